"""Paged decode attention on the Pallas Mosaic GPU backend (Hopper: TMA page copies + WGMMA).

    out = paged_decode_mosaic(q, k_pages, v_pages, block_tables, lengths)    # [B, N, D]
    out = paged_decode_mosaic(q, ..., rope=(cos, sin))     # q rotated first, in the kernel

The contract is delta_jax.models.attention.paged_decode_reference's: q [B, N, D] (one query per
sequence, N = K * G query heads over K key/value heads); k_pages, v_pages [K, P, page_size, D]
(one layer's page pool, read in place); block_tables int32 [B, pages_per_seq] (sequence b's token t
lives at page block_tables[b, t // page_size], offset t % page_size); lengths int32 [B] (sequence
b attends its tokens [0, lengths[b]); 0 gives output 0). Scores q.k accumulate in float32, are
scaled by D ** -0.5, softmax in float32, probabilities cast to v's dtype for the value product
(float32 accumulation). rope=(cos, sin), float32 [B, D] each: q is first rotated by them as
models.rope.apply_rope does (the decode step passes q unrotated, so its RoPE costs no kernel of
its own).

Why it exists: jax.experimental.pallas.ops.gpu.paged_attention runs on Pallas' Triton backend,
which jax 0.11 deprecates (issue #16), and no maintained Mosaic GPU paged decode kernel was found:
pallas.ops.gpu has none (its ragged and decode attention are Triton too), and tokamax 0.0.12's
Mosaic GPU attention refuses paging ("Paged attention not supported"; only its XLA path pages).

How it works. One CUDA block (one warpgroup) per (sequence, KV head, split of the pages). The G
query heads of the KV head sit in a 64-row WGMMA tile: one TMA copy brings a window of q's rows
read in place from [B, N, D], whole 8-row tiles from the tile holding the head's first row
(q_windows: 8 rows at Qwen3-0.6B / 8B, 16 at 14B's 5 heads a KV head), holding its G rows
and other heads' queries (and the tile's other rows are zeros: rows of a matmul are
independent, so they cost tensor-core time, which decode has spare, and no memory traffic; their
outputs are never stored). With rope, the prologue rotates the tile in float32 by halves (D = 128
in bf16: each half is whole 128-byte swizzle atoms; a narrower head is rotated by XLA before the
call). The block walks its share
of the sequence's live pages in steps of `pages_per_block` pages: each page of K and of V is one
TMA copy (the page id read from the block table), `stages` steps are in flight, and each step is
S = q K^T (WGMMA into float32), the length mask, an online-softmax update, and O += P V (WGMMA).
Pages past the sequence's length are never read. The output tile goes to an untiled
shared-memory buffer, from which one TMA copy stores its G real rows straight into the
[B, N, D] output (the other rows never leave the block, so nothing is sliced off afterwards:
that slice was a kernel of its own a layer, ~1.8 us at batch 64 on an H200, and so was q's RoPE
with the padding of q to 8 rows a KV head, ~2.1 us). With k_splits > 1
each split writes its normalised partial output and log-sum-exp and the splits are merged in
jnp.

It runs on NVIDIA Hopper GPUs. Without one it is checked two ways (tests/test_paged_decode.py):
its lowering to the Mosaic GPU dialect (jax.export for "cuda": register layouts, WGMMA and TMA
shapes, the shared-memory budget), and its numbers, run by Mosaic GPU's CPU interpreter (simulated
shared memory, TMA copies and barriers; tests/mosaic_interpret.py adds the transposed and register
WGMMA operands and layout casts it lacks) against the jnp reference, alone and inside the rollout
engine. The CI's jax is the newest for its Python (0.10 on 3.11); scripts/gpu_jax_check.sh runs
the same tests under the GPU image's jax 0.11.2, whose lowering is stricter (it refuses a tiled q
copy from an unaligned row, which 0.10 and the interpreter took). Where a GPU is, the compiled
kernel is checked against the same reference (its five GPU tests passed on an H200, 2026-11-26,
before q was read in place).

Speed, one H200, 2026-11-26, the whole decode of the Qwen3-0.6B shape (bf16, prompt 512 + 1,024
new tokens; benchmarks/decode_throughput.py with a profiler trace; BENCHMARKS.md): this kernel with
3 steps in flight took 80 us a layer call at batch 64 and 302 us at 256 (about 3.4 / 3.6 TB/s of
live K/V), against 126 / 440 us for pallas.ops' Triton kernel at its tuned parameters; the decode
ran 17,563 / 23,708 tokens/s against 12,772 / 17,231 (1.38x). So it is the CUDA default on Hopper
(attention.resolve_decode_impl). With 2 steps in flight (the default since the second H200 run of
that day) the batch-256 decode ran 27,197 tokens/s.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# The WGMMA tile's rows: the query heads of one KV head are padded to this.
WGMMA_ROWS = 64
# Defaults, chosen by benchmarks/paged_attention.py's sweep on an H200 (2026-11-26, calls timed
# back to back, one layer's call at 1,024 live tokens; BENCHMARKS.md "Fifth GPU run"): 2 pages
# (64 tokens of 32-token pages) a step, 2 steps in flight, one split: 16 KiB of q tile, 16 KiB
# of output tile and 2 x 2 x 16 KiB of K/V, 96 KiB of shared memory a block, two blocks an SM
# (the sweep ran with the output in q's tile: 80 KiB, also two). The fastest of 15 settings at
# batch 64 and 256 (81.4 / 273.6 us against 89.0 / 321.8 us with 3 steps in flight, the earlier
# default; 4 in flight and 4 pages a step were slower too); the whole decode at batch 256 ran
# 27,197 tokens/s against 23,678.
PAGES_PER_BLOCK = 2
STAGES = 2
K_SPLITS = 1
_LOG2E = math.log2(math.e)
# Shared memory a block may use on Hopper (H100 / H200: 227 KiB opt-in).
SMEM_LIMIT_BYTES = 227 * 1024


def smem_bytes(head_dim: int, page_size: int, pages_per_block: int, stages: int,
               itemsize: int = 2) -> int:
  """Shared memory of one block: the q tile, the output tile, `stages` steps of K and V pages
  and the log-sum-exp row of k_splits > 1 (counted always; barriers aside)."""
  return (2 * WGMMA_ROWS * head_dim * itemsize
          + 2 * stages * pages_per_block * page_size * head_dim * itemsize + 4 * WGMMA_ROWS)


def q_windows(num_heads: int, num_kv_heads: int) -> tuple[int, int, list[int]]:
  """(rows, q_rows, starts): the window of q's rows each block copies, for q [B, num_heads, D]
  with G = num_heads / num_kv_heads query heads a KV head. KV head h's block copies rows
  [starts[h], starts[h] + rows) of q (padded to q_rows rows when num_heads is not a whole
  number of 8-row tiles). A TMA copy into the tiled q tile moves whole 8-row tiles, so every
  start is a multiple of 8 (a copy from an unaligned row would read the wrong rows on a GPU;
  jax 0.11's lowering refuses it, jax 0.10's and the CPU interpreter did not), and the window
  covers the head's rows [h G, h G + G)."""
  G = num_heads // num_kv_heads
  rows = -(-max(h * G % 8 + G for h in range(num_kv_heads)) // 8) * 8
  q_rows = -(-max(num_heads, rows) // 8) * 8
  return rows, q_rows, [window_start(h, G, rows, q_rows) for h in range(num_kv_heads)]


def window_start(h, G: int, rows: int, q_rows: int, minimum=min):
  """KV head h's window start (q_windows'): the tile holding its first row, moved back where the
  window would reach past q's q_rows rows. minimum: min, or jnp.minimum for a traced h."""
  return minimum(h * G // 8 * 8, q_rows - rows)


def config_problem(dtype, head_dim: int, page_size: int, group: int,
                   pages_per_block: int = PAGES_PER_BLOCK, k_splits: int = K_SPLITS,
                   stages: int = STAGES) -> str | None:
  """Why the kernel cannot run this configuration (q dtype, head_dim, page_size, query heads per
  KV head, and its own parameters), or None: checked by the kernel and, at start-up, by the
  Sampler for rollout.decode_attention="mosaic"."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"q dtype {jnp.dtype(dtype)} must be bfloat16 or float16 (the WGMMA operand types)"
  if head_dim % 64:
    return f"head_dim {head_dim} must be a multiple of 64"
  rows = q_windows(8 * group, 8)[0]   # the widest window any number of KV heads gives
  if rows > WGMMA_ROWS:
    return (f"{group} query heads per KV head need a window of {rows} rows of q (8-row tiles "
            f"from an offset of up to 7 rows), over the {WGMMA_ROWS}-row tile")
  if page_size % 8:
    return f"page_size {page_size} must be a multiple of 8"
  block_kv = pages_per_block * page_size
  if pages_per_block < 1 or block_kv % 64:
    return (f"pages_per_block {pages_per_block} x page_size {page_size} = {block_kv} keys a step "
            "must be a positive multiple of 64")
  if k_splits < 1 or stages < 1:
    return f"k_splits {k_splits} and stages {stages} must be >= 1"
  need = smem_bytes(head_dim, page_size, pages_per_block, stages, jnp.dtype(dtype).itemsize)
  if need > SMEM_LIMIT_BYTES:
    return (f"stages {stages} x pages_per_block {pages_per_block} need {need} B of shared "
            f"memory a block, over {SMEM_LIMIT_BYTES}: lower one")
  return None


def _check(q, k_pages, v_pages, block_tables, lengths, pages_per_block, k_splits, stages):
  from delta_jax.models.attention import check_paged_decode_inputs
  check_paged_decode_inputs(q, k_pages, v_pages, block_tables, lengths, "paged_decode_mosaic")
  problem = config_problem(q.dtype, q.shape[-1], k_pages.shape[2], q.shape[1] // k_pages.shape[0],
                           pages_per_block, k_splits, stages)
  if problem:
    raise ValueError(f"paged_decode_mosaic: {problem}")


@functools.partial(jax.jit, static_argnames=("pages_per_block", "k_splits", "stages", "pdl"))
def paged_decode_mosaic(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        block_tables: jax.Array, lengths: jax.Array, *, rope=None,
                        pages_per_block: int = PAGES_PER_BLOCK, k_splits: int = K_SPLITS,
                        stages: int = STAGES, pdl: bool = False) -> jax.Array:
  """Decode attention over a page pool (the contract in the module docstring), on Mosaic GPU.
  rope: None, or (cos, sin) float32 [B, D] each: q is rotated by them in the kernel's prologue
  (rope.apply_rope's rotation). pages_per_block pages make one step (pages_per_block * page_size
  must be a multiple of 64), `stages` steps are copied ahead, k_splits blocks share a sequence's
  pages. pdl (an experiment, off by default): the kernel takes part in CUDA's programmatic
  dependent launch; its blocks can start while the kernel before it drains, each waits for that
  kernel's results (griddepcontrol.wait) before it reads any input, and lets the kernel after it
  launch once its pages are read (griddepcontrol.launch_dependents). jax 0.11's Pallas marks
  such a kernel for a PDL launch; jax 0.10 lowers the two instructions without the mark, where
  they wait for nothing."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  _check(q, k_pages, v_pages, block_tables, lengths, pages_per_block, k_splits, stages)
  B, N, D = q.shape
  K, P, page_size, _ = k_pages.shape
  G = N // K
  rows, q_rows, starts = q_windows(N, K)
  D2 = D // 2
  dtype = q.dtype
  k_pages = k_pages.astype(dtype)
  v_pages = v_pages.astype(dtype)
  pages_per_seq = block_tables.shape[1]
  share = -(-pages_per_seq // k_splits)          # pages of a sequence per split
  block_kv = pages_per_block * page_size
  scale = (D ** -0.5) * _LOG2E                   # scores in log2 units: exp2 in the softmax
  tables = block_tables.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  # A block reads `rows` rows of q in place, the window of q_windows around its G rows (the
  # other rows are other heads' queries: rows of a matmul are independent, and their outputs are
  # never stored); only a q whose rows are not a whole number of tiles is padded.
  offsets = [h * G - starts[h] for h in range(K)]   # each head's G rows within its window
  q = jnp.pad(q, ((0, 0), (0, q_rows - N), (0, 0))) if q_rows > N else q
  if rope is not None:
    rope = tuple(jnp.asarray(x, jnp.float32).reshape(B, D) for x in rope)
  swizzle = 128
  tile = (8, swizzle // jnp.dtype(dtype).itemsize)
  transforms = (plgpu.TilingTransform(tile), plgpu.SwizzleTransform(swizzle))
  if rope is not None and (D2 * jnp.dtype(dtype).itemsize) % swizzle:
    # The RoPE prologue loads and stores each half of q's tile, and a slice of a swizzled
    # buffer must cover whole 128-byte atoms (WGMMA wants q's swizzle to be K's): a half row
    # narrower than that (D = 64 in bf16) is rotated by XLA before the call instead.
    from delta_jax.models.rope import apply_rope
    q, rope = apply_rope(q, *rope), None

  def kernel(lengths_ref, tables_ref, q_ref, *refs):
    # the rest of the inputs, the outputs and the scratch buffers, in the order declared below
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None  # noqa: E731
    cos_ref, sin_ref = take(rope is not None), take(rope is not None)
    k_ref, v_ref, o_ref, lse_ref = take(), take(), take(), take(k_splits > 1)
    q_smem, o_smem, k_smem, v_smem = take(), take(), take(), take()
    lse_smem, cs_smem = take(k_splits > 1), take(rope is not None)
    q_bar, k_bar, v_bar = refs
    if pdl:
      plgpu.griddepcontrol_wait()   # the inputs (q, this step's K / V writes) are the last
                                    # kernels' outputs
    b = lax.axis_index("batch")
    h = lax.axis_index("heads")
    split = lax.axis_index("split")
    # the block's window of q rows: q_windows' start, in a form whose multiple of the tile's 8
    # rows the TMA lowering can see (a tiled copy must start on a tile)
    start = pl.multiple_of(window_start(h, G, rows, q_rows, jnp.minimum), 8)
    off = h * G - start                          # its own G rows within the window
    length = lengths_ref[b]
    first = split * share
    # live pages of this split: [first, first + live)
    live = jnp.clip((length + page_size - 1) // page_size - first, 0, share)
    live = jnp.minimum(live, pages_per_seq - first)
    steps = (live + pages_per_block - 1) // pages_per_block
    # keys this block may attend: the row's, within its split (a step can reach past the split's
    # last page, or past the table, whose column is clipped: those keys are masked)
    limit = jnp.minimum(length, jnp.minimum(first + share, pages_per_seq) * page_size)

    def page_ids(step):
      # the pool pages of a step (block-table reads; clipped so a step past the end reads in range)
      cols = [jnp.minimum(first + step * pages_per_block + p, pages_per_seq - 1)
              for p in range(pages_per_block)]
      return [jnp.clip(tables_ref[b, col], 0, P - 1) for col in cols]

    def issue(pages, slot):
      for p, page in enumerate(pages):
        dst = pl.ds(p * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, dst],
                                k_bar.at[slot * pages_per_block + p])
        plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, dst],
                                v_bar.at[slot * pages_per_block + p])

    for i in range(stages):
      @pl.when(i < steps)
      def _():
        issue(page_ids(i), i)

    q_smem[...] = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS, D), dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(start, rows)], q_smem.at[pl.ds(0, rows)],
                            q_bar.at[0])
    if rope is not None:
      plgpu.copy_gmem_to_smem(cos_ref.at[b], cs_smem.at[0], q_bar.at[1])
      plgpu.copy_gmem_to_smem(sin_ref.at[b], cs_smem.at[1], q_bar.at[2])
      plgpu.barrier_wait(q_bar.at[1])
      plgpu.barrier_wait(q_bar.at[2])
    plgpu.barrier_wait(q_bar.at[0])
    if rope is not None:
      # q cos + rotate_half(q) sin in float32 (rotate_half(q) = [-q2, q1]), by halves of the
      # tile; cos and sin are the row's, the same for every row of the tile.
      def half(ref, j, layout):
        return plgpu.layout_cast(ref[..., pl.ds(j * D2, D2)], layout).astype(jnp.float32)

      def row_vector(i, j):
        v = half(cs_smem.at[i], j, plgpu.Layout.WGMMA.reduce(0))
        return lax.broadcast_in_dim(v, (WGMMA_ROWS, D2), [1])
      q1, q2 = half(q_smem, 0, plgpu.Layout.WGMMA), half(q_smem, 1, plgpu.Layout.WGMMA)
      q_smem[:, pl.ds(0, D2)] = (q1 * row_vector(0, 0) - q2 * row_vector(1, 0)).astype(dtype)
      q_smem[:, pl.ds(D2, D2)] = (q2 * row_vector(0, 1) + q1 * row_vector(1, 1)).astype(dtype)
      plgpu.commit_smem()

    def body(step, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(step, jnp.asarray(stages, step.dtype))
      ahead = page_ids(step + stages)    # read now: the table's latency hides under this step
      for p in range(pages_per_block):
        plgpu.barrier_wait(k_bar.at[slot * pages_per_block + p])

      def qk_fn(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]
      s = pl.run_scoped(qk_fn, plgpu.ACC((WGMMA_ROWS, block_kv), jnp.float32))
      token = plgpu.broadcasted_iota(jnp.int32, (WGMMA_ROWS, block_kv), 1,
                                     layout=plgpu.Layout.WGMMA)
      token = token + (first + step * pages_per_block) * page_size
      s = jnp.where(token < limit, s * scale, -jnp.inf)
      m_new = jnp.maximum(m_i, s.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l_i = l_i * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      for pg in range(pages_per_block):
        plgpu.barrier_wait(v_bar.at[slot * pages_per_block + pg])

      def pv_fn(acc_ref):
        plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
        return acc_ref[...]
      acc = acc + pl.run_scoped(pv_fn, plgpu.ACC((WGMMA_ROWS, D), jnp.float32))

      # The step's K/V buffers are free again: copy the step `stages` ahead into them.
      @pl.when(step + stages < steps)
      def _():
        issue(ahead, slot)
      return acc, m_new, l_i

    acc = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS, D), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), -jnp.inf, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS,), jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    acc, m_i, l_i = lax.fori_loop(0, steps, body, (acc, m_i, l_i))
    if pdl:
      plgpu.griddepcontrol_launch_dependents()   # every page read: the next kernel may start

    has = l_i > 0.0
    inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
    out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    # The output goes through an untiled buffer, so its G real rows are one TMA store straight
    # into the [B, N, D] layout the caller reads (no padded rows to slice off afterwards).
    o_smem[...] = out.astype(dtype)
    if k_splits > 1:
      lse_smem[...] = jnp.where(has, m_i / _LOG2E + jnp.log(jnp.where(has, l_i, 1.0)), -jnp.inf)
    plgpu.commit_smem()
    # The rows' offset in the tile is one of the few values of `offsets`: a branch per value
    # keeps the shared-memory slice static (jax 0.11's Mosaic GPU layout inference refuses a
    # dynamic row offset into it; 0.10 accepted one).
    for value in sorted(set(offsets)):
      @pl.when(off == value)
      def _():
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(value, G)],
                                o_ref.at[split, b, pl.ds(h * G, G)])
    if k_splits > 1:
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, b, h])
    plgpu.wait_smem_to_gmem(0)

  scratch = [
      plgpu.SMEM((WGMMA_ROWS, D), dtype, transforms=transforms),
      plgpu.SMEM((WGMMA_ROWS, D), dtype),        # the output, untiled
      plgpu.SMEM((stages, block_kv, D), dtype, transforms=transforms),
      plgpu.SMEM((stages, block_kv, D), dtype, transforms=transforms),
      *([plgpu.SMEM((WGMMA_ROWS,), jnp.float32)] if k_splits > 1 else []),
      *([plgpu.SMEM((2, D), jnp.float32)] if rope is not None else []),   # cos, sin
      plgpu.Barrier(num_barriers=1 if rope is None else 3),   # q (and cos, sin)
      plgpu.Barrier(num_barriers=stages * pages_per_block),
      plgpu.Barrier(num_barriers=stages * pages_per_block),
  ]
  out_type = [jax.ShapeDtypeStruct((k_splits, B, N, D), dtype)]
  if k_splits > 1:  # each split's log-sum-exp, to merge the splits' outputs
    out_type.append(jax.ShapeDtypeStruct((k_splits, B, K, WGMMA_ROWS), jnp.float32))
  call = plgpu.kernel(
      kernel, out_type=tuple(out_type), scratch_types=scratch, grid=(B, K, k_splits),
      grid_names=("batch", "heads", "split"), kernel_name="paged_decode_mosaic",
      compiler_params=plgpu.CompilerParams(approx_math=True))
  o, *lse = call(lengths, tables, q, *(rope or ()), k_pages, v_pages)
  if k_splits == 1:
    return o[0]                                                       # [B, N, D]
  # each head's G rows sit at its window offset in the block's log-sum-exp row
  lse = jnp.stack([lse[0][:, :, h, offsets[h]:offsets[h] + G] for h in range(K)], axis=2)
  lse = lse.reshape(k_splits, B, N)                                   # [S, B, N]
  top = jnp.max(lse, axis=0)
  w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  total = jnp.sum(w, axis=0)
  out = jnp.einsum("sbn,sbnd->bnd", w, o.astype(jnp.float32))
  return (out / jnp.where(total > 0, total, 1.0)[..., None]).astype(dtype)
