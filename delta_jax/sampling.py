"""Rollout engine: jitted prefill + a lax.while_loop decode over a KV cache.

    sampler = Sampler(model, tokenizer=None, max_batch_size=256)
    out = sampler.generate(prompt_ids, n=1, temperature=0.0, top_p=1.0, top_k=-1,
                           max_new_tokens=32, stop_token_ids=(eos_id,), seed=0)
    out.response_ids[i][j]   # list[int], prompt i, sample j (the stop token included)
    out.logprobs[i][j]       # list[float], log-probs under the sampling distribution
    batch = out.padded()     # dict of [num_prompts * n, L] arrays for teacher forcing

How a call runs:
* Prompts are sorted by length and cut into chunks of at most `max_batch_size` sequences
  (prompts x samples); each chunk is padded to bucketed static shapes (powers of two for the
  prompt batch, the prompt length and the response length), so a run compiles a handful of
  programs rather than one per batch.
* Prefill runs the B left-padded prompts once, then repeats their cache n times along the batch
  (the n samples of a prompt share its prefill) into a cache with room for the response.
* Decode is one jitted lax.while_loop that samples, writes one token per sequence per step and
  stops as soon as every sequence has emitted a stop token or max_new_tokens is reached. The
  prefill's cache is donated to it.
* Parameters are an argument of the jitted functions (the nnx state), so `update_params` or
  `generate(..., state=...)` swaps weights without recompiling.
* Randomness is per sample: sample j of prompt i draws from fold_in(fold_in(key(seed), i), j),
  folded with the step, so results do not depend on chunking, bucketing or the mesh.
* Multi-host: with a mesh spanning processes, every process calls generate with the same prompts
  and arguments; the decoded outputs are all-gathered (`fetch_global`), so every process returns
  the same full GenerationOutput.

See delta_jax/sampling_utils.py for the exact temperature / top-k / top-p / greedy definitions.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.sampling_utils import SamplingParams, sample_tokens

DEFAULT_BATCH_AXES = tuple(sharding_lib.DEFAULT_RULES["batch"])  # ("data", "fsdp")


# --------------------------------------------------------------------------------------------
# Shapes and buckets


def bucket_size(n: int, minimum: int = 1, multiple_of: int = 1) -> int:
    """The next power of two >= max(n, minimum), rounded up to a multiple of `multiple_of`."""
    size = 1 << max(0, math.ceil(math.log2(max(n, minimum, 1))))
    return -(-size // multiple_of) * multiple_of


def fetch_global(tree):
    """Host numpy copies of the global values of a pytree of arrays.

    On one process this is jax.device_get. When a mesh spans processes, an output sharded over it
    is not fully addressable (each process holds only its own devices' shards) and
    jax.device_get fails; those arrays are all-gathered across processes
    (multihost_utils.process_allgather), so every process gets the whole value. Every process
    must call this with the same arrays (it is a collective then).
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
    """Ragged prompts -> (ids int32 [B, length], mask int32 [B, length]), right-aligned."""
    ids = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, length - len(prompt):] = prompt
            mask[row, length - len(prompt):] = 1
    return ids, mask


# --------------------------------------------------------------------------------------------
# Output


