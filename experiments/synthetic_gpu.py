"""The synthetic task at GPU scale, where token credit assignment should matter: a ~76M-parameter
Qwen3-shaped model from random init, long problems (28 operations on 3-digit values, 2 distractor
statements each: responses of ~260-330 tokens with one decisive number per worked step), an SFT
warm start, then DelTA RL; sized for one H100 in about 8 minutes.

    python -m delta_jax.main --config=experiments/synthetic_gpu.py --workdir=runs/synthetic_gpu
    python benchmarks/compare_methods.py --config experiments/synthetic_gpu.py \\
        --variants grpo,dapo,delta --seeds 0,1,2,3,4 --out_dir runs/compare_gpu
    python experiments/synthetic_gpu.py      # the parameter count and the time estimate below
    python -m delta_jax.main --config=experiments/synthetic_gpu.py --config.mode=plan  # memory

Why these sizes. On the default tiny task (experiments/tiny.py: 1-2 operations, ~17-token
answers) nearly every response token is formatting and GRPO, DAPO and DelTA are within seed noise
(BENCHMARKS.md). Here a response is 28 worked steps "a op b = c." + \\boxed{}; a wrong response
is usually right up to one wrong intermediate result and consistent after it, so the tokens that
decide the reward are a few digits among ~300 tokens: the situation DelTA's token weights are for,
and the one the ground-truth credit metrics (delta_jax.rl.credit, logged on the synthetic task)
measure.

Data (generated into the workdir, no downloads): levels 3,4 with data.synthetic_steps=28 and
data.synthetic_digits=3 (operands up to 199, multipliers up to 6 / 7, every value along the way
below 1000), 2 distractors per problem; measured with the tiny tokenizer on 300 problems
(2026-11-23, with the generator's knobs as they stood in the working tree then): prompts mean 180
/ max 242 tokens with the qwen_math template, worked solutions + EOS mean 309 / p99 328 / max 331
tokens. Hence
data.max_prompt_len 256, rollout/eval max_new_tokens 384 (the DAPO overlong penalty only past
352), sft.max_len 640. At 3 digits the tiny tokenizer still covers every number (433 ids, padded
to model.vocab_size 512).

Model: the "tiny" preset's Qwen3 layout (q/k RMSNorm, GQA, SwiGLU, RoPE theta 1e4, untied head)
at hidden 768, 12 layers, 12 query / 4 key-value heads of 64, MLP 2048: 75.5M parameters
without the embeddings, 76.3M with them (num_params() of the ModelConfig, printed by running this
file). bfloat16 activations, float32 master parameters (AdamW), no remat.

Time on one H100: NOT MEASURED (no GPU was available when this was written); an estimate from
FLOPs, see estimate_seconds() (printed by running this file). Assumptions: 989 TFLOP/s dense bf16
peak at 20% utilisation for the matmul-bound phases (SFT, prefill, the old-policy pass, the
update: a 768-wide model cannot fill an H100), 5 ms per decode step of the sampler (latency-bound
at 256 slots; the HBM traffic of one step is ~0.1 ms), 2 minutes of compilation. With these:
SFT 1200 steps x 64 x 640 tokens ~2.0 min; RL 60 steps x 256 samples at ~2.5 s each (decode
~1.9 s, prefill + old-policy pass + 2 updates ~0.6 s) ~2.5 min; the two evals (256 problems x
avg@4) ~0.3 min; compilation ~2 min: ~6.8 min, under the 8-minute target with a little slack for
data generation and the reward workers. Check the real time on the first GPU run and adjust
train.steps / sft.steps.

Memory (`--config.mode=plan`, one 80 GB device, 2026-11-23): update peak 28.3 GB with 32-row
micro-batches (128 rows at once would need ~108 GB of activations with materialised attention
scores), old-policy pass + DelTA 18.9 GB, rollout 3.3 GB. The SFT batch of 64 x 640 tokens holds
about twice the update micro-batch's activations (~55 GB by the same formula, less with cuDNN
attention).

Not tuned: lr 2e-5 for RL and 5e-4 for SFT are guesses scaled from the tiny run (1e-4 / 2e-3 at
0.9M parameters); the warm-start accuracy on 28-step problems is unknown (every step must be
right). If it comes out near 0 or near 1, change sft.steps (more / fewer) or
data.synthetic_steps before comparing methods.
"""
from delta_jax.train.config import default_config

# Assumptions of estimate_seconds (module docstring).
H100_BF16_FLOPS = 989e12
MFU = 0.20
DECODE_STEP_S = 0.005
COMPILE_S = 120.0


