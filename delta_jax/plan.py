"""Memory planning (`--config.mode=plan`): per-device bytes of a config on a planned mesh,
computed from shapes (jax.eval_shape) and the sharding rules, without the devices.

    plan = plan_from_config(cfg)            # cfg: a validated run config
    print(plan.to_text())
    check_fits(plan, device_memory_bytes())  # what train / eval start-up runs (plan.check_memory)

Exact figures (from the parameter / optimizer-state shapes and the rules table, identical to what
the placed arrays hold on device 0): parameters, gradients, optimizer state, a KL term's reference
policy, rollout KV cache, DelTA feature cache. Estimates (stated formulas, see
`_layer_activation_bytes`): activations of the update (each remat policy of
models.REMAT_POLICIES: none, full, and the dots_* policies from the matmul outputs they save),
the rollout prefill's attention scores, the old-policy pass.

The update and old-policy pass formulas follow XLA's buffer assignment of the compiled programs:
the "update" figure agrees with XLA:CPU's memory analysis of the trainer's train step, and the
"old-policy pass + DelTA" figure (less the optimizer state) with that of its old-policy pass, both
compiled from abstract shapes, within 15% on a grid of small float32 models (remat none and full,
two micro-batch / chunk sizes, two sequence lengths, in a half-fraction design for the update;
materialised attention scores; tests/test_plan.py), except one old-pass point of its widest
model (hidden 512, 128-wide heads, 8 x 512 tokens), where XLA's heap packs the softmax's
score-sized buffers into two slots where the narrower models' take three, and the plan, which
counts three, is 34% over (KNOWN_MISSES says why). The
update figure of the dots_* policies is checked the same way at five more points (DOTS_GRID:
dots_with_no_batch_dims_saveable with materialised scores and with blockwise attention in 4 x 4
blocks, dots_saveable with each; 0.97-1.08 there, 0.96-1.10 at 47 points measured by hand). The
"rollout" figure (less the optimizer state) agrees with the larger of the sampler's prefill and
decode programs at two points there (0.91 and 1.00), each with the sampler's copy of the layer
weights (programs.decode_layers, held for the whole generate()) beside it; its prefill term (one
prefill call's one layer's forward) and the old-policy pass also with XLA:GPU's own figures for
Qwen3-0.6B compiled for an H100 without one (0.92-1.10 and 1.01-1.04, 2026-11-27; a test that
runs where jax's CUDA plugin and cuDNN are installed; Qwen3-8B's prefill 1.21). Not checked that
way: bfloat16 activations on XLA:CPU (which keeps them largely in float32, unlike a GPU),
blockwise attention other than the dots_* update points, the recompute feature cache's trunk
pass, and other GPU figures (the benchmarks print those where they run; an H100 run of
2026-11-24, Qwen3-1.7B at micro-batch 2 x 4096 in bf16, compiled the train step at 0.89-0.93x the
plan for remat full and dots_with_no_batch_dims_saveable, with cuDNN and with materialised
attention).

model.remat="auto" (the default) is resolved from these plans (choose_remat): the first policy of
the backend's order (auto_remat_order: on CUDA dots_with_no_batch_dims_saveable then full, measured
faster than "none" there; elsewhere least recomputation first) whose planned update fits the
device, as plan mode prints and train start-up logs.

The "old-policy pass + DelTA" phase peak counts the feature cache the config chooses
(delta.feature_cache): "device" keeps every row's features on the device, "host" moves them to host
memory chunk by chunk and brings back one recompute_chunk at a time, "recompute" holds one
recompute chunk's hidden states plus the trunk pass that recomputes them. The "fits" line below
the phases compares all three modes. A run that evaluates (data.eval) has an "eval" phase too:
the rollout's, with the sampler's page pool sized for eval.max_new_tokens; with train.eval_best
also "eval of the best policy", that one plus the best policy's parameters, read back beside the
training state after the last step. A warm start (sft.steps > 0, or mode=sft) has an "sft" phase:
one supervised step on sft.batch_size rows of sft.max_len tokens, with its own optimizer state.

Plan mode judges each phase against what XLA's allocator may use on the planned device
(planned_capacity_bytes: plan.device_memory_gb x allocator_fraction, 0.75 on a CUDA GPU unless the
environment or plan.memory_fraction says otherwise), the limit a run there is checked against at
start-up (device_memory_bytes), so that what plan mode accepts, the run accepts.

Attention follows model.attention (delta_jax/models/attention.py): "xla" materialises the
[rows, heads, T, S] float32 scores per layer, a quadratic term that dominates at long contexts;
"blockwise" / "cudnn" (and "auto" at lengths where it picks them) keep only block-sized scores plus
per-token softmax statistics (but remat=dots_saveable keeps every block pair's score matmul of the
blockwise path, quadratic again; not cuDNN's). The second column of the phase table is always the
blockwise figure, so the cost of the materialised scores stays visible.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from delta_jax import models
from delta_jax import sharding as sharding_lib
from delta_jax.errors import naming
from delta_jax.models.logprobs import positions_per_chunk
from delta_jax.sampling import bucket_size, plan_kv, prefill_rows_per_shard, widest_resume_prefill

GB = 1e9
FEATURE_CACHE_MODES = ("device", "host", "recompute")  # config.delta.feature_cache


def abstract_mesh(data: int, fsdp: int, tensor: int) -> AbstractMesh:
    """A device-less mesh of these sizes (for planning layouts one does not have)."""
    return AbstractMesh((data, fsdp, tensor), sharding_lib.MESH_AXES)


def shard_shape(shape, spec, mesh) -> tuple[int, ...]:
    """The per-device block shape of an array of `shape` under PartitionSpec `spec`."""
    out = list(shape)
    for i, entry in enumerate(spec):
        for axis in sharding_lib._as_tuple(entry):
            out[i] //= mesh.shape[axis]
    return tuple(out)


def tree_device_bytes(tree, mesh, rules: Mapping[str, Any] = sharding_lib.DEFAULT_RULES) -> int:
    """Bytes one device holds of `tree` (abstract or real) when placed by
    sharding.tree_shardings: Variables by their logical names, other arrays replicated."""
    from flax import nnx
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(leaf, nnx.Variable):
            value = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
            axes = leaf.get_metadata().get("out_sharding")
            spec = (sharding_lib.logical_to_spec(axes, value.shape, mesh, rules) if axes
                    else ())
        elif hasattr(leaf, "shape"):
            value, spec = leaf, ()
        else:
            continue
        total += math.prod(shard_shape(value.shape, spec, mesh)) * jnp.dtype(value.dtype).itemsize
    return total


def abstract_params(model_cfg: models.ModelConfig):
    """The nnx.Param state of the model as ShapeDtypeStructs (nothing allocated)."""
    from flax import nnx
    model = nnx.eval_shape(lambda: models.Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


def _div(n: int, parts: int) -> int:
    return n // parts if parts > 1 and n % parts == 0 else n


# plan.target: the backend a plan is for ("" = the one it runs on).
TARGETS = ("", "cpu", "cuda", "tpu")


def _target_cuda(target: str) -> Optional[bool]:
    """attention.resolve_impl's `cuda` for a plan target: None (look at this backend) for ""."""
    if target not in TARGETS:
        raise ValueError(f"plan.target must be one of {TARGETS}, got {target!r}")
    return None if not target else target == "cuda"


# What XLA's allocator may use of a device's memory where the user sets nothing: on a CUDA GPU
# jax caps its pool at 0.75 of the memory unless the environment says otherwise (jax 0.10 / 0.11
# read XLA_CLIENT_MEM_FRACTION, or the older XLA_PYTHON_CLIENT_MEM_FRACTION, and refuse both
# at once); a TPU's and the CPU's allocators are given the whole memory.
DEFAULT_MEM_FRACTION_CUDA = 0.75
MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def allocator_fraction(target: str = "", fraction: float = 0.0,
                       env: Optional[Mapping[str, str]] = None) -> tuple[float, str]:
    """The fraction of a device's memory XLA's allocator may use on the `target` backend
    (plan.target; "" = this one), and where it comes from: `fraction` when > 0
    (plan.memory_fraction); on a CUDA GPU the environment's MEM_FRACTION_ENV (env: default
    os.environ), as jax reads it, else DEFAULT_MEM_FRACTION_CUDA; elsewhere 1."""
    if fraction > 0:
        return float(fraction), "plan.memory_fraction"
    cuda = _target_cuda(target)
    if cuda is None:
        from delta_jax.models import attention
        cuda = attention._cuda_backend()
    if not cuda:
        return 1.0, "the whole memory off CUDA GPUs"
    env = os.environ if env is None else env
    for name in MEM_FRACTION_ENV:
        if env.get(name, "").strip():
            try:
                return float(env[name]), name
            except ValueError:
                raise ValueError(f"{name}={env[name]!r} is not a number") from None
    return DEFAULT_MEM_FRACTION_CUDA, f"jax's default on CUDA GPUs; {MEM_FRACTION_ENV[0]} sets it"


