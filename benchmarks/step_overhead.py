"""Step overhead: time per RL step phase for dapo and delta on the same model and batch.

Runs the real trainer code (delta_jax.train.run.build_run + delta_jax.train.rl_step.rl_step) for
each variant with the same config, seed, model and prompts:

    dapo             the baseline step
    delta            dapo + DelTA weights from the cached old-policy features (delta.pass_impl)
    delta-recompute  delta.feature_cache="recompute": the trunk is run again for every DelTA pass
                     (K + 3 extra trunk passes), the reference implementation's cost

Model: a random-init preset (default Qwen3-0.6B shape; --layers overrides the depth). Prompts:
fixed random token ids (--prompt-len), the same every step. Rewards: a random model never solves
math and rarely emits EOS (so every response runs to --new-tokens, as the issue intends, and the
response length is the same for all: its parity would give constant rewards), so a seeded stand-in
scorer gives reward = parity of crc32(seed, response text): mixed rewards, non-zero advantages,
DelTA does real work. Dynamic sampling is off so every variant generates exactly one batch.

Timing: rl_step's own phase timers (time/rollout_s, reward_s, old_policy_s, delta_s, update_s,
step_s; each phase ends with block_until_ready). --warmup-steps steps run first and are dropped:
they compile every program (sampler prefill/decode, old-policy pass, DelTA, train step), and the
shapes stay fixed afterwards (prompts of one length, responses padded to --new-tokens), so the
--steps timed steps that follow run compiled code only. Reported: median over the timed steps.
Each step also records how far the sampler's log-probs are from the old-policy pass's on this
backend (rollout/mismatch_k3, sampler_logp_abs_diff_mean / _max, is_beyond_cap_fraction at
rl.rollout_is_cap: rl/rollout_correction.py).
Memory: after each variant, XLA's memory analysis of every jitted program the steps ran (the
old-policy pass, the train step, ...; compiled again from its first call's shapes on the backend
that ran it), printed beside plan mode's figure for its phase (delta_jax.plan.plan_from_config:
"update" for the train step; "old-policy pass + DelTA" for the old-policy pass, which also counts
the optimizer state and the DelTA feature cache that the program itself does not hold).

Remat: --remat auto (the default) is the run config's model.remat="auto" (delta_jax.plan.
choose_remat): the least-recompute policy whose planned update fits the device's allocator limit,
or --device-memory-gb (80) where the backend reports none (the CPU). At the issue's shape
(Qwen3-0.6B, 64-sequence micro-batches of 1152 tokens) the update without remat plans at hundreds
of GB; the small CPU runs keep remat none, as recorded before. The policy run is printed and kept
in the JSON ("remat").
Issue #9 shapes (GPU):
    python benchmarks/step_overhead.py
CPU recording run (a Qwen3-0.6B-shaped model with 2 layers, 4 prompts x 4 responses, 32 tokens):
    python benchmarks/step_overhead.py --layers 2 --prompts 4 --group-size 4 --new-tokens 32 \
        --prompt-len 32 --steps 2 --dtype float32
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import zlib

import numpy as np

from delta_jax import xla_env
from delta_jax.models import REMAT_POLICIES

PHASES = ("rollout_s", "reward_s", "old_policy_s", "delta_s", "update_s", "step_s")
# --offload: the optimizer state's two transfers (rl_step's time/offload_in_s, _out_s)
OFFLOAD = ("offload_in_s", "offload_out_s")
MISMATCH = ("mismatch_k3", "sampler_logp_abs_diff_mean", "sampler_logp_abs_diff_max",
            "is_beyond_cap_fraction")
VARIANTS = ("dapo", "delta", "delta-recompute")
QWEN3_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tokenizers",
                               "qwen3")


class ParityScorer:
    """Stand-in for rl.rewards.RewardScorer: reward = parity of crc32(seed, response text)."""

    def __init__(self, seed: int):
        self.seed = seed

    def score(self, responses, golds, response_lengths=None, truncated=None,
              problems=None, data_sources=None, extra_infos=None):
        rewards = np.array([zlib.crc32(f"{self.seed}:{r}".encode()) & 1 for r in responses],
                           np.float32)
        info = {"accuracy": rewards.copy(), "num_timeouts": 0, "num_no_box": len(responses)}
        return rewards, info

    def close(self):
        pass


def fixed_prompts(num_prompts: int, prompt_len: int, vocab: int, seed: int):
    """An endless iterator over the same batch of random-token prompt records."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(100, min(vocab, 50_000), size=(num_prompts, prompt_len))
    records = [{"prompt_ids": [int(t) for t in row], "answer": "0"} for row in ids]
    while True:
        yield records


