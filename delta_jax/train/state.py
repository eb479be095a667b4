"""Train state (parameters + optimizer state + step) and the Optax optimizer built from config."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx


@flax.struct.dataclass
class TrainState:
    """Everything the pure train step updates. A pytree; donated to the jitted step.

    step:      int32 scalar, optimizer updates applied so far (skipped updates do not count).
    params:    nnx.State of the model's nnx.Param variables (the whole policy).
    opt_state: the Optax state of the trainable part of `params` (split_trainable): all of it,
               or only the LoRA factors of a model with adapters.
    """
    step: jax.Array
    params: Any
    opt_state: Any


def split_trainable(params):
    """(trainable, frozen) parts of a model's parameter State: (params, None) for full
    fine-tuning; with LoRA adapters (models.LoRAParam variables) the factors and the rest."""
    from delta_jax.models import LoRAParam
    if isinstance(params, nnx.State):
        trainable, frozen = nnx.split_state(params, LoRAParam, ...)
        if jax.tree.leaves(trainable):
            return trainable, frozen
    return params, None


def merge_trainable(trainable, frozen):
    """The whole parameter State from split_trainable's parts."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def trainable_value_and_grad(fn: Callable, params, *args):
    """((value, aux), grads) of fn(params, *args) -> (value, aux), differentiated with respect to
    the trainable part of `params` only (split_trainable): no gradient of frozen base weights is
    formed."""
    trainable, frozen = split_trainable(params)
    return jax.value_and_grad(lambda t, *a: fn(merge_trainable(t, frozen), *a),
                              has_aux=True)(trainable, *args)


def apply_if_finite(state: TrainState, grads, optimizer: optax.GradientTransformation, *,
                    loss: jax.Array, grad_norm: jax.Array) -> tuple[TrainState, jax.Array]:
    """(new state, finite): the optimizer update of `grads` (of the trainable parameters,
    split_trainable) applied only if `loss` and `grad_norm` are finite; otherwise parameters,
    optimizer state and step are kept (jnp.where, so it runs inside jit). `finite` is a bool
    scalar (the step's metrics report 1 - finite as "skipped").

    Every leaf of the new state keeps the dtype it had: Optax's AdamW initialises its moments
    in the parameters' dtype but returns its first moment in float32 when the gradients are
    float32 (a bfloat16 model's are after the train step divides them by its float32 token
    count, train.step.make_train_step), which made the state a bfloat16 run
    donates to its second step another type than its first's: the jitted step compiled twice,
    and that state held the first moment in float32 (2 bytes a parameter more than plan mode
    counts: Qwen3-1.7B's step, compiled for a TPU, output 3.2 GiB more state than it took).
    The moments are kept as they were created, in the parameters' dtype, as torch's AdamW keeps
    them for bfloat16 parameters."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    trainable, frozen = split_trainable(state.params)
    updates, new_opt = optimizer.update(grads, state.opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    keep = lambda new, old: jnp.where(finite, new, old).astype(old.dtype)  # noqa: E731
    new_state = TrainState(
        step=state.step + finite.astype(jnp.int32),
        params=merge_trainable(jax.tree.map(keep, new_trainable, trainable), frozen),
        opt_state=jax.tree.map(keep, new_opt, state.opt_state))
    return new_state, finite


def learning_rate_schedule(lr: float, schedule: str = "constant", warmup_steps: int = 0,
                           total_steps: int = 1, min_lr_ratio: float = 0.0) -> optax.Schedule:
    """Linear warmup to `lr`, then constant | cosine | linear decay to lr * min_lr_ratio."""
    decay_steps = max(total_steps - warmup_steps, 1)
    end = lr * min_lr_ratio
    if schedule == "constant":
        main = optax.constant_schedule(lr)
    elif schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, decay_steps, alpha=min_lr_ratio)
    elif schedule == "linear":
        main = optax.linear_schedule(lr, end, decay_steps)
    else:
        raise ValueError(f"optim.schedule: unknown schedule {schedule!r}")
    if warmup_steps <= 0:
        return main
    warmup = optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


class MasterWeightsState(NamedTuple):
    """with_master_weights' state: `master`, a float32 copy of the parameters (an empty tuple
    when they are float32 already), and the wrapped optimizer's state (of `master`)."""
    master: Any
    inner: Any


