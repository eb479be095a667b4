"""A full RL step (rollout -> rewards -> advantages -> old-policy pass -> DelTA -> mini-batch
updates, i.e. delta_jax.train.rl_step.rl_step) on 8 simulated CPU devices with the meshes
(data, fsdp, tensor) = (8,1,1), (2,4,1), (1,4,2), (2,2,2) gives the one-device results, and the
parameters and optimizer moments are really placed as the sharding rules say.

Kept cheap: one tiny model (2 layers, width 32), 4 prompts x 4 samples, 8 new tokens, one step per
mesh, one shared workdir (the synthetic data and tokenizer are made once). Rewards come from a
deterministic stand-in scorer over the response text, so groups have reward variance and the
update is not trivially zero (the real math grader is tested elsewhere).

Tolerances: rewards and the sampled rows must be identical (same random streams; fp32 logits
differ by ~1e-6 between layouts, far from flipping a draw). DelTA weights: atol 1e-4 (fp32
reductions in another order; the features are stored in bf16 on every layout). Parameters after
one AdamW update of lr 1e-3: atol 2e-5, i.e. 2% of one update step; Adam normalises each
coordinate, so that bound is what a layout change may move any weight. Adam's normalisation and
global-norm clipping also hide a uniform gradient scale from the parameters, so the step's metrics
policy/loss and policy/grad_norm are compared too: rtol 1e-4 (measured: up to 8e-6 for the loss,
a sum of signed terms, and 4e-7 for the gradient norm).
"""
import jax
import numpy as np
import pytest

from delta_jax import sharding
from delta_jax.train import rl_step as rl_step_lib
from tests.rl_fixtures import (build_scored_run, device_bytes, initial_state, single_device_mesh,
                               tiny_rl_config, tree_max_abs_diff)

MESHES = [(8, 1, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2)]


def make_config():
    return tiny_rl_config(
        "delta",
        model=dict(num_heads=4, num_kv_heads=2, logprob_chunk_tokens=64),
        rl=dict(mini_batch_prompts=2,    # 2 updates of 8 rows
                micro_batch_size=4),     # 2 micro-batches per update
        optim=dict(weight_decay=0.0))


def one_step(cfg, workdir, mesh):
    run = build_scored_run(cfg, workdir, mesh)
    try:
        state = initial_state(run)
        params_before = jax.device_get(state.params)  # the step donates the state
        out = rl_step_lib.rl_step(run, state, 1)
        batch = jax.device_get(out.batch)
        return {"rewards": out.prepared.rollout.rewards,
                "input_ids": np.asarray(batch["input_ids"]),
                "weights": np.asarray(batch["token_weights"]),
                "old_logp": np.asarray(batch["old_logp"]),
                "params": jax.device_get(out.state.params),
                "params_before": params_before,
                "state": out.state, "metrics": out.metrics}
    finally:
        run.close()


pytestmark = pytest.mark.devices(8)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cfg = make_config()
    workdir = tmp_path_factory.mktemp("sharded_rl")
    out = {"single": one_step(cfg, workdir, single_device_mesh())}
    for shape in MESHES:
        out[shape] = one_step(cfg, workdir, sharding.make_mesh(*shape))
    return out


def expected_shard_shape(path, shape, data, fsdp, tensor):
    """Hand-written placement of each parameter (independent of the rules code): hidden side
    over fsdp, heads / mlp / vocab side over tensor, layers and norms replicated."""
    name = path.split("/")[-1]
    div = {
        "embed": (tensor, fsdp), "lm_head": (fsdp, tensor), "final_norm": (1,),
        "q_proj": (1, fsdp, tensor, 1), "k_proj": (1, fsdp, tensor, 1),
        "v_proj": (1, fsdp, tensor, 1), "o_proj": (1, tensor, 1, fsdp),
        "gate_proj": (1, fsdp, tensor), "up_proj": (1, fsdp, tensor),
        "down_proj": (1, tensor, fsdp),
        "input_norm": (1, 1), "post_attn_norm": (1, 1), "q_norm": (1, 1), "k_norm": (1, 1),
    }[name]
    return tuple(s // d for s, d in zip(shape, div))


def _named_leaves(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/").removesuffix("/value"): x
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_single_device_step_learns_something(results):
    ref = results["single"]
    assert 0 < ref["rewards"].mean() < 1, "the stand-in rewards should vary"
    moved = tree_max_abs_diff(ref["params"], ref["params_before"])
    assert moved > 1e-4, "the update changed nothing; the comparison would be vacuous"
    assert ref["metrics"]["policy/skipped_updates"] == 0


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_step_equals_single_device(results, shape):
    ref, got = results["single"], results[shape]
    np.testing.assert_array_equal(got["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(got["rewards"], ref["rewards"])
    np.testing.assert_allclose(got["old_logp"], ref["old_logp"], atol=1e-4)
    np.testing.assert_allclose(got["weights"], ref["weights"], atol=1e-4)
    ref_p, got_p = _named_leaves(ref["params"]), _named_leaves(got["params"])
    assert ref_p.keys() == got_p.keys()
    for name in ref_p:
        np.testing.assert_allclose(got_p[name], ref_p[name], atol=2e-5, err_msg=name)
    # AdamW and global-norm clipping hide a uniform gradient (or loss) scale from the
    # parameters; the step's loss and gradient norm do not.
    for key in ("policy/loss", "policy/grad_norm"):
        np.testing.assert_allclose(float(got["metrics"][key]), float(ref["metrics"][key]),
                                   rtol=1e-4, err_msg=key)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_parameters_and_moments_are_sharded_by_the_rules(results, shape):
    state = results[shape]["state"]
    params = _named_leaves(state.params)
    for name, x in params.items():
        assert len(x.sharding.device_set) == 8, name
        assert x.sharding.shard_shape(x.shape) == expected_shard_shape(name, x.shape, *shape), (
            name, x.sharding)
    # Adam's moments mirror the parameters (same names, same placement).
    moments = {k: v for k, v in _named_leaves(state.opt_state).items() if "/mu/" in k}
    assert len(moments) == len(params)
    for name, x in moments.items():
        pname = name.split("/mu/")[1]
        assert x.sharding.shard_shape(x.shape) == params[pname].sharding.shard_shape(x.shape)
    if shape[1] * shape[2] > 1:  # something is split: device 0 holds less than everything
        total = sum(x.nbytes for x in params.values())
        assert device_bytes(state.params) < total
