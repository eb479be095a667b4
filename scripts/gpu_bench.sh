#!/usr/bin/env bash
# The GPU measurements of issues #15, #16 and #19 on a lent, offline GPU machine, in stages that
# fit one 10-minute device call each (see ../shared/bench/README.md for the set-up it assumes:
# .whl/ holds the wheels from fetch_gpu_wheels.sh and, for the real vocabulary, a copy of the
# Qwen3 tokenizer in .whl/qwen3).
#
#   bash scripts/gpu_bench.sh decode step        # rollout engine (#15), step memory/time (#16)
#   bash scripts/gpu_bench.sh decode_fixed       # batch 64 and 256, fixed lengths only (#15)
#   bash scripts/gpu_bench.sh lmhead train       # kernels, MFU (#16)
#   bash scripts/gpu_bench.sh load               # model.path read onto the GPU: headers, whole, by shards
#   bash scripts/gpu_bench.sh step_dapo step_delta   # step_overhead at full defaults, per variant
#   bash scripts/gpu_bench.sh step_delta-recompute   #   (one call each pair: ~4 min a variant)
#   bash scripts/gpu_bench.sh step step_offload  # step's shape without / with optim.offload
#   bash scripts/gpu_bench.sh train_full         # train_throughput at its defaults (#16)
#   bash scripts/gpu_bench.sh train_auto         # MFU at 1.7B with model.remat=auto's pick (#16)
#   bash scripts/gpu_bench.sh train_profile      # the 1.7B train step's device time by kernel (#16)
#   bash scripts/gpu_bench.sh train_lora         # the 1.7B step training LoRA adapters (rank 16)
#   bash scripts/gpu_bench.sh tests              # the GPU test files (#16)
#   bash scripts/gpu_bench.sh suite              # the whole suite, 12 xdist workers, one call (#16)
#   bash scripts/gpu_bench.sh paged decode_ref   # decode attention kernel sweep, jnp path (#15, #16)
#   bash scripts/gpu_bench.sh profile            # decode device time by kernel (#15)
#   bash scripts/gpu_bench.sh longtail longtail_noahead  # long tail with / without prefilling ahead (#15)
#   bash scripts/gpu_bench.sh longtail_shrink    # long tail: continuous with / without shrink_batch,
#                                                # static (TAIL_MODES, SHRINK_BATCHES) (#15)
#   bash scripts/gpu_bench.sh profile_longtail   # long tail at batch 64 (PROFILE_TAIL_BATCH), device time by kernel (#15)
#   bash scripts/gpu_bench.sh synthetic          # experiments/synthetic_gpu.py wall time (#19)
#   bash scripts/gpu_bench.sh recipe_paths       # the whole program on the GPU through the recipes'
#                                                # memory settings: host feature cache, optimizer
#                                                # offload, a page pool that preempts, old-policy
#                                                # chunks, eval phase, a micro-batched warm start;
#                                                # a resume; then mode=eval (#16; memory/* metrics)
#   bash scripts/gpu_bench.sh mosaic             # the Mosaic GPU decode kernel: tests, sweep (#16)
#   bash scripts/gpu_bench.sh decode_flags       # batch-64 decode under XLA flag variants (#15)
#   bash scripts/gpu_bench.sh tunix              # tunix's sampler at batch 64 on this GPU (#15)
#   bash scripts/gpu_bench.sh decode_gemm        # the decode's weight matmuls alone, split-K (#15)
#   bash scripts/gpu_bench.sh draw               # the sampling draw alone: inverse CDF vs Gumbel (#15)
#   bash scripts/gpu_bench.sh decode_pdl         # batch-64 decode, Mosaic kernel without / with PDL (#15)
#   bash scripts/gpu_bench.sh decode_anatomy     # batch-64 decode: kernel times + optimized HLO (#15)
#   bash scripts/gpu_bench.sh decode_fused       # decode attention mosaic_fused against mosaic (#15)
#   bash scripts/gpu_bench.sh paged_rows decode_rows  # the Mosaic kernel with 1 / 2 / 4 / 8 rows a block:
#                                                # alone, then the whole decode (#15)
#   bash scripts/gpu_bench.sh longtail_splits    # batch 64 with the Mosaic kernel split 2 / 4 (#15)
#   bash scripts/gpu_bench.sh decode_splits      # rollout.decode_splits: the kernel split at 8-32
#                                                # rows, then the long tail, 1 / auto splits (#15)
#   bash scripts/gpu_bench.sh longtail_refill    # batch 64, refill_after 2 (old default) / 4 (#15)
#   bash scripts/gpu_bench.sh longtail_rl        # batch 64, 768 long-tailed samples (12 a slot) (#15)
#   bash scripts/gpu_bench.sh longtail_queue     # batch 64, 256 and 768 samples, staged refills off (#15)
#   bash scripts/gpu_bench.sh longtail_ab        # batch 64: staging / none / static interleaved (#15)
#   bash scripts/gpu_bench.sh shrink_ab          # batch 256, 64: shrink_batch / not / static interleaved (#15)
#   bash scripts/gpu_bench.sh batch_invariant    # batch 256: shrink_batch / not / 128 slots, with and
#                                                # without rollout.batch_invariant: tokens, cost (#15)
#   bash scripts/gpu_bench.sh decode_invariant   # fixed lengths at 64 and 256 with / without batch_invariant (#15)
#   bash scripts/gpu_bench.sh programs           # the decode / prefill programs this GPU compiles:
#                                                # GEMM splits, kernels a step, 8-256 rows (#15)
#   bash scripts/gpu_bench.sh fused_tail         # batch 64, 256: long tail, mosaic / mosaic_fused interleaved (#15)
#   bash scripts/gpu_bench.sh longtail_steps     # batch 64, staging: 32 / 64 steps a call, 16 / 32 staged (#15)
#   bash scripts/gpu_bench.sh longtail_pool      # batch 64 in a 0.3 page pool: preempted samples resumed / restarted (#15)
#   DECODE_ATTENTION=reference bash scripts/gpu_bench.sh profile longtail   # decode with the jnp
#                                                # page reader (the default "auto" is Mosaic on Hopper)
# Stage times on an H100 (2026-11-24): step 178 s, tests 336-390 s (run it in a call of its own),
# lmhead 24 s, train 166 s, paged 86 s, decode 223 s, longtail 192 s.
# Stage limits add up: `train recipe_paths` is 230 + 300 + 180 + 120 s at the defaults, more
# than one 600 s call. With 15 minutes of device time a session (2026-12), one call of both:
#   STAGE_LIMIT_recipe_paths=200 STAGE_LIMIT_recipe_paths_resume=90 STAGE_LIMIT_recipe_paths_eval=60 \
#     BUNDLE=1 OUT=$OUT bash scripts/gpu_bench.sh train recipe_paths      # <= 580 s of stages
#
# Results go to $OUT (default ./gpu_out): one JSON per benchmark and one log for the call;
# BUNDLE=1 packs all but the log into $OUT/gpu_bench_results.tar.gz at the end.
# DECODE_ATTENTION=mosaic|reference runs the decode, profile and longtail stages with that decode
# attention instead of rollout.decode_attention's default "auto" (the Mosaic GPU kernel on Hopper
# since 2026-11-26); their JSON files then end in _mosaic, _reference.
# Each stage has its own time limit (seconds, STAGE_LIMIT_<stage> overrides) so one slow stage
# cannot take the others' time; a stage that fails or times out is logged and the next one runs.
# DRY_RUN=1 prints each stage's command line and runs nothing (no install, no GPU, no $OUT):
# tests/test_gpu_bench.py parses every stage's command against its script's arguments on the
# CPU, so a stale flag fails there rather than in a device call.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${DRY_RUN:-}" ]; then
  stage() { local name=$1 limit=$2; shift 2; echo "=== stage $name (limit ${limit}s): $(printf '%q ' "$@")"; }
  OUT=${OUT:-/nonexistent/gpu_out}; LOG=/dev/null; DECODE=${DECODE_ATTENTION:-auto}
  SUFFIX=$([ "$DECODE" = auto ] || echo "_$DECODE"); TOK=""
