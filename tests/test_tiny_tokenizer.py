"""data/tiny_tokenizer.py: the default corpus's tokenizer, trained once a process, is what a fresh
training of it saves (its other properties are tested with the task, in test_synthetic.py)."""
import filecmp
import os

from delta_jax.data import tiny_tokenizer


def test_a_second_build_saves_what_a_fresh_training_does(tmp_path):
  fresh = tiny_tokenizer.save_tokenizer(
      tiny_tokenizer.train_tokenizer(tiny_tokenizer.default_corpus()), str(tmp_path / "fresh"))
  first = tiny_tokenizer.build_tiny_tokenizer(str(tmp_path / "first"))
  second = tiny_tokenizer.build_tiny_tokenizer(str(tmp_path / "second"))
  names = sorted(os.listdir(fresh))
  assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
  for built in (first, second):
    assert sorted(os.listdir(built)) == names
    match, mismatch, errors = filecmp.cmpfiles(fresh, built, names, shallow=False)
    assert (mismatch, errors) == ([], []), built
  # texts of one's own are trained on, not answered from the default's cache
  own = tiny_tokenizer.build_tiny_tokenizer(str(tmp_path / "own"), texts=["zebra quagga"] * 50,
                                            vocab_size=300)
  assert not filecmp.cmp(os.path.join(own, "tokenizer.json"),
                         os.path.join(fresh, "tokenizer.json"), shallow=False)
