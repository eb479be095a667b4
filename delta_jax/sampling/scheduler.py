"""Continuous-batching scheduler over a paged KV cache: the Sampler.

    sampler = Sampler(model, tokenizer=None, max_batch_size=256)
    out = sampler.generate(prompt_ids, n=1, temperature=0.0, top_p=1.0, top_k=-1,
                           max_new_tokens=32, stop_token_ids=(eos_id,), seed=0)

How a call runs (a host loop over three jitted programs, delta_jax.sampling.programs):
* There are `max_batch_size` slots. Samples (prompt i, sample j) wait in order; when a slot is
  free the next sample takes it at once. Its prompt is prefilled once, when its first sample is
  admitted: the KV of all prompt tokens but the last is written into pages shared by the prompt's
  n samples (a sample copies only the partial last page); the last prompt token is the sample's
  first decode input. When a refill prefills anyway, the call also takes the next waiting
  prompts up to its row capacity while the pool has room to spare (prefill_ahead), so their
  samples find their pages ready.
* `decode` runs up to `decode_steps_per_call` steps for all slots in one lax.while_loop. With it
  go up to refill_queue (default slots // 4) waiting samples staged on the device (admitted,
  prefilled, their pages taken): a slot whose sample finishes takes the next one of its shard at
  the next step, inside the loop. Once none is left, the call returns as soon as enough slots
  have finished to refill (refill_after: max(1, slots // 16), or fewer when fewer samples wait),
  so slots stay full until the work runs out; the host then appends the new tokens (each slot's
  tokens split by the per-step owner record), frees the finished samples' pages, admits and
  stages waiting samples, and gives live samples the pages the next call may write (no host sync
  per token). Every decode call takes the same copy of the layer weights, made once per
  generate() (programs.decode_layers). When the live samples fit in fewer rows than there are
  slots, a call runs only the live slots' rows, padded to the smallest power of two that holds
  them (shrink_batch; a free slot can take no sample during a call): the tail of a run, a
  static batch draining and slots left free for want of pages do not pay for empty slots.
* KV memory: a page pool (delta_jax.sampling.kv_cache) sized by kv_budget_bytes (default: the
  worst case, so nothing waits). Samples take pages as they grow; if the pool runs dry the newest
  samples are preempted. A preempted sample resumes later where it stopped (resume_preempted):
  one prefill of its prompt and the tokens it had generated writes their KV into pages of its
  own (after its prompt's shared pages when its shard holds them, which it then reads as its
  prompt's other samples do), and it decodes on; one whose prompt and tokens exceed
  MAX_PREFILL_TOKENS, or any with resume_preempted=False, restarts from its first token.
* On a mesh the slots and the pool are split over the S batch shards: slot s belongs to shard
  s // (slots / S), which owns a contiguous range of the pool's pages (its own scratch page
  included) and a free list of its own; a sample's pages (and its prompt's shared pages) come
  from its slot's shard, and the programs read and write them there (shard-local page ids, no
  page crosses devices). A prompt's samples go to the shard that already holds its prompt pages
  when it has a free slot, else to the shard with the most free slots (the prompt is then
  prefilled there too). kv_budget_bytes is one shard's pool: the KV bytes each device holds.
* Results do not depend on scheduling: response token r of sample j of prompt i is drawn with
  fold_in(fold_in(fold_in(key(seed), i), j), r), so max_batch_size, refill order, preemption and
  the mesh change nothing. (A resumed sample continues from keys and values its prefill computed
  rather than the decode steps that first did: the same up to rounding, so a draw that falls
  within rounding of a token's boundary could go the other way.)
* Shapes are bucketed (slots, pages per sequence, prefill batch and length, pages copied), so a
  run compiles a handful of programs. Multi-host: every process runs the same host loop on the
  same all-gathered results (fetch_global).

See delta_jax/sampling_utils.py for the exact temperature / top-k / top-p / greedy definitions.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.models import attention
from delta_jax.sampling import programs
from delta_jax.sampling.kv_cache import PageAllocator, pages_for, plan_kv
from delta_jax.sampling.output import GenerationOutput, bucket_size, fetch_global
from delta_jax.sampling_utils import SamplingParams

log = logging.getLogger("delta_jax.sampling")
DEFAULT_BATCH_AXES = tuple(sharding_lib.DEFAULT_RULES["batch"])  # ("data", "fsdp")
# Tokens (rows x bucketed length) per prefill call, at most (one prompt at least).
MAX_PREFILL_TOKENS = 32768
# The fewest rows (over all batch shards) a shrunk decode call runs (Sampler shrink_batch): below
# this a step's cost hardly falls with its rows, and each row count is one more compile.
SHRINK_MIN_ROWS = 8


def prefill_rows_per_shard(slots: int, n: int, width: int, shards: int = 1) -> int:
    """Rows (prompts) per batch shard of one prefill call of prompts up to `width` (bucketed)
    tokens, for `slots` slots and n samples a prompt: at most slots / n prompts and about
    MAX_PREFILL_TOKENS tokens per call (a layer's activations grow with them), a power of two.
    Plan mode sizes the prefill's memory by this too."""
    rows = min(max(1, slots // n), max(1, MAX_PREFILL_TOKENS // width))
    return max(1, max(shards, 1 << int(math.floor(math.log2(rows)))) // shards)


def resume_width(length: int, min_bucket: int = 16) -> Optional[int]:
    """The row width (bucketed tokens) of the prefill that resumes a preempted sample of
    `length` KV tokens (its prompt and every token it generated but the last; Sampler
    resume_preempted), or None where that is wider than MAX_PREFILL_TOKENS: such a sample
    restarts from its first token instead. A call holds prefill_rows_per_shard(slots, 1, width,
    shards) such rows a shard."""
    width = bucket_size(max(1, length), min_bucket)
    return width if width <= MAX_PREFILL_TOKENS else None


def widest_resume_prefill(max_length: int, min_bucket: int = 16) -> int:
    """The widest resume_width of samples of up to max_length KV tokens: longer ones restart.
    Plan mode sizes the prefill's memory by it."""
    return resume_width(min(max_length, MAX_PREFILL_TOKENS), min_bucket)


@dataclasses.dataclass
class _Prompt:
    ids: list
    kv_len: int                 # prompt tokens whose KV is shared (all but the last)
    unfinished: int             # samples not finished yet (live or waiting)
    # shard -> its shared pages there (shard-local ids) while prefilled on that shard
    pages: dict = dataclasses.field(default_factory=dict)
    # shard -> samples of this prompt in that shard's slots
    live: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class _Sample:
    prompt: int
    index: int
    admitted: int               # admission order (preemption takes the newest)
    length: int = 0             # KV tokens cached
    own: list = dataclasses.field(default_factory=list)
    pages: list = dataclasses.field(default_factory=list)  # its table row (prompt's + own)
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    tempered: list = dataclasses.field(default_factory=list)
    stopped: bool = False
    # Resumed after a preemption on a shard without its prompt's pages: its table holds only
    # pages of its own, prefilled with its prompt and the tokens it had generated.
    private: bool = False


class GenerationStopped(Exception):
    """Sampler.generate(should_stop=) was told to stop; its samples are dropped."""


class Sampler:
    """Continuous-batching generation for a delta_jax.models.Transformer.

    model: the nnx Transformer (its parameters are captured now; swap with update_params).
    tokenizer: optional; lets generate() take strings and return texts (needs encode/decode).
    max_batch_size: decode slots (sequences decoded at once).
    max_prompt_len: longest accepted prompt (default: max_position_embeddings - max_new_tokens).
    truncate_prompts: "error" (default) raises on longer prompts; "left" keeps their last tokens.
    mesh / batch_axes: optional jax Mesh; slots are sharded over the mesh axes among batch_axes
      (default ("data", "fsdp")); the page pool's kv heads over "tensor" when it divides them.
      Parameters keep whatever sharding they have.
    min_prompt_bucket / min_response_bucket: smallest bucketed prompt / response lengths.
    pad_id: the token used for padding (never attended to; default 0).
    page_size: tokens per KV page. kv_budget_bytes: the page pool's size (None: the worst case);
      with a mesh, the size of each batch shard's part of the pool (what each device holds,
      before any split of the KV heads over "tensor").
    decode_steps_per_call: most decode steps per decode program call (pages are handed out that
      far ahead). decode_attention: attention.DECODE_IMPLS ("auto": the Mosaic GPU kernel
      delta_jax.kernels.paged_decode on Hopper GPUs where it takes the model and page_size, the
      jnp page reader elsewhere; "mosaic_fused": that kernel with the q / k norms, RoPE and the
      K / V page writes inside it, by name; "tpu": pallas.ops' TPU paged attention, by name; see
      attention.resolve_decode_impl). decode_impl: the one that runs.
    decode_splits: the Mosaic GPU kernel's splits of each row's pages (flash-decoding: a call's
      blocks are rows x KV heads x splits; attention.decode_splits): 1 (default), a fixed
      count, or 0 = auto: per call, the fewest (a power of two up to 8) that give every SM a
      block (kernels.paged_decode.auto_splits: 4 at 8 rows, 2 at 16, 1 from 32 at Qwen3's 8 KV
      heads on an H100), so the few rows of a shrunk call (a rollout's draining tail) read their
      long pages with the whole GPU. Other decode attentions have no splits. Splits merge a
      row's attention in another order: with 0 a row's tokens on a GPU depend on the rows of
      the call it runs in, so 0 is refused with batch_invariant. Not measured on a GPU yet
      (`gpu_bench.sh decode_splits`).
    continuous: True (default) refills a slot as soon as its sample stops; False decodes static
      batches (new samples only once every slot is free; with shrink_batch=False, every step
      over every slot: the baseline that benchmarks compare against).
    prefill_ahead: when a refill prefills prompts anyway, the same call also prefills the next
      waiting prompts up to its row capacity (continuous batching only), while the pool keeps
      room for every live sample's longest continuation plus one more sample: fewer, fuller
      prefill calls (one per refill otherwise). Never changes the tokens.
    refill_queue: with continuous batching, waiting samples staged on the device with each
      decode call (admitted, prompt prefilled, pages taken, while pages fit): a slot whose sample
      finishes mid-call starts the next staged sample of its batch shard at the next step.
      Default max(1, slots // 4) (with a mesh, rounded up to a multiple of the batch shards);
      0: none (slots are refilled between calls only). Never changes the tokens.
    refill_after: with continuous batching, once no staged sample is left a decode call returns
      to refill slots after this many more samples have finished (fewer when fewer wait).
      Default max(1, slots // 16): each call costs the device about a decode step of idle time
      (the host's work between calls), each slot left free until then a share of a step. Never
      changes the tokens.
    shrink_batch: a decode call runs only the rows it needs: each batch shard's live samples in
      the smallest power of two of rows that holds them (bucket_size; at least SHRINK_MIN_ROWS
      rows in all), when that is fewer than the shard's slots, each row count a program of its
      own. (No sample can enter a free slot during a call: staged samples take the slots whose
      samples finish, and a shard keeps staged samples only while its slots are full.) So the
      tail of a generate(), where the last long samples run alone, a static batch draining and
      slots left free for want of pages do not pay for empty slots: their rows would go through
      every matmul, norm and sampling draw of a step. Default True; False runs every call on all
      slots (the static baseline of the benchmarks). The same tokens on the CPU; on a GPU some
      differ (89 of 1,024 long-tailed samples on an H100, 2026-11-27: BENCHMARKS.md "Ninth GPU
      run"; presumably the matmuls rounding a row differently at another row count), and False
      keeps them independent of the refill order.
    resume_preempted: a sample preempted when the page pool runs dry keeps its tokens and later
      resumes where it stopped, after one prefill of its prompt and those tokens into pages of
      its own (those after its prompt's shared full pages, where its shard holds them; rows of
      at most MAX_PREFILL_TOKENS tokens a call, like the prompts'); False, or a
      sample whose prompt and tokens would exceed MAX_PREFILL_TOKENS, restarts from its first
      token (its decode steps run again). Default True: a long sample preempted late otherwise
      runs thousands of decode steps twice, at the tail of the rollout.
    batch_invariant: compile the prefill and decode programs with
      programs.BATCH_INVARIANT_OPTIONS (XLA's GEMMs without split-K, never cuBLAS; no excess
      precision), so that a GPU sums each row's matmuls in one order and rounds where the
      program's dtypes say, whatever the rows of the call: the tokens then should not depend on
      shrink_batch, max_batch_size or the refill order on a GPU either. Default False: neither
      that nor its cost is measured yet (`gpu_bench.sh batch_invariant`). A float32 model's
      results on the CPU are the same either way. Refused on other platforms (a TPU), whose
      compiler is not known to take the GPU options.
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int = 256,
                 max_prompt_len: Optional[int] = None, truncate_prompts: str = "error",
                 mesh: Optional[jax.sharding.Mesh] = None,
                 batch_axes: Sequence[str] = DEFAULT_BATCH_AXES, min_prompt_bucket: int = 16,
                 min_response_bucket: int = 16, pad_id: int = 0, page_size: int = 32,
                 kv_budget_bytes: Optional[int] = None, decode_steps_per_call: int = 32,
                 decode_attention: str = "auto", continuous: bool = True,
                 prefill_ahead: bool = True, refill_after: Optional[int] = None,
                 refill_queue: Optional[int] = None, shrink_batch: bool = True,
                 batch_invariant: bool = False, decode_splits: int = 1,
                 resume_preempted: bool = True):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if truncate_prompts not in ("error", "left"):
            raise ValueError(f"truncate_prompts must be 'error' or 'left', got {truncate_prompts!r}")
        if max_prompt_len is not None and (not isinstance(max_prompt_len, int)
                                           or max_prompt_len < 1):
            raise ValueError(f"max_prompt_len must be an int >= 1, got {max_prompt_len!r}")
        for name, value in (("page_size", page_size),
                            ("decode_steps_per_call", decode_steps_per_call)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if refill_after is not None and (isinstance(refill_after, bool)
                                         or not isinstance(refill_after, int) or refill_after < 1):
            raise ValueError(f"refill_after must be an int >= 1 (or None), got {refill_after!r}")
        if refill_queue is not None and (isinstance(refill_queue, bool)
                                         or not isinstance(refill_queue, int) or refill_queue < 0):
            raise ValueError(f"refill_queue must be an int >= 0 (or None), got {refill_queue!r}")
        if isinstance(decode_splits, bool) or not isinstance(decode_splits, int) \
                or decode_splits < 0:
            raise ValueError(f"decode_splits must be an int >= 0 (0 = auto), got "
                             f"{decode_splits!r}")
        if decode_splits == 0 and batch_invariant:
            raise ValueError("decode_splits=0 (rollout.decode_splits, auto) splits a row's "
                             "attention by the rows of its call, which batch_invariant "
                             "(rollout.batch_invariant) holds fixed: set a fixed count (1) or "
                             "turn batch_invariant off")
        if kv_budget_bytes is not None and not kv_budget_bytes > 0:
            raise ValueError(f"kv_budget_bytes must be > 0 (or None), got {kv_budget_bytes!r}")
        cfg = model.cfg
        problem = dict(dtype=cfg.dtype, head_dim=cfg.head_dim, page_size=page_size,
                       group=cfg.num_groups)
        # Validates the name; "auto" picks the Mosaic GPU kernel only where it takes the problem.
        resolved = attention.resolve_decode_impl(decode_attention, **problem)
        if resolved in attention.MOSAIC_DECODE_IMPLS:
            from delta_jax.kernels import paged_decode
            reason = paged_decode.config_problem(**problem)
            if reason:
                raise ValueError(f"decode_attention {resolved!r} (rollout.decode_attention) "
                                 f"cannot run this model / rollout.page_size: {reason}")
        if batch_invariant:
            platform = (mesh.devices.flat[0].platform if mesh is not None
                        else jax.default_backend())
            if platform not in programs.BATCH_INVARIANT_PLATFORMS:
                raise ValueError(f"batch_invariant (rollout.batch_invariant) compiles with XLA "
                                 f"GPU options ({', '.join(programs.BATCH_INVARIANT_OPTIONS)}); "
                                 f"the sampler runs on {platform!r}, whose compiler is not known "
                                 f"to take them: leave it off there")
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prompt_len = max_prompt_len
        self.truncate_prompts = truncate_prompts
        self.min_prompt_bucket = min_prompt_bucket
        self.min_response_bucket = min_response_bucket
        self.pad_id = int(pad_id)
        self.page_size = page_size
        self.kv_budget_bytes = kv_budget_bytes
        self.decode_steps_per_call = decode_steps_per_call
        self.decode_attention = decode_attention
        self.decode_impl = resolved  # what runs: attention.resolve_decode_impl's choice
        self.continuous = bool(continuous)
        self.prefill_ahead = bool(prefill_ahead)
        self.mesh = mesh
        axes = tuple(a for a in batch_axes if mesh is not None and a in mesh.axis_names)
        self._batch_axes = axes
        self._batch_spec = (mesh, axes) if axes else None  # static argument of the jitted code
        self._batch_shards = sharding_lib.axes_size(mesh, axes)
        self.num_slots = bucket_size(max_batch_size, 1, self._batch_shards) \
            if max_batch_size % self._batch_shards else max_batch_size
        # The default: each decode call costs about one decode step at batch 64 on an H200
        # (2026-11-26: ~3 ms of host work between calls, the GPU idle, against 2.9 ms a step);
        # waiting for more finishers costs a few more steps. With the device programs stood in
        # for (benchmarks/scheduler_host.py: the same 108 calls as that GPU run at slots // 32),
        # slots // 16 took the long-tailed workload at 64 slots from 108 to 66 calls at the same
        # 1,024 steps (256 samples), from 443 to 243 calls for 31 more steps of 2,364 (1,024
        # samples); at 256 slots, whose steps cost ~3x more, 106 -> 65 calls at the same 1,024
        # steps (BENCHMARKS.md, "Refills").
        self.refill_after = refill_after or max(1, self.num_slots // 16)
        # Staged samples per call (rounded up to a multiple of the batch shards). A decode call
        # at 64 slots of the long-tailed workload (lengths of mean 128) sees ~16 samples finish
        # in its 32 steps: with slots // 4 staged, the stand-in scheduler takes that workload in
        # 32 calls instead of 66 (256 samples) and 69 instead of 193 (768 samples).
        queued = max(1, self.num_slots // 4) if refill_queue is None else refill_queue
        self.refill_queue = queued if self.continuous else 0
        self.queue_per_shard = -(-self.refill_queue // self._batch_shards)
        self.shrink_batch = bool(shrink_batch)
        self.batch_invariant = bool(batch_invariant)
        self.decode_splits = decode_splits
        self.resume_preempted = bool(resume_preempted)

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
        """A host array for a jitted program: placed rows over the sampler's batch axes with a
        mesh (every process of a multi-host mesh holds the same host value); without one a
        numpy copy, which the jitted call transfers in its own (C++) dispatch path, cheaper per
        call than a separate device_put. A copy, so that a dispatched program never shares
        memory with the per-slot arrays the run keeps updating (XLA:CPU can alias numpy
        memory)."""
        x = np.array(x)
        return x if self.mesh is None else sharding_lib.put_rows(x, self.mesh,
                                                                 batch_axes=self._batch_axes)

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
        out, cut = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is a string but the Sampler has no tokenizer")
                prompt = self.tokenizer.encode(prompt)
            ids = np.asarray(prompt).reshape(-1) if len(prompt) else np.zeros(0, np.int64)
            if ids.dtype.kind not in "iu":  # e.g. floats holding ids: as int() reads them
                ids = np.asarray([int(t) for t in ids], np.int64)
            if not ids.size:
                raise ValueError(f"prompts[{i}] is empty")
            # In numpy: a Python check per token took ~60 ms for 256 prompts of 512 tokens.
            bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
            if bad.size:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {self.cfg.vocab_size}): "
                                 f"{bad[:5].tolist()}")
            prompt = ids.tolist()
            if len(prompt) > limit:
                if self.truncate_prompts == "error":
                    raise ValueError(f"prompts[{i}] has {len(prompt)} tokens, more than the limit "
                                     f"max_prompt_len={limit} (use truncate_prompts='left')")
                cut.append(len(prompt))
                prompt = prompt[-limit:]
            out.append(prompt)
        if cut:
            log.warning("%d of %d prompts are over max_prompt_len=%d tokens (the longest: %d): "
                        "generating from their last %d tokens", len(cut), len(prompts), limit,
                        max(cut), limit)
        return out

    def _pool_sharding(self):
        if self.mesh is None:
            return None
        if self._batch_spec is not None:  # pages over the batch shards, heads over "tensor"
            return NamedSharding(self.mesh, attention.pool_specs(
                self.mesh, self._batch_axes, self.cfg.num_kv_heads)[0])
        tensor = "tensor" if ("tensor" in self.mesh.axis_names
                              and self.cfg.num_kv_heads % self.mesh.shape["tensor"] == 0) else None
        return NamedSharding(self.mesh, PartitionSpec(tensor, None, None, None))

    def kv_plan(self, prompt_len: int, max_new_tokens: int):
        """The page pool generate() would use for prompts up to prompt_len tokens
        (kv_cache.KVPlan: num_pages, page_bytes, bytes, worst_case_pages, shards,
        shard_bytes)."""
        return plan_kv(self.cfg, slots=self.num_slots, shards=self._batch_shards,
                       prompt_len=prompt_len,
                       max_new_tokens=max_new_tokens, page_size=self.page_size,
                       kv_budget_bytes=self.kv_budget_bytes,
                       min_prompt_bucket=self.min_prompt_bucket,
                       min_response_bucket=self.min_response_bucket)

    # ---------------------------------------------------------------------------------------
    def generate(self, prompts, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = -1, max_new_tokens: int = 32,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0,
                 state: Any = None,
                 progress: Optional[Callable[[dict], None]] = None,
                 should_stop: Optional[Callable[[], bool]] = None) -> GenerationOutput:
        """Generate n samples for each prompt.

        prompts: list of prompts, each a list of token ids (ragged) or a string (needs a
          tokenizer). n: samples per prompt (>= 1). temperature (0 = greedy), top_p, top_k: see
          delta_jax.sampling_utils. max_new_tokens: response length limit (>= 1), or one limit
          per prompt (a list of ints: a length schedule, e.g. for benchmarks).
        stop_token_ids: generation of a sample stops after it emits one of these (kept in the
          response). Default: the tokenizer's eos_token_id when there is a tokenizer, else none.
        seed: int; results are reproducible for a given seed whatever the batching.
        state: optional nnx state to use instead of the sampler's current parameters.
        progress: called after every decode call with {"finished": samples done, "samples":
          len(prompts) * n, "generated_tokens": tokens of the finished and the live samples,
          "decode_steps", "seconds": since generate() began} (sampling.progress.ProgressLog
          turns these into log lines). Every process of a multi-host run calls it alike.
        should_stop: asked after every decode call (on every process at the same calls, so it may
          be collective: train.preemption.StopOnSignal.requested); when it is true generate()
          raises GenerationStopped, leaving the sampler as it was (a trainer stopped by SIGTERM
          abandons a long rollout within one decode call instead of at its end).
        Raises ValueError before any work when the KV budget cannot hold one sample.
        """
        start_time = time.perf_counter()
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if any(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree.leaves(self.state if state is None else state)):
            raise ValueError("generate: the sampler holds parameter shapes, not weights (its model "
                             "was abstract: nnx.eval_shape, or a train Run's before it reads "
                             "them); give it weights with update_params first")
        limits = None
        if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, str):
            limits = list(max_new_tokens)
            if len(limits) != len(prompts) or not all(
                    isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1
                    for x in limits):
                raise ValueError(f"max_new_tokens must be an int >= 1 or one such int per "
                                 f"prompt ({len(prompts)}), got {max_new_tokens!r}")
            limits = [int(x) for x in limits]
            max_new_tokens = max(limits)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        params = SamplingParams(temperature, top_p, top_k)
        stop_ids = self._stop_ids(stop_token_ids)
        prompt_ids = self._prepare_prompts(prompts, max_new_tokens)
        state = self.state if state is None else state
        plan = self.kv_plan(max(len(p) for p in prompt_ids), max_new_tokens)
        limits = limits or [max_new_tokens] * len(prompt_ids)
        run = _Run(self, state, plan, prompt_ids, n, limits, params, stop_ids, seed)
        run.loop(progress, start_time, should_stop)

        lengths = [[len(run.results[i][j].tokens) for j in range(n)]
                   for i in range(len(prompt_ids))]
        response_ids = [[run.results[i][j].tokens for j in range(n)]
                        for i in range(len(prompt_ids))]
        stopped = [[run.results[i][j].stopped for j in range(n)] for i in range(len(prompt_ids))]
        texts = None
        if self.tokenizer is not None:
            texts = [[self.tokenizer.decode(r[:-1] if stopped[i][j] else r)
                      for j, r in enumerate(response_ids[i])] for i in range(len(prompt_ids))]
        generated = sum(map(sum, lengths))
        return GenerationOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=[[run.results[i][j].logprobs for j in range(n)]
                      for i in range(len(prompt_ids))],
            tempered_logprobs=[[run.results[i][j].tempered for j in range(n)]
                               for i in range(len(prompt_ids))],
            response_lengths=lengths,
            truncated=[[not s for s in row] for row in stopped],
            texts=texts,
            stats={"decode_steps": run.decode_steps, "generated_tokens": generated,
                   "slot_utilization": generated / max(1, run.decode_steps * self.num_slots),
                   "slots": self.num_slots,
                   "decode_rows": run.row_steps / max(1, run.decode_steps),
                   "shrunk_calls": run.shrunk_calls, "decode_calls": run.decode_calls,
                   "prefill_calls": run.prefill_calls, "prefilled_prompts": run.prefilled,
                   "preemptions": run.preemptions, "resumed": run.resumed_count,
                   "resumed_tokens": run.resumed_tokens, "queue_refills": run.queue_refills,
                   "kv_pages": plan.num_pages,
                   "kv_page_size": plan.page_size, "kv_bytes": plan.bytes,
                   "kv_shards": plan.shards, "kv_bytes_per_shard": plan.shard_bytes,
                   "prefill_seconds": run.prefill_seconds, "decode_seconds": run.decode_seconds,
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


def _spread(rows: np.ndarray, slots: np.ndarray, num_slots: int, fill) -> np.ndarray:
    """[num_slots, ...]: rows[i] at slots[i], `fill` elsewhere (a shrunk call's outputs)."""
    out = np.full((num_slots,) + rows.shape[1:], fill, rows.dtype)
    out[slots] = rows
    return out


class _Run:
    """The state of one generate() call: slots, waiting samples, pages, results."""

    def __init__(self, sampler: Sampler, state, plan, prompt_ids, n, limits, params,
                 stop_ids, seed):
        self.s, self.state, self.plan = sampler, state, plan
        self.n, self.limits = n, limits
        self.params, self.seed = params, np.uint32(seed % 2**32)
        self.stop_ids = stop_ids
        self.stop_set = frozenset(int(t) for t in stop_ids if t >= 0)
        self.ps = plan.page_size
        self.prompts = [_Prompt(ids=p, kv_len=len(p) - 1, unfinished=n) for p in prompt_ids]
        self.waiting = collections.deque((i, j) for i in range(len(prompt_ids)) for j in range(n))
        # (i, j) -> a preempted sample waiting to resume with its tokens (resume_preempted)
        self.resumable: dict[tuple, _Sample] = {}
        self.slots: list[Optional[_Sample]] = [None] * sampler.num_slots
        # Per batch shard: samples staged on the device to take its slots as they free up
        # during a decode call (admitted, pages taken, prompt prefilled; not started).
        self.staged = [collections.deque() for _ in range(plan.shards)]
        self.queue_width = max(1, sampler.queue_per_shard)  # the program's entries per shard
        self.results = [[None] * n for _ in prompt_ids]
        self.num_shards = plan.shards
        self.per_shard = sampler.num_slots // plan.shards  # slots per batch shard
        self.allocs = [PageAllocator(plan.pages_per_shard) for _ in range(plan.shards)]
        self.cache = models.init_paged_cache(sampler.cfg, plan.num_pages, self.ps,
                                             sharding=sampler._pool_sharding())
        # The layer weights every decode call takes, copied out of the stacked parameters once
        # per generate() (held until it returns: plan mode's "rollout decode weight copy").
        self.layers = programs.decode_layers(sampler.graphdef, state)
        self.admissions = 0
        self.decode_steps = self.decode_calls = self.prefill_calls = 0
        self.prefilled = self.preemptions = self.queue_refills = 0
        self.resumed_count = self.resumed_tokens = 0  # resumes; their tokens not decoded again
        self.finished = self.finished_tokens = 0  # samples done and their tokens (progress)
        self.row_steps = self.shrunk_calls = 0  # decode steps x the rows each ran; calls shrunk
        self.prefill_seconds = self.decode_seconds = 0.0
        # The decode program's per-slot inputs, kept up to date as samples are admitted, given
        # pages, advanced and removed (not rebuilt from the samples every call); a free slot's
        # row is zeros.
        S = sampler.num_slots
        self.tables = np.zeros((S, plan.pages_per_seq), np.int32)
        self.num_pages = np.zeros(S, np.int64)  # table entries in use
        self.token, self.length, self.generated = (np.zeros(S, np.int32) for _ in range(3))
        self.active = np.zeros(S, bool)
        self.prompt_index, self.sample_index = np.zeros(S, np.int32), np.zeros(S, np.int32)
        self.limit = np.ones(S, np.int32)
        self.kv_len = np.zeros(S, np.int64)  # the prompt's KV tokens (its length - 1)

    # ---------------------------------------------------------------------------------------
    def loop(self, progress=None, start_time: float = 0.0, should_stop=None):
        while self.waiting or any(self.slots) or any(self.staged):
            self.admit()
            self.reserve()
            if self.waiting and not (self.active.any() or any(self.staged)):  # never spin
                i, j = self.waiting[0]
                raise RuntimeError(f"rollout KV pool: sample {j} of prompt {i} cannot take its "
                                   f"pages with nothing else live (the budget check of plan_kv "
                                   f"should have caught this)")
            calls = self.decode_calls
            self.decode()
            if self.decode_calls == calls:
                continue
            samples = len(self.prompts) * self.n
            if progress is not None:
                progress({"finished": self.finished, "samples": samples,
                          "generated_tokens": self.finished_tokens
                          + int(self.generated[self.active].sum()),
                          "decode_steps": self.decode_steps,
                          "seconds": time.perf_counter() - start_time})
            if should_stop is not None and should_stop():
                raise GenerationStopped(
                    f"generation stopped after {self.decode_steps} decode steps, "
                    f"{self.finished} of {samples} samples done")

    def _pages_to_take(self, length, kv_len, limit, held):
        """Own pages still to take so that a sample with `length` KV tokens (of which kv_len are
        its prompt's), a response limit of `limit` tokens and `held` pages in its table (the
        prompt's full pages + its own) can run one more decode call: ints, or arrays over slots."""
        tokens = np.minimum(np.asarray(length, np.int64) + self.s.decode_steps_per_call,
                            np.asarray(kv_len, np.int64) + limit)
        return -(-tokens // self.ps) - held

    def _shared(self, sample: _Sample) -> int:
        """The prompt's full pages the sample reads in place (0 for a private one)."""
        return 0 if sample.private else self.prompts[sample.prompt].kv_len // self.ps

    def _need(self, sample: _Sample) -> int:
        """Own pages the sample needs to run one more decode call."""
        prompt = self.prompts[sample.prompt]
        return int(self._pages_to_take(sample.length, prompt.kv_len, self.limits[sample.prompt],
                                       self._shared(sample) + len(sample.own)))

    def _slot_needs(self) -> np.ndarray:
        """_need of every slot's sample at once from the slot arrays (0 for a free slot)."""
        need = self._pages_to_take(self.length, self.kv_len, self.limit, self.num_pages)
        return np.where(self.active, need, 0)

    def shard_of(self, slot: int) -> int:
        return slot // self.per_shard

    def _shard_slots(self, shard: int) -> range:
        return range(shard * self.per_shard, (shard + 1) * self.per_shard)

    def _live_on(self, shard: int) -> bool:
        """Whether samples on `shard` (in its slots or staged) will free pages."""
        return bool(self.staged[shard]) or any(self.slots[k] is not None
                                                for k in self._shard_slots(shard))

    def admit(self):
        """Free slots take staged samples of their shard, then waiting samples in order, while
        their pages fit; then (continuous batching) waiting samples are staged on the device
        for the next decode call, up to refill_queue, while their pages fit."""
        to_prefill, copies, resumes = [], [], []
        if not self.s.continuous and any(self.slots):
            return  # static batching: the batch runs until its last sample stops
        free = [collections.deque(k for k in self._shard_slots(sh) if self.slots[k] is None)
                for sh in range(self.num_shards)]
        for shard, staged in enumerate(self.staged):
            while staged and free[shard]:
                self._enter(free[shard].popleft(), staged.popleft())
        while self.waiting and any(free):
            shard, sample = self._take_next(list(map(len, free)), to_prefill, copies, resumes)
            if sample is None:
                break
            self._enter(free[shard].popleft(), sample)
        if self.s.continuous:
            room = [self.s.queue_per_shard - len(q) for q in self.staged]
            while self.waiting and any(room):
                shard, sample = self._take_next(room, to_prefill, copies, resumes)
                if sample is None:
                    break
                self.staged[shard].append(sample)
                room[shard] -= 1
        if to_prefill and self.s.prefill_ahead and self.s.continuous:
            to_prefill += self._ahead(to_prefill)
        start = time.perf_counter()
        self._prefill(to_prefill)
        self._resume(resumes)
        self._copy(copies)
        if to_prefill or resumes:  # timed (the copies alone run beside the host's work)
            jax.block_until_ready(self.cache)
            self.prefill_seconds += time.perf_counter() - start

    def _take_next(self, room: list, to_prefill: list, copies: list, resumes: list):
        """The first waiting sample, given its pages on the shard _place picks among those with
        room (> 0): (shard, the sample), its prompt's prefill and partial-page copy added to the
        jobs (a preempted sample that resumes: its own prefill, to `resumes`); (None, None) when
        no shard has its pages."""
        i, j = self.waiting[0]
        prompt = self.prompts[i]
        sample = self.resumable.get((i, j))
        if sample is not None:  # its tokens kept, its admission order too (preempted last)
            shard = self._place_resumed(sample, room)
            if shard is None:
                return None, None
            self.waiting.popleft()
            del self.resumable[i, j]
            sample.own = self.allocs[shard].take(self._need(sample))
            if sample.private:
                sample.pages = list(sample.own)
            else:
                prompt.live[shard] += 1
                sample.pages = prompt.pages[shard][:self._shared(sample)] + sample.own
            resumes.append((shard, sample))
            return shard, sample
        sample = _Sample(prompt=i, index=j, admitted=self.admissions, length=prompt.kv_len)
        own = self._need(sample)
        shard = self._place(i, own, room)
        if shard is None:
            return None, None
        alloc = self.allocs[shard]
        self.waiting.popleft()
        self.admissions += 1
        if shard not in prompt.pages:
            shared = pages_for(prompt.kv_len, self.ps)
            prompt.pages[shard] = alloc.take(shared)
            if shared:
                to_prefill.append((i, shard))
        sample.own = alloc.take(own)
        if prompt.kv_len % self.ps:  # a private copy of the partial last prompt page
            copies.append((shard, prompt.pages[shard][-1], sample.own[0]))
        prompt.live[shard] += 1
        sample.pages = prompt.pages[shard][:self._shared(sample)] + sample.own
        return shard, sample

    def _enter(self, slot: int, sample: _Sample):
        """`sample` (admitted, its pages taken, not started: its first input is the prompt's
        last token) now decodes in the free slot `slot` (whose row is zeros)."""
        self.slots[slot] = sample
        self.tables[slot, :len(sample.pages)] = sample.pages
        self.num_pages[slot] = len(sample.pages)
        (self.token[slot], self.length[slot], self.generated[slot], self.prompt_index[slot],
         self.sample_index[slot], self.limit[slot]) = self._start_row(sample)
        self.active[slot] = True
        self.kv_len[slot] = self.prompts[sample.prompt].kv_len

    def _place_resumed(self, sample: _Sample, room: list) -> Optional[int]:
        """The shard for a preempted sample that resumes: one holding its prompt's shared pages
        (it then reads them, as its prompt's other samples do, and its prefill writes only the
        positions after them), else any (private: its prefill writes its prompt's keys and
        values into pages of its own too); None when no shard has its pages. Sets
        sample.private."""
        prompt = self.prompts[sample.prompt]
        sample.own = []
        shard = None
        if any(room[sh] for sh in prompt.pages):
            sample.private = False
            shard = self._place(sample.prompt, self._need(sample),
                                [room[sh] if sh in prompt.pages else 0
                                 for sh in range(self.num_shards)])
        if shard is None:
            sample.private = True
            shard = self._place(sample.prompt, self._need(sample), room, private=True)
        return shard

    def _start_row(self, sample: _Sample) -> tuple:
        """A not-yet-started (or resumed) sample's decode inputs besides its pages: (token,
        length, generated, prompt index, sample index, limit), in programs.Rows' order; its
        first input is its last token (the prompt's, before it generated any)."""
        token = sample.tokens[-1] if sample.tokens else self.prompts[sample.prompt].ids[-1]
        return (token, sample.length, len(sample.tokens), sample.prompt, sample.index,
                self.limits[sample.prompt])

    def _place(self, i: int, own: int, room: list, private: bool = False) -> Optional[int]:
        """The shard that takes a sample of prompt i needing `own` pages, among those with
        room[shard] > 0 (free slots, or free queue entries): the shards holding the prompt's
        pages first (unless the sample is `private`: it uses none of them), then those with
        the most room (lowest index on ties); None when none has the pages."""
        prompt = self.prompts[i]
        order = sorted((sh for sh in range(self.num_shards) if room[sh]),
                       key=lambda sh: (sh not in prompt.pages and not private, -room[sh], sh))
        for shard in order:
            alloc = self.allocs[shard]
            shared = (0 if private or shard in prompt.pages
                      else pages_for(prompt.kv_len, self.ps))
            if not self._live_on(shard):  # nothing will free pages: drop idle prompts' pages
                keep = -1 if private else i  # (its own prompt's too when it uses none of them)
                while alloc.num_free < shared + own and self._evict_prompt(shard, keep=keep):
                    pass
            if alloc.num_free >= shared + own:
                return shard
        return None

    def _prefill(self, jobs):
        """Prefill prompt i's shared pages on shard sh for every (i, sh) in jobs (all its
        tokens but the last)."""
        if jobs:
            self._prefill_rows([(sh, self.prompts[i].ids[:-1], self.prompts[i].pages[sh])
                                for i, sh in jobs], self._prefill_cap(self._prefill_width(jobs)))
            self.prefilled += len(jobs)

    def _resume(self, jobs):
        """Prefill each resumed (shard, sample) of jobs: its prompt and every token it generated
        but the last (its next decode input), writing the positions its own pages hold (all of
        them for a private sample; those after the prompt's shared full pages otherwise, which
        it reads as they are); longest first, each call at most MAX_PREFILL_TOKENS tokens a
        shard (prefill_rows_per_shard with one sample a row)."""
        jobs = sorted(jobs, key=lambda job: -job[1].length)
        while jobs:
            width = resume_width(jobs[0][1].length, self.s.min_prompt_bucket)  # the longest
            cap = prefill_rows_per_shard(self.s.num_slots, 1, width, self.num_shards)
            call, shards = [], collections.Counter()
            for shard, sample in jobs:
                if shards[shard] < cap:
                    shards[shard] += 1
                    call.append((shard, sample))
            self._prefill_rows([(sh, self.prompts[x.prompt].ids + x.tokens[:-1],
                                 [-1] * (len(x.pages) - len(x.own)) + x.own)
                                for sh, x in call], cap)
            self.resumed_count += len(call)
            self.resumed_tokens += sum(len(x.tokens) for _, x in call)
            taken = {id(x) for _, x in call}
            jobs = [job for job in jobs if id(job[1]) not in taken]

    def _prefill_rows(self, jobs, cap: int):
        """Write the KV of each (shard, token ids, pages) of jobs: ids[t] at position t, in page
        pages[t // page_size] of that shard (-1: not written; every token is still attended).
        Rows of a call are split evenly over the shards (row r on shard r // (rows / S)), at
        most `cap` a shard, each shard's rows writing its own pages."""
        s = self.s
        S = self.num_shards
        queues = [[(ids, pages) for sh, ids, pages in jobs if sh == shard] for shard in range(S)]
        while any(queues):
            groups = [q[:cap] for q in queues]
            queues = [q[cap:] for q in queues]
            per = bucket_size(max(len(g) for g in groups), 1)
            rows = S * per
            width = bucket_size(max(len(ids) for g in groups for ids, _ in g),
                                s.min_prompt_bucket)
            ids = np.full((rows, width), s.pad_id, np.int32)
            mask = np.zeros((rows, width), np.int32)
            page = np.full((rows, width), -1, np.int32)  # padding: not written
            offset = np.zeros((rows, width), np.int32)
            for shard, group in enumerate(groups):
                for r, (tokens, pages) in enumerate(group, start=shard * per):
                    t = np.arange(len(tokens))
                    ids[r, :len(tokens)] = tokens
                    mask[r, :len(tokens)] = 1
                    page[r, :len(tokens)] = np.asarray(pages)[t // self.ps]
                    offset[r, :len(tokens)] = t % self.ps
            program = programs.batch_invariant_prefill if s.batch_invariant else programs.prefill
            self.cache = program(
                s.graphdef, self.state, self.layers, self.cache,
                *(s._put(x) for x in (ids, mask, page, offset)), batch_spec=s._batch_spec)
            self.prefill_calls += 1

    def _prefill_width(self, jobs) -> int:
        return bucket_size(max(self.prompts[i].kv_len for i, _ in jobs), self.s.min_prompt_bucket)

    def _prefill_cap(self, width: int) -> int:
        return prefill_rows_per_shard(self.s.num_slots, self.n, width, self.num_shards)

    def _ahead(self, jobs) -> list:
        """Prefill-ahead jobs for the call that prefills `jobs`: the next waiting prompts with no
        pages yet and no longer than the call's width, in queue order, on the shard with the most
        free pages, until each shard's last call is full. A prompt's pages are taken only while
        its shard keeps room for every live sample there to reach its limit plus one sample of
        the longest kind, so prefilling ahead never preempts a live sample. (Staged samples are
        not counted: one starts only in a slot whose sample finished, and grows into the pages
        that sample gave back; counting both left little to prefill ahead: 30 prefill calls
        instead of 12 on the CPU long-tail case.)"""
        width = self._prefill_width(jobs)
        cap = self._prefill_cap(width)
        count = collections.Counter(sh for _, sh in jobs)
        room = {sh: -count[sh] % cap if count[sh] else cap for sh in range(self.num_shards)}
        spare = [self.allocs[sh].num_free - self.plan.pages_per_seq
                 for sh in range(self.num_shards)]
        for k, sample in enumerate(self.slots):
            if sample is not None:
                prompt = self.prompts[sample.prompt]
                top = pages_for(prompt.kv_len + self.limits[sample.prompt], self.ps)
                spare[self.shard_of(k)] -= max(0, top - self._shared(sample) - len(sample.own))
        out, seen = [], {i for i, _ in jobs}
        for i, _ in self.waiting:
            if not any(room.values()):
                break
            prompt = self.prompts[i]
            if i in seen or prompt.pages or prompt.kv_len == 0 or prompt.kv_len > width:
                continue
            seen.add(i)
            need = pages_for(prompt.kv_len, self.ps)
            shard = max((sh for sh in room if room[sh] and spare[sh] >= need),
                        key=lambda sh: (spare[sh], -sh), default=None)
            if shard is None:
                break
            prompt.pages[shard] = self.allocs[shard].take(need)
            spare[shard] -= need
            room[shard] -= 1
            out.append((i, shard))
        return out

    def _copy(self, copies):
        """(shard, src, dst) copies of shard-local pages: entries split evenly over the shards."""
        if not copies:
            return
        S = self.num_shards
        per = [[(a, b) for sh, a, b in copies if sh == shard] for shard in range(S)]
        width = bucket_size(max(map(len, per)), 4)
        src = np.zeros(S * width, np.int32)
        dst = np.full(S * width, -1, np.int32)  # padding: nothing copied
        for shard, pairs in enumerate(per):
            if pairs:
                at = shard * width
                src[at:at + len(pairs)], dst[at:at + len(pairs)] = zip(*pairs)
        self.cache = programs.copy_pages(self.cache, self.s._put(src), self.s._put(dst),
                                         batch_spec=self.s._batch_spec)

    def reserve(self):
        """Pages for the next decode call of every live sample, oldest first; when the pool runs
        dry, the newest live samples go back to the front of the queue (_preempt: to resume or
        restart later, the same tokens, since randomness is per sample and position) and
        prompts with no live sample give back their shared pages (prefilled again when
        needed)."""
        needs = self._slot_needs()  # a slot needing none has nothing to do here
        for slot in sorted(np.flatnonzero(needs > 0).tolist(),
                           key=lambda k: self.slots[k].admitted):
            sample = self.slots[slot]
            if sample is None:  # preempted below for an older one
                continue
            shard = self.shard_of(slot)
            alloc = self.allocs[shard]
            need = int(needs[slot])
            while need > alloc.num_free:
                if not (self._unstage_newest(shard)
                        or self._preempt_newest(shard, older_than=sample)
                        or self._evict_prompt(shard)):
                    break
            if need <= alloc.num_free:
                pages = alloc.take(need)
                sample.own += pages
                at = self.num_pages[slot]
                self.tables[slot, at:at + need] = pages
                self.num_pages[slot] = at + need
            elif any(self.slots[k] is not None and self.slots[k] is not sample
                     for k in self._shard_slots(shard)):
                self._preempt(slot)  # older samples hold the rest: wait for them
            else:
                raise RuntimeError("rollout KV pool exhausted by one sample (the budget check "
                                   "of plan_kv should have caught this)")

    def _unstage_newest(self, shard: int) -> bool:
        """Return the newest staged sample of `shard` to the front of the queue (it has not
        started): its pages back, and its prompt's there when no other sample of it is live or
        staged on the shard. With every staged sample of a shard back, its pages are what they
        would be without staging, so staging never preempts a live sample that the pool would
        otherwise hold (the default, worst-case pool never preempts)."""
        if not self.staged[shard]:
            return False
        sample = self.staged[shard].pop()
        self.allocs[shard].give(sample.own)
        if not sample.private:
            prompt = self.prompts[sample.prompt]
            prompt.live[shard] -= 1
            if prompt.live[shard] == 0 and shard in prompt.pages:
                self.allocs[shard].give(prompt.pages.pop(shard))
        if sample.tokens:  # a resumed sample: prefilled again when it next enters
            sample.own, sample.pages = [], []
            self.resumable[sample.prompt, sample.index] = sample
        self.waiting.appendleft((sample.prompt, sample.index))
        return True

    def _preempt_newest(self, shard: int, older_than: _Sample) -> bool:
        live = [k for k in self._shard_slots(shard)
                if self.slots[k] is not None and self.slots[k].admitted > older_than.admitted]
        if not live:
            return False
        self._preempt(max(live, key=lambda k: self.slots[k].admitted))
        return True

    def _preempt(self, slot):
        """Back to the front of the queue: to resume with its tokens (resume_preempted, when
        its prompt and tokens fit one prefill row of MAX_PREFILL_TOKENS) or to restart."""
        sample = self.slots[slot]
        shard = self.shard_of(slot)
        self._vacate(slot)
        self.allocs[shard].give(sample.own)
        if not sample.private:
            self.prompts[sample.prompt].live[shard] -= 1
        if (self.s.resume_preempted and sample.tokens
                and resume_width(sample.length, self.s.min_prompt_bucket) is not None):
            sample.own, sample.pages = [], []
            self.resumable[sample.prompt, sample.index] = sample
        self.waiting.appendleft((sample.prompt, sample.index))
        self.preemptions += 1

    def _evict_prompt(self, shard: int, keep: int = -1) -> bool:
        """Give back the shared pages on `shard` of one prompt with no live sample there."""
        for i, prompt in enumerate(self.prompts):
            if prompt.pages.get(shard) and prompt.live[shard] == 0 and i != keep:
                self.allocs[shard].give(prompt.pages.pop(shard))
                return True
        return False

    def _vacate(self, slot: int):
        self.slots[slot] = None
        self.tables[slot] = 0
        self.num_pages[slot] = 0
        for a in (self.token, self.length, self.generated, self.prompt_index, self.sample_index,
                  self.kv_len):
            a[slot] = 0
        self.active[slot] = False
        self.limit[slot] = 1

    def _queue_rows(self) -> tuple[programs.Rows, dict]:
        """The staged samples as the decode program's queue (shard b's in entries
        [b * Q / B, b * Q / B + len), the rest inactive), and entry -> staged sample. With no
        sample staged, Q = 0: a program of its own (compiled once), whose steps do none of the
        refill's work (the static engine's only program; a continuous call once no sample is
        left to stage, every shrunk call included)."""
        per = self.queue_width if any(self.staged) else 0
        Q, P = per * self.num_shards, self.tables.shape[1]
        tables = np.zeros((Q, P), np.int32)
        ints = np.zeros((6, Q), np.int32)  # token, length, generated, prompt, sample, limit
        ints[5] = 1
        active = np.zeros(Q, bool)
        queued = {}
        for shard, staged in enumerate(self.staged):
            for q, sample in enumerate(staged, start=shard * per):
                tables[q, :len(sample.pages)] = sample.pages
                ints[:, q] = self._start_row(sample)
                active[q] = True
                queued[q] = sample
        token, length, generated, prompt_index, sample_index, limit = ints
        return programs.Rows(tables, token, length, generated, active, prompt_index,
                             sample_index, limit), queued

    def _rows_to_run(self) -> Optional[np.ndarray]:
        """The slots the next decode call runs, in the order of its rows, or None for all of them
        (Sampler shrink_batch): each batch shard's live slots (in slot order) and after them its
        first free ones, as many rows per shard as the smallest power of two that holds every
        shard's live samples (together at least SHRINK_MIN_ROWS), when that is fewer than its
        slots. A shard's rows stay its own (shard b's rows are the call's b-th block), and so
        do the pages they read. The rows left out hold no sample and could take none during the
        call: staged samples only take slots whose samples finish in it, and after admit() and
        reserve() a shard with a staged sample has every slot live (admit fills free slots from
        the staged first; reserve unstages a shard's samples before it preempts a live one)."""
        s = self.s
        if not s.shrink_batch:
            return None
        active = self.active.reshape(self.num_shards, self.per_shard)
        rows = bucket_size(int(active.sum(axis=1).max()),
                           -(-SHRINK_MIN_ROWS // self.num_shards))
        if rows >= self.per_shard:
            return None
        order = np.argsort(~active, axis=1, kind="stable")[:, :rows]  # live first
        return (order + np.arange(self.num_shards)[:, None] * self.per_shard).reshape(-1)

    def decode(self):
        s = self.s
        if not self.active.any():
            return
        refill = self.waiting and self.s.continuous
        exit_after = min(s.refill_after, len(self.waiting)) if refill else len(self.slots) + 1
        slot_rows = programs.Rows(self.tables, self.token, self.length, self.generated,
                                  self.active, self.prompt_index, self.sample_index, self.limit)
        run_rows = self._rows_to_run()
        if run_rows is not None:  # a shrunk call: those slots' rows only
            slot_rows = programs.Rows(*(a[run_rows] for a in slot_rows))
        queue_rows, queued = self._queue_rows()
        start = time.perf_counter()
        program = programs.batch_invariant_decode if s.batch_invariant else programs.decode
        out = program(
            s.graphdef, self.state, self.layers, self.cache,
            programs.Rows(*map(s._put, slot_rows)), programs.Rows(*map(s._put, queue_rows)),
            self.seed, self.stop_ids, np.float32(self.params.temperature),
            np.float32(self.params.top_p), np.int32(s.pad_id), np.int32(max(1, exit_after)),
            num_steps=s.decode_steps_per_call,
            top_k=self.params.effective_top_k(s.cfg.vocab_size),
            use_top_p=self.params.use_top_p, greedy=self.params.greedy,
            attention_impl=s.decode_impl, pages_per_block=self._pages_per_block(),
            attention_splits=s.decode_splits, batch_spec=s._batch_spec)
        self.cache = out[0]
        toks, logp, tlogp, owner, steps = fetch_global(out[1:])
        self.decode_seconds += time.perf_counter() - start
        steps = int(steps)
        self.decode_steps += steps
        self.decode_calls += 1
        self.row_steps += steps * len(slot_rows.token)
        if run_rows is not None:  # back to one row per slot; the others held no sample (-2)
            self.shrunk_calls += 1
            toks, logp, tlogp, owner = (_spread(x, run_rows, len(self.slots), fill)
                                        for x, fill in ((toks, s.pad_id), (logp, 0.0),
                                                        (tlogp, 0.0), (owner, -2)))
        owner = owner[:, :steps]
        live = np.flatnonzero(self.active)
        refilled = (owner[live] >= 0).any(axis=1)
        # Slots that started no staged sample: in bulk (one list conversion per array).
        plain = live[~refilled]
        counts = (owner[plain] == -1).sum(axis=1)
        rows = (toks[plain].tolist(), logp[plain].tolist(), tlogp[plain].tolist())
        for k, count, tok, lp, tlp in zip(plain.tolist(), counts.tolist(), *rows):
            self._advance(k, tok[:count], lp[:count], tlp[:count])
        # Slots whose sample finished and that took staged samples: run by run.
        started = collections.defaultdict(list)  # shard -> the queue entries it started
        for k in live[refilled].tolist():
            row = owner[k]
            starts = [0] + (np.flatnonzero(row[1:] != row[:-1]) + 1).tolist()
            for a, b in zip(starts, starts[1:] + [steps]):
                who = int(row[a])
                if who == -2:
                    continue
                if who >= 0:
                    if self.slots[k] is not None:
                        raise RuntimeError(f"decode started staged entry {who} in slot {k} "
                                           f"before its sample finished")
                    self._enter(k, queued[who])
                    started[who // self.queue_width].append(who)
                self._advance(k, toks[k, a:b].tolist(), logp[k, a:b].tolist(),
                              tlogp[k, a:b].tolist())
        for shard, entries in started.items():  # each shard's staged samples start in order
            first = shard * self.queue_width
            if sorted(entries) != list(range(first, first + len(entries))):
                raise RuntimeError(f"decode started queue entries {sorted(entries)} of shard "
                                   f"{shard}, not its first {len(entries)}")
            for _ in entries:
                self.staged[shard].popleft()
            self.queue_refills += len(entries)

    def _advance(self, slot: int, tokens: list, logprobs: list, tempered: list):
        """Append a call's tokens to the sample in `slot`; finish it when it stopped (its last
        token a stop id, as the decode program decides) or reached its limit."""
        sample = self.slots[slot]
        count = len(tokens)
        sample.tokens += tokens
        sample.logprobs += logprobs
        sample.tempered += tempered
        sample.length += count
        if count:
            self.token[slot] = tokens[-1]
            self.length[slot] += count
            self.generated[slot] += count
            stop = tokens[-1] in self.stop_set
            if stop or len(sample.tokens) >= self.limits[sample.prompt]:
                sample.stopped = stop
                self._finish(slot)

    def _pages_per_block(self) -> int:
        # About 256 keys per step of the reference decode attention's page loop.
        return max(1, min(self.plan.pages_per_seq, 256 // self.ps))

    def _finish(self, slot):
        sample = self.slots[slot]
        shard = self.shard_of(slot)
        self._vacate(slot)
        self.results[sample.prompt][sample.index] = sample
        self.finished += 1
        self.finished_tokens += len(sample.tokens)
        self.allocs[shard].give(sample.own)
        prompt = self.prompts[sample.prompt]
        if not sample.private:
            prompt.live[shard] -= 1
        prompt.unfinished -= 1
        if prompt.unfinished == sum(prompt.live.values()):  # none of its samples waits:
            for sh in [sh for sh in prompt.pages if prompt.live[sh] == 0]:  # idle copies go
                self.allocs[sh].give(prompt.pages.pop(sh))
