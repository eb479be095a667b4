"""Logging helpers shared by the modules that drive absl-logging libraries (orbax, tfds)."""
from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def absl_warnings_held_back():
    """Inside: warnings (and infos) that libraries log through absl are not shown; errors are.
    For library calls whose warning states what the caller meant to do (orbax: a type handler
    replaced; tfds: a custom builder config), so that it does not fill every run's console.
    The absl logger's level is restored on exit."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_log.setLevel(level)