def make_config(args, variant: str):
    from delta_jax.train.config import default_config, validate_config

    c = default_config()
    c.method = "dapo" if variant == "dapo" else "delta"
    c.seed = args.seed
    c.model.random_init = True
    c.model.preset = args.preset
    c.model.num_layers = args.layers
    c.model.dtype = args.dtype
    c.model.param_dtype = args.dtype
    c.model.remat = args.remat
    c.plan.device_memory_gb = args.device_memory_gb
    c.tokenizer.path = args.tokenizer
    c.data.max_prompt_len = args.prompt_len
    # Validation wants training data; the prompts come from fixed_prompts (need_data=False).
    c.data.train = "synthetic"
    c.data.synthetic_train = 16
    c.rollout.batch_prompts = args.prompts
    c.rollout.group_size = args.group_size
    c.rollout.max_new_tokens = args.new_tokens
    sequences = args.prompts * args.group_size
    # Defaults sized for one 80 GB GPU at the shape (512 sequences x 1152 tokens of
    # Qwen3-0.6B): the whole batch in one sampler call would need 68 GB of bf16 K/V, and one
    # forward/backward over it tens of GB of activations. Small batches run whole.
    c.rollout.max_batch_size = args.max_batch_size or min(256, sequences)
    c.rl.mini_batch_prompts = args.mini_batch_prompts or args.prompts
    c.rl.micro_batch_size = args.micro_batch_size or math.gcd(64, sequences)
    c.rl.dynamic_sampling = False
    c.rewards.overlong = False  # the stand-in scorer's reward only
    c.optim.offload = args.offload
    c.delta.pass_impl = args.pass_impl
    c.delta.num_refine = args.num_refine
    if variant == "delta-recompute":
        c.delta.feature_cache = "recompute"
        c.delta.recompute_chunk = args.recompute_chunk or min(64, sequences)
    if args.tokenizer != "synthetic":
        # The preset's vocabulary (Qwen3's LM head) when it covers the tokenizer's (ids past the
        # tokenizer decode to ""); else the tokenizer's size (0), e.g. the "tiny" preset.
        from delta_jax import models
        preset_vocab = models.get_preset(args.preset).vocab_size
        if preset_vocab >= models.load_tokenizer(args.tokenizer).vocab_size:
            c.model.vocab_size = preset_vocab
    c.train.steps = args.warmup_steps + args.steps
    c.train.progress_bar = False
    c.train.export_final = False
    return validate_config(c)


