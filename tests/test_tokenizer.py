"""Tokenizer wrapper: a small tokenizer built here (always runs) and the real Qwen3 one."""
import json

import pytest

from delta_jax import models

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory):
  """A word-level fast tokenizer with special tokens and a chat template, saved like HF does."""
  import tokenizers
  from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, decoders
  from transformers import PreTrainedTokenizerFast

  words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]", "user", "assistant", "what",
           "is", "2", "+", "?", "\n", " "]
  tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split(
      tokenizers.Regex(r"<\|[a-z_]+\|>|[a-z]+|\S|\s"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", unk_token="[UNK]",
                                 additional_special_tokens=["<|im_start|>"])
  fast.chat_template = CHAT_TEMPLATE
  path = tmp_path_factory.mktemp("tok") / "small"
  fast.save_pretrained(path)
  return path


def test_small_tokenizer_ids_and_chat_template(small_tokenizer_dir):
  tok = models.load_tokenizer(small_tokenizer_dir)
  assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and tok.bos_token_id is None
  ids = tok.encode("what is 2+2?")
  assert ids == [6, 12, 7, 12, 8, 9, 8, 10] and all(type(i) is int for i in ids)
  assert tok.decode(ids) == "what is 2+2?"
  text = tok.apply_chat_template([{"role": "user", "content": "what"}])
  assert text == "<|im_start|>user\nwhat<|im_end|>\n<|im_start|>assistant\n"
  assert tok.apply_chat_template([{"role": "user", "content": "what"}], tokenize=True) == \
      [1, 4, 11, 6, 2, 11, 1, 5, 11]
  assert tok.encode_batch(["what", "is"]) == [[6], [7]]
  assert tok.convert_tokens_to_ids("<|im_start|>") == 1  # delegated to the HF tokenizer


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    models.load_tokenizer(tmp_path)


def test_qwen3_tokenizer_math_prompt_and_chat_template(qwen3_tokenizer_dir):
  tok = models.load_tokenizer(qwen3_tokenizer_dir)
  assert tok.eos_token_id == 151645  # <|im_end|>
  assert tok.pad_token_id == 151643  # <|endoftext|>
  assert tok.vocab_size == 151669
  prompt = r"Find $x$ if $x^2 - 5x + 6 = 0$ and $x > 2$. Put the answer in \boxed{}."
  ids = tok.encode(prompt)
  assert tok.decode(ids) == prompt
  assert max(ids) < 151643  # plain text uses no special tokens
  messages = [{"role": "user", "content": prompt}]
  text = tok.apply_chat_template(messages, add_generation_prompt=True)
  assert text.startswith("<|im_start|>user\n" + prompt + "<|im_end|>\n")
  assert text.endswith("<|im_start|>assistant\n")
  no_think = tok.apply_chat_template(messages, enable_thinking=False)
  assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  chat_ids = tok.apply_chat_template(messages, tokenize=True)
  assert chat_ids[0] == tok.token_to_id("<|im_start|>") == 151644
  assert tok.eos_token_id in chat_ids
  assert tok.decode(chat_ids) == text
  assert tok.token_to_id("<think>") == 151667


def test_loading_without_pytorch_prints_no_advice(tmp_path):
  """Installed without PyTorch (the main job's install), transformers advises on import that
  PyTorch was not found; delta_jax needs only its tokenizers, so load_tokenizer imports it
  without that line (it would open every run's output), and leaves the environment as it was."""
  import subprocess
  import sys

  from delta_jax.data import tiny_tokenizer
  tok_dir = tiny_tokenizer.build_tiny_tokenizer(str(tmp_path / "tok"))
  code = ("import os, sys\n"
          "sys.modules['torch'] = None  # as if PyTorch were not installed\n"
          "from delta_jax import models\n"
          f"tok = models.load_tokenizer({tok_dir!r})\n"
          "import transformers.utils.import_utils as iu\n"
          "assert not iu.is_torch_available()\n"
          "assert 'TRANSFORMERS_NO_ADVISORY_WARNINGS' not in os.environ\n"
          "print(tok.decode(tok.encode('1 + 2')))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "1 + 2"
  assert "PyTorch" not in out.stderr, out.stderr[-2000:]
