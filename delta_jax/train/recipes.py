"""Named run recipes shared by the experiment files: the DelTA paper's RL recipe (DELTA_SPEC.md 3).

Experiment files (experiments/*.py) start from one of these and change a few values.
"""
from delta_jax.train.config import default_config


def paper_config(preset: str, steps: int):
    """Qwen3-Base RL recipe of the paper; needs only model.path and data.train to run."""
    c = default_config()
    c.method = "delta"
    c.model.path = ""                 # required: --config.model.path=/path/to/Qwen3-8B-Base
    c.model.preset = preset           # documentation only unless model.random_init=True
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = "auto"            # plan.choose_remat: full where nothing lighter fits
    c.model.logprob_chunk_tokens = 4096  # = 512 positions x the micro-batch of 8 rows
    c.data.train = ""                 # required: --config.data.train=/path/to/deepmath.jsonl
    c.data.template = "qwen_math"
    c.data.max_prompt_len = 2048
    c.rollout.batch_prompts = 128
    c.rollout.group_size = 16
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1
    c.rollout.max_new_tokens = 20480
    # Sized for Qwen3-8B on 8 x 80 GB (mesh fsdp=8; --config.mode=plan --config.plan.target=cuda
    # plans it against jax's default allocator limit, 60 GB a GPU). Decode slots: 256, 32 a GPU.
    # At 4 rows a GPU a decode step of an fsdp-sharded model is set by what does not grow with
    # the rows (each GPU's read of its weight shard, each layer's collectives' latency), so more
    # slots should raise rollout tokens/s; until 2026-11-28 the recipe had 32 slots, all that a
    # worst-case pool of 22.5k-token sequences could hold. Their pages now come from a 32 GiB
    # pool a GPU (233k tokens of Qwen3-8B, 7.3k a slot on average): samples take pages as they
    # grow and, when the pool runs dry, the newest are preempted and later resume where they
    # stopped (rollout.resume_preempted: one prefill of their prompt and tokens).
    # The old-policy pass keeps chunks of 32 rows (its activations grow with them). Rollout
    # speed at these settings: not measured.
    c.rollout.max_batch_size = 256
    c.rollout.kv_budget_gb = 32.0
    c.rl.old_pass_rows = 32
    # Every device one fsdp shard (parameters, gradients and optimizer state split over them,
    # batches too): on 8 x 80 GB an unsharded replica per GPU (the schema's data-parallel mesh)
    # plans 166-295% of a GPU for Qwen3-8B. A TPU slice may add tensor parallelism
    # (--config.mesh.fsdp=8 --config.mesh.tensor=4 on a v5p-64).
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.rewards.name = "math"
    c.rewards.num_workers = 8
    c.rewards.overlong_buffer = 4096
    c.rewards.overlong_factor = 1.0
    c.rl.mini_batch_prompts = 32      # 4 optimizer steps per rollout batch, 1 epoch
    c.rl.epochs = 1
    c.rl.micro_batch_size = 8
    c.rl.entropy_coef = 0.0
    c.rl.kl_coef = 0.0               # paper: no KL term (rl.kl_type applies when > 0)
    c.delta.num_refine = 1
    c.delta.lam_min = 0.8
    c.delta.lam_max = 1.2
    c.delta.proxy = "last_layer"
    c.delta.feature_cache = "device"
    c.optim.lr = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.1
    c.optim.max_grad_norm = 1.0
    c.train.steps = steps
    c.train.save_every = 4
    c.train.keep = 3
    # The paper picks its checkpoint on AIME25 avg@8, validated every 4 steps, and reports avg@16
    # on seven benchmarks: the periodic evals are validations at 8 samples (val/...: on data.val,
    # e.g. .../aime25.jsonl, else on data.eval; --config.train.best_metric=
    # val/benchmarks/aime25/avg@8 keeps the best policy, and --config.train.eval_best=True
    # evaluates it on data.eval at the end), data.eval at 16 before and after.
    c.train.eval_every = 4
    c.eval.val_k = 8
    c.sft.steps = 0
    c.eval.k = 16
    c.eval.pass_k = "1,16"
    c.eval.temperature = 1.0
    c.eval.top_p = 0.7
    c.eval.max_new_tokens = 30000
    return c


def small_model_config(preset: str, steps: int = 200):
    """paper_config scaled down to a small model (Qwen3-0.6B / 1.7B) and batch: 32 prompts x 8
    rollouts of up to 4096 tokens, 4 updates per step in micro-batches of 8 rows."""
    c = paper_config(preset, steps)
    c.rollout.batch_prompts = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 4096
    c.rewards.overlong_buffer = 1024
    c.rl.mini_batch_prompts = 8
    c.rl.micro_batch_size = 8
    # One device: 32 slots in a pool of 21.5 GiB (a rollout's worst case, 22.9 GB for either
    # model, never preempts; evaluation's 8k-token samples share it) beside the optimizer state
    # (Qwen3-1.7B's 20 GB with its float32 master copy) within an 80 GB GPU's 60 GB limit.
    c.rollout.max_batch_size = 32
    c.rollout.kv_budget_gb = 21.5
    c.rl.old_pass_rows = 0
    # A whole replica per device fits these models (data parallel over several: Qwen3-1.7B on
    # 8 x 80 GB plans 30 / 26 / 42 GB for rollout / old pass / update against 60).
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.eval.max_new_tokens = 8192
    return c
