"""The run configuration: its schema with defaults, the method presets, and validation.

Every experiment file (experiments/*.py) starts from `default_config()` and changes values; it may
not add fields. `validate_config(cfg)` runs at start-up and raises `ConfigError` naming the field for
an unknown field, a wrong type, a bad choice or an impossible combination. `resolve_method(cfg)`
fills the fields left at None ("the method's default") from the method table below.

Methods (one flag, `--config.method=...`; any single field can still be overridden):

  grpo   GRPO advantages (group mean/std, ddof 1) + PPO clip 0.2 / 0.2, no dual clip, token-mean
         aggregation, no overlong penalty, no dynamic sampling.  (Token-mean rather than GRPO's
         original seq-mean-token-mean, so that the three methods differ only in what is listed.)
  dapo   GRPO advantages + clip-higher 0.2 / 0.28, dual clip 10, token-mean, DAPO overlong penalty
         (buffer/factor from rewards.*); dynamic sampling stays off unless rl.dynamic_sampling=True
         (the DelTA paper's runs use none).
  delta  dapo + DelTA token weights (DELTA_SPEC.md; settings under delta.*).
"""
from __future__ import annotations

import dataclasses
import math
import os

from ml_collections import config_dict

METHODS = ("grpo", "dapo", "delta")
MODES = ("train", "sft", "eval", "plan")

# Fields the method decides when the user leaves them at None.
METHOD_DEFAULTS = {
    "grpo": {"rl.advantage": "grpo", "rl.eps_low": 0.2, "rl.eps_high": 0.2, "rl.dual_clip": 0.0,
             "rl.agg": "token-mean", "rewards.overlong": False, "rl.dynamic_sampling": False},
    "dapo": {"rl.advantage": "grpo", "rl.eps_low": 0.2, "rl.eps_high": 0.28, "rl.dual_clip": 10.0,
             "rl.agg": "token-mean", "rewards.overlong": True, "rl.dynamic_sampling": False},
}
METHOD_DEFAULTS["delta"] = dict(METHOD_DEFAULTS["dapo"])

CHOICES = {
    "method": METHODS,
    "mode": MODES,
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.remat": ("auto", "none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"),
    "model.attention": ("auto", "xla", "blockwise", "cudnn"),  # models.attention.IMPLS
    "plan.target": ("", "cpu", "cuda", "tpu"),  # plan.TARGETS
    "model.logprob_impl": ("chunked", "fused"),
    "delta.pass_impl": ("jnp", "kernel"),
    "rl.advantage": ("grpo", "drgrpo", "rloo", "batch_std"),
    "rl.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "delta.feature_cache": ("device", "host", "recompute"),
    "rl.kl_type": ("k1", "k2", "k3"),
    "rl.rollout_is": ("none", "tis", "mis"),  # rl.rollout_correction.MODES
    "rl.ratio_level": ("token", "sequence"),  # rl.losses.RATIO_LEVELS
    "rl.surrogate": ("clip", "sapo"),  # rl.losses.SURROGATES
    "delta.proxy": ("last_layer", "hidden_topk"),
    "delta.stats_mode": ("global", "per_shard"),
    "delta.assignment": ("soft", "hard"),
    "delta.weight": ("lambda", "alpha"),
    "data.template": ("qwen_math", "base", "chat", "plain", "code"),  # data.templates.KINDS
    "data.on_error": ("raise", "skip"),
    "data.overlong_prompts": ("drop", "error", "truncate"),
    "rewards.code_sandbox": ("local", "sandbox_fusion"),
    "rewards.completion_format": ("auto", "text", "messages"),  # rewards.COMPLETION_FORMATS
    "rl.dynamic_sampling_on_max_rounds": ("raise", "pad"),  # rl.dynamic_sampling.ON_MAX_ROUNDS
    "train.best_mode": ("max", "min"),
    # models.attention.DECODE_IMPLS
    "rollout.decode_attention": ("auto", "reference", "mosaic", "mosaic_fused", "tpu"),
}

# Placeholders: None means "the method decides" (see METHOD_DEFAULTS).
_P = config_dict.placeholder


class ConfigError(ValueError):
    """A bad configuration; the message starts with the offending field's dotted name."""