def get_config():
    c = default_config()
    c.seed = 0
    c.method = "delta"
    c.model.random_init = True
    c.model.preset = "tiny"          # the Qwen3 layout; every shape overridden below
    c.model.vocab_size = 512         # the tiny tokenizer's 433 ids, padded
    c.model.hidden_size = 768
    c.model.intermediate_size = 2048
    c.model.num_layers = 12
    c.model.num_heads = 12
    c.model.num_kv_heads = 4
    c.model.head_dim = 64
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "none"
    c.model.attention = "auto"
    c.model.logprob_chunk_tokens = 16384
    c.tokenizer.path = "synthetic"
    c.data.train = "synthetic"
    c.data.eval = "synthetic"
    c.data.max_prompt_len = 256
    c.data.synthetic_train = 40000
    c.data.synthetic_test = 512
    c.data.synthetic_levels = "3,4"
    c.data.synthetic_steps = 28
    c.data.synthetic_digits = 3
    c.data.synthetic_distractors = 2
    c.rollout.batch_prompts = 32
    c.rollout.group_size = 8
    c.rollout.temperature = 1.0
    c.rollout.max_new_tokens = 384
    c.rollout.max_batch_size = 256
    c.rewards.num_workers = 4
    c.rewards.overlong_buffer = 32
    c.rl.mini_batch_prompts = 16     # 2 optimizer steps per RL step
    c.rl.micro_batch_size = 32      # plan mode: 128 rows at once need ~108 GB of activations
    c.optim.lr = 2e-5
    c.optim.weight_decay = 0.0
    c.train.steps = 60
    c.train.save_every = 20
    c.train.eval_every = 0
    c.train.keep = 2
    c.sft.steps = 1200
    c.sft.batch_size = 64
    c.sft.lr = 5e-4
    c.sft.warmup_steps = 100
    c.sft.max_len = 640              # the longest prompt + solution + EOS is ~575 tokens
    c.eval.k = 4
    c.eval.pass_k = "1,4"
    c.eval.temperature = 1.0
    c.eval.top_p = 1.0
    c.eval.max_new_tokens = 384
    c.eval.limit = 256
    c.plan.device_memory_gb = 80.0
    c.plan.num_devices = 1
    return c


def model_config(cfg=None):
    """The ModelConfig this config builds (plan.model_config_from_run_config)."""
    from delta_jax import plan
    return plan.model_config_from_run_config(cfg if cfg is not None else get_config())


def forward_flops_per_token(mc, context: float) -> float:
    """Matmul FLOPs of one token's forward pass attending to `context` earlier positions: 2 per
    weight of the layers and the LM head, plus QK^T and AV (4 x heads x head_dim x context)."""
    weights = mc.num_params(include_embeddings=False) + mc.vocab_size * mc.hidden_size
    return 2.0 * weights + 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * context


def estimate_seconds(cfg=None, flops_per_s: float = H100_BF16_FLOPS * MFU,
                     decode_step_s: float = DECODE_STEP_S, compile_s: float = COMPILE_S) -> dict:
    """A time estimate of one run (train mode: SFT warm start, eval, RL, eval) from FLOPs and a
    per-decode-step latency; {phase: seconds} plus "total". Not a measurement."""
    cfg = cfg if cfg is not None else get_config()
    mc = model_config(cfg)
    P, R = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
    rows = cfg.rollout.batch_prompts * cfg.rollout.group_size
    sft_tokens = cfg.sft.steps * cfg.sft.batch_size * cfg.sft.max_len
    sft = 3 * sft_tokens * forward_flops_per_token(mc, cfg.sft.max_len / 2) / flops_per_s
    rl_tokens = rows * (P + R)
    f_rl = forward_flops_per_token(mc, (P + R) / 2)
    old_pass = rl_tokens * f_rl / flops_per_s                       # no-grad forward
    update = cfg.rl.epochs * 3 * rl_tokens * f_rl / flops_per_s      # forward + backward
    slots = max(1, cfg.rollout.max_batch_size)
    decode = -(-rows // slots) * R * decode_step_s
    prefill = rows * P * forward_flops_per_token(mc, P / 2) / flops_per_s
    rl_step = decode + prefill + old_pass + update
    evals = int(cfg.train.eval_before) + int(cfg.train.eval_after)
    eval_rows = cfg.eval.limit * cfg.eval.k
    one_eval = -(-eval_rows // slots) * cfg.eval.max_new_tokens * decode_step_s
    out = {"sft": sft, "rl_step": rl_step, "rl_decode_per_step": decode,
           "rl": cfg.train.steps * rl_step, "eval": evals * one_eval, "compile": compile_s}
    out["total"] = out["sft"] + out["rl"] + out["eval"] + out["compile"]
    return out


if __name__ == "__main__":
    mc = model_config()
    print(f"parameters: {mc.num_params() / 1e6:.1f}M ({mc.num_params(False) / 1e6:.1f}M without "
          "embeddings)")
    est = estimate_seconds()
    print("time estimate on one H100 (not measured; assumptions in the docstring): "
          + ", ".join(f"{k} {v / 60:.2f} min" if k not in ("rl_step", "rl_decode_per_step")
                      else f"{k} {v:.2f} s" for k, v in est.items()))