@dataclasses.dataclass
class GenerationOutput:
    """Per-sample results; lists are indexed [prompt i][sample j].

    prompt_ids[i]: list[int], the prompt as generated from (after any left truncation).
    response_ids[i][j]: list[int], the stop token included when one was generated.
    logprobs[i][j]: list[float], log-probs of response_ids under the sampling distribution (the
      tempered, top-k / top-p filtered, renormalised one). Greedy: under softmax(z), T = 1.
    tempered_logprobs[i][j]: list[float], under softmax(z / T) without filtering (what the RL
      old-policy pass recomputes). Equal to logprobs when nothing is filtered.
    response_lengths[i][j]: int. truncated[i][j]: True when max_new_tokens was reached without a
      stop token. texts[i][j]: decoded responses (stop token dropped) when a tokenizer was given.
    stats: a few counters of the run (chunks, decode steps, generated tokens, seconds).
    """

    prompt_ids: list
    response_ids: list
    logprobs: list
    tempered_logprobs: list
    response_lengths: list
    truncated: list
    texts: Optional[list] = None
    stats: dict = dataclasses.field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_ids)

    @property
    def n(self) -> int:
        return len(self.response_ids[0]) if self.response_ids else 0

    def padded(self, pad_id: int = 0, prompt_len: Optional[int] = None,
               response_len: Optional[int] = None) -> dict[str, np.ndarray]:
        """One row per sample (row = i * n + j): prompt left-padded, response right after it.

        prompt_len / response_len: pad to at least these (default: the longest in the output).
        With P = prompt_len, R = response_len, L = P + R, returns
          input_ids int32 [B*n, L]; attention_mask int32 [B*n, L] (prompt + response tokens);
          response_mask int32 [B*n, L] (response tokens only); positions int32 [B*n, L]
          (cumsum(attention_mask) - 1, clipped at 0: the positions the sampler used);
          logprobs, tempered_logprobs float32 [B*n, L]: at column t the log-prob of
          input_ids[:, t] given the columns before it (0 outside the response), so the model's
          output at column t - 1 is the one to teacher-force against;
          prompt_index, sample_index, prompt_lengths, response_lengths int32 [B*n];
          truncated bool [B*n]; prompt_len, response_len: the P and R used (ints).
        """
        rows = [(i, j) for i in range(self.num_prompts) for j in range(self.n)]
        max_prompt = max((len(p) for p in self.prompt_ids), default=0)
        max_resp = max((len(self.response_ids[i][j]) for i, j in rows), default=0)
        P = max_prompt if prompt_len is None else int(prompt_len)
        R = max_resp if response_len is None else int(response_len)
        if P < max_prompt:
            raise ValueError(f"padded: prompt_len={P} < longest prompt ({max_prompt})")
        if R < max_resp:
            raise ValueError(f"padded: response_len={R} < longest response ({max_resp})")
        num, L = len(rows), P + R
        out = {
            "input_ids": np.full((num, L), pad_id, np.int32),
            "attention_mask": np.zeros((num, L), np.int32),
            "response_mask": np.zeros((num, L), np.int32),
            "logprobs": np.zeros((num, L), np.float32),
            "tempered_logprobs": np.zeros((num, L), np.float32),
            "prompt_index": np.asarray([i for i, _ in rows], np.int32).reshape(num),
            "sample_index": np.asarray([j for _, j in rows], np.int32).reshape(num),
            "prompt_lengths": np.zeros(num, np.int32),
            "response_lengths": np.zeros(num, np.int32),
            "truncated": np.zeros(num, bool),
        }
        for r, (i, j) in enumerate(rows):
            prompt, resp = self.prompt_ids[i], self.response_ids[i][j]
            out["input_ids"][r, P - len(prompt):P] = prompt
            out["input_ids"][r, P:P + len(resp)] = resp
            out["attention_mask"][r, P - len(prompt):P + len(resp)] = 1
            out["response_mask"][r, P:P + len(resp)] = 1
            out["logprobs"][r, P:P + len(resp)] = self.logprobs[i][j]
            out["tempered_logprobs"][r, P:P + len(resp)] = self.tempered_logprobs[i][j]
            out["prompt_lengths"][r] = len(prompt)
            out["response_lengths"][r] = len(resp)
            out["truncated"][r] = self.truncated[i][j]
        out["positions"] = np.maximum(np.cumsum(out["attention_mask"], axis=1) - 1, 0).astype(
            np.int32)
        out["prompt_len"], out["response_len"] = P, R
        return out


# --------------------------------------------------------------------------------------------
# Jitted programs


@functools.partial(jax.jit, static_argnames=("graphdef", "num_copies", "response_slots",
                                             "batch_spec"))
