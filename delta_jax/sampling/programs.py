"""The rollout engine's jitted programs: prefill prompts into pages, copy pages, decode a few
steps for all slots. Static shapes (the scheduler buckets them); the page pool is donated to
every program, so it is updated in place and exists once.

Parameters are an argument (the nnx state), so new weights need no recompile.

With a mesh (batch_spec = (mesh, batch axes)) the pool's page axis is split over the batch
shards and every page index these programs get is shard-LOCAL: row / slot / copy entry r of a
call belongs to shard r // (rows / S) and addresses that shard's pages only. The page writes,
copies and the decode attention run per shard (jax.shard_map), so no page crosses devices.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.models import attention
from delta_jax.sampling_utils import sample_tokens


_scatter_pages = attention.write_pages


def _per_shard(fn, batch_spec, num_kv_heads, in_kinds, out_kinds):
    """fn as is without a mesh (batch_spec None), else per batch shard on its own pages
    (attention.shard_pages: the pool's page axis over the batch axes, LOCAL page ids)."""
    if batch_spec is None:
        return fn
    mesh, batch_axes = batch_spec
    return attention.shard_pages(fn, mesh, batch_axes, num_kv_heads, in_kinds, out_kinds)


@functools.partial(jax.jit, static_argnames=("graphdef", "batch_spec"),
                   donate_argnames=("cache",))
def prefill(graphdef, state, cache: models.PagedKVCache, ids, mask, dest_page, dest_offset, *,
            batch_spec=None):
    """Run B prompts (left-aligned, right-padded: ids, mask int32 [B, T]) and write every
    layer's keys/values of token t of row b at page dest_page[b, t], offset dest_offset[b, t]
    (padding: page -1, not written; with a mesh, row b's shard-local pages). Returns the updated
    cache."""
    model = nnx.merge(graphdef, state)
    mesh, batch_axes = batch_spec or (None, None)
    ids, mask = sharding_lib.constrain_batch((ids, mask), mesh, batch_axes=batch_axes)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = model(ids, positions=positions, attention_mask=mask, return_logits=False,
                return_kv=True)
    L = out.cache.k.shape[0]

    def write(k_pools, v_pools, new_k, new_v, dest_page, dest_offset):
        _, B, T, K, D = new_k.shape
        pages, offsets = dest_page.reshape(B * T), dest_offset.reshape(B * T)
        k = tuple(_scatter_pages(k_pools[i], pages, offsets, new_k[i].reshape(B * T, K, D))
                  for i in range(L))
        v = tuple(_scatter_pages(v_pools[i], pages, offsets, new_v[i].reshape(B * T, K, D))
                  for i in range(L))
        return k, v

    pools = ("pool",) * L
    k, v = _per_shard(write, batch_spec, cache.k[0].shape[0],
                      (pools, pools, "stack", "stack", "rows", "rows"), (pools, pools))(
        cache.k, cache.v, out.cache.k, out.cache.v, dest_page, dest_offset)
    return models.PagedKVCache(k=tuple(k), v=tuple(v))


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


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "top_k", "use_top_p",
                                             "greedy", "attention_impl", "pages_per_block",
                                             "batch_spec"),
                   donate_argnames=("cache",))
def decode(graphdef, state, layers, cache: models.PagedKVCache, block_tables, token, length,
           generated, active, prompt_index, sample_index, seed, stop_ids, temperature, top_p,
           limit, pad_id, exit_after, *, num_steps, top_k, use_top_p, greedy,
           attention_impl="auto", pages_per_block=8, batch_spec=None):
    """Up to num_steps decode steps for all S slots; returns early once `exit_after` slots have
    finished (so the scheduler can refill them) or none is live.

    state: the model's nnx state (embedding, final norm, LM head); layers: decode_layers(graphdef,
    state), the layer weights the steps use.

    block_tables int32 [S, pages_per_seq]: pages of each slot (covering length + num_steps;
    with a mesh, the slot's shard-local pages).
    token: int32 [S], each slot's next input token; length: int32 [S], its KV tokens so far (=
    the input token's position); generated: int32 [S], response tokens so far; active: bool [S]
    (False: a free slot); prompt_index, sample_index: int32 [S], the random stream of a slot's
    sample: response token r draws with fold_in(fold_in(fold_in(key(seed), i), j), r), whatever
    the slot or step. limit: int32 [S], each slot's max_new_tokens. seed: uint32; stop_ids:
    int32 [num_stop] (-1 = unused); temperature, top_p, pad_id, exit_after: traced scalars.
    Returns (cache, tokens int32 [S, num_steps], logprobs, tempered_logprobs float32
    [S, num_steps], generated int32 [S], stopped bool [S] (emitted a stop token), steps int32).
    A slot live at entry produced tokens[:, :generated_out - generated_in] in this call.
    """
    model = nnx.merge(graphdef, state)
    num_slots = token.shape[0]
    page_size = cache.page_size
    mesh, batch_axes = batch_spec or (None, None)
    base_key = jax.random.key(seed)
    row_keys = jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(base_key, i), j))(
        prompt_index, sample_index)

    def fresh(dtype):
        return sharding_lib.constrain_batch(jnp.zeros((num_slots, num_steps), dtype), mesh,
                                            batch_axes=batch_axes,
                                            others=PartitionSpec.UNCONSTRAINED)

    def cond(carry):
        step, _, _, _, _, active, _, finished, _ = carry
        return (step < num_steps) & jnp.any(active) & (finished < exit_after)

    def body(carry):
        step, cache, token, length, generated, active, stopped, finished, bufs = carry
        tokens_buf, logp_buf, tlogp_buf = bufs
        page = jnp.take_along_axis(block_tables, (length // page_size)[:, None], axis=1)[:, 0]
        page = jnp.where(active, page, -1)  # free slots write nothing
        offset = jnp.where(active, length % page_size, 0)
        logits, cache = model.decode_paged(
            token, length, cache, block_tables, jnp.where(active, length + 1, 0), page, offset,
            attention_impl=attention_impl, pages_per_block=pages_per_block,
            mesh=mesh, batch_axes=batch_axes or (), layers=layers)
        keys = jax.vmap(jax.random.fold_in)(row_keys, generated)
        new, logp, tlogp = sample_tokens(keys, logits, temperature, top_p, top_k=top_k,
                                         use_top_p=use_top_p, greedy=greedy)
        new = jnp.where(active, new, pad_id)
        tokens_buf = tokens_buf.at[:, step].set(new)
        logp_buf = logp_buf.at[:, step].set(jnp.where(active, logp, 0.0))
        tlogp_buf = tlogp_buf.at[:, step].set(jnp.where(active, tlogp, 0.0))
        live = active.astype(jnp.int32)
        generated, length = generated + live, length + live
        hit = active & jnp.any(new[:, None] == stop_ids[None, :], axis=1)
        done = active & (hit | (generated >= limit))
        return (step + 1, cache, jnp.where(active, new, token), length, generated,
                active & ~done, stopped | hit, finished + jnp.sum(done, dtype=jnp.int32),
                (tokens_buf, logp_buf, tlogp_buf))

    bufs = (fresh(jnp.int32), fresh(jnp.float32), fresh(jnp.float32))
    carry = (jnp.int32(0), cache, token, length, generated, active,
             jnp.zeros_like(active), jnp.int32(0), bufs)
    step, cache, _, _, generated, _, stopped, _, bufs = jax.lax.while_loop(cond, body, carry)
    return (cache,) + bufs + (generated, stopped, step)
