"""Paged decode attention on the Pallas Mosaic GPU backend (Hopper: TMA page copies + WGMMA).

    out = paged_decode_mosaic(q, k_pages, v_pages, block_tables, lengths)    # [B, N, D]
    out = paged_decode_mosaic(q, ..., rope=(cos, sin))     # q rotated first, in the kernel
    out, k_pages, v_pages = paged_write_decode_mosaic(     # a layer's whole decode attention:
        qkv, k_pages, v_pages, block_tables, lengths,      #   q / k norms, RoPE, the new key /
        write_page, write_offset, rope=(cos, sin),         #   value written in place, attention
        q_norm=q_norm, k_norm=k_norm)

The contract is delta_jax.models.attention.paged_decode_reference's: q [B, N, D] (one query per
sequence, N = K * G query heads over K key/value heads); k_pages, v_pages [K, P, page_size, D]
(one layer's page pool, read in place); block_tables int32 [B, pages_per_seq] (sequence b's token t
lives at page block_tables[b, t // page_size], offset t % page_size); lengths int32 [B] (sequence
b attends its tokens [0, lengths[b]); 0 gives output 0). Scores q.k accumulate in float32, are
scaled by D ** -0.5, softmax in float32, probabilities cast to v's dtype for the value product
(float32 accumulation). rope=(cos, sin), float32 [B, D] each: q is first rotated by them as
models.rope.apply_rope does (the decode step passes q unrotated, so its RoPE costs no kernel of
its own).

paged_write_decode_mosaic is the same kernel with the rest of a layer's attention step in it
(models.attention.paged_write_attend runs it for rollout.decode_attention "mosaic_fused", an
opt-in until measured on a GPU, where it takes the problem): it reads each KV head's rows of the
new token from the step's one q / k / v GEMM output, normalises and rotates q and k, scores the
new token from registers, attends the older tokens from the pages and writes the new key and
value into the pools, which it takes as jax Refs (aliased in and out of the call: no copy).
Unfused, those are four more kernels a layer (q norm, k norm + RoPE, two scatters; ~230 us of
a batch-64 step of Qwen3-0.6B on an H200, 2026-11-27 anatomy).

Why it exists: jax.experimental.pallas.ops.gpu.paged_attention runs on Pallas' Triton backend,
which jax 0.11 deprecates (issue #16), and no maintained Mosaic GPU paged decode kernel was found:
pallas.ops.gpu has none (its ragged and decode attention are Triton too), and tokamax 0.0.12's
Mosaic GPU attention refuses paging ("Paged attention not supported"; only its XLA path pages).

How it works. One CUDA block (one warpgroup) per (sequence, KV head, split of the pages), or
with rows_per_block R per R consecutive sequences, attended in turn (below). The G
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
with the padding of q to 8 rows a KV head, ~2.1 us). With k_splits > 1 (flash-decoding:
more blocks for a call whose rows x KV heads leave SMs idle, the draining tail of a rollout)
a row's live pages are cut into k_splits equal shares of whole steps (from its length, so a
row far shorter than its table still spreads over every split), each split writes its
normalised partial output and log-sum-exp, and the splits are merged in jnp (merge_splits,
one kernel a layer); auto_splits is the rule rollout.decode_splits=0 picks a call's splits by.
With rows_per_block R > 1 a block's page copies are one stream over its R rows (row r's
steps follow row r - 1's in the stages' buffers), and a row's q window (with `write`, its key /
value rows, in one of two buffers by the row's parity) is copied in as soon as the previous
row's last step is done, so a row's first pages and its prologue's inputs are in flight while the
previous row's output is normalised and stored. The reason to try it: the kernel took 81.4 us
a call at batch 64 and 1,024 live tokens, 79% of copy, against 93.5% at batch 256 (fifth run).
At batch 64 one row a block is 512 blocks, about two waves over an H200's 264 block slots (two
on each of 132 SMs), so each block's start (its first copies' latency, q's prologue) and end
(its output's store), with little in flight, weigh more than over 256's eight waves; two rows a
block make 256 blocks, one wave. Whether that is faster is not measured yet (`gpu_bench.sh
paged_rows decode_rows`); the default stays 1.

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
# of output tile and 2 x 2 x 16 KiB of K/V, 96 KiB of shared memory a block (98 with the
# log-sum-exp rows of k_splits > 1), two blocks an SM
# (the sweep ran with the output in q's tile: 80 KiB, also two). The fastest of 15 settings at
# batch 64 and 256 (81.4 / 273.6 us against 89.0 / 321.8 us with 3 steps in flight, the earlier
# default; 4 in flight and 4 pages a step were slower too); the whole decode at batch 256 ran
# 27,197 tokens/s against 23,678.
PAGES_PER_BLOCK = 2
STAGES = 2
K_SPLITS = 1
# Rows (sequences) a block attends one after another, its page copies one stream across them
# (rows_per_block): 1 until measured otherwise on a GPU (an experiment: benchmarks/
# paged_attention.py --rows-per-block, decode_throughput.py --mosaic-rows).
ROWS_PER_BLOCK = 1
# The most splits auto_splits gives a row's pages.
MAX_SPLITS = 8
# float32 columns of a split's log-sum-exp rows (the value in each): 32-byte rows, so a head's
# rows start 16-byte aligned in shared memory, as a TMA store needs.
LSE_COLS = 8
_LOG2E = math.log2(math.e)
# Shared memory a block may use on Hopper (H100 / H200: 227 KiB opt-in).
SMEM_LIMIT_BYTES = 227 * 1024


def smem_bytes(head_dim: int, page_size: int, pages_per_block: int, stages: int,
               itemsize: int = 2, fused: bool = False, rows_per_block: int = 1) -> int:
  """Shared memory of one block: the q tile, the output tile, `stages` steps of K and V pages
  and the log-sum-exp rows of k_splits > 1 (counted always; barriers aside); with `fused`
  (paged_write_decode_mosaic) also the new key / value rows (two rows' worth with
  rows_per_block > 1: the next row's arrive while this row's are stored) and the float32
  cos / sin and norm weight rows."""
  kv_rows = 2 * min(rows_per_block, 2)
  extra = (kv_rows * itemsize + 4 * 4) * head_dim if fused else 0   # k / v rows, 4 f32 rows
  return (2 * WGMMA_ROWS * head_dim * itemsize
          + 2 * stages * pages_per_block * page_size * head_dim * itemsize
          + 4 * WGMMA_ROWS * LSE_COLS
          + extra)


def auto_splits(rows: int, num_kv_heads: int, cores: int,
                rows_per_block: int = ROWS_PER_BLOCK, max_splits: int = MAX_SPLITS) -> int:
  """The k_splits of a call with `rows` rows (sequences) and num_kv_heads KV heads on a GPU of
  `cores` SMs: the fewest, a power of two up to max_splits, that give the call at least one
  block per SM (ceil(rows / rows_per_block) x num_kv_heads x k_splits >= cores). At Qwen3's 8
  KV heads on a 132-SM H100 / H200: 4 splits at 8 rows, 2 at 16, 1 from 32 rows on."""
  if rows < 1 or num_kv_heads < 1 or cores < 1 or max_splits < 1:
    raise ValueError(f"auto_splits: rows {rows}, num_kv_heads {num_kv_heads}, cores {cores} and "
                     f"max_splits {max_splits} must be >= 1")
  blocks = -(-rows // rows_per_block) * num_kv_heads
  splits = 1
  while splits < max_splits and blocks * splits < cores:
    splits *= 2
  return splits


def merge_splits(o: jax.Array, lse: jax.Array) -> jax.Array:
  """The attention of a row over all its splits from each split's normalised output o
  [S, B, N, D] and log-sum-exp lse [S, B, N] (-inf: a split with no key; its output 0), in
  float32: the splits folded in one at a time as the kernel's online softmax folds its steps.
  Elementwise only, on the kernel's outputs as they are (each head's log-sum-exp rows stored
  beside its output rows, column 0 read here), so XLA makes one kernel a layer of it (a
  deviceless compile for an H100, 2026-11-27; gathering the heads' rows out of whole 64-row
  tiles first was a second). A row no split attends gives 0."""
  finite = jnp.isfinite
  m = lse[0]
  acc = o[0].astype(jnp.float32)
  total = finite(m).astype(jnp.float32)
  for s in range(1, o.shape[0]):
    new = jnp.maximum(m, lse[s])
    base = jnp.where(finite(new), new, 0.0)
    old_w = jnp.where(finite(m), jnp.exp(m - base), 0.0)
    new_w = jnp.where(finite(lse[s]), jnp.exp(lse[s] - base), 0.0)
    acc = acc * old_w[..., None] + o[s].astype(jnp.float32) * new_w[..., None]
    total, m = total * old_w + new_w, new
  return acc / jnp.where(total > 0, total, 1.0)[..., None]


def _row_share(n, page_size: int, pages_per_block: int, k_splits: int, pages_per_seq: int):
  """Pages of a row's table each of its k_splits blocks reads from, for a row of n tokens in the
  pages (traced): split j reads [j share, (j + 1) share). One split: the whole table (a static
  int). More: ceil(live pages / k_splits) rounded up to whole steps of pages_per_block, so a
  split's steps never reach into the next split's pages and the last split's end no further
  than the row's last step."""
  if k_splits == 1:
    return pages_per_seq
  pages = (n + page_size - 1) // page_size
  per = (pages + k_splits - 1) // k_splits
  return (per + pages_per_block - 1) // pages_per_block * pages_per_block