else
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_bench.log"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
[ -e delta_jax/kernels ] || ln -sfn ../kernels delta_jax/kernels
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
# The benchmarks own the GPU: let XLA's allocator use 95% of it (the default pool is 75%). On a
# card larger than an H100 80 GB (81,559 MiB) the fraction is scaled down to an H100's 95% (an
# H200's 143,771 MiB: 0.539, the 75.5 GiB limit of the fourth and fifth runs), so memory-driven
# choices (model.remat=auto, the batch-256 page pool) are an 80 GB card's, which the issues target.
# Set XLA_CLIENT_MEM_FRACTION (or the older XLA_PYTHON_CLIENT_MEM_FRACTION; jax refuses both
# at once) to use the whole card.
if [ -n "${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ] && [ -z "${XLA_CLIENT_MEM_FRACTION:-}" ]; then
  XLA_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION
fi
unset XLA_PYTHON_CLIENT_MEM_FRACTION
if [ -z "${XLA_CLIENT_MEM_FRACTION:-}" ]; then
  total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  XLA_CLIENT_MEM_FRACTION=0.95
  if [ -n "$total_mib" ] && [ "$total_mib" -gt 81559 ] 2>/dev/null; then
    XLA_CLIENT_MEM_FRACTION=$(awk -v t="$total_mib" 'BEGIN { printf "%.3f", 0.95 * 81559 / t }')
  fi
fi
export XLA_CLIENT_MEM_FRACTION
echo "XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION" | tee -a "$LOG"
DECODE=${DECODE_ATTENTION:-auto}
SUFFIX=$([ "$DECODE" = auto ] || echo "_$DECODE")
TOK=.whl/qwen3
[ -f "$TOK/tokenizer.json" ] || TOK=""

{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv;
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } \
    2>&1 | tee -a "$LOG"

stage() {  # [STAGE_SIGNAL=INT] stage NAME DEFAULT_LIMIT CMD...: at the limit CMD gets SIGTERM
  # (or STAGE_SIGNAL), and SIGKILL 30 s later
  local name=$1 limit=$2; shift 2
  local var="STAGE_LIMIT_$name"; limit=${!var:-$limit}
  echo "=== stage $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -s "${STAGE_SIGNAL:-TERM}" --kill-after=30 "$limit" "$@" 2>&1 | tee -a "$LOG"
  echo "=== stage $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}
fi

for s in "$@"; do
  case $s in
    decode)  # issue 15: fixed and long-tailed workloads, batch 64 and 256, $DECODE attention
             # (H100, 2026-11-24: ~100 s at batch 64, ~190 s at batch 256 with --repeats 1)
      stage decode 420 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload fixed longtail --hf never --repeats 1 \
        --output "$OUT/decode_throughput$SUFFIX.json" ;;
    decode_fixed)  # issue 15: the fixed workload alone at batch 64 and 256, $DECODE attention (the
                   # acceptance's bandwidth figures without the long tail; H200 ~37 s at 64)
      stage decode_fixed 240 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload fixed --hf never --repeats 1 \
        --output "$OUT/decode_fixed$SUFFIX.json" ;;
    decode_invariant)  # issue 15: decode_fixed with rollout.batch_invariant (XLA's GEMMs without
                       # split-K and cuBLAS, no excess precision), one process, then the default
                       # in another: what holding the summation order costs at fixed lengths
      stage decode_invariant 240 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload fixed --hf never --repeats 1 --batch-invariant \
        --output "$OUT/decode_invariant$SUFFIX.json"
      stage decode_invariant_base 240 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload fixed --hf never --repeats 1 \
        --output "$OUT/decode_invariant_base$SUFFIX.json" ;;
    profile)  # issue 15: fixed lengths at batch 64 and 256 with the device time by kernel
              # (kernels.timing.trace_summary; H100, 2026-11-24: ~170 s)
      stage profile 300 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload fixed --hf never --repeats 1 \
        --profile /tmp/decode_profile --output "$OUT/decode_profile$SUFFIX.json" ;;
    longtail)  # issue 15: the long-tailed workload alone, prefilling ahead (the default)
      stage longtail 240 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload longtail --hf never --repeats 1 \
        --output "$OUT/decode_throughput_longtail$SUFFIX.json" ;;
    longtail_shrink)  # issue 15: the long-tailed workload, continuous batching with and without
                      # shrink_batch (a draining batch runs only the rows it needs) against the
                      # static baseline; TAIL_MODES adds static_shrunk
      stage longtail_shrink 360 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch ${SHRINK_BATCHES:-64 256} --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload longtail --hf never --repeats 1 \
        --tail-modes ${TAIL_MODES:-continuous static continuous_unshrunk} \
        --output "$OUT/decode_throughput_shrink$SUFFIX.json" ;;
    profile_longtail)  # issue 15: the long-tailed workload at batch 64 (PROFILE_TAIL_BATCH), continuous
                       # and static, each traced once more: device time by kernel and kernel time
                       # vs wall (where continuous batching's extra time goes: calls, copies,
                       # prefill; at 256 on an H100, 2026-11-27, prefill was 1.34 s of 7.66)
      stage profile_longtail 300 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch "${PROFILE_TAIL_BATCH:-64}" --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload longtail --hf never --repeats 1 \
        --profile /tmp/decode_profile_longtail \
        --output "$OUT/decode_profile_longtail$SUFFIX.json" ;;
    longtail_noahead)  # issue 15: the long-tailed workload with one prefill call per refill
                       # (Sampler(prefill_ahead=False)), to compare with the decode stage's
      stage longtail_noahead 300 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention "$DECODE" --workload longtail --hf never --repeats 1 \
        --no-prefill-ahead --output "$OUT/decode_throughput_noahead$SUFFIX.json" ;;
    decode_ref)  # the same with the jnp page reader (not yet measured on a GPU)
      stage decode_ref 420 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 256 --prompt-len 512 --new-tokens 1024 \
        --decode-attention reference --workload fixed longtail --hf never --repeats 1 \
        --output "$OUT/decode_throughput_reference.json" ;;
    paged)  # issue 15: the paged decode attention alone, a sweep of the Mosaic kernel's
            # parameters and the jnp page reader's block size (benchmarks/paged_attention.py)
      stage paged 420 python3 benchmarks/paged_attention.py --batch 64 256 \
        --out "$OUT/paged_attention.json" ;;
    mosaic|mosaic_tests|mosaic_paged)  # issue 16: the Mosaic GPU paged decode kernel
             # (kernels/paged_decode.py, written without a GPU on 2026-11-24): its GPU tests, then a
             # sweep of its parameters around its defaults (the Triton kernel it was swept beside
             # until 2026-11-26 is retired); the whole decode with it: DECODE_ATTENTION=mosaic ...
             # profile. `mosaic` runs both stages, mosaic_tests / mosaic_paged one each.
      [ "$s" = mosaic_paged ] || stage mosaic_tests 240 env JAX_PLATFORMS=cuda,cpu \
        python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_decode.py
      # (2026-11-26 on an H200: tests passed; that sweep timed one call at a time, so it did not
      # rank settings. Now: calls back to back; every row live, then a continuous-batching-like
      # batch 64: ragged lengths, half the rows free, where the decode's attention read K/V at
      # ~2.0 TB/s against ~3.35 with every row live.)
      [ "$s" = mosaic_tests ] || { stage mosaic_paged 200 python3 benchmarks/paged_attention.py \
        --batch 64 256 --impls mosaic --k-splits 1 2 4 --pages-per-block 2 4 \
        --num-stages 2 3 --out "$OUT/paged_attention_mosaic.json";
        stage mosaic_paged_ragged 150 python3 benchmarks/paged_attention.py --batch 64 \
        --ragged --live-fraction 0.5 --impls mosaic --k-splits 1 2 4 \
        --pages-per-block 2 4 --num-stages 2 3 \
        --out "$OUT/paged_attention_mosaic_ragged.json"; } ;;
    longtail_refill)  # issue 15: the long-tailed workload at batch 64 with the Sampler's refill
                      # default before 2026-11-26 (refill_after 2 = slots // 32) and now (4 =
                      # slots // 16): 108 against 66 decode calls at the same 1,024 steps
                      # (benchmarks/scheduler_host.py); predicted ~0.13 s of 3.7 s on an H200
      for r in 2 4; do
        stage "longtail_refill_$r" 150 python3 benchmarks/decode_throughput.py \
          --preset qwen3-0.6b --dtype bfloat16 --batch 64 --prompt-len 512 --new-tokens 1024 \
          --decode-attention "$DECODE" --refill-after "$r" --workload longtail --hf never \
          --repeats 2 --output "$OUT/decode_throughput_refill_$r$SUFFIX.json"
      done ;;
    longtail_rl)  # issue 15: the long-tailed lengths with 12 samples a slot (768 at batch 64, the
                  # proportion of the issue's CPU case: 48 x 4 in 16 slots) instead of 4: the
                  # 1,024-token sample no longer sets the continuous run's step count (stand-in
                  # scheduler: 2,193 continuous steps against 7,805 static; 1,024 vs 2,637 at 256)
      stage longtail_rl 240 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
        --dtype bfloat16 --batch 64 --prompt-len 512 --new-tokens 1024 --tail-samples 768 \
        --decode-attention "$DECODE" --workload longtail --hf never --repeats 1 \
        --output "$OUT/decode_throughput_longtail_768$SUFFIX.json" ;;
    longtail_queue)  # issue 15: the long-tailed workload at batch 64 without samples staged on
                     # the device (refill_queue 0: slots refilled between calls only, as before
                     # 2026-11-26's third session), 256 and 768 samples; the default (slots // 4)
                     # is in longtail / longtail_rl. Stand-in scheduler: 66 vs 32 calls (256),
                     # 193 vs 69 (768)
      for n in 256 768; do
        stage "longtail_queue_0_$n" 240 python3 benchmarks/decode_throughput.py \
          --preset qwen3-0.6b --dtype bfloat16 --batch 64 --prompt-len 512 --new-tokens 1024 \
          --tail-samples "$n" --decode-attention "$DECODE" --refill-queue 0 --workload longtail \
          --hf never --repeats 1 --output "$OUT/decode_throughput_queue_0_$n$SUFFIX.json"
      done ;;
    longtail_ab)  # issue 15: the batch-64 long tail (256 and 768 samples) with samples staged on
                  # the device (the default), without, and static batching, interleaved in one
                  # process (benchmarks/sampler_ab.py), so the three share the machine's state
      for n in 256 768; do
        stage "longtail_ab_$n" 300 python3 benchmarks/sampler_ab.py --preset qwen3-0.6b \
          --dtype bfloat16 --batch 64 --samples "$n" --prompt-len 512 --new-tokens 1024 \
          --decode-attention "$DECODE" --refill-queue -1 0 --static --repeats 2 \
          --out "$OUT/sampler_ab_$n$SUFFIX.json"
      done ;;
    shrink_ab)  # issue 15: the long tail (4 x B samples) with shrink_batch (the default), without,
                # and static batching, interleaved in one process (benchmarks/sampler_ab.py)
      for b in ${SHRINK_BATCHES:-256 64}; do
        stage "shrink_ab_$b" 300 python3 benchmarks/sampler_ab.py --preset qwen3-0.6b \
          --dtype bfloat16 --batch "$b" --prompt-len 512 --new-tokens 1024 \
          --decode-attention "$DECODE" --refill-queue -1 --unshrunk --static --repeats 2 \
          --out "$OUT/sampler_ab_shrink_$b$SUFFIX.json"
      done ;;
    batch_invariant)  # issue 15: rollout.batch_invariant (Sampler(batch_invariant=True): the
                      # prefill and decode programs compiled with XLA's GEMMs without split-K,
                      # never cuBLAS, and no excess precision: programs.BATCH_INVARIANT_OPTIONS)
                      # on the long tail, in one process per batch (INVARIANT_BATCHES, default
                      # 256): continuous batching with shrink_batch, without, and at half the
                      # slots, each with the default options and with batch_invariant,
                      # interleaved x 2. Ninth run (H100): with the default options 89 of 1,024
                      # samples differed between shrink_batch and not at 256. Do the
                      # batch-invariant variants agree (samples and log-probs differing 0), and
                      # what does it cost? (~350 s expected at 256: shrink_ab 256, three variants
                      # of which one static, took 207 s on the H100 on 2026-11-27)
      for b in ${INVARIANT_BATCHES:-256}; do
        stage "batch_invariant_$b" 480 python3 benchmarks/sampler_ab.py --preset qwen3-0.6b \
          --dtype bfloat16 --batch "$b" --prompt-len 512 --new-tokens 1024 \
          --decode-attention "$DECODE" --refill-queue -1 --unshrunk --batch-invariant 0 1 \
          --other-batches $((b / 2)) --repeats 2 --out "$OUT/sampler_ab_invariant_$b$SUFFIX.json"
      done ;;
    programs)  # issue 15: the decode and prefill programs as this GPU's compiler builds them,
               # autotuned (benchmarks/gpu_program.py --target local): GEMM splits and kernels a
               # step at 8-256 rows, with and without batch_invariant, to set beside the ones
               # compiled without a GPU (BENCHMARKS.md, 2026-11-27: the same splits at 64 rows
               # as the eighth run's profiled program). Compiles only (~3-5 min expected).
      stage programs 360 python3 benchmarks/gpu_program.py --target local --prefill-rows 1 2 16 \
        --output "$OUT/gpu_program_local.json" ;;
    fused_tail)  # issue 15: the long tail with the fused Mosaic step against the unfused one,
                 # interleaved (FUSED_TAIL_BATCHES, default "64 256"). Why: on the ninth run (H100)
                 # the fused step gained 1.5% at batch 64 with fixed lengths, inside the spread,
                 # but the long tail's drained steps (8-32 rows, ~450 of 1,024 at 64 slots) are
                 # mostly kernels' fixed costs, of which it removes four a layer.
      for b in ${FUSED_TAIL_BATCHES:-64 256}; do
        stage "fused_tail_$b" 300 python3 benchmarks/sampler_ab.py --preset qwen3-0.6b \
          --dtype bfloat16 --batch "$b" --prompt-len 512 --new-tokens 1024 \
          --decode-attention mosaic mosaic_fused --refill-queue -1 --repeats 2 \
          --out "$OUT/sampler_ab_fused_tail_$b.json"
      done ;;
    longtail_pool)  # issue 15: the batch-64 long tail (lengths of mean 341) in a page pool of
                    # 3.2 GiB, 0.3 of the worst case (10.8 GiB): preempted samples resumed after
                    # a prefill of their tokens (the default) and restarted. CPU counts at the 8B
                    # recipe's proportions: BENCHMARKS.md "Preemption in a bounded page pool"
      for mode in resume restart; do
        stage "longtail_pool_$mode" 300 python3 benchmarks/decode_throughput.py \
          --preset qwen3-0.6b --dtype bfloat16 --batch 64 --prompt-len 512 --new-tokens 1024 \
          --decode-attention "$DECODE" --workload longtail --tail-mean-div 3 --hf never \
          --repeats 2 --kv-budget-gb 3.2 $([ $mode = restart ] && echo --restart-preempted) \
          --output "$OUT/decode_throughput_pool_$mode$SUFFIX.json"
      done ;;
    longtail_steps)  # issue 15: the batch-64 long tail (256 and 768 samples) with samples staged
                     # at 32 (the default) and 64 decode steps a call, 16 (the default, slots //
                     # 4) and 32 staged, interleaved in one process. Stand-in scheduler
                     # (scheduler_host.py, 2026-11-26): calls 32 / 69 (256 / 768 samples) at the
                     # defaults, 20 / 47 at 64 steps, 16 / 34 at 64 steps and 32 staged (up to
                     # one more page reserved a sample); each call ~3 ms of idle GPU on the H200
      for n in 256 768; do
        stage "longtail_steps_$n" 300 python3 benchmarks/sampler_ab.py --preset qwen3-0.6b \
          --dtype bfloat16 --batch 64 --samples "$n" --prompt-len 512 --new-tokens 1024 \
          --decode-attention "$DECODE" --refill-queue -1 32 --steps-per-call 32 64 \
          --repeats 2 --out "$OUT/sampler_ab_steps_$n$SUFFIX.json"
      done ;;
    longtail_splits)  # issue 15: the long-tailed workload at batch 64 with the Mosaic kernel
                      # split over 2 and 4 blocks a row (--mosaic-kernel K_SPLITS 2 3; its
                      # default is 1 split): its attention read ~2.2 TB/s there on an H200
                      # against ~3.35 with every row live (2026-11-26)
      for ks in 2 4; do
        stage "longtail_splits_$ks" 150 python3 benchmarks/decode_throughput.py \
          --preset qwen3-0.6b --dtype bfloat16 --batch 64 --prompt-len 512 --new-tokens 1024 \
          --decode-attention mosaic --mosaic-kernel "$ks" 2 3 --workload fixed longtail \
          --hf never --repeats 1 --output "$OUT/decode_throughput_splits_$ks.json"
      done ;;
    decode_splits)  # issue 15: rollout.decode_splits (Sampler(decode_splits=0): auto, per call,
                    # enough splits of each row's live pages for a block on every SM: 4 at 8
                    # rows, 2 at 16, 1 from 32 at 8 KV heads; the shares follow a row's length
                    # since 2026-11-27, not the table's width). The kernel alone at the shrunk
                    # tail's row counts (ragged, half the rows live, as a shrunk call's bucket),
                    # at this workload's lengths and at an RL response's (8,192 tokens); then
                    # the batch-64 long tail with 1 split and with auto, and static batching,
                    # interleaved x 2 (SPLITS_BATCHES, default 64). Expected ~4-5 minutes.
      stage decode_splits_paged 150 python3 benchmarks/paged_attention.py --batch 8 16 32 \
        --ragged --live-fraction 0.5 --impls mosaic --k-splits 1 2 4 8 --pages-per-block 2 \
        --num-stages 2 --out "$OUT/paged_attention_splits.json"
      stage decode_splits_paged_long 150 python3 benchmarks/paged_attention.py --batch 8 16 \
        --length 8192 --pages-per-seq 512 --ragged --live-fraction 0.5 --impls mosaic \
        --k-splits 1 2 4 8 --pages-per-block 2 --num-stages 2 \
        --out "$OUT/paged_attention_splits_long.json"
      for b in ${SPLITS_BATCHES:-64}; do
        stage "decode_splits_ab_$b" 300 python3 benchmarks/sampler_ab.py --preset qwen3-0.6b \
          --dtype bfloat16 --batch "$b" --prompt-len 512 --new-tokens 1024 \
          --decode-attention "$DECODE" --refill-queue -1 --decode-splits 1 0 --static \
          --repeats 2 --out "$OUT/sampler_ab_splits_$b$SUFFIX.json"
      done ;;
    decode_flags)  # issue 15: the fixed workload at batch 64 under XLA flag variants, one process
                   # each (an unknown flag aborts only its own variant); ~40 s a variant. "base"
                   # is the product's flags (delta_jax.xla_env's defaults, which decode_throughput
                   # applies: concurrent CUDA-graph regions since 2026-11-27). Measured on an H200:
                   # cuBLAS instead of Triton GEMM fusions (--xla_gpu_enable_triton_gemm=false)
                   # 16,688 tok/s against 18,895 (2026-11-26); no command buffers 17,531 against
                   # 18,922; exhaustive tiling did not compile in 146 s; 2026-11-27: pdl_off /
                   # pdl_on 19,471 / 19,489 against 19,503 (no effect), concurrent_graph 19,992-
                   # 20,150 against 19,422-19,677 (adopted); H100 (2026-11-27): graph_while 15,539
                   # against 15,349-15,635 as is (no gain). Variants, by name in DECODE_FLAG_VARIANTS
                   # (flags that jaxlib 0.11.2, the GPU image's, accepts: checked on the CPU with
                   # scripts/gpu_jax_check.sh's venv): no_concurrent (the default off), no_splitk
                   # (Triton GEMMs without split-K: at 64 rows the qkv fusion writes f32[4, 64,
                   # 4096] partial sums that three consumers read, 4.2 MB each), warp_spec
                   # (warp-specialised Triton GEMMs), multi_output (Triton multi-output fusions),
                   # all_triton (every fusion emitted by Triton), heroless (Triton's heroless
                   # priority fusion), block_level (the block-level fusion rewriter), pdl_off /
                   # pdl_on (programmatic dependent launch), exhaustive_tiling, cublaslt,
                   # no_command_buffer, graph_while (command buffers with the decode's while loop
                   # and conditionals in them as well: one CUDA graph for the loop, if XLA takes
                   # its data-dependent trip count; the enum names are jaxlib 0.11.2's: it has no
                   # DYNAMIC_SLICE_COPY_FUSION). tests/test_gpu_bench.py parses every variant's
                   # XLA_FLAGS with the local jaxlib.
      for variant in ${DECODE_FLAG_VARIANTS:-base no_concurrent no_splitk warp_spec}; do
        case $variant in
          base) flags="" ;;
          exhaustive_tiling) flags="--xla_gpu_exhaustive_tiling_search=true" ;;
          cublaslt) flags="--xla_gpu_enable_cublaslt=true" ;;
          no_command_buffer) flags="--xla_gpu_enable_command_buffer=" ;;
          graph_while) flags="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL" ;;
          pdl_off) flags="--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false" ;;
          pdl_on) flags="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" ;;
          concurrent_graph) flags="--xla_gpu_graph_enable_concurrent_region=true" ;;
          no_concurrent) flags="--xla_gpu_graph_enable_concurrent_region=false" ;;
          no_splitk) flags="--xla_gpu_experimental_force_split_k=1" ;;
          warp_spec) flags="--xla_gpu_experimental_enable_triton_warp_specialization=true" ;;
          multi_output) flags="--xla_gpu_unsupported_enable_triton_multi_output_fusion=true" ;;
          all_triton) flags="--xla_gpu_experimental_all_fusions_with_triton=true" ;;
          heroless) flags="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true" ;;
          block_level) flags="--xla_gpu_experimental_enable_fusion_block_level_rewriter=true" ;;
          *) echo "unknown decode_flags variant $variant" | tee -a "$LOG"; continue ;;
        esac
        # XLA aborts on an XLA_FLAGS that is blank but not empty (it reads it as a file name)
        xla_flags=$(echo ${XLA_FLAGS:-} $flags)
        stage "decode_flags_$variant" 150 env ${xla_flags:+XLA_FLAGS="$xla_flags"} \
          python3 benchmarks/decode_throughput.py --preset qwen3-0.6b --dtype bfloat16 --batch 64 \
          --prompt-len 512 --new-tokens 1024 --decode-attention "$DECODE" --workload fixed \
          --hf never --repeats 1 --output "$OUT/decode_flags_$variant$SUFFIX.json"
      done ;;
    decode_fused)  # issue 15: the fixed workload with the fused Mosaic step (the q / k norms,
                   # RoPE and page writes inside the attention kernel: rollout.decode_attention
                   # mosaic_fused, by name until measured) against the Mosaic step the default
                   # runs (mosaic: XLA's norms, RoPE and two scatters a layer, then the attention
                   # kernel), one process a run, alternating; FUSED_BATCHES (default "64 64 256":
                   # ~45 s a run at 64, ~60 at 256).
      n=0   # the run's number in the names: a batch given twice keeps both runs' files
      for batch in ${FUSED_BATCHES:-64 64 256}; do
        n=$((n + 1))
        for v in fused unfused; do
          impl=$([ "$v" = fused ] && echo mosaic_fused || echo mosaic)
          stage "decode_fused_${v}_${batch}_$n" 150 python3 benchmarks/decode_throughput.py \
            --preset qwen3-0.6b --dtype bfloat16 --batch "$batch" --prompt-len 512 \
            --new-tokens 1024 --decode-attention "$impl" --workload fixed --hf never --repeats 1 \
            --output "$OUT/decode_fused_${v}_${batch}_$n$SUFFIX.json"
        done
      done ;;
    paged_rows)  # issue 15: the Mosaic kernel alone at its defaults with 1, 2, 4 and 8 rows a block
                 # (rows_per_block: a block attends its rows in turn, its page copies one stream
                 # across them; batch 64 = 512 blocks at 1 row, 256 at 2), every row live, then
                 # batch 64 ragged with half the rows free (the long tail's), then a layer's
                 # whole step (--fused): the fused kernel at 1 / 2 / 4 rows a block against the
                 # unfused Mosaic step (XLA's norms and scatters + the kernel). ~2-4 minutes.
      stage paged_rows 150 python3 benchmarks/paged_attention.py --batch 64 256 --impls mosaic \
        --k-splits 1 --pages-per-block 2 --num-stages 2 --rows-per-block 1 2 4 8 \
        --out "$OUT/paged_attention_rows.json"
      stage paged_rows_ragged 120 python3 benchmarks/paged_attention.py --batch 64 --ragged \
        --live-fraction 0.5 --impls mosaic --k-splits 1 2 --pages-per-block 2 --num-stages 2 \
        --rows-per-block 1 2 --out "$OUT/paged_attention_rows_ragged.json"
      # a layer's step: mosaic_fused (paged_write_decode_mosaic) at 2 and 3 stages against
      # mosaic (unfused), as chains of calls carrying the pools
      stage paged_rows_fused 180 python3 benchmarks/paged_attention.py --batch 64 256 --fused \
        --impls mosaic --k-splits 1 --pages-per-block 2 --num-stages 2 3 --rows-per-block 1 2 4 \
        --out "$OUT/paged_attention_rows_fused.json" ;;
    decode_rows)  # issue 15: the fixed workload with the Mosaic kernels at 1 and 2 rows a block
                  # (--mosaic-rows), one process a run, alternating; ROWS_BATCHES (default
                  # "64 64 256"), MOSAIC_ROWS (default "1 2"); DECODE_ATTENTION=mosaic_fused
                  # runs them on the fused step.
      n=0
      for batch in ${ROWS_BATCHES:-64 64 256}; do
        n=$((n + 1))
        for rows in ${MOSAIC_ROWS:-1 2}; do
          stage "decode_rows_${rows}_${batch}_$n" 150 python3 benchmarks/decode_throughput.py \
            --preset qwen3-0.6b --dtype bfloat16 --batch "$batch" --prompt-len 512 \
            --new-tokens 1024 --decode-attention "$DECODE" --workload fixed --hf never \
            --repeats 1 --mosaic-rows "$rows" \
            --output "$OUT/decode_rows_${rows}_${batch}_$n$SUFFIX.json"
        done
      done ;;
    decode_pdl)  # issue 15: the fixed workload at batch 64 with the Mosaic kernel as is and with
                 # programmatic dependent launch (--mosaic-pdl: it starts while the kernel before
                 # it drains and lets the next one start once its pages are read), one process
                 # each; whether XLA's own kernels use PDL, decode_flags' pdl_off says. ~80 s.
      for v in off on; do
        stage "decode_pdl_$v" 150 python3 benchmarks/decode_throughput.py --preset qwen3-0.6b \
          --dtype bfloat16 --batch 64 --prompt-len 512 --new-tokens 1024 --decode-attention mosaic \
          --workload fixed --hf never --repeats 1 $([ "$v" = on ] && echo --mosaic-pdl) \
          --output "$OUT/decode_pdl_$v.json"
      done ;;
    decode_anatomy)  # issue 15: what each kernel of a batch-64 decode step is. The fixed
                     # workload at batch 64 (256 new tokens: the same per-step program), traced
                     # (device time by kernel) with XLA's optimized HLO of the decode program
                     # dumped beside it ($OUT/hlo/*jit_decode*after_optimizations.txt), so each
                     # fusion the trace names (gemm_fusion_dot_*, loop_*_fusion_*, ...) can be
                     # read op by op off the GPU (benchmarks/hlo_fusions.py joins the two
                     # and prints each timed kernel's ops, bytes and rate). ~1-2 minutes.
                     # Under a profiler XLA runs command buffers op by op (its log: "Execute
                     # command buffer thunk as a regular thunk sequence because we detected
                     # active profiling session"), so the traced step is not quite the timed
                     # one's; ANATOMY_GRAPHS=1 keeps the CUDA graphs while profiling
                     # (--xla_enable_command_buffers_during_profiling, experimental in 0.11.2).
      xla_flags=$(echo ${XLA_FLAGS:-} --xla_dump_to="$OUT/hlo" --xla_dump_hlo_as_text \
        --xla_dump_hlo_module_re=jit_decode \
        $([ "${ANATOMY_GRAPHS:-0}" = 1 ] && echo --xla_enable_command_buffers_during_profiling=true))
      stage decode_anatomy 240 env XLA_FLAGS="$xla_flags" python3 \
        benchmarks/decode_throughput.py --preset qwen3-0.6b --dtype bfloat16 --batch 64 \
        --prompt-len 512 --new-tokens 256 --decode-attention "$DECODE" --workload fixed \
        --hf never --repeats 1 --profile /tmp/decode_anatomy \
        --output "$OUT/decode_anatomy$SUFFIX.json"
      # only the optimized modules come back (the pre-optimization ones are as large)
      find "$OUT/hlo" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
      # each timed kernel's ops and bytes (benchmarks/hlo_fusions.py), into the log
      for hlo in "$OUT"/hlo/*jit_decode.*after_optimizations.txt; do
        [ -f "$hlo" ] && stage decode_anatomy_fusions 60 python3 benchmarks/hlo_fusions.py \
          "$hlo" --profile "$OUT/decode_anatomy$SUFFIX.json" \
          --out "$OUT/decode_anatomy_fusions_$(basename "$hlo" | cut -d. -f1)$SUFFIX.json"
      done
      # one file for the dumped modules: a device call returns at most 8 files (the seventh
      # run's three HLO files were left behind)
      [ -d "$OUT/hlo" ] && tar czf "$OUT/decode_anatomy_hlo$SUFFIX.tar.gz" -C "$OUT" hlo \
        && rm -rf "$OUT/hlo" ;;
    decode_gemm)  # issue 15: the decode step's weight matmuls alone (benchmarks/decode_gemm.py,
                  # Qwen3-0.6B shape, bf16, 64 and 256 rows): XLA's dot and its GEMM choices,
                  # split-K 2 / 4 / 8 and concatenated weights, against the copy rate measured
                  # in the same process. Rates from each program's device time (profiler
                  # trace): the wall time of a few-microsecond matmul is the host's dispatch
                  # rate (~40-70 us a call on an H200, seventh run). ~1-2 minutes.
      stage decode_gemm 240 python3 benchmarks/decode_gemm.py --batch 64 256 \
        --out "$OUT/decode_gemm.json" ;;
    draw)  # issue 15: the sampling draw alone (benchmarks/sampling_draw.py: the sampler's inverse
           # CDF against jax.random.categorical's Gumbel arg-max, the Qwen3 vocabulary, 64 and
           # 256 rows, device time from a profiler trace); the Gumbel draw was 65 us of a 2.8 ms
           # batch-64 decode step on an H200 (2026-11-26). ~1 minute.
      stage draw 120 python3 benchmarks/sampling_draw.py --out "$OUT/sampling_draw.json" ;;
    tunix)  # issue 15: the peer, google-tunix 0.1.7's JAX sampler (.whl/tunix_decode.py from
            # ../shared/bench), at batch 64 on this GPU (batch 256 did not fit its prefill on
            # an H100); compare its decode tok/s with the decode stage's on the same machine
      stage tunix 200 python3 .whl/tunix_decode.py --batch 64 --prompt-len 512 --new-tokens 1024 \
        --output "$OUT/tunix_decode.json" ;;
    step)  # issue 16: step_overhead's default shape (one variant, one timed step: the memory
           # question is the shape's, and the full default sweep takes ~10 minutes)
      stage step 230 python3 benchmarks/step_overhead.py --variants delta --steps 1 \
        ${TOK:+--tokenizer "$TOK"} --out "$OUT/step_overhead.json" ;;
    step_offload)  # optim.offload: step's shape and variant with the optimizer state in host
                   # memory outside the updates (update_s includes its two transfers, also
                   # printed alone as offload_in_s / offload_out_s); run `step` in the same call
                   # for the same shape without it
      stage step_offload 230 python3 benchmarks/step_overhead.py --variants delta --steps 1 \
        --offload ${TOK:+--tokenizer "$TOK"} --out "$OUT/step_overhead_offload.json" ;;
    step_dapo|step_delta|step_delta-recompute)  # issue 16: step_overhead at its full defaults
             # (3 timed steps after 1 warm-up), one variant a stage: all three take ~10 minutes,
             # more than one device call, so run them in separate calls
      v=${s#step_}
      stage "$s" 400 python3 benchmarks/step_overhead.py --variants "$v" \
        ${TOK:+--tokenizer "$TOK"} --out "$OUT/step_overhead_$v.json" ;;
    train_full)  # issue 16: train_throughput at its defaults (2 remat x 2 attention x 2 log-prob
                 # paths, 2 warm-up + 5 timed steps, the compiled-memory table)
      stage train_full 560 python3 benchmarks/train_throughput.py \
        --out "$OUT/train_throughput_full.json" ;;
    tests)  # issue 16: the five files of the first GPU run and every gpu-marked test
      stage tests 480 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
        tests/test_kernels_delta.py tests/test_kernels_logprob.py tests/test_attention.py \
        tests/test_logprobs.py tests/test_sampling.py tests/test_paged_decode.py ;;
    suite)  # issue 16: the whole suite on the GPU in one call, SUITE_WORKERS pytest-xdist workers
            # (default 12 of the 16 cores; the suite is mostly compiles, and conftest turns off
            # preallocation on CUDA so the processes share the GPU), whole files per worker, each
            # result printed as it comes (-v). At the limit pytest gets SIGINT and still prints its
            # summary of what ran. The workers need pytest-xdist and execnet among the wheels
            # (`pip download --no-deps -d .whl pytest-xdist execnet`); without them the suite
            # runs in one process. SUITE_TESTS names other paths or test ids to run the same way
            # (default: tests). H200, 2026-11-26: 4 min 50 s with 12 workers.
      par=(-n "${SUITE_WORKERS:-12}" --dist loadfile)
      python3 -c "import xdist" 2>/dev/null || par=()
      STAGE_SIGNAL=INT stage suite 500 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -v \
        -p no:cacheprovider "${par[@]}" --durations=30 -rfE --junitxml="$OUT/suite.xml" \
        ${SUITE_TESTS:-tests} ;;
    lmhead)
      stage lmhead 90 python3 benchmarks/lm_head_logprob.py --out "$OUT/lm_head_logprob.json" ;;
    load)  # reading a Qwen3-1.7B-shaped bf16 checkpoint (3.4 GB) onto the GPU: headers only,
           # whole, by shards (models.from_pretrained; CPU figures in BENCHMARKS.md 2026-12-03)
      stage load 120 python3 benchmarks/load_weights.py --preset qwen3-1.7b --repeats 3 \
        --json "$OUT/load_weights.json" ;;
    train)  # issue 16: MFU at the 1.7B shape, the three policies model.remat=auto chooses from,
            # on one machine (cuDNN attention, fused log-probs). H100 2026-11-24: dots 40.2%, full
            # 37.2%; H200 2026-11-26: dots 42.5%, none 39.0% (so auto skips none on CUDA now).
      stage train 230 python3 benchmarks/train_throughput.py --logprob-impls fused \
        --attention auto --remat none dots_with_no_batch_dims_saveable full --warmup 1 \
        --iters 3 --skip-memory --out "$OUT/train_throughput.json" ;;
    train_profile)  # issue 16: where the 1.7B train step's time goes, by kernel (remat none,
                    # auto's pick on the H200: its backward ran ~346 TFLOP/s against the
                    # forward's ~518, 2026-11-26), one traced step after the timed ones
      stage train_profile 200 python3 benchmarks/train_throughput.py --logprob-impls fused \
        --attention auto --remat none --warmup 1 --iters 2 --skip-memory \
        --profile /tmp/train_profile --out "$OUT/train_throughput_profile.json" ;;
    train_lora)  # LoRA (rank 16, every projection) at the 1.7B shape: the step's time and MFU
                 # (frozen weights counted 4x, adapters 6x) with remat=auto's pick; never
                 # measured on a GPU
      stage train_lora 200 python3 benchmarks/train_throughput.py --logprob-impls fused \
        --attention auto --remat auto --lora-rank 16 --warmup 1 --iters 3 --skip-memory \
        --out "$OUT/train_throughput_lora.json" ;;
    train_auto)  # issue 16: MFU at the 1.7B shape with what model.remat=auto picks there
                 # (the run default; plan.pick_remat against this GPU's allocator limit)
      stage train_auto 150 python3 benchmarks/train_throughput.py --logprob-impls fused \
        --attention auto --remat auto --warmup 1 --iters 3 --skip-memory \
        --out "$OUT/train_throughput_auto.json" ;;
    synthetic)  # issue 19: the GPU-scale config's wall time (target <= 8 minutes)
      stage synthetic 540 python3 -m delta_jax.main --config=experiments/synthetic_gpu.py \
        --workdir=/tmp/synthetic_gpu ;;
    recipe_paths)  # issue 16: the paths the 8B / 14B recipes take, none yet run on a GPU:
                   # bfloat16 parameters with their float32 master copy, DelTA's features in
                   # pinned host memory, the optimizer state offloaded between updates, a
                   # 0.25 GiB page pool (preempts: rollout/preemptions),
                   # old-policy chunks of 64 rows, an eval phase; a 4-step warm start in
                   # micro-batches of 16 rows, 2 RL steps, a checkpoint, a resume for step 3
                   # (memory/in_use_gb against step 2's: one state held), then mode=eval
                   # reading its parameters alone. metrics.jsonl goes to $OUT.
      RP=(--config=experiments/synthetic_gpu.py --workdir=/tmp/recipe_paths --config.sft.steps=4
          --config.sft.micro_batch_size=16
          --config.train.steps=2 --config.train.save_every=2 --config.train.eval_before=False
          --config.eval.limit=64 --config.delta.feature_cache=host --config.optim.offload=True
          --config.rollout.kv_budget_gb=0.25 --config.rl.old_pass_rows=64
          --config.model.param_dtype=bfloat16)
      stage recipe_paths 300 python3 -m delta_jax.main "${RP[@]}"
      stage recipe_paths_resume 180 python3 -m delta_jax.main "${RP[@]}" --config.train.steps=3
      stage recipe_paths_eval 120 python3 -m delta_jax.main "${RP[@]}" --config.mode=eval
      [ -n "${DRY_RUN:-}" ] || cp /tmp/recipe_paths/metrics.jsonl "$OUT/recipe_paths_metrics.jsonl" \
        2>/dev/null ;;
    *) echo "unknown stage $s" | tee -a "$LOG" ;;
  esac
done
# A device call returns at most 8 files: BUNDLE=1 packs every result but the log into one
# (gpu_bench_results.tar.gz; the eighth run's call 1 wrote 15 files and was packed by hand).
if [ -n "${BUNDLE:-}" ] && [ -z "${DRY_RUN:-}" ]; then
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name gpu_bench.log \
     ! -name gpu_bench_results.tar.gz -printf '%P\n' | sort > /tmp/gpu_bench_bundle.txt
   [ -s /tmp/gpu_bench_bundle.txt ] && tar czf gpu_bench_results.tar.gz -T /tmp/gpu_bench_bundle.txt \
     && xargs -d '\n' rm -rf < /tmp/gpu_bench_bundle.txt)
  echo "bundled: $OUT/gpu_bench_results.tar.gz" | tee -a "$LOG"
fi
