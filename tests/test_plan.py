"""Memory planning: the exact figures (parameters, optimizer state) equal the bytes the placed
arrays really hold on device 0; the other figures follow their shapes; plan mode runs from the
command line without the planned devices."""
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from delta_jax import models, plan, sharding
from delta_jax.train.state import init_train_state, make_optimizer, split_model
from delta_jax.sampling.programs import abstract_decode_args
from tests.rl_fixtures import device_bytes

# hidden 36 does not divide by fsdp=8 (the rules fall back to replication there).
SMALL = models.get_preset("tiny").replace(vocab_size=96, hidden_size=36, intermediate_size=80,
                                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def real_device0_bytes(mcfg, mesh_shape, optimizer):
    """Place a real model + optimizer state by the rules; sum device 0's shard bytes of the
    parameters, of the optimizer state, of the LoRA adapters (the LoRAParam variables) and of
    the KL reference a run keeps of them (train.run.reference_part)."""
    from delta_jax.train.run import reference_part
    mesh = sharding.make_mesh(*mesh_shape)
    model = sharding.shard_model(models.Transformer(mcfg, rngs=nnx.Rngs(0)), mesh)
    _, params, _ = split_model(model)
    state = init_train_state(params, optimizer)
    state = sharding.shard_tree(state, sharding.tree_shardings(state, mesh))
    device0 = jax.devices()[0]
    adapters = nnx.split_state(state.params, models.LoRAParam, ...)[0]
    return (device_bytes(state.params, device0),
            device_bytes(state.opt_state, device0),
            device_bytes(adapters, device0),
            device_bytes(reference_part(state.params), device0))


@pytest.mark.parametrize("mesh_shape,dtype,lora_rank", [((1, 4, 2), jnp.float32, 0),
                                                        ((2, 2, 2), jnp.bfloat16, 0),
                                                        ((1, 8, 1), jnp.float32, 0),
                                                        ((1, 4, 2), jnp.bfloat16, 4)])
@pytest.mark.devices(8)
def test_param_and_optimizer_bytes_match_placed_arrays(mesh_shape, dtype, lora_rank):
    """With LoRA (rank 4 on every projection) the parameters include the float32 adapters while
    the optimizer state and the gradients cover the adapters alone. A KL term's reference
    policy adds what the run keeps of it to every phase: a copy of the whole model, or of the
    adapters alone (the base is shared with the policy)."""
    mcfg = SMALL.replace(param_dtype=dtype, lora_rank=lora_rank,
                         lora_targets=models.LORA_TARGETS if lora_rank else ())
    optimizer = make_optimizer(optax.constant_schedule(1e-3))  # a bf16 model's master copy too
    want_params, want_opt, adapters, reference = real_device0_bytes(mcfg, mesh_shape, optimizer)
    p, p_kl = (plan.plan_memory(mcfg, mesh_shape=mesh_shape, device_memory_gb=1.0,
                                rollout_rows=16, prompt_len=8, response_len=8, sampler_rows=16,
                                group_size=4, mini_batch_rows=8, micro_batch_rows=0,
                                logprob_chunk_tokens=32, recompute_chunk=4, optimizer=optimizer,
                                kl_reference=kl) for kl in (False, True))
    assert p.params == want_params
    assert p.optimizer == want_opt
    # No micro-batching: one float32 gradient tree, of the whole model or of the (float32)
    # adapters.
    assert p.gradients == (adapters if lora_rank else p.params * 4 // jnp.dtype(dtype).itemsize)
    if dtype == jnp.bfloat16 and not lora_rank:  # master copy + AdamW's moments, all float32
        assert want_opt == 6 * want_params + 8   # + the step and schedule counters
    assert (adapters > 0) == bool(lora_rank)
    assert p.kl_reference == 0 and p_kl.kl_reference == reference
    assert reference == (adapters if lora_rank else want_params)
    assert {k: v - p.phases[k] for k, v in p_kl.phases.items()} == dict.fromkeys(p.phases,
                                                                                 reference)
    assert "KL reference policy" in p_kl.to_text() and "KL reference" not in p.to_text()


def test_figures_follow_the_shapes():
    """Independent arithmetic for the shape-determined items of a Qwen3-8B-like config on a
    planned 32-device mesh (no such devices here)."""
    mc = models.get_preset("qwen3-8b", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                           remat="full")
    p = plan.plan_memory(mc, mesh_shape=(1, 8, 4), device_memory_gb=95.0, rollout_rows=2048,
                         prompt_len=2048, response_len=20480, sampler_rows=256, group_size=16,
                         mini_batch_rows=512, micro_batch_rows=8, logprob_chunk_tokens=4096,
                         recompute_chunk=64)
    # Every parameter dimension of Qwen3-8B divides by fsdp=8 / tensor=4 except the norms
    # (replicated): params = (total - norms) / 32 + norms, in bf16.
    L, H, D = 36, 4096, 128
    norms = L * 2 * H + L * 2 * D + H
    assert p.params == 2 * ((mc.num_params() - norms) // 32 + norms)
    # AdamW through a float32 master copy: the copy and two moments, each twice the bf16
    # parameters, plus scale_by_adam's and the schedule's int32 step counters (replicated).
    assert p.optimizer == 6 * p.params + 8
    # Micro-batches: a float32 accumulator + one micro-batch's bf16 gradients.
    assert p.gradients == 3 * p.params
    # KV page pool (worst case, 32-token pages), split over the 1 x 8 batch shards: a device
    # holds its shard's pages: the shard's scratch page, per slot of its 256 / 8 = 32 the
    # prompt's 64 pages + the response's 640 + one partial, and the next prompt's 64; 8 kv
    # heads over tensor=4; a page holds K and V of 32 tokens of every layer.
    pages = 1 + (256 // 8) * (2048 // 32 + 20480 // 32 + 1) + 2048 // 32
    assert p.kv_cache == pages * 2 * L * (8 // 4) * 32 * D * 2
    # LM head: a micro-batch row a device (8 rows over 8 batch shards) x 512 positions a chunk
    # (4,096 tokens / 8 rows) x V / tensor float32 logits, three such; and, its hidden dimension
    # split over fsdp, the head gathered whole: two bf16 copies and a float32 gradient sum.
    V = 151936
    assert p.logprob_chunk == 1 * 512 * (V // 4) * 4 * 3 + H * (V // 4) * (2 * 2 + 4)
    one = plan.plan_memory(mc, mesh_shape=(1, 1, 4), device_memory_gb=95.0, rollout_rows=2048,
                           prompt_len=2048, response_len=20480, sampler_rows=256, group_size=16,
                           mini_batch_rows=512, micro_batch_rows=8, logprob_chunk_tokens=4096,
                           recompute_chunk=64)
    assert one.logprob_chunk == 8 * 512 * (V // 4) * 4 * 3  # nothing gathered without fsdp
    # Device feature cache: 2048 rows over 8 batch shards x 20480 tokens x H, bf16.
    assert p.features_device == (2048 // 8) * 20480 * H * 2
    assert p.features_host_chunk == (64 // 8) * 20480 * H * 2
    assert p.activations_remat_full < p.activations_remat_none
    assert set(p.feature_cache_fits) == {"device", "host", "recompute"}
    text = p.to_text()
    assert "optimizer state" in text and "DelTA features, device" in text


def _plan_mode(*flags, env=None):
    base = {k: v for k, v in __import__("os").environ.items() if k not in plan.MEM_FRACTION_ENV}
    return subprocess.run(
        [sys.executable, "-m", "delta_jax.main", "--config=experiments/qwen3_8b.py",
         "--config.mode=plan", "--config.plan.num_devices=8",
         "--config.plan.device_memory_gb=80", *flags],
        capture_output=True, text=True, timeout=120,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]),
        env={**base, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", **(env or {})})


def test_plan_mode_on_the_command_line():
    out = _plan_mode()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mesh data=1 fsdp=8 tensor=1 (8 devices of 80 GB)" in out.stdout  # the recipe's mesh
    assert "recommended:" in out.stdout
    assert "remat=auto -> full (planned update or warm-start step per device: none " in out.stdout
    assert "the first of none, dots_with_no_batch_dims_saveable, full within" in out.stdout
    assert "as resolved on the cpu backend" in out.stdout
    # Planned for a CUDA GPU from this CPU; a target that is not one names the field.
    cuda = _plan_mode("--config.plan.target=cuda")
    assert cuda.returncode == 0, cuda.stderr[-2000:]
    assert "as resolved on the cuda backend" in cuda.stdout
    # ... against what jax's allocator may use there by default, 0.75 of the card, as the
    # start-up check of a run on such a GPU does; the recipe as shipped fits it.
    assert ("(8 devices of 80 GB; the allocator may use 0.75 of it: 60.00 GB (jax's default on "
            "CUDA GPUs; XLA_CLIENT_MEM_FRACTION sets it))") in cuda.stdout
    assert "within 0.85 x 60.00 GB" in cuda.stdout and "DOES NOT FIT" not in cuda.stdout
    # remat=auto for a CUDA GPU does not try "none" (plan.AUTO_REMAT_ORDER_CUDA).
    assert ("(planned update or warm-start step per device: dots_with_no_batch_dims_saveable "
            in cuda.stdout)
    assert "the first of dots_with_no_batch_dims_saveable, full within" in cuda.stdout
    bad = _plan_mode("--config.plan.target=gpu")
    assert bad.returncode != 0 and "plan.target: 'gpu' is not one of" in bad.stdout + bad.stderr
    # Shapes only: the recipe's preset stands in for a checkpoint (no model.path, no
    # random_init, no tokenizer above); with neither, the error names the field.
    none = _plan_mode("--config.model.preset=")
    assert none.returncode != 0
    assert "model.path: plan mode needs the model's shapes" in none.stdout + none.stderr


def test_plan_mode_plans_against_the_allocator_limit():
    """Plan mode judges each phase against what XLA's allocator may use on the target: on a CUDA
    GPU 0.75 of the card unless XLA_CLIENT_MEM_FRACTION (or the older name) or
    plan.memory_fraction says otherwise. The 8B recipe with the device-resident feature cache
    (65.41 GB old-policy phase) does not fit jax's default 60 GB of an 80 GB card, fits 72."""
    device = ("--config.plan.target=cuda", "--config.delta.feature_cache=device")
    line = "  old-policy pass + DelTA            65.41 GB  "
    default = _plan_mode(*device)
    assert default.returncode == 0, default.stderr[-2000:]
    assert line + "DOES NOT FIT" in default.stdout
    assert "recommended: host" in default.stdout
    for env, flags, source in (({"XLA_CLIENT_MEM_FRACTION": "0.9"}, (), "XLA_CLIENT_MEM_FRACTION"),
                               ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, (),
                                "XLA_PYTHON_CLIENT_MEM_FRACTION"),
                               ({}, ("--config.plan.memory_fraction=0.9",),
                                "plan.memory_fraction")):
        out = _plan_mode(*device, *flags, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"the allocator may use 0.9 of it: 72.00 GB ({source})" in out.stdout
        assert line + "fits" in out.stdout and "recommended: device" in out.stdout
    # A TPU's allocator has the whole chip: no fraction is named.
    tpu = _plan_mode("--config.plan.target=tpu", env={"XLA_CLIENT_MEM_FRACTION": "0.5"})
    assert tpu.returncode == 0 and "(8 devices of 80 GB)" in tpu.stdout
    # A run that evaluates (data.eval) plans its evaluation too: eval.max_new_tokens = 30000.
    evals = _plan_mode("--config.plan.target=cuda", "--config.data.eval=aime25")
    assert evals.returncode == 0, evals.stderr[-2000:]
    assert "eval KV cache" in evals.stdout and "(eval.max_new_tokens=30000)" in evals.stdout
    assert "\n  eval        " in evals.stdout and "DOES NOT FIT" not in evals.stdout


def test_old_pass_rows_sizes_the_old_policy_chunk_alone():
    """rl.old_pass_rows sets the old-policy pass's chunk: planned as a config whose sampler has
    that many slots (the default, 0, takes rollout.max_batch_size), and with the rollout's own
    figures left to rollout.max_batch_size; the text names both."""
    from tests.rl_fixtures import tiny_rl_config
    rollout = dict(batch_prompts=8, group_size=4, max_new_tokens=64)
    wide = plan.plan_from_config(tiny_rl_config("dapo", rollout=dict(rollout, max_batch_size=32),
                                                rl=dict(old_pass_rows=4)), mesh_shape=(1, 1, 1))
    narrow = plan.plan_from_config(tiny_rl_config("dapo", rollout=dict(rollout, max_batch_size=4)),
                                   mesh_shape=(1, 1, 1))
    tied = plan.plan_from_config(tiny_rl_config("dapo", rollout=dict(rollout, max_batch_size=32)),
                                 mesh_shape=(1, 1, 1))
    assert wide.old_pass_activations == narrow.old_pass_activations < tied.old_pass_activations
    assert wide.phases["rollout"] == tied.phases["rollout"] > narrow.phases["rollout"]
    assert "sampler slots 32 (KV pages of" in wide.to_text()
    assert "old-policy chunk 4 rows" in wide.to_text()


def test_allocator_fraction(monkeypatch):
    """plan.allocator_fraction: plan.memory_fraction when set; on CUDA the environment's
    fraction under either of the names jax reads, else 0.75; the whole memory elsewhere; ""
    follows the backend this runs on. A value that is not a number names the variable."""
    from delta_jax.models import attention
    assert plan.allocator_fraction("cuda", env={})[0] == 0.75
    assert plan.allocator_fraction("cuda", env={"XLA_CLIENT_MEM_FRACTION": "0.9"}) == (
        0.9, "XLA_CLIENT_MEM_FRACTION")
    assert plan.allocator_fraction("cuda", env={"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}) == (
        0.5, "XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert plan.allocator_fraction("cuda", 0.6, env={"XLA_CLIENT_MEM_FRACTION": "0.9"}) == (
        0.6, "plan.memory_fraction")
    for target in ("tpu", "cpu"):
        assert plan.allocator_fraction(target, env={"XLA_CLIENT_MEM_FRACTION": "0.9"})[0] == 1.0
    with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION='most' is not a number"):
        plan.allocator_fraction("cuda", env={"XLA_CLIENT_MEM_FRACTION": "most"})
    monkeypatch.setattr(attention, "_cuda_backend", lambda: True)
    assert plan.allocator_fraction("", env={})[0] == 0.75
    monkeypatch.setattr(attention, "_cuda_backend", lambda: False)
    assert plan.allocator_fraction("", env={})[0] == 1.0


def test_eval_phase_plans_the_evaluations_generation():
    """A run with data.eval plans an "eval" phase: the sampler's pool sized for
    eval.max_new_tokens and eval.k samples a prompt. At the rollout's length and group size it
    is the rollout phase; longer, it grows by exactly the difference of the two pools as the
    sampler sizes them (sampling.plan_kv). A KV budget too small for one evaluation sample is
    refused naming eval.max_new_tokens; without data.eval there is no eval phase. train.eval_best
    adds a phase of its own, the eval phase plus one copy of the parameters."""
    from delta_jax.sampling.kv_cache import plan_kv
    from delta_jax.train.config import ConfigError
    from tests.rl_fixtures import tiny_rl_config
    rollout = dict(batch_prompts=4, group_size=4, max_new_tokens=64, max_batch_size=16)
    assert "eval" not in plan.plan_from_config(tiny_rl_config("dapo", rollout=rollout),
                                               mesh_shape=(1, 1, 1)).phases
    same = plan.plan_from_config(
        tiny_rl_config("dapo", rollout=rollout, data=dict(eval="x"),
                       eval=dict(max_new_tokens=64, k=4, pass_k="1")), mesh_shape=(1, 1, 1))
    assert same.phases["eval"] == same.phases["rollout"]
    cfg = tiny_rl_config("dapo", rollout=rollout, data=dict(eval="x"),
                         eval=dict(max_new_tokens=1000, k=4, pass_k="1"))
    longer = plan.plan_from_config(cfg, mesh_shape=(1, 1, 1))
    mc = plan.model_config_from_run_config(cfg)

    def pool(tokens, slots=16):
        return plan_kv(mc, slots=slots, prompt_len=cfg.data.max_prompt_len,
                       max_new_tokens=tokens, page_size=cfg.rollout.page_size).shard_bytes

    assert longer.eval_kv_cache == pool(1000) > pool(64) == longer.kv_cache
    assert longer.phases["eval"] - longer.phases["rollout"] == pool(1000) - pool(64)
    # validations alone (data.val, no data.eval) generate as the evaluations do
    validated = plan.plan_from_config(
        tiny_rl_config("dapo", rollout=rollout, data=dict(val="x"), train=dict(eval_every=1),
                       eval=dict(max_new_tokens=1000, k=4, pass_k="1")), mesh_shape=(1, 1, 1))
    assert validated.phases["eval"] == longer.phases["eval"]
    # mode=eval holds the parameters alone (loop.eval_only): no optimizer state beside them.
    evaluate = cfg.copy_and_resolve_references()
    evaluate.mode = "eval"
    alone = plan.plan_from_config(evaluate, mesh_shape=(1, 1, 1))
    assert alone.phases["eval"] == longer.phases["eval"] - longer.optimizer > 0
    assert plan.BEST_EVAL not in longer.phases
    # train.eval_best: after the last step the best policy's parameters, read back from its
    # export, sit beside the training state while it is evaluated; mode=eval runs no such phase.
    best = cfg.copy_and_resolve_references()
    best.train.eval_best, best.train.best_metric = True, "eval/average/avg@4"
    with_best = plan.plan_from_config(best, mesh_shape=(1, 1, 1))
    params = plan.tree_device_bytes(plan.abstract_params(mc), plan.abstract_mesh(1, 1, 1))
    assert with_best.phases[plan.BEST_EVAL] == with_best.phases["eval"] + params
    assert {n: v for n, v in with_best.phases.items() if n != plan.BEST_EVAL} == longer.phases
    best.mode = "plan"  # plans a train run
    assert plan.plan_from_config(best, mesh_shape=(1, 1, 1)).phases == with_best.phases
    best.mode = "eval"
    assert plan.BEST_EVAL not in plan.plan_from_config(best, mesh_shape=(1, 1, 1)).phases
    with pytest.raises(ConfigError, match=r"phase 'eval of the best policy' plans .*turn: "
                                          r"train\.eval_best=False \(then --config\.mode=eval"):
        plan.check_fits(with_best, with_best.phases["eval"], phases=plan.PHASES_BY_MODE["train"])
    # Room for one rollout sample, not for one evaluation sample.
    budget = (pool(64, slots=1) + pool(1000, slots=1)) / 2 / 2**30
    with pytest.raises(ConfigError, match=r"rollout\.kv_budget_gb / eval\.max_new_tokens"):
        plan.plan_from_config(
            tiny_rl_config("dapo", rollout=dict(rollout, kv_budget_gb=budget),
                           data=dict(eval="x"), eval=dict(max_new_tokens=1000, k=4, pass_k="1")),
            mesh_shape=(1, 1, 1))


def _plan_for(mc, prompt_len, response_len, **kw):
    return plan.plan_memory(mc, mesh_shape=(1, 4, 2), device_memory_gb=1.0, rollout_rows=16,
                            prompt_len=prompt_len, response_len=response_len, sampler_rows=16,
                            group_size=4, mini_batch_rows=8, micro_batch_rows=0,
                            logprob_chunk_tokens=32, recompute_chunk=4, **kw)


def test_sft_phase_plans_the_warm_start_where_one_runs():
    """sft.steps > 0 adds an "sft" phase in train mode, mode=sft and mode=plan, sized by
    sft.batch_size x sft.max_len (more rows or tokens, more memory; micro-batches, less) and not
    by the RL shapes; none without a warm start or in mode=eval."""
    from tests.rl_fixtures import tiny_rl_config

    def sft_phase(mode="train", **sft):
        cfg = tiny_rl_config("dapo", sft=dict(dict(steps=2, batch_size=8, max_len=128), **sft))
        cfg.mode = mode
        return plan.plan_from_config(cfg, mesh_shape=(1, 1, 1)).phases.get("sft")

    base = sft_phase()
    assert base is not None and sft_phase("sft") == base == sft_phase("plan")
    assert sft_phase(batch_size=16) > base and sft_phase(max_len=256) > base
    assert sft_phase(batch_size=16, micro_batch_size=2) < sft_phase(batch_size=16)
    assert sft_phase(micro_batch_size=8) == base  # a micro-batch of the whole batch
    assert sft_phase(steps=0) is None and sft_phase("eval") is None
    cfg = tiny_rl_config("dapo", sft=dict(steps=2, batch_size=8, max_len=128),
                         rollout=dict(max_new_tokens=64))
    assert plan.plan_from_config(cfg, mesh_shape=(1, 1, 1)).phases["sft"] == base


def test_activation_estimate_follows_the_configured_attention():
    """"xla" grows quadratically with the sequence, "blockwise" linearly; "auto" is xla for short
    and blockwise for long sequences; block sizes only matter to blockwise."""
    mc = SMALL.replace(remat="none", attention_block_q=64, attention_block_kv=64)
    xla, blockwise, auto = (mc.replace(attention=a) for a in ("xla", "blockwise", "auto"))
    short, long_ = (64, 64), (1024, 2048)  # seq 128 and 3072 (3072^2 > the auto threshold)
    p_short = _plan_for(xla, *short)
    p_long = _plan_for(xla, 2 * 1024, 2 * 2048)
    x1, x2 = _plan_for(xla, *long_), p_long
    b1, b2 = _plan_for(blockwise, *long_), _plan_for(blockwise, 2 * 1024, 2 * 2048)
    # Doubling the sequence: the score matrices make xla's activations grow by > 3x (-> 4x),
    # blockwise's by ~2x.
    assert x2.activations_remat_none > 3.5 * x1.activations_remat_none
    assert 1.9 < b2.activations_remat_none / b1.activations_remat_none < 2.1
    assert b1.activations_remat_none < x1.activations_remat_none / 10
    assert b1.old_pass_activations < x1.old_pass_activations
    # The xla figure keeps the materialised [rows, heads, T, T] float32 scores per layer.
    rows, n_loc, seq = 8 // 4, SMALL.num_heads // 2, 3072
    assert (x1.activations_remat_none - b1.activations_remat_none
            > SMALL.num_layers * rows * n_loc * seq * seq * 4)
    # "auto" picks by length; the second column is always the blockwise figure.
    assert _plan_for(auto, *short).activations_remat_none == p_short.activations_remat_none
    a1 = _plan_for(auto, *long_)
    assert a1.activations_remat_none == b1.activations_remat_none
    assert a1.phases_flash == x1.phases_flash
    for phase in ("update", "old-policy pass + DelTA"):  # 3072 tokens: blockwise
        assert a1.phases[phase] == a1.phases_flash[phase] < x1.phases[phase]
    # The rollout prefill covers only the 1024-token prompt: short enough for xla.
    assert a1.settings["attention_prefill"] == "xla"
    assert a1.phases["rollout"] == x1.phases["rollout"] > a1.phases_flash["rollout"]
    assert a1.settings["attention_train"] == "blockwise"
    assert p_short.settings["attention_train"] == "xla"
    # Bigger blocks: a bigger blockwise transient, no change to xla.
    big = dict(attention_block_q=512, attention_block_kv=512)
    assert (_plan_for(blockwise.replace(**big), *long_).activations_remat_none
            > b1.activations_remat_none)
    assert (_plan_for(xla.replace(**big), *long_).activations_remat_none
            == x1.activations_remat_none)
    assert "attention=blockwise (update / old-policy pass: blockwise" in b1.to_text()


def test_activation_estimate_follows_the_remat_policy(monkeypatch):
    """Every models.REMAT_POLICIES has its own update estimate: full <
    dots_with_no_batch_dims_saveable < dots_saveable, and < none but for dots_saveable with
    blockwise attention. The dots_* policies keep each layer's input and its projection / MLP
    matmul outputs (plan._layer_activation_bytes' dots_saved) and recompute attention, so
    materialised scores cost dots_with_no_batch_dims_saveable nothing per layer; dots_saveable
    also keeps the batched attention matmuls (batched_dots): the raw scores and P V products
    (xla), every block pair's (blockwise), nothing with cuDNN's fused kernel. Hand-computed for
    SMALL on (1, 4, 2): 2 rows x 128 tokens per device, 4 / 2 q heads, 2 / 2 kv heads, 80 / 2
    MLP columns, head dim 8, hidden 36, float32."""
    from delta_jax.models import attention
    no_batch, saveable = "dots_with_no_batch_dims_saveable", "dots_saveable"
    assert set(models.REMAT_POLICIES) == {"none", "full", no_batch, saveable}
    mc = SMALL.replace(attention_block_q=32, attention_block_kv=32)

    def plan_of(remat, impl, layers=2, **kw):
        return _plan_for(mc.replace(remat=remat, attention=impl, num_layers=layers, **kw), 64, 64)

    def act(*args, **kw):
        return plan_of(*args, **kw).activations_configured

    for impl in ("xla", "blockwise"):
        p = {remat: plan_of(remat, impl) for remat in models.REMAT_POLICIES}
        assert p["none"].activations_configured == p["none"].activations_remat_none
        assert p["full"].activations_configured == p["full"].activations_remat_full
        assert (p["full"].activations_configured < p[no_batch].activations_configured
                < p["none"].activations_configured), impl
        assert p[no_batch].activations_configured < p[saveable].activations_configured
        # With blockwise attention dots_saveable keeps more than no remat at all (as XLA does:
        # S, micro-batch 2 x 512 tokens in 128-token blocks compiles to 71.8 MiB against 63.6).
        assert ((p[saveable].activations_configured < p["none"].activations_configured)
                == (impl == "xla"))
        for dots in (no_batch, saveable):
            assert f"(estimate; remat={dots})" in p[dots].to_text()
        assert "configured remat" not in p["full"].to_text()

    # Two more layers add two layers' kept bytes (the transients do not depend on the depth).
    def per_two_layers(remat, impl, **kw):
        return act(remat, impl, 4, **kw) - act(remat, impl, 2, **kw)

    tokens = 2 * 128
    dots_saved = tokens * 4 * (2 * 36 + 2 * 8 + 2 * 1 * 8 + 2 * 40)
    assert per_two_layers(no_batch, "xla") == 2 * dots_saved == per_two_layers(no_batch,
                                                                                "blockwise")
    assert per_two_layers(saveable, "xla") == 2 * (dots_saved + tokens * 2 * (128 + 8) * 4)
    blocks = 2 * 2 * 128 * 4 * (32 + 8) * 4  # 4 x 4 pairs of 32-token blocks, scores and P V
    assert per_two_layers(saveable, "blockwise") == 2 * (dots_saved + blocks)
    assert act(saveable, "blockwise", attention_block_kv=16) > act(saveable, "blockwise")
    # The materialised scores are recomputed one layer at a time by the no-batch-dims policy.
    assert (act(no_batch, "xla", 4) - act(no_batch, "blockwise", 4)
            == act(no_batch, "xla") - act(no_batch, "blockwise"))
    # cuDNN (on a CUDA GPU, bf16): dots_saveable keeps what the no-batch-dims policy keeps.
    monkeypatch.setattr(attention, "_cuda_backend", lambda: True)
    bf16 = dict(dtype=jnp.bfloat16)
    assert (act(saveable, "cudnn", **bf16) == act(no_batch, "cudnn", **bf16)
            < act(saveable, "blockwise", **bf16))


def test_attention_kind_follows_the_backends_dispatch(monkeypatch):
    """The plan resolves attention as attend() does on the backend: on a CUDA GPU "auto" and
    "cudnn" in bf16 run cuDNN (no score arrays) at every length, so a short-sequence update plans
    the blockwise figure there, and the forward-only passes (the old-policy pass, the rollout
    prefill) less than blockwise's (cuDNN's fused forward keeps no block of scores); float32 (no
    cuDNN) and "xla" keep the materialised scores, and an explicit "cudnn" off the GPU falls back
    to blockwise, as attend() does."""
    from delta_jax.models import attention
    bf16 = SMALL.replace(remat="none", dtype=jnp.bfloat16, head_dim=8)
    short = (64, 64)  # 128 tokens: "auto" is xla by length
    monkeypatch.setattr(attention, "_cuda_backend", lambda: False)  # off CUDA, on any machine
    assert plan.attention_kind(bf16.replace(attention="auto"), 128) == "xla"
    assert plan.attention_kind(bf16.replace(attention="cudnn"), 128) == "blockwise"
    cpu_auto = _plan_for(bf16.replace(attention="auto"), *short, target="cpu")
    assert cpu_auto.settings["attention_backend"] == "cpu"
    assert "as resolved on the cpu backend" in cpu_auto.to_text()
    monkeypatch.setattr(attention, "_cuda_backend", lambda: True)
    for impl in ("auto", "cudnn"):
        assert plan.attention_kind(bf16.replace(attention=impl), 128) == "blockwise"
    assert plan.attention_kind(bf16.replace(attention="xla"), 128) == "xla"
    assert plan.attention_kind(bf16.replace(attention="auto", dtype=jnp.float32), 128) == "xla"
    gpu_auto = _plan_for(bf16.replace(attention="auto"), *short)
    blockwise = _plan_for(bf16.replace(attention="blockwise"), *short)
    assert gpu_auto.phases["update"] == blockwise.phases["update"]
    for forward in ("rollout", "old-policy pass + DelTA"):
        assert gpu_auto.phases[forward] < blockwise.phases[forward]
    assert gpu_auto.phases["update"] < cpu_auto.phases["update"]
    assert gpu_auto.settings["attention_prefill"] == "blockwise"
    dots = {impl: _plan_for(bf16.replace(attention=impl, remat="dots_saveable"), *short)
            for impl in ("auto", "blockwise")}
    monkeypatch.undo()
    # plan.target="cuda" plans on this (CPU) backend what the CUDA dispatch above gave, cuDNN
    # included (dots_saveable keeps no blockwise score blocks under it); "cpu" the CPU's own.
    assert jax.default_backend() != "cpu" or not attention._cuda_backend()
    for impl, want in (("auto", gpu_auto), ("blockwise", blockwise)):
        assert _plan_for(bf16.replace(attention=impl), *short, target="cuda").phases == want.phases
    for impl, want in dots.items():
        got = _plan_for(bf16.replace(attention=impl, remat="dots_saveable"), *short,
                        target="cuda")
        assert got.phases == want.phases
    assert dots["auto"].phases["update"] < dots["blockwise"].phases["update"]
    targeted = _plan_for(bf16.replace(attention="auto"), *short, target="cuda")
    assert "as resolved on the cuda backend" in targeted.to_text()
    if jax.default_backend() == "cpu":  # "" plans for the backend it runs on: here the CPU
        assert _plan_for(bf16.replace(attention="auto"), *short).phases == cpu_auto.phases
    with pytest.raises(ValueError, match="plan.target must be one of"):
        _plan_for(bf16, *short, target="gpu")


def test_run_config_attention_reaches_the_plan():
    from delta_jax.train import config as config_lib
    cfg = config_lib.default_config()
    cfg.model.random_init, cfg.model.preset, cfg.model.attention = True, "tiny", "blockwise"
    assert plan.model_config_from_run_config(cfg).attention == "blockwise"


def test_old_pass_peak_follows_the_configured_feature_cache():
    """The "old-policy pass + DelTA" peak counts the features the configured cache mode keeps
    on the device. Hand-computed for SMALL on (1, 4, 2): 16 rollout rows over 4 batch shards = 4
    rows, recompute chunk 4 rows = 1 row, response 8 tokens, hidden 36, bf16 features."""
    feat_row = 8 * 36 * 2
    # One decoder layer's forward intermediates of the recompute chunk's trunk pass: the old
    # pass's 4 rows x 16 tokens in fp32, scaled to 1 row: 4 H + 3 (N D + 2 K D) + N D + 4 I
    # with N = 4 / 2, K = 2 / 2, I = 80 / 2 per device, D = 8.
    recompute_layer = 4 * 16 * 4 * (4 * 36 + 3 * (2 * 8 + 2 * 1 * 8) + 2 * 8 + 4 * 40) // 4
    # feat_row = 8 x 36 x 2 = 576 bytes; recompute_layer = 256 x (144 + 96 + 16 + 160) / 4 =
    # 26624 bytes: device 4 x 576 = 2304, host 576, recompute 576 + 26624 = 27200.
    want = {"device": 4 * feat_row, "host": 1 * feat_row,
            "recompute": 1 * feat_row + recompute_layer}

    def plan_with(mode, memory_gb=1.0):
        return plan.plan_memory(SMALL, mesh_shape=(1, 4, 2), device_memory_gb=memory_gb,
                                rollout_rows=16, prompt_len=8, response_len=8, sampler_rows=16,
                                group_size=4, mini_batch_rows=8, micro_batch_rows=0,
                                logprob_chunk_tokens=32, recompute_chunk=4, feature_cache=mode)

    plans = {mode: plan_with(mode) for mode in want}
    name = "old-policy pass + DelTA"
    for mode, p in plans.items():
        assert p.phases[name] == p.params + p.optimizer + p.old_pass_activations + want[mode]
        # The blockwise-attention column: the same features on top of its own old pass.
        assert (p.phases_flash[name] - plans["device"].phases_flash[name]
                == want[mode] - want["device"]), mode
        # Only that phase depends on the cache mode.
        assert p.phases["rollout"] == plans["device"].phases["rollout"]
        assert p.phases["update"] == plans["device"].phases["update"]
        assert f"phase peaks per device (delta.feature_cache={mode})" in p.to_text()
    assert plans["device"].old_pass_activations == plans["host"].old_pass_activations

    # A device that fits the host mode's peak but not the device mode's: the host-configured
    # plan's phase line and its recommendation agree.
    host_peak = plans["host"].phases[name]
    tight = plan_with("host", memory_gb=(host_peak + 1) / plan.GB)
    assert tight.phases[name] == host_peak
    assert tight.feature_cache_fits == {"device": False, "host": True, "recompute": False}
    assert tight.recommended_feature_cache == "host"
    line = next(l for l in tight.to_text().splitlines()
                if l.strip().startswith(name))
    assert re.search(r" fits \(\d+%\)$", line.split("|")[0].rstrip()), line
    with pytest.raises(ValueError, match="delta.feature_cache"):
        plan_with("disk")


def test_plan_from_config_uses_delta_feature_cache():
    """From a run config (tiny model: 4 x 4 rows, 8 response tokens, hidden 32, one device):
    the host mode's peak is the device mode's minus the features of all but one 4-row chunk."""
    from tests.rl_fixtures import tiny_rl_config
    cfgs = {mode: tiny_rl_config("delta", delta=dict(feature_cache=mode, recompute_chunk=4))
            for mode in ("device", "host")}
    plans = {mode: plan.plan_from_config(c, mesh_shape=(1, 1, 1)) for mode, c in cfgs.items()}
    assert {m: p.settings["feature_cache"] for m, p in plans.items()} == {
        "device": "device", "host": "host"}
    peak = {m: p.phases["old-policy pass + DelTA"] for m, p in plans.items()}
    assert peak["device"] - peak["host"] == (16 - 4) * 8 * 32 * 2


def test_plan_from_config_counts_a_kl_reference():
    """rl.kl_coef > 0 keeps the reference policy resident (tiny model, full fine-tuning: a copy
    of every parameter); the plan's text names it."""
    from tests.rl_fixtures import tiny_rl_config
    off, on = (plan.plan_from_config(tiny_rl_config("grpo", rl=dict(kl_coef=kl)),
                                     mesh_shape=(1, 1, 1)) for kl in (0.0, 0.1))
    assert off.kl_reference == 0 and on.kl_reference == on.params > 0
    assert on.phases["update"] - off.phases["update"] == on.params


def test_plan_from_config_counts_an_offloaded_optimizer_state_in_the_update_only(tmp_path,
                                                                                 monkeypatch):
    """optim.offload: the optimizer state leaves the rollout and old-policy phases and stays in
    the update; the text says where it rests, and check_fits stops offering it once it is on. A
    backend without a pinned_host memory space refuses it at start-up, naming the field."""
    from delta_jax import sharding
    from delta_jax.train import run as run_lib
    from delta_jax.train.config import ConfigError
    from tests.rl_fixtures import tiny_rl_config

    off, on = (plan.plan_from_config(tiny_rl_config("delta", optim=dict(offload=o)),
                                     mesh_shape=(1, 1, 1)) for o in (False, True))
    assert on.optimizer == off.optimizer > 0
    assert {k: off.phases[k] - on.phases[k] for k in off.phases} == {
        "rollout": off.optimizer, "old-policy pass + DelTA": off.optimizer, "update": 0}
    assert "optim.offload" in on.to_text() and "optim.offload" not in off.to_text()
    with pytest.raises(ConfigError, match=r"optim\.offload=True") as err:
        plan.check_fits(off, 0, phases=["rollout"])
    with pytest.raises(ConfigError) as err:
        plan.check_fits(on, 0, phases=["rollout", "old-policy pass + DelTA"])
    assert "optim.offload" not in str(err.value)
    monkeypatch.setattr(sharding, "host_memory_kind_available", lambda device=None: False)
    with pytest.raises(ConfigError, match=r"^optim\.offload: the \w+ backend has no pinned_host"):
        run_lib.build_run(tiny_rl_config("dapo", optim=dict(offload=True)), str(tmp_path),
                          need_scorer=False)


def test_a_kv_budget_that_cannot_hold_one_sample_fails_before_anything_runs(tmp_path):
    """rollout.kv_budget_gb below one sample's pages: plan mode and build_run both stop with a
    ConfigError naming the field (the sampler would otherwise fail at its first call)."""
    from delta_jax.train import run as run_lib
    from delta_jax.train.config import ConfigError
    from tests.rl_fixtures import tiny_rl_config

    cfg = tiny_rl_config("dapo", rollout=dict(kv_budget_gb=1e-6))
    with pytest.raises(ConfigError, match=r"^rollout\.kv_budget_gb: .* needs \d+ "):
        plan.plan_from_config(cfg, mesh_shape=(1, 1, 1))
    with pytest.raises(ConfigError, match=r"^rollout\.kv_budget_gb"):
        run_lib.build_run(cfg, str(tmp_path), need_scorer=False)
    ok = tiny_rl_config("dapo", rollout=dict(kv_budget_gb=0.01))
    assert plan.plan_from_config(ok, mesh_shape=(1, 1, 1)).kv_cache <= 0.01 * 2**30


def test_check_fits_names_each_phase_over_the_device_and_its_knobs():
    """check_fits on a real plan: a capacity between the phases' peaks fails on exactly the phases
    above it, with planned and available GB and the fields that shrink each; the old-policy
    phase names the feature-cache mode the plan recommends; `phases` limits what is checked."""
    from delta_jax.train.config import ConfigError
    from tests.rl_fixtures import tiny_rl_config

    memory_plan = plan.plan_from_config(tiny_rl_config("delta"), mesh_shape=(1, 1, 1))
    peaks = memory_plan.phases
    plan.check_fits(memory_plan, max(peaks.values()))  # exactly enough: no error
    for name in peaks:
        below = peaks[name] - 1
        over = [n for n, v in peaks.items() if v > below]
        with pytest.raises(ConfigError, match=r"^plan\.check_memory: ") as err:
            plan.check_fits(memory_plan, below)
        text = str(err.value)
        for n in peaks:
            assert (f"phase '{n}' plans {peaks[n] / plan.GB:.2f} GB" in text) == (n in over), text
        for knob in plan.PHASE_KNOBS[name]:
            assert knob in text
        plan.check_fits(memory_plan, below, phases=[n for n in peaks if n not in over])
    # Already remat full (what auto falls back to): not offered again.
    full = plan.plan_from_config(tiny_rl_config("delta", model=dict(remat="full")),
                                 mesh_shape=(1, 1, 1))
    with pytest.raises(ConfigError, match=r"rl\.micro_batch_size, model\.logprob_chunk_tokens"):
        plan.check_fits(full, 0, phases=["update"])
    # A feature cache too big for the device: the plan's recommendation is named first.
    memory_plan.recommended_feature_cache = "recompute"
    with pytest.raises(ConfigError, match="delta.feature_cache=recompute .recommended"):
        plan.check_fits(memory_plan, 0, phases=["old-policy pass + DelTA"])
    assert plan.REPLICA_KNOB not in str(err.value)  # one device: nothing to shard over
    # A data-parallel mesh of several devices (a replica of the state on each): sharding the
    # state is named first, for every phase; not once fsdp or tensor shards it.
    for mesh_shape, named in (((4, 1, 1), True), ((2, 2, 1), False), ((2, 1, 2), False)):
        p = plan.plan_from_config(tiny_rl_config("delta"), mesh_shape=mesh_shape)
        with pytest.raises(ConfigError) as err:
            plan.check_fits(p, 0)
        text = str(err.value)
        assert text.count(plan.REPLICA_KNOB) == (len(p.phases) if named else 0), text
        if named:
            assert "; turn: mesh.data=1 mesh.fsdp=-1 (each device" in text
        hint = f"a phase does not fit: turn {plan.REPLICA_KNOB}"
        assert hint not in p.to_text()  # every phase fits the planned 80 GB
        p.settings["capacity_bytes"] = min(p.phases.values()) / 2  # none fits: plan mode says
        assert (hint in p.to_text()) == named


def test_build_run_stops_a_config_that_will_not_fit(tmp_path, monkeypatch):
    """train / eval / sft start-up: with the device's allocator limit below a phase's plan,
    build_run raises before anything compiles (train: every phase; eval: its evaluation; sft:
    its step);
    plan.check_memory=False skips the check. The CPU reports no limit, so nothing is checked
    there (the limit is monkeypatched to what a small GPU would say)."""
    from delta_jax.train import run as run_lib
    from delta_jax.train.config import ConfigError
    from tests.rl_fixtures import single_device_mesh, tiny_rl_config

    assert jax.default_backend() != "cpu" or plan.device_memory_bytes() is None
    cfg = tiny_rl_config("dapo")
    peaks = plan.plan_from_config(cfg, mesh_shape=(1, 1, 1)).phases
    limit = peaks["rollout"] + 1            # the rollout fits, the update does not
    assert peaks["update"] > limit
    monkeypatch.setattr(plan, "device_memory_bytes", lambda device=None: limit)
    mesh = single_device_mesh()
    with pytest.raises(ConfigError, match=r"phase 'update' plans .* rl\.micro_batch_size"):
        run_lib.build_run(cfg, str(tmp_path), need_scorer=False, mesh=mesh)
    model_cfg = plan.model_config_from_run_config(cfg)
    skip = tiny_rl_config("dapo", plan=dict(check_memory=False))
    run_lib.check_memory_plan(skip, model_cfg, mesh)
    # eval mode checks its evaluation's generation (eval.max_new_tokens), with the sampler.
    evaluate = tiny_rl_config("dapo", data=dict(eval="x"))
    evaluate.mode = "eval"                  # (eval's own validation wants benchmark files)
    eval_peak = plan.plan_from_config(evaluate, mesh_shape=(1, 1, 1)).phases["eval"]
    monkeypatch.setattr(plan, "device_memory_bytes", lambda device=None: eval_peak)
    run_lib.check_memory_plan(evaluate, model_cfg, mesh)
    monkeypatch.setattr(plan, "device_memory_bytes", lambda device=None: eval_peak - 1)
    with pytest.raises(ConfigError, match=r"phase 'eval' plans .* eval\.max_new_tokens"):
        run_lib.check_memory_plan(evaluate, model_cfg, mesh)
    # A warm start's step: in train mode beside the other phases, in mode=sft alone.
    warm = tiny_rl_config("dapo", sft=dict(steps=2, batch_size=64, max_len=512))
    warm_peaks = plan.plan_from_config(warm, mesh_shape=(1, 1, 1)).phases
    assert warm_peaks["sft"] > max(v for n, v in warm_peaks.items() if n != "sft")
    monkeypatch.setattr(plan, "device_memory_bytes", lambda device=None: warm_peaks["sft"] - 1)
    for mode in ("train", "sft"):
        warm.mode = mode
        with pytest.raises(ConfigError, match=r"this config will not fit: phase 'sft' plans .* "
                                              r"turn: sft\.micro_batch_size, sft\.batch_size"):
            run_lib.check_memory_plan(warm, model_cfg, mesh)


def test_start_up_warns_of_a_phase_in_the_last_5_percent(monkeypatch, caplog):
    """A phase planned over plan.TIGHT_FILL (95%) of the allocator's limit passes the start-up
    check with a warning naming it and its knobs (XLA may recompute to stay within the limit);
    at 90% nothing is said. plan.tight_phases picks those phases."""
    import logging

    from delta_jax.train import run as run_lib
    from tests.rl_fixtures import single_device_mesh, tiny_rl_config

    cfg = tiny_rl_config("dapo")
    model_cfg = plan.model_config_from_run_config(cfg)
    peaks = plan.plan_from_config(cfg, mesh_shape=(1, 1, 1), model_cfg=model_cfg).phases
    top = max(peaks, key=peaks.get)
    for share, warned in ((0.97, True), (0.90, False)):
        limit = peaks[top] / share
        assert (top in plan.tight_phases(plan.plan_from_config(
            cfg, mesh_shape=(1, 1, 1), model_cfg=model_cfg), limit)) == warned
        monkeypatch.setattr(plan, "device_memory_bytes", lambda device=None: limit)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
            run_lib.check_memory_plan(cfg, model_cfg, single_device_mesh())
        said = f"phase '{top}' plans" in caplog.text
        assert said == warned, caplog.text
        if warned:
            assert plan.PHASE_KNOBS[top][0] in caplog.text


# ----------------------------------------------------------------------------- compiled memory

def test_compiled_memory_bytes_of_known_programs():
    """kernels.timing.compiled_memory_bytes: f(x) = 2 x over f32[64, 32] with x donated has 8 KiB
    of arguments, 8 KiB of output and the output aliased to the argument; g(x) = column sums
    (not donated) 128 B of output and nothing aliased. The same figures from a jitted function
    with abstract arguments and from a Compiled."""
    from delta_jax.kernels import timing

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    f = jax.jit(lambda x: 2.0 * x, donate_argnums=0)
    got = timing.compiled_memory_bytes(f, x)
    assert got == timing.compiled_memory_bytes(f.lower(x).compile())
    assert got["backend"] == jax.default_backend()
    assert (got["argument_bytes"], got["output_bytes"], got["alias_bytes"]) == (8192, 8192, 8192)
    assert got["peak_estimate_bytes"] == 8192 + got["temp_bytes"]
    g = timing.compiled_memory_bytes(jax.jit(lambda x: jnp.sum(x, axis=0)), x)
    assert (g["argument_bytes"], g["output_bytes"], g["alias_bytes"]) == (8192, 128, 0)
    assert g["peak_estimate_bytes"] == 8192 + 128 + g["temp_bytes"]
    line = timing.format_compiled_memory("f", got, plan_bytes=2 * got["peak_estimate_bytes"])
    assert "plan / compiled 2.00" in line and f"[{jax.default_backend()}]" in line


def test_compiled_memory_without_an_analysis_says_so():
    from delta_jax.kernels import timing

    class NoAnalysis:
        def memory_analysis(self):
            return None

    got = timing.compiled_memory_bytes(NoAnalysis())
    assert "unavailable" in got
    assert "unavailable" in timing.format_compiled_memory("p", got, plan_bytes=1)


# ----------------------------------------------------------------------------- plan vs compiled

def _benchmark(name: str):
    """benchmarks/<name>.py as a module (its sibling modules importable): train_throughput's
    abstract-shape train step is the one the memory analysis of the benchmark compiles (the
    trainer's make_train_step); gpu_program's compile-only GPU device."""
    import importlib.util
    import pathlib
    folder = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Small float32 Qwen3-shaped models: q heads x head dim equal to the hidden size (S), twice it
# (W), a deeper, wider one with a bigger vocabulary (M), and a wide one with 128-wide heads (D).
GRID_MODELS = {
    "D": dict(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_layers=2,
              num_heads=8, num_kv_heads=4, head_dim=128),
    "S": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=32),
    "W": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=64),
    "M": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4,
              num_heads=8, num_kv_heads=4, head_dim=32),
}


# Grid points where the plan is known to miss XLA:CPU's figure by more than 15%, with the
# measured plan / compiled ratio. The old-policy pass of the wide model D at 8 x 512 tokens: XLA's
# live-range peak there is the attention's two live float32 [rows, heads, T, S] arrays (the
# scores and their masked copy, 64 MiB each) beside the layer's other buffers (150 MiB of
# temporaries live at once), and its heap packs the four score-sized values of the softmax chain
# (scores, masked, exp, transposed probabilities, each live beside the next) into two 64 MiB
# slots (158 MiB packed). At the same (rows, length) on S, W and M, whose other intermediates are
# smaller, the best-fit packing of the same chain takes three slots (M: 135 MiB live, 203 MiB
# packed; S: 68 / 102), and the plan's third score array follows those: three slots overshoot D
# by 34%, two would undershoot M, S and W by ~30%. Which layout the heap heuristic picks is not a
# function of the shapes the plan sees. (Fixed 2026-11-26 by modelling the buffers: full remat's
# MLP backward beside the recomputed attention's three score-sized arrays, D full 8 x 512:
# 0.78 -> 0.95; the old pass's sliced layer weights beside the rotated q / k, D 2 x 128: 0.77 ->
# 1.06, D 8 x 128: 0.82 -> 1.02.) Strict: a case that starts to agree fails until removed here.
KNOWN_MISSES = {
    ("old pass", "D", 8, 512): 1.34,
}


def _known_miss(request, key):
    if key in KNOWN_MISSES:
        request.applymarker(pytest.mark.xfail(
            strict=True, reason=f"plan / compiled measured {KNOWN_MISSES[key]} (> 15% off) "
                                f"for {key}; see KNOWN_MISSES"))


# The update grid is a half fraction of remat {none, full} x micro-batch {2, 8} x sequence
# {128, 512}: the points whose three +-1 levels multiply to +1 (defining relation I = ABC). Every
# model still sees each level of each factor twice, in half the compiles (~4.5 s each on the CI
# machine), and the widest point (full, 8, 512) stays in.
UPDATE_GRID = [("none", 2, 512, 384), ("none", 8, 128, 64), ("full", 2, 128, 64),
               ("full", 8, 512, 384)]


@pytest.mark.parametrize("remat,micro_batch,seq,response_len", UPDATE_GRID)
@pytest.mark.parametrize("model", sorted(GRID_MODELS))
@pytest.mark.usefixtures("on_cpu")  # XLA:CPU's figures, on any machine
def test_update_phase_agrees_with_the_compiled_train_step(model, remat, micro_batch, seq,
                                                          response_len, request):
    """Plan mode's "update" phase (one device, a mini-batch of two micro-batches) within 15% of
    XLA's memory analysis (arguments + outputs + temporaries - aliased) of the trainer's train
    step compiled from abstract shapes for the CPU (on_cpu: on a GPU machine too; XLA:GPU's
    figures come from the benchmarks). float32: XLA:CPU keeps a bfloat16 model's activations
    largely in float32, so a bfloat16 grid would measure the CPU's conversions rather than what
    a GPU holds."""
    mc = models.get_preset("tiny", **GRID_MODELS[model], dtype=jnp.float32,
                           param_dtype=jnp.float32, remat=remat, attention="auto")
    planned, compiled = _planned_and_compiled_update(mc, micro_batch, seq, response_len)
    _known_miss(request, ("update", model, remat, micro_batch, seq))
    assert abs(planned / compiled - 1) <= 0.15, (planned / 2**20, compiled / 2**20,
                                                 planned / compiled)


def _planned_and_compiled_update(mc, micro_batch, seq, response_len):
    """(plan mode's "update" phase, XLA's peak estimate of the compiled train step) in bytes for
    a mini-batch of two micro-batches of `micro_batch` rows on one device."""
    from delta_jax.kernels import timing

    tt = _benchmark("train_throughput")
    shape = dict(chunk=256, batch=2 * micro_batch, micro_batch=micro_batch, seq=seq,
                 response_len=response_len)
    step, state, batch = tt.abstract_step(mc, impl="chunked", **shape)
    compiled = timing.compiled_memory_bytes(step, state, batch)["peak_estimate_bytes"]
    return tt.plan_update_bytes(mc, **shape), compiled


@pytest.mark.usefixtures("on_cpu")  # XLA:CPU's figures, on any machine
def test_update_phase_agrees_with_the_compiled_train_step_with_lora():
    """The update test for a LoRA model (rank 8 on every projection): the adapters' gradients
    and optimizer state, the base weights frozen (measured 2026-11-25: plan / compiled 0.93 at
    this point, 0.95 at S remat none 8 x 128, left out for CI time)."""
    mc = models.get_preset("tiny", **GRID_MODELS["M"], dtype=jnp.float32,
                           param_dtype=jnp.float32, remat="full", attention="auto", lora_rank=8,
                           lora_targets=models.LORA_TARGETS)
    planned, compiled = _planned_and_compiled_update(mc, 2, 512, 384)
    assert abs(planned / compiled - 1) <= 0.15, (planned / 2**20, compiled / 2**20,
                                                 planned / compiled)


# The dots_* remat policies, with materialised scores ("xla") and with blockwise attention in
# 128-token blocks at 512 tokens (4 x 4 block pairs: the regime blockwise is for). Five of the ten
# points measured when the dots formulas were written (plan / XLA:CPU compiled, 2026-11-24,
# 0.97-1.10 at all ten; left out for CI time: D xla 8x512 0.993, M xla 2x512 1.028, D blockwise
# 2x512 1.021, S blockwise 2x512 1.089, W blockwise 8x512 1.101). Measured by hand then: 0.960-1.103
# at all 32 no-batch-dims points of {D, M, S, W} x micro {2, 8} x seq {128, 512} x {xla,
# blockwise}, 0.960-1.052 at 15 dots_saveable points (8 xla, 7 blockwise in 64- to 256-token
# blocks).
DOTS_GRID = [
    ("S", "dots_with_no_batch_dims_saveable", "xla", 8, 128, 64),         # 1.040
    ("W", "dots_with_no_batch_dims_saveable", "xla", 2, 512, 384),        # 0.971
    ("M", "dots_with_no_batch_dims_saveable", "blockwise", 8, 512, 384),  # 1.078
    ("S", "dots_saveable", "xla", 8, 512, 384),                           # 1.021
    ("M", "dots_saveable", "blockwise", 2, 512, 384),                     # 1.050
]


@pytest.mark.parametrize("model,remat,attention,micro_batch,seq,response_len", DOTS_GRID)
@pytest.mark.usefixtures("on_cpu")  # XLA:CPU's figures, on any machine
def test_update_phase_agrees_with_the_compiled_train_step_for_dots_remat(
        model, remat, attention, micro_batch, seq, response_len, request):
    """The update test for the dots_* remat policies (plan._layer_activation_bytes' dots_saved
    and batched_dots), with materialised and blockwise attention."""
    mc = models.get_preset("tiny", **GRID_MODELS[model], dtype=jnp.float32,
                           param_dtype=jnp.float32, remat=remat, attention=attention,
                           attention_block_q=128, attention_block_kv=128)
    planned, compiled = _planned_and_compiled_update(mc, micro_batch, seq, response_len)
    _known_miss(request, ("update", model, remat, micro_batch, seq, attention))
    assert abs(planned / compiled - 1) <= 0.15, (planned / 2**20, compiled / 2**20,
                                                 planned / compiled)


# Measured by hand on 2026-12-02 (plan / XLA:CPU compiled), rows x tokens (/ micro-batch): S none
# 4 x 128 0.932, W none 8 x 128 1.007, M none 2 x 512 0.961, S dots_with_no_batch_dims_saveable
# 8 x 512 0.986, S none 8 x 128 / 4 1.008, D full 8 x 512 / 2 0.964, W none 16 x 256 / 4 0.984,
# M dots_with_no_batch_dims_saveable 8 x 512 / 4 1.034, and the three below.
@pytest.mark.parametrize("model,remat,rows,micro,length", [("M", "full", 8, 0, 512),   # 1.010
                                                           ("D", "full", 2, 0, 512),   # 0.934
                                                           ("M", "full", 8, 2, 512)])  # 1.059
@pytest.mark.usefixtures("on_cpu")  # XLA:CPU's figures, on any machine
def test_sft_phase_agrees_with_the_compiled_sft_step(model, remat, rows, micro, length):
    """Plan mode's "sft" phase within 15% of XLA's memory analysis of the warm start's step
    (train.sft.make_sft_step: `rows` rows of `length` tokens, in one forward / backward or in
    micro-batches of `micro` rows, AdamW) compiled from abstract shapes; float32 as in the
    update test."""
    from delta_jax.kernels import timing
    from delta_jax.train import sft as sft_lib
    from delta_jax.train.state import init_train_state, make_optimizer

    mc = models.get_preset("tiny", **GRID_MODELS[model], dtype=jnp.float32,
                           param_dtype=jnp.float32, remat=remat, attention="auto")
    graphdef, params, rest = nnx.split(
        nnx.eval_shape(lambda: models.Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
    optimizer = make_optimizer(optax.constant_schedule(1e-4))
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer), params)
    step = sft_lib.make_sft_step(graphdef, rest, optimizer, chunk_size=256,
                                 micro_batch_size=micro)
    batch = {"input_ids": jax.ShapeDtypeStruct((rows, length), jnp.int32),
             "attention_mask": jax.ShapeDtypeStruct((rows, length), jnp.int32),
             "loss_mask": jax.ShapeDtypeStruct((rows, length), jnp.float32)}
    compiled = timing.compiled_memory_bytes(step, state, batch)["peak_estimate_bytes"]
    planned = plan.plan_memory(mc, mesh_shape=(1, 1, 1), device_memory_gb=80.0, rollout_rows=4,
                               prompt_len=64, response_len=64, sampler_rows=4, group_size=1,
                               mini_batch_rows=4, micro_batch_rows=0, logprob_chunk_tokens=256,
                               recompute_chunk=4, sft_rows=rows, sft_len=length,
                               sft_micro_rows=micro).phases["sft"]
    assert abs(planned / compiled - 1) <= 0.15, (planned / 2**20, compiled / 2**20,
                                                 planned / compiled)


@pytest.mark.parametrize("seq,response_len", [(128, 64), (512, 384)])
@pytest.mark.parametrize("rows", [2, 8])
@pytest.mark.parametrize("model", sorted(GRID_MODELS))
@pytest.mark.usefixtures("on_cpu")  # XLA:CPU's figures, on any machine
def test_old_pass_phase_agrees_with_the_compiled_old_policy_pass(model, rows, seq,
                                                                 response_len, request):
    """Plan mode's "old-policy pass + DelTA" phase less the optimizer state (which lies beside
    the pass on the device but is no argument of it) within 15% of XLA's memory analysis of the
    trainer's old-policy pass (train.features.make_old_policy_pass: parameters in, log-probs,
    entropies and the bf16 DelTA features of every row out) over one sampler chunk of `rows`
    rows, compiled from abstract shapes; float32 as in the update test."""
    from delta_jax.kernels import timing
    from delta_jax.train.features import make_old_policy_pass

    mc = models.get_preset("tiny", **GRID_MODELS[model], dtype=jnp.float32,
                           param_dtype=jnp.float32, attention="auto")
    graphdef, params, rest = split_model(
        nnx.eval_shape(lambda: models.Transformer(mc, rngs=nnx.Rngs(0))))
    old_pass = make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=256)
    ids = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    compiled = timing.compiled_memory_bytes(old_pass, params, ids, ids,
                                            response_len)["peak_estimate_bytes"]
    p = plan.plan_memory(mc, mesh_shape=(1, 1, 1), device_memory_gb=80.0, rollout_rows=rows,
                         prompt_len=seq - response_len, response_len=response_len,
                         sampler_rows=rows, group_size=1, mini_batch_rows=rows,
                         micro_batch_rows=0, logprob_chunk_tokens=256, recompute_chunk=rows)
    planned = p.phases["old-policy pass + DelTA"] - p.optimizer
    _known_miss(request, ("old pass", model, rows, seq))
    assert abs(planned / compiled - 1) <= 0.15, (planned / 2**20, compiled / 2**20,
                                                 planned / compiled)


# Two points (each compiles a decode loop, ~15-30 s on the CI machine): one where the decode
# program peaks, one where the prefill does. Measured by hand on 2026-11-23 at more points: D 4 x
# 64 + 64: 0.999, D 16 x 256 + 256: 0.891, M 16 x 256 + 256: 0.994, M 64 x 128 + 128: 0.915.
@pytest.mark.parametrize("model,slots,group,prompt_len,response_len", [
    ("M", 4, 2, 64, 64),        # the decode program peaks (its copy of the layer weights)
    ("S", 16, 1, 512, 64),      # the prefill peaks (materialised attention scores)
])
@pytest.mark.usefixtures("on_cpu")  # XLA:CPU's figures, on any machine
def test_rollout_phase_agrees_with_the_compiled_sampler_programs(model, slots, group, prompt_len,
                                                                 response_len):
    """Plan mode's "rollout" phase less the optimizer state within 15% of the larger of XLA's
    memory analyses of the rollout engine's two big programs (sampling.programs.prefill of the
    prompts of `slots` samples, and decode of `slots` slots for 32 steps, both taking the layer
    weights' copy), each compiled from abstract shapes with the worst-case page
    pool of sampling.plan_kv (16-token pages), as the sampler calls them; float32 as in the
    update test."""
    from delta_jax.kernels import timing
    from delta_jax.sampling import bucket_size, plan_kv, programs

    mc = models.get_preset("tiny", **GRID_MODELS[model], dtype=jnp.float32,
                           param_dtype=jnp.float32, attention="auto")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: models.Transformer(mc, rngs=nnx.Rngs(0))))
    kv = plan_kv(mc, slots=slots, prompt_len=prompt_len, max_new_tokens=response_len,
                 page_size=16)
    pool = jax.ShapeDtypeStruct((mc.num_kv_heads, kv.num_pages, 16, mc.head_dim), jnp.float32)
    cache = models.PagedKVCache(k=(pool,) * mc.num_layers, v=(pool,) * mc.num_layers)

    def ints(*shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype)

    # The layer weights' copy (programs.decode_layers) lives for the whole generate(): an
    # argument of decode and of the prefill, which leave the stacked layer weights unused (jit
    # prunes them from their arguments) while they stay resident.
    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    layers = jax.eval_shape(programs.decode_layers, graphdef, state)
    stacked_bytes = nbytes(state["layers"])
    decode = timing.compiled_memory_bytes(
        programs.decode, *abstract_decode_args(graphdef, state, cache, slots, kv.pages_per_seq,
                                               queued=max(1, slots // 4)),
        num_steps=32, top_k=-1, use_top_p=False, greedy=False, attention_impl="reference",
        pages_per_block=8)
    rows, length = max(1, slots // group), bucket_size(prompt_len, 16)
    prefill = timing.compiled_memory_bytes(programs.prefill, graphdef, state, layers, cache,
                                           *(ints(rows, length),) * 4)
    compiled = max(decode["peak_estimate_bytes"], prefill["peak_estimate_bytes"]) + stacked_bytes
    p = plan.plan_memory(mc, mesh_shape=(1, 1, 1), device_memory_gb=80.0, rollout_rows=slots,
                         prompt_len=prompt_len, response_len=response_len, sampler_rows=slots,
                         group_size=group, mini_batch_rows=slots, micro_batch_rows=0,
                         logprob_chunk_tokens=256, recompute_chunk=slots, page_size=16)
    planned = p.phases["rollout"] - p.optimizer
    assert abs(planned / compiled - 1) <= 0.15, (planned / 2**20, compiled / 2**20,
                                                 planned / compiled)


# ----------------------------------------------------------------------------- remat auto


def _update_by_policy(cfg, policies=plan.AUTO_REMAT_ORDER):
    mc = plan.model_config_from_run_config(cfg, remat="full")
    return {p: plan.plan_from_config(cfg, mesh_shape=(1, 1, 1), model_cfg=mc.replace(remat=p)
                                     ).phases["update"] for p in policies}


def test_choose_remat_takes_the_least_recompute_policy_that_fits(monkeypatch):
    """model.remat=auto off CUDA: at each capacity, the first of none /
    dots_with_no_batch_dims_saveable / full whose planned update is within AUTO_REMAT_FILL of it
    (the plan of that policy, computed here on its own), with what it tried; full when nothing
    fits, which check_fits then reports like a configured policy. (Planned as off CUDA on any
    backend, so that it holds on a GPU too; CUDA's order is the next test's.)"""
    from delta_jax.models import attention
    from tests.rl_fixtures import tiny_rl_config
    monkeypatch.setattr(attention, "_cuda_backend", lambda: False)
    cfg = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32))
    assert cfg.model.remat == "auto"  # the default
    update = _update_by_policy(cfg)
    order = list(plan.AUTO_REMAT_ORDER)
    assert order == ["none", "dots_with_no_batch_dims_saveable", "full"]
    # Less recomputation keeps more: the order is only worth following if the plans fall.
    assert update["none"] > update["dots_with_no_batch_dims_saveable"] > update["full"]
    fill = plan.AUTO_REMAT_FILL
    for i, policy in enumerate(order):
        enough = update[policy] / fill
        got, tried = plan.choose_remat(cfg, enough, mesh_shape=(1, 1, 1))
        assert got == policy and tried == {p: update[p] for p in order[:i + 1]}
        if i + 1 < len(order):  # a byte less than this policy needs: the next one
            assert plan.choose_remat(cfg, enough - 1, mesh_shape=(1, 1, 1))[0] == order[i + 1]
    got, tried = plan.choose_remat(cfg, 0, mesh_shape=(1, 1, 1))
    assert got == "full" and tried == update
    # Plan mode resolves it against plan.device_memory_gb and says so.
    capacity_gb = update["dots_with_no_batch_dims_saveable"] / fill / plan.GB
    small = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32),
                           plan=dict(device_memory_gb=capacity_gb, num_devices=1))
    p = plan.plan_from_config(small)
    assert p.settings["remat"] == "dots_with_no_batch_dims_saveable"
    assert p.phases["update"] == update["dots_with_no_batch_dims_saveable"]
    assert p.settings["remat_auto"] == {k: update[k] for k in order[:2]}
    assert "remat=auto -> dots_with_no_batch_dims_saveable (planned update" in p.to_text()
    # A configured policy is planned as it is, auto's line absent.
    fixed = plan.plan_from_config(tiny_rl_config("dapo", model=dict(remat="none"),
                                                 rollout=dict(max_new_tokens=32)),
                                  mesh_shape=(1, 1, 1))
    assert fixed.phases["update"] == update["none"] and "remat=auto" not in fixed.to_text()
    # The ModelConfig a run config describes carries what plan mode picks.
    assert plan.model_config_from_run_config(small).remat == "dots_with_no_batch_dims_saveable"


def test_choose_remat_counts_the_warm_start_step(monkeypatch):
    """With a warm start whose step (sft.batch_size x sft.max_len) needs more than the RL
    update, model.remat=auto judges each policy by the larger of the two: a capacity where
    "none" fits the update alone but not the warm start takes the next policy."""
    from delta_jax.models import attention
    from tests.rl_fixtures import tiny_rl_config
    monkeypatch.setattr(attention, "_cuda_backend", lambda: False)
    cfg = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32),
                         sft=dict(steps=2, batch_size=32, max_len=256))
    mc = plan.model_config_from_run_config(cfg, remat="full")
    by_policy = {p: plan.plan_from_config(cfg, mesh_shape=(1, 1, 1),
                                          model_cfg=mc.replace(remat=p)).phases
                 for p in plan.AUTO_REMAT_ORDER}
    assert by_policy["none"]["sft"] > by_policy["none"]["update"]
    enough_for_update = by_policy["none"]["update"] / plan.AUTO_REMAT_FILL
    got, tried = plan.choose_remat(cfg, enough_for_update, mesh_shape=(1, 1, 1))
    assert got != "none" and tried["none"] == by_policy["none"]["sft"]
    without = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32))
    assert plan.choose_remat(without, enough_for_update, mesh_shape=(1, 1, 1))[0] == "none"


