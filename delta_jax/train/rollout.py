"""Assembly of the arrays one RL step trains on, from the sampler's GenerationOutput:

    batch = pack_rollout(samples, advantages, rewards, pad_id)  # RolloutBatch (numpy arrays)
    select_groups(samples, keep) / concat_samples(parts)        # prompt groups of outputs
    step_seed(seed, step, salt)                                 # every random draw of a step

Rows are ordered prompt-major (row = i * G + j), so a group is a contiguous block of G rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from delta_jax.sampling import bucket_size


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A 31-bit seed determined by (seed, step, salt): every random draw of step `step` uses it,
    so a resumed run draws exactly what an uninterrupted run draws."""
    return int(np.random.SeedSequence([seed, step, salt]).generate_state(1)[0] & 0x7FFFFFFF)


@dataclasses.dataclass
class RolloutBatch:
    """Teacher-forcing arrays of one rollout batch (N = prompts x group_size rows).

    input_ids int32 [N, P + R]; attention_mask int32 [N, P + R]; response_mask fp32 [N, R];
    sampler_logp fp32 [N, R] (the sampler's log-probs under softmax(z / T), for diagnostics);
    advantages fp32 [N]; rewards fp32 [N]; response_lengths int32 [N]; truncated bool [N].
    """
    input_ids: np.ndarray
    attention_mask: np.ndarray
    response_mask: np.ndarray
    sampler_logp: np.ndarray
    advantages: np.ndarray
    rewards: np.ndarray
    response_lengths: np.ndarray
    truncated: np.ndarray
    prompt_len: int
    response_len: int

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]


def pack_rollout(samples, advantages, rewards, pad_id: int, min_bucket: int = 16) -> RolloutBatch:
    """Pads the samples to power-of-two buckets (a few compiled shapes per run)."""
    max_prompt = max(len(p) for p in samples.prompt_ids)
    max_resp = max((len(r) for group in samples.response_ids for r in group), default=1)
    P = bucket_size(max_prompt, min_bucket)
    R = bucket_size(max(max_resp, 1), min_bucket)
    arr = samples.padded(pad_id=pad_id, prompt_len=P, response_len=R)
    return RolloutBatch(
        input_ids=arr["input_ids"],
        attention_mask=arr["attention_mask"],
        response_mask=arr["response_mask"][:, P:].astype(np.float32),
        sampler_logp=arr["tempered_logprobs"][:, P:].astype(np.float32),
        advantages=np.asarray(advantages, np.float32).reshape(-1),
        rewards=np.asarray(rewards, np.float32).reshape(-1),
        response_lengths=arr["response_lengths"],
        truncated=arr["truncated"],
        prompt_len=P, response_len=R)


def flat(nested):
    """[[a, b], [c, d]] -> [a, b, c, d] (prompt-major)."""
    return [x for group in nested for x in group]


def select_groups(samples, keep):
    """A GenerationOutput restricted to the prompts `keep` (indices)."""
    return dataclasses.replace(
        samples,
        prompt_ids=[samples.prompt_ids[i] for i in keep],
        response_ids=[samples.response_ids[i] for i in keep],
        logprobs=[samples.logprobs[i] for i in keep],
        tempered_logprobs=[samples.tempered_logprobs[i] for i in keep],
        response_lengths=[samples.response_lengths[i] for i in keep],
        truncated=[samples.truncated[i] for i in keep],
        texts=None if samples.texts is None else [samples.texts[i] for i in keep])


def concat_samples(parts):
    """Concatenates GenerationOutputs along the prompt axis."""
    first = parts[0]
    fields = ("prompt_ids", "response_ids", "logprobs", "tempered_logprobs", "response_lengths",
              "truncated")
    out = {f: [x for p in parts for x in getattr(p, f)] for f in fields}
    texts = None if first.texts is None else [x for p in parts for x in p.texts]
    return dataclasses.replace(first, texts=texts, stats={}, **out)


def rollout_metrics(batch: RolloutBatch, accuracy: np.ndarray, max_new_tokens: int) -> dict:
    """Scalar metrics of the rollout (lengths, truncation, reward and accuracy)."""
    lengths = batch.response_lengths.astype(np.float64)
    return {
        "rollout/reward_mean": float(batch.rewards.mean()),
        "rollout/reward_std": float(batch.rewards.std()),
        "rollout/accuracy": float(np.mean(accuracy)),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncation_rate": float(np.mean(batch.truncated)),
        "rollout/clipped_to_max_rate": float(np.mean(lengths >= max_new_tokens)),
        "rollout/advantage_abs_mean": float(np.abs(batch.advantages).mean()),
        "rollout/zero_advantage_frac": float(np.mean(batch.advantages == 0)),
        "rollout/num_sequences": float(batch.num_rows),
    }
