"""Memory planning: the exact figures (parameters, optimizer state) equal the bytes the placed
arrays really hold on device 0; the other figures follow their shapes; plan mode runs from the
command line without the planned devices."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax import models, plan, sharding
from delta_jax.train.state import init_train_state, split_model

# hidden 36 does not divide by fsdp=8 (the rules fall back to replication there).
SMALL = models.get_preset("tiny").replace(vocab_size=96, hidden_size=36, intermediate_size=80,
                                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def real_device0_bytes(mcfg, mesh_shape, optimizer):
    """Place a real model + optimizer state by the rules; sum device 0's shard bytes."""
    mesh = sharding.make_mesh(*mesh_shape)
    model = sharding.shard_model(models.Transformer(mcfg, rngs=nnx.Rngs(0)), mesh)
    _, params, _ = split_model(model)
    state = init_train_state(params, optimizer)
    state = sharding.shard_tree(state, sharding.tree_shardings(state, mesh))
    device0 = jax.devices()[0]
    return (sharding.local_shard_bytes(state.params, device0),
            sharding.local_shard_bytes(state.opt_state, device0))


@pytest.mark.parametrize("mesh_shape,dtype", [((1, 4, 2), jnp.float32),
                                              ((2, 2, 2), jnp.bfloat16),
                                              ((1, 8, 1), jnp.float32)])
def test_param_and_optimizer_bytes_match_placed_arrays(mesh_shape, dtype):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    mcfg = SMALL.replace(param_dtype=dtype)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    want_params, want_opt = real_device0_bytes(mcfg, mesh_shape, optimizer)
    p = plan.plan_memory(mcfg, mesh_shape=mesh_shape, device_memory_gb=1.0, rollout_rows=16,
                         prompt_len=8, response_len=8, sampler_rows=16, group_size=4,
                         mini_batch_rows=8, micro_batch_rows=0, logprob_chunk=4,
                         recompute_chunk=4, optimizer=optimizer)
    assert p.params == want_params
    assert p.optimizer == want_opt
    assert p.gradients == p.params  # no micro-batching: one gradient tree


def test_figures_follow_the_shapes():
    """Independent arithmetic for the shape-determined items of a Qwen3-8B-like config on a
    planned 32-device mesh (no such devices here)."""
    mc = models.get_preset("qwen3-8b", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                           remat="full")
    p = plan.plan_memory(mc, mesh_shape=(1, 8, 4), device_memory_gb=95.0, rollout_rows=2048,
                         prompt_len=2048, response_len=20480, sampler_rows=256, group_size=16,
                         mini_batch_rows=512, micro_batch_rows=8, logprob_chunk=512,
                         recompute_chunk=64)
    # Every parameter dimension of Qwen3-8B divides by fsdp=8 / tensor=4 except the norms
    # (replicated): params = (total - norms) / 32 + norms, in bf16.
    L, H, D = 36, 4096, 128
    norms = L * 2 * H + L * 2 * D + H
    assert p.params == 2 * ((mc.num_params() - norms) // 32 + norms)
    # AdamW (constant lr): two moments like the parameters (in the parameter dtype) plus
    # scale_by_adam's int32 step counter (replicated).
    assert p.optimizer == 2 * p.params + 4
    assert p.gradients == 2 * p.params  # micro-batches: accumulator + one micro-batch's grads
    # KV cache: 256 rows over 8 batch shards, 2048 + 32768 slots, 8 kv heads over tensor=4.
    assert p.kv_cache == 2 * L * (256 // 8) * (2048 + 32768) * (8 // 4) * D * 2
    # Device feature cache: 2048 rows over 8 batch shards x 20480 tokens x H, bf16.
    assert p.features_device == (2048 // 8) * 20480 * H * 2
    assert p.features_host_chunk == (64 // 8) * 20480 * H * 2
    assert p.activations_remat_full < p.activations_remat_none
    assert set(p.feature_cache_fits) == {"device", "host", "recompute"}
    text = p.to_text()
    assert "optimizer state" in text and "DelTA features, device" in text


def test_plan_mode_on_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "delta_jax.main", "--config=experiments/qwen3_8b.py",
         "--config.mode=plan", "--config.model.random_init=True", "--config.mesh.data=1",
         "--config.mesh.fsdp=-1", "--config.plan.num_devices=8",
         "--config.plan.device_memory_gb=80"],
        capture_output=True, text=True, timeout=120,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]),
        env={**__import__("os").environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mesh data=1 fsdp=8 tensor=1 (8 devices of 80 GB)" in out.stdout
    assert "recommended:" in out.stdout
