"""delta_jax.train.generations: the rows of a step's rollout against hand-computed values, and on
the real trainer (tiny model) the files train.rollouts_every and eval.save_responses write,
checked against what the step trained on and what the eval counted."""
import json

import jax
import numpy as np
import pytest

from delta_jax.rl.rewards import final_answer
from delta_jax.train import generations, loop
from tests.rl_fixtures import TextLengthScorer, build_scored_run, tiny_rl_config


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_rollout_rows_are_prompt_major_with_the_losss_mean_token_weight():
    records = [{"id": "a", "prompt": "1+1=", "answer": "2"},
               {"prompt": "2+2=", "answer": 4}]  # no id; a non-string answer
    texts = [["2", "3"], ["4", "ä5"]]
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], np.float32)
    weights = np.array([[1.2, 0.8, 9.0], [0.5, 7.0, 7.0], [3.0, 3.0, 3.0], [1.0, 1.1, 0.9]])
    rows = generations.rollout_rows(
        7, records, texts, rewards=[1, 0, -1, 0.5], correct=[1, 0, 0, 1],
        advantages=[0.7, -0.7, 0.0, 0.0], response_lengths=[2, 1, 8, 3],
        truncated=[False, False, True, False], loss_mask=mask, token_weights=weights)
    assert [(r["row"], r["group"], r["sample"]) for r in rows] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [r["response"] for r in rows] == ["2", "3", "4", "ä5"]
    assert [r["id"] for r in rows] == ["a", "a", None, None]
    assert [r["answer"] for r in rows] == ["2", "2", "4", "4"]
    assert [r["prompt"] for r in rows] == ["1+1=", "1+1=", "2+2=", "2+2="]
    assert rows[0]["token_weight_mean"] == pytest.approx(1.0)  # (1.2 + 0.8) / 2; 9.0 is masked
    assert rows[1]["token_weight_mean"] == pytest.approx(0.5)
    assert rows[2]["in_loss"] is False and rows[2]["token_weight_mean"] is None
    assert rows[3]["token_weight_mean"] == pytest.approx(1.0)
    assert [r["truncated"] for r in rows] == [False, False, True, False]
    assert [r["reward"] for r in rows] == [1.0, 0.0, -1.0, 0.5]
    assert all(r["step"] == 7 for r in rows)
    assert json.loads(json.dumps(rows)) == rows  # plain JSON types only
    assert "token_weights" not in rows[0]
    ids = [[[5, 6], [7]], [[8, 9, 1], [3, 4, 1]]]
    tokens = generations.rollout_rows(
        7, records, texts, rewards=[1, 0, -1, 0.5], correct=[1, 0, 0, 1],
        advantages=[0.7, -0.7, 0.0, 0.0], response_lengths=[2, 1, 3, 3],
        truncated=[False, False, True, False], loss_mask=mask, token_weights=weights,
        response_ids=ids)
    assert [r["token_ids"] for r in tokens] == [[5, 6], [7], [8, 9, 1], [3, 4, 1]]
    assert [r["token_weights"] for r in tokens] == [[1.2, 0.8], [0.5], [0.0, 0.0, 0.0],
                                                    [1.0, 1.1, 0.9]]
    assert "reward_fns" not in tokens[0]
    each = generations.rollout_rows(
        7, records, texts, rewards=[1, 0, -1, 0.5], correct=[1, 0, 0, 1],
        advantages=[0.7, -0.7, 0.0, 0.0], response_lengths=[2, 1, 3, 3],
        truncated=[False, False, True, False], loss_mask=mask, token_weights=weights,
        reward_fns={"acc": np.array([1, 0, 0, 1], np.float32), "fmt": [0.5, 0.0, 0.25, 1.0]})
    assert [r["reward_fns"] for r in each] == [{"acc": 1.0, "fmt": 0.5}, {"acc": 0.0, "fmt": 0.0},
                                               {"acc": 0.0, "fmt": 0.25}, {"acc": 1.0, "fmt": 1.0}]
    assert json.loads(json.dumps(each)) == each


