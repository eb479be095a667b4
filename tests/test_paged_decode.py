"""kernels/paged_decode.py: the Mosaic GPU paged decode attention.

On any machine: the kernel itself run by Mosaic GPU's interpreter (tests/mosaic_interpret.py:
simulated shared memory, TMA copies and barriers, NaN-filled fresh memory, out-of-bounds reads
raising, the race detector on) against the jnp reference (models.attention.paged_decode_reference)
on scrambled pages with ragged lengths; its lowering to the Mosaic GPU dialect for CUDA
(jax.export), which runs Mosaic GPU's own checks of register layouts, WGMMA and TMA shapes and
the shared-memory budget, at the model shapes the rollout uses; its input checks. Where a GPU is:
the compiled kernel against the same reference.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from delta_jax.kernels import paged_decode as PD
from delta_jax.models import attention as A
from tests import mosaic_interpret
from delta_jax.sampling.programs import abstract_decode_args
from tests.test_attention import paged_case

needs_interpreter = pytest.mark.skipif(mosaic_interpret.available() is not None,
                                       reason=str(mosaic_interpret.available()))


def test_the_interpreter_runs_under_the_jax_it_was_written_for():
  """On jax 0.10 and 0.11 (the CPU venv's and the GPU image's: tests/mosaic_interpret.py was
  written against both) the interpreter must be available: there a failing probe is a bug in the
  extension, not a missing piece, and must not turn every interpreted kernel test into a skip."""
  if not jax.__version__.startswith(("0.10.", "0.11.")):
    pytest.skip(f"jax {jax.__version__}: the interpreter's extension was not written for it")
  assert mosaic_interpret.available() is None


def allow_mosaic_here(monkeypatch):
  """Lift resolve_decode_impl's refusal of "mosaic" and "mosaic_fused" without a Hopper GPU (the
  kernels are only lowered for CUDA or interpreted here); everything else resolves as before."""
  resolve = A.resolve_decode_impl
  monkeypatch.setattr(A, "resolve_decode_impl",
                      lambda impl, **problem: impl if impl in A.MOSAIC_DECODE_IMPLS
                      else resolve(impl, **problem))


@needs_interpreter
@pytest.mark.parametrize("G,lengths,kw", [
    (2, (0, 1, 37, 128), dict(pages_per_block=4)),                    # 1 / 2 steps, 2 in flight
    (2, (0, 1, 37, 128), dict(pages_per_block=4, stages=1)),          # refill after each step
    (4, (64, 0, 100, 17), dict(pages_per_block=4, k_splits=2)),       # an empty split per row
    (5, (128, 3, 65, 0), dict(pages_per_block=4, k_splits=4, stages=2)),  # steps over splits
    (1, (33, 128, 1, 96), dict(pages_per_block=8, stages=1)),         # a whole table a step
    (2, (0, 32, 5, 17), dict(pages_per_block=4, pages_per_seq=2)),    # a step wider than the table
    (2, (37, 0, 128, 1), dict(pages_per_block=4, rows_per_block=2)),  # 2 rows a block, one stream
    (2, (100, 17, 1, 64), dict(pages_per_block=4, stages=1, rows_per_block=4)),  # all in 1 block
    (4, (64, 0, 100, 17), dict(pages_per_block=4, k_splits=2, rows_per_block=3)),  # rows past B
])
def test_interpreted_matches_reference(G, lengths, kw):
  """The kernel's own code in Mosaic GPU's interpreter, bf16 (D 64, 16-token pages, tables of
  8 pages unless given): within bf16 rounding of the jnp reference; a row of length 0 gives
  exactly 0; no data race found; pages past each row's last step are NaN pages (paged_case) that
  must not be read. With rows_per_block R a block attends R rows in turn, its page copies one
  stream over them (a row's pages, q or output mistaken for another's, a copy refilled into a
  buffer still read, or a row past B (3 a block: rows 4 and 5 of the second) storing its zeros
  over row 3, would show)."""
  kw = dict(kw)
  pages_per_seq = kw.pop("pages_per_seq", 8)
  ppb = kw["pages_per_block"]
  q, kp, vp, tables, lengths, _, _ = paged_case(
      20 + G, B=4, K=2, G=G, D=64, page_size=16, pages_per_seq=pages_per_seq, lengths=lengths,
      dtype=jnp.bfloat16, pages_per_block=ppb * kw.get("k_splits", 1))
  ref = np.asarray(A.paged_decode_reference(q, kp, vp, tables, lengths), np.float32)
  with mosaic_interpret.interpreting(detect_races=True):
    got = np.asarray(PD.paged_decode_mosaic(q, kp, vp, tables, lengths, **kw), np.float32)
  assert not mosaic_interpret.races_found()
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, ref, atol=1e-2, rtol=1e-2)
  for b in np.flatnonzero(np.asarray(lengths) == 0):
    assert np.all(got[b] == 0)


def test_auto_splits_give_every_sm_a_block():
  """rollout.decode_splits=0's rule, known answers: the fewest splits, a power of two up to
  MAX_SPLITS, with ceil(rows / rows_per_block) x KV heads x splits >= the SMs."""
  assert [PD.auto_splits(rows, 8, 132) for rows in (1, 8, 16, 17, 32, 64, 256)] == \
      [8, 4, 2, 1, 1, 1, 1]                   # Qwen3's 8 KV heads on an H100 / H200
  assert PD.auto_splits(8, 8, 132, rows_per_block=2) == 8      # 4 row blocks x 8 heads = 32
  assert PD.auto_splits(8, 4, 132) == 8                        # 4 KV heads a shard (tensor 2)
  assert PD.auto_splits(1, 8, 132, max_splits=2) == 2
  assert PD.auto_splits(16, 8, 128) == 1                       # 128 blocks on 128 SMs
  with pytest.raises(ValueError, match="rows 0"):
    PD.auto_splits(0, 8, 132)


@pytest.mark.parametrize("k_splits", [2, 3, 4, 8])
@pytest.mark.parametrize("ppb", [1, 2, 4])
def test_row_shares_cut_a_rows_live_pages_into_equal_whole_steps(k_splits, ppb):
  """Split j of a row of n tokens reads [j share, (j + 1) share) of its pages (the kernel's
  live-page and step counts, as it computes them): the splits read each live page once, a
  share is whole steps, its longest split takes the fewest steps any cut into whole steps can
  (ceil(pages / (k_splits ppb))), whatever the table's width, and no step reaches past the
  row's pages rounded up to a step."""
  page_size, pages_per_seq = 16, 64
  assert PD._row_share(100, page_size, ppb, 1, pages_per_seq) == pages_per_seq  # one: the table
  for n in list(range(0, 70)) + [255, 256, 257, 999, 1024]:
    pages = -(-n // page_size)
    share = int(PD._row_share(n, page_size, ppb, k_splits, pages_per_seq))
    assert share % ppb == 0
    live = [min(max(pages - j * share, 0), share) for j in range(k_splits)]
    steps = [-(-x // ppb) for x in live]
    assert sum(live) == pages, (n, live)
    assert max(steps) == -(-pages // (k_splits * ppb)), (n, steps)
    ends = [j * share + s * ppb for j, s in enumerate(steps) if s]
    assert max(ends, default=0) <= -(-pages // ppb) * ppb, (n, ends)


@needs_interpreter
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("k_splits", [3, 4])
def test_interpreted_splits_of_short_rows_in_a_wide_table(fused, k_splits):
  """k_splits over a 32-page table whose rows are far shorter (the tail of a rollout with a
  table bucket sized for its longest sample): each row's live pages are cut into shares of
  whole steps, and the result is the reference's / the unfused step's. Pages from the longest
  row's last step on (a step: 4 pages) are NaN, so no split may read past its row's pages: a
  share of the table's width (32 / 3 -> 11 pages, not whole steps) would send the second split
  of the 256-token row (16 pages) to pages 11-18."""
  lengths = (0, 1, 256, 61)
  if fused:
    args, fkw, ref = fused_case(71, G=2, page_size=16, pages_per_seq=32, lengths=lengths,
                                block=4)
    with mosaic_interpret.interpreting(detect_races=True):
      got = PD.paged_write_decode_mosaic(*args, **fkw, pages_per_block=4, k_splits=k_splits)
    assert not mosaic_interpret.races_found()
    check_fused(got, ref, args)
    return
  q, kp, vp, tables, lengths, _, _ = paged_case(
      72, B=4, K=2, G=2, D=64, page_size=16, pages_per_seq=32, lengths=lengths,
      dtype=jnp.bfloat16, pages_per_block=4)
  ref = np.asarray(A.paged_decode_reference(q, kp, vp, tables, lengths, pages_per_block=4),
                   np.float32)
  with mosaic_interpret.interpreting(detect_races=True):
    got = np.asarray(PD.paged_decode_mosaic(q, kp, vp, tables, lengths, pages_per_block=4,
                                            k_splits=k_splits), np.float32)
  assert not mosaic_interpret.races_found()
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, ref, atol=1e-2, rtol=1e-2)
  assert np.all(got[0] == 0)


def test_decode_splits_resolves_auto_from_the_device(monkeypatch):
  """attention.decode_splits: a count >= 1 as given; 0 = auto_splits on the default device's
  SMs (its core_count), one split where the device has no SM count (a CPU); anything else
  refused."""
  class Device:
    core_count = 132
  assert A.decode_splits(3, 8, 8) == 3
  monkeypatch.setattr(A, "_default_device", lambda: object())
  assert A._sm_count() is None and A.decode_splits(0, 8, 8) == 1
  monkeypatch.setattr(A, "_default_device", lambda: Device())
  assert A._sm_count() == 132
  assert [A.decode_splits(0, rows, 8) for rows in (8, 16, 64)] == [4, 2, 1]
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="0 = auto"):
      A.decode_splits(bad, 8, 8)


@needs_interpreter
@pytest.mark.parametrize("G,K,kw", [
    (2, 8, {}),                    # Qwen3-0.6B's 16 / 8 heads: windows at rows 0 and 8
    (5, 8, dict(k_splits=2)),      # 14B's 40 / 8: 16-row windows on tiles, the last ones clipped
    (1, 4, dict(pages_per_block=4)),      # 4 rows in all, padded to the 8-row window
])
def test_interpreted_rotates_q_as_apply_rope_does(G, K, kw):
  """rope=(cos, sin): the kernel rotates q in its prologue (D 128, halves of whole swizzle
  atoms; 32-token pages). Within bf16 rounding of the jnp reference on q rotated by
  rope.apply_rope, for every head's window offset; the rotation matters (without it the output
  differs)."""
  from delta_jax.models.rope import apply_rope, rope_cos_sin

  block = kw.get("pages_per_block", PD.PAGES_PER_BLOCK) * kw.get("k_splits", 1)
  q, kp, vp, tables, lengths, _, _ = paged_case(
      40 + G, B=3, K=K, G=G, D=128, page_size=32, pages_per_seq=8, lengths=(70, 1, 33),
      dtype=jnp.bfloat16, pages_per_block=block)
  cos, sin = rope_cos_sin(jnp.asarray([69, 0, 1000]), 128, 1e6)
  ref, unrotated = (np.asarray(A.paged_decode_reference(x, kp, vp, tables, lengths,
                                                        pages_per_block=block), np.float32)
                    for x in (apply_rope(q, cos, sin), q))
  with mosaic_interpret.interpreting(detect_races=True):
    got = np.asarray(PD.paged_decode_mosaic(q, kp, vp, tables, lengths, rope=(cos, sin), **kw),
                     np.float32)
  assert not mosaic_interpret.races_found()
  np.testing.assert_allclose(got, ref, atol=1e-2, rtol=1e-2)
  assert np.abs(unrotated - ref).max() > 0.1


@needs_interpreter
def test_interpreted_with_pdl_matches_reference():
  """pdl=True (programmatic dependent launch) only adds the grid-dependency instructions: the
  same outputs as the reference, k_splits 2 included."""
  q, kp, vp, tables, lengths, _, _ = paged_case(
      61, B=3, K=2, G=2, D=64, page_size=16, pages_per_seq=8, lengths=(70, 1, 33),
      dtype=jnp.bfloat16, pages_per_block=4)
  ref = np.asarray(A.paged_decode_reference(q, kp, vp, tables, lengths), np.float32)
  with mosaic_interpret.interpreting(detect_races=True):
    got = np.asarray(PD.paged_decode_mosaic(q, kp, vp, tables, lengths, pdl=True,
                                            pages_per_block=4, k_splits=2), np.float32)
  assert not mosaic_interpret.races_found()
  np.testing.assert_allclose(got, ref, atol=1e-2, rtol=1e-2)


def test_pdl_lowers_to_the_grid_dependency_instructions():
  """pdl=True puts griddepcontrol.wait / .launch_dependents in the kernel (pdl=False neither),
  and where this jax's Pallas marks a kernel for a PDL launch (jax >= 0.11: the PdlEffect), the
  module carries the mark."""
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  plain, pdl = lower_for_cuda(), lower_for_cuda(pdl=True)
  rows = lower_for_cuda(pdl=True, rows_per_block=2)   # launched after the last row's pages
  for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
    assert op in pdl and op in rows and op not in plain
  marks = hasattr(gpu_core, "PdlEffect")
  assert ("mosaic_gpu.uses_pdl" in pdl) == marks and "mosaic_gpu.uses_pdl" not in plain


@needs_interpreter
@pytest.mark.parametrize("wait", [True, False])
def test_race_detector_is_live(wait):
  """The positive control of the no-race assertion above: a TMA copy into shared memory whose
  buffer the kernel then overwrites is a race unless the copy's barrier is waited on first."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def kernel(x_ref, o_ref, x_smem, bar):
    plgpu.copy_gmem_to_smem(x_ref, x_smem, bar.at[0])
    if wait:
      plgpu.barrier_wait(bar.at[0])
    x_smem[...] = jnp.zeros_like(x_smem)
    if not wait:
      plgpu.barrier_wait(bar.at[0])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  x = jnp.ones((128,), jnp.float32)
  call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      scratch_types=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_barriers=1)])
  with mosaic_interpret.interpreting(detect_races=True):
    jax.block_until_ready(call(x))
  assert mosaic_interpret.races_found() == (not wait)


def fused_case(seed, *, B=4, K=2, G=2, page_size=16, pages_per_seq=8, lengths=(0, 1, 37, 128),
               norms=True, block=4):
  """paged_write_decode_mosaic's inputs (bf16, D 128) and the unfused step's results: q / k
  RMSNorm, RoPE, the key and value written by write_pages, then the jnp page reader
  (attention.paged_write_attend with impl "reference", which the product runs off the GPU).
  Each row's new token is its last (position lengths - 1, on its own page of the table); the
  slot it goes to holds stale keys and values of 50 (if the kernel read it as an old token, its
  score would swamp the row's)."""
  from delta_jax.models.rope import rope_cos_sin
  D = 128
  q, kp, vp, tables, lengths, _, _ = paged_case(
      seed, B=B, K=K, G=G, D=D, page_size=page_size, pages_per_seq=pages_per_seq,
      lengths=lengths, dtype=jnp.bfloat16, pages_per_block=block)
  rng = np.random.RandomState(seed)
  qkv = jnp.asarray(2 * rng.randn(B, K, G + 2, D), jnp.bfloat16)
  n = np.asarray(lengths)
  pos = np.maximum(n - 1, 0)
  page = np.where(n > 0, np.asarray(tables)[np.arange(B), pos // page_size], -1).astype(np.int32)
  offset = np.where(n > 0, pos % page_size, 0).astype(np.int32)
  live = page >= 0
  kp = kp.at[:, page[live], offset[live]].set(50.0)
  vp = vp.at[:, page[live], offset[live]].set(50.0)
  cos, sin = rope_cos_sin(jnp.asarray(pos), D, 1e6)
  qk_norm = ((jnp.asarray(1 + 0.3 * rng.randn(D), jnp.float32),
              jnp.asarray(1 + 0.3 * rng.randn(D), jnp.float32)) if norms else None)
  args = (qkv, kp, vp, tables, lengths, jnp.asarray(page), jnp.asarray(offset))
  kw = dict(rope=(cos, sin), q_norm=qk_norm and qk_norm[0], k_norm=qk_norm and qk_norm[1])
  ref = A.paged_write_attend(qkv, kp, vp, jnp.asarray(page), jnp.asarray(offset), tables,
                             lengths, rope=(cos, sin), qk_norm=qk_norm, impl="reference",
                             pages_per_block=block)
  return args, kw, ref


def check_fused(got, ref, args, tol=1e-2):
  """The fused kernel's (out, k_pages, v_pages) against the unfused step's: the output within
  bf16 rounding (tol; 2e-2 compiled, as test_compiled_matches_reference: approximate exp2), exactly 0 for rows of length 0, exactly the new value for rows of length 1
  (the new token alone); the value rows as written, the keys within a bf16 rounding of them,
  every other entry of the pools (NaN pages included) untouched."""
  out, k_pages, v_pages = (np.asarray(x, np.float32) for x in got)
  ref_out, ref_k, ref_v = (np.asarray(x, np.float32) for x in ref)
  qkv, lengths = np.asarray(args[0], np.float32), np.asarray(args[4])
  B, K, G2, D = qkv.shape
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out, ref_out, atol=tol, rtol=tol)
  for b in np.flatnonzero(lengths == 0):
    assert np.all(out[b] == 0)
  for b in np.flatnonzero(lengths == 1):
    np.testing.assert_array_equal(out[b], np.repeat(qkv[b, :, -1], G2 - 2, axis=0))
  np.testing.assert_array_equal(v_pages, ref_v)
  np.testing.assert_allclose(k_pages, ref_k, rtol=2 ** -7, atol=0)
  page, offset = np.asarray(args[5]), np.asarray(args[6])
  untouched = np.ones(k_pages.shape[1:3], bool)
  untouched[page[page >= 0], offset[page >= 0]] = False
  np.testing.assert_array_equal(k_pages[:, untouched], np.asarray(args[1], np.float32)[:, untouched])


@needs_interpreter
@pytest.mark.parametrize("G,K,case,kw", [
    (2, 2, {}, dict(pages_per_block=4)),                             # 1 / 2 steps, 2 in flight
    (2, 2, {}, dict(pages_per_block=4, stages=1)),                   # refill after each step
    (4, 2, dict(lengths=(64, 0, 100, 17), block=8), dict(pages_per_block=4, k_splits=2)),
    (2, 2, dict(norms=False, lengths=(1, 2, 16, 17)), dict(pages_per_block=4)),  # no q / k norm
    (5, 8, dict(page_size=32, lengths=(70, 1, 33, 0), block=4),
     dict(pages_per_block=2, k_splits=2)),                            # 14B's 40 / 8 heads
    (2, 2, {}, dict(pages_per_block=4, rows_per_block=2)),           # 2 rows a block
    (4, 2, dict(lengths=(64, 0, 100, 17), block=8),
     dict(pages_per_block=4, k_splits=2, rows_per_block=3)),         # rows past B, 3 rows a block
])
def test_interpreted_fused_step_matches_the_unfused_one(G, K, case, kw):
  """paged_write_decode_mosaic, the kernel's code in Mosaic GPU's interpreter: the unfused
  step's output and pools (check_fused) for ragged rows (0: nothing written, output 0; 1: the
  new token alone; mid-page; a page's last slot), one or two splits, with and without q / k
  norms, one to three rows a block (the second row's key / value rows in the other buffer);
  no data race (its own page reads and its write of the slot past them)."""
  args, fkw, ref = fused_case(30 + G, K=K, G=G, **case)
  with mosaic_interpret.interpreting(detect_races=True):
    got = PD.paged_write_decode_mosaic(*args, **fkw, **kw)
  assert not mosaic_interpret.races_found()
  check_fused(got, ref, args)


@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize("shape,kw", [
    (dict(G=2), {}),                                          # Qwen3-0.6B / 1.7B: 16 / 8 heads
    (dict(G=4), dict(k_splits=4, pages_per_block=4)),         # Qwen3-8B: 32 / 8 heads
    (dict(G=5, pages_per_seq=32), dict(k_splits=2)),          # Qwen3-14B: 40 / 8 heads
    (dict(G=2), dict(rows_per_block=2)),                      # 0.6B, 2 rows a block
])
def test_fused_step_lowers_to_mosaic_gpu_at_model_shapes(shape, kw, norms):
  """The fused kernel exported for CUDA from abstract shapes (batch 64, 32-token pages, D 128
  bf16; Mosaic GPU's checks of layouts, TMA and WGMMA shapes run): one custom call, whose K
  and V pools are aliased in and out (written in place; with the pools donated, the exported
  program's too)."""
  sd = jax.ShapeDtypeStruct
  B, K, D, G = 64, 8, 128, shape["G"]
  pages_per_seq = shape.get("pages_per_seq", 16)
  pool = sd((K, 256, 32, D), jnp.bfloat16)
  rows = sd((B,), jnp.int32)
  weights = (sd((D,), jnp.float32),) * 2 if norms else ()

  def fn(qkv, kp, vp, tables, lengths, page, offset, cos, sin, *w):
    return PD.paged_write_decode_mosaic(qkv, kp, vp, tables, lengths, page, offset,
                                        rope=(cos, sin), q_norm=w[0] if w else None,
                                        k_norm=w[1] if w else None, **kw)
  text = export.export(jax.jit(fn, donate_argnums=(1, 2)), platforms=["cuda"])(
      sd((B, K, G + 2, D), jnp.bfloat16), pool, pool, sd((B, pages_per_seq), jnp.int32), rows,
      rows, rows, sd((B, D), jnp.float32), sd((B, D), jnp.float32), *weights).mlir_module()
  assert text.count("custom_call @mosaic_gpu") == 1
  assert text.count("output_operand_alias<") == 2
  assert text.count("tf.aliasing_output") == 2


def test_fused_step_bad_inputs_name_the_tensor_or_knob():
  args, kw, _ = fused_case(2, lengths=(0, 1, 5, 9), pages_per_seq=2, page_size=32)
  qkv, kp, vp, tables, lengths, page, offset = args
  with pytest.raises(ValueError, match=r"qkv \(4, 1, 4, 128\) must be \[B, K=2, G \+ 2, D\]"):
    PD.paged_write_decode_mosaic(qkv[:, 1:], *args[1:], **kw)
  with pytest.raises(ValueError, match="head_dim 64 in bfloat16"):
    PD.paged_write_decode_mosaic(qkv[..., :64], kp[..., :64], vp[..., :64], *args[3:],
                                 **dict(kw, rope=tuple(x[:, :64] for x in kw["rope"]),
                                        q_norm=kw["q_norm"][:64], k_norm=kw["k_norm"][:64]))
  with pytest.raises(ValueError, match="pools .float32 / float32. must be in q's dtype"):
    PD.paged_write_decode_mosaic(qkv, kp.astype(jnp.float32), vp.astype(jnp.float32),
                                 *args[3:], **kw)
  with pytest.raises(ValueError, match="q_norm and k_norm go together"):
    PD.paged_write_decode_mosaic(*args, **dict(kw, k_norm=None))
  with pytest.raises(ValueError, match="rope .cos, sin. is required"):
    PD.paged_write_decode_mosaic(*args, **dict(kw, rope=None))
  with pytest.raises(ValueError, match="write_page .3,. and write_offset"):
    PD.paged_write_decode_mosaic(*args[:5], page[:3], offset, **kw)


def test_write_attend_fuses_where_the_fused_kernel_runs():
  """attention.fused_write_attend: one kernel for "mosaic_fused" with RoPE, a pool in q's dtype
  and head_dim 128 in bf16; the unfused step (XLA's norms, RoPE and scatters) otherwise, and
  always for "mosaic" (what "auto" picks on Hopper: the fused step is not measured yet)."""
  bf16 = jnp.bfloat16
  fused = "mosaic_fused"
  assert A.fused_write_attend(fused, bf16, bf16, 128, 32, 2, True)
  assert not A.fused_write_attend("mosaic", bf16, bf16, 128, 32, 2, True)   # by name only
  assert not A.fused_write_attend(fused, bf16, bf16, 64, 32, 2, True)   # half a swizzle atom
  assert not A.fused_write_attend(fused, bf16, jnp.float32, 128, 32, 2, True)
  assert not A.fused_write_attend(fused, bf16, bf16, 128, 32, 2, False)  # no RoPE
  assert not A.fused_write_attend("reference", bf16, bf16, 128, 32, 2, True)
  assert not A.fused_write_attend(fused, bf16, bf16, 128, 16, 2, True)   # 16 x 2 keys a step
  assert PD.smem_bytes(128, 32, PD.PAGES_PER_BLOCK, PD.STAGES, fused=True) <= PD.SMEM_LIMIT_BYTES


def test_q_windows_start_on_tiles_and_cover_each_heads_rows():
  """Each KV head's window of q rows starts on an 8-row tile (a tiled TMA copy from any other row
  reads the wrong rows on a GPU; only jax 0.11's lowering refuses it), lies inside q (padded only
  to whole tiles, or to one window), and holds the head's G rows; config_problem refuses exactly
  the groups whose widest window (any number of KV heads) exceeds the 64-row tile."""
  for group in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 57, 59):
    widest = PD.q_windows(8 * group, 8)[0]
    for num_kv_heads in (1, 2, 4, 8, 16):
      N = group * num_kv_heads
      rows, q_rows, starts = PD.q_windows(N, num_kv_heads)
      assert rows % 8 == 0 and q_rows % 8 == 0, (group, num_kv_heads, rows, q_rows)
      assert q_rows == max(-(-N // 8) * 8, rows), (group, num_kv_heads, q_rows)
      assert rows <= widest, (group, num_kv_heads, rows, widest)
      for h, start in enumerate(starts):
        assert start % 8 == 0 and 0 <= start and start + rows <= q_rows, (group, h, start)
        assert start <= h * group and h * group + group <= start + rows, (group, h, start)
    fits = PD.config_problem(jnp.bfloat16, 128, 32, group) is None
    assert fits == (widest <= PD.WGMMA_ROWS), (group, widest)
  assert PD.config_problem(jnp.bfloat16, 128, 32, 57) is None
  assert "window of 72 rows" in PD.config_problem(jnp.bfloat16, 128, 32, 59)


def lower_for_cuda(B=4, K=8, G=2, D=128, page_size=32, pages=64, pages_per_seq=16,
                   dtype=jnp.bfloat16, rope=False, **kw):
  """The kernel exported for CUDA from abstract shapes (rope: with cos / sin given): the Mosaic
  GPU module's text."""
  sd = jax.ShapeDtypeStruct
  pool = sd((K, pages, page_size, D), dtype)
  args = (sd((B, K * G, D), dtype), pool, pool, sd((B, pages_per_seq), jnp.int32),
          sd((B,), jnp.int32)) + ((sd((B, D), jnp.float32),) * 2 if rope else ())

  def fn(q, kp, vp, tables, lengths, *cs):
    return PD.paged_decode_mosaic(q, kp, vp, tables, lengths, rope=cs or None, **kw)
  return export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("shape,kw", [
    (dict(G=2), {}),                                          # Qwen3-0.6B / 1.7B: 16 / 8 heads
    (dict(G=4), dict(k_splits=4, pages_per_block=4)),         # Qwen3-8B: 32 / 8 heads
    (dict(G=5, pages_per_seq=32), dict(k_splits=2, stages=2)),  # Qwen3-14B: 40 / 8 heads
    (dict(G=2, D=64, page_size=16, dtype=jnp.float16), dict(pages_per_block=4)),
    (dict(G=2, B=6), dict(rows_per_block=4, k_splits=2)),     # 2 blocks of rows, one part-full
])
def test_lowers_to_mosaic_gpu_at_model_shapes(shape, kw, rope):
  """With rope the prologue's half-tile loads and stores lower too: at D 128 the kernel takes
  the rows' cos / sin (7 operands, not 5); at D 64 the rotation is XLA's, before the call, and
  the kernel takes the 5 operands of the one without rope."""
  text = lower_for_cuda(**shape, **kw, rope=rope)
  in_kernel = rope and shape.get("D", 128) == 128
  assert kernel_operands(text) == (7 if in_kernel else 5)


def kernel_operands(text):
  """How many operands the one Mosaic GPU custom call of an exported module's text takes."""
  found = re.findall(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
  assert len(found) == 1, len(found)
  return len(found[0].split(","))


@pytest.mark.devices(2)
@pytest.mark.parametrize("impl", ["mosaic", "mosaic_fused"])
def test_lowers_for_cuda_per_shard_of_a_batch_mesh(monkeypatch, impl):
  """On a mesh (the sampler's pool split over "data": attention.paged_write_attend under
  shard_map, as a multi-GPU rollout runs it, with the rows' RoPE cos / sin split like the rows),
  the layer's write + Mosaic GPU attention exports for CUDA over two devices, with the kernel
  lowered once, per shard."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from tests.decode_args import abstract_write_attend_args
  allow_mosaic_here(monkeypatch)
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  args = abstract_write_attend_args(mesh)
  B, D = args[0].shape[0], args[0].shape[3]
  cs = jax.ShapeDtypeStruct((B, D), jnp.float32,
                            sharding=NamedSharding(mesh, PartitionSpec("data")))
  fn = jax.jit(lambda *a: A.paged_write_attend(*a[:-2], rope=a[-2:], impl=impl, mesh=mesh,
                                               batch_axes=("data",)))
  exported = export.export(fn, platforms=["cuda"])(*args, cs, cs)
  assert exported.nr_devices == 2
  text = exported.mlir_module()
  assert text.count("custom_call @mosaic_gpu") == 1
  # the fused kernel writes the pools in place (aliased in and out); "mosaic" leaves that to XLA
  assert ("output_operand_alias<" in text) == (impl == "mosaic_fused")


def test_lowering_checks_the_shared_memory_budget(monkeypatch):
  """The lowering these tests rely on does check the kernel: with the kernel's own budget check
  lifted, 8 steps of 8 pages in flight (~1 MiB of shared memory) are refused by Mosaic GPU on the
  way to CUDA; with it, they are refused first, naming the knobs."""
  # 2 x 16 KiB of q and output tiles + 8 x 8 x 2 x 8 KiB of K / V pages + 64 x 8 x 4 B of
  # log-sum-exp rows = 1,083,392 B
  with pytest.raises(ValueError, match="stages 8 x pages_per_block 8 need 1083392 B"):
    lower_for_cuda(pages_per_seq=64, stages=8, pages_per_block=8)
  assert PD.smem_bytes(128, 32, PD.PAGES_PER_BLOCK, PD.STAGES) <= PD.SMEM_LIMIT_BYTES
  monkeypatch.setattr(PD, "SMEM_LIMIT_BYTES", 1 << 30)
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    lower_for_cuda(pages_per_seq=64, stages=8, pages_per_block=8)


def test_bad_inputs_name_the_tensor_or_knob():
  f32 = jnp.zeros((2, 4, 64), jnp.float32)
  pool = jnp.zeros((2, 8, 32, 64), jnp.bfloat16)
  tables = jnp.zeros((2, 4), jnp.int32)
  lengths = jnp.zeros((2,), jnp.int32)
  q = f32.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match="q dtype float32"):
    PD.paged_decode_mosaic(f32, pool, pool, tables, lengths)
  with pytest.raises(ValueError, match="pages_per_block 1 x page_size 32"):
    PD.paged_decode_mosaic(q, pool, pool, tables, lengths, pages_per_block=1)
  with pytest.raises(ValueError, match="head_dim 32"):
    PD.paged_decode_mosaic(q[..., :32], pool[..., :32], pool[..., :32], tables, lengths)
  with pytest.raises(ValueError, match="block_tables"):
    PD.paged_decode_mosaic(q, pool, pool, tables[:1], lengths)
  with pytest.raises(ValueError, match="k_splits 0"):
    PD.paged_decode_mosaic(q, pool, pool, tables, lengths, k_splits=0)


hopper = pytest.mark.skipif(not A._hopper(),
                            reason="the Mosaic GPU kernel needs a Hopper GPU (sm_90)")


def test_sampler_refuses_a_model_the_kernel_cannot_run(monkeypatch):
  """At start-up, naming the field: float32 compute, or 16-token pages (a step of the default 2
  pages must hold a multiple of 64 keys)."""
  from flax import nnx
  from delta_jax import models
  from delta_jax.sampling import Sampler

  allow_mosaic_here(monkeypatch)
  fp32 = models.Transformer(models.get_preset("tiny", head_dim=64), rngs=nnx.Rngs(0))
  for name in ("mosaic", "mosaic_fused"):
    with pytest.raises(ValueError, match=f"'{name}'.*rollout.decode_attention.*q dtype float32"):
      Sampler(fp32, decode_attention=name)
  bf16 = models.Transformer(models.get_preset("tiny", head_dim=64, dtype=jnp.bfloat16),
                            rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rollout.page_size.*page_size 16 = 32 keys"):
    Sampler(bf16, decode_attention="mosaic", page_size=16)
  assert Sampler(bf16, decode_attention="mosaic", page_size=32).decode_impl == "mosaic"


def test_sampler_auto_runs_the_kernel_on_hopper_where_it_can(monkeypatch):
  """rollout.decode_attention="auto" on a Hopper GPU (stood in for here): the Sampler runs the
  Mosaic GPU kernel for a bfloat16 model with 32-token pages, and falls back to the jnp page
  reader, with a warning and no error, where the Mosaic one cannot run (float32, 16-token
  pages)."""
  from flax import nnx
  from delta_jax import models
  from delta_jax.sampling import Sampler

  monkeypatch.setattr(A, "_cuda_backend", lambda: True)
  monkeypatch.setattr(A, "_hopper", lambda: True)
  bf16 = models.Transformer(models.get_preset("tiny", head_dim=64, dtype=jnp.bfloat16),
                            rngs=nnx.Rngs(0))
  fp32 = models.Transformer(models.get_preset("tiny", head_dim=64), rngs=nnx.Rngs(0))
  assert Sampler(bf16, page_size=32).decode_impl == "mosaic"
  with pytest.warns(RuntimeWarning, match="jnp page reader"):
    assert Sampler(bf16, page_size=16).decode_impl == "reference"
    assert Sampler(fp32, page_size=32).decode_impl == "reference"
  assert Sampler(bf16, page_size=32, decode_attention="reference").decode_impl == "reference"


@pytest.mark.skipif(A._hopper(), reason="the refusal is for machines without Hopper")
def test_mosaic_is_refused_without_a_hopper_gpu():
  with pytest.raises(ValueError, match="rollout.decode_attention"):
    A.resolve_decode_impl("mosaic")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("G,D,page_size,kw", [
    (2, 128, 32, {}),
    (2, 128, 32, dict(k_splits=2, stages=2)),
    (4, 64, 16, dict(k_splits=4, pages_per_block=4)),
    (5, 128, 32, dict(pages_per_block=4, stages=2)),
    (2, 128, 32, dict(rows_per_block=4)),          # 2 blocks of rows, the second half full
    (2, 128, 32, dict(k_splits=3)),   # shares of each row's own pages: 6, 6, 4 of a full table
    (2, 128, 32, dict(k_splits=8)),   # rollout.decode_splits auto's most
])
def test_compiled_matches_reference(G, D, page_size, kw):
  """GQA groups 2 / 4 / 5, one to eight splits, one or four rows a block, ragged lengths with a
  row of length 0 (exactly 0 out) and a row that ends inside a page, on scrambled pages, bf16:
  within bf16 rounding of the jnp reference. Entries past each row's last block point at a NaN
  page (paged_case): a read of one would poison the row."""
  ppb = kw.get("pages_per_block", PD.PAGES_PER_BLOCK)
  q, kp, vp, tables, lengths, _, _ = paged_case(
      11 + G, B=6, K=2, G=G, D=D, page_size=page_size, pages_per_seq=16,
      lengths=(0, 1, 37, 200, 16 * page_size, 5 * page_size), dtype=jnp.bfloat16,
      pages_per_block=ppb)
  assert A.resolve_decode_impl("mosaic") == "mosaic"
  got = jax.jit(lambda *a: PD.paged_decode_mosaic(*a, **kw))(q, kp, vp, tables, lengths)
  ref = A.paged_decode_reference(q, kp, vp, tables, lengths)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2e-2)
  assert np.all(np.asarray(got, np.float32)[0] == 0)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("G,K,case,kw", [
    (2, 8, dict(page_size=32, pages_per_seq=16, lengths=(0, 1, 37, 200, 512, 160), B=6), {}),
    (4, 8, dict(page_size=32, pages_per_seq=16, lengths=(0, 1, 37, 200, 512, 160), B=6,
                block=16), dict(k_splits=4, pages_per_block=4)),
    (5, 8, dict(page_size=32, pages_per_seq=16, lengths=(33, 0, 1, 64), norms=False, block=4),
     dict(k_splits=2, stages=2)),
    (2, 8, dict(page_size=32, pages_per_seq=16, lengths=(0, 1, 37, 200, 512, 160), B=6),
     dict(rows_per_block=4)),                      # 2 blocks of rows, the second half full
    (2, 8, dict(page_size=32, pages_per_seq=16, lengths=(0, 1, 37, 200, 512, 160), B=6),
     dict(k_splits=3)),                            # shares of each row's own pages
])
def test_compiled_fused_step_matches_the_unfused_one(G, K, case, kw):
  """The compiled fused kernel (paged_write_decode_mosaic, jitted with its pools donated, as the
  decode loop carries them) against the unfused step: check_fused's output and pools."""
  args, fkw, ref = fused_case(50 + G, K=K, G=G, **case)
  assert A.resolve_decode_impl("mosaic") == "mosaic"
  fn = jax.jit(lambda *a: PD.paged_write_decode_mosaic(*a, **fkw, **kw), donate_argnums=(1, 2))
  got = fn(args[0], jnp.copy(args[1]), jnp.copy(args[2]), *args[3:])
  check_fused(got, ref, args, tol=2e-2)


@pytest.mark.gpu
@hopper
def test_selected_through_paged_decode_attention():
  """rollout.decode_attention="mosaic" reaches the kernel (same result as calling it)."""
  q, kp, vp, tables, lengths, _, _ = paged_case(3, B=4, K=2, G=2, D=128, page_size=32,
                                                pages_per_seq=4, lengths=(0, 1, 40, 128),
                                                dtype=jnp.bfloat16, pages_per_block=2)
  via = jax.jit(lambda *a: A.paged_decode_attention(*a, impl="mosaic"))(q, kp, vp, tables, lengths)
  direct = PD.paged_decode_mosaic(q, kp, vp, tables, lengths)
  np.testing.assert_array_equal(np.asarray(via, np.float32), np.asarray(direct, np.float32))


@pytest.mark.parametrize("impl,head_dim", [("mosaic", 128), ("mosaic_fused", 128),
                                           ("mosaic_fused", 64)])
def test_decode_program_lowers_for_cuda_with_it(monkeypatch, impl, head_dim):
  """rollout.decode_attention="mosaic" / "mosaic_fused" in the sampler's whole decode program
  (tiny model in bf16, 32-token pages): the program, kernel included, lowers for CUDA, with the
  Mosaic GPU kernel called once per layer in the step loop. "mosaic_fused" with 128-wide heads
  runs the fused kernel (paged_write_decode_mosaic: q / k norms, RoPE and the page writes in it,
  so the program has no scatter and its pools are aliased in and out of each call); "mosaic",
  and "mosaic_fused" with 64-wide heads, the attention kernel alone, after XLA's norms, RoPE
  and two scatters a layer."""
  from flax import nnx
  from delta_jax import models
  from delta_jax.sampling import programs

  allow_mosaic_here(monkeypatch)
  cfg = models.get_preset("tiny", head_dim=head_dim, dtype=jnp.bfloat16,
                          param_dtype=jnp.bfloat16)
  S, page_size, pages_per_seq = 4, 32, 4
  graphdef, state = nnx.split(models.Transformer(cfg, rngs=nnx.Rngs(0)))
  cache = jax.eval_shape(lambda: models.init_paged_cache(cfg, 1 + S * pages_per_seq, page_size))
  traced = programs.decode.trace(
      *abstract_decode_args(graphdef, state, cache, S, pages_per_seq), num_steps=8, top_k=-1,
      use_top_p=False, greedy=False, attention_impl=impl, pages_per_block=2, batch_spec=None)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "custom_call @mosaic_gpu" in text                  # the kernel, lowered once
  fused = impl == "mosaic_fused" and head_dim == 128
  name = "paged_write_decode_mosaic" if fused else "paged_decode_mosaic"
  assert len(re.findall(rf"call @{name}\b", text)) == cfg.num_layers  # called per layer
  # the page writes' scatters (a row of D at each (head, page, offset): attention.write_pages;
  # the step's token buffers' are [S] columns)
  page_writes = re.findall(r'"stablehlo.scatter".*update_window_dims = \[2\], '
                           r'inserted_window_dims = \[0, 1, 2\]', text)
  assert len(page_writes) == (0 if fused else 2 * cfg.num_layers)
  assert text.count("output_operand_alias<") == (2 if fused else 0)  # K and V pools, in place
  # one GEMM a layer for q, k and v (decode_layers' qkv_proj), then o, gate, up, down; the LM head
  assert text.count("stablehlo.dot_general") == 5 * cfg.num_layers + 1


@needs_interpreter
@pytest.mark.parametrize("impl", ["mosaic", "mosaic_fused"])
def test_sampler_with_auto_splits_generates_what_the_reference_does(monkeypatch, on_cpu, impl):
  """Sampler(decode_splits=0) (rollout.decode_splits auto) on a GPU of 16 SMs (stood in for):
  each decode call's kernel gets auto_splits(its rows, the KV heads, 16) = 2 splits for the
  tiny model's 4 slots x 2 KV heads, and the tokens are the jnp page reader's (greedy), the
  log-probs within bf16 rounding. Refused with batch_invariant, and below 0."""
  from flax import nnx
  from delta_jax import models
  from delta_jax.sampling import Sampler

  allow_mosaic_here(monkeypatch)
  monkeypatch.setattr(A, "_sm_count", lambda: 16)
  cfg = models.get_preset("tiny", head_dim=128, dtype=jnp.bfloat16)
  model = models.Transformer(cfg, rngs=nnx.Rngs(1))
  prompts = [[3, 17, 42], [5, 6, 7, 8, 9, 10, 11, 12, 13], [99]]
  # 6 samples in 4 slots: slots refill; 3 new tokens, one decode call before the refill and one
  # after (the interpreter takes ~1 s a decode step, twice that at 2 splits, on a 2-core CPU)
  kwargs = dict(n=2, max_new_tokens=3, seed=0)
  common = dict(max_batch_size=4, page_size=32, decode_steps_per_call=3)
  ref = Sampler(model, decode_attention="reference", **common).generate(prompts, **kwargs)
  splits = []
  for name in ("paged_decode_mosaic", "paged_write_decode_mosaic"):
    def recorded(*a, kernel=getattr(PD, name), **k):
      splits.append(k["k_splits"])
      return kernel(*a, **k)
    monkeypatch.setattr(PD, name, recorded)
  with mosaic_interpret.interpreting():
    got = Sampler(model, decode_attention=impl, decode_splits=0, **common).generate(prompts,
                                                                                  **kwargs)
  assert set(splits) == {PD.auto_splits(4, cfg.num_kv_heads, 16)} == {2}
  assert got.stats["decode_calls"] == 2
  assert got.response_ids == ref.response_ids
  assert sum(map(len, sum(got.response_ids, []))) == 6 * 3
  for a, b in zip(sum(got.logprobs, []), sum(ref.logprobs, [])):
    np.testing.assert_allclose(a, b, atol=2e-2)
  with pytest.raises(ValueError, match="decode_splits=0.*batch_invariant"):
    Sampler(model, decode_splits=0, batch_invariant=True)
  with pytest.raises(ValueError, match="decode_splits must be an int >= 0"):
    Sampler(model, decode_splits=-1)


@needs_interpreter
@pytest.mark.parametrize("impl,head_dim", [("mosaic", 64), ("mosaic", 128),
                                           ("mosaic_fused", 128)])
def test_sampler_with_it_generates_what_the_reference_does(monkeypatch, on_cpu, impl, head_dim):
  """The rollout engine with rollout.decode_attention="mosaic" / "mosaic_fused" (the kernel
  interpreted, in every layer of every decode step; tiny bf16 model, 32-token pages, two samples
  of three prompts in four slots, so slots refill; "mosaic_fused" with 128-wide heads: the fused
  kernel normalises and rotates q and k and writes the pages itself; "mosaic": XLA does and the
  attention kernel, rotating q, runs alone): the same greedy tokens and log-probs (within bf16
  rounding) as with the jnp page reader. Both on the CPU (on_cpu), so the tokens compare exactly
  on a GPU machine too."""
  from flax import nnx
  from delta_jax import models
  from delta_jax.sampling import Sampler

  allow_mosaic_here(monkeypatch)
  cfg = models.get_preset("tiny", head_dim=head_dim, dtype=jnp.bfloat16)
  model = models.Transformer(cfg, rngs=nnx.Rngs(1))
  prompts = [[3, 17, 42], [5, 6, 7, 8, 9, 10, 11, 12, 13], [99]]
  # 6 new tokens, 3 decode steps a call: 12 steps in 4 calls, two of them after the refill
  # (the interpreter takes ~1 s a decode step on a 2-core CPU)
  kwargs = dict(n=2, max_new_tokens=6, seed=0)
  common = dict(max_batch_size=4, page_size=32, decode_steps_per_call=3)
  ref = Sampler(model, decode_attention="reference", **common).generate(prompts, **kwargs)
  traced = []
  for name in ("paged_decode_mosaic", "paged_write_decode_mosaic"):
    def recorded(*a, name=name, kernel=getattr(PD, name), **k):
      traced.append((name, a[0].shape[1:]))
      return kernel(*a, **k)
    monkeypatch.setattr(PD, name, recorded)
  with mosaic_interpret.interpreting():
    got = Sampler(model, decode_attention=impl, **common).generate(prompts, **kwargs)
  N, K = cfg.num_heads, cfg.num_kv_heads
  want = (("paged_write_decode_mosaic", (K, N // K + 2, head_dim))
          if impl == "mosaic_fused" and head_dim == 128
          else ("paged_decode_mosaic", (N, head_dim)))
  assert traced and set(traced) == {want}  # it ran, in every layer
  assert got.response_ids == ref.response_ids
  assert sum(map(len, sum(got.response_ids, []))) == 6 * 6
  assert got.stats["decode_calls"] == 4  # two calls for the first four samples, two after
  for a, b in zip(sum(got.logprobs, []), sum(ref.logprobs, [])):
    np.testing.assert_allclose(a, b, atol=2e-2)
