"""The phases of one RL step, each a function with explicit inputs and outputs (DESIGN.md's data
flow; `rl_step.py` strings them together, times them and owns the run's state):

    collect_rollout(generate_and_score, record_batches, ...)  prompts -> Rollout
        samples + rewards, with DAPO dynamic sampling (rl.dynamic_sampling) when on
    rl.advantages.compute_advantages                          rewards -> advantages
    rollout.pack_rollout                                      -> RolloutBatch (numpy arrays)
    old_policy_features(old_pass, params, ids, attn, ...)    -> OldPolicyFeatures
        log p, entropy and (for DelTA) h or the top-K proxy inputs, in row chunks
    delta_feature_source(...)                                 -> what DelTA reads: v on device,
        or a re-iterable of per-chunk features (host cache, trunk recompute, top-K proxy)
    delta_weights(source, advantages, mask, settings, key=)   -> (weights [N, R], diagnostics)
    update_policy(train_step, state, batch, ...)              -> (state, metric sums, updates)

Nothing here reads a config object or a Run: settings come as plain values or the small frozen
DeltaSettings, programs as callables, data as arrays.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from delta_jax.rl.rewards import REWARD_FNS_KEY
from delta_jax.sampling.output import COUNTERS
from delta_jax.train import rollout as rollout_lib

# ----------------------------------------------------------------------------- rollout


@dataclasses.dataclass
class Rollout:
    """The samples of one RL step, prompt-major (row = i * G + j).

    samples: sampling.GenerationOutput over P prompts x G samples; records: the P prompt records
    (dicts with at least "prompt_ids", "answer"); rewards fp32 [P * G] (shaped: what the
    advantages use); accuracy fp32 [P * G] (0/1, unshaped); stats: float counters (rounds,
    dropped groups, timeouts, responses without an answer, generate / reward seconds);
    reward_fns: each reward function's own rewards {name: fp32 [P * G]} when the scorer has
    several (rl.rewards.REWARD_FNS_KEY), else empty.
    """
    samples: Any
    records: list
    rewards: np.ndarray
    accuracy: np.ndarray
    stats: dict
    reward_fns: dict = dataclasses.field(default_factory=dict)


GenerateAndScore = Callable[[list, int], tuple[Any, np.ndarray, dict]]


# Rollout.stats' key prefix of each of several reward functions' rewards summed over the rounds
REWARD_FN_STAT = "reward_fn/"

# The counters collect_rollout sums over a step's generation rounds: the scorer's, the wall time
# of the sampler and the scorer, and the sampler's own (GenerationOutput.counters).
ROUND_COUNTERS = ("num_timeouts", "num_errors", "num_no_box", "time_generate",
                  "time_reward") + COUNTERS


def collect_rollout(generate_and_score: GenerateAndScore, record_batches: Iterator[list], *,
                    num_prompts: int, group_size: int, dynamic_sampling: bool = False,
                    max_rounds: int = 1, prompts_per_round: int = 0,
                    on_max_rounds: str = "raise") -> Rollout:
    """Prompts -> samples -> rewards, refilled by DAPO dynamic sampling when it is on.

    generate_and_score(records, round) -> (GenerationOutput over the records x group_size,
      rewards fp32 [len(records) * G], info with "accuracy" [len(records) * G] and optional float
      counters (ROUND_COUNTERS: "num_timeouts", "num_errors", "num_no_box", "time_generate",
      "time_reward" and the sampler's own, summed over the rounds) and optional
      "reward_fns" {name: [len(records) * G]} (rl.rewards.REWARD_FNS_KEY); `round` counts the
      generation rounds of this step from 0 (each round draws its own seed).
    record_batches: iterator of lists of prompt records (the data pipeline's batches). Without
      dynamic sampling one batch is drawn and kept whole; with it, rounds of `prompts_per_round`
      records (0: num_prompts) are drawn until `num_prompts` groups with reward variance are kept
      (rl.dynamic_sampling.fill_batch_with_signal); after `max_rounds` rounds a BatchNotFilled, or
      with on_max_rounds "pad" the batch filled up with zero-signal groups (and a warning).
    stats: the ROUND_COUNTERS summed over the rounds, num_scored (the responses they scored),
      "reward_fn/<name>" (each reward function's rewards summed over those), rounds,
      dropped_groups; with dynamic sampling also padded_groups, keep_rate (groups with signal /
      groups generated), dropped_mean_reward. reward_fns: the kept groups' reward_fns.
    """
    G = group_size
    stats = dict.fromkeys(ROUND_COUNTERS + ("num_scored",), 0.0)
    rounds = itertools.count()

    def one_round(records):
        samples, rewards, info = generate_and_score(list(records), next(rounds))
        for key in ROUND_COUNTERS:
            stats[key] += float(info.get(key, 0.0))
        stats["num_scored"] += len(records) * G
        each = {name: np.asarray(part, np.float32).reshape(len(records), G)
                for name, part in info.get(REWARD_FNS_KEY, {}).items()}
        for name, part in each.items():
            key = REWARD_FN_STAT + name
            stats[key] = stats.get(key, 0.0) + float(part.sum())
        return (samples, np.asarray(rewards, np.float32).reshape(len(records), G),
                np.asarray(info["accuracy"], np.float32).reshape(len(records), G), each)

    if not dynamic_sampling:
        records = list(next(record_batches))
        samples, rewards, accuracy, each = one_round(records)
        stats.update(rounds=1.0, dropped_groups=0.0)
    else:
        from delta_jax.rl.dynamic_sampling import BatchNotFilled, fill_batch_with_signal

        def split_round(records):  # one group per prompt: its samples, accuracy [G], reward_fns
            samples, rewards, accuracy, each = one_round(records)
            return ([(rollout_lib.select_groups(samples, [i]), accuracy[i],
                      {name: part[i] for name, part in each.items()})
                     for i in range(len(records))], rewards)

        try:
            filled = fill_batch_with_signal(
                split_round, (r for batch in record_batches for r in batch),
                num_groups=num_prompts, prompts_per_round=prompts_per_round or num_prompts,
                max_rounds=max_rounds, on_max_rounds=on_max_rounds)
        except BatchNotFilled as e:  # name the config fields, not the function's arguments
            raise BatchNotFilled(
                f"{e} Config: rl.dynamic_sampling_max_rounds={max_rounds} caps the rounds of "
                f"{prompts_per_round or num_prompts} prompts "
                f"(rl.dynamic_sampling_prompts_per_round, 0 = rollout.batch_prompts="
                f"{num_prompts}); "
                + ("rl.dynamic_sampling_on_max_rounds=pad fills the batch with zero-signal "
                   "groups instead; " if on_max_rounds == "raise" else "")
                + "rl.dynamic_sampling=False trains on the groups as drawn. A policy that solves "
                "(almost) nothing, e.g. after too short an SFT warm start (sft.steps), can never "
                "fill the batch.") from e
        records, rewards = filled.prompts, filled.rewards
        samples = rollout_lib.concat_samples([g[0] for g in filled.groups])
        accuracy = np.stack([g[1] for g in filled.groups])
        each = {name: np.stack([g[2][name] for g in filled.groups])
                for name in filled.groups[0][2]}
        stats.update(rounds=float(filled.stats["rounds"]),
                     dropped_groups=float(filled.stats["groups_dropped"]),
                     padded_groups=float(filled.stats["groups_padded"]),
                     keep_rate=float(filled.stats["keep_rate"]),
                     dropped_mean_reward=float(filled.stats["dropped_mean_reward"]))
    return Rollout(samples=samples, records=list(records),
                   rewards=np.asarray(rewards, np.float32).reshape(-1),
                   accuracy=np.asarray(accuracy, np.float32).reshape(-1), stats=stats,
                   reward_fns={name: part.reshape(-1) for name, part in each.items()})


# ----------------------------------------------------------------------------- old policy


@dataclasses.dataclass
class OldPolicyFeatures:
    """Outputs of the old-policy pass over all rows (N = rows, R = response length).

    logp, entropy fp32 [N, R] (on device). hidden: h [N, R, H] on device (feature cache
    "device"), HostChunks (cache "host"), or None (not needed / recomputed). topk_ids int32
    [N, R, K] and topk_probs fp32 [N, R, K] with the top-K proxy, else None.
    """
    logp: jax.Array
    entropy: jax.Array
    hidden: Any = None
    topk_ids: jax.Array | None = None
    topk_probs: jax.Array | None = None


@dataclasses.dataclass
class HostChunks:
    """Row chunks of an array kept in host memory with their device shardings (memory kind
    "pinned_host"), so that each process holds only its own shards and a chunk comes back to the
    devices in place, without a collective: `bounds[i] = (start, stop)` rows of `parts[i]`."""
    parts: list
    bounds: list

    @staticmethod
    def offload(x: jax.Array) -> jax.Array:
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))

    def restore(self, i: int) -> jax.Array:
        x = self.parts[i]
        return jax.device_put(x, x.sharding.with_memory_kind("device"))


class PassStopped(Exception):
    """old_policy_features(should_stop=) was told to stop between its chunks."""


def old_policy_features(old_pass: Callable, params, input_ids, attention_mask,
                        response_len: int, *, row_chunk: int,
                        keep_hidden: str = "device",
                        should_stop: Callable[[], bool] | None = None) -> OldPolicyFeatures:
    """Runs old_pass(params, ids, attn, response_len) -> (logp, entropy, hidden | None[, topk_ids,
    topk_probs]) over row chunks of at most `row_chunk` rows.

    keep_hidden: "device" (h concatenated on device), "host" (each chunk's h moved to host memory:
    HostChunks, brought back chunk by chunk by delta_feature_source), "drop" (not kept).
    should_stop: asked after each chunk but the last has run (each is then waited for); when true,
    PassStopped is raised and the rest is not run.
    """
    if keep_hidden not in ("device", "host", "drop"):
        raise ValueError(f"keep_hidden must be device | host | drop, got {keep_hidden!r}")
    n = input_ids.shape[0]
    outs, bounds = [], []
    for s in range(0, n, row_chunk):
        e = min(s + row_chunk, n)
        logp, ent, hid, *topk = old_pass(params, input_ids[s:e], attention_mask[s:e],
                                         response_len)
        if hid is not None and keep_hidden == "host":
            hid = HostChunks.offload(hid)
        elif keep_hidden == "drop":
            hid = None
        outs.append((logp, ent, hid, *topk))
        bounds.append((s, e))
        if should_stop is not None and e < n:
            jax.block_until_ready(logp)
            if should_stop():
                raise PassStopped(f"old-policy pass stopped after {e} of {n} rows")

    def cat(i):
        parts = [o[i] for o in outs]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    hidden = None
    if outs[0][2] is not None:
        hidden = HostChunks([o[2] for o in outs], bounds) if keep_hidden == "host" else cat(2)
    topk = (cat(3), cat(4)) if len(outs[0]) == 5 else (None, None)
    return OldPolicyFeatures(cat(0), cat(1), hidden, *topk)


# ----------------------------------------------------------------------------- DelTA


@dataclasses.dataclass(frozen=True)
class DeltaSettings:
    """The delta.* settings the weights depend on (train/config.py documents each)."""
    num_refine: int = 1
    lam_min: float = 0.8
    lam_max: float = 1.2
    stats_mode: str = "global"     # global | per_shard
    pass_impl: str = "jnp"         # jnp | kernel
    feature_cache: str = "device"  # device | host | recompute
    proxy: str = "last_layer"      # last_layer | hidden_topk
    recompute_chunk: int = 64
    # The paper's ablation rows (rl.delta.Ablations; the defaults are the full method).
    fixed_gamma: float = 0.0       # > 0: gamma+ = gamma- = this value
    assignment: str = "soft"       # soft | hard (alpha = 1[Delta > 0])
    normalize: bool = True         # False: w = lambda (c = 1)
    weight: str = "lambda"         # lambda | alpha (lambda = alpha* on P/N, 0 on Z)
    random_lambda: bool = False    # lambda ~ U[lam_min, lam_max] per P/N token (needs a key)

    @classmethod
    def from_config(cls, delta_cfg) -> "DeltaSettings":
        return cls(**{f.name: delta_cfg[f.name] for f in dataclasses.fields(cls)})

    def ablations(self):
        """The ablation fields as an rl.delta.Ablations."""
        from delta_jax.rl import delta as delta_lib

        return delta_lib.Ablations(fixed_gamma=self.fixed_gamma, assignment=self.assignment,
                                   normalize=self.normalize, weight=self.weight,
                                   random_lambda=self.random_lambda)


@dataclasses.dataclass
class FeatureSource:
    """What the DelTA passes read. Either `features` (v [N, R, H] on device, or h with
    `token_prob` for the last-layer proxy v = (1 - p) h), or `chunks`: a zero-argument callable
    giving a fresh iterable of (start, stop, features [stop - start, R, H]) row chunks, read
    K + 3 times (features recomputed or brought back from host memory on every read)."""
    features: jax.Array | None = None
    token_prob: jax.Array | None = None
    chunks: Callable[[], Iterable[tuple[int, int, jax.Array]]] | None = None


def delta_feature_source(old: OldPolicyFeatures, settings: DeltaSettings, *, params=None,
                         input_ids=None, attention_mask=None, hidden_pass: Callable | None = None,
                         topk_proxy_pass: Callable | None = None,
                         proxy_row_chunk: int | None = None) -> FeatureSource:
    """The DelTA features of one batch from the old-policy pass, per delta.proxy and
    delta.feature_cache.

    Last-layer proxy: h from `old.hidden` (device: as is; host: HostChunks brought back chunk by
    chunk) or, with feature_cache "recompute", from hidden_pass(params, ids, attn, R) (the trunk
    alone) over chunks of settings.recompute_chunk rows; p = exp(old.logp).
    Top-K proxy: v = topk_proxy_pass(params, labels, topk_ids, topk_probs) (the LM head alone),
    built at once in chunks of `proxy_row_chunk` rows (device) or per recompute chunk on every read
    (host / recompute).
    """
    n, R = old.logp.shape
    p = jnp.exp(old.logp)
    if settings.proxy == "hidden_topk":
        if old.topk_ids is None or topk_proxy_pass is None:
            raise ValueError("delta.proxy='hidden_topk' needs the old-policy pass's top-K ids and "
                             "probabilities and a top-K proxy pass")
        labels = input_ids[:, -R:]

        def proxy(s, e):
            return topk_proxy_pass(params, labels[s:e], old.topk_ids[s:e], old.topk_probs[s:e])

        if settings.feature_cache == "device":
            step = proxy_row_chunk or n
            parts = [proxy(s, min(s + step, n)) for s in range(0, n, step)]
            return FeatureSource(features=parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return FeatureSource(chunks=_row_chunks(n, settings.recompute_chunk, proxy))
    if settings.feature_cache == "device":
        if old.hidden is None:
            raise ValueError("delta.feature_cache='device' needs the old-policy pass's hidden "
                             "states (build the pass with them)")
        return FeatureSource(features=old.hidden, token_prob=p)
    if settings.feature_cache == "host":
        if not isinstance(old.hidden, HostChunks):
            raise ValueError("delta.feature_cache='host' needs the old-policy features with "
                             "keep_hidden='host'")
        host = old.hidden
        return FeatureSource(token_prob=p, chunks=lambda: (
            (s, e, host.restore(i)) for i, (s, e) in enumerate(host.bounds)))
    if hidden_pass is None:
        raise ValueError("delta.feature_cache='recompute' needs a hidden (trunk) pass")
    return FeatureSource(token_prob=p, chunks=_row_chunks(
        n, settings.recompute_chunk,
        lambda s, e: hidden_pass(params, input_ids[s:e], attention_mask[s:e], R)))


def _row_chunks(n: int, chunk: int, make: Callable[[int, int], jax.Array]):
    def chunks():
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            yield s, e, make(s, e)
    return chunks


def delta_weights(source: FeatureSource, advantages, mask, settings: DeltaSettings, *,
                  mesh=None, batch_axes: Sequence[str] = ("data",), key=None):
    """DelTA weights fp32 [N, R] (mean 1 over valid tokens unless delta.normalize is off) and
    diagnostics from a FeatureSource.

    One-shot (features on device): rl.delta.delta_coefficients, with global or per-shard
    statistics over `mesh`'s `batch_axes` (delta.stats_mode; global sums over sharded features
    are partitioned by XLA). Chunked sources:
    rl.delta.delta_coefficients_streaming (global statistics, K + 3 reads of the source; K + 2
    with delta.fixed_gamma). The ablation settings go on as rl.delta.Ablations.
    key: PRNG key of the delta.random_lambda draws (required then; None is fine otherwise).
    """
    from delta_jax.rl import delta as delta_lib

    if settings.random_lambda and key is None:
        raise ValueError("delta.random_lambda needs a PRNG key: pass key= to delta_weights")
    common = dict(num_refine=settings.num_refine, lam_min=settings.lam_min,
                  lam_max=settings.lam_max, pass_impl=settings.pass_impl,
                  ablations=settings.ablations(), key=key)
    if source.chunks is None:
        kwargs = dict(common)
        if settings.stats_mode == "per_shard":
            kwargs.update(stats_mode="per_shard", mesh=mesh, data_axes=tuple(batch_axes))
        if source.token_prob is None:
            return delta_lib.delta_coefficients(None, None, advantages, mask,
                                                features=source.features, **kwargs)
        return delta_lib.delta_coefficients(source.features, source.token_prob, advantages, mask,
                                            **kwargs)
    if settings.stats_mode != "global":
        raise ValueError("per-shard DelTA statistics need the features on device "
                         "(delta.feature_cache='device')")
    scale = None if source.token_prob is None else 1.0 - source.token_prob

    def chunks():
        for s, e, v in source.chunks():
            yield delta_lib.FeatureChunk(v, advantages[s:e], mask[s:e],
                                         None if scale is None else scale[s:e])
    parts, diag = delta_lib.delta_coefficients_streaming(chunks, **common)
    return (parts[0] if len(parts) == 1 else jnp.concatenate(parts)), diag


# ----------------------------------------------------------------------------- updates


def update_policy(train_step: Callable, state, batch: dict, *, num_prompts: int, group_size: int,
                  mini_batch_prompts: int, epochs: int, seed: int):
    """PPO-style mini-batch updates: `epochs` passes over the prompt groups in a fresh random
    order (numpy default_rng(seed)), each split into mini-batches of `mini_batch_prompts` whole
    groups (rows i * G .. i * G + G - 1), one train_step(state, mini_batch) each.

    Returns (state, sums of train_step's metrics over the updates, number of updates)."""
    num_mini = num_prompts // mini_batch_prompts
    rng = np.random.default_rng(seed)
    sums: dict = {}
    for _ in range(epochs):
        order = rng.permutation(num_prompts)
        for m in range(num_mini):
            groups = order[m * mini_batch_prompts:(m + 1) * mini_batch_prompts]
            rows = jnp.asarray((groups[:, None] * group_size
                                + np.arange(group_size)[None]).reshape(-1))
            mb = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), batch)
            state, metrics = train_step(state, mb)
            for k, v in jax.device_get(metrics).items():
                sums[k] = sums.get(k, 0.0) + float(v)
    return state, sums, epochs * num_mini