def default_config() -> config_dict.ConfigDict:
    """The full schema with defaults (the paper's settings where it has one, DELTA_SPEC.md 3)."""
    c = config_dict.ConfigDict()
    c.seed = 0
    c.method = "delta"
    c.mode = "train"

    c.model = config_dict.ConfigDict()
    c.model.path = ""            # Hugging Face directory (config.json + *.safetensors)
    c.model.random_init = False  # build models.get_preset(preset) with random weights instead
    c.model.preset = ""          # models.get_preset name for random init ("tiny", "qwen3-0.6b", ...)
    c.model.dtype = "float32"    # activations
    c.model.param_dtype = "float32"
    # "auto": the first policy of plan.auto_remat_order (on CUDA dots_with_no_batch_dims_saveable,
    # full; elsewhere none first) whose planned update fits the device (plan.choose_remat); or one
    # of models.REMAT_POLICIES.
    c.model.remat = "auto"
    # Attention implementation (delta_jax/models/attention.py): "xla" materialises the [T, S]
    # scores; "auto" = cuDNN flash on GPU where it applies, else blockwise for long sequences.
    c.model.attention = "auto"
    # Random-init shape overrides (0 = keep the preset's value; vocab 0 = the tokenizer's size).
    c.model.vocab_size = 0
    c.model.hidden_size = 0
    c.model.intermediate_size = 0
    c.model.num_layers = 0
    c.model.num_heads = 0
    c.model.num_kv_heads = 0
    c.model.head_dim = 0
    # Tokens (rows x positions) whose fp32 [tokens, vocab] logits exist at once in the LM-head
    # log-prob passes (train step, old-policy / reference passes, SFT): a budget in tokens, so
    # the memory does not grow with the micro-batch (4096 x 151936 x 4 B = 2.5 GB per buffer).
    c.model.logprob_chunk_tokens = 4096
    # Per-token log-probs of the LM head: "chunked" = logits of logprob_chunk_tokens tokens at a
    # time (models.token_logprobs); "fused" = kernels.lm_head_logprob (tiled over the
    # vocabulary with an online log-sum-exp and a custom VJP, never materialising [T, V] logits).
    c.model.logprob_impl = "chunked"
    # LoRA (models.transformer): rank 0 = full fine-tuning; > 0 trains only low-rank adapters on
    # the projections in lora_targets ("all" = q,k,v,o,gate,up,down, or a comma-separated
    # subset), scaled by lora_alpha / rank, and exports W + (alpha / rank) B A merged. The base
    # weights get no gradient and no optimizer state. LoRA usually wants a larger optim.lr than
    # full fine-tuning (~10x).
    c.model.lora_rank = 0
    c.model.lora_alpha = 32.0
    c.model.lora_targets = "all"

    c.tokenizer = config_dict.ConfigDict()
    c.tokenizer.path = ""        # "" = model.path; "synthetic" = build the tiny tokenizer in workdir

    c.data = config_dict.ConfigDict()
    c.data.train = ""            # JSONL/parquet path(s), comma separated, or "synthetic"
    # Comma separated benchmark files (name = file stem; JSONL, JSON or parquet in any layout
    # data/records.py reads, e.g. verl's parquet; evaluation.load_benchmark), or "synthetic".
    c.data.eval = ""
    # The periodic evaluations during training (train.eval_every) as a validation of their own,
    # as the paper picks its checkpoint on AIME25 avg@8 every 4 steps while it reports avg@16 on
    # seven benchmarks: these benchmark files ("" = data.eval's) at eval.val_k samples a question,
    # logged as val/... (eval/val_step_<N>.json); data.eval is then evaluated before and after
    # training only (train.eval_before / eval_after). Both unset: the periodic evals are data.eval's.
    c.data.val = ""
    c.data.template = "qwen_math"   # delta_jax.data.templates.KINDS
    # The instruction the run's template gives with each problem of the run's task (qwen_math's
    # system turn; base / chat / plain / code: after the problem): "" = the task's own (math:
    # put the final answer in \boxed{}; code: one ```python block). For a reward of the user's
    # own that reads another form (verl's DAPO reward reads "Answer: ..."); "none" gives none,
    # for data whose problems carry their own (verl's GSM8K asks for "#### <answer>"). The other
    # task's benchmarks keep their task's instruction.
    c.data.instruction = ""
    # data.template = "chat" only (the tokenizer's own chat template): a system turn before the
    # user's ("" = none), and Qwen3's thinking switch (False opens the answer with an empty
    # <think></think> block: non-thinking mode; templates without the variable ignore it).
    c.data.system_prompt = ""
    c.data.enable_thinking = True
    c.data.max_prompt_len = 2048
    # False: the training records in file order, every epoch (e.g. a curriculum sorted by
    # difficulty); True: a new order each epoch (seed + epoch).
    c.data.shuffle = True
    # Training records whose prompt is longer: "drop" (left out, counted in a warning), "error"
    # (refused at start-up) or "truncate" (their last max_prompt_len tokens are kept).
    c.data.overlong_prompts = "drop"
    # Reading data.train (data/records.py): "auto" detects the layout; or a preset name, or a
    # JSON object string {"problem": "<column>", "answer": "<column>"} (optional keys: id,
    # solution, level, data_source, extra_info; the last two, a rewards.python_fn's context,
    # default to the rows' own columns of those names). on_error: raise | skip (malformed rows
    # are counted and left out).
    c.data.fields = "auto"
    c.data.on_error = "raise"
    c.data.synthetic_train = 4096  # synthetic task sizes (data.train == "synthetic")
    c.data.synthetic_test = 64
    c.data.synthetic_levels = "1,2"
    c.data.synthetic_steps = 0         # > 0: every problem has this many operations (else the level's)
    c.data.synthetic_digits = 2        # every value along the way stays below 10**digits
    c.data.synthetic_distractors = 0   # irrelevant clauses (word) / facts (expression) per problem

    c.rollout = config_dict.ConfigDict()
    c.rollout.batch_prompts = 128
    c.rollout.group_size = 16
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1
    c.rollout.max_new_tokens = 20480
    c.rollout.max_batch_size = 256  # decode slots of the sampler (continuous batching)
    # The sampler's paged KV cache (delta_jax/sampling): tokens per page; the page pool's size
    # in GiB (0 = the worst case of max_batch_size slots at full length, so nothing ever waits;
    # a smaller budget preempts the newest samples, which resume later: resume_preempted);
    # decode steps per jitted call; decode attention (auto = the project's Mosaic GPU kernel
    # on Hopper GPUs, the jnp page reader elsewhere; mosaic_fused = that kernel with the
    # layer's q / k norms, RoPE and K / V writes inside, no gain on an H100;
    # models.attention.resolve_decode_impl).
    c.rollout.page_size = 32
    c.rollout.kv_budget_gb = 0.0
    c.rollout.decode_steps_per_call = 32
    c.rollout.decode_attention = "auto"
    # Decode calls run only the rows the live samples need (the smallest power of two of rows,
    # >= 8, that holds them, when fewer than the slots; Sampler shrink_batch): ~10% faster on
    # an H100's long tail; same tokens on the CPU, some differ on a GPU (README).
    c.rollout.shrink_batch = True
    # Prefill and decode compiled with XLA's GEMMs held to one summation order at every row count
    # and no excess precision (no split-K, no cuBLAS; Sampler batch_invariant), so a GPU's tokens
    # should not depend on the schedule (shrink_batch, max_batch_size, refills): its effect and
    # cost on a GPU are not measured yet. GPU and CPU only (refused on a TPU).
    c.rollout.batch_invariant = False
    # The Mosaic GPU decode kernel's splits of each row's pages (flash-decoding): 1, a fixed
    # count, or 0 = auto (per call, enough splits to give every SM a block: the few rows of a
    # rollout's draining tail read their long pages with the whole GPU; Sampler decode_splits).
    # Not measured on a GPU yet; 0 is refused with rollout.batch_invariant.
    c.rollout.decode_splits = 1
    # A sample preempted when the page pool (kv_budget_gb) runs dry keeps its tokens and resumes
    # where it stopped after one prefill of its prompt and those tokens (Sampler
    # resume_preempted); False restarts it from its first token. The same tokens up to rounding.
    c.rollout.resume_preempted = True

    c.rewards = config_dict.ConfigDict()
    c.rewards.name = "math"
    c.rewards.num_workers = 2
    c.rewards.timeout_s = 10.0
    c.rewards.overlong = _P(bool)
    c.rewards.overlong_buffer = 4096
    c.rewards.overlong_factor = 1.0
    # rewards.name = "math_format" only: + one_box_bonus for exactly one \\boxed{} answer,
    # - no_box_penalty for none (defaults: 1 correct, 0 wrong, -1 no boxed answer).
    c.rewards.one_box_bonus = 0.0
    c.rewards.no_box_penalty = 1.0
    # rewards.name = "code" (rl/rewards.py, rl/sandbox.py): where model-written programs run
    # ("local": a namespace sandbox per program; "sandbox_fusion": an HTTP SandboxFusion service
    # at code_sandbox_url), whether the local sandbox must isolate (False runs programs without
    # namespaces, with a warning on every start), its per-program limits, and partial credit
    # (fraction of tests passed instead of all-or-nothing).
    c.rewards.code_sandbox = "local"
    c.rewards.code_sandbox_url = ""
    c.rewards.code_isolation = True
    c.rewards.code_memory_mb = 1024
    c.rewards.code_max_processes = 8
    c.rewards.code_pass_fraction = False
    # rewards.name = "python": a reward of your own, "<file.py>:<function>" or
    # "<module>:<function>", called fn(response: str, answer: str) in the rewards.num_workers
    # worker processes (rewards.timeout_s each) and returning a number or bool (the reward;
    # correct, for accuracy and eval, when > 0) or {"reward" | "score": number, "correct": bool}.
    # DAPO's overlong shaping (rewards.overlong) still adds to it; a call that raises scores 0.
    # A function with a `completions` parameter is a batch reward, TRL's reward_funcs form:
    # fn(completions=[...], prompts=, completion_ids=, answer= / solution= / ground_truth=, ...,
    # trainer_state= (global_step, max_steps) by keyword) ->
    # one reward (or None = 0) each, called on python_batch_size responses at a time
    # (rewards.timeout_s a call), with completions as strings or, completion_format=messages,
    # TRL's conversational [{"role": "assistant", "content": ...}] ("auto": messages for the
    # chat templates qwen_math / chat / code, strings for base / plain).
    # Several functions, separated by commas, are summed with python_weights ("" = 1 each; TRL's
    # reward_funcs and reward_weights): correctness (accuracy, eval) is the first function's, and
    # each one's mean reward is logged as rollout/reward_fn/<function name>.
    # A function's other parameters (not the ones above) are data set columns, as TRL passes a
    # data set's columns by keyword: the records keep the row's top-level columns of those names
    # (a row without one the function takes without a default is malformed, data.on_error),
    # and a call gets them where its records have them; python_columns names more (comma
    # separated, each required) for a function that reads them from **kwargs, which gets every
    # column kept.
    c.rewards.python_fn = ""
    c.rewards.python_weights = ""
    c.rewards.python_columns = ""
    c.rewards.python_batch_size = 16
    c.rewards.completion_format = "auto"

    c.rl = config_dict.ConfigDict()
    c.rl.advantage = _P(str)
    c.rl.eps_low = _P(float)
    c.rl.eps_high = _P(float)
    c.rl.dual_clip = _P(float)   # 0 disables
    c.rl.agg = _P(str)
    c.rl.log_ratio_clamp = 20.0
    # The importance ratio of the clipped surrogate: "token" (PPO / GRPO / DAPO, the paper's) or
    # "sequence" (GSPO: each response's length-normalised ratio exp(mean_t log pi / pi_old) for
    # all its tokens; its paper clips at rl.eps_low=3e-4, rl.eps_high=4e-4, rl.agg=
    # seq-mean-token-mean). DelTA's token weights and rl.rollout_is still act per token.
    c.rl.ratio_level = "token"
    # The per-token objective: "clip" (the PPO / DAPO clipped surrogate: rl.eps_low, rl.eps_high,
    # rl.dual_clip) or "sapo" (SAPO, arXiv 2511.20347, the DelTA paper's strongest 8B baseline:
    # a soft sigmoid gate, no clip; rl.eps_* and rl.dual_clip are then refused). Its gate
    # temperatures for positive / other advantages (the SAPO paper's 1.0 / 1.05).
    c.rl.surrogate = "clip"
    c.rl.sapo_tau_pos = 1.0
    c.rl.sapo_tau_neg = 1.05
    # FIPO (arXiv 2603.19835, the DelTA paper's strongest 14B baseline): the clipped surrogate of
    # each token times clip(exp(FutureKL_t), 1, 1 + rl.fipo_clip) (1 - rl.fipo_clip below with
    # rl.fipo_clip_high_only=False), FutureKL_t the sum of the later tokens' log(pi / pi_old),
    # discounted by 2^(-1 / rl.fipo_decay_rate) a token, tokens over rl.dual_clip left out; a
    # negative-advantage token whose ratio is over rl.fipo_safety_threshold (0 = off) is never
    # amplified; a response with more than one dual-clipped token leaves the loss. It needs more
    # than one update a step (pi = pi_old at the first). Defaults: the settings ms-swift's port
    # documents and FIPO's loss code defaults to (decay 32, clip 0.2, high only, safety 4).
    c.rl.fipo = False
    c.rl.fipo_decay_rate = 32.0
    c.rl.fipo_clip = 0.2
    c.rl.fipo_clip_high_only = True
    c.rl.fipo_safety_threshold = 4.0
    c.rl.entropy_coef = 0.0
    # KL penalty to a frozen reference policy (the initial policy, after any SFT warm start).
    # 0 = off (the paper's setting). When on, the run keeps a second copy of the parameters and
    # runs one extra forward pass per step (reference log-probs, in the old-policy phase).
    c.rl.kl_coef = 0.0
    c.rl.kl_type = "k3"           # k1 | k2 | k3 (Schulman's estimators; GRPO uses k3)
    # Sampler-vs-trainer mismatch correction (rl/rollout_correction.py): "none" (the paper's
    # surrogate), "tis" (weight min(pi_old / pi_rollout, cap) per token) or "mis" (drop tokens
    # whose ratio exceeds cap). Its metrics (rollout/is_*, rollout/mismatch_k3) are logged always.
    c.rl.rollout_is = "none"
    c.rl.rollout_is_cap = 2.0
    c.rl.mini_batch_prompts = 32  # prompts per optimizer step (x group_size sequences)
    c.rl.micro_batch_size = 0     # sequences per forward/backward (0 = whole mini-batch)
    # Sequences per chunk of the old-policy pass (and the reference-policy and top-k proxy
    # passes), all devices together: 0 = rollout.max_batch_size. Its activations grow with it.
    c.rl.old_pass_rows = 0
    c.rl.epochs = 1
    c.rl.dynamic_sampling = _P(bool)
    c.rl.dynamic_sampling_max_rounds = 8
    # Prompts generated per dynamic-sampling round (DAPO's gen batch size): 0 = the batch's own
    # rollout.batch_prompts, else a multiple of it (each round draws whole data batches).
    c.rl.dynamic_sampling_prompts_per_round = 0
    # When the rounds run out before the batch fills: "raise", or "pad" it with zero-signal
    # groups (zero advantage, no gradient) and warn; rollout/padded_groups counts them.
    c.rl.dynamic_sampling_on_max_rounds = "raise"
    c.rl.max_nonfinite = 3        # consecutive skipped (non-finite) updates before the run stops
    # DAPO's overlong filtering (TRL's mask_truncated_completions): responses cut at
    # rollout.max_new_tokens leave the loss (their tokens out of the surrogate, its token counts,
    # the KL / entropy terms and DelTA's statistics); they still count in their group's
    # advantages. Off in the paper's runs (the overlong penalty, rewards.overlong, shapes them).
    c.rl.mask_truncated = False
    # The high-entropy minority (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939):
    # > 0 keeps in the loss only the response tokens whose old-policy entropy is in the top
    # this fraction of the batch's (the paper's 0.2); the others leave it as rl.mask_truncated's
    # do (rl/high_entropy.py). 0 = off, as in the DelTA paper.
    c.rl.entropy_top_frac = 0.0

    c.delta = config_dict.ConfigDict()
    c.delta.num_refine = 1
    c.delta.lam_min = 0.8
    c.delta.lam_max = 1.2
    c.delta.proxy = "last_layer"
    c.delta.topk = 64
    c.delta.stats_mode = "global"
    c.delta.feature_cache = "device"  # device | host | recompute
    c.delta.recompute_chunk = 64      # sequences per chunk in recompute mode
    # Refinement passes over the cached features: "jnp" = rl/delta.py's XLA code; "kernel" =
    # kernels.delta_pass (one fused pass over (h, p) per round, v never stored).
    c.delta.pass_impl = "jnp"
    # The paper's ablation rows (DELTA_SPEC section 4); the defaults are the full method.
    c.delta.fixed_gamma = 0.0         # > 0: both temperatures fixed to this value (spec 2.4 off)
    c.delta.assignment = "soft"       # soft: alpha = sigmoid(Delta / gamma); hard: alpha = 1[Delta > 0]
    c.delta.normalize = True          # False: w = lambda (spec 2.7's normaliser c = 1)
    c.delta.weight = "lambda"         # lambda: spec 2.6; alpha: the raw alpha* as lambda (P/N), 0 on Z
    c.delta.random_lambda = False     # True: lambda ~ U[lam_min, lam_max] per P/N token (a control)

    c.optim = config_dict.ConfigDict()
    c.optim.lr = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.min_lr_ratio = 0.0
    c.optim.weight_decay = 0.1
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.max_grad_norm = 1.0
    # bfloat16 parameters (model.param_dtype) are updated through a float32 master copy held in
    # the optimizer state, AdamW's moments in float32 (train.state.with_master_weights: +10 bytes
    # a parameter); False updates them in bfloat16, where a small step (the paper's lr 1e-6)
    # rounds away. No effect on float32 parameters.
    c.optim.master_weights = True
    # True: the optimizer state (master copy and moments) rests in the host's pinned memory and is
    # on the device only for a step's updates (brought over before the first, returned after the
    # last: two transfers of its size per RL step), so the rollout and the old-policy pass run
    # without it. Needs a backend with a pinned_host memory space (GPU, TPU).
    c.optim.offload = False

    c.train = config_dict.ConfigDict()
    c.train.steps = 220
    c.train.log_every = 1
    c.train.save_every = 4
    c.train.keep = 3
    c.train.eval_every = 4        # 0 = no periodic eval
    c.train.eval_before = True
    c.train.eval_after = True
    c.train.export_final = True   # write the final policy as a HF directory in workdir/final
    c.train.progress_bar = True
    # A rollout or evaluation generate() call running longer than this logs a progress line
    # (samples done, tokens, tok/s) every this many seconds (sampling.progress; 0 = never).
    c.train.progress_every_s = 60.0
    # Every this many RL steps (0 = never), the step's responses as they were trained on, one
    # JSON line each (prompt, response, answer, reward, advantage, length, truncated, the loss's
    # mean token weight): workdir/rollouts/step_<N>.jsonl (train/generations.py). The 8B
    # recipe's 2,048 responses of up to 20k tokens are up to ~170 MB a step.
    c.train.rollouts_every = 0
    # With rollouts_every: each row also holds its response's token ids ("token_ids", the stop
    # token included) and the weight the loss gave each ("token_weights", 0 where a token is
    # not in the loss): DelTA's coefficients token by token over the run (~6 bytes a token).
    c.train.rollouts_token_weights = False
    # JAX's persistent compilation cache: a rerun of the same shapes (a sweep, a resume) loads
    # its compiled programs instead of compiling them again. "" = off; JAX_COMPILATION_CACHE_DIR,
    # where set, wins. Off on the CPU backend (xla_env.enable_compilation_cache says why).
    c.train.compilation_cache_dir = "~/.cache/delta_jax/jax"
    # The best policy by an eval metric, as the paper picks its checkpoint (AIME25 avg@8,
    # validated every 4 steps): "" = off, else a metric the training evals log, e.g.
    # "eval/benchmarks/aime25/avg@8" or "eval/average/pass@16"; each eval whose value beats the
    # best so far (best_mode: max | min) exports the policy to workdir/best (train/best.py).
    c.train.best_metric = ""
    c.train.best_mode = "max"
    # True: after the last step the best policy (workdir/best) is evaluated on data.eval at
    # eval.k, as the paper reports its checkpoint picked on the validation: eval/best_step_N.json
    # and the table printed (train.loop.evaluate_best). Needs train.best_metric.
    c.train.eval_best = False
    # Resuming a run whose results-changing fields differ from its config.json is refused
    # (the differences are listed) unless this is True.
    c.train.allow_config_change = False

    c.sft = config_dict.ConfigDict()
    c.sft.steps = 0               # > 0 in train mode: a supervised warm start before RL
    c.sft.batch_size = 32
    c.sft.micro_batch_size = 0    # rows per forward/backward of a step (0 = the whole batch)
    c.sft.lr = 1e-3
    c.sft.warmup_steps = 10
    c.sft.weight_decay = 0.0
    c.sft.max_len = 128
    # The warm start's own checkpoints (workdir/sft_checkpoints), every this many SFT steps and at
    # a stop (0: at a stop only); each holds a whole optimizer state, and SFT steps are short.
    c.sft.save_every = 100

    c.eval = config_dict.ConfigDict()
    c.eval.k = 16
    c.eval.pass_k = "1"
    # Majority voting, comma separated k' <= eval.k ("" = none): maj@k' (cons@k'), the accuracy of
    # the final answer most of k' samples give (evaluation.maj_at_k; math benchmarks, built-in
    # math rewards), beside avg@k and pass@k.
    c.eval.maj_k = ""
    c.eval.temperature = 1.0
    c.eval.top_p = 0.7
    c.eval.max_new_tokens = 30000
    c.eval.limit = 0              # questions per benchmark (0 = all)
    # Samples per question of the validations (data.val above; 0 = eval.k); their pass@k are the
    # eval.pass_k values up to it.
    c.eval.val_k = 0
    # Every eval sample's response and whether it was right, one JSON line each, beside the eval's
    # results: eval/<step_N | standalone_step_N>_responses.jsonl (train/generations.py).
    c.eval.save_responses = False
    # mode=eval evaluates: "latest" (the newest checkpoint in the workdir that reads back, else
    # model.path), "none" (model.path itself, e.g. a run's best/ or final/ export, even in a
    # workdir with checkpoints) or a step N (checkpoint N of the workdir).
    c.eval.checkpoint = "latest"

    # Device mesh (delta_jax/sharding.py): sizes of the ("data", "fsdp", "tensor") axes; one may
    # be -1 = the remaining devices. Rules: batch -> (data, fsdp), embed -> fsdp,
    # heads/mlp/vocab -> tensor.
    c.mesh = config_dict.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1

    # Multi-host (jax.distributed): empty = the JAX_* environment, a TPU pod or SLURM job
    # (detected), or a single process.
    c.distributed = config_dict.ConfigDict()
    c.distributed.coordinator_address = ""   # "host:port" of process 0
    c.distributed.num_processes = 0
    c.distributed.process_id = -1
    # Seconds without heartbeats after which the runtime declares a process dead and stops the
    # others (a process that fails alone exits at once; the rest follow within this time).
    c.distributed.heartbeat_timeout_s = 100

    # mode=plan (delta_jax/plan.py): per-device memory of this config on a planned machine.
    c.plan = config_dict.ConfigDict()
    c.plan.device_memory_gb = 80.0   # HBM per device (H100 80 GB; v5p 95 GB)
    # The fraction of it XLA's allocator may use, which plan mode plans against: 0 = the target's
    # default (CUDA: XLA_CLIENT_MEM_FRACTION or XLA_PYTHON_CLIENT_MEM_FRACTION where set, else
    # jax's 0.75; TPU, CPU: 1). A train / eval start-up check uses the device's own limit.
    c.plan.memory_fraction = 0.0
    c.plan.num_devices = 0           # 0 = the devices present
    c.plan.host_memory_gb = 0.0      # host RAM per process, for feature_cache=host (0 = unknown)
    # The backend plan mode plans for: "" = the one it runs on; "cuda" / "tpu" / "cpu" (decides
    # what model.attention=auto runs: cuDNN flash on CUDA GPUs in bf16, else by the length).
    c.plan.target = ""
    # train / eval start-up: fail (naming the phase and the fields to turn) when a phase's planned
    # per-device peak exceeds what the device's allocator may use (GPU / TPU; the CPU reports no
    # limit and is not checked).
    c.plan.check_memory = True
    return c