def run_variant(args, variant: str, workdir: str) -> dict:
    import jax

    from delta_jax.kernels import timing
    from delta_jax.train.rl_step import rl_step
    from delta_jax.train.run import build_run, place_state
    from delta_jax.train.state import init_train_state

    cfg = make_config(args, variant)
    run = build_run(cfg, os.path.join(workdir, variant), need_data=False, need_scorer=False)
    cfg = run.cfg  # model.remat resolved (auto -> a policy)
    print(f"  {variant}: model.remat={cfg.model.remat}"
          + (" (auto)" if args.remat == "auto" else ""), flush=True)
    run.scorer = ParityScorer(args.seed)
    vocab = cfg.model.vocab_size or run.tokenizer.vocab_size
    run.data_iter = fixed_prompts(args.prompts, args.prompt_len, vocab, args.seed)
    state = place_state(run, init_train_state(run.take_initial_params(), run.optimizer))
    counters, first_calls = {}, {}
    for name in ("old_pass", "ref_pass", "hidden_pass", "topk_proxy_pass", "train_step"):
        fn = getattr(run, name)
        if fn is not None:  # count the calls of each jitted program; keep its first call's shapes
            recorded = timing.recording_first_call(fn, name, first_calls)

            def counted(*a, _fn=recorded, _name=name, **kw):
                counters[_name] = counters.get(_name, 0) + 1
                return _fn(*a, **kw)
            setattr(run, name, counted)
    steps = []
    try:
        for step in range(args.warmup_steps + args.steps):
            out = rl_step(run, state, step)
            state, metrics = out.state, out.metrics
            del out
            row = {k: float(metrics[f"time/{k}"]) for k in PHASES}
            for k in OFFLOAD:
                if f"time/{k}" in metrics:
                    row[k] = float(metrics[f"time/{k}"])
            row["warmup"] = step < args.warmup_steps
            row["reward_mean"] = float(metrics.get("rollout/reward_mean",
                                                   metrics.get("rollout/accuracy", np.nan)))
            row["delta_tokens_pos"] = float(metrics.get("delta/tokens_pos", 0.0))
            row["delta_tokens_neg"] = float(metrics.get("delta/tokens_neg", 0.0))
            # The sampler's log-probs against the old-policy pass's (rl/rollout_correction.py):
            # how far this backend's decode and training numerics disagree.
            for k in MISMATCH:
                row[k] = float(metrics[f"rollout/{k}"])
            steps.append(row)
            print(f"  {variant} step {step}{' (warm-up)' if row['warmup'] else ''}: "
                  + " ".join(f"{k}={row[k]:.3f}" for k in PHASES)
                  + " " + " ".join(f"{k}={row[k]:.3g}" for k in MISMATCH)
                  + "".join(f" {k}={row[k]:.3f}" for k in OFFLOAD if k in row), flush=True)
        jax.block_until_ready(state.params)
    finally:
        run.close()
    timed = [s for s in steps if not s["warmup"]]
    median = {k: statistics.median(s[k] for s in timed) for k in PHASES + OFFLOAD
              if all(k in s for s in timed)}
    return {"variant": variant, "remat": cfg.model.remat, "median": median, "steps": steps,
            "counters": counters, "compiled_memory": compiled_memory(cfg, vocab, variant, first_calls)}


# The plan phase (delta_jax.plan) each jitted program belongs to.
PLAN_PHASES = {"train_step": "update", "old_pass": "old-policy pass + DelTA"}


