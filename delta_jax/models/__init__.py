"""Qwen3 / Llama-family decoder-only transformers in flax.nnx, HF checkpoint I/O, tokenizer.

    cfg = models.get_preset("tiny")                 # or models.ModelConfig(...)
    model = models.Transformer(cfg, rngs=nnx.Rngs(0))
    model = models.from_pretrained(path, dtype=jnp.bfloat16)
    cfg = models.pretrained_config(path)            # its config, weights checked, none read
    out = model(input_ids, attention_mask=mask)     # ModelOutput(logits, hidden, cache)
    logp, ent = models.token_logprobs(model, out.hidden, labels, temperature=1.0)
    models.save_pretrained(model, path)             # LoRA adapters merged into the weights
    models.save_peft_adapter(model, path)           # or the adapters alone, in PEFT's format
    model.add_lora(rank=16)                         # low-rank adapters (model.lora_rank)
    tok = models.load_tokenizer(path)
"""
from delta_jax.models.cache import PagedKVCache, init_paged_cache, page_bytes
from delta_jax.models.config import (LORA_TARGETS, PRESETS, REMAT_POLICIES, ModelConfig,
                                     get_preset)
from delta_jax.models.hf_io import (CheckpointError, UnsupportedModelError, config_from_hf,
                                    from_pretrained, hf_config_dict, pretrained_config,
                                    read_config_json, save_peft_adapter, save_pretrained)
from delta_jax.models.logprobs import logprobs_from_logits, map_sequence_chunks, token_logprobs
from delta_jax.models.tokenizer import Tokenizer, load_tokenizer
from delta_jax.models.transformer import (LAYER_AXES, LoRAParam, ModelOutput, Transformer,
                                          init_lora_arrays)

__all__ = [
    "CheckpointError", "LAYER_AXES", "LORA_TARGETS", "LoRAParam",
    "ModelConfig", "ModelOutput",
    "PRESETS", "PagedKVCache", "REMAT_POLICIES", "Tokenizer", "Transformer",
    "UnsupportedModelError", "config_from_hf", "from_pretrained", "get_preset", "hf_config_dict",
    "init_lora_arrays", "init_paged_cache", "load_tokenizer", "logprobs_from_logits",
    "map_sequence_chunks", "page_bytes", "pretrained_config", "read_config_json",
    "save_peft_adapter", "save_pretrained", "token_logprobs",
]
