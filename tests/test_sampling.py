"""The rollout engine (delta_jax.sampling) on tiny models: transformers parity, log-prob
consistency with a teacher-forced pass, continuous batching and its invariances (slots, pages,
preemption, mesh), the KV budget, bad input."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax import models
from delta_jax.sampling import GenerationOutput, Sampler, bucket_size, plan_kv, programs
from tests.test_sampling_filters import reference_distribution

PROMPTS = [[3, 17, 42], [5, 6, 7, 8, 9, 10, 11, 12, 13], [99], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def tiny_model():
    return models.Transformer(models.get_preset("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sampler(tiny_model):
    return Sampler(tiny_model, max_batch_size=16)


def teacher_forced_logits(model, batch):
    """[B*n, L - 1, V] logits predicting input_ids[:, 1:], from one no-cache forward pass."""
    out = model(jnp.asarray(batch["input_ids"]), positions=jnp.asarray(batch["positions"]),
                attention_mask=jnp.asarray(batch["attention_mask"]))
    return np.asarray(out.logits[:, :-1], np.float64)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ------------------------------------------------------------------------------------------
# Parity with transformers


def _hf_model(kind, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                  initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "qwen3":
        config = transformers.Qwen3Config(**common)
        hf = transformers.Qwen3ForCausalLM(config).eval()
    else:
        config = transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    return torch, hf


def _hf_greedy(torch, hf, prompt, max_new_tokens, eos):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_matches_transformers(kind, tmp_path):
    torch, hf = _hf_model(kind, tmp_path)
    model = models.from_pretrained(str(tmp_path), dtype=jnp.float32)
    max_new = 12
    free = [_hf_greedy(torch, hf, p, max_new, None) for p in PROMPTS]
    # A stop token that the greedy path actually emits part-way through some response.
    eos = next(r[k] for r in free for k in range(2, max_new - 2) if r[k] not in r[:k])
    hf_out = [_hf_greedy(torch, hf, p, max_new, eos) for p in PROMPTS]
    assert any(len(r) < max_new and r[-1] == eos for r in hf_out)

    out = Sampler(model, max_batch_size=16).generate(
        PROMPTS, n=1, temperature=0.0, max_new_tokens=max_new, stop_token_ids=(eos,))
    for i in range(len(PROMPTS)):
        assert out.response_ids[i][0] == hf_out[i], f"prompt {i}"
        assert out.truncated[i][0] == (eos not in hf_out[i])
        assert out.response_lengths[i][0] == len(hf_out[i])


# ------------------------------------------------------------------------------------------
# Log-probs against a teacher-forced pass


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 40, 0.9)])
def test_logprobs_match_teacher_forced_pass(tiny_model, sampler, temperature, top_k, top_p):
    out = sampler.generate(PROMPTS, n=3, temperature=temperature, top_k=top_k, top_p=top_p,
                           max_new_tokens=10, stop_token_ids=(1, 2, 3), seed=4)
    batch = out.padded()
    mask = batch["response_mask"][:, 1:].astype(bool)
    targets = batch["input_ids"][:, 1:]
    logits = teacher_forced_logits(tiny_model, batch)
    tempered = np.take_along_axis(log_softmax(logits / temperature), targets[..., None], -1)[..., 0]
    err = np.abs(tempered - batch["tempered_logprobs"][:, 1:])[mask]
    assert err.max() <= 1e-4
    # The sampling distribution: the NumPy reference of the filter (test_sampling_filters) on
    # the teacher-forced logits of each response position.
    rows, cols = np.nonzero(mask)
    probs = np.asarray([reference_distribution(logits[r, c], temperature, top_k, top_p)
                        [targets[r, c]] for r, c in zip(rows, cols)])
    assert (probs > 0).all()  # every sampled token lies in the kept set
    assert np.abs(np.log(probs) - batch["logprobs"][:, 1:][mask]).max() <= 1e-4
    if (top_k, top_p) != (-1, 1.0):
        assert (batch["logprobs"][:, 1:][mask] > tempered[mask] + 1e-3).all()  # renormalised
    # The padded rows are consistent with the per-sample lists.
    assert mask.sum() == sum(sum(r) for r in out.response_lengths)


# ------------------------------------------------------------------------------------------
# Batching, stopping and parameter swaps


def test_results_do_not_depend_on_scheduling(tiny_model, sampler):
    """Two slots (n > slots: a prompt's samples run at different times), pages of 4 tokens,
    3 decode steps per call, and a KV budget so small that samples are preempted and restarted:
    the same tokens as 16 slots."""
    kwargs = dict(n=3, temperature=1.0, max_new_tokens=8, stop_token_ids=(7,), seed=11)
    ref = sampler.generate(PROMPTS, **kwargs)
    small = Sampler(tiny_model, max_batch_size=2, page_size=4,
                    decode_steps_per_call=3).generate(PROMPTS, **kwargs)
    # Each prompt prefilled once (a 1-token prompt has no KV to share: its token is decoded).
    assert small.stats["slots"] == 2 and small.stats["prefilled_prompts"] == 3
    assert small.response_ids == ref.response_ids
    np.testing.assert_allclose(np.concatenate(sum(small.logprobs, [])),
                               np.concatenate(sum(ref.logprobs, [])), atol=1e-5)
    page = models.page_bytes(tiny_model.cfg, 4)
    tight = Sampler(tiny_model, max_batch_size=8, page_size=4, decode_steps_per_call=2,
                    kv_budget_bytes=12 * page).generate(PROMPTS, **kwargs)
    assert tight.stats["kv_pages"] == 12 and tight.stats["preemptions"] > 0
    assert tight.stats["resumed"] > 0  # with the tokens they had (resume_preempted)
    assert tight.response_ids == ref.response_ids
    static = Sampler(tiny_model, max_batch_size=4, continuous=False).generate(PROMPTS, **kwargs)
    assert static.response_ids == ref.response_ids
    # A length schedule (one max_new_tokens per prompt) cuts the same samples short.
    limits = [8, 3, 1, 5]
    cut = sampler.generate(PROMPTS, **{**kwargs, "max_new_tokens": limits})
    assert cut.response_ids == [[r[:limit] for r in rows]
                                for rows, limit in zip(ref.response_ids, limits)]
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampler.generate(PROMPTS, max_new_tokens=[8, 3])
    # The n samples of a prompt are different draws; another seed gives other samples.
    assert all(len({tuple(r) for r in ref.response_ids[i]}) == 3 for i in range(len(PROMPTS)))
    assert sampler.generate(PROMPTS, **{**kwargs, "seed": 12}).response_ids != ref.response_ids


def test_should_stop_ends_generate_after_a_decode_call_and_the_sampler_goes_on(tiny_model):
    """generate(should_stop=) is asked after every decode call: true at the second ask ends the
    call with GenerationStopped after 2 decode calls of 3 steps (the samples need up to 8), and
    the sampler's next call gives the tokens of an uninterrupted one."""
    from delta_jax.sampling import GenerationStopped
    kwargs = dict(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    stopping = Sampler(tiny_model, max_batch_size=8, decode_steps_per_call=3)
    asked = []
    with pytest.raises(GenerationStopped, match=r"after 6 decode steps, \d+ of 8 samples done"):
        stopping.generate(PROMPTS, should_stop=lambda: asked.append(1) or len(asked) == 2,
                          **kwargs)
    assert len(asked) == 2
    ref = Sampler(tiny_model, max_batch_size=8, decode_steps_per_call=3).generate(PROMPTS,
                                                                                  **kwargs)
    assert ref.stats["decode_steps"] > 6  # the stop came before the end
    assert stopping.generate(PROMPTS, should_stop=lambda: False, **kwargs).response_ids == (
        ref.response_ids)


def test_slot_page_needs_agree_with_each_samples(tiny_model, monkeypatch):
    """reserve() reads every slot's page need from the slot arrays at once (_slot_needs); at each
    reserve of a run with refills and preemptions (a 12-page pool) it equals _need of the slot's
    sample, and free slots need none."""
    from delta_jax.sampling import scheduler
    seen = []
    reserve = scheduler._Run.reserve

    def checked(run):
        needs = run._slot_needs()
        want = [run._need(x) if x is not None else 0 for x in run.slots]
        assert needs.tolist() == want
        seen.append(sum(w > 0 for w in want))
        return reserve(run)

    monkeypatch.setattr(scheduler._Run, "reserve", checked)
    page = models.page_bytes(tiny_model.cfg, 4)
    out = Sampler(tiny_model, max_batch_size=8, page_size=4, decode_steps_per_call=2,
                  kv_budget_bytes=12 * page).generate(
        PROMPTS, n=3, temperature=1.0, max_new_tokens=8, stop_token_ids=(7,), seed=11)
    assert out.stats["preemptions"] > 0 and len(seen) > 3 and max(seen) > 1


def test_preempted_samples_resume_where_they_stopped(tiny_model, monkeypatch):
    """A page pool of 40 four-token pages for 16 slots of long-tailed samples: preempted samples
    resume with the tokens they had (resume_preempted, the default) after one prefill of their
    prompt and those tokens (widths at most MAX_PREFILL_TOKENS; longer ones restart), written
    into pages of their own after their prompt's shared pages where a shard holds those, all of
    it into their own pages elsewhere; the same tokens and log-probs as the worst-case pool,
    which preempts nothing, and as restarting every preempted sample, in fewer decode steps
    than restarting."""
    from delta_jax.sampling import scheduler
    assert Sampler.__init__.__kwdefaults__["resume_preempted"] is True
    rng = np.random.RandomState(0)
    prompts = [rng.randint(21, 256, rng.randint(4, 40)).tolist() for _ in range(12)]
    kwargs = dict(n=4, temperature=1.0, max_new_tokens=64, stop_token_ids=tuple(range(1, 21)),
                  seed=3)
    ref = Sampler(tiny_model, max_batch_size=16).generate(prompts, **kwargs)
    assert ref.stats["preemptions"] == 0
    resumed_lengths = []
    resume = scheduler._Run._resume

    kinds = collections.Counter()

    def recorded(run, jobs):
        for shard, sample in jobs:
            prompt = run.prompts[sample.prompt]
            assert sample.length == prompt.kv_len + len(sample.tokens) and sample.own
            if sample.private:  # its prompt's keys and values in pages of its own too
                assert sample.pages == sample.own
            else:  # on a shard holding its prompt's pages, which it reads
                full = prompt.kv_len // run.ps
                assert sample.pages == prompt.pages[shard][:full] + sample.own
                assert prompt.live[shard] > 0
            kinds[sample.private] += 1
            resumed_lengths.append(sample.length)
        return resume(run, jobs)

    monkeypatch.setattr(scheduler._Run, "_resume", recorded)
    page = models.page_bytes(tiny_model.cfg, 4)

    def tight(**kw):
        return Sampler(tiny_model, max_batch_size=16, page_size=4, decode_steps_per_call=3,
                       kv_budget_bytes=40 * page, **kw).generate(prompts, **kwargs)

    runs = {"resume": tight(), "restart": tight(resume_preempted=False)}
    monkeypatch.setattr(scheduler, "MAX_PREFILL_TOKENS", 32)
    resumed_lengths.clear()
    runs["capped"] = tight()
    capped_lengths = list(resumed_lengths)
    for name, out in runs.items():
        assert out.response_ids == ref.response_ids, name
        np.testing.assert_allclose(np.concatenate(sum(out.logprobs, [])),
                                   np.concatenate(sum(ref.logprobs, [])), atol=1e-5)
        np.testing.assert_allclose(np.concatenate(sum(out.tempered_logprobs, [])),
                                   np.concatenate(sum(ref.tempered_logprobs, [])), atol=1e-5)
    st = runs["resume"].stats
    assert st["preemptions"] > 0 and 0 < st["resumed"] <= st["preemptions"], st
    assert st["resumed_tokens"] >= st["resumed"]
    assert runs["restart"].stats["preemptions"] > 0 and runs["restart"].stats["resumed"] == 0
    assert st["decode_steps"] < runs["restart"].stats["decode_steps"]
    assert kinds[False] > 0 and kinds[True] > 0  # both kinds of resume were exercised
    # Capped at 32 tokens a row: only samples whose prompt and tokens fit resume.
    capped = runs["capped"].stats
    assert 0 < capped["resumed"] == len(capped_lengths) and max(capped_lengths) <= 32
    assert capped["resumed"] < capped["preemptions"]


def test_a_sample_that_can_never_take_its_pages_is_an_error_not_a_spin(tiny_model,
                                                                       monkeypatch):
    """If no sample can be placed while nothing is live (the budget check of plan_kv is meant
    to rule it out), generate() raises naming the sample instead of looping on empty decode
    calls."""
    from delta_jax.sampling import scheduler
    idle = []
    decode = scheduler._Run.decode

    def counted(run):
        if not run.active.any():
            idle.append(1)
            assert len(idle) < 100, "the host loop spins with nothing to run"
        return decode(run)

    monkeypatch.setattr(scheduler._Run, "decode", counted)
    monkeypatch.setattr(scheduler._Run, "_place", lambda run, *a, **k: None)
    with pytest.raises(RuntimeError, match="sample 0 of prompt 0 cannot take its pages"):
        Sampler(tiny_model, max_batch_size=4).generate(PROMPTS, max_new_tokens=4)


def test_continuous_batching_keeps_slots_full(tiny_model):
    """The issue's case: 48 prompts x 4 samples, stop ids 1..20 (long-tailed lengths), 96 new
    tokens at most, 16 slots: at most 1.25 x generated / 16 + 96 decode steps (static batches
    took 486), the same outputs as 64 slots, and each prompt prefilled once."""
    rng = np.random.RandomState(0)
    prompts = [rng.randint(21, 256, rng.randint(4, 40)).tolist() for _ in range(48)]
    kwargs = dict(n=4, temperature=1.0, max_new_tokens=96, stop_token_ids=tuple(range(1, 21)),
                  seed=0)
    infos = []  # generate(progress=): one report a decode call, counts only growing
    out = Sampler(tiny_model, max_batch_size=16).generate(prompts, progress=infos.append,
                                                          **kwargs)
    stats = out.stats
    generated = stats["generated_tokens"]
    assert generated == sum(map(sum, out.response_lengths))
    assert len(infos) == stats["decode_calls"]
    for key in ("finished", "generated_tokens", "decode_steps", "seconds"):
        assert all(a[key] <= b[key] for a, b in zip(infos, infos[1:])), key
    assert 0 < infos[0]["finished"] < 192 and {i["samples"] for i in infos} == {192}
    assert (infos[-1]["finished"], infos[-1]["generated_tokens"],
            infos[-1]["decode_steps"]) == (192, generated, stats["decode_steps"])
    assert max(map(max, out.response_lengths)) > 3 * generated / 192  # long-tailed
    assert stats["decode_steps"] <= 1.25 * generated / 16 + 96, stats
    assert stats["slot_utilization"] == pytest.approx(generated / (16 * stats["decode_steps"]))
    # No slot idles while samples wait: at most generated / 16 steps with every slot busy, then
    # the tail of the longest sample (Graham's bound for list scheduling; a chunk of 16 decoding
    # until its longest member stops took 486 steps). The utilization follows, whatever lengths
    # the random stream draws (0.78-0.83 over seeds 0-2, 2026-11-27).
    longest = max(map(max, out.response_lengths))
    assert stats["decode_steps"] <= generated / 16 + longest, (stats, longest)
    assert stats["prefilled_prompts"] == 48
    wide = Sampler(tiny_model, max_batch_size=64).generate(prompts, **kwargs)
    assert wide.response_ids == out.response_ids and wide.truncated == out.truncated
    # Refilling once 4 samples have finished (the default at 64 slots) instead of each one:
    # fewer decode calls, the same tokens.
    lazy = Sampler(tiny_model, max_batch_size=16, refill_after=4).generate(prompts, **kwargs)
    assert lazy.response_ids == out.response_ids
    assert lazy.stats["decode_calls"] < stats["decode_calls"], (lazy.stats, stats)
    with pytest.raises(ValueError, match="refill_after"):
        Sampler(tiny_model, refill_after=0)
    # Samples staged on the device (the default, slots // 4 = 4) start in the step their slot
    # frees, mid-call: the same tokens as without staging, in far fewer decode calls and no more
    # steps.
    assert stats["queue_refills"] > 100 and stats["preemptions"] == 0, stats
    unstaged = Sampler(tiny_model, max_batch_size=16, refill_queue=0).generate(prompts, **kwargs)
    assert unstaged.stats["queue_refills"] == 0
    assert unstaged.response_ids == out.response_ids
    assert unstaged.truncated == out.truncated
    np.testing.assert_allclose(np.concatenate(sum(unstaged.logprobs, [])),
                               np.concatenate(sum(out.logprobs, [])), atol=1e-5)
    assert 2 * stats["decode_calls"] < unstaged.stats["decode_calls"], (stats, unstaged.stats)
    # Staging may split one refill's prefill in two (seeds 0-3 of this case, 2026-11-27: 13, 12,
    # 13, 13 prefill calls staged against 12 unstaged; 12 <= 12 with the Gumbel draw's stream):
    # at most one more call, while the decode calls fall 3x.
    assert stats["prefill_calls"] <= unstaged.stats["prefill_calls"] + 1, (stats, unstaged.stats)
    assert stats["decode_steps"] <= unstaged.stats["decode_steps"], (stats, unstaged.stats)
    with pytest.raises(ValueError, match="refill_queue"):
        Sampler(tiny_model, refill_queue=-1)
    # Prefilling ahead (the default) fills each refill's prefill call with the next waiting
    # prompts: fewer calls than one per refill, each prompt still prefilled once, same tokens.
    one_by_one = Sampler(tiny_model, max_batch_size=16, prefill_ahead=False).generate(
        prompts, **kwargs)
    assert one_by_one.response_ids == out.response_ids
    assert one_by_one.stats["prefilled_prompts"] == 48
    assert stats["prefill_calls"] < one_by_one.stats["prefill_calls"], (
        stats["prefill_calls"], one_by_one.stats["prefill_calls"])


def record_decode_calls(monkeypatch, record):
    """Patches the scheduler so that every decode call it makes first appends record(run, args,
    kwargs) to the returned list: run, the sampler's _Run making the call (as it stands before
    the call); args / kwargs, programs.decode's (args[4] the slots' Rows, args[5] the queue's;
    the cache, args[3], is donated to the call: read it inside record)."""
    from delta_jax.sampling import scheduler
    calls, making = [], []
    decode, run_decode = scheduler.programs.decode, scheduler._Run.decode

    def recorded(*args, **kwargs):
        calls.append(record(making[-1], args, kwargs))
        return decode(*args, **kwargs)

    def run_decode_recorded(run):
        making.append(run)
        try:
            return run_decode(run)
        finally:
            making.pop()

    monkeypatch.setattr(scheduler.programs, "decode", recorded)
    monkeypatch.setattr(scheduler._Run, "decode", run_decode_recorded)
    return calls


def test_a_call_with_nothing_staged_runs_a_decode_program_without_refills(tiny_model,
                                                                          monkeypatch):
    """A decode call gets a queue of Q = 0 entries exactly when no sample is staged (the static
    engine's every call; a continuous run's once nothing is left to stage): that program's step
    loop traces none of the refill's work (its loop body has fewer operations than the program
    with a queue), and the tokens are those of the program with a queue and of static batching."""
    from delta_jax.sampling import programs
    jitted = programs.decode  # record_decode_calls patches the module's name

    def record(run, args, kwargs):
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)
                              if isinstance(a, (jax.Array, np.ndarray)) else a, args)
        return len(args[5].active), sum(len(q) for q in run.staged), shapes, kwargs

    calls = record_decode_calls(monkeypatch, record)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(21, 256, rng.randint(4, 40)).tolist() for _ in range(12)]
    kwargs = dict(n=4, temperature=1.0, max_new_tokens=48, stop_token_ids=tuple(range(1, 21)),
                  seed=5)
    out = Sampler(tiny_model, max_batch_size=8).generate(prompts, **kwargs)
    continuous, calls[:] = list(calls), []
    static = Sampler(tiny_model, max_batch_size=8, continuous=False).generate(prompts, **kwargs)
    assert static.response_ids == out.response_ids
    for queue_len, staged_count, _, _ in continuous + calls:
        assert (queue_len == 0) == (staged_count == 0), (queue_len, staged_count)
    assert {q == 0 for q, *_ in continuous} == {True, False}  # both kinds of call ran
    assert all(q == 0 for q, *_ in calls)

    def loop_body_size(shapes, kw):
        jaxpr = jitted.trace(*shapes, **kw).jaxpr
        (loop,) = [e for e in jaxpr.eqns if e.primitive.name == "while"]
        return len(loop.params["body_jaxpr"].jaxpr.eqns)
    with_queue = next(c for c in continuous if c[0] > 0)
    without = next(c for c in continuous if c[0] == 0 and c[2][4].active.shape
                   == with_queue[2][4].active.shape)
    assert loop_body_size(*without[2:]) < loop_body_size(*with_queue[2:])