def _needs_master(params) -> bool:
    return any(jnp.dtype(x.dtype) != jnp.float32 for x in jax.tree.leaves(params))


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` applied to a float32 master copy of lower-precision (bfloat16) parameters.

    A bfloat16 parameter keeps 8 significant bits: an update below half its spacing (2^-9 to
    2^-8 of its magnitude) rounds away. The paper's recipe (lr 1e-6, AdamW updates of ~lr) on
    Qwen3 weights of magnitude ~0.02 moves a bfloat16 weight only if it is below ~5e-4 in
    magnitude: updated in bfloat16, about 98% of the weights and every norm scale never change.
    Here the optimizer's state holds the parameters in float32 (`master`, 4 bytes a parameter)
    and the wrapped optimizer's state follows it (AdamW's moments in float32); the gradients are
    taken to float32 first. The update moves `master` and returns, for each parameter, the step from
    its current value to `master` rounded to the parameter's dtype (in float32, where that
    difference of two bfloat16 numbers is exact), so optax.apply_updates leaves every parameter
    equal to its master copy rounded. The forward, the sampler and every pass read the
    bfloat16 parameters as before. float32 parameters need no copy: then this is `inner`
    unchanged (the state's `master` is empty)."""

    def init(params):
        if not _needs_master(params):
            return MasterWeightsState(master=(), inner=inner.init(params))
        master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return MasterWeightsState(master=master, inner=inner.init(master))

    def update(grads, state, params=None):
        if not jax.tree.leaves(state.master):
            updates, new_inner = inner.update(grads, state.inner, params)
            return updates, MasterWeightsState(master=state.master, inner=new_inner)
        if params is None:
            raise ValueError("with_master_weights: update() needs the current parameters")
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
        updates, new_inner = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        to_master = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32),
            master, params)
        return to_master, MasterWeightsState(master=master, inner=new_inner)

    return optax.GradientTransformation(init, update)


def make_optimizer(lr_schedule: optax.Schedule, *, weight_decay: float = 0.1, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, max_grad_norm: float = 1.0,
                   master_weights: bool = True) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay on every parameter, as the reference's torch AdamW) after a
    global grad-norm clip (0 disables the clip). master_weights: bfloat16 parameters are updated
    through a float32 master copy, the moments in float32 (with_master_weights; config
    optim.master_weights); False updates them in their own dtype."""
    parts = []
    if max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(optax.adamw(lr_schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    chain = optax.chain(*parts)
    return with_master_weights(chain) if master_weights else chain


def optimizer_from_config(optim_cfg, total_steps: int):
    """(optax optimizer, schedule) from the config's `optim` block."""
    schedule = learning_rate_schedule(optim_cfg.lr, optim_cfg.schedule, optim_cfg.warmup_steps,
                                      total_steps, optim_cfg.min_lr_ratio)
    opt = make_optimizer(schedule, weight_decay=optim_cfg.weight_decay, b1=optim_cfg.b1,
                         b2=optim_cfg.b2, eps=optim_cfg.eps, max_grad_norm=optim_cfg.max_grad_norm,
                         master_weights=optim_cfg.master_weights)
    return opt, schedule


def split_model(model: nnx.Module):
    """(graphdef, params, rest): params are the nnx.Param variables; rest is any other state
    (kept fixed by training)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, rest


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(split_trainable(params)[0]))


def abstract_train_state(params, optimizer: optax.GradientTransformation, mesh):
    """(the TrainState init_train_state(params, optimizer) builds, as ShapeDtypeStructs placed on
    `mesh` by the rules table; those NamedShardings): nothing is allocated. `params` may be
    abstract (jax.eval_shape / nnx.eval_shape)."""
    from delta_jax import sharding
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer), params)
    shardings = sharding.tree_shardings(state, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, shardings), shardings