def test_choose_remat_on_cuda_starts_from_dots_with_no_batch_dims_saveable(monkeypatch):
    """On a CUDA GPU model.remat=auto never tries "none" (measured slower than
    dots_with_no_batch_dims_saveable there, plan.AUTO_REMAT_ORDER_CUDA): with room for
    everything it picks dots_with_no_batch_dims_saveable, below that full; for plan.target
    "cuda" from this CPU, and for "" where the backend is CUDA."""
    from delta_jax.models import attention
    from tests.rl_fixtures import tiny_rl_config
    cfg = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32))
    dots = "dots_with_no_batch_dims_saveable"
    assert plan.auto_remat_order("cpu") == plan.AUTO_REMAT_ORDER
    assert plan.auto_remat_order("cuda") == (dots, "full")
    mc = plan.model_config_from_run_config(cfg, remat="full")
    want = {p: plan.plan_from_config(cfg, mesh_shape=(1, 1, 1), model_cfg=mc.replace(remat=p),
                                     target="cuda").phases["update"] for p in (dots, "full")}
    fill = plan.AUTO_REMAT_FILL
    got, tried = plan.choose_remat(cfg, 1e15, mesh_shape=(1, 1, 1), target="cuda")
    assert got == dots and tried == {dots: want[dots]}
    got, tried = plan.choose_remat(cfg, want[dots] / fill - 1, mesh_shape=(1, 1, 1),
                                   target="cuda")
    assert got == "full" and tried == want
    # "" follows the backend it runs on (what train start-up passes).
    monkeypatch.setattr(attention, "_cuda_backend", lambda: False)
    assert plan.auto_remat_order("") == plan.AUTO_REMAT_ORDER
    monkeypatch.setattr(attention, "_cuda_backend", lambda: True)
    assert plan.auto_remat_order("") == (dots, "full")
    assert plan.choose_remat(cfg, 1e15, mesh_shape=(1, 1, 1))[0] == dots


