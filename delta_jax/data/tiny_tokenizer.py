"""A tiny byte-level BPE tokenizer for the synthetic task, saved as a Hugging Face tokenizer dir.

* Byte-level (GPT-2 style) so any text round-trips losslessly; BPE merges trained on the
  synthetic corpus make its words single tokens; vocabulary < 512.
* Digits are never merged with each other: a pre-tokenizer isolates every digit (with at most
  the one space before it), so "125" is always "1" "2" "5" and arithmetic stays learnable.
* Special tokens: <|endoftext|> = 0 (pad), <|im_end|> = 1 (eos), <|im_start|> = 2.
* A minimal ChatML chat template in tokenizer_config.json (the Qwen3 turn format without tools or
  thinking), so prompts look like the real models' prompts.

The directory (tokenizer.json, tokenizer_config.json, special_tokens_map.json) loads with
transformers.AutoTokenizer.from_pretrained(dir).

    python -m delta_jax.data.tiny_tokenizer --out_dir /tmp/tiny_tok
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from delta_jax.data import synthetic, templates

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
IM_START_TOKEN = "<|im_start|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN)  # ids 0, 1, 2
DEFAULT_VOCAB_SIZE = 448

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_corpus(num_problems: int = 4000, seed: int = 0) -> list[str]:
    """Synthetic problems and solutions of every level, the vocabulary, and prompt scaffolding."""
    stream = synthetic.iter_problems(seed)
    texts = []
    for _ in range(num_problems):
        rec = next(stream)
        texts += [rec["problem"], rec["solution"]]
    texts.append(" ".join(synthetic.VOCABULARY))
    texts += ["system", "user", "assistant", templates.BOXED_INSTRUCTION]
    texts += [templates.PromptTemplate(kind=k)("What is 1 + 2?") for k in ("qwen_math", "base", "plain")]
    return texts


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE on `texts` (see the module docstring for the design)."""
    if vocab_size >= 512:
        raise ValueError(f"vocab_size must stay below 512 for the tiny model, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?[0-9]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str, model_max_length: int = 2048) -> str:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir.
    model_max_length: the "tiny" preset's max_position_embeddings (transformers warns about any
    text encoded longer than it)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START_TOKEN],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    special_map = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START_TOKEN]}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special_map, f, indent=2)
    return out_dir


def build_tiny_tokenizer(
    out_dir: str, texts: Sequence[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> str:
    """Train on `texts` (default: default_corpus()) and save an HF tokenizer dir; returns out_dir.
    The default corpus's tokenizer is the same every time: it is trained once a process."""
    tok = (Tokenizer.from_str(_default_tokenizer_json(vocab_size)) if texts is None
           else train_tokenizer(texts, vocab_size))
    return save_tokenizer(tok, out_dir)


@functools.lru_cache(maxsize=4)
def _default_tokenizer_json(vocab_size: int) -> str:
    """The tokenizer trained on default_corpus(), serialized (a fresh Tokenizer per caller)."""
    return train_tokenizer(default_corpus(), vocab_size).to_str()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    print(build_tiny_tokenizer(args.out_dir, vocab_size=args.vocab_size))


if __name__ == "__main__":
    main()