def test_a_draining_batch_runs_only_the_rows_it_needs(tiny_model, monkeypatch):
    """shrink_batch (the default): each decode call runs the live samples in the smallest power
    of two of rows, at least 8 (SHRINK_MIN_ROWS), that holds them when that is fewer than the 16
    slots, live slots first (a call with a sample staged has every slot live); the long-tailed
    case gives the same tokens, log-probs and decode steps as every call over all 16 slots,
    continuous and static, and so does a KV budget that preempts, whose calls shrink while
    samples wait for pages."""
    from delta_jax.sampling import scheduler
    assert scheduler.SHRINK_MIN_ROWS == 8
    assert Sampler.__init__.__kwdefaults__["shrink_batch"] is True

    def record(run, args, kwargs):  # rows, live, any sample staged, the rows' live flags, waiting
        active = np.asarray(args[4].active)
        return (len(active), int(active.sum()), bool(np.asarray(args[5].active).any()),
                active.tolist(), len(run.waiting))

    calls = record_decode_calls(monkeypatch, record)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(21, 256, rng.randint(4, 40)).tolist() for _ in range(24)]
    kwargs = dict(n=4, temperature=1.0, max_new_tokens=64, stop_token_ids=tuple(range(1, 21)),
                  seed=3)
    runs = {}
    for continuous in (True, False):
        for shrink in (True, False):
            calls.clear()
            out = Sampler(tiny_model, max_batch_size=16, continuous=continuous,
                          shrink_batch=shrink).generate(prompts, **kwargs)
            runs[continuous, shrink] = out, list(calls)
    for continuous in (True, False):
        (out, calls_shrunk), (full, calls_full) = runs[continuous, True], runs[continuous, False]
        assert out.response_ids == full.response_ids and out.truncated == full.truncated
        np.testing.assert_allclose(np.concatenate(sum(out.logprobs, [])),
                                   np.concatenate(sum(full.logprobs, [])), atol=1e-5)
        assert out.stats["decode_steps"] == full.stats["decode_steps"]
        assert all(rows == 16 for rows, *_ in calls_full) and full.stats["shrunk_calls"] == 0
        assert full.stats["decode_rows"] == 16
        shrunk = [c for c in calls_shrunk if c[0] < 16]
        assert len(shrunk) == out.stats["shrunk_calls"] > 0, out.stats
        for rows, live, queued, active, _ in shrunk:
            assert active == sorted(active, reverse=True)  # live rows first
        # Every call's rows: the smallest power of two >= 8 that holds the live samples; a call
        # with a sample staged (continuous batching only) has every slot live, so it runs all 16
        # (a staged sample only takes a slot whose sample finishes in the call).
        for rows, live, queued, _, _ in calls_shrunk:
            assert rows == min(16, max(8, 1 << (live - 1).bit_length())), (rows, live)
            assert live == 16 or not queued, (continuous, live)
        assert any(queued for _, _, queued, _, _ in calls_shrunk) == continuous
        assert out.stats["decode_rows"] < 16
    assert runs[True, True][0].response_ids == runs[False, True][0].response_ids
    # 12 slots (not a power of two), 4 steps a call: calls shrink to 8 rows once 8 or fewer
    # samples live.
    calls.clear()
    twelve = Sampler(tiny_model, max_batch_size=12, decode_steps_per_call=4).generate(prompts,
                                                                                     **kwargs)
    assert twelve.response_ids == runs[True, True][0].response_ids
    assert {rows for rows, *_ in calls} == {12, 8} and twelve.stats["shrunk_calls"] > 0
    assert all(live <= 8 for rows, live, *_ in calls if rows == 8)
    # With a KV budget that preempts samples, 4-token pages and 3 steps a call: the same tokens.
    # Slots left free for want of pages, with samples waiting and none staged, shrink too.
    page = models.page_bytes(tiny_model.cfg, 4)
    calls.clear()
    tight = Sampler(tiny_model, max_batch_size=16, page_size=4, decode_steps_per_call=3,
                    kv_budget_bytes=40 * page).generate(prompts[:12], **kwargs)
    assert tight.stats["preemptions"] > 0 and tight.stats["shrunk_calls"] > 0, tight.stats
    assert any(rows == 8 and waits > 0 for rows, _, _, _, waits in calls), calls
    for rows, live, queued, _, _ in calls:
        assert rows == min(16, max(8, 1 << (live - 1).bit_length())) and (live == 16 or not queued)
    ref = Sampler(tiny_model, max_batch_size=16, shrink_batch=False).generate(prompts[:12],
                                                                              **kwargs)
    assert tight.response_ids == ref.response_ids