def planned_capacity_bytes(cfg, target: str = "") -> float:
    """What plan mode plans a device's phases against: plan.device_memory_gb x the allocator
    fraction of `target` (allocator_fraction, with plan.memory_fraction)."""
    return cfg.plan.device_memory_gb * GB * allocator_fraction(target, cfg.plan.memory_fraction)[0]


def attention_kind(mc: models.ModelConfig, seq: int, target: str = "") -> str:
    """The attention implementation the model runs for causal self-attention over `seq` tokens
    on the `target` backend ("" = the current one; attention.resolve_impl, the dispatch attend()
    itself uses): "xla" (materialised scores) or "blockwise" (stands for cudnn too: both keep no
    [T, S] array). So "auto" in bf16 plans as cuDNN on a CUDA GPU at every length (no score
    arrays; an H100 run of 2026-11-24 showed the old xla-at-short-lengths assumption
    over-estimating the 0.6B step's update 2.1x), and by the length threshold elsewhere."""
    return "xla" if _resolved_attention(mc, seq, target) == "xla" else "blockwise"


def _resolved_attention(mc: models.ModelConfig, seq: int, target: str = "") -> str:
    """attention.resolve_impl for causal self-attention over `seq` tokens on `target`: "xla",
    "blockwise" or "cudnn" (attention_kind without folding cudnn into blockwise)."""
    from delta_jax.models import attention
    return attention.resolve_impl(mc.attention, (1, seq, mc.num_heads, mc.head_dim), mc.dtype,
                                  kv_len=seq, cuda=_target_cuda(target))