def _prefill(graphdef, state, prompt_ids, prompt_mask, *, num_copies, response_slots,
             batch_spec=None):
    """Prefill B left-padded prompts once and share the result with their samples.

    prompt_ids, prompt_mask: int32 [B, P]. Returns, for N = B * num_copies rows (row b * n + c
    is copy c of prompt b):
      cache: KVCache with S = P + response_slots slots (prompt in slots [0, P));
      logits: float32 [N, V] for the first response token; kv_mask: bool [N, S];
      next_position: int32 [N], the position of the first response token (= prompt length).
    """
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    batch, prompt_slots = prompt_ids.shape
    cache = models.init_cache(cfg, batch, prompt_slots)
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    kv_mask = prompt_mask.astype(bool)
    out = model(prompt_ids, positions=positions, cache=cache, cache_index=0, kv_mask=kv_mask,
                return_logits=False)
    logits = model.logits(out.hidden[:, -1:])[:, 0]  # prompts are right-aligned

    mesh, batch_axes = batch_spec or (None, None)

    def share(x, axis):  # repeat each prompt's row num_copies times along the batch axis
        # Dim `axis` over the batch mesh axes, the others left to the compiler.
        return sharding_lib.constrain_batch(jnp.repeat(x, num_copies, axis=axis), mesh,
                                            axis=axis, batch_axes=batch_axes,
                                            others=PartitionSpec.UNCONSTRAINED)

    def grow(x):  # [layers, N, P, ...] -> [layers, N, P + response_slots, ...]
        pad = [(0, 0)] * x.ndim
        pad[2] = (0, response_slots)
        return jnp.pad(share(x, 1), pad)

    cache = models.KVCache(k=grow(out.cache.k), v=grow(out.cache.v))
    kv_mask = jnp.pad(share(kv_mask, 0), ((0, 0), (0, response_slots)))
    next_position = share(prompt_mask.sum(axis=1).astype(jnp.int32), 0)
    return cache, share(logits, 0), kv_mask, next_position


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "use_top_p", "greedy",
                                             "response_slots", "batch_spec"),
                   donate_argnames=("cache",))
