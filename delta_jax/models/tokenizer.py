"""Tokenizer wrapper over a Hugging Face tokenizer directory (tokenizer.json + config).

Loaded through transformers.AutoTokenizer with trust_remote_code=False, so only the fast
(Rust `tokenizers`) implementation and the Jinja chat template stored in the directory run.
"""
from __future__ import annotations

import os
import pathlib
from typing import Optional, Sequence

from delta_jax.errors import InputError, MissingInputError


class Tokenizer:
  """encode/decode/apply_chat_template with ids as plain Python ints.

  eos_token_id: the end-of-turn/sequence token from the tokenizer config (Qwen3: <|im_end|>).
  pad_token_id: the configured pad token, or eos_token_id when none is configured.
  """

  def __init__(self, hf_tokenizer):
    self.hf = hf_tokenizer
    if hf_tokenizer.eos_token_id is None:
      raise InputError("tokenizer has no eos_token configured (tokenizer_config.json)")
    self.eos_token_id: int = int(hf_tokenizer.eos_token_id)
    pad = hf_tokenizer.pad_token_id
    self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_id
    bos = hf_tokenizer.bos_token_id
    self.bos_token_id: Optional[int] = int(bos) if bos is not None else None

  @property
  def vocab_size(self) -> int:
    """Number of token ids in use (base vocabulary + added tokens)."""
    return len(self.hf)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    enc = self.hf(list(texts), add_special_tokens=add_special_tokens)
    return [list(ids) for ids in enc["input_ids"]]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> Optional[int]:
    tid = self.hf.convert_tokens_to_ids(token)
    return None if tid is None or tid == self.hf.unk_token_id else int(tid)

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                          tokenize: bool = False, enable_thinking: Optional[bool] = None,
                          **template_kwargs):
    """Render messages [{"role", "content"}, ...] with the directory's chat template.

    Returns the prompt string, or its token ids when tokenize=True. enable_thinking is passed
    to templates that read it (Qwen3) when given.
    """
    if getattr(self.hf, "chat_template", None) is None:
      raise InputError("tokenizer has no chat_template (tokenizer_config.json / "
                       "chat_template.jinja)")
    if enable_thinking is not None:
      template_kwargs["enable_thinking"] = enable_thinking
    text = self.hf.apply_chat_template(list(messages), tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       **template_kwargs)
    return self.encode(text) if tokenize else text

  def __len__(self) -> int:
    return self.vocab_size

  def __getattr__(self, name):
    # Anything not wrapped here (convert_tokens_to_ids, save_pretrained, ...) is the HF
    # tokenizer's own attribute.
    if name == "hf":
      raise AttributeError(name)
    return getattr(self.hf, name)


def _auto_tokenizer():
  """transformers.AutoTokenizer, imported without transformers' advice that PyTorch is missing:
  delta_jax uses its tokenizers only, which need no PyTorch, and the advice would open the
  output of every run installed without it (a config error's one-line message included)."""
  key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
  saved = os.environ.get(key)
  os.environ[key] = "1"
  try:
    from transformers import AutoTokenizer  # heavy import, only when needed
  finally:
    if saved is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = saved
  return AutoTokenizer


def load_tokenizer(path) -> Tokenizer:
  """Tokenizer from a local HF directory (or a hub id, resolved by transformers)."""
  AutoTokenizer = _auto_tokenizer()

  local = pathlib.Path(path)
  if local.exists():
    if not local.is_dir():
      raise MissingInputError(f"{local}: expected a tokenizer directory, found a file")
    if not (local / "tokenizer.json").is_file():
      raise MissingInputError(f"{local}: no tokenizer.json (a fast tokenizer is required)")
    hf = AutoTokenizer.from_pretrained(str(local), trust_remote_code=False,
                                       local_files_only=True)
  else:
    from delta_jax.data.records import looks_like_hub_name
    if not looks_like_hub_name(str(path)):
      raise MissingInputError(f"{path}: no such tokenizer directory (and not an org/name hub id)")
    hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
  return Tokenizer(hf)
