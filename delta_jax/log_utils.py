"""Logging helpers shared by the modules that drive absl-logging libraries (orbax, tfds)."""
from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def absl_warning_held_back(prefix: str):
    """Inside: the absl log records whose message starts with `prefix` are not shown; every other
    record is. For a library warning that states what the caller meant to do (orbax: its type
    handler replaced; tfds: a custom builder config), so that it does not fill every run's
    console."""
    absl_log = logging.getLogger("absl")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefix)

    absl_log.addFilter(keep)
    try:
        yield
    finally:
        absl_log.removeFilter(keep)