def _decode(graphdef, state, cache, logits, kv_mask, next_position, active, prompt_index,
            sample_index, seed, stop_ids, temperature, top_p, max_new_tokens, pad_id, *, top_k,
            use_top_p, greedy, response_slots, batch_spec=None):
    """Sample up to max_new_tokens tokens per row; stop early when every row has stopped.

    cache, logits [N, V], kv_mask [N, S], next_position [N]: from _prefill.
    active: bool [N], False for padding rows. prompt_index, sample_index: int32 [N] (the random
    stream of each row). seed: uint32 scalar. stop_ids: int32 [num_stop] (-1 = unused).
    temperature, top_p, max_new_tokens, pad_id: scalars (traced: no recompile when they change).
    Returns tokens int32 [N, R], logprobs, tempered_logprobs float32 [N, R], lengths int32 [N],
    stopped bool [N], num_steps int32, and the final cache (returned so its donated buffer is
    reused; callers drop it). R = response_slots.
    """
    model = nnx.merge(graphdef, state)
    num_rows = logits.shape[0]
    prompt_slots = cache.max_len - response_slots
    base_key = jax.random.key(seed)
    row_keys = jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(base_key, i), j))(
        prompt_index, sample_index)

    def sample_step(step, logits, buffers, done, lengths):
        tokens_buf, logp_buf, tlogp_buf, stopped = buffers
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
        token, logp, tlogp = sample_tokens(keys, logits, temperature, top_p, top_k=top_k,
                                           use_top_p=use_top_p, greedy=greedy)
        token = jnp.where(done, pad_id, token)
        zero = jnp.zeros_like(logp)
        tokens_buf = tokens_buf.at[:, step].set(token)
        logp_buf = logp_buf.at[:, step].set(jnp.where(done, zero, logp))
        tlogp_buf = tlogp_buf.at[:, step].set(jnp.where(done, zero, tlogp))
        lengths = lengths + (~done).astype(jnp.int32)
        hit_stop = (~done) & jnp.any(token[:, None] == stop_ids[None, :], axis=1)
        stopped = stopped | hit_stop
        return token, (tokens_buf, logp_buf, tlogp_buf, stopped), done | hit_stop, lengths

    mesh, batch_axes = batch_spec or (None, None)

    def fresh(dtype):
        return sharding_lib.constrain_batch(jnp.zeros((num_rows, response_slots), dtype), mesh,
                                            batch_axes=batch_axes,
                                            others=PartitionSpec.UNCONSTRAINED)

    buffers = (fresh(jnp.int32), fresh(jnp.float32), fresh(jnp.float32),
               jnp.zeros((num_rows,), bool))
    done = ~active
    token, buffers, done, lengths = sample_step(
        0, logits, buffers, done, jnp.zeros((num_rows,), jnp.int32))

    def cond(carry):
        step, _, _, _, _, done, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, kv_mask, token, buffers, done, lengths, position = carry
        slot = prompt_slots + step - 1  # the slot of the token sampled at step - 1
        kv_mask = kv_mask.at[:, slot].set(True)
        out = model(token[:, None], positions=position[:, None], cache=cache, cache_index=slot,
                    kv_mask=kv_mask, return_logits=True)
        token, buffers, done, lengths = sample_step(step, out.logits[:, 0], buffers, done,
                                                    lengths)
        return step + 1, out.cache, kv_mask, token, buffers, done, lengths, position + 1

    carry = (jnp.int32(1), cache, kv_mask, token, buffers, done, lengths, next_position)
    num_steps, cache, _, _, buffers, _, lengths, _ = jax.lax.while_loop(cond, body, carry)
    tokens_buf, logp_buf, tlogp_buf, stopped = buffers
    return tokens_buf, logp_buf, tlogp_buf, lengths, stopped, num_steps, cache


# --------------------------------------------------------------------------------------------
# The sampler


