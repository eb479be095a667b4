"""delta_jax.log_utils: absl warnings are held back inside the context only; errors still show."""
import logging

import absl.logging
import pytest

from delta_jax.log_utils import absl_warnings_held_back


def test_holds_back_absl_warnings_inside_only(caplog):
    absl_log = logging.getLogger("absl")
    before = absl_log.level
    with caplog.at_level(logging.INFO):
        absl_log.setLevel(logging.INFO)
        with absl_warnings_held_back():
            absl.logging.info("info inside")
            absl.logging.warning("warning inside")
            absl.logging.error("error inside")
        absl.logging.warning("warning after")
        with pytest.raises(RuntimeError):
            with absl_warnings_held_back():
                raise RuntimeError("boom")
        level_after_raise = absl_log.level
        absl_log.setLevel(before)
    messages = [r.getMessage() for r in caplog.records if r.name == "absl"]
    assert messages == ["error inside", "warning after"]
    assert level_after_raise == logging.INFO