def test_the_trainer_writes_the_rollouts_it_trained_on_and_the_eval_responses(tmp_path):
    """Two delta steps with train.rollouts_every=2 and an eval before with eval.save_responses:
    rollouts/step_2.jsonl alone, its rows what step 2 trained on (the responses the tokenizer
    decodes from the sampled ids, the rewards TextLengthScorer gives those texts, the packed
    advantages and lengths, the mean of the token weights the loss used); and
    eval/step_0_responses.jsonl, graded by the same rule, whose per-question counts of correct
    are step_0.json's, each with the answer it voted for in maj@2 (eval.maj_k), and
    step_0.json's maj@2 of a question the verdict of its first sample with an answer."""
    cfg = tiny_rl_config(
        "delta", train=dict(steps=2, keep=10, save_every=10, rollouts_every=2,
                            rollouts_token_weights=True, eval_before=True,
                            eval_after=False, eval_every=0, export_final=False),
        data=dict(eval="synthetic"), eval=dict(k=2, pass_k="1,2", maj_k="2", limit=3,
                                               max_new_tokens=8, save_responses=True),
        rewards=dict(num_workers=1))
    seen = {}

    def keep(run, step, out):
        seen[step] = (out.prepared, jax.device_get(out.batch))

    run = build_scored_run(cfg, tmp_path)
    run.eval_scorers["math"] = TextLengthScorer()  # a rule each row can be checked against
    try:
        loop.train(cfg, str(tmp_path), run=run, step_hooks=(*loop.DEFAULT_STEP_HOOKS, keep))
        tokenizer = run.tokenizer
    finally:
        run.close()

    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_2.jsonl"]
    rows = _read(tmp_path / "rollouts" / "step_2.jsonl")
    prep, batch = seen[2]
    samples, rb, G = prep.rollout.samples, prep.packed, cfg.rollout.group_size
    assert len(rows) == cfg.rollout.batch_prompts * G == rb.num_rows
    stop = tokenizer.eos_token_id
    for r in rows:
        i, j = r["group"], r["sample"]
        assert r["row"] == i * G + j and r["step"] == 2
        ids = [t for t in samples.response_ids[i][j] if t != stop]
        assert r["response"] == tokenizer.decode(ids)
        assert r["reward"] == float(len(r["response"]) % 2 == 0)  # TextLengthScorer's rule
        assert r["prompt"] == prep.rollout.records[i]["prompt"]
        assert r["answer"] == str(prep.rollout.records[i]["answer"])
        assert r["advantage"] == pytest.approx(float(rb.advantages[r["row"]]))
        assert r["response_tokens"] == int(rb.response_lengths[r["row"]])
        assert r["token_ids"] == list(samples.response_ids[i][j])
        n = len(r["token_ids"])  # the weights the loss gave each of them, token by token
        np.testing.assert_allclose(r["token_weights"], batch["token_weights"][r["row"]][:n]
                                   * batch["response_mask"][r["row"]][:n], atol=6e-5)
        m = batch["response_mask"][r["row"]]
        if m.sum() > 0:
            want = float((batch["token_weights"][r["row"]] * m).sum() / m.sum())
            assert r["token_weight_mean"] == pytest.approx(want, rel=1e-5)
    # DelTA's weights differ from 1 on some response (grpo / dapo would give 1 everywhere)
    assert any(abs(r["token_weight_mean"] - 1.0) > 1e-3 for r in rows if r["in_loss"])

    result = json.loads((tmp_path / "eval" / "step_0.json").read_text())
    responses = _read(tmp_path / "eval" / "step_0_responses.jsonl")
    for name, bench in result["benchmarks"].items():
        mine = [r for r in responses if r["benchmark"] == name]
        assert len(mine) == bench["num_questions"] * cfg.eval.k
        for q in bench["per_question"]:
            got = [r for r in mine if r["id"] == q["id"]]
            assert sorted(r["sample"] for r in got) == list(range(cfg.eval.k))
            assert sum(r["correct"] for r in got) == q["num_correct"]
            assert all(r["correct"] == float(len(r["response"]) % 2 == 0) for r in got)
            assert all(0 < r["response_tokens"] <= cfg.eval.max_new_tokens for r in got)
            assert all(r["response_tokens"] == cfg.eval.max_new_tokens
                       for r in got if r["truncated"])
            assert [r["vote"] for r in got] == [final_answer(r["response"]) for r in got]
            # of two samples the first with an answer wins (alone, or first of a tie)
            voted = [r["correct"] for r in sorted(got, key=lambda r: r["sample"])
                     if r["vote"] is not None]
            assert q["maj@2"] == (voted[0] if voted else 0.0)
        assert bench["response_len_mean"] == pytest.approx(
            np.mean([r["response_tokens"] for r in mine]))
        assert bench["truncated_frac"] == pytest.approx(np.mean([r["truncated"] for r in mine]))
        assert {r["prompt"] for r in mine} and all(r["answer"] for r in mine)
    assert 0 < sum(r["correct"] for r in responses) < len(responses)
    assert result["maj_ks"] == [2] and "maj@2" in result["average"]
