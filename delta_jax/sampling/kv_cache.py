"""The rollout engine's paged KV memory: pool sizing (the plan) and the host-side page allocator.

A sequence's keys/values live in pages of `page_size` tokens of one pool per layer
(models.PagedKVCache, [K, num_pages, page_size, D] each); a block table row lists its pages in
order. Page 0 is the scratch page: unused block-table entries point there and no sequence attends
it (padding rows write nowhere: their page id is -1).

On a mesh the pool is split over the batch shards (the product S of the batch axes' sizes): the
slots are divided evenly among the shards (slot s belongs to shard s // (slots / S)) and each
shard owns a contiguous range of `pages_per_shard` pages of the pool's page axis (its own
scratch page, local page 0, included). Block tables and page writes use LOCAL page ids (global
id minus shard * pages_per_shard), so a shard reads and writes only its own pages, and the host
keeps one PageAllocator per shard. S = 1 is the single pool above.

What a sample holds (prompt of P tokens, KV of its first P - 1 tokens shared, the last prompt
token being the first input of decode):
  shared, per prompt: ceil((P - 1) / page_size) pages, prefilled once (the full pages are in
    every sample's table; the last, partial one stays pristine);
  own, per sample: a copy of the partial prompt page (if any) and the pages its response grows
    into, taken a decode call ahead of need and given back when it stops.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from delta_jax import models
from delta_jax.sampling.output import bucket_size


def pages_for(tokens: int, page_size: int) -> int:
    return -(-max(int(tokens), 0) // page_size)


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """The page pool of one generate call.

    page_size: tokens per page. num_pages: pages in the pool (all shards), the scratch pages
    included. pages_per_seq: block-table width (a power of two). page_bytes: one page, K and V,
    all layers. worst_case_pages: the pool (all shards) that never preempts (every slot at its
    longest at once). shards: batch shards the pool is split over (num_pages = shards *
    pages_per_shard; each shard's range starts with its scratch page).
    """

    page_size: int
    num_pages: int
    pages_per_seq: int
    page_bytes: int
    worst_case_pages: int
    shards: int = 1

    @property
    def pages_per_shard(self) -> int:
        return self.num_pages // self.shards

    @property
    def bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def shard_bytes(self) -> int:
        """One shard's pages: what each device of a batch shard holds (before any split of the
        KV heads over "tensor")."""
        return self.pages_per_shard * self.page_bytes


def sample_pages(prompt_len: int, max_new_tokens: int, page_size: int) -> tuple[int, int]:
    """(shared prompt pages, own pages at most) of one sample."""
    kv_prompt = prompt_len - 1
    shared = pages_for(kv_prompt, page_size)
    own = pages_for(kv_prompt + max_new_tokens, page_size) - kv_prompt // page_size
    return shared, own


def plan_kv(cfg: models.ModelConfig, *, slots: int, prompt_len: int, max_new_tokens: int,
            page_size: int, kv_budget_bytes: Optional[int] = None, min_prompt_bucket: int = 16,
            min_response_bucket: int = 16, dtype=None, shards: int = 1) -> KVPlan:
    """The pool for `slots` concurrent samples of prompts up to `prompt_len` tokens and
    responses up to `max_new_tokens`, split over `shards` batch shards (slots / shards each,
    rounded up; each shard's pages are sized for its own slots).

    Without a budget the pool is the worst case (no sample ever waits for memory); its size is
    a function of the bucketed prompt length and max_new_tokens, so calls of similar shapes
    share compiled programs.
    With kv_budget_bytes (the bytes of ONE shard's pages, i.e. the KV memory of each device
    before any split of the KV heads over "tensor"; with shards=1 the whole pool) each shard's
    pages are min(its worst case, budget): samples then take pages as they
    grow, and when the pool runs dry the newest samples are preempted and resume or restart
    later (Sampler resume_preempted; the same tokens: the randomness is per sample and token
    position). Raises ValueError when the budget
    cannot hold one sample of the longest prompt at max_new_tokens (the call could never end).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    prompt_bucket = bucket_size(prompt_len, min_prompt_bucket)
    response_bucket = bucket_size(max_new_tokens, min_response_bucket)
    per_page = models.page_bytes(cfg, page_size, dtype)
    pages_per_seq = bucket_size(pages_for(prompt_bucket + response_bucket, page_size))
    prompt_pages = pages_for(prompt_bucket, page_size)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    slots_per_shard = -(-int(slots) // shards)
    # Per shard: every slot may hold a distinct prompt's shared pages and its own response
    # pages; one more prompt (the next one, partly admitted) may hold its shared pages; + the
    # shard's scratch page. (max_new_tokens exact: callers such as the trainer keep it fixed, so
    # the pool's shape is.)
    worst = (1 + slots_per_shard * (prompt_pages + pages_for(max_new_tokens, page_size) + 1)
             + prompt_pages)
    num_pages = worst
    if kv_budget_bytes is not None:
        budget_pages = int(kv_budget_bytes) // per_page
        shared, own = sample_pages(prompt_len, max_new_tokens, page_size)
        if budget_pages < 1 + shared + own:
            raise ValueError(
                f"rollout KV budget of {kv_budget_bytes / 2**30:.3f} GiB holds {budget_pages} pages "
                f"of {page_size} tokens ({per_page} bytes each); one sample of a {prompt_len}-token "
                f"prompt with max_new_tokens={max_new_tokens} needs {1 + shared + own} "
                f"({(1 + shared + own) * per_page / 2**30:.3f} GiB)")
        num_pages = min(worst, budget_pages)
    return KVPlan(page_size=page_size, num_pages=shards * num_pages, pages_per_seq=pages_per_seq,
                  page_bytes=per_page, worst_case_pages=shards * worst, shards=shards)


class PageAllocator:
    """Free list of the pool's pages 1 .. num_pages - 1 (page 0 is the scratch page); on a mesh,
    one per batch shard over its LOCAL pages (num_pages = KVPlan.pages_per_shard)."""

    def __init__(self, num_pages: int):
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"PageAllocator: {count} pages asked, {len(self._free)} free")
        if count <= 0:
            return []
        taken = self._free[-count:][::-1]
        del self._free[-count:]
        return taken

    def give(self, pages) -> None:
        self._free.extend(reversed(list(pages)))
