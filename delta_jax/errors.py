"""Errors in the user's input: a missing or malformed data, benchmark, tokenizer or checkpoint
file, data that does not fit the config, or a config this host cannot run (rewards.py's
IsolationUnavailable: no user namespaces for the code sandbox). Their messages name the file,
row and config field; `delta_jax.main` prints them as one line (exit code 1) instead of a
traceback, like the config's own errors (train/config.ConfigError, exit code 2).

Both classes keep the built-in types callers catch: an InputError is a ValueError, a
MissingInputError also a FileNotFoundError.

RunHalted is the run's own: training cannot go on as configured (a dynamic-sampling batch that
cannot be filled, too many non-finite updates); the loop saved a checkpoint of the last finished
step first, and the message names the config fields that decide it. `delta_jax.main` prints it as
one line (exit code 1). Every process of a multi-host run reaches it at the same step (the
rewards and the loss it follows are global).
"""
from __future__ import annotations

import contextlib


class InputError(ValueError):
    """Input the user can fix; the message says which file / row / field and what is wrong."""


class MissingInputError(InputError, FileNotFoundError):
    """A data, benchmark, tokenizer or checkpoint path that names nothing usable."""


class RunHalted(RuntimeError):
    """Training stopped because it cannot go on as configured; a checkpoint of the last finished
    step is saved, and the message says which fields to change and how to resume."""


def first_line(e: BaseException, limit: int = 400) -> str:
    """"Type: first line of the message" of an exception, at most `limit` characters: the cause
    of a library's failure, quoted in one of our one-line messages."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:limit]


@contextlib.contextmanager
def naming(field: str):
    """Prefixes "field: " to the message of an InputError raised inside, so a message that names
    only a file (e.g. "x.jsonl: no such file") also says which config field gave it; a message
    that already starts with a config field is kept as it is."""
    try:
        yield
    except InputError as e:
        from delta_jax.train.config import field_names
        text = str(e)
        if text.split(": ", 1)[0] not in field_names():
            e.args = (f"{field}: {text}",)
        raise