def _layer_activation_bytes(mc: models.ModelConfig, rows: int, seq: int, tensor: int,
                            attention: Optional[str] = None, backward: bool = True,
                            target: str = "") -> dict:
    """Estimated bytes of one decoder layer's intermediates for `rows` x `seq` tokens on one
    device (heads and MLP columns split over `tensor` when it divides them).

    backward=True (the update): what XLA keeps for the backward pass, counted from the buffer
    assignment of the compiled train step (tests/test_plan.py checks the sum against XLA:CPU's
    memory analysis on a grid of float32 shapes):
      linear: what each layer keeps for its backward without remat: 6 H (layer input, the two
              norms' normalised and scaled outputs, the residual after attention) + 3 N D (q:
              projected, i.e. its norm's input, and rotated; the attention output) + 3 K D (k:
              projected and rotated; v) + 3 I (gate, up, silu(gate) * up), in the activation
              dtype. The norms and the SwiGLU product keep their inputs and recompute the rest
              (models.norm, transformer._swiglu); until 2026-11-28 XLA kept each norm's float32
              upcast and normalised value and SiLU's intermediates, 4 N D + 4 K D + 6 I here;
      linear_work: that former set, 6 H + 4 N D + 4 K D + 6 I: what a layer's backward works
              through one layer at a time (the recomputed ones included), the base of its
              transient peak (1.2x, activations() in plan_memory);
      scores (xla): the float32 scores and probabilities, N T per token each, plus the
              probabilities cast to the activation dtype when that is narrower than float32;
      attn_transient (xla, one layer at a time): the attention backward's 4 float32 [N, T, S]
              arrays (probability and score cotangents and their temporaries) and the boolean
              mask, N T bytes per token;
      recomputed_scores (xla): with full remat, the one float32 score array of the recomputed
              layer that is live beside the backward's transients;
      dots_saved: what remat=dots_with_no_batch_dims_saveable keeps of a layer: the outputs of
              its matmuls without batch dimensions, q (N D), k, v (K D each), the o_proj output
              (H), gate and up (I each), plus the layer input (H), in the activation dtype
              (down_proj's output is no residual): exactly the layer-stacked residuals of the
              compiled forward layer scan. The rest of the layer, attention included, is
              recomputed in the backward;
      batched_dots: what dots_saveable keeps on top of dots_saved: the outputs of the batched
              matmuls, in float32 (preferred_element_type). xla: the raw scores and the P V
              product, N (T + D) per token. blockwise: its forward's block matmuls sit in a
              scan inside the custom VJP's forward, which the policy sees, so every (query block,
              key block) pair's score block and P V block is kept, skipped causal pairs included:
              N nk (block_kv + D) per (padded) token, nk = key blocks, quadratic in the length
              like the xla scores. cudnn: 0 (a fused kernel, no dot_general to save).
      held_scores: what the recomputed layer's attention leaves for its own backward while
              the MLP backward before it runs (full remat: XLA's buffer assignment of the
              compiled step peaks there, in the MLP's cotangents, at the widest models): xla:
              three float32 [N, T, S] arrays, exp(scores - max), the softmax's reciprocal sum
              broadcast to the scores' shape, and the masked probabilities, 3 N T float32 per
              token; blockwise: the log-sum-exp, N per token.
    mask (xla): the boolean [rows, T, S] mask, T S bytes per row.
    weights: one layer's matmul weights (q, k, v, o, gate, up, down) in the compute dtype on one
      device (heads and MLP columns over `tensor` when it divides them, gathered over fsdp):
      the layer scan's dynamic-slice of each layer-stacked weight, a buffer of its own that
      XLA:CPU's schedule makes at the top of the layer body and holds until its matmul.
    backward=False (a forward-only pass: the old-policy pass, the rollout prefill):
      linear: 4 H (residual in/out, two norms) + 3 (N D + 2 K D) (q, k, v; after q/k-norm;
              after RoPE) + N D (attention output) + 4 I (gate, up, silu(gate) * up, its input
              to down_proj), in the activation dtype;
      scores (xla): N T float32 scores + their masked copy, + the probabilities in the activation
              dtype, per token: the quadratic term; attn_transient 0;
      rope: what the layer holds while it rotates q and k: q projected and rotated and the
              rotation's two half-width temporaries (3 N D), k projected and rotated and v
              (3 K D), per token in the activation dtype;
      mlp: what the layer holds in its MLP: the gate / up projections, silu(gate) x up and the
              residual stream in and out (3 I + 2 H per token, the activation dtype): the peak
              of a layer whose attention keeps no scores (cuDNN's), as XLA:GPU compiles the
              prefill for an H100 (2026-11-27).
    cudnn, backward=False: attn_transient = 0 (cuDNN's fused forward keeps no scores in memory,
      and the model's passes give it each row's real tokens at its front, by key lengths, with
      no copies of q, k, v or the output: attention.attend_prefix_causal); otherwise as
      blockwise.
    blockwise (either pass): scores = the float32 log-sum-exp, N per token (also what full remat
      keeps of the recomputed layer's scores); attn_transient = one (block_q x block_kv) block of
      scores, probabilities and, in the backward pass, their cotangents (4 float32 + 2
      activation-dtype copies, N heads), the running max / sum / float32 accumulator and dq of
      one query block, and the float32 dk / dv accumulators plus one query block's contributions
      (4 K D per token); with backward=False (a forward-only pass) only the forward's block of
      scores and probabilities (2 float32 + 1 activation-dtype copy) and one query block's
      running statistics and accumulator.
    `attention`: "xla" | "blockwise" | "cudnn" (default: as the `target` backend resolves it;
    cudnn is counted as blockwise but for batched_dots). The returned "attention" is
    attention_kind's "xla" | "blockwise".
    """
    a = jnp.dtype(mc.dtype).itemsize
    H, N, K, D, I = (mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                     mc.intermediate_size)
    n_loc, k_loc, i_loc = _div(N, tensor), _div(K, tensor), _div(I, tensor)
    tokens = rows * seq
    linear_work = tokens * a * (6 * H + 4 * n_loc * D + 4 * k_loc * D + 6 * i_loc)
    if backward:
        linear = tokens * a * (6 * H + 3 * n_loc * D + 3 * k_loc * D + 3 * i_loc)
    else:
        linear = tokens * a * (4 * H + 3 * (n_loc * D + 2 * k_loc * D) + n_loc * D + 4 * i_loc)
    impl = attention or _resolved_attention(mc, seq, target)
    kind = "xla" if impl == "xla" else "blockwise"
    if kind == "xla":
        score_elems = tokens * n_loc * seq
        if backward:
            scores = score_elems * (2 * 4 + (a if a < 4 else 0))
            transient = score_elems * (4 * 4 + 1)
        else:
            scores = score_elems * (2 * 4 + a)
            transient = 0
        recomputed_scores = score_elems * 4
        held_scores = score_elems * 3 * 4
        batched_dots = tokens * n_loc * (seq + D) * 4
        mask = rows * seq * seq  # the boolean [rows, T, S] mask the forward builds
    else:
        mask = 0
        bq, bkv = min(mc.attention_block_q, seq), min(mc.attention_block_kv, seq)
        scores = recomputed_scores = held_scores = tokens * n_loc * 4
        nq, nk = -(-seq // bq), -(-seq // bkv)
        batched_dots = 0 if impl == "cudnn" else rows * n_loc * nq * bq * nk * (bkv + D) * 4
        if backward:
            transient = (rows * n_loc * bq * bkv * (4 * 4 + 2 * a)
                         + rows * n_loc * bq * (2 * D + 2) * 4
                         + tokens * 4 * k_loc * D * 4)
        elif impl == "cudnn":
            # cuDNN's fused forward keeps no block of scores in memory, and the model's rows
            # reach it unpermuted (attention.attend_prefix_causal)
            transient = 0
        else:
            transient = rows * n_loc * bq * bkv * (2 * 4 + a) + rows * n_loc * bq * (D + 2) * 4
    dots_saved = tokens * a * (2 * H + n_loc * D + 2 * k_loc * D + 2 * i_loc)
    weights = a * H * (2 * n_loc * D + 2 * k_loc * D + 3 * i_loc)
    rope = tokens * a * (3 * n_loc * D + 3 * k_loc * D)
    mlp = tokens * a * (3 * i_loc + 2 * H)
    return {"linear": linear, "linear_work": linear_work, "scores": scores,
            "attn_transient": transient, "mlp": mlp,
            "recomputed_scores": recomputed_scores, "held_scores": held_scores, "mask": mask,
            "input": tokens * H * a, "dots_saved": dots_saved, "batched_dots": batched_dots,
            "weights": weights, "rope": rope, "attention": kind}


def forward_layer_peak(layer: Mapping[str, int]) -> int:
    """The peak of a forward-only pass over the layers (the old-policy pass's layer scan, the
    rollout prefill's loop) within one layer, from _layer_activation_bytes(backward=False): in
    the layer's attention (its
    scores, the mask and about an eighth of the layer's intermediates, as measured in XLA's
    buffer assignment), or in its projections and q / k rotation (the layer's sliced weights,
    all made at the top of the layer body and live at its q / k / v matmuls, the o_proj and MLP
    ones still during the rotation, beside the projected and rotated q and k: the peak where the
    weights are large against the scores, e.g. XLA:CPU's old pass of hidden 512, 128-wide heads
    at 128 tokens), or in its MLP (where the attention keeps no scores: cuDNN's)."""
    attention_peak = (layer["scores"] + layer["mask"] + layer["attn_transient"]
                      + layer["linear"] // 8)
    return max(attention_peak, layer["weights"] + layer["rope"], layer["mlp"])


@dataclasses.dataclass
class MemoryPlan:
    """Per-device bytes (ints) of each item, with the settings they were computed for."""
    settings: dict
    params: int
    gradients: int
    optimizer: int
    activations_remat_none: int
    activations_remat_full: int
    activations_configured: int
    logprob_chunk: int
    kv_cache: int
    prefill: int
    old_pass_activations: int
    features_device: int
    features_host_chunk: int
    features_host_ram: int
    features_recompute: int
    phases: dict = dataclasses.field(default_factory=dict)
    feature_cache_fits: dict = dataclasses.field(default_factory=dict)
    recommended_feature_cache: str = ""
    # The same with model.attention="blockwise" (no quadratic attention-score terms), for
    # comparison when the configured attention materialises the scores.
    phases_flash: dict = dataclasses.field(default_factory=dict)
    feature_cache_fits_flash: dict = dataclasses.field(default_factory=dict)
    recommended_feature_cache_flash: str = ""
    # The decode program's copy of the layer weights (see plan_memory's rollout phase).
    decode_weight_copy: int = 0
    # The sampler's KV page pool during evaluation (eval_response_len tokens; 0: not planned).
    eval_kv_cache: int = 0
    # rl.kl_coef > 0: the frozen reference policy's own copy (train.run.reference_part).
    kl_reference: int = 0

    def to_text(self) -> str:
        s = self.settings
        g = lambda b: f"{b / GB:9.2f} GB"  # noqa: E731
        lines = [
            f"memory plan: {s['model']} ({s['num_params'] / 1e9:.2f} B params, "
            f"{s['param_dtype']} params, {s['dtype']} activations)",
            f"  mesh data={s['mesh'][0]} fsdp={s['mesh'][1]} tensor={s['mesh'][2]} "
            f"({s['num_devices']} devices of {s['device_memory_gb']:g} GB"
            + (f"; the allocator may use {s['memory_fraction']:g} of it: "
               f"{s['capacity_bytes'] / GB:.2f} GB ({s['memory_fraction_source']})"
               if s.get("memory_fraction", 1.0) != 1.0 else "") + ")",
            f"  rollout {s['rollout_rows']} rows x (prompt {s['prompt_len']} + response "
            f"{s['response_len']}), sampler slots {s['sampler_rows']} (KV pages of "
            f"{s['page_size']} tokens); old-policy chunk {s['old_pass_rows']} rows; "
            f"update micro-batch {s['micro_rows']} rows; "
            f"remat={s['remat']}",
            *([f"  warm start (sft) {s['sft_rows']} rows x {s['sft_len']} tokens a step"
               + (f", micro-batch {s['sft_micro_rows']} rows"
                  if 0 < s.get("sft_micro_rows", 0) < s["sft_rows"] else "")]
              if s.get("sft_rows") else []),
            *([f"  remat=auto -> {s['remat']} (planned update or warm-start step per device: "
               + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in s["remat_auto"].items())
               + f"; the first of {', '.join(s['remat_auto_order'])} within {AUTO_REMAT_FILL:g} x "
               f"{s['capacity_bytes'] / GB:.2f} GB)"] if s.get("remat_auto") else []),
            f"  attention={s['attention']} (update / old-policy pass: {s['attention_train']}, "
            f"rollout prefill: {s['attention_prefill']}; as resolved on the "
            f"{s.get('attention_backend', '?')} backend, blockwise standing for cudnn too)",
            "per device:",
            f"  parameters                     {g(self.params)}",
            f"  gradients                      {g(self.gradients)}",
            f"  optimizer state                {g(self.optimizer)}"
            + ("  (in host memory outside the updates: optim.offload)"
               if s.get("optimizer_offload") else ""),
            *([f"  KL reference policy            {g(self.kl_reference)}"
               + ("  (the adapters; the base is shared)" if s.get("lora") else "")]
              if self.kl_reference else []),
            f"  activations, remat none        {g(self.activations_remat_none)}  (estimate)",
            f"  activations, remat full        {g(self.activations_remat_full)}  (estimate)",
            *([f"  activations, configured remat  {g(self.activations_configured)}  "
               f"(estimate; remat={s['remat']})"] if s["remat"] not in ("none", "full") else []),
            f"  LM-head log-prob chunk         {g(self.logprob_chunk)}"
            + ("  (with the LM head gathered whole and its float32 gradient: fsdp)"
               if s.get("lm_head_gathered") else ""),
            f"  rollout KV cache               {g(self.kv_cache)}",
            *([f"  eval KV cache                  {g(self.eval_kv_cache)}  "
               f"(eval.max_new_tokens={s['eval_response_len']})"] if self.eval_kv_cache else []),
            f"  rollout prefill                {g(self.prefill)}  (estimate: one layer's "
            f"forward)",
            f"  rollout decode weight copy     {g(self.decode_weight_copy)}",
            f"  old-policy pass activations    {g(self.old_pass_activations)}  (estimate)",
            f"  DelTA features, device         {g(self.features_device)}",
            f"  DelTA features, host (on dev.) {g(self.features_host_chunk)}  "
            f"(+ {self.features_host_ram / GB:.2f} GB host RAM per device)",
            f"  DelTA features, recompute      {g(self.features_recompute)}  "
            f"(+ {s['num_refine'] + 3} trunk passes per step)",
            f"phase peaks per device (delta.feature_cache={s['feature_cache']}):",
        ]
        mem = s["capacity_bytes"]

        def verdict(b):  # with the share of the limit the phase plans
            return f"{'fits' if b <= mem else 'DOES NOT FIT'} ({b / mem:.0%})"
        for name, value in self.phases.items():
            flash = self.phases_flash[name]
            lines.append(f"  {name:30s} {g(value)}  {verdict(value)}"
                         f"   | blockwise attention {g(flash)}  {verdict(flash)}")
        for label, fits, rec in (("", self.feature_cache_fits, self.recommended_feature_cache),
                                 (" (blockwise attention)", self.feature_cache_fits_flash,
                                  self.recommended_feature_cache_flash)):
            text = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in fits.items())
            lines.append(f"delta.feature_cache fits{label} -> {text}; recommended: {rec}")
        if replicated_state(s["mesh"]) and any(v > mem for v in self.phases.values()):
            lines.append(f"a phase does not fit: turn {REPLICA_KNOB}")
        return "\n".join(lines)


