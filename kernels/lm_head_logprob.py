"""Fused LM-head log-probs: log p(label) and entropy without materialising [N, V] logits.

For hidden states h [N, H], the head W [H, V], labels [N] and a temperature T,

    z = (h @ W) / T                      (fp32 logits, one vocabulary tile at a time)
    logp_n   = z[n, y_n] - logsumexp(z[n])
    entropy_n = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]

computed with an online log-sum-exp over vocabulary tiles (running max m, running sum of exp l,
running sum of exp * z for the entropy, and the label logit).

Gradients (jax.custom_vjp, both outputs differentiable): with p = softmax(z), Ez = sum p z,
    d logp / dz = onehot(y) - p,     d entropy / dz = -p (z - Ez),
so dz = g_logp (onehot(y) - p) - g_ent p (z - Ez). The backward recomputes z chunk by chunk over
the vocabulary (lax.scan; the matmuls go to XLA / cuBLAS), accumulating dh = sum_chunks dz W_c^T / T
and writing dW_c = h^T dz / T per chunk. The temperature and the tiling are static (not
differentiated). Labels must lie in [0, V); any other label gives logp = -logsumexp (no error).

`lm_head_logprob_reference`: forward and backward as chunked jnp scans (runs anywhere, at real
sizes). `lm_head_logprob`: forward as a Pallas (Triton backend) kernel over a grid of
(token tiles x vocabulary splits) whose partial (m, l, sum exp z, label logit) are merged by a
tiny jnp step (flash-decoding style, more programs than token tiles alone); backward shared with
the reference. `lm_head_logprob_auto` picks one (see kernels/backend.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from delta_jax.kernels import backend

_HIGHEST = lax.Precision.HIGHEST
_NEG_BIG = -1e30  # finite "minus infinity" for running maxima (keeps exp(m_old - m_new) finite)


def _check_inputs(h, w, labels, temperature):
    if h.ndim != 2 or w.ndim != 2 or labels.ndim != 1:
        raise ValueError(f"lm_head_logprob: expected h [N, H], w [H, V], labels [N]; got h {h.shape}, "
                         f"w {w.shape}, labels {labels.shape}")
    if h.shape[1] != w.shape[0]:
        raise ValueError(f"lm_head_logprob: hidden size of h {h.shape} != rows of w {w.shape}")
    if labels.shape[0] != h.shape[0]:
        raise ValueError(f"lm_head_logprob: labels {labels.shape} do not match h {h.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"lm_head_logprob: labels must be integers, got {labels.dtype}")
    if not float(temperature) > 0:
        raise ValueError(f"lm_head_logprob: temperature must be > 0, got {temperature}")


def _chunk_logits(h, w_chunk, temperature):
    """fp32 logits of one vocabulary chunk: [N, H] x [H, c] -> [N, c]."""
    precision = _HIGHEST if h.dtype == jnp.float32 else None
    z = jnp.dot(h, w_chunk.astype(h.dtype), precision=precision, preferred_element_type=jnp.float32)
    return z / temperature


def _vocab_chunks(vocab, chunk_size):
    """(number of full chunks, size of the remainder chunk)."""
    chunk_size = min(chunk_size, vocab)
    return vocab // chunk_size, vocab % chunk_size, chunk_size


# ----------------------------------------------------------------------------- jnp forward/backward


def _reference_forward_stats(h, w, labels, temperature, chunk_size):
    """Returns logp [N], entropy [N], lse [N], Ez [N] by an online LSE over vocabulary chunks."""
    n = h.shape[0]
    vocab = w.shape[1]
    n_full, rem, chunk = _vocab_chunks(vocab, chunk_size)

    def update(carry, w_chunk, offset):
        m, l, sz, zy = carry
        z = _chunk_logits(h, w_chunk, temperature)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[:, None])
        cols = offset + jnp.arange(z.shape[1])
        zy = zy + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        return (m_new, l * scale + jnp.sum(e, axis=1), sz * scale + jnp.sum(e * z, axis=1), zy)

    def step(carry, i):
        offset = i * chunk
        w_chunk = lax.dynamic_slice_in_dim(w, offset, chunk, axis=1)
        return update(carry, w_chunk, offset), None

    zeros = jnp.zeros((n,), jnp.float32)
    carry = (jnp.full((n,), _NEG_BIG, jnp.float32), zeros, zeros, zeros)
    carry, _ = lax.scan(step, carry, jnp.arange(n_full))
    if rem:
        carry = update(carry, w[:, n_full * chunk:], n_full * chunk)
    return _finish_stats(*carry)


def _finish_stats(m, l, sz, zy):
    lse = m + jnp.log(l)
    ez = sz / l
    return zy - lse, lse - ez, lse, ez


def _chunked_backward(h, w, labels, lse, ez, g_logp, g_ent, temperature, chunk_size):
    """dh [N, H], dW [H, V] by recomputing the logits chunk by chunk (see the module docstring)."""
    vocab = w.shape[1]
    n_full, rem, chunk = _vocab_chunks(vocab, chunk_size)
    g_logp = g_logp.astype(jnp.float32)
    g_ent = g_ent.astype(jnp.float32)
    precision = _HIGHEST if h.dtype == jnp.float32 else None

    def chunk_grads(w_chunk, offset):
        z = _chunk_logits(h, w_chunk, temperature)
        prob = jnp.exp(z - lse[:, None])
        cols = offset + jnp.arange(z.shape[1])
        onehot = (cols[None, :] == labels[:, None]).astype(jnp.float32)
        dz = g_logp[:, None] * (onehot - prob) - g_ent[:, None] * prob * (z - ez[:, None])
        dz = (dz / temperature).astype(h.dtype)
        dh = jnp.dot(dz, w_chunk.astype(h.dtype).T, precision=precision,
                     preferred_element_type=jnp.float32)
        dw = jnp.dot(h.T, dz, precision=precision, preferred_element_type=jnp.float32)
        return dh, dw.astype(w.dtype)

    def step(carry, i):
        dh, dw = carry
        offset = i * chunk
        dh_c, dw_c = chunk_grads(lax.dynamic_slice_in_dim(w, offset, chunk, axis=1), offset)
        return (dh + dh_c, lax.dynamic_update_slice_in_dim(dw, dw_c, offset, axis=1)), None

    carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
    (dh, dw), _ = lax.scan(step, carry, jnp.arange(n_full))
    if rem:
        dh_c, dw_c = chunk_grads(w[:, n_full * chunk:], n_full * chunk)
        dh = dh + dh_c
        dw = dw.at[:, n_full * chunk:].set(dw_c)
    return dh.astype(h.dtype), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _reference_core(h, w, labels, temperature, chunk_size):
    logp, ent, _, _ = _reference_forward_stats(h, w, labels, temperature, chunk_size)
    return logp, ent


def _reference_core_fwd(h, w, labels, temperature, chunk_size):
    logp, ent, lse, ez = _reference_forward_stats(h, w, labels, temperature, chunk_size)
    return (logp, ent), (h, w, labels, lse, ez)


def _labels_cotangent(labels):
    import numpy as np  # float0 zeros: integer inputs have no tangent space
    return np.zeros(labels.shape, dtype=jax.dtypes.float0)


def _reference_core_bwd(temperature, chunk_size, residuals, cotangents):
    h, w, labels, lse, ez = residuals
    g_logp, g_ent = cotangents
    dh, dw = _chunked_backward(h, w, labels, lse, ez, g_logp, g_ent, temperature, chunk_size)
    return dh, dw, _labels_cotangent(labels)


_reference_core.defvjp(_reference_core_fwd, _reference_core_bwd)


def lm_head_logprob_reference(h, w, labels, temperature=1.0, *, chunk_size=8192):
    """Chunked-jnp log p(labels) and entropy. h [N, H], w [H, V], labels int [N] -> fp32 [N], [N].

    Differentiable in h and w (custom VJP). Peak extra memory ~ N x chunk_size fp32.
    """
    _check_inputs(h, w, labels, temperature)
    return _reference_core(h, w, labels.astype(jnp.int32), float(temperature), int(chunk_size))


# ----------------------------------------------------------------------------- Pallas forward


def _lm_head_kernel(h_ref, w_ref, y_ref, m_ref, l_ref, sz_ref, zy_ref, *, n_tokens, hidden, vocab,
                    temperature, block_tokens, block_vocab, block_hidden, tiles_per_split):
    """Program (i, s): rows [i*BN, (i+1)*BN) against the vocabulary tiles of split s."""
    i, split = pl.program_id(0), pl.program_id(1)
    bn, bv, bk = block_tokens, block_vocab, block_hidden
    f32 = jnp.float32
    row0 = i * bn
    rows_ok = row0 + jnp.arange(bn) < n_tokens
    labels = pltriton.load(y_ref.at[pl.ds(row0, bn)], mask=rows_ok, other=-1)
    k_idx = jnp.arange(bk)
    n_kblocks = pl.cdiv(hidden, bk)

    def vocab_tile(t, carry):
        m, l, sz, zy = carry
        col0 = (split * tiles_per_split + t) * bv
        cols = col0 + jnp.arange(bv)
        cols_ok = cols < vocab

        def k_block(kb, acc):
            k_ok = kb * bk + k_idx < hidden
            hb = pltriton.load(h_ref.at[pl.ds(row0, bn), pl.ds(kb * bk, bk)],
                               mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            wb = pltriton.load(w_ref.at[pl.ds(kb * bk, bk), pl.ds(col0, bv)],
                               mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
            return acc + jnp.dot(hb, wb.astype(hb.dtype), preferred_element_type=f32)

        z = lax.fori_loop(0, n_kblocks, k_block, jnp.zeros((bn, bv), f32)) / temperature
        z_masked = jnp.where(cols_ok[None, :], z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z_masked, axis=1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z_masked - m_new[:, None])  # exactly 0 on masked columns
        l = l * scale + jnp.sum(e, axis=1)
        sz = sz * scale + jnp.sum(jnp.where(cols_ok[None, :], e * z, 0.0), axis=1)
        zy = zy + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        return m_new, l, sz, zy

    zeros = jnp.zeros((bn,), f32)
    m, l, sz, zy = lax.fori_loop(0, tiles_per_split, vocab_tile,
                                 (jnp.full((bn,), _NEG_BIG, f32), zeros, zeros, zeros))
    for ref, value in ((m_ref, m), (l_ref, l), (sz_ref, sz), (zy_ref, zy)):
        pltriton.store(ref.at[split, pl.ds(row0, bn)], value, mask=rows_ok)


def _pallas_forward_stats(h, w, labels, temperature, options):
    n, hidden = h.shape
    vocab = w.shape[1]
    bn, bv, bk = options["block_tokens"], options["block_vocab"], options["block_hidden"]
    bk = min(bk, max(16, pl.next_power_of_2(hidden)))
    num_vocab_tiles = pl.cdiv(vocab, bv)
    num_splits = options["num_splits"]
    if num_splits is None:
        # Enough programs to fill a GPU (~4 per SM) even when N / block_tokens is small.
        row_tiles = pl.cdiv(n, bn)
        num_splits = max(1, min(num_vocab_tiles, pl.cdiv(4 * 132, row_tiles)))
    num_splits = max(1, min(int(num_splits), num_vocab_tiles))
    tiles_per_split = pl.cdiv(num_vocab_tiles, num_splits)
    kernel = functools.partial(
        _lm_head_kernel, n_tokens=n, hidden=hidden, vocab=vocab, temperature=float(temperature),
        block_tokens=bn, block_vocab=bv, block_hidden=bk, tiles_per_split=tiles_per_split)
    part = jax.ShapeDtypeStruct((num_splits, n), jnp.float32)
    m, l, sz, zy = pl.pallas_call(
        kernel,
        out_shape=(part, part, part, part),
        grid=(pl.cdiv(n, bn), num_splits),
        interpret=backend.default_interpret(options["interpret"]),
        compiler_params=pltriton.CompilerParams(num_warps=options["num_warps"],
                                                num_stages=options["num_stages"]),
        name="lm_head_logprob",
    )(h, w, labels)
    # Merge the splits' partial online-LSE states.
    m_all = jnp.max(m, axis=0)
    scale = jnp.exp(m - m_all[None, :])
    return _finish_stats(m_all, jnp.sum(l * scale, axis=0), jnp.sum(sz * scale, axis=0),
                         jnp.sum(zy, axis=0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pallas_core(h, w, labels, temperature, options):
    logp, ent, _, _ = _pallas_forward_stats(h, w, labels, temperature, dict(options))
    return logp, ent


def _pallas_core_fwd(h, w, labels, temperature, options):
    logp, ent, lse, ez = _pallas_forward_stats(h, w, labels, temperature, dict(options))
    return (logp, ent), (h, w, labels, lse, ez)


def _pallas_core_bwd(temperature, options, residuals, cotangents):
    h, w, labels, lse, ez = residuals
    g_logp, g_ent = cotangents
    dh, dw = _chunked_backward(h, w, labels, lse, ez, g_logp, g_ent, temperature,
                               dict(options)["backward_chunk_size"])
    return dh, dw, _labels_cotangent(labels)


_pallas_core.defvjp(_pallas_core_fwd, _pallas_core_bwd)


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def lm_head_logprob(h, w, labels, temperature=1.0, *, block_tokens=64, block_vocab=128,
                    block_hidden=64, num_splits=None, num_warps=4, num_stages=3,
                    backward_chunk_size=8192, interpret=None):
    """Pallas fused log p(labels) and entropy; same arguments/results as the reference.

    block_* are powers of two >= 16 (Triton's dot); num_splits splits the vocabulary across
    programs (default: enough programs for ~4 per SM). The backward is the chunked recompute.
    """
    _check_inputs(h, w, labels, temperature)
    for name, value in (("block_tokens", block_tokens), ("block_vocab", block_vocab),
                        ("block_hidden", block_hidden)):
        if not (_is_power_of_two(value) and value >= 16):
            raise ValueError(f"lm_head_logprob: {name}={value} must be a power of two >= 16")
    options = (("block_tokens", block_tokens), ("block_vocab", block_vocab),
               ("block_hidden", block_hidden), ("num_splits", num_splits), ("num_warps", num_warps),
               ("num_stages", num_stages), ("backward_chunk_size", int(backward_chunk_size)),
               ("interpret", interpret))
    return _pallas_core(h, w, labels.astype(jnp.int32), float(temperature), options)


def lm_head_logprob_auto(h, w, labels, temperature=1.0, *, impl=None, chunk_size=8192,
                         **kernel_options):
    """The Pallas kernel on GPU, the chunked jnp reference elsewhere; impl= or $DELTA_JAX_KERNELS
    overrides ("pallas" | "interpret" | "reference" | "auto")."""
    choice = backend.resolve_impl(impl)
    if choice == "reference":
        return lm_head_logprob_reference(h, w, labels, temperature, chunk_size=chunk_size)
    kernel_options.setdefault("backward_chunk_size", chunk_size)
    return lm_head_logprob(h, w, labels, temperature, interpret=(choice == "interpret"),
                           **kernel_options)
