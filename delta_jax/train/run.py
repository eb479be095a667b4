"""Building a run from a validated config: assets (data, tokenizer), the model, the loss, the
jitted programs, the checkpointer and metrics writer, all held in one `Run`; plus the train state's
placement on the mesh and the KL reference policy's save/restore for resumes.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.errors import InputError, naming
from delta_jax.sampling import Sampler
from delta_jax.train import CHECKPOINTS
from delta_jax.train import config as config_lib
from delta_jax.train import features as features_lib
from delta_jax.train.checkpoint import Checkpointer
from delta_jax.train.metrics import MetricsWriter, to_scalars
from delta_jax.train.state import (TrainState, abstract_train_state, init_train_state,
                                   merge_trainable, optimizer_from_config, split_model,
                                   split_trainable)
from delta_jax.train.step import make_train_step

_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim")
log = logging.getLogger("delta_jax.train")


# ----------------------------------------------------------------------------- assets


def prepare_assets(cfg, workdir: str) -> dict:
    """Resolves data/tokenizer paths; generates the synthetic task and tiny tokenizer on demand.

    Returns {"train": path(s) or "", "eval": {name: path}, "val": {name: path} (data.val's;
    {} when it is unset), "tokenizer": dir}.
    """
    out = {"train": cfg.data.train, "eval": {}, "val": {},
           "tokenizer": cfg.tokenizer.path or cfg.model.path}
    if "synthetic" in (cfg.data.train, cfg.data.eval, cfg.data.val):
        from delta_jax.data import tiny_task
        levels = [int(x) for x in str(cfg.data.synthetic_levels).split(",") if x.strip()]
        splits = tiny_task.prepare_synthetic_splits(
            os.path.join(workdir, "synthetic"), num_train=cfg.data.synthetic_train,
            num_test=cfg.data.synthetic_test, seed=cfg.seed, levels=levels,
            steps=cfg.data.synthetic_steps, digits=cfg.data.synthetic_digits,
            distractors=cfg.data.synthetic_distractors)
        if cfg.data.train == "synthetic":
            out["train"] = splits["train"]
        for kind in ("eval", "val"):
            if cfg.data[kind] == "synthetic":
                out[kind][config_lib.SYNTHETIC_BENCHMARK] = splits["test"]
    for kind in ("eval", "val"):
        out[kind].update(config_lib.benchmark_paths(cfg.data[kind]))
    if cfg.tokenizer.path == "synthetic":
        from delta_jax.data import tiny_task
        out["tokenizer"] = tiny_task.prepare_tiny_tokenizer(os.path.join(workdir, "tokenizer"))
    return out


def load_benchmarks(paths: dict, field: str = "data.eval", columns=None,
                    majority: bool = False) -> dict:
    """{name: rows} of the benchmark files {name: path} of `field` (data.eval, data.val), read at
    start-up, so a missing or malformed one stops the run before it trains. columns: {kind:
    {column: required}} (evaluation.load_benchmark's; build_run gives the run's own task
    data_columns(cfg)). majority: the evaluations vote (eval.maj_k), which a code benchmark
    cannot: an InputError naming it."""
    from delta_jax import evaluation
    benchmarks = {}
    for name, path in paths.items():
        with naming(field):
            benchmarks[name] = evaluation.load_benchmark(path, columns=columns)
        if majority and evaluation.benchmark_kind(name, benchmarks[name]) == "code":
            raise InputError(f"eval.maj_k: {field} benchmark {name!r} ({path}) is a code "
                             "benchmark, whose responses are programs, not answers to vote on: "
                             f"evaluate it in a run without eval.maj_k")
    return benchmarks


def data_columns(cfg) -> dict:
    """{column: required}: the data set columns the run's records keep for its reward, the
    names rewards.python_fn's functions take beside their call's own keywords and
    rewards.python_columns (rewards.reward_columns); {} for a built-in reward."""
    from delta_jax.rl import rewards as rewards_lib
    if cfg.rewards.name != rewards_lib.USER_REWARD:
        return {}
    _, calls = rewards_lib.load_python_fns(cfg.rewards.python_fn)
    return rewards_lib.python_fn_columns(calls, cfg.rewards.python_columns)


def build_model(cfg, vocab_size: int, mesh=None):
    """Random init from a preset (+ shape overrides) or a Hugging Face directory; with a mesh,
    the parameters are placed by the sharding rules (checkpoint tensors go straight to their
    shards). model.remat="auto" is resolved first (resolve_remat)."""
    cfg = resolve_remat(cfg, mesh, vocab_size)
    dtype = jnp.dtype(cfg.model.dtype)
    param_dtype = jnp.dtype(cfg.model.param_dtype)
    remat = cfg.model.remat
    if cfg.model.random_init:
        overrides = {f: cfg.model[f] for f in _SHAPE_FIELDS if cfg.model[f]}
        overrides["attention"] = cfg.model.attention  # models.attention implementation
        vocab = _random_init_vocab(cfg, vocab_size)
        mcfg = models.get_preset(cfg.model.preset, vocab_size=vocab, dtype=dtype,
                                 param_dtype=param_dtype, remat=remat, **overrides)
        model = add_lora(cfg, models.Transformer(mcfg, rngs=nnx.Rngs(cfg.seed)))
        return model if mesh is None else sharding_lib.shard_model(model, mesh)
    shardings = None if mesh is None else sharding_lib.param_sharding_fn(mesh)
    with naming("model.path"):
        model = add_lora(cfg, models.from_pretrained(
            cfg.model.path, dtype=dtype, param_dtype=param_dtype, remat=remat,
            attention=cfg.model.attention, shardings=shardings))
    # The base weights are on their shards already; the adapters go to theirs.
    return model if mesh is None or not cfg.model.lora_rank else sharding_lib.shard_model(
        model, mesh)


def abstract_model(cfg, vocab_size: int):
    """What build_model(cfg, vocab_size) returns, with jax.ShapeDtypeStructs for parameters:
    nothing is allocated and no weight is read (model.path's config.json is, and its
    safetensors headers are checked for every tensor the model needs, so a checkpoint that
    would not load stops the run now)."""
    cfg = resolve_remat(cfg, None, vocab_size)
    if cfg.model.random_init:
        return nnx.eval_shape(lambda: build_model(cfg, vocab_size))
    with naming("model.path"):
        mcfg = models.pretrained_config(cfg.model.path, jnp.dtype(cfg.model.dtype),
                                        param_dtype=jnp.dtype(cfg.model.param_dtype),
                                        remat=cfg.model.remat, attention=cfg.model.attention)
    return nnx.eval_shape(lambda: add_lora(cfg, models.Transformer(mcfg, rngs=nnx.Rngs(0))))


def add_lora(cfg, model):
    """The model with fresh LoRA adapters when model.lora_rank > 0 (from the run's seed)."""
    if cfg.model.lora_rank:
        model.add_lora(cfg.model.lora_rank, cfg.model.lora_alpha, config_lib.lora_targets(cfg),
                       seed=cfg.seed)
    return model


def _random_init_vocab(cfg, tokenizer_vocab: int) -> int:
    """A random-init model's vocabulary: model.vocab_size, else the tokenizer's rounded up to 64."""
    return cfg.model.vocab_size or -(-tokenizer_vocab // 64) * 64


def resolve_remat(cfg, mesh, tokenizer_vocab: int):
    """`cfg`, or for model.remat="auto" a copy with a policy in its place: in train mode the one
    plan.choose_remat picks for this mesh (None: config.mesh over the devices present) against
    the device's allocator limit (plan.device_memory_gb where the backend reports none, as the
    CPU), logged with the planned update (or warm-start step, where larger) of each policy
    tried; in the other modes "full" (eval takes no gradients; mode=sft keeps the default that
    recomputes most)."""
    if cfg.model.remat != "auto":
        return cfg
    from delta_jax import plan
    policy = "full"
    if cfg.mode == "train":
        capacity = plan.capacity_bytes(cfg.plan.device_memory_gb)
        model_cfg = plan.model_config_from_run_config(cfg, remat="full")
        if cfg.model.random_init or not cfg.model.path:
            model_cfg = model_cfg.replace(vocab_size=_random_init_vocab(cfg, tokenizer_vocab))
        policy, tried = plan.choose_remat(cfg, capacity, mesh_shape=_mesh_shape(mesh),
                                          model_cfg=model_cfg)
        log.info("model.remat=auto -> %s (planned update or warm-start step per device: %s; "
                 "capacity %.2f GB)", policy,
                 ", ".join(f"{k} {v / plan.GB:.2f} GB" for k, v in tried.items()),
                 capacity / plan.GB)
    out = cfg.copy_and_resolve_references()
    out.model.remat = policy
    return out


def _mesh_shape(mesh):
    """(data, fsdp, tensor) sizes of a mesh, as plan.plan_from_config takes them; None for None."""
    return None if mesh is None else tuple(int(mesh.shape[a]) for a in sharding_lib.MESH_AXES)


def make_loss_fn(cfg) -> Callable:
    """loss_fn(logp, old_logp, adv, mask, weights, entropy) -> (sum, denom, metric sums)."""
    from delta_jax.rl import losses

    loss_cfg = losses.PolicyLossConfig(
        eps_low=cfg.rl.eps_low, eps_high=cfg.rl.eps_high,
        dual_clip=cfg.rl.dual_clip if cfg.rl.dual_clip > 0 else None,
        log_ratio_clamp=cfg.rl.log_ratio_clamp, agg=cfg.rl.agg,
        # Dr.GRPO's constant normaliser: the maximum response length.
        drgrpo_norm=(float(cfg.rollout.max_new_tokens)
                     if cfg.rl.agg == "seq-mean-token-sum-norm" else None),
        entropy_coef=cfg.rl.entropy_coef, ratio_level=cfg.rl.ratio_level,
        surrogate=cfg.rl.surrogate, sapo_tau_pos=cfg.rl.sapo_tau_pos,
        sapo_tau_neg=cfg.rl.sapo_tau_neg,
        fipo=cfg.rl.fipo, fipo_decay_rate=cfg.rl.fipo_decay_rate, fipo_clip=cfg.rl.fipo_clip,
        fipo_clip_high_only=cfg.rl.fipo_clip_high_only,
        fipo_safety_threshold=cfg.rl.fipo_safety_threshold,
        kl_type=cfg.rl.kl_type if cfg.rl.kl_coef > 0 else None, kl_coef=cfg.rl.kl_coef)

    def loss_fn(logp, old_logp, advantages, mask, token_weights, entropy, ref_logp=None):
        return losses.policy_loss(logp, old_logp, advantages, mask, token_weights=token_weights,
                                  cfg=loss_cfg, entropy=entropy, ref_logp=ref_logp)

    return loss_fn



# ----------------------------------------------------------------------------- run


@dataclasses.dataclass
class Run:
    """Everything a step needs; built once by build_run."""
    cfg: Any
    workdir: str
    assets: dict
    tokenizer: Any
    graphdef: Any
    rest: Any
    template: Callable[[str], str]
    sampler: Sampler
    optimizer: Any
    schedule: Any
    train_step: Callable
    old_pass: Callable
    hidden_pass: Callable
    ckpt: Checkpointer
    writer: MetricsWriter
    data_iter: Any = None
    scorer: Any = None
    benchmarks: dict = dataclasses.field(default_factory=dict)  # data.eval: name -> rows
    val_benchmarks: dict = dataclasses.field(default_factory=dict)  # data.val's (or data.eval's)
    eval_prompts: dict = dataclasses.field(default_factory=dict)  # kind -> prompt format
    eval_scorers: dict = dataclasses.field(default_factory=dict)  # kind -> scorer (accuracy)
    with_delta: bool = False     # the old-policy pass feeds DelTA (method delta, token view)
    # The policy's parameters at the start of the run (model.path's weights, or the random init
    # from the seed) as ShapeDtypeStructs; take_initial_params reads them (read_initial_params),
    # so a run that restores a checkpoint never reads them.
    initial_params: Any = None
    read_initial_params: Callable[[], Any] | None = None
    initial_params_taken: bool = False
    mesh: Any = None             # the (data, fsdp, tensor) mesh shared by sampler and trainer
    state_shardings: Any = None  # TrainState-shaped NamedShardings (delta_jax.sharding)
    # optim.offload: the same with the optimizer state in pinned host memory (where it rests
    # between a step's updates); None keeps it on the device throughout.
    resting_shardings: Any = None
    topk_proxy_pass: Any = None  # delta.proxy = "hidden_topk": (params, labels, ids, probs) -> v
    ref_pass: Any = None         # rl.kl_coef > 0: log-probs of the reference policy
    # rl.kl_coef > 0: the reference policy's own part (reference_part; reference_params
    # rebuilds the whole policy from it and the live frozen weights)
    ref_params: Any = None
    # data.train == "synthetic": (prompt records, response ids [N, R], response mask [N, R]) ->
    # ground-truth credit classes int8 [N, R] (rl.credit codes; make_credit_labeller)
    credit_labeller: Any = None

    def model(self, params):
        return nnx.merge(self.graphdef, params, self.rest)

    def take_initial_params(self, read: bool = True):
        """The initial parameters, read now (model.path's weights or the seeded random init)
        and handed over: the Run keeps their ShapeDtypeStructs (initial_params, what
        abstract_state needs) and never holds the arrays, so they are freed once the taker is
        done with them (a train step donates them). read=False: a restored checkpoint stands in
        for them, and nothing is read (returns None). None when they were taken before."""
        if self.initial_params_taken:
            return None
        self.initial_params_taken = True
        return self.read_initial_params() if read else None

    def close(self):
        for scorer in (self.scorer, *self.eval_scorers.values()):
            if scorer is not None:
                scorer.close()
        self.ckpt.close()
        self.writer.close()


def check_memory_plan(cfg, model_cfg, mesh) -> None:
    """Start-up memory checks of a train / eval / sft run, before anything compiles: a KV budget
    that cannot hold one sample, and (plan.check_memory, where the device reports its memory) a
    phase whose planned per-device peak exceeds it; both are ConfigErrors naming the fields to
    turn."""
    from delta_jax import plan
    plan.kv_plan_from_config(cfg, model_cfg)
    capacity = plan.device_memory_bytes() if cfg.plan.check_memory else None
    if capacity is None:
        return
    memory_plan = plan.plan_from_config(cfg, mesh_shape=_mesh_shape(mesh), model_cfg=model_cfg,
                                        capacity_bytes=capacity)
    device = jax.local_devices()[0]
    phases = plan.PHASES_BY_MODE[cfg.mode]
    plan.check_fits(memory_plan, capacity, phases=phases,
                    source=f"the allocator limit of {device.platform}:{device.id}; on GPUs "
                           f"{plan.MEM_FRACTION_ENV[0]} sets it, default "
                           f"{plan.DEFAULT_MEM_FRACTION_CUDA:g} of the memory")
    for name in plan.tight_phases(memory_plan, capacity, phases):
        log.warning("plan.check_memory: phase '%s' plans %.2f GB of the %.2f GB the allocator may "
                    "use (over %.0f%%): it should fit, but XLA may recompute values to stay "
                    "within the limit, which is slower; turn: %s", name,
                    memory_plan.phases[name] / plan.GB, capacity / plan.GB,
                    100 * plan.TIGHT_FILL, ", ".join(plan.PHASE_KNOBS[name]))


def build_run(cfg, workdir: str, *, need_data: bool = True, need_scorer: bool = True,
              mesh=None, with_delta: bool | None = None) -> Run:
    """Everything a run needs. mesh: a delta_jax.sharding mesh (default: from config.mesh).
    with_delta: build the passes that feed DelTA (default: method delta; the token view asks for
    them on grpo / dapo runs too)."""
    os.makedirs(workdir, exist_ok=True)
    assets = prepare_assets(cfg, workdir)
    columns = data_columns(cfg)  # before the data: a python_fn that does not load stops here
    by_kind = {reward_task(cfg): columns}  # the benchmarks the run's own reward grades
    majority = bool(str(cfg.eval.maj_k).strip())
    benchmarks = load_benchmarks(assets["eval"], columns=by_kind, majority=majority)
    val_benchmarks = (load_benchmarks(assets["val"], "data.val", by_kind, majority)
                      if cfg.data.val else benchmarks)
    with naming("tokenizer.path" if cfg.tokenizer.path else "model.path"):
        tokenizer = models.load_tokenizer(assets["tokenizer"])
    template = run_template(cfg, tokenizer)
    # The data before the model: a bad data.train stops the run before weights are read.
    data_iter = (make_data_iter(cfg, assets["train"], workdir, tokenizer, template, columns)
                 if need_data and cfg.mode == "train" else None)
    prompts = eval_prompts(cfg, template, {**benchmarks, **val_benchmarks})
    warn_long_eval_prompts(cfg, benchmarks, prompts, tokenizer)
    if val_benchmarks is not benchmarks:
        warn_long_eval_prompts(cfg, val_benchmarks, prompts, tokenizer, "data.val")
    mesh = sharding_lib.mesh_from_config(cfg.mesh) if mesh is None else mesh
    cfg = resolve_remat(cfg, mesh, tokenizer.vocab_size)
    # Shapes only: the weights are read when a run starts from them (take_initial_params), not
    # when it resumes from, or evaluates, a checkpoint.
    model = abstract_model(cfg, tokenizer.vocab_size)
    if cfg.mode in ("train", "eval", "sft"):
        check_memory_plan(cfg, model.cfg, mesh)
    graphdef, params, rest = split_model(model)

    def read_initial_params():
        log.info("reading the initial parameters (%s)", cfg.model.path or
                 f"random init of {cfg.model.preset}, seed {cfg.seed}")
        loaded_graphdef, loaded, _ = split_model(build_model(cfg, tokenizer.vocab_size, mesh=mesh))
        if loaded_graphdef != graphdef:
            raise RuntimeError("the model read from model.path differs in structure from the one "
                               "its config.json describes")
        return loaded

    optimizer, schedule = optimizer_from_config(cfg.optim, cfg.train.steps * _updates_per_step(cfg))
    state_shardings = abstract_train_state(params, optimizer, mesh)[1]
    resting_shardings = None
    if cfg.optim.offload:
        if not sharding_lib.host_memory_kind_available():
            raise config_lib.ConfigError(
                f"optim.offload: the {jax.default_backend()} backend has no pinned_host memory "
                "space to keep the optimizer state in; set optim.offload=False")
        resting_shardings = state_shardings.replace(
            opt_state=sharding_lib.in_memory(state_shardings.opt_state, "pinned_host"))
    try:
        sampler = Sampler(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size,
                          max_prompt_len=cfg.data.max_prompt_len, truncate_prompts="left",
                          pad_id=tokenizer.pad_token_id, mesh=mesh,
                          batch_axes=sharding_lib.batch_axes(mesh),
                          page_size=cfg.rollout.page_size,
                          kv_budget_bytes=int(cfg.rollout.kv_budget_gb * 2**30) or None,
                          decode_steps_per_call=cfg.rollout.decode_steps_per_call,
                          decode_attention=cfg.rollout.decode_attention,
                          shrink_batch=cfg.rollout.shrink_batch,
                          batch_invariant=cfg.rollout.batch_invariant,
                          decode_splits=cfg.rollout.decode_splits,
                          resume_preempted=cfg.rollout.resume_preempted)
    except ValueError as e:  # a rollout.* setting this model or device cannot run (e names it)
        raise config_lib.ConfigError(f"rollout: {e}") from e
    run = Run(
        cfg=cfg, workdir=workdir, assets=assets, tokenizer=tokenizer, graphdef=graphdef,
        rest=rest, template=template, sampler=sampler, optimizer=optimizer, schedule=schedule,
        train_step=None, old_pass=None, hidden_pass=None,
        # mode=eval reads the run's checkpoints and writes its eval/ file only: no checkpoint
        # directory, metrics.jsonl or TensorBoard events are made, none set aside
        ckpt=Checkpointer(os.path.join(workdir, CHECKPOINTS), save_every=cfg.train.save_every,
                          keep=cfg.train.keep, read_only=cfg.mode == "eval"),
        writer=(MetricsWriter(workdir) if jax.process_index() == 0 and cfg.mode != "eval"
                else _NullWriter()),
        initial_params=params, read_initial_params=read_initial_params, mesh=mesh,
        state_shardings=state_shardings,
        resting_shardings=resting_shardings, data_iter=data_iter,
        benchmarks=benchmarks, val_benchmarks=val_benchmarks, eval_prompts=prompts,
        with_delta=cfg.method == "delta" if with_delta is None else bool(with_delta))
    if cfg.mode == "train":
        run.train_step = make_train_step(
            graphdef, rest, optimizer, make_loss_fn(cfg), temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.logprob_chunk_tokens, micro_batch_size=cfg.rl.micro_batch_size,
            schedule=schedule, mesh=mesh, state_shardings=state_shardings,
            logprob_impl=cfg.model.logprob_impl)
        topk = cfg.delta.topk if run.with_delta and cfg.delta.proxy == "hidden_topk" else 0
        # h leaves the pass only when DelTA reads it from there (not for grpo / dapo, the top-K
        # proxy or the recompute cache): an unused [rows, R, H] output is memory plan mode
        # does not count.
        run.old_pass = features_lib.make_old_policy_pass(
            graphdef, rest, temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.logprob_chunk_tokens, mesh=mesh, topk=topk,
            with_hidden=feature_cache_mode(cfg, run.with_delta) != "drop",
            logprob_impl=cfg.model.logprob_impl)
        if run.with_delta and not topk and cfg.delta.feature_cache == "recompute":
            run.hidden_pass = features_lib.make_hidden_pass(graphdef, rest, mesh=mesh)
        if topk:
            mcfg = model.cfg
            run.topk_proxy_pass = features_lib.make_topk_proxy_pass(
                graphdef, rest, mesh=mesh, chunk_size=features_lib.proxy_token_chunk(
                    cfg.model.logprob_chunk_tokens, mcfg.vocab_size, topk, mcfg.hidden_size))
        if cfg.rl.kl_coef > 0:
            run.ref_pass = features_lib.make_old_policy_pass(
                graphdef, rest, temperature=cfg.rollout.temperature,
                chunk_size=cfg.model.logprob_chunk_tokens, mesh=mesh, with_hidden=False,
                logprob_impl=cfg.model.logprob_impl)
            # run.ref_params: set by train() once the policy at the start of RL is known
    if cfg.data.train == "synthetic":
        run.credit_labeller = make_credit_labeller(tokenizer)
    if need_scorer and cfg.mode == "train":
        run.scorer = make_scorer(cfg, shaped=True)
    if need_scorer:  # made now: a scorer that cannot start (code isolation) stops the run here
        add_eval_scorers(cfg, prompts, run.eval_scorers, run.scorer)
    return run


def make_data_iter(cfg, train_files, workdir: str, tokenizer, template, columns=None):
    """The training prompts (data.train, prepared once into workdir/tfds) as a resumable
    pipeline of rollout.batch_prompts records (a new order each epoch; the file's order with
    data.shuffle=False); prompts over data.max_prompt_len are handled as data.overlong_prompts
    says (a warning counts those left out). columns: the data set columns each record keeps
    (data_columns)."""
    from delta_jax.data import builders, pipeline
    with naming("data.train"):
        source = builders.build_tfds_source(train_files, data_dir=os.path.join(workdir, "tfds"),
                                            fields=cfg.data.fields, on_error=cfg.data.on_error,
                                            columns=columns)
    check_reward_fits_data(source, cfg.rewards.name)
    data_iter = pipeline.make_prompt_pipeline(
        source, batch_size=cfg.rollout.batch_prompts, seed=cfg.seed, shuffle=cfg.data.shuffle,
        template=template, encode_fn=tokenizer.encode, encode_batch_fn=tokenizer.encode_batch,
        max_prompt_tokens=cfg.data.max_prompt_len, overlong_prompts=cfg.data.overlong_prompts)
    if data_iter.num_overlong:
        log.warning("data.train: left out %d of %d records whose prompt is over "
                    "data.max_prompt_len=%d tokens (the longest: %d; data.overlong_prompts=drop)",
                    data_iter.num_overlong, data_iter.num_overlong + data_iter.num_records,
                    cfg.data.max_prompt_len, data_iter.longest_prompt)
    return data_iter


def check_reward_fits_data(source, reward_name: str, sample: int = 64) -> None:
    """The training records' answers must be what rewards.name grades: unit-test specs for
    "code", math answers for the others. Checked on the first `sample` records, so a math
    reward on code problems (rewards 0) or the code reward on math answers (a crash at the
    first step's scoring) stops the run at start-up. A reward of the user's own
    (rewards.name=python) decides itself what its answers are."""
    from delta_jax.rl import sandbox
    from delta_jax.rl.rewards import USER_REWARD

    if reward_name == USER_REWARD:
        return

    answers = [source[i]["answer"] for i in range(min(len(source), sample))]
    specs = [sandbox.is_spec(a) for a in answers]
    if reward_name == "code" and not all(specs):
        example = answers[specs.index(False)]
        raise InputError(
            f"rewards.name=code: {specs.count(False)} of the first {len(answers)} records of "
            f"data.train have no unit tests as their answer (e.g. {example[:60]!r}); code "
            "training needs a code layout (data.fields: mbpp, humaneval, taco, codecontests) "
            "or test specs as answers")
    if reward_name != "code" and any(specs):
        raise InputError(
            f"rewards.name={reward_name}: {specs.count(True)} of the first {len(answers)} "
            "records of data.train are code problems (their answers are unit tests); train "
            "them with --config.rewards.name=code --config.data.template=code")


def make_credit_labeller(tokenizer) -> Callable:
    """labeller(records, response_ids [N, R], mask [N, R]) -> classes int8 [N, R]: the
    ground-truth credit classes (rl.credit codes) of packed response rows on the synthetic task.

    records: the P prompt records of the rollout, each with its reference worked "solution";
    rows are prompt-major (row n belongs to records[n // (N / P)]). Each valid token is decoded on
    its own with the run's tokenizer (special tokens as "", zero-width) and the rows are labelled
    by data.synthetic.token_classes against their prompt's solution; 0 ("none") elsewhere."""
    from delta_jax.data import synthetic
    from delta_jax.rl import credit

    special = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}

    def decode(token_id: int) -> str:
        return "" if token_id in special else tokenizer.decode([token_id])

    def labeller(records, response_ids, mask):
        rows, num_prompts = len(response_ids), len(records)
        if num_prompts == 0 or rows % num_prompts:
            raise ValueError(f"{rows} response rows do not split into equal groups over "
                             f"{num_prompts} prompt records")
        group = rows // num_prompts
        solutions = [str(records[n // group].get("solution") or "") for n in range(rows)]
        return credit.label_batch(solutions, response_ids, mask, decode, synthetic.token_classes)

    return labeller


def reward_task(cfg) -> str:
    """What the run's reward grades: "code" (unit tests, rewards.name=code; a reward of the
    user's own, rewards.name=python, with data.template=code) or "math"."""
    from delta_jax.rl.rewards import USER_REWARD
    if cfg.rewards.name == "code" or (cfg.rewards.name == USER_REWARD
                                      and cfg.data.template == "code"):
        return "code"
    return "math"


def run_template(cfg, tokenizer):
    """The run's prompt template: data.template asking for its reward's task's answer
    (templates.for_task), in data.instruction's words when it has some ("none": the problem
    as the data words it, with no instruction)."""
    import dataclasses

    from delta_jax.data import templates
    template = templates.for_task(templates.make_template(cfg.data.template, tokenizer=tokenizer,
                                                          **template_options(cfg)),
                                  reward_task(cfg))
    if cfg.data.instruction:
        template = dataclasses.replace(
            template, instruction=None if cfg.data.instruction == "none" else cfg.data.instruction)
    return template


def template_options(cfg) -> dict:
    """PromptTemplate keywords from data.*: the chat template's system turn and template
    variables (data.template = "chat" only; validate_config refuses them elsewhere)."""
    if cfg.data.template != "chat":
        return {}
    return {"system": cfg.data.system_prompt or None,
            "chat_template_kwargs": {"enable_thinking": bool(cfg.data.enable_thinking)}}


def reward_options(cfg) -> dict:
    """The reward function's keywords from rewards.* (math_format's shaping)."""
    if cfg.rewards.name != "math_format":
        return {}
    return {"one_box_bonus": float(cfg.rewards.one_box_bonus),
            "no_box_penalty": float(cfg.rewards.no_box_penalty)}


def scorer_name(cfg, task: str | None = None) -> str:
    """The reward that grades `task` ("math", "code"; None = the run's own): rewards.name for the
    run's own task, the other task's plain reward for the other."""
    return cfg.rewards.name if task in (None, reward_task(cfg)) else task


def make_scorer(cfg, *, shaped: bool, task: str | None = None, pool=None):
    """The run's RewardScorer from rewards.*: shaped=True adds the method's DAPO overlong
    penalty (training rewards); shaped=False grades accuracy only (evaluation). task: "math" or
    "code" for a benchmark of the other task than the run's (rewards.name is the run's own).
    pool: a scorer's worker pool to grade in (shared_pool), instead of its own."""
    from delta_jax.rl.rewards import RewardScorer, user_reward_weights

    r = cfg.rewards
    overlong = shaped and r.overlong
    own_task = task in (None, reward_task(cfg))
    scorer = RewardScorer(
        name=scorer_name(cfg, task), num_workers=r.num_workers,
        timeout_s=r.timeout_s,
        max_response_len=cfg.rollout.max_new_tokens if shaped else None,
        overlong_buffer_len=r.overlong_buffer if overlong else 0,
        overlong_penalty_factor=r.overlong_factor, code_sandbox=r.code_sandbox,
        code_sandbox_url=r.code_sandbox_url, code_isolation=r.code_isolation,
        code_memory_mb=r.code_memory_mb, code_max_processes=r.code_max_processes,
        pass_fraction=r.code_pass_fraction, python_fn=r.python_fn if own_task else "",
        python_weights=user_reward_weights(r.python_weights) if own_task else None,
        python_columns=r.python_columns if own_task else (),
        python_batch_size=r.python_batch_size, completion_format=completion_format(cfg),
        reward_kwargs=reward_options(cfg) if own_task else None, pool=pool)
    for spec, call in zip(scorer.python_fns, scorer.user_calls):
        if pool is None and call.batch:  # once: the pool's owner
            log.info("rewards.python_fn %s takes completions=: a batch reward (TRL's form), "
                     "called on %d responses at a time (rewards.python_batch_size) with "
                     "completions as %s (rewards.completion_format=%s)", spec,
                     r.python_batch_size, "chat messages [{'role': 'assistant', 'content': ...}]"
                     if scorer.completion_format == "messages" else "strings",
                     r.completion_format)
    return scorer


# Templates whose prompt is a chat conversation: a batch reward gets TRL's conversational form.
CHAT_TEMPLATES = ("qwen_math", "chat", "code")


def completion_format(cfg) -> str:
    """rewards.completion_format, "auto" resolved: "messages" (TRL's conversational form) when
    data.template lays the prompt out as a chat (CHAT_TEMPLATES), "text" for base / plain, as
    TRL gives a reward function the form its dataset's prompts have."""
    fmt = cfg.rewards.completion_format
    if fmt != "auto":
        return fmt
    return "messages" if cfg.data.template in CHAT_TEMPLATES else "text"


def shared_pool(scorer, name: str):
    """The worker pool an accuracy scorer of reward `name` can share with the run's training
    `scorer`: the RewardScorer's pool when it runs the same function (math grading for the
    math rewards, or the user's rewards.name=python reward), so one set of rewards.num_workers
    processes serves both; None otherwise (no RewardScorer, or a code one, whose sandbox runner
    is its own)."""
    from delta_jax.rl.rewards import USER_REWARD, RewardScorer
    if (not isinstance(scorer, RewardScorer) or "code" in (name, scorer.name)
            or (name == USER_REWARD) != (scorer.name == USER_REWARD)):
        return None
    return scorer.pool


def eval_prompts(cfg, template, benchmarks: dict) -> dict:
    """{kind: prompt format} for the kinds of `benchmarks`: the run's template for the run's own
    task, the same layout asking for the other task's answer for the other
    (templates.for_task: a math run's HumanEval asks for a ```python program)."""
    from delta_jax.data.templates import for_task
    from delta_jax.evaluation import benchmark_kind
    kinds = {benchmark_kind(name, rows) for name, rows in benchmarks.items()}
    return {kind: template if kind == reward_task(cfg) else for_task(template, kind)
            for kind in sorted(kinds)}


def warn_long_eval_prompts(cfg, benchmarks: dict, prompts: dict, tokenizer,
                           field: str = "data.eval") -> None:
    """Warns at start-up, per benchmark of `field`, of prompts (of the eval.limit questions
    evaluated) over data.max_prompt_len tokens: the sampler keeps their last tokens only, so
    those questions are evaluated without their beginning."""
    from delta_jax.data.pipeline import prompt_lengths
    from delta_jax.evaluation import benchmark_kind
    limit = cfg.data.max_prompt_len
    for name, rows in benchmarks.items():
        fmt = prompts[benchmark_kind(name, rows)]
        lengths = prompt_lengths(rows[:cfg.eval.limit or None], fmt, tokenizer.encode_batch)
        over = sum(n > limit for n in lengths)
        if over:
            log.warning("%s: %s: %d of %d prompts are over data.max_prompt_len=%d tokens "
                        "(the longest: %d); they are evaluated from their last %d tokens", field,
                        name, over, len(lengths), limit, max(lengths), limit)


def add_eval_scorers(cfg, kinds, scorers: dict, train_scorer=None) -> dict:
    """Adds to `scorers` ({kind: scorer}) an accuracy scorer for each of the benchmark `kinds`
    ("math", "code") it lacks: the run's reward for the run's own task, the other task's plain
    reward for the other (a math run's HumanEval runs unit tests). A math scorer grades in the
    run's `train_scorer`'s worker pool where it runs the same function (shared_pool): one set
    of rewards.num_workers processes, not two."""
    for kind in sorted(kinds):
        if kind not in scorers:
            scorers[kind] = make_scorer(cfg, shaped=False, task=kind,
                                        pool=shared_pool(train_scorer, scorer_name(cfg, kind)))
    return scorers


class _NullWriter:
    """Metrics sink of processes other than 0 (metrics are logged once)."""

    def write(self, step, metrics, prefix=""):
        return {prefix + k: v for k, v in to_scalars(metrics).items()}

    def write_text(self, step, tag, text):
        pass

    def position(self) -> int:
        return 0

    def truncate(self, position: int):
        pass

    def close(self):
        pass


def place_state(run: Run, state: TrainState) -> TrainState:
    """The train state on the run's mesh, by its logical-axis shardings, where it rests between
    updates (optim.offload: the optimizer state in pinned host memory)."""
    if run.state_shardings is None:
        return state
    return sharding_lib.shard_tree(state, run.resting_shardings or run.state_shardings)


def abstract_state(run: Run) -> TrainState:
    """What place_state(run, init_train_state(run.initial_params, run.optimizer)) returns, as
    ShapeDtypeStructs with its shardings: a checkpoint's restore target that allocates nothing
    (a fresh state built to restore into would otherwise stay beside the restored one)."""
    state = jax.eval_shape(lambda p: init_train_state(p, run.optimizer), run.initial_params)
    shardings = run.resting_shardings or run.state_shardings
    if shardings is None:
        return state
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings)


def optimizer_state_to(run: Run, state: TrainState, where: str) -> TrainState:
    """optim.offload: the state with its optimizer state moved to "device" (before a step's
    updates, where the train step takes it) or back to "host" (after them); unchanged without
    offload. The copy it leaves behind is freed once nothing refers to it."""
    if run.resting_shardings is None:
        return state
    target = run.state_shardings if where == "device" else run.resting_shardings
    return state.replace(opt_state=sharding_lib.shard_tree(state.opt_state, target.opt_state))


def feature_cache_mode(cfg, with_delta: bool) -> str:
    """What the old-policy pass keeps of the hidden states h: delta.feature_cache ("device" |
    "host") when DelTA reads h from that pass, else "drop" (no DelTA, the top-K proxy, which reads
    the top-K ids instead, or the recompute cache, which runs the trunk again)."""
    if (not with_delta or cfg.delta.proxy == "hidden_topk"
            or cfg.delta.feature_cache == "recompute"):
        return "drop"
    return cfg.delta.feature_cache


def copy_tree(tree):
    """Fresh device buffers with the same values and shardings."""
    return jax.tree.map(lambda x: x.copy(), tree)


def reference_part(params):
    """What a run keeps of its frozen KL reference policy, given the policy's parameters at the
    start of RL: a copy (the train step donates, and so frees, the live buffers) of their
    trainable part (state.split_trainable): every parameter in full fine-tuning; with LoRA only
    the adapters, since the base weights never change and are shared with the live policy
    (reference_params). No second copy of the base model on the device."""
    return copy_tree(split_trainable(params)[0])


def reference_params(ref_part, params):
    """The whole reference policy: `ref_part` (reference_part) with the frozen weights of the
    live `params` (nothing with full fine-tuning, where ref_part is the whole policy)."""
    return merge_trainable(ref_part, split_trainable(params)[1])


def _updates_per_step(cfg) -> int:
    return cfg.rl.epochs * (cfg.rollout.batch_prompts // cfg.rl.mini_batch_prompts)


# ----------------------------------------------------------------------------- KL reference


def _reference_dir(run: Run) -> str:
    return os.path.join(run.workdir, "reference")


def save_reference(run: Run, params):
    """Keeps the post-SFT reference policy's own part (reference_part: the whole policy, or
    the LoRA adapters) for resumes (without SFT it is rebuilt from the config: random init from
    the seed, or model.path)."""
    ckpt = Checkpointer(_reference_dir(run), keep=1)
    try:
        ckpt.save(0, params, None, {"what": "KL reference policy (parameters after SFT)"},
                  force=True)
    finally:
        ckpt.close()


def resumed_reference(run: Run, params):
    """The KL reference part (reference_part) of a run resumed with policy `params`: the one
    saved after its SFT warm start (sft.steps > 0), else that of its initial parameters, made
    again (initial_trainable)."""
    if run.cfg.sft.steps > 0:
        return restore_reference(run, params)
    return initial_trainable(run)


def initial_trainable(run: Run):
    """The trainable part (split_trainable) of the run's initial parameters, made again, placed
    as the run places it: with LoRA the fresh adapters alone, from the seed as build_model makes
    them (model.path's base weights are not read); else the whole initial policy, read again."""
    if not run.cfg.model.lora_rank:
        return split_trainable(run.read_initial_params())[0]  # fresh arrays: no copy to make
    arrays = models.init_lora_arrays(run.model(run.initial_params).cfg,
                                     jax.random.key(run.cfg.seed))
    abstract = split_trainable(run.initial_params)[0]
    trainable = nnx.from_flat_state([(path, var.replace(arrays[path[-1]]))
                                     for path, var in nnx.to_flat_state(abstract)])
    if run.state_shardings is None:
        return trainable
    return sharding_lib.shard_tree(trainable, split_trainable(run.state_shardings.params)[0])


def restore_reference(run: Run, params):
    """save_reference's part, placed like the same part of the policy's `params`."""
    target = split_trainable(params)[0]
    ckpt = Checkpointer(_reference_dir(run), keep=1)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(
                f"rl.kl_coef: resuming a run with an SFT warm start needs its KL reference "
                f"policy in {_reference_dir(run)}, which is missing (was rl.kl_coef 0 when the "
                "run started?)")
        params, _, _ = ckpt.restore(0, target)
        return params
    finally:
        ckpt.close()