def q_windows(num_heads: int, num_kv_heads: int,
              stride: int | None = None) -> tuple[int, int, list[int]]:
  """(rows, q_rows, starts): the window of q's rows each block copies, for q [B, num_heads, D]
  with G = num_heads / num_kv_heads query heads a KV head, KV head h's at rows
  [h stride, h stride + G) (stride G, the default: q as it is; G + 2 for the fused kernel's
  rows of a KV head, its queries then its key and value). KV head h's block copies rows
  [starts[h], starts[h] + rows) (q padded to q_rows rows where its rows are not a whole
  number of 8-row tiles). A TMA copy into the tiled q tile moves whole 8-row tiles, so every
  start is a multiple of 8 (a copy from an unaligned row would read the wrong rows on a GPU;
  jax 0.11's lowering refuses it, jax 0.10's and the CPU interpreter did not), and the window
  covers the head's G rows."""
  G = num_heads // num_kv_heads
  stride = G if stride is None else stride
  rows = -(-max(h * stride % 8 + G for h in range(num_kv_heads)) // 8) * 8
  q_rows = -(-max(num_kv_heads * stride, rows) // 8) * 8
  return rows, q_rows, [window_start(h, stride, rows, q_rows) for h in range(num_kv_heads)]


def window_start(h, stride: int, rows: int, q_rows: int, minimum=min):
  """KV head h's window start (q_windows'): the tile holding its first row, moved back where the
  window would reach past q's q_rows rows. minimum: min, or jnp.minimum for a traced h."""
  return minimum(h * stride // 8 * 8, q_rows - rows)


def config_problem(dtype, head_dim: int, page_size: int, group: int,
                   pages_per_block: int = PAGES_PER_BLOCK, k_splits: int = K_SPLITS,
                   stages: int = STAGES, fused: bool = False,
                   rows_per_block: int = ROWS_PER_BLOCK) -> str | None:
  """Why the kernel cannot run this configuration (q dtype, head_dim, page_size, query heads per
  KV head, and its own parameters), or None: checked by the kernel and, at start-up, by the
  Sampler for rollout.decode_attention="mosaic". fused: for paged_write_decode_mosaic, which
  also needs each half of a head to be whole 128-byte swizzle atoms (its RoPE and norms work
  on the halves of q's swizzled tile: head_dim 128 in bf16)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"q dtype {jnp.dtype(dtype)} must be bfloat16 or float16 (the WGMMA operand types)"
  if head_dim % 64:
    return f"head_dim {head_dim} must be a multiple of 64"
  if fused and (head_dim // 2 * jnp.dtype(dtype).itemsize) % 128:
    return (f"head_dim {head_dim} in {jnp.dtype(dtype).name}: the fused write + attention "
            "needs halves of a head of whole 128-byte swizzle atoms (head_dim 128 in bf16)")
  # the widest window any number of KV heads gives
  rows = q_windows(8 * group, 8, group + 2 if fused else group)[0]
  if rows > WGMMA_ROWS:
    return (f"{group} query heads per KV head need a window of {rows} rows of q (8-row tiles "
            f"from an offset of up to 7 rows), over the {WGMMA_ROWS}-row tile")
  if page_size % 8:
    return f"page_size {page_size} must be a multiple of 8"
  block_kv = pages_per_block * page_size
  if pages_per_block < 1 or block_kv % 64:
    return (f"pages_per_block {pages_per_block} x page_size {page_size} = {block_kv} keys a step "
            "must be a positive multiple of 64")
  if k_splits < 1 or stages < 1 or rows_per_block < 1:
    return (f"k_splits {k_splits}, stages {stages} and rows_per_block {rows_per_block} must "
            "be >= 1")
  need = smem_bytes(head_dim, page_size, pages_per_block, stages, jnp.dtype(dtype).itemsize,
                    fused, rows_per_block)
  if need > SMEM_LIMIT_BYTES:
    return (f"stages {stages} x pages_per_block {pages_per_block} need {need} B of shared "
            f"memory a block, over {SMEM_LIMIT_BYTES}: lower one")
  return None


def _check(q, k_pages, v_pages, block_tables, lengths, pages_per_block, k_splits, stages,
           rows_per_block, fused=False):
  from delta_jax.models.attention import check_paged_decode_inputs
  who = "paged_write_decode_mosaic" if fused else "paged_decode_mosaic"
  check_paged_decode_inputs(q, k_pages, v_pages, block_tables, lengths, who)
  problem = config_problem(q.dtype, q.shape[-1], k_pages.shape[2], q.shape[1] // k_pages.shape[0],
                           pages_per_block, k_splits, stages, fused, rows_per_block)
  if fused and not problem and (k_pages.dtype != q.dtype or v_pages.dtype != q.dtype):
    problem = (f"the pools ({k_pages.dtype} / {v_pages.dtype}) must be in q's dtype {q.dtype} "
               "(they are written in place)")
  if problem:
    raise ValueError(f"{who}: {problem}")


@functools.partial(jax.jit, static_argnames=("pages_per_block", "k_splits", "stages",
                                             "rows_per_block", "pdl"))
def paged_decode_mosaic(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        block_tables: jax.Array, lengths: jax.Array, *, rope=None,
                        pages_per_block: int = PAGES_PER_BLOCK, k_splits: int = K_SPLITS,
                        stages: int = STAGES, rows_per_block: int = ROWS_PER_BLOCK,
                        pdl: bool = False) -> jax.Array:
  """Decode attention over a page pool (the contract in the module docstring), on Mosaic GPU.
  rope: None, or (cos, sin) float32 [B, D] each: q is rotated by them in the kernel's prologue
  (rope.apply_rope's rotation). pages_per_block pages make one step (pages_per_block * page_size
  must be a multiple of 64), `stages` steps are copied ahead, k_splits blocks share a sequence's
  pages, and a block attends rows_per_block rows (sequences) one after another, with one stream
  of page copies across them: the next row's first pages and its q arrive while this row
  finishes (fewer blocks: at batch 64 with 2 rows a block, 256 blocks of (row pair, KV head),
  one wave of two blocks an SM on an H200's 132 SMs, where one row a block makes 512).
  pdl (an experiment, off by default): the kernel takes part in CUDA's programmatic
  dependent launch; its blocks can start while the kernel before it drains, each waits for that
  kernel's results (griddepcontrol.wait) before it reads any input, and lets the kernel after it
  launch once its pages are read (griddepcontrol.launch_dependents). jax 0.11's Pallas marks
  such a kernel for a PDL launch; jax 0.10 lowers the two instructions without the mark, where
  they wait for nothing."""
  _check(q, k_pages, v_pages, block_tables, lengths, pages_per_block, k_splits, stages,
         rows_per_block)
  return _run(q, k_pages, v_pages, block_tables, lengths, num_heads=q.shape[1], rope=rope,
              pages_per_block=pages_per_block, k_splits=k_splits, stages=stages,
              rows_per_block=rows_per_block, pdl=pdl)


@functools.partial(jax.jit, static_argnames=("eps", "pages_per_block", "k_splits", "stages",
                                             "rows_per_block", "pdl"))
def paged_write_decode_mosaic(qkv: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, lengths: jax.Array,
                              write_page: jax.Array, write_offset: jax.Array, *, rope,
                              q_norm=None, k_norm=None, eps: float = 1e-6,
                              pages_per_block: int = PAGES_PER_BLOCK, k_splits: int = K_SPLITS,
                              stages: int = STAGES, rows_per_block: int = ROWS_PER_BLOCK,
                              pdl: bool = False):
  """One layer's decode step of attention in one kernel: the new token's q / k RMSNorm and RoPE,
  its key and value written into the pools, and the attention (models.attention.paged_write_attend's
  contract, which runs it).

  qkv [B, K, G + 2, D]: row b's projections of its new token by KV head h (N = K G query heads,
  query head h G + g at qkv[b, h, g]), unnormalised and unrotated: qkv[b, h, :G] the head's
  queries, qkv[b, h, G] its key, qkv[b, h, G + 1] its value (the layout of
  models.Transformer.decode_layers' qkv_proj: one GEMM makes it, split the same way by tensor
  parallelism as the pools' KV heads).
  q_norm, k_norm: None, or the [D] weights of an RMSNorm over each head (models.norm.rms_norm,
  with eps), applied first; rope = (cos, sin) float32 [B, D] each, then applied to q and k.
  lengths [B]: row b's tokens with the new one (it attends [0, lengths[b]): the last from qkv,
  the others from its pages; 0 = none, output 0); write_page, write_offset int32 [B]: where the
  new key and value go (page -1: not written). Returns (out [B, N, D], k_pages, v_pages): the
  pools are the kernel's in place (jax Refs aliased in and out of the Mosaic GPU call), so a
  caller that donates them, or carries them through a loop, copies nothing.

  Against the unfused step (XLA's q norm, k norm + RoPE, two scatters, then paged_decode_mosaic)
  it saves four kernels a layer; a block reads its KV head's key and value rows beside its q
  window. Written values are the unfused step's (each rounded to the model's dtype where XLA
  rounds them); the new token's score is an fp32 dot of the rounded q and k (WGMMA's for the
  pages). Each (row, KV head) has one writer: the block of the split whose pages hold the slot,
  after its own page reads (the slot is past the tokens it attends, but on a page it reads);
  no other block reads that page. Needs rope, a pool of q's
  dtype and whole 128-byte halves of a head (head_dim 128 in bf16: config_problem(fused=True))."""
  K = k_pages.shape[0]
  if qkv.ndim != 4 or qkv.shape[1] != K or qkv.shape[2] < 3:
    raise ValueError(f"paged_write_decode_mosaic: qkv {qkv.shape} must be [B, K={K}, G + 2, D] "
                     "(each KV head's G >= 1 queries, then its key and value)")
  B, _, G2, D = qkv.shape
  G = G2 - 2
  _check(jax.ShapeDtypeStruct((B, K * G, D), qkv.dtype), k_pages, v_pages, block_tables,
         lengths, pages_per_block, k_splits, stages, rows_per_block, fused=True)
  if rope is None:
    raise ValueError("paged_write_decode_mosaic: rope (cos, sin) is required")
  if write_page.shape != (B,) or write_offset.shape != (B,):
    raise ValueError(f"paged_write_decode_mosaic: write_page {write_page.shape} and "
                     f"write_offset {write_offset.shape} must be [B={B}]")
  if (q_norm is None) != (k_norm is None):
    raise ValueError("paged_write_decode_mosaic: q_norm and k_norm go together (both or none)")
  norms = None
  if q_norm is not None:
    # each its own input (stacking them would be a kernel a layer and step); one dtype in shared
    # memory, used in float32
    norms = (q_norm, k_norm.astype(q_norm.dtype))
    if q_norm.shape != (D,) or k_norm.shape != (D,):
      raise ValueError(f"paged_write_decode_mosaic: q_norm {q_norm.shape} and k_norm "
                       f"{k_norm.shape} must be [head_dim={D}]")
  return _run(qkv.reshape(B, K * G2, D), k_pages, v_pages, block_tables, lengths,
              num_heads=K * G, rope=rope, pages_per_block=pages_per_block, k_splits=k_splits,
              stages=stages, rows_per_block=rows_per_block, pdl=pdl,
              write=(write_page.astype(jnp.int32), write_offset.astype(jnp.int32)), norms=norms,
              eps=eps)


def _run(q, k_pages, v_pages, block_tables, lengths, *, num_heads, rope, pages_per_block,
         k_splits, stages, pdl, rows_per_block=1, write=None, norms=None, eps=1e-6):
  """The kernel of paged_decode_mosaic (write None: q [B, N, D]) and of
  paged_write_decode_mosaic (write = (write_page, write_offset): q is its qkv as
  [B, K (G + 2), D], norms its (q_norm, k_norm) weights [D] or None)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  fused = write is not None
  B, _, D = q.shape
  N = num_heads
  K, P, page_size, _ = k_pages.shape
  G = N // K
  stride = G + 2 if fused else G                 # rows of q a KV head's rows start apart
  rows, q_rows, starts = q_windows(N, K, stride)
  D2 = D // 2
  dtype = q.dtype
  k_pages = k_pages.astype(dtype)
  v_pages = v_pages.astype(dtype)
  pages_per_seq = block_tables.shape[1]
  block_kv = pages_per_block * page_size
  scale = (D ** -0.5) * _LOG2E                   # scores in log2 units: exp2 in the softmax
  tables = block_tables.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  # A block reads `rows` rows of q in place, the window of q_windows around its G rows (the
  # other rows are other heads' queries, or with `write` keys and values: rows of a matmul are
  # independent, and their outputs are never stored); only a q with fewer rows than the windows
  # reach is padded.
  offsets = [h * stride - starts[h] for h in range(K)]   # each head's G rows in its window
  q = jnp.pad(q, ((0, 0), (0, q_rows - q.shape[1]), (0, 0))) if q_rows > q.shape[1] else q
  if rope is not None:
    rope = tuple(jnp.asarray(x, jnp.float32).reshape(B, D) for x in rope)
  swizzle = 128
  tile = (8, swizzle // jnp.dtype(dtype).itemsize)
  transforms = (plgpu.TilingTransform(tile), plgpu.SwizzleTransform(swizzle))
  if rope is not None and (D2 * jnp.dtype(dtype).itemsize) % swizzle:
    # The RoPE prologue loads and stores each half of q's tile, and a slice of a swizzled
    # buffer must cover whole 128-byte atoms (WGMMA wants q's swizzle to be K's): a half row
    # narrower than that (D = 64 in bf16) is rotated by XLA before the call instead (the fused
    # kernel refuses it: config_problem).
    from delta_jax.models.rope import apply_rope
    q, rope = apply_rope(q, *rope), None
  # the prologue's TMA copies, one barrier each: q's window, cos, sin, the new key row, its value
  # row (each row's), the norm weights (once a block)
  row_copies = ["q"] + ["cos", "sin"] * (rope is not None) + ["k", "v"] * fused
  copies = row_copies + ["q_norm", "k_norm"] * (norms is not None)
  bar_of = {name: i for i, name in enumerate(copies)}
  R = rows_per_block

  def kernel(lengths_ref, tables_ref, q_ref, *refs):
    # the rest of the inputs, the outputs and the scratch buffers, in the order declared below
    refs = list(refs)
    take = lambda present=True: refs.pop(0) if present else None  # noqa: E731
    cos_ref, sin_ref = take(rope is not None), take(rope is not None)
    q_norm_ref, k_norm_ref = take(norms is not None), take(norms is not None)
    page_ref, offset_ref = take(fused), take(fused)
    k_ref, v_ref, o_ref, lse_ref = take(), take(), take(), take(k_splits > 1)
    q_smem, o_smem, k_smem, v_smem = take(), take(), take(), take()
    lse_smem, cs_smem = take(k_splits > 1), take(rope is not None)
    kv_smem, norms_smem = take(fused), take(norms is not None)
    q_bar, k_bar, v_bar = refs
    if pdl:
      plgpu.griddepcontrol_wait()   # the inputs (q, this step's K / V writes) are the last
                                    # kernels' outputs
    h = lax.axis_index("heads")
    split = lax.axis_index("split")
    # the block's window of q rows: q_windows' start, in a form whose multiple of the tile's 8
    # rows the TMA lowering can see (a tiled copy must start on a tile)
    start = pl.multiple_of(window_start(h, stride, rows, q_rows, jnp.minimum), 8)
    off = h * stride - start                     # its own G rows within the window
    # The block's rows: R consecutive rows from row_0; a row past B (the last block of a batch
    # R does not divide) has length 0 and is neither read nor stored.
    row_0 = lax.axis_index("batch") * R
    bs = [jnp.minimum(row_0 + r, B - 1) if R > 1 else row_0 for r in range(R)]
    valid = [row_0 + r < B for r in range(R)]
    lengths_r = [jnp.where(valid[r], lengths_ref[bs[r]], 0) if R > 1 else lengths_ref[bs[r]]
                 for r in range(R)]
    # tokens read from the pages: all of them, or with `write` all but the new one
    paged = [jnp.maximum(n - 1, 0) if fused else n for n in lengths_r]
    # Each row's pages in k_splits shares: split j reads pages [j share, (j + 1) share) of the
    # row's table. One split: the whole table. More: the row's live pages in equal shares of
    # whole steps (_row_share), so every split of a long row has work whatever the table's
    # width (a share of the table's width would leave the later splits of a row shorter than
    # the table with nothing to read).
    shares = [_row_share(n, page_size, pages_per_block, k_splits, pages_per_seq)
              for n in paged]
    firsts = [split * share for share in shares]
    steps, bases = [], [0]
    for n, first, share in zip(paged, firsts, shares):
      # live pages of this split: [first, first + live)
      live = jnp.clip((n + page_size - 1) // page_size - first, 0, share)
      live = jnp.minimum(live, pages_per_seq - first)
      steps.append((live + pages_per_block - 1) // pages_per_block)
      bases.append(bases[-1] + steps[-1])        # the row's first step in the block's stream
    total = bases[-1]

    def page_ids(g):
      # the pool pages of step g of the block's stream (row r's steps are [bases[r],
      # bases[r + 1])): block-table reads, clipped so a step past the end reads in range
      b, local, first = bs[0], g, firsts[0]
      for r in range(1, R):
        later = g >= bases[r]
        b, local = jnp.where(later, bs[r], b), jnp.where(later, g - bases[r], local)
        first = jnp.where(later, firsts[r], first)
      cols = [jnp.minimum(first + local * pages_per_block + p, pages_per_seq - 1)
              for p in range(pages_per_block)]
      return [jnp.clip(tables_ref[b, col], 0, P - 1) for col in cols]

    def issue(pages, slot):
      for p, page in enumerate(pages):
        dst = pl.ds(p * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, dst],
                                k_bar.at[slot * pages_per_block + p])
        plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, dst],
                                v_bar.at[slot * pages_per_block + p])

    def load_row(r):
      # row r's q window, cos / sin rows and new key / value rows (into its parity's buffer)
      b = bs[r]
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(start, rows)], q_smem.at[pl.ds(0, rows)],
                              q_bar.at[bar_of["q"]])
      if rope is not None:
        plgpu.copy_gmem_to_smem(cos_ref.at[b], cs_smem.at[0], q_bar.at[bar_of["cos"]])
        plgpu.copy_gmem_to_smem(sin_ref.at[b], cs_smem.at[1], q_bar.at[bar_of["sin"]])
      if fused:
        kv = kv_smem.at[r % 2]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(h * stride + G, 1)], kv.at[pl.ds(0, 1)],
                                q_bar.at[bar_of["k"]])
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(h * stride + G + 1, 1)], kv.at[pl.ds(1, 1)],
                                q_bar.at[bar_of["v"]])

    for i in range(stages):
      @pl.when(i < total)
      def _():
        issue(page_ids(i), i)

    q_smem[...] = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS, D), dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    load_row(0)
    if norms is not None:
      plgpu.copy_gmem_to_smem(q_norm_ref, norms_smem.at[0], q_bar.at[bar_of["q_norm"]])
      plgpu.copy_gmem_to_smem(k_norm_ref, norms_smem.at[1], q_bar.at[bar_of["k_norm"]])

    def rounded(x):  # as XLA rounds each step's result to the model's dtype
      return x.astype(dtype).astype(jnp.float32)

    def half(ref, j, layout):
      return plgpu.layout_cast(ref[..., pl.ds(j * D2, D2)], layout).astype(jnp.float32)

    def row_vector(ref, j):  # half j of a [D] row, the same for every row of the tile
      v = half(ref, j, plgpu.Layout.WGMMA.reduce(0))
      return lax.broadcast_in_dim(v, (WGMMA_ROWS, D2), [1])

    def rms_norm(x1, x2, weight_ref):  # models.norm.rms_norm over D, the halves of each row
      ss = (x1 * x1).sum(axis=1) + (x2 * x2).sum(axis=1)
      inv = lax.broadcast_in_dim(lax.rsqrt(ss * (1.0 / D) + eps), (WGMMA_ROWS, D2), [0])
      return (rounded(x1 * inv * row_vector(weight_ref, 0)),
              rounded(x2 * inv * row_vector(weight_ref, 1)))

    def rotate(x1, x2):  # x cos + rotate_half(x) sin in float32 (rotate_half(x) = [-x2, x1])
      return (rounded(x1 * row_vector(cs_smem.at[0], 0) - x2 * row_vector(cs_smem.at[1], 0)),
              rounded(x2 * row_vector(cs_smem.at[0], 1) + x1 * row_vector(cs_smem.at[1], 1)))

    for r in range(R):
      b, length, old, first, share = bs[r], lengths_r[r], paged[r], firsts[r], shares[r]
      # keys this block may attend: the row's, within its split (a step can reach past the
      # split's last page, or past the table, whose column is clipped: those keys are masked)
      limit = jnp.minimum(old, jnp.minimum(first + share, pages_per_seq) * page_size)
      for name in (copies if r == 0 else row_copies):
        plgpu.barrier_wait(q_bar.at[bar_of[name]])
      if r > 0:
        # the previous row's stores have read o_smem (and its parity's key / value rows)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      if rope is not None:
        # q normalised (with `norms`) and rotated in float32 by halves of the tile; cos and sin
        # are the row's, the same for every row of the tile.
        q1, q2 = half(q_smem, 0, plgpu.Layout.WGMMA), half(q_smem, 1, plgpu.Layout.WGMMA)
        if norms is not None:
          q1, q2 = rms_norm(q1, q2, norms_smem.at[0])
        q1, q2 = rotate(q1, q2)
        q_smem[:, pl.ds(0, D2)] = q1.astype(dtype)
        q_smem[:, pl.ds(D2, D2)] = q2.astype(dtype)
        plgpu.commit_smem()

      m_i = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS,), jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.zeros((WGMMA_ROWS, D), jnp.float32), plgpu.Layout.WGMMA)
      if fused:
        kv = kv_smem.at[r % 2]
        # The new key: normalised and rotated as q, its score an fp32 dot with the rounded q; it
        # waits in the output buffer (free until the end) for its write to the pool.
        k1, k2 = row_vector(kv.at[0], 0), row_vector(kv.at[0], 1)
        if norms is not None:
          k1, k2 = rms_norm(k1, k2, norms_smem.at[1])
        k1, k2 = rotate(k1, k2)
        s_new = ((q1 * k1).sum(axis=1) + (q2 * k2).sum(axis=1)) * scale
        o_smem[:, pl.ds(0, D2)] = k1.astype(dtype)
        o_smem[:, pl.ds(D2, D2)] = k2.astype(dtype)   # committed by the fence before its store
        # One block of a (row, KV head) writes its key and value: the split whose pages hold
        # the new token's slot (its page is the row's last: a split whose block reads it is this
        # one, which writes after its reads). The softmax of that split starts from the new
        # token (weight 1, its value); the other splits and rows of length 0 start empty, from
        # the same reference maximum, which only rescales.
        owner = jnp.minimum(old // page_size // jnp.maximum(share, 1), k_splits - 1)
        mine = split == owner
        counts = (mine & (length > 0)).astype(jnp.float32)
        v_row = plgpu.layout_cast(kv.at[1][...], plgpu.Layout.WGMMA.reduce(0))
        acc = lax.broadcast_in_dim(v_row.astype(jnp.float32), (WGMMA_ROWS, D), [1]) * counts
        m_i = s_new
        l_i = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), 1.0, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(1)) * counts

      def body(step, carry, base=bases[r], limit=limit, first=first):
        acc, m_i, l_i = carry
        g = base + step                  # the step's place in the block's stream of copies
        slot = lax.rem(g, jnp.asarray(stages, g.dtype))
        ahead = page_ids(g + stages)     # read now: the table's latency hides under this step
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

        # The step's K/V buffers are free again: copy the step `stages` ahead into them (the
        # next row's first steps, after this row's last).
        @pl.when(g + stages < total)
        def _():
          issue(ahead, slot)
        return acc, m_new, l_i

      acc, m_i, l_i = lax.fori_loop(0, steps[r], body, (acc, m_i, l_i))
      if r + 1 < R:
        # The next row's q and rows come in while this one finishes: its q tile's last reader,
        # the WGMMA above, is done, and a proxy fence orders this row's reads of q, cos / sin
        # (the new key's RoPE) before the copies' writes (jax 0.11's interpreter reports them
        # racing without it); its key / value rows go to the other parity's buffer.
        plgpu.commit_smem()
        load_row(r + 1)
      elif pdl:
        plgpu.griddepcontrol_launch_dependents()   # every page read: the next kernel may start

      has = l_i > 0.0
      inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      if fused:
        # The new key and value to the pools (page -1: a row not to write), now that every page
        # this block reads has arrived: the slot is on a page it may have read (masked).
        wpage = page_ref[b]
        # a proxy fence: the key row written to o_smem, and the page reads this thread waited
        # for, come before the TMA's stores (the Mosaic GPU interpreter of jax 0.11 orders the
        # reads by it; without it, it reports the slot's store racing with its page's read)
        plgpu.commit_smem()

        @pl.when((wpage >= 0) & mine & valid[r])
        def _():
          at = (h, jnp.clip(wpage, 0, P - 1), pl.ds(offset_ref[b], 1))
          plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, 1)], k_ref.at[at])
          plgpu.copy_smem_to_gmem(kv.at[pl.ds(1, 1)], v_ref.at[at])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the key's row has left o_smem
      # The output goes through an untiled buffer, so its G real rows are one TMA store straight
      # into the [B, N, D] layout the caller reads (no padded rows to slice off afterwards).
      o_smem[...] = out.astype(dtype)
      if k_splits > 1:
        # each row's log-sum-exp across a row of LSE_COLS (16-byte-aligned rows, so that a
        # head's G rows are one TMA store beside its output's)
        lse = jnp.where(has, m_i / _LOG2E + jnp.log(jnp.where(has, l_i, 1.0)), -jnp.inf)
        lse_smem[...] = lax.broadcast_in_dim(lse, (WGMMA_ROWS, LSE_COLS), [0])
      plgpu.commit_smem()
      # The rows' offset in the tile is one of the few values of `offsets`: a branch per value
      # keeps the shared-memory slice static (jax 0.11's Mosaic GPU layout inference refuses a
      # dynamic row offset into it; 0.10 accepted one).
      for value in sorted(set(offsets)):
        @pl.when((off == value) & valid[r])
        def _():
          plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(value, G)],
                                  o_ref.at[split, b, pl.ds(h * G, G)])
          if k_splits > 1:
            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(value, G)],
                                    lse_ref.at[split, b, pl.ds(h * G, G)])
    plgpu.wait_smem_to_gmem(0)

  scratch = [
      plgpu.SMEM((WGMMA_ROWS, D), dtype, transforms=transforms),
      plgpu.SMEM((WGMMA_ROWS, D), dtype),        # the output, untiled
      plgpu.SMEM((stages, block_kv, D), dtype, transforms=transforms),
      plgpu.SMEM((stages, block_kv, D), dtype, transforms=transforms),
      *([plgpu.SMEM((WGMMA_ROWS, LSE_COLS), jnp.float32)] if k_splits > 1 else []),
      *([plgpu.SMEM((2, D), jnp.float32)] if rope is not None else []),   # cos, sin
      *([plgpu.SMEM((min(R, 2), 2, D), dtype)] if fused else []),   # new k, v rows (by parity)
      *([plgpu.SMEM((2, D), norms[0].dtype)] if norms is not None else []),  # q, k norms
      plgpu.Barrier(num_barriers=len(copies)),   # the prologue's copies
      plgpu.Barrier(num_barriers=stages * pages_per_block),
      plgpu.Barrier(num_barriers=stages * pages_per_block),
  ]
  out_type = [jax.ShapeDtypeStruct((k_splits, B, N, D), dtype)]
  if k_splits > 1:  # each split's log-sum-exp (in column 0), to merge the splits' outputs
    out_type.append(jax.ShapeDtypeStruct((k_splits, B, N, LSE_COLS), jnp.float32))
  params = plgpu.CompilerParams(approx_math=True)
  grid = dict(grid=(-(-B // R), K, k_splits), grid_names=("batch", "heads", "split"))
  inputs = (lengths, tables, q, *(rope or ()), *(norms or ()), *(write or ()))
  if fused:
    # The pools as jax Refs in global memory: the kernel writes them in place, and Pallas aliases
    # them in and out of the custom call (plgpu.kernel's batching wrapper takes no Ref, so the
    # mesh kernel is made here as plgpu.kernel makes it).
    def with_scratch(*refs):
      pl.run_scoped(lambda *scratch_refs: kernel(*refs, *scratch_refs), *scratch)
    call = pl.kernel(with_scratch, out_type=tuple(out_type), mesh=plgpu.Mesh(**grid),
                     compiler_params=params, name="paged_write_decode_mosaic")
    k_pool = jax.new_ref(k_pages, memory_space=plgpu.GMEM)
    v_pool = jax.new_ref(v_pages, memory_space=plgpu.GMEM)
    o, *lse = call(*inputs, k_pool, v_pool)
  else:
    call = plgpu.kernel(kernel, out_type=tuple(out_type), scratch_types=scratch, **grid,
                        kernel_name="paged_decode_mosaic", compiler_params=params)
    o, *lse = call(*inputs, k_pages, v_pages)
  if k_splits == 1:
    out = o[0]                                                       # [B, N, D]
  else:
    out = merge_splits(o, lse[0][..., 0]).astype(dtype)
  if fused:
    return out, k_pool[...], v_pool[...]
  return out