def test_choose_remat_on_a_tpu_leaves_out_none(monkeypatch):
    """On a TPU model.remat=auto never tries "none" (the plan under-counts it there by more than
    AUTO_REMAT_FILL's margin, plan.AUTO_REMAT_ORDER_TPU): with room for everything it picks
    dots_with_no_batch_dims_saveable; for plan.target "tpu" from this CPU, and for "" where the
    backend is a TPU."""
    from delta_jax.models import attention
    from tests.rl_fixtures import tiny_rl_config
    cfg = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32))
    dots = "dots_with_no_batch_dims_saveable"
    assert plan.auto_remat_order("tpu") == (dots, "full")
    got, tried = plan.choose_remat(cfg, 1e15, mesh_shape=(1, 1, 1), target="tpu")
    assert got == dots and list(tried) == [dots]
    monkeypatch.setattr(attention, "_cuda_backend", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert plan.auto_remat_order("") == (dots, "full")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert plan.auto_remat_order("")[0] == "none"


# ----------------------------------------------------------------------------- an H100's compile

def test_prefill_cap_is_the_samplers():
    """The rows of one prefill call that plan mode counts are the sampler's own
    (sampling.prefill_rows_per_shard, which Sampler._prefill_cap is): at most slots / n prompts
    and ~MAX_PREFILL_TOKENS tokens, a power of two, per batch shard."""
    from delta_jax.sampling import prefill_rows_per_shard
    from delta_jax.sampling.scheduler import MAX_PREFILL_TOKENS
    assert MAX_PREFILL_TOKENS == 32768
    assert [prefill_rows_per_shard(256, 16, 2048), prefill_rows_per_shard(256, 1, 512),
            prefill_rows_per_shard(64, 1, 2048), prefill_rows_per_shard(256, 16, 2048, 8),
            prefill_rows_per_shard(48, 1, 512), prefill_rows_per_shard(4, 8, 64)] == \
        [16, 64, 16, 2, 32, 1]


def test_rollout_prefill_is_one_layers_forward():
    """The "rollout" phase's prefill term: one layer's forward (plan.forward_layer_peak) for one
    prefill call of the sampler, whose layers write their keys and values into the pages as
    they go (Transformer.prefill_paged): known answer for Qwen3-0.6B in bf16, 64 prompts of 512
    + 1 tokens (width 512) on a CUDA target, where cuDNN keeps no scores, the prompts'
    right-padded rows are not permuted (no copies of q, k, v or the output) and the layer's MLP
    peaks; the same at any number of layers."""
    mc = models.get_preset("qwen3-0.6b", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

    def prefill(cfg):
        return plan.plan_memory(
            cfg, mesh_shape=(1, 1, 1), device_memory_gb=80.0, rollout_rows=64, prompt_len=513,
            response_len=1024, sampler_rows=64, group_size=1, mini_batch_rows=64,
            micro_batch_rows=0, logprob_chunk_tokens=256, recompute_chunk=64,
            target="cuda").prefill

    layer = plan._layer_activation_bytes(mc, 64, 512, 1, "cudnn", backward=False)
    assert layer["mlp"] == 64 * 512 * 2 * (3 * 3072 + 2 * 1024) and layer["attn_transient"] == 0
    assert prefill(mc) == plan.forward_layer_peak(layer) == layer["mlp"]
    assert prefill(mc.replace(num_layers=14)) == prefill(mc)


def test_rollout_prefill_counts_resumed_samples_where_the_pool_can_run_dry():
    """With a KV budget below the worst case, preempted samples resume after a prefill of their
    prompt and tokens (rollout.resume_preempted): the prefill term is the larger of the prompts'
    call and such a call (scheduler.widest_resume_prefill wide, prefill_rows_per_shard rows of
    one sample). Known answers for Qwen3-0.6B on a CUDA target (cuDNN attention): 16 slots
    of 4 samples a prompt, prompts of 512 + 1 tokens (4 rows x 512 a call), 1,024 new tokens:
    resumed rows up to 2,048 wide, 16 a call; 40,000 new tokens: one row of 32,768
    (MAX_PREFILL_TOKENS; longer samples restart). Without a budget, or with resumes off: the
    prompts' call."""
    from delta_jax.sampling import prefill_rows_per_shard, widest_resume_prefill
    mc = models.get_preset("qwen3-0.6b", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    def budget(response_len):  # room for about two samples; the worst case is 16
        return 2 * (-(-(513 + response_len) // 32) + 1) * models.page_bytes(mc, 32)

    def prefill(response_len=1024, **kw):
        return plan.plan_memory(
            mc, mesh_shape=(1, 1, 1), device_memory_gb=80.0, rollout_rows=16, prompt_len=513,
            response_len=response_len, sampler_rows=16, group_size=4, mini_batch_rows=16,
            micro_batch_rows=0, logprob_chunk_tokens=256, recompute_chunk=16,
            target="cuda", **kw).prefill

    def peak(rows, width):
        return plan.forward_layer_peak(
            plan._layer_activation_bytes(mc, rows, width, 1, "cudnn", backward=False))

    assert prefill_rows_per_shard(16, 4, 512) == 4
    assert widest_resume_prefill(512 + 1024 - 1) == 2048
    assert prefill_rows_per_shard(16, 1, 2048) == 16
    assert widest_resume_prefill(512 + 40000 - 1) == 32768
    assert prefill_rows_per_shard(16, 1, 32768) == 1
    prompts = peak(4, 512)
    assert prefill() == prefill(kv_budget_bytes=budget(1024), resume_preempted=False) == prompts
    assert prefill(kv_budget_bytes=budget(1024)) == peak(16, 2048) > 10 * prompts
    assert prefill(40000, kv_budget_bytes=budget(40000)) == peak(1, 32768) > 10 * prompts
    assert prefill(40000) == prompts


def test_prefill_and_old_pass_plans_agree_with_an_h100_compile():
    """With the CUDA plugin and cuDNN (`COMPILE_CUDNN=1 bash scripts/gpu_jax_check.sh --compile
    -m pytest tests/test_plan.py -k h100`; skipped elsewhere): the sampler's prefill and the
    trainer's old-policy pass compiled for an H100 without one (benchmarks/gpu_program.py's
    compile-only device, cuDNN attention), Qwen3-0.6B in bf16: plan mode's prefill term within
    15% of the prefill's temporaries and its "old-policy pass + DelTA" phase (less the
    optimizer) within 15% of the pass's peak. (Measured 2026-11-27: prefill 0.92-1.10 at
    512-32,768 tokens, the old pass 1.01-1.04 at 64 x 1,536, 16 x 2,560 and 8 x 4,096; before
    cuDNN's forward was counted as keeping no scores, the old pass up to 1.48. 2026-11-28, no
    rows permuted in a layer any more: the prefill 0.88 at 16 x 512 and 4 x 2,048 (200 MiB
    compiled), the old pass 1.10 at 64 x 1,536 (3,067 MiB) and 1.06 at 16 x 2,560.)"""
    pytest.importorskip("jax_plugins.xla_cuda12")
    from delta_jax.kernels import timing
    from delta_jax.sampling import programs
    from delta_jax.train.features import make_old_policy_pass
    gpu_program = _benchmark("gpu_program")
    device = gpu_program.compile_only_device("h100", gpu_program.CUDNN_VERSION,
                                             gpu_program.CUDA_VERSION)
    placed = jax.sharding.SingleDeviceSharding(device)
    mc = models.get_preset("qwen3-0.6b", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

    def planned(rows, prompt_len, response_len):
        return plan.plan_memory(
            mc, mesh_shape=(1, 1, 1), device_memory_gb=80.0, rollout_rows=rows,
            prompt_len=prompt_len, response_len=response_len, sampler_rows=rows, group_size=1,
            mini_batch_rows=rows, micro_batch_rows=0, logprob_chunk_tokens=256,
            recompute_chunk=rows, target="cuda")

    with jax.default_device(device):
        graphdef, params, rest = split_model(
            nnx.eval_shape(lambda: models.Transformer(mc, rngs=nnx.Rngs(0))))
        state = nnx.split(nnx.eval_shape(lambda: models.Transformer(mc, rngs=nnx.Rngs(0))))[1]
        layers = timing.abstract_like(jax.eval_shape(programs.decode_layers, graphdef, state),
                                      placed)
        for rows, width in ((16, 512), (4, 2048)):
            cache = timing.abstract_like(jax.eval_shape(lambda: models.init_paged_cache(
                mc, 1 + rows * width // 32, 32)), placed)
            ints = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=placed)
            try:
                compiled = programs.prefill.lower(graphdef, timing.abstract_like(state, placed),
                                                  layers, cache, ints, ints, ints, ints).compile()
            except RuntimeError as e:  # jax asks the cuDNN library's version: COMPILE_CUDNN=1
                pytest.skip(f"no cuDNN to compile the prefill's attention with: {e}")
            temp = timing.compiled_memory_bytes(compiled)["temp_bytes"]
            ratio = planned(rows, width + 1, 1024).prefill / temp
            print(f"prefill {rows} x {width}: temporaries {temp / 2**20:.1f} MiB, "
                  f"plan / compiled {ratio:.3f}")  # (pytest -s shows the figures)
            assert abs(ratio - 1) <= 0.15, (rows, width, ratio)
        old = make_old_policy_pass(graphdef, rest, temperature=1.0, chunk_size=256)
        for rows, seq, response_len in ((64, 1536, 1024), (16, 2560, 2048)):
            ids = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=placed)
            peak = timing.compiled_memory_bytes(old.lower(
                timing.abstract_like(params, placed), ids, ids, response_len).compile())
            p = planned(rows, seq - response_len, response_len)
            ratio = (p.phases["old-policy pass + DelTA"] - p.optimizer) / peak["peak_estimate_bytes"]
            print(f"old pass {rows} x {seq}: peak {peak['peak_estimate_bytes'] / 2**20:.1f} MiB "
                  f"(temporaries {peak['temp_bytes'] / 2**20:.1f} MiB), plan / compiled "
                  f"{ratio:.3f}")
            assert abs(ratio - 1) <= 0.15, (rows, seq, ratio)