def plan_memory(model_cfg: models.ModelConfig, *, mesh_shape: tuple[int, int, int],
                device_memory_gb: float, memory_fraction: float = 1.0,
                memory_fraction_source: str = "",
                rollout_rows: int, prompt_len: int, response_len: int,
                sampler_rows: int, group_size: int, mini_batch_rows: int, micro_batch_rows: int,
                logprob_chunk_tokens: int, recompute_chunk: int, num_refine: int = 1,
                feature_cache: str = "device", optimizer=None, host_memory_gb: float = 0.0,
                page_size: int = 32, kv_budget_bytes: Optional[int] = None,
                devices_per_host: int = 8, kl_reference: bool = False,
                optimizer_offload: bool = False, old_pass_rows: int = 0,
                resume_preempted: bool = True,
                eval_response_len: int = 0, eval_group_size: int = 0,
                eval_best: bool = False, sft_rows: int = 0, sft_len: int = 0,
                sft_micro_rows: int = 0,
                rules: Mapping[str, Any] = sharding_lib.DEFAULT_RULES,
                name: str = "", target: str = "") -> MemoryPlan:
    """Per-device memory of training `model_cfg` on a (data, fsdp, tensor) = mesh_shape mesh.

    rollout_rows: sequences per RL step (prompts x group size); prompt_len / response_len: the
    padded lengths; sampler_rows: sequences per sampler call; old_pass_rows: per old-policy
    pass chunk (0: sampler_rows); mini/micro_batch_rows: rows per
    optimizer step / per forward-backward (0 = the mini-batch). feature_cache: the
    delta.feature_cache mode ("device" | "host" | "recompute") whose on-device features the
    old-policy pass + DelTA peak counts. optimizer: an optax GradientTransformation (default
    train.state.make_optimizer's: AdamW, through a float32 master copy of bfloat16 parameters).
    kl_reference: a KL term's frozen reference policy is resident (rl.kl_coef > 0): a copy of
    the trainable parameters (all of them, or the LoRA adapters, whose base it shares).
    optimizer_offload: the optimizer state rests in host memory outside the update phase
    (optim.offload). target: the backend planned for, "" = the one this runs on (TARGETS; it
    decides what model.attention="auto" runs). A phase fits when its peak is within
    device_memory_gb x memory_fraction (what the allocator may use: allocator_fraction;
    memory_fraction_source says where that came from, for the text). eval_response_len > 0 adds
    an "eval" phase: the rollout's with the sampler's pool sized for that many new tokens and
    eval_group_size samples a prompt (default group_size); with eval_best (train.eval_best) also
    an "eval of the best policy" phase: that one with the best policy's parameters beside the
    training state (loop.evaluate_best reads them back from its export). sft_rows > 0 adds an
    "sft" phase: one step of the supervised warm start (train.sft.make_sft_step) on sft_rows
    rows of sft_len tokens in micro-batches of sft_micro_rows (0: all at once), its optimizer
    state beside the parameters (optimizer's structure; on the device throughout), no KL
    reference yet. resume_preempted: with
    a pool below the worst case (kv_budget_bytes), the sampler's prefill of preempted samples'
    prompts and tokens (rollout.resume_preempted) counts beside the prompts'. Nothing is
    allocated.
    """
    import optax
    if feature_cache not in FEATURE_CACHE_MODES:
        raise ValueError(f"delta.feature_cache must be one of {FEATURE_CACHE_MODES}, got "
                         f"{feature_cache!r}")
    _target_cuda(target)  # an unknown target: ValueError naming plan.target
    data, fsdp, tensor = mesh_shape
    mesh = abstract_mesh(data, fsdp, tensor)
    num_devices = data * fsdp * tensor
    params = abstract_params(model_cfg)
    from delta_jax.train.state import make_optimizer, split_trainable
    if optimizer is None:
        optimizer = make_optimizer(optax.constant_schedule(1e-6))
    # Gradients and optimizer state cover the trainable parameters only (LoRA: the adapters).
    trainable = split_trainable(params)[0]
    opt_state = jax.eval_shape(optimizer.init, trainable)
    param_bytes = tree_device_bytes(params, mesh, rules)
    trainable_bytes = tree_device_bytes(trainable, mesh, rules)
    trainable_f32_bytes = tree_device_bytes(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), trainable), mesh, rules)
    opt_bytes = tree_device_bytes(opt_state, mesh, rules)
    ref_bytes = trainable_bytes if kl_reference else 0

    def rows_per_device(rows):
        spec = sharding_lib.logical_to_spec(("batch",), (rows,), mesh, rules)
        return shard_shape((rows,), spec, mesh)[0]

    micro = micro_batch_rows if 0 < micro_batch_rows < mini_batch_rows else mini_batch_rows
    # The step sums micro-batch gradients into a float32 buffer (train.step): with
    # micro-batching that buffer beside one micro-batch's gradients (in the parameters' dtype),
    # without it the one float32 tree.
    grad_bytes = trainable_f32_bytes + (trainable_bytes if micro < mini_batch_rows else 0)

    L, H, V = model_cfg.num_layers, model_cfg.hidden_size, model_cfg.vocab_size
    a = jnp.dtype(model_cfg.dtype).itemsize
    seq = prompt_len + response_len
    m_rows = rows_per_device(micro)
    policy = model_cfg.remat_policy

    def activations(layer):
        """{remat policy: (kept, transient)} activation bytes of the update: `kept` for the whole
        backward pass, `transient` the peak of one layer's backward (the LM head's chunk peaks
        at another time: the update phase takes the larger of the two)."""
        # Each layer's backward peaks either in its attention or in its projections / MLP (the
        # linear intermediates and their cotangents: 1.2x linear_work), as measured in XLA's
        # buffer assignment.
        linear_peak = 6 * layer["linear_work"] // 5
        # No remat: every layer's backward residuals; the attention backward's transients.
        none = (L * (layer["linear"] + layer["scores"]),
                max(layer["attn_transient"], linear_peak))
        # Full remat keeps each layer's input and recomputes one layer at a time; its attention
        # backward also holds the recomputed scores and a quarter of the recomputed linear
        # intermediates. Its MLP backward, which runs first, holds what the recomputed attention
        # keeps for its own backward (held_scores) beside the linear peak: the larger of the two
        # where the MLP is wide against heads x length (intermediate 1536 against 8 heads x 512
        # tokens; at 384 against 4 or 8 heads the attention backward still peaks).
        recompute = (layer["attn_transient"] + layer["recomputed_scores"]
                     + layer["linear_work"] // 4)
        full = (L * layer["input"], max(recompute, linear_peak + layer["held_scores"]))
        # dots_with_no_batch_dims_saveable keeps every layer's projection / MLP matmul outputs
        # and its input (dots_saved) and recomputes the rest one layer at a time, attention
        # included (its score and P V matmuls are batched dots, which it does not save): full
        # remat's transient, plus one more float32 [T, S] score array with materialised scores
        # (six float32 [T, S]-sized buffers in XLA:CPU's buffer assignment of the compiled step
        # against full remat's five).
        xla = layer["attention"] == "xla"
        no_batch = (L * layer["dots_saved"],
                    max(recompute + (layer["recomputed_scores"] if xla else 0), linear_peak))
        # dots_saveable also keeps the batched matmul outputs (batched_dots). xla: the raw
        # scores, from which the backward rebuilds the probabilities: full remat's transient.
        # blockwise: every block pair's score and P V blocks, quadratic in the length, of which
        # the buffer assignment holds one layer's twice (the blockwise forward's own scan output
        # beside the layer-stacked residuals). cudnn: nothing more than dots_with_no_batch_dims.
        dots = (L * (layer["dots_saved"] + layer["batched_dots"]),
                max(recompute, linear_peak) + (0 if xla else layer["batched_dots"]))
        by_policy = {"none": none, "full": full, "dots_with_no_batch_dims_saveable": no_batch,
                     "dots_saveable": dots}
        return {"none": none, "full": full, "configured": by_policy[policy]}

    layer = _layer_activation_bytes(model_cfg, m_rows, seq, tensor, target=target)
    act = activations(layer)
    act_none, act_full, act_cfg = (sum(act[k]) for k in ("none", "full", "configured"))
    # LM head: float32 logits of one chunk of logprob_chunk_tokens tokens (positions =
    # tokens // rows, models.positions_per_chunk), their softmax and cotangent.
    lp_chunk = (m_rows * min(positions_per_chunk(logprob_chunk_tokens, micro), response_len)
                * _div(V, tensor) * 4 * 3)
    # With the LM head's hidden dimension split (fsdp over "embed"), its chunk loop runs on the
    # weight gathered whole ([H, V / tensor] in the compute dtype; XLA's buffer assignment holds
    # two such copies) and sums its gradient over the chunks whole in float32, reduce-scattered
    # once after the loop: on a v5p's compile of Qwen3-1.7B's step over 4 / 8 chips, 1.16 GiB of
    # float32 [2,048, 151,936] and 2 x 0.58 GiB of bf16 beside the chunk (BENCHMARKS.md); the
    # old-policy pass holds one gathered copy.
    head_split = sharding_lib.logical_to_spec(("embed", "vocab"), (H, V), mesh, rules)
    lm_head_gathered = (H * _div(V, tensor) * (2 * a + 4)
                        if len(head_split) and head_split[0] is not None else 0)
    lm_head_peak = lp_chunk + lm_head_gathered

    # Rollout: the sampler's KV page pool (sampling.plan_kv: sampler_rows slots split over the
    # batch shards, each shard's pages sized for its own slots, worst case or the budget per
    # shard; pages over the batch axes, KV heads over tensor when they divide), and the
    # prefill's transients.
    s_rows = rows_per_device(sampler_rows)
    batch_shards = sharding_lib.axes_size(mesh, sharding_lib._as_tuple(rules.get("batch")))
    slots = (bucket_size(sampler_rows, 1, batch_shards) if sampler_rows % batch_shards
             else sampler_rows)
    kv_split = tensor if model_cfg.num_kv_heads % tensor == 0 else 1

    def kv_pool(new_tokens):
        return plan_kv(model_cfg, slots=slots, shards=batch_shards, prompt_len=prompt_len,
                       max_new_tokens=new_tokens, page_size=page_size,
                       kv_budget_bytes=kv_budget_bytes)

    def kv_bytes(new_tokens):
        return kv_pool(new_tokens).shard_bytes // kv_split

    kv = kv_bytes(response_len)
    # Evaluation runs the same sampler (same slots, prompts and budget) for eval_response_len
    # tokens, eval_group_size samples a prompt, its pool sized for those.
    kv_eval = kv_bytes(eval_response_len) if eval_response_len else 0
    # Decode takes each layer's weights as arrays of their own (sampling.programs.decode_layers:
    # the matmul weights in the compute dtype, LoRA merged; the norm scales as they are): a copy
    # of every layer's weights, made once per generate() and held until it returns, beside the
    # prefill and the decode programs alike.
    from delta_jax.models.transformer import NORM_NAMES
    layer_weights = {k: v for k, v in params["layers"].items()
                     if k not in NORM_NAMES and "_lora_" not in k}
    norm_scales = {k: v for k, v in params["layers"].items() if k in NORM_NAMES}
    decode_copy = (tree_device_bytes(layer_weights, mesh, rules) * a
                   // jnp.dtype(model_cfg.param_dtype).itemsize
                   + tree_device_bytes(norm_scales, mesh, rules))
    # One prefill call of the sampler (scheduler.prefill_rows_per_shard: slots / n prompts of
    # all but their last token, bucketed, at most ~MAX_PREFILL_TOKENS tokens) on a device: one
    # layer's forward at a time (forward_layer_peak, as the old-policy pass); each layer writes
    # its keys and values into the pages as it computes them (Transformer.prefill_paged). Where
    # the pool can run dry (a budget below the worst case) and preempted samples resume, a call
    # may instead prefill their prompts and tokens: rows up to widest_resume_prefill wide.
    P = bucket_size(max(1, prompt_len - 1), 16)

    def prefill_bytes(flash, group=group_size, new_tokens=response_len):
        shapes = [(prefill_rows_per_shard(slots, group, P, batch_shards), P)]
        pool = kv_pool(new_tokens)
        if resume_preempted and pool.num_pages < pool.worst_case_pages:
            width = widest_resume_prefill(prompt_len - 1 + new_tokens - 1)
            shapes.append((prefill_rows_per_shard(slots, 1, width, batch_shards), width))
        return max(forward_layer_peak(_layer_activation_bytes(
            model_cfg, rows, width, tensor,
            "blockwise" if flash else _resolved_attention(model_cfg, width, target),
            backward=False)) for rows, width in shapes)

    prefill_kind = attention_kind(model_cfg, P, target)
    prefill = prefill_bytes(False)
    eval_group = eval_group_size or group_size

    # Old-policy pass: forward only over a chunk of old_pass_rows rows (default sampler_rows),
    # one layer live at a time.
    o_global = min(rollout_rows, old_pass_rows or sampler_rows)
    o_rows = rows_per_device(o_global)
    lp_old = (o_rows * min(positions_per_chunk(logprob_chunk_tokens, o_global), response_len)
              * _div(V, tensor) * 4 * 2)
    if lm_head_gathered:  # the forward's chunk loop on the LM head gathered whole (update's)
        lp_old += H * _div(V, tensor) * a

    def old_pass_bytes(o_layer):  # one layer's forward at a time, or an LM-head chunk
        return max(forward_layer_peak(o_layer), lp_old)

    o_layer = _layer_activation_bytes(model_cfg, o_rows, seq, tensor, backward=False,
                                      target=target)
    old_pass = old_pass_bytes(o_layer)

    feat_row = response_len * H * 2  # bfloat16 hidden states
    f_device = rows_per_device(rollout_rows) * feat_row
    chunk_rows = rows_per_device(min(recompute_chunk, rollout_rows))
    f_host_chunk = chunk_rows * feat_row
    f_host_ram = f_device
    f_recompute = chunk_rows * feat_row + (o_layer["linear"] * chunk_rows // max(o_rows, 1))
    # What each cache mode holds on the device while DelTA runs (host: one chunk brought back).
    features_on_device = {"device": f_device, "host": f_host_chunk, "recompute": f_recompute}

    # What stays on the device through every phase; the update phase adds the optimizer state
    # where it rests in host memory otherwise (optimizer_offload).
    resident = param_bytes + ref_bytes + (0 if optimizer_offload else opt_bytes)
    in_update = resident + (opt_bytes if optimizer_offload else 0)
    mem = device_memory_gb * memory_fraction * GB
    host_ok = host_memory_gb <= 0 or f_host_ram * devices_per_host <= host_memory_gb * GB

    def peaks(prefill, old_pass, act, eval_prefill):
        phases = {
            "rollout": resident + kv + decode_copy + max(prefill, s_rows * V * 4),
            "old-policy pass + DelTA": resident + old_pass + features_on_device[feature_cache],
            "update": in_update + grad_bytes + act[0] + max(act[1], lm_head_peak),
        }
        if eval_response_len:
            phases["eval"] = resident + kv_eval + decode_copy + max(eval_prefill, s_rows * V * 4)
            if eval_best:
                phases[BEST_EVAL] = phases["eval"] + param_bytes
        base = resident + old_pass
        fits = {m: base + features_on_device[m] <= mem and (host_ok or m != "host")
                for m in FEATURE_CACHE_MODES}
        return phases, fits, next((m for m in FEATURE_CACHE_MODES if fits[m]), "none")

    phases, fits, recommended = peaks(
        prefill, old_pass, act["configured"],
        prefill_bytes(False, eval_group, eval_response_len or response_len))
    act_cfg_flash = activations(_layer_activation_bytes(model_cfg, m_rows, seq, tensor,
                                                        "blockwise"))["configured"]
    phases_flash, fits_flash, rec_flash = peaks(
        prefill_bytes(True),
        old_pass_bytes(_layer_activation_bytes(model_cfg, o_rows, seq, tensor, "blockwise",
                                               backward=False)),
        act_cfg_flash, prefill_bytes(True, eval_group, eval_response_len or response_len))
    if sft_rows:
        # The warm start's step: a micro-batch's forward / backward at a time (the whole batch
        # without micro-batches, whose gradients are then in the parameters' dtype with no
        # float32 sum beside them), the update's activations at its shape, the LM head's
        # log-prob chunks over every position but the last.
        sft_micro = sft_micro_rows if 0 < sft_micro_rows < sft_rows else sft_rows
        sft_local = rows_per_device(sft_micro)
        sft_grads = trainable_bytes + (trainable_f32_bytes if sft_micro < sft_rows else 0)
        sft_head = (sft_local * min(positions_per_chunk(logprob_chunk_tokens, sft_micro),
                                    sft_len - 1) * _div(V, tensor) * 4 * 3 + lm_head_gathered)
        for table, attention in ((phases, None), (phases_flash, "blockwise")):
            kept, transient = activations(_layer_activation_bytes(
                model_cfg, sft_local, sft_len, tensor, attention, target=target))["configured"]
            table["sft"] = (param_bytes + opt_bytes + sft_grads + kept
                            + max(transient, sft_head))
    settings = {
        "model": name or f"L={L} H={H}", "num_params": model_cfg.num_params(),
        "param_dtype": jnp.dtype(model_cfg.param_dtype).name,
        "dtype": jnp.dtype(model_cfg.dtype).name, "mesh": mesh_shape,
        "num_devices": num_devices, "device_memory_gb": device_memory_gb,
        "memory_fraction": memory_fraction, "memory_fraction_source": memory_fraction_source,
        "capacity_bytes": mem,
        "rollout_rows": rollout_rows, "prompt_len": prompt_len, "response_len": response_len,
        "eval_response_len": eval_response_len, "sft_rows": sft_rows, "sft_len": sft_len,
        "sft_micro_rows": sft_micro_rows,
        "sampler_rows": sampler_rows, "old_pass_rows": o_global, "micro_rows": micro,
        "remat": policy,
        "num_refine": num_refine, "host_memory_gb": host_memory_gb,
        "feature_cache": feature_cache, "page_size": page_size,
        "optimizer_offload": bool(optimizer_offload), "lm_head_gathered": lm_head_gathered,
        "lora": model_cfg.lora_rank > 0,
        "attention": model_cfg.attention, "attention_train": layer["attention"],
        "attention_prefill": prefill_kind, "attention_backend": target or jax.default_backend(),
    }
    return MemoryPlan(settings=settings, params=param_bytes, gradients=grad_bytes,
                      optimizer=opt_bytes, activations_remat_none=act_none,
                      activations_remat_full=act_full, activations_configured=act_cfg,
                      logprob_chunk=lm_head_peak, kv_cache=kv, eval_kv_cache=kv_eval,
                      prefill=prefill,
                      old_pass_activations=old_pass, features_device=f_device,
                      features_host_chunk=f_host_chunk, features_host_ram=f_host_ram,
                      features_recompute=f_recompute, phases=phases,
                      feature_cache_fits=fits, recommended_feature_cache=recommended,
                      phases_flash=phases_flash, feature_cache_fits_flash=fits_flash,
                      recommended_feature_cache_flash=rec_flash, decode_weight_copy=decode_copy,
                      kl_reference=ref_bytes)


def model_config_from_run_config(cfg, remat: Optional[str] = None) -> models.ModelConfig:
    """The ModelConfig a run would build, from config.json (model.path) or the preset, without
    reading weights or a tokenizer (a preset's own vocabulary unless model.vocab_size is set).
    remat: the policy to build it with (default model.remat; "auto" is what choose_remat picks
    against planned_capacity_bytes on the config's mesh for plan.target, as plan mode does)."""
    dtype, param_dtype = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.param_dtype)
    remat = cfg.model.remat if remat is None else remat
    if remat == "auto":
        remat = choose_remat(cfg, planned_capacity_bytes(cfg, cfg.plan.target),
                             target=cfg.plan.target)[0]
    from delta_jax.train.config import lora_targets
    lora = dict(lora_rank=cfg.model.lora_rank, lora_alpha=float(cfg.model.lora_alpha),
                lora_targets=lora_targets(cfg) if cfg.model.lora_rank else ())
    if cfg.model.random_init or not cfg.model.path:
        overrides = {f: cfg.model[f] for f in ("hidden_size", "intermediate_size", "num_layers",
                                               "num_heads", "num_kv_heads", "head_dim",
                                               "vocab_size") if cfg.model[f]}
        return models.get_preset(cfg.model.preset, dtype=dtype, param_dtype=param_dtype,
                                 remat=remat, attention=cfg.model.attention,
                                 **overrides, **lora)
    with naming("model.path"):
        return models.pretrained_config(cfg.model.path, dtype, param_dtype=param_dtype,
                                        remat=remat, attention=cfg.model.attention,
                                        check_weights=False).replace(**lora)


def eval_new_tokens(cfg) -> int:
    """The response length the run's evaluations and validations generate (eval.max_new_tokens),
    or 0 where it evaluates nothing (no data.eval, no data.val)."""
    return cfg.eval.max_new_tokens if cfg.data.eval or cfg.data.val else 0


def eval_group_size(cfg) -> int:
    """The most samples a question the run's evaluations draw: eval.k, or the validations'
    eval.val_k where larger."""
    from delta_jax.train.config import VAL, eval_settings, validation_on
    return max(cfg.eval.k, eval_settings(cfg, VAL).k if validation_on(cfg) else 0)


def kv_plan_from_config(cfg, model_cfg: models.ModelConfig):
    """The sampler's KV page pool for a run config's rollouts (sampling.plan_kv); a
    rollout.kv_budget_gb that cannot hold one sample of a rollout or of an evaluation
    (eval.max_new_tokens) is a ConfigError naming the fields, before anything runs."""
    def pool(new_tokens):
        return plan_kv(model_cfg, slots=cfg.rollout.max_batch_size,
                       prompt_len=cfg.data.max_prompt_len, max_new_tokens=new_tokens,
                       page_size=cfg.rollout.page_size,
                       kv_budget_bytes=int(cfg.rollout.kv_budget_gb * 2**30) or None)

    from delta_jax.train.config import ConfigError
    try:
        rollout = pool(cfg.rollout.max_new_tokens)
    except ValueError as e:
        raise ConfigError(f"rollout.kv_budget_gb: {e}") from None
    if eval_new_tokens(cfg):
        try:
            pool(eval_new_tokens(cfg))
        except ValueError as e:
            raise ConfigError(f"rollout.kv_budget_gb / eval.max_new_tokens: {e}") from None
    return rollout


def plan_from_config(cfg, *, mesh_shape: Optional[tuple[int, int, int]] = None,
                     model_cfg: Optional[models.ModelConfig] = None,
                     target: str = "", capacity_bytes: Optional[float] = None) -> MemoryPlan:
    """plan_memory for a validated run config: the mesh from config.mesh over
    config.plan.num_devices devices (0 = the devices present), or `mesh_shape` (data, fsdp,
    tensor) when given; `model_cfg` overrides the model the config describes (e.g. the built
    model, whose vocabulary follows the tokenizer; its remat policy is the one planned).
    Without `model_cfg`, model.remat="auto" is resolved by choose_remat against the capacity,
    and the plan's settings record what it tried. `target`: the backend planned for
    (plan_memory; "" = this one: start-up checks; plan mode passes plan.target).
    `capacity_bytes`: what a device's allocator may use (start-up checks: the device's own
    limit); default planned_capacity_bytes (plan.device_memory_gb x the allocator fraction)."""
    mesh_shape = _config_mesh_shape(cfg, mesh_shape)
    if model_cfg is None and cfg.model.remat == "auto":
        policy, plans = _remat_plans(cfg, capacity_bytes, mesh_shape, None, target)
        result = plans[policy]
        result.settings["remat_auto"] = _updates(plans)
        result.settings["remat_auto_order"] = auto_remat_order(target)
        return result
    return _plan_from_config(cfg, mesh_shape,
                             model_config_from_run_config(cfg) if model_cfg is None else model_cfg,
                             target, capacity_bytes)


def _config_mesh_shape(cfg, mesh_shape=None) -> tuple[int, int, int]:
    """`mesh_shape`, or config.mesh over config.plan.num_devices (0: the devices present)."""
    if mesh_shape is not None:
        return tuple(mesh_shape)
    n = cfg.plan.num_devices or len(jax.devices())
    return sharding_lib.resolve_mesh_shape(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor,
                                           num_devices=n)


# model.remat="auto" (choose_remat): the policies it considers, in order of preference, on each
# backend (auto_remat_order). Elsewhere than CUDA least recomputation first: "none" recomputes
# nothing. On CUDA "none" is left out: on an H200 at the Qwen3-1.7B shape (micro-batch 2 x 4096,
# bf16, cuDNN attention; BENCHMARKS.md "Fifth GPU run", 2026-11-26) dots_with_no_batch_dims_saveable
# ran the train step 8.2% faster than "none" (877.7 vs 956.0 ms, 42.5% vs 39.0% MFU) with half
# its memory (28.3 vs 53.1 GiB compiled), and on an H100 (2026-11-24) 8% faster than full remat
# (40.2% vs 37.2% MFU): saving the matmul outputs and recomputing the elementwise work beats
# reading back everything saved. Not measured on a TPU. dots_saveable is left out everywhere:
# with blockwise or materialised attention it keeps quadratic score blocks, and it was not
# measured faster than dots_with_no_batch_dims_saveable.
AUTO_REMAT_ORDER = ("none", "dots_with_no_batch_dims_saveable", "full")
AUTO_REMAT_ORDER_CUDA = ("dots_with_no_batch_dims_saveable", "full")
# On a TPU "none" is left out for another reason: there the plan under-counts it by more than
# AUTO_REMAT_FILL's margin. Compiled for a v5p chip without one (BENCHMARKS.md, 2026-11-28), the
# Qwen3-1.7B step (8 x 4,096 tokens, micro-batch 2) is planned at 0.81-0.82 of the compiled peak
# without remat (the TPU keeps some of the layer residuals in float32), at 0.86-0.88 with
# dots_with_no_batch_dims_saveable and 0.95-0.98 with full remat: a "none" planned at 0.85 of the
# chip's memory would need ~1.04 of it. Which policy runs fastest on a TPU is not measured.
AUTO_REMAT_ORDER_TPU = AUTO_REMAT_ORDER_CUDA


def auto_remat_order(target: str = "") -> tuple[str, ...]:
    """The policies model.remat="auto" tries, in order, for the `target` backend (plan.target;
    "" = the one this runs on): AUTO_REMAT_ORDER_CUDA on an NVIDIA GPU, AUTO_REMAT_ORDER_TPU on a
    TPU, else AUTO_REMAT_ORDER."""
    from delta_jax.models import attention
    cuda = _target_cuda(target)
    if cuda is None:
        cuda = attention._cuda_backend()
    tpu = target == "tpu" or (not target and jax.default_backend() == "tpu")
    return AUTO_REMAT_ORDER_CUDA if cuda else AUTO_REMAT_ORDER_TPU if tpu else AUTO_REMAT_ORDER


# The fraction of the device memory the planned update phase may fill for a policy to be chosen:
# the plan agrees with compiled figures within 15% (tests/test_plan.py's grid; XLA:GPU's train
# step: 0.89-1.00x the plan), so a plan 15% under the compiled figure still fits (0.85 x 1.15).
AUTO_REMAT_FILL = 0.85


def choose_remat(cfg, capacity_bytes: float, *,
                 mesh_shape: Optional[tuple[int, int, int]] = None,
                 model_cfg: Optional[models.ModelConfig] = None,
                 target: str = "") -> tuple[str, dict]:
    """model.remat="auto": the first policy of auto_remat_order(target) whose planned "update"
    phase (or "sft", the warm start's step, where larger: _gradient_peak; per device, on
    `mesh_shape`; plan_from_config) is at most AUTO_REMAT_FILL x
    capacity_bytes, else "full" (which check_fits then judges like any configured policy).
    `model_cfg`: the model to plan (its remat is replaced), default the config's; `target`:
    plan_memory's (the backend planned for, "" = this one).
    Returns (policy, {policy tried: planned update bytes}); nothing is compiled or allocated."""
    policy, plans = _remat_plans(cfg, capacity_bytes, _config_mesh_shape(cfg, mesh_shape),
                                 model_cfg, target)
    return policy, _updates(plans)


def _remat_plans(cfg, capacity_bytes: Optional[float], mesh_shape: tuple[int, int, int],
                 model_cfg: Optional[models.ModelConfig], target: str) -> tuple[str, dict]:
    """choose_remat's policy and the whole plan of each policy tried, in order (capacity_bytes
    None: planned_capacity_bytes)."""
    base = model_config_from_run_config(cfg, remat="full") if model_cfg is None else model_cfg
    plans = {}

    def update_bytes(policy):
        plans[policy] = _plan_from_config(cfg, mesh_shape, base.replace(remat=policy), target,
                                          capacity_bytes)
        return _gradient_peak(plans[policy])

    limit = planned_capacity_bytes(cfg, target) if capacity_bytes is None else capacity_bytes
    policy, _ = pick_remat(update_bytes, limit, auto_remat_order(target))
    return policy, plans


def _gradient_peak(memory_plan: MemoryPlan) -> int:
    """The larger of the phases that take gradients (whose memory the remat policy sets): the
    update, and the warm start's step where one runs."""
    return max(memory_plan.phases["update"], memory_plan.phases.get("sft", 0))


def _updates(plans: dict) -> dict:
    return {policy: _gradient_peak(p) for policy, p in plans.items()}


def pick_remat(update_bytes, capacity_bytes: float,
               order: tuple[str, ...]) -> tuple[str, dict]:
    """choose_remat's rule on any planned update: the first policy of `order`
    (auto_remat_order's) whose `update_bytes(policy)` (the update phase's per-device bytes with
    that policy, e.g. plan_memory's phases["update"]) is within AUTO_REMAT_FILL x capacity_bytes,
    else "full"; with {policy tried: bytes}."""
    tried = {}
    for policy in order:
        tried[policy] = update_bytes(policy)
        if tried[policy] <= AUTO_REMAT_FILL * capacity_bytes:
            return policy, tried
    return "full", tried


def _plan_from_config(cfg, mesh_shape: tuple[int, int, int], mc: models.ModelConfig,
                      target: str, capacity_bytes: Optional[float] = None) -> MemoryPlan:
    from delta_jax.train.config import old_pass_rows
    from delta_jax.train.state import optimizer_from_config
    n = math.prod(mesh_shape)
    G = cfg.rollout.group_size
    optimizer, _ = optimizer_from_config(cfg.optim, max(cfg.train.steps, 1))
    kv_plan_from_config(cfg, mc)  # a budget that cannot hold one sample: ConfigError first
    budget = int(cfg.rollout.kv_budget_gb * 2**30) or None
    if capacity_bytes is None:  # plan mode: the planned device, as its allocator is set
        fraction, source = allocator_fraction(target, cfg.plan.memory_fraction)
        memory_gb = cfg.plan.device_memory_gb
    else:  # a start-up check: what this device's allocator reports
        fraction, source, memory_gb = 1.0, "the device's allocator limit", capacity_bytes / GB
    return plan_memory(
        mc, mesh_shape=mesh_shape, device_memory_gb=memory_gb, memory_fraction=fraction,
        memory_fraction_source=source,
        rollout_rows=cfg.rollout.batch_prompts * G, prompt_len=cfg.data.max_prompt_len,
        response_len=cfg.rollout.max_new_tokens, sampler_rows=cfg.rollout.max_batch_size,
        old_pass_rows=old_pass_rows(cfg), resume_preempted=cfg.rollout.resume_preempted,
        group_size=G, mini_batch_rows=cfg.rl.mini_batch_prompts * G,
        micro_batch_rows=cfg.rl.micro_batch_size,
        logprob_chunk_tokens=cfg.model.logprob_chunk_tokens,
        recompute_chunk=cfg.delta.recompute_chunk, num_refine=cfg.delta.num_refine,
        feature_cache=cfg.delta.feature_cache, optimizer=optimizer,
        host_memory_gb=cfg.plan.host_memory_gb, page_size=cfg.rollout.page_size,
        kv_budget_bytes=budget, kl_reference=cfg.rl.kl_coef > 0,
        # mode=eval holds no optimizer state (loop.eval_only reads the parameters alone)
        optimizer_offload=cfg.optim.offload or cfg.mode == "eval",
        eval_response_len=eval_new_tokens(cfg), eval_group_size=eval_group_size(cfg),
        eval_best=cfg.train.eval_best and cfg.mode in ("train", "plan"),
        # the warm start (sft.steps > 0) of a train run (mode=plan plans one), or mode=sft's
        sft_rows=(cfg.sft.batch_size if cfg.sft.steps > 0 and cfg.mode in ("train", "sft", "plan")
                  else 0),
        sft_len=cfg.sft.max_len, sft_micro_rows=cfg.sft.micro_batch_size,
        devices_per_host=min(n, 8),
        name=cfg.model.preset or cfg.model.path, target=target)


# The config fields that shrink each phase's planned peak (named by `check_fits`).
PHASE_KNOBS = {
    "rollout": ("rollout.max_batch_size (sampler slots)", "rollout.kv_budget_gb (KV page pool)",
                "data.max_prompt_len / rollout.max_new_tokens",
                "model.attention=blockwise (prefill scores)",
                "optim.offload=True (optimizer state in host memory)"),
    "old-policy pass + DelTA": ("delta.feature_cache=host or recompute",
                                "rl.old_pass_rows (rows per old-policy chunk)",
                                "model.logprob_chunk_tokens", "delta.recompute_chunk",
                                "optim.offload=True (optimizer state in host memory)"),
    "update": ("rl.micro_batch_size", "model.remat=full", "model.logprob_chunk_tokens",
               "model.attention=blockwise"),
    "eval": ("rollout.max_batch_size (sampler slots)", "rollout.kv_budget_gb (KV page pool)",
             "eval.max_new_tokens / data.max_prompt_len",
             "model.attention=blockwise (prefill scores)"),
}
PHASE_KNOBS["sft"] = ("sft.micro_batch_size", "sft.batch_size", "sft.max_len", "model.remat=full",
                      "model.logprob_chunk_tokens", "model.attention=blockwise")
# After the last step (train.eval_best) the best policy's parameters join the training state.
BEST_EVAL = "eval of the best policy"
PHASE_KNOBS[BEST_EVAL] = ("train.eval_best=False (then --config.mode=eval "
                          "--config.eval.checkpoint=none --config.model.path=<workdir>/best)",
                          *PHASE_KNOBS["eval"],
                          "optim.offload=True (optimizer state in host memory)")


def replicated_state(mesh_shape) -> bool:
    """Whether a (data, fsdp, tensor) mesh puts a whole replica of the parameters, gradients and
    optimizer state on each of several devices (data parallelism alone)."""
    data, fsdp, tensor = mesh_shape
    return data > 1 and fsdp == tensor == 1


# Named first for every phase over the device when the mesh is data-parallel alone.
REPLICA_KNOB = ("mesh.data=1 mesh.fsdp=-1 (each device now holds whole parameters, gradients and "
                "optimizer state; this shards them over the devices)")
# The phases a mode runs (check_fits leaves out those a plan has not: "eval" without data.eval,
# "sft" without sft.steps).
PHASES_BY_MODE = {"train": tuple(PHASE_KNOBS), "eval": ("eval",), "sft": ("sft",)}


def device_memory_bytes(device=None) -> Optional[int]:
    """What XLA's allocator may use on `device` (default: the first local device), from its
    memory_stats()["bytes_limit"]; None where the backend does not say (the CPU)."""
    device = jax.local_devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (backends without allocator statistics raise or return None)
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def capacity_bytes(fallback_gb: float) -> float:
    """What remat auto plans against: the device's allocator limit (device_memory_bytes), or
    `fallback_gb` where the backend reports none (the CPU)."""
    return device_memory_bytes() or fallback_gb * GB


# Past this share of the allocator's limit a phase's program may still compile and run, but
# XLA:GPU then recomputes values to keep its temporaries under the limit (README, Known limits):
# slower, not out of memory. The start-up check warns of such phases (tight_phases).
TIGHT_FILL = 0.95


def tight_phases(memory_plan: MemoryPlan, capacity_bytes: float, phases=None) -> list[str]:
    """The phases (of `phases`, default all) planned within the last 1 - TIGHT_FILL of
    `capacity_bytes` but not over it."""
    names = tuple(memory_plan.phases) if phases is None else phases
    return [n for n in names if n in memory_plan.phases
            and TIGHT_FILL * capacity_bytes < memory_plan.phases[n] <= capacity_bytes]


def check_fits(memory_plan: MemoryPlan, capacity_bytes: int, phases=None,
               source: str = "") -> None:
    """Raises ConfigError when a phase's planned per-device peak exceeds `capacity_bytes`, naming
    each such phase, its planned and available GB, and the config fields that shrink it (the
    old-policy phase also names the feature-cache mode the plan recommends). `phases`: the
    phases to check (default all); `source`: where the capacity came from, for the message."""
    from delta_jax.train.config import ConfigError
    names = tuple(memory_plan.phases) if phases is None else tuple(
        n for n in phases if n in memory_plan.phases)
    over = [(n, memory_plan.phases[n]) for n in names if memory_plan.phases[n] > capacity_bytes]
    if not over:
        return
    lines = []
    for name, need in over:
        already = {f"model.remat={memory_plan.settings.get('remat')}"}  # not what it is
        if memory_plan.settings.get("optimizer_offload"):
            already.add("optim.offload=True")
        knobs = [k for k in PHASE_KNOBS.get(name, ()) if k.split(" (")[0] not in already]
        if replicated_state(memory_plan.settings.get("mesh", (1, 1, 1))):
            knobs.insert(0, REPLICA_KNOB)
        if name == "old-policy pass + DelTA" and memory_plan.recommended_feature_cache not in (
                "", "none", memory_plan.settings.get("feature_cache")):
            knobs.insert(0, f"delta.feature_cache={memory_plan.recommended_feature_cache} "
                            "(recommended by the plan)")
        lines.append(f"phase '{name}' plans {need / GB:.2f} GB per device, "
                     f"{capacity_bytes / GB:.2f} GB available{source and f' ({source})'}; "
                     f"turn: {', '.join(knobs)}")
    raise ConfigError("plan.check_memory: this config will not fit: " + "; ".join(lines)
                      + ". `--config.mode=plan` prints the whole plan; "
                      "--config.plan.check_memory=False skips this check.")
