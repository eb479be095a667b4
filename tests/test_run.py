"""delta_jax.train.run: what build_run wires from a config."""
import jax
import jax.numpy as jnp
import pytest

from delta_jax.train import run as run_lib
from tests.rl_fixtures import build_scored_run, tiny_rl_config


@pytest.mark.parametrize("method,delta,hidden_out", [
    ("dapo", {}, False),
    ("grpo", {}, False),
    ("delta", dict(feature_cache="recompute"), False),
    ("delta", dict(proxy="hidden_topk", topk=4), False),
    ("delta", dict(feature_cache="device"), True),
    ("delta", dict(feature_cache="host"), True),
])
def test_old_policy_pass_returns_h_only_when_delta_reads_it(tmp_path, method, delta, hidden_out):
    """The old-policy pass's [rows, R, H] hidden states leave the program only when DelTA reads
    them from it: not for grpo / dapo, the recompute cache (the trunk runs again) or the top-K
    proxy (it reads the top-K ids); the trunk pass exists only for the recompute cache."""
    run = build_scored_run(tiny_rl_config(method, delta=delta), tmp_path)
    try:
        ids = jax.ShapeDtypeStruct((4, 24), jnp.int32)
        out = jax.eval_shape(lambda p, i, a: run.old_pass(p, i, a, 8), run.initial_params, ids,
                             ids)
        assert (out[2] is not None) == hidden_out
        if hidden_out:
            assert out[2].shape == (4, 8, 32) and out[2].dtype == jnp.bfloat16
        assert (run.hidden_pass is not None) == (delta.get("feature_cache") == "recompute")
        assert run_lib.feature_cache_mode(run.cfg, run.with_delta) == (
            delta.get("feature_cache", "device") if hidden_out else "drop")
    finally:
        run.close()