def _flatten(cfg, prefix=""):
    """{dotted field name: value} of a ConfigDict or of its to_dict() / config.json form."""
    out = {}
    for key in cfg.keys():
        value = cfg[key]
        name = f"{prefix}{key}"
        if isinstance(value, (config_dict.ConfigDict, dict)):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def _set(cfg, dotted, value):
    parts = dotted.split(".")
    for part in parts[:-1]:
        cfg = cfg[part]
    with cfg.unlocked():
        cfg[parts[-1]] = value


def _schema_types():
    """Field -> expected Python type, from the defaults (placeholders carry their type)."""
    schema = default_config()
    types = {}
    for name in _flatten(schema):
        parent = _get(schema, name.rsplit(".", 1)[0]) if "." in name else schema
        ref = parent.get_ref(name.rsplit(".", 1)[-1])
        types[name] = ref.get_type()
    return types


def resolve_method(cfg: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """Returns a copy with every None field filled from METHOD_DEFAULTS[cfg.method]."""
    if cfg.method not in METHODS:
        raise ConfigError(f"method: {cfg.method!r} is not one of {METHODS}")
    out = config_dict.ConfigDict(cfg.to_dict(preserve_field_references=False))
    for name, value in METHOD_DEFAULTS[cfg.method].items():
        if _get(out, name) is None:
            _set(out, name, value)
    return out


def validate_config(cfg: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """Checks `cfg` against the schema and the combination rules; returns the resolved config.

    Raises ConfigError("<field>: ...") for unknown fields, wrong types, bad choices and impossible
    combinations.
    """
    types = _schema_types()
    given = _flatten(cfg)
    for name in given:
        if name not in types:
            raise ConfigError(f"{name}: unknown config field (not in delta_jax.train.config"
                              ".default_config())")
    for name in types:
        if name not in given:
            raise ConfigError(f"{name}: missing config field")
    cfg = resolve_method(cfg)
    tree = cfg.to_dict()
    for name, value in _flatten(cfg).items():
        expected = types[name]
        if value is None:
            raise ConfigError(f"{name}: must be set (got None)")
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            parent = tree
            for part in name.split(".")[:-1]:
                parent = parent[part]
            parent[name.split(".")[-1]] = float(value)  # an int where a float is expected
            continue
        if expected is not None and not (isinstance(value, expected)
                                         and not (expected is int and isinstance(value, bool))):
            raise ConfigError(f"{name}: expected {expected.__name__}, got "
                              f"{type(value).__name__} {value!r}")
    cfg = config_dict.ConfigDict(tree)
    for name, choices in CHOICES.items():
        if _get(cfg, name) not in choices:
            raise ConfigError(f"{name}: {_get(cfg, name)!r} is not one of {choices}")
    _check_combinations(cfg)
    return cfg


# models.LORA_TARGETS (not imported: this module loads before jax).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets(cfg) -> tuple[str, ...]:
    """model.lora_targets as a tuple of projection names ("all" = every one)."""
    if cfg.model.lora_targets == "all":
        return LORA_TARGETS
    return tuple(t.strip() for t in cfg.model.lora_targets.split(",") if t.strip())


def _require(ok, name, message):
    if not ok:
        raise ConfigError(f"{name}: {message}")


# DelTA's own hyperparameters (the coefficients and the paper's ablations), which only
# method="delta" trains with; delta.feature_cache / recompute_chunk / pass_impl are memory and
# speed settings that the recipes set for every method.
DELTA_METHOD_FIELDS = ("delta.num_refine", "delta.lam_min", "delta.lam_max", "delta.proxy",
                       "delta.topk", "delta.stats_mode", "delta.fixed_gamma", "delta.assignment",
                       "delta.normalize", "delta.weight", "delta.random_lambda")


def unused_delta_fields(cfg) -> list[str]:
    """The DELTA_METHOD_FIELDS that a train run of another method sets away from their defaults:
    they change nothing it trains (a `--config.delta.lam_max` sweep of a dapo run gives the
    same run every time; only the token view reads them then). Not an error, as rl.surrogate's
    unused fields are: `--config.method=` switches a config that sets them with one flag."""
    if cfg.method == "delta" or cfg.mode != "train":
        return []
    defaults = default_config()
    return [f"{name}={_get(cfg, name)!r}" for name in DELTA_METHOD_FIELDS
            if _get(cfg, name) != _get(defaults, name)]


def _require_defaults(c, names, why: str):
    """Each field of `names` left at its default_config() value: settings that only another
    option reads (`why`, then "leave <field> at <default>", is the message)."""
    defaults = default_config()
    for name in names:
        default = _get(defaults, name)
        _require(_get(c, name) == default, name, f"{why} leave {name} at {default}")


def _check_surrogate_fields(c):
    """rl.surrogate=sapo has no clip range: rl.eps_low / eps_high / dual_clip other than the
    method's (which it ignores) are refused; the gate's temperatures belong to sapo alone, the
    rl.fipo_* settings to rl.fipo."""
    if c.rl.surrogate == "sapo":
        for name in ("rl.eps_low", "rl.eps_high", "rl.dual_clip"):
            _require(_get(c, name) == METHOD_DEFAULTS[c.method][name], name,
                     "belongs to the clipped surrogate; rl.surrogate='sapo' has no clip (its "
                     "soft gate: rl.sapo_tau_pos / rl.sapo_tau_neg): leave it unset")
    else:
        _require_defaults(c, ("rl.sapo_tau_pos", "rl.sapo_tau_neg"),
                          f"the soft gate of rl.surrogate='sapo', not {c.rl.surrogate!r}: set "
                          "rl.surrogate=sapo or")
    for name in ("rl.sapo_tau_pos", "rl.sapo_tau_neg"):
        _require(_get(c, name) > 0, name, f"must be > 0, got {_get(c, name)}")
    if not c.rl.fipo:
        _require_defaults(c, ("rl.fipo_decay_rate", "rl.fipo_clip", "rl.fipo_clip_high_only",
                              "rl.fipo_safety_threshold"),
                          "belongs to rl.fipo=True: set it, or")
        return
    _require(c.rl.surrogate == "clip", "rl.fipo",
             f"weights the clipped surrogate, not rl.surrogate={c.rl.surrogate!r}")
    _require(c.rl.mini_batch_prompts < c.rollout.batch_prompts or c.rl.epochs > 1, "rl.fipo",
             "weights tokens by how the policy moved since the rollout, which needs more than "
             "one update a step (pi = pi_old at the first): set rl.mini_batch_prompts below "
             f"rollout.batch_prompts={c.rollout.batch_prompts} or rl.epochs > 1")
    for name in ("rl.fipo_decay_rate", "rl.fipo_clip"):
        _require(_get(c, name) > 0, name, f"must be > 0, got {_get(c, name)}")
    _require(c.rl.fipo_safety_threshold >= 0, "rl.fipo_safety_threshold",
             f"must be >= 0 (0 = off), got {c.rl.fipo_safety_threshold}")


def _check_combinations(c):
    if c.mode == "plan":  # shapes only: config.json, or a preset's; no weights, no tokenizer
        _require(c.model.path or c.model.preset, "model.path",
                 "plan mode needs the model's shapes: a Hugging Face model directory (its "
                 "config.json) or model.preset (e.g. 'qwen3-8b')")
    else:
        _require(c.model.random_init or c.model.path, "model.path",
                 "a Hugging Face model directory is required (or set model.random_init=True "
                 "with model.preset)")
        # A random-init model's vocabulary comes from its tokenizer too: it needs one as well.
        _require(c.tokenizer.path or c.model.path, "tokenizer.path",
                 "no tokenizer: set tokenizer.path (a Hugging Face tokenizer directory, or "
                 "'synthetic') or model.path")
    _require(not c.model.random_init or c.model.preset, "model.preset",
             "random init needs a preset name (e.g. 'tiny')")
    # Random init builds model.preset and never reads model.path's weights: a path given with it
    # would be silently dropped (a run, or an eval that says "eval of <path>", of random weights).
    _require(not (c.model.random_init and c.model.path), "model.random_init",
             f"True builds model.preset={c.model.preset!r} with random weights and ignores "
             f"model.path={c.model.path!r}: pass --config.model.random_init=False to load that "
             f"checkpoint, or leave model.path empty (tokenizer.path names a tokenizer alone)")
    if c.mode in ("train", "sft"):
        _require(c.data.train, "data.train", "training data is required (file path(s) or "
                 "'synthetic')")
    if c.mode == "eval":
        _require(c.data.eval, "data.eval", "eval mode needs benchmark files")
    for name in ("train.log_every", "rollout.batch_prompts", "rollout.group_size",
                 "rollout.max_new_tokens",
                 "rollout.max_batch_size", "rl.mini_batch_prompts", "rl.epochs",
                 "data.max_prompt_len", "train.keep", "eval.k", "eval.max_new_tokens",
                 "sft.batch_size", "sft.max_len", "model.logprob_chunk_tokens", "delta.recompute_chunk"):
        _require(_get(c, name) >= 1, name, f"must be >= 1, got {_get(c, name)}")
    for name in ("train.steps", "sft.steps", "train.save_every", "sft.save_every",
                 "train.eval_every", "train.progress_every_s", "train.rollouts_every",
                 "rl.micro_batch_size", "sft.micro_batch_size", "optim.warmup_steps",
                 "rl.max_nonfinite",
                 "delta.num_refine", "eval.limit", "sft.warmup_steps",
                 "rl.dynamic_sampling_prompts_per_round"):
        _require(_get(c, name) >= 0, name, f"must be >= 0, got {_get(c, name)}")
    _require(c.rl.dynamic_sampling_prompts_per_round % c.rollout.batch_prompts == 0,
             "rl.dynamic_sampling_prompts_per_round",
             f"{c.rl.dynamic_sampling_prompts_per_round} is not a multiple of "
             f"rollout.batch_prompts={c.rollout.batch_prompts} (each round draws whole data "
             f"batches; 0 = one batch a round)")
    _require(c.rollout.batch_prompts % c.rl.mini_batch_prompts == 0, "rl.mini_batch_prompts",
             f"{c.rl.mini_batch_prompts} does not divide rollout.batch_prompts="
             f"{c.rollout.batch_prompts}")
    mini_seqs = c.rl.mini_batch_prompts * c.rollout.group_size
    _require(c.rl.micro_batch_size == 0 or mini_seqs % c.rl.micro_batch_size == 0,
             "rl.micro_batch_size", f"{c.rl.micro_batch_size} does not divide the mini-batch of "
             f"{mini_seqs} sequences (rl.mini_batch_prompts x rollout.group_size)")
    _require(c.sft.micro_batch_size == 0 or c.sft.batch_size % c.sft.micro_batch_size == 0,
             "sft.micro_batch_size", f"{c.sft.micro_batch_size} does not divide sft.batch_size="
             f"{c.sft.batch_size}")
    _require(c.rollout.group_size >= 2, "rollout.group_size",
             f"rl.advantage={c.rl.advantage} compares the responses of a prompt with each other: "
             "with 1 response per prompt every advantage is 0 and nothing is trained; use >= 2")
    _check_surrogate_fields(c)
    _require(c.rl.eps_low >= 0 and c.rl.eps_high >= 0, "rl.eps_low", "clip ranges must be >= 0")
    _require(c.rl.dual_clip == 0 or c.rl.dual_clip > 1 + c.rl.eps_high, "rl.dual_clip",
             f"must be 0 (off) or > 1 + rl.eps_high, got {c.rl.dual_clip}")
    _require(c.rollout.temperature > 0, "rollout.temperature",
             "RL needs sampling (temperature > 0)")
    _require(0 < c.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _require(c.rollout.top_k == -1 or c.rollout.top_k >= 1, "rollout.top_k", "-1 or >= 1")
    for name in ("rollout.page_size", "rollout.decode_steps_per_call"):
        _require(_get(c, name) >= 1, name, f"must be >= 1, got {_get(c, name)}")
    _require(c.rollout.decode_splits >= 0, "rollout.decode_splits",
             f"must be >= 0 (0 = auto), got {c.rollout.decode_splits}")
    _require(not (c.rollout.decode_splits == 0 and c.rollout.batch_invariant),
             "rollout.decode_splits", "0 (auto) splits a row's attention by the rows of its "
             "call, which rollout.batch_invariant holds fixed: set a fixed count (1) or turn "
             "rollout.batch_invariant off")
    _require(c.rl.old_pass_rows >= 0, "rl.old_pass_rows",
             f"must be >= 0 (0 = rollout.max_batch_size), got {c.rl.old_pass_rows}")
    _require(c.rollout.kv_budget_gb >= 0, "rollout.kv_budget_gb",
             f"must be >= 0 (0 = the worst case), got {c.rollout.kv_budget_gb}")
    _require(c.eval.temperature >= 0, "eval.temperature",
             f"must be >= 0 (0 = greedy), got {c.eval.temperature}")
    _require(0 < c.eval.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {c.eval.top_p}")
    from delta_jax.rl import rewards as rewards_lib
    names = sorted([*rewards_lib.REWARD_FNS, rewards_lib.USER_REWARD])
    _require(c.rewards.name in names, "rewards.name",
             f"{c.rewards.name!r} is not one of {names}")
    user = c.rewards.name == rewards_lib.USER_REWARD
    _require(not user or c.rewards.python_fn, "rewards.python_fn",
             "rewards.name=python grades with a function of yours: name it as "
             "'<file.py>:<function>' or '<module>:<function>'")
    _require(user or not c.rewards.python_fn, "rewards.python_fn",
             f"is used by rewards.name=python only, not {c.rewards.name!r}")
    if user:
        try:
            specs = rewards_lib.user_reward_specs(c.rewards.python_fn)
        except ValueError as e:
            raise ConfigError(f"rewards.python_fn: {e}") from None
        weights = str(c.rewards.python_weights).strip()
        try:
            values = rewards_lib.user_reward_weights(weights)
        except ValueError:
            values = ()
        _require(values is None or (len(values) == len(specs)
                                    and all(math.isfinite(v) for v in values)),
                 "rewards.python_weights", f"{weights!r} is not {len(specs)} comma-separated "
                 f"number(s), one for each rewards.python_fn function")
    _require(user or not str(c.rewards.python_weights).strip(), "rewards.python_weights",
             f"is used by rewards.name=python only, not {c.rewards.name!r}")
    _require(user or not str(c.rewards.python_columns).strip(), "rewards.python_columns",
             f"is used by rewards.name=python only, not {c.rewards.name!r}")
    try:
        rewards_lib.user_reward_columns(c.rewards.python_columns)
    except ValueError as e:
        raise ConfigError(f"rewards.python_columns: {e}") from None
    # qwen_math and code are task-specific prompts; base / chat / plain get the reward's task's
    # instruction (templates.for_task). A reward of the user's own reads what its template asks.
    _require(c.data.template != "code" or c.rewards.name in ("code", rewards_lib.USER_REWARD),
             "data.template",
             f"'code' asks for a ```python program, which rewards.name={c.rewards.name!r} does "
             "not run: set rewards.name=code, or a math template (qwen_math, base, chat, plain)")
    _require(c.data.template != "qwen_math" or c.rewards.name != "code", "data.template",
             "'qwen_math' asks for a \\boxed{} answer, which rewards.name='code' does not read: "
             "set data.template=code (or base, chat, plain: they ask for a program then)")
    for name, value in (("data.system_prompt", c.data.system_prompt != ""),
                        ("data.enable_thinking", not c.data.enable_thinking)):
        _require(not value or c.data.template == "chat", name,
                 f"applies to data.template='chat' (the tokenizer's chat template), not "
                 f"{c.data.template!r}: set data.template=chat or leave {name} at its default")
    if c.rewards.name != "math_format":
        _require_defaults(c, ("rewards.one_box_bonus", "rewards.no_box_penalty"),
                          f"shapes rewards.name='math_format' only, not {c.rewards.name!r}: set "
                          "rewards.name=math_format or")
    _require(c.rewards.num_workers >= 1, "rewards.num_workers",
             f"must be >= 1, got {c.rewards.num_workers}")
    _require(c.rewards.timeout_s > 0, "rewards.timeout_s",
             f"must be > 0, got {c.rewards.timeout_s}")
    _require(c.rewards.python_batch_size >= 1, "rewards.python_batch_size",
             f"must be >= 1, got {c.rewards.python_batch_size}")
    for name in ("rewards.code_memory_mb", "rewards.code_max_processes"):
        _require(_get(c, name) >= 1, name, f"must be >= 1, got {_get(c, name)}")
    _require(c.rewards.code_sandbox != "sandbox_fusion" or c.rewards.code_sandbox_url,
             "rewards.code_sandbox_url", "code_sandbox='sandbox_fusion' needs the service's "
             "URL (http(s)://host:port)")
    _require(0 < c.delta.lam_min <= c.delta.lam_max, "delta.lam_min",
             "need 0 < lam_min <= lam_max")
    _require(c.delta.topk >= 1, "delta.topk", f"must be >= 1, got {c.delta.topk}")
    _require(c.delta.fixed_gamma >= 0, "delta.fixed_gamma",
             f"must be >= 0 (0 = the adaptive temperatures of spec 2.4), got {c.delta.fixed_gamma}")
    _require(c.delta.assignment == "soft" or c.delta.pass_impl == "jnp", "delta.assignment",
             "'hard' has no fused-pass form: use delta.pass_impl='jnp'")
    _require(not (c.delta.random_lambda and c.delta.weight == "alpha"), "delta.random_lambda",
             "draws lambda in [lam_min, lam_max]; it cannot be combined with delta.weight='alpha'")
    _require(c.data.synthetic_steps >= 0, "data.synthetic_steps",
             f"must be >= 0 (0 = each level's own), got {c.data.synthetic_steps}")
    _require(1 <= c.data.synthetic_digits <= 6, "data.synthetic_digits",
             f"must be in 1..6, got {c.data.synthetic_digits}")
    _require(c.data.synthetic_distractors >= 0, "data.synthetic_distractors",
             f"must be >= 0, got {c.data.synthetic_distractors}")
    _require(c.delta.stats_mode == "global" or c.delta.feature_cache == "device",
             "delta.stats_mode", "per_shard statistics need delta.feature_cache='device' (the "
             "streaming host/recompute modes compute global statistics only)")
    _require(c.model.lora_rank >= 0, "model.lora_rank",
             f"must be >= 0 (0 = full fine-tuning), got {c.model.lora_rank}")
    _require(c.model.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {c.model.lora_alpha}")
    _require(c.model.lora_targets == "all" or (
        set(lora_targets(c)) <= set(LORA_TARGETS) and len(set(lora_targets(c))) ==
        len(lora_targets(c)) > 0), "model.lora_targets",
        f"'all' or distinct names from {', '.join(LORA_TARGETS)}, comma separated; got "
        f"{c.model.lora_targets!r}")
    _require(c.rl.kl_coef >= 0, "rl.kl_coef", f"must be >= 0 (0 = off), got {c.rl.kl_coef}")
    _require(c.rl.rollout_is_cap >= 1, "rl.rollout_is_cap",
             f"must be >= 1 (a ratio of 1 is on-policy), got {c.rl.rollout_is_cap}")
    _require(c.optim.lr > 0, "optim.lr", "must be > 0")
    _require(c.optim.max_grad_norm >= 0, "optim.max_grad_norm", "must be >= 0 (0 = off)")
    _require(c.rewards.overlong_buffer < c.rollout.max_new_tokens or not c.rewards.overlong,
             "rewards.overlong_buffer", f"must be < rollout.max_new_tokens="
             f"{c.rollout.max_new_tokens}")
    for axis in ("data", "fsdp", "tensor"):
        _require(c.mesh[axis] == -1 or c.mesh[axis] >= 1, f"mesh.{axis}",
                 f"must be -1 (the remaining devices) or >= 1, got {c.mesh[axis]}")
    _require([c.mesh.data, c.mesh.fsdp, c.mesh.tensor].count(-1) <= 1, "mesh.data",
             "at most one mesh axis may be -1")
    _require(c.distributed.num_processes >= 0, "distributed.num_processes", "must be >= 0")
    _require(c.distributed.heartbeat_timeout_s >= 1, "distributed.heartbeat_timeout_s",
             "must be >= 1")
    _require(c.plan.device_memory_gb > 0, "plan.device_memory_gb", "must be > 0")
    _require(0 <= c.plan.memory_fraction <= 1, "plan.memory_fraction",
             f"must be in [0, 1] (0 = the target's allocator default), got "
             f"{c.plan.memory_fraction}")
    _require(c.plan.num_devices >= 0, "plan.num_devices", "must be >= 0 (0 = present devices)")
    for p in str(c.eval.pass_k).split(","):
        _require(p.strip().isdigit() and 1 <= int(p) <= c.eval.k, "eval.pass_k",
                 f"comma separated ints in [1, eval.k]; got {c.eval.pass_k!r}")
    for p in str(c.eval.maj_k).split(",") if str(c.eval.maj_k).strip() else ():
        _require(p.strip().isdigit() and 1 <= int(p) <= c.eval.k, "eval.maj_k",
                 f"comma separated ints in [1, eval.k] or \"\" (none); got {c.eval.maj_k!r}")
    _require(not str(c.eval.maj_k).strip() or c.rewards.name != rewards_lib.USER_REWARD,
             "eval.maj_k", "votes on each response's last \\boxed{} answer, as the built-in math "
             "rewards read it; a rewards.name=python function reads its own answers (--config."
             "eval.maj_k= turns it off)")
    _require(0 <= c.rl.entropy_top_frac <= 1, "rl.entropy_top_frac",
             f"must be in [0, 1] (0 = off; the paper's 0.2), got {c.rl.entropy_top_frac}")
    _require(c.eval.val_k >= 0, "eval.val_k", f"must be >= 0 (0 = eval.k), got {c.eval.val_k}")
    _require(c.eval.checkpoint in ("latest", "none") or str(c.eval.checkpoint).isdigit(),
             "eval.checkpoint", f"'latest', 'none' or a step number, got {c.eval.checkpoint!r}")
    # (eval.val_k alone may stay set with train.eval_every = 0, as the recipes set it: there are
    # no validations then, as there are none without benchmarks)
    _require(not c.data.val or c.train.eval_every > 0 or c.mode != "train", "data.val",
             "validations run every train.eval_every steps, which is 0: set train.eval_every")
    _require(not c.train.eval_best or c.train.best_metric or c.mode != "train",
             "train.eval_best", "evaluates the policy train.best_metric picks: set "
             "train.best_metric (e.g. val/benchmarks/aime25/avg@8)")
    if c.train.best_metric and c.mode == "train":
        known = eval_metric_names(c)
        _require(known, "train.best_metric", "needs evaluations: set data.eval")
        _require(c.train.eval_every or c.train.eval_after or c.train.eval_before,
                 "train.best_metric", "needs evaluations during training: train.eval_every > 0 "
                 "(or train.eval_before / eval_after)")
        _require(c.train.best_metric in known, "train.best_metric",
                 f"{c.train.best_metric!r} is not a metric the evaluations log; they log "
                 f"{', '.join(known)}")


# The name data.eval="synthetic"'s held-out split is evaluated under (train/run.py).
SYNTHETIC_BENCHMARK = "synthetic_test"


def benchmark_name(path: str) -> str:
    """A data.eval benchmark's name (its metrics' "eval/benchmarks/<name>/"): the file's stem."""
    return os.path.splitext(os.path.basename(path.strip()))[0]


def benchmark_paths(files: str) -> dict[str, str]:
    """{name: path} of a data.eval / data.val value of benchmark files (comma separated; the
    name is the file's stem); {} for "" and for "synthetic" (generated in the workdir)."""
    if files == "synthetic":
        return {}
    return {benchmark_name(p): p.strip() for p in str(files).split(",") if p.strip()}


def benchmark_names(files: str) -> list[str]:
    """The benchmark names of a data.eval / data.val value (comma separated files, or
    "synthetic")."""
    return [SYNTHETIC_BENCHMARK] if files == "synthetic" else list(benchmark_paths(files))


EVAL, VAL = "eval", "val"  # the two kinds of evaluation: data.eval's, and data.val's validations


def validation_on(cfg) -> bool:
    """Whether the periodic evaluations during training are validations of their own (data.val
    or eval.val_k set: logged as val/...); else they evaluate data.eval as the others do."""
    return bool(cfg.data.val) or cfg.eval.val_k > 0


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What an evaluation of `kind` (EVAL or VAL) evaluates: the benchmark files (a data.eval
    value), samples a question and the pass@k values; its metrics are "<kind>/..."."""
    kind: str
    files: str
    k: int
    pass_ks: tuple
    maj_ks: tuple = ()


def eval_settings(cfg, kind: str = EVAL) -> EvalSettings:
    pass_ks = tuple(int(p) for p in str(cfg.eval.pass_k).split(","))
    maj_ks = tuple(int(p) for p in str(cfg.eval.maj_k).split(",") if p.strip())
    if kind == EVAL:
        return EvalSettings(EVAL, cfg.data.eval, cfg.eval.k, pass_ks, maj_ks)
    if kind != VAL:
        raise ValueError(f"kind must be {EVAL!r} or {VAL!r}, got {kind!r}")
    k = cfg.eval.val_k or cfg.eval.k
    return EvalSettings(VAL, cfg.data.val or cfg.data.eval, k,
                        tuple(p for p in pass_ks if p <= k) or (1,),
                        tuple(p for p in maj_ks if p <= k))


def eval_metric_names(cfg) -> list[str]:
    """The accuracy metrics the evaluations of `cfg` log: avg@k, pass@p and maj@p of each
    benchmark and of their question-weighted average, for data.eval (eval/..., eval.k,
    eval.pass_k and eval.maj_k) and,
    with validations (and train.eval_every > 0), for data.val (val/..., eval.val_k); [] without
    benchmarks."""
    out = []
    for kind in (EVAL, VAL) if validation_on(cfg) and cfg.train.eval_every else (EVAL,):
        e = eval_settings(cfg, kind)
        values = ([f"avg@{e.k}"] + [f"pass@{p}" for p in e.pass_ks]
                  + [f"maj@{p}" for p in e.maj_ks])
        names = benchmark_names(e.files)
        out += [f"{kind}/{where}/{value}" for where in
                [f"benchmarks/{n}" for n in names] + (["average"] if names else [])
                for value in values]
    return out


# Fields that may change when a run resumes: how long it runs, how it logs, saves, evaluates and
# where it runs; none of them changes what a step computes.
RESUMABLE_FIELDS = ("mode", "train.steps", "train.log_every", "train.save_every", "train.keep",
                    "sft.save_every",
                    "train.eval_every", "train.eval_before", "train.eval_after",
                    "train.export_final", "train.progress_bar", "train.progress_every_s",
                    "train.rollouts_every", "train.rollouts_token_weights", "data.val",
                    "train.allow_config_change", "train.best_metric", "train.best_mode",
                    "train.eval_best",
                    "train.compilation_cache_dir",
                    "rewards.num_workers", "rewards.timeout_s", "rollout.max_batch_size",
                    "rl.old_pass_rows",
                    "rollout.page_size", "rollout.kv_budget_gb", "rollout.decode_steps_per_call",
                    "rollout.decode_attention", "rollout.shrink_batch",
                    "rollout.batch_invariant", "rollout.decode_splits",
                    "rollout.resume_preempted")
RESUMABLE_SECTIONS = ("eval.", "plan.", "distributed.", "mesh.")


def field_names() -> set[str]:
    """Every dotted field name of the schema, and every section name ("rl", "rl.epochs", ...)."""
    fields = set(_flatten(default_config()))
    return fields | {name.rsplit(".", 1)[0] for name in fields if "." in name}


def resume_changes(saved: dict, new: dict) -> list[str]:
    """The fields that differ between a run's saved config (config.json, nested dicts) and the
    config it is resumed with, as "field: old -> new" lines, leaving out RESUMABLE_FIELDS and
    RESUMABLE_SECTIONS. A field one of them lacks shows as <absent>, except a field added to the
    schema after the run started that the new config leaves at its default."""
    old, cur = _flatten(saved), _flatten(new)
    defaults = _flatten(default_config())
    lines = []
    for name in sorted(set(old) | set(cur)):
        if name in RESUMABLE_FIELDS or name.startswith(RESUMABLE_SECTIONS):
            continue
        a, b = old.get(name, "<absent>"), cur.get(name, "<absent>")
        if name not in old and name in defaults and b == defaults[name]:
            continue
        if name not in cur and name not in defaults:  # retired from the schema since
            continue
        if a != b and not (isinstance(a, (int, float)) and isinstance(b, (int, float))
                           and not isinstance(a, bool) and float(a) == float(b)):
            lines.append(f"{name}: {a!r} -> {b!r}")
    return lines


@dataclasses.dataclass(frozen=True)
class MethodSettings:
    """What the chosen method means for the step (derived from the resolved config)."""
    use_delta: bool
    advantage: str
    dynamic_sampling: bool
    overlong: bool


def old_pass_rows(cfg) -> int:
    """Sequences per chunk of the old-policy pass (rl.old_pass_rows; 0: rollout.max_batch_size)."""
    return cfg.rl.old_pass_rows or cfg.rollout.max_batch_size


def method_settings(cfg) -> MethodSettings:
    return MethodSettings(use_delta=cfg.method == "delta", advantage=cfg.rl.advantage,
                          dynamic_sampling=cfg.rl.dynamic_sampling, overlong=cfg.rewards.overlong)
