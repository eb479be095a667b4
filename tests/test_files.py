"""delta_jax.files: a file is replaced whole, and a write that fails leaves the old one."""
import json
import os

import pytest

from delta_jax import files


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_a_file_is_replaced_whole_and_no_temporary_stays(tmp_path):
    path = tmp_path / "d" / "x.jsonl"  # the directory is made
    files.write_jsonl(path, [{"a": 1}, {"b": "é"}])
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n{"b": "é"}\n'
    files.write_jsonl(path, [{"c": 2}])
    assert _read(path) == [{"c": 2}]
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.jsonl"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "x.txt"
    files.write_text(path, "old")
    with pytest.raises(TypeError):  # a row that is not JSON: nothing is written
        files.write_jsonl(path, [{"d": object()}])

    def replace_fails(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(OSError, match="disk gone"):
        files.write_text(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]


def test_unused_path_numbers_past_what_earlier_set_asides_left(tmp_path):
    stem = str(tmp_path / "config.until_step_4")
    assert files.unused_path(stem, ".json") == stem + ".json"
    (tmp_path / "config.until_step_4.json").write_text("{}")
    assert files.unused_path(stem, ".json") == stem + ".2.json"
    (tmp_path / "config.until_step_4.2.json").write_text("{}")
    assert files.unused_path(stem, ".json") == stem + ".3.json"
    (tmp_path / "unreadable-2").mkdir()  # a directory counts too, and no suffix is needed
    assert files.unused_path(str(tmp_path / "unreadable-2")) == str(tmp_path / "unreadable-2.2")
