"""Files written whole: a temporary file beside the target, then os.replace, so a reader (another
process of a multi-host run, a resumed run, a user's `tail`) never sees one half-written, and a
process killed while writing leaves the old file (or none), not a torn one.

    write_text(path, text)          # any text file
    write_jsonl(path, rows)         # one JSON object a line
    unused_path(stem, suffix)       # a name to keep an old file or directory under
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Mapping


def write_text(path: str | os.PathLike, text: str) -> str:
    """Writes `text` to `path` (its directory created), replacing any file there at once."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping]) -> str:
    """Writes `rows` to `path` as JSON Lines (UTF-8, non-ASCII kept), replacing it at once."""
    return write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def unused_path(stem: str, suffix: str = "") -> str:
    """`stem + suffix`, or where that exists the first of `stem.2 + suffix`, `stem.3 + suffix`,
    ... that does not: a name to set something aside under without replacing what an earlier
    set-aside left (config.until_step_4.json, config.until_step_4.2.json, ...)."""
    path, k = stem + suffix, 1
    while os.path.exists(path):
        k += 1
        path = f"{stem}.{k}{suffix}"
    return path
