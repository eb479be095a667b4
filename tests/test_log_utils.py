"""delta_jax.log_utils: inside the context only the absl records with the given prefix are held
back; everything else still shows, and nothing is held back after it (also after an error)."""
import logging

import absl.logging
import pytest

from delta_jax.log_utils import absl_warning_held_back


def test_holds_back_only_the_prefixed_absl_records_inside(caplog):
    with caplog.at_level(logging.WARNING):
        with absl_warning_held_back("Using custom"):
            absl.logging.warning("Using custom data configuration: x")
            absl.logging.warning("another warning inside")
            absl.logging.error("an error inside")
        absl.logging.warning("Using custom data configuration: after")
        with pytest.raises(RuntimeError):
            with absl_warning_held_back("Using custom"):
                raise RuntimeError("boom")
        absl.logging.warning("Using custom data configuration: after an error")
    messages = [r.getMessage() for r in caplog.records if r.name == "absl"]
    assert messages == ["another warning inside", "an error inside",
                        "Using custom data configuration: after",
                        "Using custom data configuration: after an error"]
