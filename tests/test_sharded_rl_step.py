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
two AdamW updates of lr 1e-3: atol 2e-5, i.e. 2% of one update step. Adam's eps is 1e-4 here, not
the default 1e-8: Adam divides each coordinate's moment by its own root mean square, so where a
first update's gradient is at the level of the layouts' rounding differences (one k_proj weight
had ~4e-8 against gradients up to ~3e-2) a 1e-8 eps turns that rounding into a step of up to
the learning rate in either direction. Seen on an AVX2 CPU (2026-11-29): every sharded layout
moved that weight 3.5e-5 to 4.3e-5 away from the one-device run, 9e-5 in a standalone rerun,
while each layout's gradients agreed to 2e-4 of their scale; with eps 1e-4 no coordinate's
step responds to a gradient difference by more than 1 / eps, and the parameters agree to ~1e-6.
Adam's moments (the gradients' running mean and mean square) are compared too, against each
tensor's largest entry: rtol 2e-4 (measured 2e-5 / 3e-5). Adam's normalisation and global-norm
clipping hide a uniform gradient scale from the parameters, so the step's metrics policy/grad_norm
(rtol 1e-4; measured 4e-7) and policy/loss are compared too: the loss, a sum of signed terms, at
rtol 1e-4 plus what the token weights' differences explain (_loss_change_from_weights; measured:
up to 8e-6 of the loss on an AVX-512 CPU, 1.5e-4 on an AVX2 one).
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
        optim=dict(weight_decay=0.0, eps=1e-4))  # eps: see the module docstring


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
                "advantages": np.asarray(batch["advantages"]),
                "response_mask": np.asarray(batch["response_mask"]),
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
    ref_o = _named_leaves(jax.device_get(ref["state"].opt_state))
    got_o = _named_leaves(jax.device_get(got["state"].opt_state))
    moments = [k for k in ref_o if "/mu/" in k or "/nu/" in k]
    assert len(moments) == 2 * len(ref_p), sorted(ref_o)
    for name in moments:
        scale = float(np.abs(ref_o[name]).max())
        np.testing.assert_allclose(got_o[name], ref_o[name], atol=2e-4 * scale, err_msg=name)
    # AdamW and global-norm clipping hide a uniform gradient (or loss) scale from the
    # parameters; the step's loss and gradient norm do not.
    np.testing.assert_allclose(float(got["metrics"]["policy/grad_norm"]),
                               float(ref["metrics"]["policy/grad_norm"]), rtol=1e-4)
    loss, ref_loss = float(got["metrics"]["policy/loss"]), float(ref["metrics"]["policy/loss"])
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss) + _loss_change_from_weights(got, ref), (
        loss, ref_loss)


def _loss_change_from_weights(got, ref) -> float:
    """How far the token weights' differences between two runs (compared above at atol 1e-4) can
    move the step's policy/loss: the loss of an update is sum_t w_t l_t / (the update's tokens),
    with l_t = -A_t r_t and r_t within the clip range (1 + rl.eps_high) at most, and the metric
    is the mean over the step's updates of equal token counts, i.e. sum_t w_t l_t / (all
    tokens). The loss is a sum of signed terms (0.0037 against |l_t| ~ 1 here), so a weight
    change of 4e-5 on a tenth of the tokens moves it by ~1e-4 of itself (measured on an AVX2 CPU,
    2026-11-29: 1.4e-4), which the weights' own tolerance already allows."""
    adv = got["advantages"] if got["advantages"].ndim == 2 else got["advantages"][:, None]
    mask = got["response_mask"]
    moved = np.abs(got["weights"] - ref["weights"]) * np.abs(adv) * mask
    return float(moved.sum()) * (1 + make_config().rl.eps_high) / float(mask.sum())


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