def compiled_memory(cfg, vocab: int, variant: str, first_calls: dict) -> dict:
    """XLA's memory analysis of each program the steps ran (compiled again from the shapes of
    its first call, on this backend), printed beside plan mode's figure for its phase (planned
    with the run's vocabulary `vocab`: without model.vocab_size the plan would take the preset's)."""
    from delta_jax import plan as plan_lib
    from delta_jax.kernels import timing

    cfg = cfg.copy_and_resolve_references()
    cfg.model.vocab_size = vocab
    phases = plan_lib.plan_from_config(cfg).phases
    return timing.print_recorded_memory(
        first_calls, prefix=f"{variant} ",
        plan_bytes={name: (phase, phases[phase]) for name, phase in PLAN_PHASES.items()})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=0, help="0 = the preset's depth")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed (compiling) steps")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--remat", default="auto", choices=["auto", *REMAT_POLICIES],
                        help="model.remat; auto = plan.choose_remat's policy")
    parser.add_argument("--device-memory-gb", type=float, default=80.0,
                        help="plan.device_memory_gb: what --remat auto plans against where the "
                             "backend reports no allocator limit (the CPU)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--pass-impl", default="kernel", choices=["jnp", "kernel"],
                        help="delta.pass_impl of the delta variants")
    parser.add_argument("--num-refine", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=0,
                        help="rollout.max_batch_size (0 = min(256, sequences))")
    parser.add_argument("--mini-batch-prompts", type=int, default=0, help="0 = one update/step")
    parser.add_argument("--micro-batch-size", type=int, default=0,
                        help="rl.micro_batch_size (0 = gcd(64, sequences))")
    parser.add_argument("--recompute-chunk", type=int, default=0,
                        help="delta.recompute_chunk (0 = min(64, sequences))")
    parser.add_argument("--tokenizer", default="",
                        help="tokenizer dir (default: ../shared/tokenizers/qwen3 if present, "
                             "else the synthetic tiny tokenizer)")
    parser.add_argument("--offload", action="store_true",
                        help="optim.offload=True: the optimizer state in host memory outside the "
                             "updates (update_s then includes its two transfers, also timed "
                             "alone as offload_in_s / offload_out_s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="")
    parser.add_argument("--out", default="benchmarks/results/step_overhead.json")
    args = parser.parse_args(argv)
    xla_env.apply_default_flags()  # the product's XLA flags (as delta_jax.main), before JAX starts
    if not args.tokenizer:
        found = os.path.isfile(os.path.join(QWEN3_TOKENIZER, "tokenizer.json"))
        args.tokenizer = os.path.abspath(QWEN3_TOKENIZER) if found else "synthetic"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"--variants: unknown {v!r}; choose from {VARIANTS}")
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    from delta_jax.kernels import timing

    workdir = args.workdir or tempfile.mkdtemp(prefix="step_overhead_")
    results = {}
    for variant in variants:
        print(f"{variant}: building the run and stepping ({args.warmup_steps} warm-up + "
              f"{args.steps} timed)", flush=True)
        results[variant] = run_variant(args, variant, workdir)

    shape = (f"{args.preset} ({args.layers or 'all'} layers), {args.prompts} prompts x "
             f"{args.group_size} responses, {args.new_tokens} new tokens, prompt {args.prompt_len}"
             f", {args.dtype}")
    timing.print_table(
        f"Step phases (median of {args.steps} steps, seconds) on {timing.device_description()}: "
        f"{shape}; delta.pass_impl={args.pass_impl}",
        [("variant", "variant", "16s")] + [(k[:-2], k, "12.3f") for k in PHASES],
        [{"variant": v, **r["median"]} for v, r in results.items()])

    summary = {}
    if "dapo" in results:
        base = results["dapo"]["median"]["step_s"]
        rows = []
        for v in ("delta", "delta-recompute"):
            if v not in results:
                continue
            med = results[v]["median"]
            summary[v] = {
                "added_step_s": med["step_s"] - base,
                "added_step_pct_of_dapo": 100.0 * (med["step_s"] - base) / base,
                "delta_phase_s": med["delta_s"],
                "delta_phase_pct_of_dapo": 100.0 * med["delta_s"] / base,
            }
            rows.append({"variant": v, **summary[v]})
        if "delta" in results and "delta-recompute" in results:
            extra = (results["delta-recompute"]["median"]["delta_s"]
                     - results["delta"]["median"]["delta_s"])
            summary["recompute_extra_s"] = extra
            summary["recompute_extra_pct_of_dapo"] = 100.0 * extra / base
        timing.print_table(
            f"DelTA's added time vs the dapo step ({base:.3f} s; target <= 3%)",
            [("variant", "variant", "16s"), ("step - dapo s", "added_step_s", "14.3f"),
             ("% of dapo", "added_step_pct_of_dapo", "10.2f"),
             ("delta phase s", "delta_phase_s", "14.3f"),
             ("% of dapo", "delta_phase_pct_of_dapo", "10.2f")], rows)
        if "recompute_extra_s" in summary:
            print(f"recompute mode (K+3 extra trunk passes) costs "
                  f"{summary['recompute_extra_s']:.3f} s more than the cached features "
                  f"({summary['recompute_extra_pct_of_dapo']:.1f}% of the dapo step)")
    timing.write_json(args.out, {"shape": shape,
                                 "results": results, "summary": summary}, args=args)


if __name__ == "__main__":
    main()
