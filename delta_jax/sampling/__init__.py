"""Rollout engine: continuous batching over slots with a paged KV cache.

    from delta_jax.sampling import Sampler
    sampler = Sampler(model, tokenizer=None, max_batch_size=256)
    out = sampler.generate(prompt_ids, n=1, temperature=0.0, top_p=1.0, top_k=-1,
                           max_new_tokens=32, stop_token_ids=(eos_id,), seed=0)
    out.response_ids[i][j]   # list[int], prompt i, sample j (the stop token included)
    out.logprobs[i][j]       # list[float], log-probs under the sampling distribution
    batch = out.padded()     # dict of [num_prompts * n, L] arrays for teacher forcing

Modules: scheduler (the Sampler: slots, admission, preemption, the host loop), kv_cache (page
pool sizing and the page allocator), programs (the jitted prefill / page copy / decode
programs), output (GenerationOutput, buckets, host transfer). Token filtering and sampling math:
delta_jax.sampling_utils. Decode attention over pages: delta_jax.models.attention.
"""
from delta_jax.sampling.kv_cache import KVPlan, PageAllocator, plan_kv
from delta_jax.sampling.output import GenerationOutput, bucket_size, fetch_global
from delta_jax.sampling.scheduler import (DEFAULT_BATCH_AXES, GenerationStopped, Sampler,
                                          prefill_rows_per_shard, widest_resume_prefill)

__all__ = ["DEFAULT_BATCH_AXES", "GenerationOutput", "GenerationStopped", "KVPlan",
           "PageAllocator", "Sampler",
           "bucket_size", "fetch_global", "plan_kv", "prefill_rows_per_shard",
           "widest_resume_prefill"]
