"""delta_jax.errors: the input errors main prints as one line, and `naming`, which says which
config field an input came from; then the errors a run raises for bad inputs, in the order the
run meets them (before any weight is read or step is taken)."""
import pytest

from delta_jax import errors, main as main_lib
from delta_jax.train.config import validate_config
from tests.rl_fixtures import tiny_rl_config


def test_input_errors_keep_the_builtin_types():
    missing = errors.MissingInputError("x.jsonl: no such file")
    assert isinstance(missing, FileNotFoundError) and isinstance(missing, ValueError)
    assert isinstance(missing, errors.InputError) and str(missing) == "x.jsonl: no such file"


def test_naming_prefixes_the_field_once():
    with pytest.raises(errors.MissingInputError, match=r"^data\.train: train\.jsonl: no such"):
        with errors.naming("data.train"):
            raise errors.MissingInputError("train.jsonl: no such file")  # a file, not a field
    # A message that already starts with a config field keeps it.
    with pytest.raises(errors.InputError, match=r"^data\.fields: unknown preset"):
        with errors.naming("data.train"):
            raise errors.InputError("data.fields: unknown preset 'x'")
    with pytest.raises(errors.InputError, match=r"^data\.train: x$"):  # the innermost field
        with errors.naming("data.eval"):
            with errors.naming("data.train"):
                with errors.naming("data.train"):
                    raise errors.InputError("x")
    with pytest.raises(KeyError, match="^'x'$"):  # not an input error: untouched
        with errors.naming("data.train"):
            raise KeyError("x")


@pytest.fixture
def good_files(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"problem": "1 + 1?", "answer": "2"}\n')
    (tmp_path / "eval.jsonl").write_text('{"problem": "2 + 2?", "answer": "4"}\n')
    return tmp_path


def _run(tmp_path, **sections):
    cfg = validate_config(tiny_rl_config(**sections))
    with pytest.raises(errors.InputError) as info:
        main_lib.run(cfg, str(tmp_path / "w"))
    return str(info.value)


def test_bad_inputs_stop_the_run_naming_field_and_file(good_files):
    train, bench = str(good_files / "train.jsonl"), str(good_files / "eval.jsonl")
    (good_files / "no_answer.jsonl").write_text('{"problem": "3 + 3?"}\n')
    missing = str(good_files / "missing.jsonl")
    # The data comes before the model: a missing data.train is reported, not the missing weights.
    text = _run(good_files, data=dict(train=missing, eval=bench),
                model=dict(random_init=False, path=str(good_files / "no_model")))
    assert text == f"data.train: {missing}: no such file, directory or glob"
    # data.eval is read at start-up, not at the first evaluation (maybe hours later).
    text = _run(good_files, data=dict(train=train, eval=f"{bench},{good_files}/no_answer.jsonl"),
                train=dict(eval_before=False, eval_every=1000))
    assert text.startswith(f"data.eval: {good_files}/no_answer.jsonl:line 1: row has no 'answer'")
    text = _run(good_files, data=dict(train=train), tokenizer=dict(path=str(good_files / "tok")))
    assert text == (f"tokenizer.path: {good_files}/tok: no such tokenizer directory (and not an "
                    "org/name hub id)")
    text = _run(good_files, data=dict(train=train, eval=""), tokenizer=dict(path=""),
                model=dict(random_init=False, path=str(good_files)))
    assert text.startswith(f"model.path: {good_files}: no tokenizer.json")