def test_batch_invariant_runs_the_programs_compiled_for_it(tiny_model, monkeypatch):
    """Sampler(batch_invariant=True) prefills and decodes with sampling.programs' twins compiled
    with BATCH_INVARIANT_OPTIONS (so those options are names this jaxlib takes: an unknown one
    fails the compile), and only with them; the default sampler never runs them. On the CPU the
    tokens and log-probs are those of the default programs, at another max_batch_size and with
    shrunk calls too; refused on a platform outside BATCH_INVARIANT_PLATFORMS."""
    ran = collections.Counter()
    for name in ("prefill", "decode", "batch_invariant_prefill", "batch_invariant_decode"):
        def counted(*args, _fn=getattr(programs, name), _name=name, **kwargs):
            ran[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(programs, name, counted)
    rng = np.random.RandomState(2)
    prompts = [rng.randint(21, 256, rng.randint(4, 40)).tolist() for _ in range(12)]
    kwargs = dict(n=4, temperature=1.0, max_new_tokens=40, stop_token_ids=tuple(range(1, 21)),
                  seed=7)
    default = Sampler(tiny_model, max_batch_size=16).generate(prompts, **kwargs)
    assert set(ran) == {"prefill", "decode"}
    ran.clear()
    sampler = Sampler(tiny_model, max_batch_size=32, batch_invariant=True)
    assert sampler.batch_invariant and not Sampler(tiny_model).batch_invariant
    out = sampler.generate(prompts, **kwargs)
    assert set(ran) == {"batch_invariant_prefill", "batch_invariant_decode"}, ran
    assert out.stats["shrunk_calls"] > 0
    assert out.response_ids == default.response_ids and out.truncated == default.truncated
    np.testing.assert_allclose(np.concatenate(sum(out.logprobs, [])),
                               np.concatenate(sum(default.logprobs, [])), atol=1e-5)
    # Where the compiler is not known to take those options (a TPU): refused, naming the field.
    from delta_jax.sampling import scheduler
    monkeypatch.setattr(scheduler.jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match=r"rollout\.batch_invariant.*'tpu'"):
        Sampler(tiny_model, batch_invariant=True)
    Sampler(tiny_model)  # the default stays available there


@pytest.mark.gpu
def test_batch_invariant_tokens_and_log_probs_are_bitwise_alike_across_row_counts():
    """On a GPU, what batch_invariant is for: a bf16 model of Qwen3-0.6B's widths (hidden 1,024,
    MLP 3,072, 128-wide heads, where XLA's GEMMs split the contraction at few rows; 2 layers, a
    4,096-token vocabulary), 96 long-tailed samples at T = 1 (near-uniform logits: a rounding
    difference soon draws another token): with shrink_batch at 32 slots (calls of 32, 16 and 8
    rows as the batch drains), without it, and at 16 slots, the same tokens and bit-for-bit the
    same log-probs."""
    cfg = models.get_preset("tiny", vocab_size=4096, hidden_size=1024, intermediate_size=3072,
                            num_heads=16, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                            param_dtype=jnp.bfloat16)
    model = models.Transformer(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)
    prompts = rng.integers(1, cfg.vocab_size, size=(96, 40)).tolist()
    limits = np.minimum(rng.geometric(1 / 24, size=96), 160)
    limits[0] = 160
    kwargs = dict(n=1, temperature=1.0, max_new_tokens=[int(x) for x in limits],
                  stop_token_ids=(), seed=11)
    runs = {}
    for slots, shrink in ((32, True), (32, False), (16, True)):
        out = Sampler(model, max_batch_size=slots, shrink_batch=shrink,
                      batch_invariant=True).generate(prompts, **kwargs)
        runs[slots, shrink] = out
    assert runs[32, True].stats["shrunk_calls"] > 0
    ref = runs[32, True]
    for key, out in runs.items():
        assert out.response_ids == ref.response_ids, key
        np.testing.assert_array_equal(np.concatenate(sum(out.logprobs, [])),
                                      np.concatenate(sum(ref.logprobs, [])), err_msg=str(key))


def test_kv_budget_is_checked_before_generating(tiny_model):
    cfg = tiny_model.cfg
    plan = plan_kv(cfg, slots=4, prompt_len=30, max_new_tokens=40, page_size=8)
    assert plan.num_pages == plan.worst_case_pages and plan.bytes == plan.num_pages * \
        models.page_bytes(cfg, 8)
    # One sample of a 30-token prompt with 40 new tokens: 4 shared + 6 own pages + scratch.
    assert plan_kv(cfg, slots=4, prompt_len=30, max_new_tokens=40, page_size=8,
                   kv_budget_bytes=11 * models.page_bytes(cfg, 8)).num_pages == 11
    with pytest.raises(ValueError, match="KV budget"):
        plan_kv(cfg, slots=4, prompt_len=30, max_new_tokens=40, page_size=8,
                kv_budget_bytes=10 * models.page_bytes(cfg, 8))
    small = Sampler(tiny_model, page_size=8, kv_budget_bytes=10 * models.page_bytes(cfg, 8))
    with pytest.raises(ValueError, match="KV budget"):
        small.generate([list(range(3, 33))], max_new_tokens=40)
    with pytest.raises(ValueError, match="page_size"):
        Sampler(tiny_model, page_size=0)


def test_stop_tokens_and_truncation(tiny_model, sampler):
    free = sampler.generate(PROMPTS, max_new_tokens=9)
    assert all(len(r[0]) == 9 for r in free.response_ids)
    assert all(t[0] for t in free.truncated)
    # Greedy: each token is the argmax of the teacher-forced logits; log-probs are under T = 1.
    batch = free.padded()
    mask = batch["response_mask"][:, 1:].astype(bool)
    logits = teacher_forced_logits(tiny_model, batch)
    assert (logits.argmax(-1) == batch["input_ids"][:, 1:])[mask].all()
    want = np.take_along_axis(log_softmax(logits), batch["input_ids"][:, 1:, None], -1)[..., 0]
    assert np.abs(want - batch["logprobs"][:, 1:])[mask].max() <= 1e-4
    stop = free.response_ids[1][0][3]
    out = sampler.generate(PROMPTS, max_new_tokens=9, stop_token_ids=(stop,))
    for i in range(len(PROMPTS)):
        want = free.response_ids[i][0]
        if stop in want:
            want = want[:want.index(stop) + 1]
        assert out.response_ids[i][0] == want
        assert out.truncated[i][0] == (stop not in want)
    assert out.response_ids[1][0][-1] == stop and len(out.response_ids[1][0]) == 4
    # Early exit: the loop stops once every sequence has stopped.
    first = free.response_ids[0][0][0]
    one = sampler.generate(PROMPTS[:1], max_new_tokens=9, stop_token_ids=(first,))
    assert one.response_ids == [[[first]]] and one.stats["decode_steps"] == 1


def test_tpu_decode_kernel_generates_what_the_reference_does(monkeypatch, on_cpu):
    """The rollout engine with rollout.decode_attention="tpu" (pallas.ops' TPU paged attention,
    run by Pallas' TPU interpreter in every layer of every decode step; a TPU stood in for; tiny
    bf16 model, 16-token pages, two samples of three prompts in four slots, so slots refill):
    the jnp page reader's tokens and log-probs within bf16 rounding. The kernel keeps the
    attention probabilities in float32 where the reader rounds them to bf16, so a near tie of
    this random model's flat logits may go the other way: each sample agrees with the reader's up
    to its first differing token, and where one differs the two tokens' log-probs are within the
    same rounding (a tie, not a wrong token); most tokens agree."""
    from jax.experimental.pallas import tpu as pltpu
    from delta_jax.models import attention as A

    monkeypatch.setattr(A, "_tpu_backend", lambda: True)
    model = models.Transformer(models.get_preset("tiny", dtype=jnp.bfloat16), rngs=nnx.Rngs(1))
    prompts = [[3, 17, 42], [5, 6, 7, 8, 9, 10, 11, 12, 13], [99]]
    kwargs = dict(n=2, max_new_tokens=12, seed=0)
    common = dict(max_batch_size=4, page_size=16, decode_steps_per_call=4)
    ref = Sampler(model, decode_attention="reference", **common).generate(prompts, **kwargs)
    calls = []
    kernel = A.paged_decode_tpu
    monkeypatch.setattr(A, "paged_decode_tpu", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with pltpu.force_tpu_interpret_mode():
        got = Sampler(model, decode_attention="tpu", **common).generate(prompts, **kwargs)
    assert calls  # traced into the decode program
    assert sum(map(len, sum(got.response_ids, []))) == 6 * 12
    agreed = 0
    for ids, ref_ids, lp, ref_lp in zip(sum(got.response_ids, []), sum(ref.response_ids, []),
                                        sum(got.logprobs, []), sum(ref.logprobs, [])):
        same = next((i for i, (x, y) in enumerate(zip(ids, ref_ids)) if x != y), len(ids))
        end = min(same + 1, len(ids))  # the first differing token's log-prob: a near tie
        np.testing.assert_allclose(lp[:end], ref_lp[:end], atol=2e-2)
        agreed += same
    assert agreed >= 0.75 * 6 * 12, agreed


def test_generate_slices_layers_once_and_repeats_without_compiling(tiny_model, monkeypatch,
                                                                    caplog):
    """The decode calls of one generate() share one copy of the layer weights
    (programs.decode_layers runs once per generate(), not per decode call), and a second
    generate() of the same shapes compiles nothing (the page pool's zeros included)."""
    sampler = Sampler(tiny_model, max_batch_size=2, decode_steps_per_call=4)
    kwargs = dict(n=2, temperature=1.0, max_new_tokens=10, seed=3)
    made = []
    real = programs.decode_layers
    monkeypatch.setattr(programs, "decode_layers", lambda *a: made.append(1) or real(*a))
    first = sampler.generate(PROMPTS, **kwargs)
    assert first.stats["decode_calls"] >= 8 and len(made) == 1
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        again = sampler.generate(PROMPTS, **kwargs)
    assert [r.getMessage()[:80] for r in caplog.records if "Compiling" in r.getMessage()] == []
    assert len(made) == 2 and again.response_ids == first.response_ids


def test_update_params_swaps_weights_without_recompiling(tiny_model, sampler):
    other = models.Transformer(models.get_preset("tiny"), rngs=nnx.Rngs(1))
    kwargs = dict(n=2, temperature=1.0, max_new_tokens=8, seed=0)
    swapped = Sampler(tiny_model, max_batch_size=16)
    before = swapped.generate(PROMPTS, **kwargs)
    compiled = programs.decode._cache_size()
    swapped.update_params(other)
    after = swapped.generate(PROMPTS, **kwargs)
    assert programs.decode._cache_size() == compiled
    assert after.response_ids != before.response_ids
    assert after.response_ids == Sampler(other, max_batch_size=16).generate(
        PROMPTS, **kwargs).response_ids
    via_state = sampler.generate(PROMPTS, **kwargs, state=nnx.split(other)[1])
    assert via_state.response_ids == after.response_ids


def test_a_sampler_of_an_abstract_model_asks_for_weights(tiny_model):
    """A sampler built from an abstract model (a train Run's, before it reads its weights)
    refuses to generate with one error naming update_params, rather than failing inside jit on
    a ShapeDtypeStruct; given weights, it generates what a sampler built from them does."""
    abstract = nnx.eval_shape(lambda: models.Transformer(models.get_preset("tiny"),
                                                         rngs=nnx.Rngs(0)))
    held = Sampler(abstract, max_batch_size=16)
    with pytest.raises(ValueError, match="update_params"):
        held.generate(PROMPTS, max_new_tokens=4)
    held.update_params(tiny_model)
    kwargs = dict(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    assert held.generate(PROMPTS, **kwargs).response_ids == Sampler(
        tiny_model, max_batch_size=16).generate(PROMPTS, **kwargs).response_ids


def test_padded_layout(sampler):
    out = sampler.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=6, stop_token_ids=(5,))
    batch = out.padded(prompt_len=12, response_len=8)
    assert batch["input_ids"].shape == (8, 20)
    for r in range(8):
        i, j = batch["prompt_index"][r], batch["sample_index"][r]
        assert r == i * 2 + j
        prompt, resp = PROMPTS[i], out.response_ids[i][j]
        row = batch["input_ids"][r]
        assert row[12 - len(prompt):12].tolist() == prompt and (row[:12 - len(prompt)] == 0).all()
        assert row[12:12 + len(resp)].tolist() == resp
        assert batch["response_mask"][r].nonzero()[0].tolist() == list(range(12, 12 + len(resp)))
        positions = batch["positions"][r][12 - len(prompt):12 + len(resp)]
        assert positions.tolist() == list(range(len(prompt) + len(resp)))
    with pytest.raises(ValueError, match="prompt_len"):
        out.padded(prompt_len=3)


@pytest.mark.devices(8)
def test_sharded_batch_matches_single_device(tiny_model, sampler):
    # Auto axes (GSPMD propagation), as the trainer's mesh.
    mesh = jax.make_mesh((4, 2, 1), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    kwargs = dict(n=2, temperature=1.0, top_k=50, max_new_tokens=8, seed=2)
    sharded = Sampler(tiny_model, max_batch_size=16, mesh=mesh).generate(PROMPTS, **kwargs)
    ref = sampler.generate(PROMPTS, **kwargs)
    assert sharded.response_ids == ref.response_ids
    np.testing.assert_allclose(np.concatenate(sum(sharded.logprobs, [])),
                               np.concatenate(sum(ref.logprobs, [])), atol=1e-5)
    # The page pool is split over the 8 batch shards (2 slots each): each shard's pages are
    # sized for its own slots, and a prompt's 2 samples share its pages on one shard.
    stats = sharded.stats
    # (32-token pages; per shard: its scratch page, per slot 1 prompt + 1 response + 1 partial
    # page, and the next prompt's page: 8 pages; one pool for 16 slots would be 50.)
    assert stats["kv_shards"] == 8 and stats["kv_pages"] == 8 * 8
    assert stats["kv_bytes_per_shard"] == 8 * models.page_bytes(tiny_model.cfg, 32)
    assert ref.stats["kv_pages"] == 50
    assert stats["prefilled_prompts"] == 3  # the 1-token prompt has no KV to prefill
    # One slot per shard and one staged sample per shard (n = 3: 12 samples in 8 slots): staged
    # samples start mid-call in their own shard's slot, the same tokens.
    kwargs = dict(n=3, temperature=1.0, max_new_tokens=8, stop_token_ids=(7,), seed=11)
    ref = sampler.generate(PROMPTS, **kwargs)
    staged = Sampler(tiny_model, max_batch_size=8, mesh=mesh, refill_queue=8).generate(
        PROMPTS, **kwargs)
    assert staged.stats["queue_refills"] > 0 and staged.response_ids == ref.response_ids
    np.testing.assert_allclose(np.concatenate(sum(staged.logprobs, [])),
                               np.concatenate(sum(ref.logprobs, [])), atol=1e-5)
    # Four slots per shard, a prompt's 3 samples on one shard, 2 steps a call, ragged lengths
    # (stop ids 1..59): once two or fewer live on every shard, calls run 2 rows (or 1) per
    # shard, each shard's own (the pages they read are the shard's): the same tokens.
    ragged = dict(kwargs, max_new_tokens=16, stop_token_ids=tuple(range(1, 60)))
    ragged_ref = sampler.generate(PROMPTS, **ragged)
    shrunk = Sampler(tiny_model, max_batch_size=32, mesh=mesh,
                     decode_steps_per_call=2).generate(PROMPTS, **ragged)
    assert shrunk.stats["shrunk_calls"] > 0 and shrunk.stats["decode_rows"] < 32, shrunk.stats
    assert len(set(map(len, sum(shrunk.response_ids, [])))) > 3  # ragged
    assert shrunk.response_ids == ragged_ref.response_ids
    np.testing.assert_allclose(np.concatenate(sum(shrunk.logprobs, [])),
                               np.concatenate(sum(ragged_ref.logprobs, [])), atol=1e-5)
    # The same with the programs compiled for batch invariance (their XLA options over the
    # mesh's per-shard programs): the same tokens.
    invariant = Sampler(tiny_model, max_batch_size=32, mesh=mesh, decode_steps_per_call=2,
                        batch_invariant=True).generate(PROMPTS, **ragged)
    assert invariant.stats["shrunk_calls"] > 0
    assert invariant.response_ids == ragged_ref.response_ids
    # One slot per shard (a prompt's samples on several shards: prefilled on each), 4-token
    # pages, 2 steps per call and 6 pages per shard (samples preempted and resumed), KV heads
    # over tensor=2: the same tokens.
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    page = models.page_bytes(tiny_model.cfg, 4)
    tight = Sampler(tiny_model, max_batch_size=8, mesh=mesh, page_size=4,
                    decode_steps_per_call=2, kv_budget_bytes=6 * page).generate(PROMPTS, **kwargs)
    assert tight.stats["kv_shards"] == 4 and tight.stats["kv_pages"] == 4 * 6
    assert tight.stats["preemptions"] > 0 and tight.stats["prefilled_prompts"] > 3
    assert tight.stats["resumed"] > 0
    assert tight.response_ids == ref.response_ids
    np.testing.assert_allclose(np.concatenate(sum(tight.logprobs, [])),
                               np.concatenate(sum(ref.logprobs, [])), atol=1e-5)


class CharTokenizer:
    """Bytes as tokens (ids 3..258 shifted into the tiny vocabulary), eos = 1."""

    eos_token_id = 1

    def encode(self, text):
        return [3 + (b % 250) for b in text.encode()]

    def decode(self, ids):
        return "".join(chr(i - 3 + 32) if i >= 3 else "?" for i in ids)


def test_string_prompts_and_texts(tiny_model):
    tok = CharTokenizer()
    texts = Sampler(tiny_model, tokenizer=tok, max_batch_size=16).generate(
        ["hi", "hello there"], max_new_tokens=5)
    ids = Sampler(tiny_model, max_batch_size=16).generate(
        [tok.encode("hi"), tok.encode("hello there")], max_new_tokens=5, stop_token_ids=(1,))
    assert texts.response_ids == ids.response_ids
    assert texts.prompt_ids[0] == tok.encode("hi")
    assert texts.texts == [[tok.decode(r[0][:-1] if r[0][-1] == 1 else r[0])]
                           for r in ids.response_ids]


# ------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("prompts,kwargs,name", [
    ([[1, 2], []], {}, r"prompts\[1\]"),
    ([], {}, "prompts"),
    (["text"], {}, "tokenizer"),
    ([[1, 2, 3000]], {}, r"prompts\[0\]"),
    ([[1, -4, 2, 7000]], {}, r"prompts\[0\] has token ids outside \[0, \d+\): \[-4, 7000\]"),
    ([[1.0, 2.0], [5000.0]], {}, r"prompts\[1\] has token ids outside"),
    ([[1, 2]], {"n": 0}, "n must"),
    ([[1, 2]], {"temperature": -1.0}, "temperature"),
    ([[1, 2]], {"top_p": 0.0}, "top_p"),
    ([[1, 2]], {"top_p": 1.1}, "top_p"),
    ([[1, 2]], {"top_k": 0}, "top_k"),
    ([[1, 2]], {"top_k": -3}, "top_k"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[1, 2]], {"stop_token_ids": (999,)}, "stop_token_ids"),
])
def test_bad_input_raises_naming_the_argument(sampler, prompts, kwargs, name):
    with pytest.raises(ValueError, match=name):
        sampler.generate(prompts, **kwargs)


