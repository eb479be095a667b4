"""The rollout engine's jitted programs: prefill prompts into pages, copy pages, decode a few
steps for all slots. Static shapes (the scheduler buckets them); the page pool is donated to
every program, so it is updated in place and exists once.

Parameters are an argument (the nnx state), so new weights need no recompile.

prefill and decode each have a twin compiled with BATCH_INVARIANT_OPTIONS
(batch_invariant_prefill, batch_invariant_decode: the same function, XLA options that hold a
GPU's matmuls to one summation order at every row count), which Sampler(batch_invariant=True)
runs instead.

With a mesh (batch_spec = (mesh, batch axes)) the pool's page axis is split over the batch
shards and every page index these programs get is shard-LOCAL: row / slot / copy entry r of a
call belongs to shard r // (rows / S) and addresses that shard's pages only. The page writes,
copies and the decode attention run per shard (jax.shard_map), so no page crosses devices.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.models import attention
from delta_jax.sampling_utils import sample_tokens


def _per_shard(fn, batch_spec, num_kv_heads, in_kinds, out_kinds):
    """fn as is without a mesh (batch_spec None), else per batch shard on its own pages
    (attention.shard_pages: the pool's page axis over the batch axes, LOCAL page ids)."""
    if batch_spec is None:
        return fn
    mesh, batch_axes = batch_spec
    return attention.shard_pages(fn, mesh, batch_axes, num_kv_heads, in_kinds, out_kinds)


# XLA options that make a row's results independent of how many rows a program runs. A GPU's
# GEMMs otherwise pick their tiling, split of the contraction and library per shape, and a
# contraction split in another number of parts sums a row in another order: one split (split-K
# off) and XLA's own Triton GEMMs always, never cuBLAS's (whose kernels split as they choose).
# Both are needed for the second: XLA's GEMM fusion leaves a "pure" matmul (operands straight
# from parameters, bitcasts or reshapes: o_proj after the attention kernel, say) to cuBLAS
# without asking the autotuner unless triton_gemm_any is set, and the autotuner may still pick
# cuBLAS for the rest unless cublas_fallback is off (XLA's gemm_fusion.cc and the flag's help:
# "to make sure only triton gemm is chosen ... run with xla_gpu_cublas_fallback set to false").
# And XLA may keep a bfloat16 value in float32 where a fusion holds it, which fusion decisions
# (shape-dependent) change: excess precision off rounds every value to its dtype. For the
# prefill and decode programs of Sampler(batch_invariant=True). XLA:CPU takes the GPU options
# and does nothing with them; excess precision off also rounds a bfloat16 model's intermediates
# there.
BATCH_INVARIANT_OPTIONS = {"xla_gpu_experimental_force_split_k": 1,
                           "xla_gpu_triton_gemm_any": True,
                           "xla_gpu_cublas_fallback": False,
                           "xla_allow_excess_precision": False}
# The platforms whose compilers take those options (jax device.platform names): XLA:GPU's and
# XLA:CPU's (the same DebugOptions; tests/test_sampling.py compiles with them on the CPU).
# Whether a TPU's compiler takes the GPU ones is not known here, so Sampler refuses them there.
BATCH_INVARIANT_PLATFORMS = ("gpu", "cpu")


def prefill(graphdef, state, layers, cache: models.PagedKVCache, ids, mask, dest_page,
            dest_offset, *, batch_spec=None):
    """Run B prompts (left-aligned, right-padded: ids, mask int32 [B, T]) and write every
    layer's keys/values of token t of row b at page dest_page[b, t], offset dest_offset[b, t]
    (padding: page -1, not written; with a mesh, row b's shard-local pages), each layer's as it
    is computed (Transformer.prefill_paged: no stack of every layer's keys and values). layers:
    decode_layers(graphdef, state), the layer weights decode reads too. Returns the updated
    cache."""
    model = nnx.merge(graphdef, state)
    mesh, batch_axes = batch_spec or (None, None)
    ids, mask = sharding_lib.constrain_batch((ids, mask), mesh, batch_axes=batch_axes)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    return model.prefill_paged(ids, positions, mask, cache, dest_page, dest_offset, layers=layers,
                               mesh=mesh, batch_axes=batch_axes or ())


_PREFILL_JIT = dict(static_argnames=("graphdef", "batch_spec"), donate_argnames=("cache",))
batch_invariant_prefill = jax.jit(prefill, **_PREFILL_JIT, compiler_options=BATCH_INVARIANT_OPTIONS)
prefill = jax.jit(prefill, **_PREFILL_JIT)


@functools.partial(jax.jit, static_argnames=("batch_spec",), donate_argnames=("cache",))
def copy_pages(cache: models.PagedKVCache, src, dst, *, batch_spec=None):
    """Copy page src[c] to page dst[c] in every layer (int32 [C]; padding: dst -1, nothing
    copied; the dst pages are distinct). With a mesh, entry c belongs to shard c // (C / S) and
    its ids are that shard's local pages."""
    def copy(k_pools, v_pools, src, dst):
        def one(pool):
            return pool.at[:, attention.drop_negative(dst, pool.shape[1])].set(
                pool[:, src], mode="drop", unique_indices=True)
        return tuple(one(p) for p in k_pools), tuple(one(p) for p in v_pools)

    pools = ("pool",) * len(cache.k)
    k, v = _per_shard(copy, batch_spec, cache.k[0].shape[0], (pools, pools, "rows", "rows"),
                      (pools, pools))(cache.k, cache.v, src, dst)
    return models.PagedKVCache(k=tuple(k), v=tuple(v))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def decode_layers(graphdef, state):
    """The layer weights decode takes (Transformer.decode_layers: each layer's own arrays in the
    compute dtype, LoRA merged): a copy of them, made once per generate() and passed to every
    decode call. (Sliced inside decode, they were copied by every call: ~200 device copies a
    call for Qwen3-0.6B, 0.8 ms of the H200's time, and 16 GB of copying a call at 8B.)"""
    return nnx.merge(graphdef, state).decode_layers()


class Rows(NamedTuple):
    """Per-row decode inputs, for the S slots or the Q staged samples of a decode call.

    tables int32 [R, pages_per_seq]: the row's pages (covering its length + the call's steps;
    with a mesh, shard-local ids). token: int32 [R], the next input token; length: int32 [R], KV
    tokens so far (= the input token's position); generated: int32 [R], response tokens so far;
    active: bool [R] (a free slot, or an empty queue entry: False); prompt_index, sample_index:
    int32 [R], the sample's random stream (response token r draws with
    fold_in(fold_in(fold_in(key(seed), i), j), r), whatever the slot or step); limit: int32 [R],
    its max_new_tokens."""
    tables: Any
    token: Any
    length: Any
    generated: Any
    active: Any
    prompt_index: Any
    sample_index: Any
    limit: Any


def decode(graphdef, state, layers, cache: models.PagedKVCache, slots: Rows, queue: Rows, seed,
           stop_ids, temperature, top_p, pad_id, exit_after, *, num_steps, top_k, use_top_p,
           greedy, attention_impl="auto", pages_per_block=8, attention_splits=1,
           batch_spec=None):
    """Up to num_steps decode steps for all S slots, refilling each slot whose sample finishes
    with the next staged sample of the queue; returns early once `exit_after` slots have
    finished with no staged sample left to take them (so the scheduler can refill them) or none
    is live.

    state: the model's nnx state (embedding, final norm, LM head); layers: decode_layers(graphdef,
    state), the layer weights the steps use. attention_impl, pages_per_block, attention_splits:
    Transformer.decode_paged's (the decode attention).
    slots: Rows [S], the slots at entry. queue: Rows [Q], samples staged to start mid-call
    (admitted, their prompt prefilled, their pages in their rows; generated 0; Q = 0 when none
    is staged: the program then does no refill work at any step): with a mesh of
    B batch shards, entries [b * Q / B, (b + 1) * Q / B) belong to shard b and go only to its
    slots, and each shard's active entries come first. A slot that finishes at a step takes its
    shard's next entry (slots in index order, entries in queue order) and decodes it from the
    next step. seed: uint32; stop_ids: int32 [num_stop] (-1 = unused); temperature, top_p,
    pad_id, exit_after: traced scalars.
    Returns (cache, tokens int32 [S, num_steps], logprobs, tempered_logprobs float32
    [S, num_steps], owner int32 [S, num_steps], steps int32): owner[s, t] says whose token
    tokens[s, t] is: -1 the sample in slot s at entry, q >= 0 queue entry q, -2 none (the slot
    was free). A sample finished at its last token when that token is a stop id or its
    generated count reached its limit; only then does another owner follow it in its slot.
    """
    model = nnx.merge(graphdef, state)
    num_slots = slots.token.shape[0]
    num_queued = queue.token.shape[0]
    page_size = cache.page_size
    mesh, batch_axes = batch_spec or (None, None)
    shards = sharding_lib.axes_size(mesh, batch_axes or ())
    base_key = jax.random.key(seed)
    impl = jax.random.key_impl(base_key)

    def stream_keys(rows):  # each row's sample stream: fold_in(fold_in(key(seed), i), j), as data
        return jax.random.key_data(jax.vmap(lambda i, j: jax.random.fold_in(
            jax.random.fold_in(base_key, i), j))(rows.prompt_index, rows.sample_index))
    per_slot, per_queue = num_slots // shards, num_queued // shards
    if num_queued:
        queue_keys = stream_keys(queue)
        queue_count = jnp.sum(queue.active.reshape(shards, per_queue), axis=1, dtype=jnp.int32)
        first_entry = jnp.arange(shards, dtype=jnp.int32)[:, None] * per_queue

    def fresh(dtype):
        return sharding_lib.constrain_batch(jnp.zeros((num_slots, num_steps), dtype), mesh,
                                            batch_axes=batch_axes,
                                            others=PartitionSpec.UNCONSTRAINED)

    def cond(carry):
        step, _, rows, _, _, _, finished, _ = carry
        return (step < num_steps) & jnp.any(rows.active) & (finished < exit_after)

    def refill(rows, keys, owner, taken, done):
        """Slots done at this step take their shard's next queue entries (in slot order)."""
        if not num_queued:  # nothing staged (Q = 0, a static shape): no refill work is traced
            return rows, keys, owner, taken, jnp.zeros_like(done)
        rank = jnp.cumsum(done.reshape(shards, per_slot), axis=1, dtype=jnp.int32) - 1
        rank = rank + taken[:, None]
        take = done.reshape(shards, per_slot) & (rank < queue_count[:, None])
        entry = (first_entry + jnp.minimum(rank, per_queue - 1)).reshape(num_slots)
        taken = taken + jnp.sum(take, axis=1, dtype=jnp.int32)
        take = take.reshape(num_slots)

        def pick(now, staged):
            mask = take.reshape((num_slots,) + (1,) * (now.ndim - 1))
            return jnp.where(mask, jnp.take(staged, entry, axis=0), now)
        rows = Rows(*(pick(now, staged) for now, staged in zip(rows, queue)))
        return rows, pick(keys, queue_keys), jnp.where(take, entry, owner), taken, take

    def body(carry):
        step, cache, rows, row_keys, owner, taken, finished, bufs = carry
        tokens_buf, logp_buf, tlogp_buf, owner_buf = bufs
        active, length = rows.active, rows.length
        page = jnp.take_along_axis(rows.tables, (length // page_size)[:, None], axis=1)[:, 0]
        page = jnp.where(active, page, -1)  # free slots write nothing
        offset = jnp.where(active, length % page_size, 0)
        logits, cache = model.decode_paged(
            rows.token, length, cache, rows.tables, jnp.where(active, length + 1, 0), page,
            offset, attention_impl=attention_impl, pages_per_block=pages_per_block,
            attention_splits=attention_splits, mesh=mesh, batch_axes=batch_axes or (),
            layers=layers)
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(row_keys, impl=impl),
                                            rows.generated)
        new, logp, tlogp = sample_tokens(keys, logits, temperature, top_p, top_k=top_k,
                                         use_top_p=use_top_p, greedy=greedy)
        new = jnp.where(active, new, pad_id)
        tokens_buf = tokens_buf.at[:, step].set(new)
        logp_buf = logp_buf.at[:, step].set(jnp.where(active, logp, 0.0))
        tlogp_buf = tlogp_buf.at[:, step].set(jnp.where(active, tlogp, 0.0))
        owner_buf = owner_buf.at[:, step].set(jnp.where(active, owner, -2))
        live = active.astype(jnp.int32)
        generated = rows.generated + live
        hit = active & jnp.any(new[:, None] == stop_ids[None, :], axis=1)
        done = active & (hit | (generated >= rows.limit))
        rows = rows._replace(token=jnp.where(active, new, rows.token), length=length + live,
                             generated=generated, active=active & ~done)
        rows, row_keys, owner, taken, took = refill(rows, row_keys, owner, taken, done)
        finished = finished + jnp.sum(done & ~took, dtype=jnp.int32)
        return (step + 1, cache, rows, row_keys, owner, taken, finished,
                (tokens_buf, logp_buf, tlogp_buf, owner_buf))

    bufs = (fresh(jnp.int32), fresh(jnp.float32), fresh(jnp.float32), fresh(jnp.int32))
    carry = (jnp.int32(0), cache, slots, stream_keys(slots), jnp.full((num_slots,), -1, jnp.int32),
             jnp.zeros((shards,), jnp.int32), jnp.int32(0), bufs)
    step, cache, _, _, _, _, _, bufs = jax.lax.while_loop(cond, body, carry)
    return (cache,) + bufs + (step,)


_DECODE_JIT = dict(static_argnames=("graphdef", "num_steps", "top_k", "use_top_p", "greedy",
                                    "attention_impl", "pages_per_block", "attention_splits",
                                    "batch_spec"),
                   donate_argnames=("cache",))
batch_invariant_decode = jax.jit(decode, **_DECODE_JIT, compiler_options=BATCH_INVARIANT_OPTIONS)
decode = jax.jit(decode, **_DECODE_JIT)


def abstract_decode_args(graphdef, state, cache: models.PagedKVCache, num_slots: int,
                         pages_per_seq: int, *, queued=None, sharding=None,
                         row_sharding=None) -> tuple:
    """decode's positional arguments as abstract shapes, to lower or compile it ahead of time
    (benchmarks/gpu_program.py: for a GPU this machine does not have; tests): `num_slots` slots
    and `queued` staged entries (None: as many as slots; 0: none, the program without refill
    work), four stop ids, temperature and top-p as scalars; the static arguments are the
    caller's. The layer weights are decode_layers' (abstract) result. `sharding` (None: the
    arguments' own) places the parameters, pages and scalars, `row_sharding` the per-row inputs
    (default `sharding`)."""
    if sharding is not None:
        state, cache = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), (state, cache))
    row_sharding = sharding if row_sharding is None else row_sharding

    def rows(n):
        def of(*shape, dtype=jnp.int32):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding)
        return Rows(of(n, pages_per_seq), of(n), of(n), of(n), of(n, dtype=jnp.bool_), of(n),
                    of(n), of(n))

    def scalar(dtype, *shape):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    layers = jax.eval_shape(decode_layers, graphdef, state)
    return (graphdef, state, layers, cache, rows(num_slots),
            rows(num_slots if queued is None else queued), scalar(jnp.uint32),
            scalar(jnp.int32, 4), scalar(jnp.float32), scalar(jnp.float32), scalar(jnp.int32),
            scalar(jnp.int32))
