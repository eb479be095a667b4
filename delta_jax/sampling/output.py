"""Shapes, buckets, host transfer and the GenerationOutput of the rollout engine."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import numpy as np


def bucket_size(n: int, minimum: int = 1, multiple_of: int = 1) -> int:
    """The next power of two >= max(n, minimum), rounded up to a multiple of `multiple_of`."""
    size = 1 << max(0, math.ceil(math.log2(max(n, minimum, 1))))
    return -(-size // multiple_of) * multiple_of


def fetch_global(tree):
    """Host numpy copies of the global values of a pytree of arrays.

    On one process this is jax.device_get. When a mesh spans processes, an output sharded over it
    is not fully addressable (each process holds only its own devices' shards) and
    jax.device_get fails; those arrays are all-gathered across processes
    (multihost_utils.process_allgather), so every process gets the whole value. Every process
    must call this with the same arrays (it is a collective then).
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)


# GenerationOutput.counters(): the stats that add up over generate() calls.
COUNTERS = ("generated_tokens", "decode_steps", "slot_steps", "preemptions", "resumed",
            "prefill_seconds", "decode_seconds", "seconds")


@dataclasses.dataclass
class GenerationOutput:
    """Per-sample results; lists are indexed [prompt i][sample j].

    prompt_ids[i]: list[int], the prompt as generated from (after any left truncation).
    response_ids[i][j]: list[int], the stop token included when one was generated.
    logprobs[i][j]: list[float], log-probs of response_ids under the sampling distribution (the
      tempered, top-k / top-p filtered, renormalised one). Greedy: under softmax(z), T = 1.
    tempered_logprobs[i][j]: list[float], under softmax(z / T) without filtering (what the RL
      old-policy pass recomputes). Equal to logprobs when nothing is filtered.
    response_lengths[i][j]: int. truncated[i][j]: True when max_new_tokens was reached without a
      stop token. texts[i][j]: decoded responses (stop token dropped) when a tokenizer was given.
    stats: counters of the run: decode_steps (decode steps run, each for all slots at once, or
      for the rows a shrunk call runs), generated_tokens, slot_utilization (mean fraction of
      slots holding a live sample per decode step = generated_tokens / (decode_steps * slots)),
      slots, decode_rows (mean rows a decode step ran: slots unless calls were shrunk),
      shrunk_calls (decode calls that ran fewer rows than slots: Sampler shrink_batch), decode_calls,
      prefill_calls, prefilled_prompts, preemptions, resumed (preempted samples that resumed
      with their tokens: Sampler resume_preempted) and resumed_tokens (tokens they had, not
      decoded again), queue_refills, kv_pages / kv_page_size / kv_bytes (the page
      pool), prefill_seconds / decode_seconds (wall time in those programs, synchronised; a
      refill's page copies run unsynchronised before the next decode call and count in its
      decode_seconds: until 2026-11-24 a synchronised copy counted as prefill), seconds.
    """

    prompt_ids: list
    response_ids: list
    logprobs: list
    tempered_logprobs: list
    response_lengths: list
    truncated: list
    texts: Optional[list] = None
    stats: dict = dataclasses.field(default_factory=dict)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_ids)

    @property
    def n(self) -> int:
        return len(self.response_ids[0]) if self.response_ids else 0

    def counters(self) -> dict[str, float]:
        """The stats that add up over several generate() calls (COUNTERS): generated_tokens,
        decode_steps, slot_steps (decode steps x slots), preemptions, resumed, prefill_seconds,
        decode_seconds, seconds; zeros for an output without stats."""
        s = self.stats
        if not s:
            return dict.fromkeys(COUNTERS, 0.0)
        return {"generated_tokens": float(s["generated_tokens"]),
                "decode_steps": float(s["decode_steps"]),
                "slot_steps": float(s["decode_steps"] * s["slots"]),
                "preemptions": float(s["preemptions"]), "resumed": float(s["resumed"]),
                "prefill_seconds": float(s["prefill_seconds"]),
                "decode_seconds": float(s["decode_seconds"]), "seconds": float(s["seconds"])}

    def padded(self, pad_id: int = 0, prompt_len: Optional[int] = None,
               response_len: Optional[int] = None) -> dict[str, np.ndarray]:
        """One row per sample (row = i * n + j): prompt left-padded, response right after it.

        prompt_len / response_len: pad to at least these (default: the longest in the output).
        With P = prompt_len, R = response_len, L = P + R, returns
          input_ids int32 [B*n, L]; attention_mask int32 [B*n, L] (prompt + response tokens);
          response_mask int32 [B*n, L] (response tokens only); positions int32 [B*n, L]
          (cumsum(attention_mask) - 1, clipped at 0: the positions the sampler used);
          logprobs, tempered_logprobs float32 [B*n, L]: at column t the log-prob of
          input_ids[:, t] given the columns before it (0 outside the response), so the model's
          output at column t - 1 is the one to teacher-force against;
          prompt_index, sample_index, prompt_lengths, response_lengths int32 [B*n];
          truncated bool [B*n]; prompt_len, response_len: the P and R used (ints).
        """
        rows = [(i, j) for i in range(self.num_prompts) for j in range(self.n)]
        max_prompt = max((len(p) for p in self.prompt_ids), default=0)
        max_resp = max((len(self.response_ids[i][j]) for i, j in rows), default=0)
        P = max_prompt if prompt_len is None else int(prompt_len)
        R = max_resp if response_len is None else int(response_len)
        if P < max_prompt:
            raise ValueError(f"padded: prompt_len={P} < longest prompt ({max_prompt})")
        if R < max_resp:
            raise ValueError(f"padded: response_len={R} < longest response ({max_resp})")
        num, L = len(rows), P + R
        out = {
            "input_ids": np.full((num, L), pad_id, np.int32),
            "attention_mask": np.zeros((num, L), np.int32),
            "response_mask": np.zeros((num, L), np.int32),
            "logprobs": np.zeros((num, L), np.float32),
            "tempered_logprobs": np.zeros((num, L), np.float32),
            "prompt_index": np.asarray([i for i, _ in rows], np.int32).reshape(num),
            "sample_index": np.asarray([j for _, j in rows], np.int32).reshape(num),
            "prompt_lengths": np.zeros(num, np.int32),
            "response_lengths": np.zeros(num, np.int32),
            "truncated": np.zeros(num, bool),
        }
        for r, (i, j) in enumerate(rows):
            prompt, resp = self.prompt_ids[i], self.response_ids[i][j]
            out["input_ids"][r, P - len(prompt):P] = prompt
            out["input_ids"][r, P:P + len(resp)] = resp
            out["attention_mask"][r, P - len(prompt):P + len(resp)] = 1
            out["response_mask"][r, P:P + len(resp)] = 1
            out["logprobs"][r, P:P + len(resp)] = self.logprobs[i][j]
            out["tempered_logprobs"][r, P:P + len(resp)] = self.tempered_logprobs[i][j]
            out["prompt_lengths"][r] = len(prompt)
            out["response_lengths"][r] = len(resp)
            out["truncated"][r] = self.truncated[i][j]
        out["positions"] = np.maximum(np.cumsum(out["attention_mask"], axis=1) - 1, 0).astype(
            np.int32)
        out["prompt_len"], out["response_len"] = P, R
        return out