def test_long_prompts_error_or_left_truncation(tiny_model, caplog):
    long_prompt = list(range(1, 30))
    with pytest.raises(ValueError, match="max_prompt_len"):
        Sampler(tiny_model, max_prompt_len=8).generate([long_prompt], max_new_tokens=4)
    with caplog.at_level("WARNING", logger="delta_jax.sampling"):
        out = Sampler(tiny_model, max_prompt_len=8, truncate_prompts="left").generate(
            [long_prompt, [5, 6]], max_new_tokens=4)
    assert "1 of 2 prompts are over max_prompt_len=8 tokens (the longest: 29)" in caplog.text
    assert out.prompt_ids == [long_prompt[-8:], [5, 6]]
    ref = Sampler(tiny_model).generate([long_prompt[-8:]], max_new_tokens=4)
    assert out.response_ids[:1] == ref.response_ids


def test_bucket_size():
    assert [bucket_size(n, 16) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert bucket_size(3, 1, multiple_of=8) == 8 and bucket_size(9, 1, multiple_of=8) == 16
    assert isinstance(GenerationOutput([], [], [], [], [], []).stats, dict)


# ------------------------------------------------------------------------------------------
# Two processes (jax.distributed over gloo, 2 CPU devices each): the batch is sharded across
# processes, so the outputs are not fully addressable anywhere; generate() all-gathers them.

_MULTIHOST_WORKER = r'''
import json, sys
import jax
from flax import nnx
from delta_jax import models, sharding
from delta_jax.sampling import Sampler
pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sharding.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
assert jax.process_count() == 2 and len(jax.devices()) == 4
cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
model = models.Transformer(cfg, rngs=nnx.Rngs(0))
mesh = sharding.make_mesh(-1, 1, 1)          # rows over 4 devices in 2 processes
res = Sampler(model, max_batch_size=16, mesh=mesh).generate(
    PROMPTS, n=2, temperature=1.0, max_new_tokens=6, stop_token_ids=(1,), seed=3)
json.dump({"ids": res.response_ids, "logprobs": res.logprobs, "truncated": res.truncated},
          open(f"{out}.{pid}", "w"))
jax.distributed.shutdown()
'''


def test_generate_two_processes(tmp_path, on_cpu):  # the reference on the CPU, as the workers
    import json
    import pathlib
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(f"PROMPTS = {[[t % 64 for t in p] for p in PROMPTS]!r}\n"
                      + _MULTIHOST_WORKER)
    repo = pathlib.Path(__file__).resolve().parents[1]
    from tests.rl_fixtures import cpu_process_env
    env = cpu_process_env(2)
    procs = [subprocess.Popen([sys.executable, str(script), str(pid), str(port),
                               str(tmp_path / "out")], env=env, cwd=str(repo),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for pid, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {pid} failed:\n{log[-3000:]}"
    got = [json.load(open(tmp_path / f"out.{pid}")) for pid in range(2)]
    assert got[0] == got[1]  # every process returns the whole output
    cfg = models.get_preset("tiny").replace(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_layers=1, num_heads=2, num_kv_heads=1,
                                            head_dim=16)
    ref = Sampler(models.Transformer(cfg, rngs=nnx.Rngs(0)), max_batch_size=16).generate(
        [[t % 64 for t in p] for p in PROMPTS], n=2, temperature=1.0, max_new_tokens=6,
        stop_token_ids=(1,), seed=3)
    assert got[0]["ids"] == ref.response_ids
    assert got[0]["truncated"] == ref.truncated
    for a, b in zip(got[0]["logprobs"], ref.logprobs):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-4)