class Sampler:
    """Batched, bucketed, jitted generation for a delta_jax.models.Transformer.

    model: the nnx Transformer (its parameters are captured now; swap with update_params).
    tokenizer: optional; lets generate() take strings and return texts (needs encode/decode).
    max_batch_size: most sequences (prompts x samples) decoded at once; bounds memory.
    max_prompt_len: longest accepted prompt (default: max_position_embeddings - max_new_tokens).
    truncate_prompts: "error" (default) raises on longer prompts; "left" keeps their last tokens.
    mesh / batch_axes: optional jax Mesh; the batch is sharded over the mesh axes among
      batch_axes (default ("data", "fsdp")). Parameters keep whatever sharding they have.
    min_prompt_bucket / min_response_bucket: smallest bucketed prompt / response lengths.
    pad_id: the token used for padding (never attended to; default 0).
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int = 256,
                 max_prompt_len: Optional[int] = None, truncate_prompts: str = "error",
                 mesh: Optional[jax.sharding.Mesh] = None,
                 batch_axes: Sequence[str] = DEFAULT_BATCH_AXES, min_prompt_bucket: int = 16,
                 min_response_bucket: int = 16, pad_id: int = 0):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if truncate_prompts not in ("error", "left"):
            raise ValueError(f"truncate_prompts must be 'error' or 'left', got {truncate_prompts!r}")
        if max_prompt_len is not None and (not isinstance(max_prompt_len, int)
                                           or max_prompt_len < 1):
            raise ValueError(f"max_prompt_len must be an int >= 1, got {max_prompt_len!r}")
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prompt_len = max_prompt_len
        self.truncate_prompts = truncate_prompts
        self.min_prompt_bucket = min_prompt_bucket
        self.min_response_bucket = min_response_bucket
        self.pad_id = int(pad_id)
        self.mesh = mesh
        axes = tuple(a for a in batch_axes if mesh is not None and a in mesh.axis_names)
        self._batch_axes = axes
        self._batch_spec = (mesh, axes) if axes else None  # static argument of the jitted code
        self._batch_shards = math.prod(mesh.shape[a] for a in axes) if axes else 1

    # ---------------------------------------------------------------------------------------
    def update_params(self, model_or_state) -> None:
        """Use new parameters from an nnx model or its state (same structure: no recompile)."""
        if isinstance(model_or_state, nnx.Module):
            graphdef, state = nnx.split(model_or_state)
            if graphdef != self.graphdef:
                raise ValueError("update_params: the model's structure differs from the sampler's")
            self.state = state
        else:
            self.state = model_or_state

    # ---------------------------------------------------------------------------------------
    def _put(self, x):
        """Place a host array on the device(s): rows over the sampler's batch axes with a mesh
        (every process of a multi-host mesh holds the same host value)."""
        return sharding_lib.put_rows(x, self.mesh, batch_axes=self._batch_axes)

    def _prepare_prompts(self, prompts, max_new_tokens: int) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of prompts (lists of token ids or strings)")
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        limit = self.max_prompt_len
        if limit is None:
            limit = self.cfg.max_position_embeddings - max_new_tokens
            if limit < 1:
                raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt "
                                 f"(max_position_embeddings={self.cfg.max_position_embeddings})")
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is a string but the Sampler has no tokenizer")
                prompt = self.tokenizer.encode(prompt)
            prompt = [int(t) for t in np.asarray(prompt).reshape(-1)] if len(prompt) else []
            if not prompt:
                raise ValueError(f"prompts[{i}] is empty")
            bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {self.cfg.vocab_size}): "
                                 f"{bad[:5]}")
            if len(prompt) > limit:
                if self.truncate_prompts == "error":
                    raise ValueError(f"prompts[{i}] has {len(prompt)} tokens, more than the limit "
                                     f"max_prompt_len={limit} (use truncate_prompts='left')")
                prompt = prompt[-limit:]
            out.append(prompt)
        return out

    # ---------------------------------------------------------------------------------------
    def generate(self, prompts, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = -1, max_new_tokens: int = 32,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                 state: Any = None) -> GenerationOutput:
        """Generate n samples for each prompt.

        prompts: list of prompts, each a list of token ids (ragged) or a string (needs a
          tokenizer). n: samples per prompt (>= 1). temperature (0 = greedy), top_p, top_k: see
          delta_jax.sampling_utils. max_new_tokens: response length limit (>= 1).
        stop_token_ids: generation of a sample stops after it emits one of these (kept in the
          response). Default: the tokenizer's eos_token_id when there is a tokenizer, else none.
        seed: int; results are reproducible for a given seed whatever the batching.
        state: optional nnx state to use instead of the sampler's current parameters.
        """
        start_time = time.perf_counter()
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        params = SamplingParams(temperature, top_p, top_k)
        stop_ids = self._stop_ids(stop_token_ids)
        prompt_ids = self._prepare_prompts(prompts, max_new_tokens)
        state = self.state if state is None else state

        num_prompts = len(prompt_ids)
        # Copies per prefilled prompt: all n samples when they fit in a batch, else n is split
        # into equal passes so no pass wastes more than one batch of rows.
        passes = -(-n // self.max_batch_size)
        copies = -(-n // passes)
        prompts_per_chunk = 1 << int(math.floor(math.log2(max(1, self.max_batch_size // copies))))
        response_slots = bucket_size(max_new_tokens, self.min_response_bucket)
        order = sorted(range(num_prompts), key=lambda i: len(prompt_ids[i]))

        tokens = np.zeros((num_prompts, n, response_slots), np.int32)
        logp = np.zeros((num_prompts, n, response_slots), np.float32)
        tlogp = np.zeros((num_prompts, n, response_slots), np.float32)
        lengths = np.zeros((num_prompts, n), np.int32)
        stopped = np.zeros((num_prompts, n), bool)
        num_chunks, decode_steps = 0, 0
        for first in range(0, num_prompts, prompts_per_chunk):
            chunk = order[first:first + prompts_per_chunk]
            batch = bucket_size(len(chunk), 1, self._batch_shards)
            prompt_slots = bucket_size(max(len(prompt_ids[i]) for i in chunk),
                                       self.min_prompt_bucket)
            chunk_prompts = [prompt_ids[i] for i in chunk] + [[self.pad_id]] * (batch - len(chunk))
            ids, mask = left_pad(chunk_prompts, prompt_slots, self.pad_id)
            cache, logits, kv_mask, next_pos = _prefill(
                self.graphdef, state, self._put(ids), self._put(mask), num_copies=copies,
                response_slots=response_slots, batch_spec=self._batch_spec)
            for p in range(passes):
                sample_idx = p * copies + np.arange(copies)
                row_prompt = np.repeat(np.asarray(chunk + [0] * (batch - len(chunk))), copies)
                row_sample = np.tile(sample_idx, batch)
                active = np.repeat(np.arange(batch) < len(chunk), copies) & (row_sample < n)
                if p + 1 < passes:  # the cache is donated to decode: keep a copy for next pass
                    pass_cache = jax.tree.map(jnp.copy, cache)
                else:
                    pass_cache = cache
                out = _decode(
                    self.graphdef, state, pass_cache, logits, kv_mask, next_pos,
                    self._put(active), self._put(row_prompt.astype(np.int32)),
                    self._put(row_sample.astype(np.int32)), np.uint32(seed % 2**32),
                    jnp.asarray(stop_ids), np.float32(temperature), np.float32(top_p),
                    np.int32(max_new_tokens), np.int32(self.pad_id),
                    top_k=params.effective_top_k(self.cfg.vocab_size),
                    use_top_p=params.use_top_p, greedy=params.greedy,
                    response_slots=response_slots, batch_spec=self._batch_spec)
                # The final cache (out[-1]) stays on device: only the results come to host.
                toks, lp, tlp, lens, stop, steps = fetch_global(out[:-1])
                decode_steps += int(steps)
                rows = active.nonzero()[0]
                for r in rows:
                    i, j = row_prompt[r], row_sample[r]
                    tokens[i, j], logp[i, j], tlogp[i, j] = toks[r], lp[r], tlp[r]
                    lengths[i, j], stopped[i, j] = lens[r], stop[r]
            num_chunks += 1

        response_ids = [[tokens[i, j, :lengths[i, j]].tolist() for j in range(n)]
                        for i in range(num_prompts)]
        texts = None
        if self.tokenizer is not None:
            texts = [[self.tokenizer.decode(r[:-1] if stopped[i, j] else r)
                      for j, r in enumerate(response_ids[i])] for i in range(num_prompts)]
        return GenerationOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=[[logp[i, j, :lengths[i, j]].tolist() for j in range(n)]
                      for i in range(num_prompts)],
            tempered_logprobs=[[tlogp[i, j, :lengths[i, j]].tolist() for j in range(n)]
                               for i in range(num_prompts)],
            response_lengths=lengths.tolist(),
            truncated=(~stopped).tolist(),
            texts=texts,
            stats={"chunks": num_chunks, "decode_steps": decode_steps,
                   "generated_tokens": int(lengths.sum()),
                   "seconds": time.perf_counter() - start_time},
        )

    def _stop_ids(self, stop_token_ids) -> np.ndarray:
        if stop_token_ids is None:
            eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer else None
            stop_token_ids = () if eos is None else (eos,)
        if isinstance(stop_token_ids, int):
            stop_token_ids = (stop_token_ids,)
        ids = [int(t) for t in stop_token_ids]
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids has ids outside [0, {self.cfg.vocab_size}): {bad}")
        # Fixed small length (padded with -1, which no token equals) so the set is not a shape.
        width = bucket_size(len(ids), 4)
        return np.asarray(ids + [-1] * (width - len(ids)), np.int32)
