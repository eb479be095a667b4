"""Ground-truth token credit on the synthetic task (data.synthetic.token_classes), the
credit-assignment report (rl.credit) and its wiring into the RL step (run.credit_labeller)."""
import random

import numpy as np
import pytest

from delta_jax.data import synthetic, tiny_tokenizer
from delta_jax.rl import credit

B, S, F, A = credit.BOILERPLATE, credit.STEP, credit.FIRST_ERROR, credit.AFTER_ERROR
CODE = {"B": B, "S": S, "F": F, "A": A}

REF = "2 + 3 = 5. 5 * 2 = 10. \\boxed{10}"
# The tiny tokenizer's pieces of REF (test_reference_pieces_are_the_tokenizers checks them).
REF_PIECES = ["2", " +", " 3", " =", " 5", ".", " 5", " *", " 2", " =", " 1", "0", ".", " \\",
              "boxed", "{", "1", "0", "}"]
EOS = "<|im_end|>"


def classes(codes: str) -> list[int]:
    return [CODE[c] for c in codes]


def with_piece(pieces, index, new):
    out = list(pieces)
    out[index] = new
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tiny_tokenizer.build_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny_tok")))
    return AutoTokenizer.from_pretrained(path)


def test_reference_pieces_are_the_tokenizers(tok):
    ids = tok.encode(REF, add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == REF_PIECES
    assert tok.decode([tok.eos_token_id]) == EOS


@pytest.mark.parametrize("name, pieces, expected", [
    # Identical to the reference: results " 5", " 1" "0" and the boxed "1" "0" are step tokens;
    # restated operands, operators, "=", ".", "\boxed{", "}" and the EOS are boilerplate.
    ("correct", REF_PIECES + [EOS], "BBBBSBBBBBSSBBBBSSBB"),
    ("correct, EOS decoded to ''", REF_PIECES + [""], "BBBBSBBBBBSSBBBBSSBB"),
    # A wrong intermediate result "12": both tokens of the number are the first error.
    ("wrong result", with_piece(with_piece(REF_PIECES, 11, "2"), 17, "2") + [EOS],
     "BBBBSBBBBBFFAAAAAAAA"),
    # A wrong operand restatement "6 * 2" (for "5 * 2"): the number " 6".
    ("wrong operand", with_piece(REF_PIECES, 6, " 6") + [EOS], "BBBBSBFAAAAAAAAAAAAA"),
    # Only the boxed answer is wrong ("11"): the whole boxed number.
    ("wrong box", with_piece(REF_PIECES, 17, "1") + [EOS], "BBBBSBBBBBSSBBBBFFAA"),
    # An extra digit on a result ("105"): the whole number, from its first digit.
    ("longer number", REF_PIECES[:12] + ["5"] + REF_PIECES[12:] + [EOS],
     "BBBBSBBBBBFFFAAAAAAAA"),
    # Truncated after "= 10." by the length limit: the missing text has no token.
    ("truncated, no EOS", REF_PIECES[:13], "BBBBSBBBBBSSB"),
    # Stopped early (EOS) after "= 10.": the EOS is the first error.
    ("stopped early", REF_PIECES[:13] + [EOS], "BBBBSBBBBBSSBF"),
    # Stopped inside a result ("= 1" for "= 10"): the number written so far.
    ("stopped in a number", REF_PIECES[:11] + [EOS], "BBBBSBBBBBFA"),
    # Going on after the reference ends: the first extra token.
    ("continues", REF_PIECES + [" 7", " +", EOS], "BBBBSBBBBBSSBBBBSSBFAA"),
    # A wrong character outside numbers ("+" for "*"): that one token.
    ("wrong operator", with_piece(REF_PIECES, 7, " +") + [EOS], "BBBBSBBFAAAAAAAAAAAA"),
])
def test_token_classes_examples(name, pieces, expected):
    got = synthetic.token_classes(REF, pieces)
    assert got.dtype == np.int8 and got.shape == (len(pieces),)
    assert got.tolist() == classes(expected), name


def test_token_classes_with_other_token_boundaries():
    ref = "1 + 2 = 3. \\boxed{3}"
    # Coarse pieces: a token is a step token when it holds any decisive character.
    assert synthetic.token_classes(ref, ["1 + 2", " = 3", ". \\boxed{", "3}"]).tolist() == \
        classes("BSBS")
    assert synthetic.token_classes(ref, ["1 + 2", " = 4", ". \\boxed{4}"]).tolist() == \
        classes("BFA")
    # A token that starts before the error and overlaps it is the first error.
    assert synthetic.token_classes(ref, ["1 + 2 = 4.", " \\boxed{4}"]).tolist() == classes("FA")
    # Special tokens as the run's labeller decodes them ("", zero width) or as "<|...|>" text:
    # their text is not part of the response.
    assert synthetic.token_classes(ref, ["", "1 + 2 = 3. \\boxed{3}", ""]).tolist() == \
        classes("BSB")
    assert synthetic.token_classes(ref, ["<|im_start|>", "1 + 2 = 7", EOS]).tolist() == \
        classes("BFA")
    # An empty response that stops at once: its EOS is the error; no tokens at all is fine.
    assert synthetic.token_classes(ref, [EOS]).tolist() == classes("F")
    assert synthetic.token_classes(ref, []).tolist() == []


def test_first_error_unit_and_decisive_characters():
    assert synthetic.first_error_unit(REF, REF) is None
    assert synthetic.first_error_unit(REF, REF.replace("= 10", "= 12")) == (19, 21)
    assert synthetic.first_error_unit(REF, REF[:20]) == (19, 20)      # "= 1": the number so far
    assert synthetic.first_error_unit(REF, REF[:22]) == (22, 22)      # stopped after "10."
    assert synthetic.first_error_unit(REF, REF + " 7") == (len(REF), len(REF) + 1)
    decisive = synthetic.decisive_mask(REF)
    assert "".join(c for c, d in zip(REF, decisive) if d) == "51010"
    assert [i for i, d in enumerate(decisive) if d] == [8, 19, 20, 30, 31]


def _split_tokens(tok, text, eos):
    ids = tok.encode(text, add_special_tokens=False)
    return [tok.decode([i]) for i in ids] + ([EOS] if eos else [])


def _corrupt(rng, text):
    """One random single-character edit (replace, insert or delete) that changes the text."""
    alphabet = "0123456789 .=+-*{}x"
    while True:
        k = rng.randrange(len(text) + 1)
        edit = rng.choice(("replace", "insert", "delete"))
        if edit == "replace" and k < len(text):
            out = text[:k] + rng.choice(alphabet) + text[k + 1:]
        elif edit == "insert":
            out = text[:k] + rng.choice(alphabet) + text[k:]
        elif edit == "delete" and k < len(text):
            out = text[:k] + text[k + 1:]
        else:
            continue
        if out != text:
            return out


def test_token_classes_properties_on_corrupted_solutions(tok):
    """Random single-character corruptions of generated solutions, in the real tokenizer's
    pieces: the classes are ordered (before | first error | after), the first error is where
    the texts first differ (the whole number there), step tokens are exactly the tokens before
    it with a digit of a result or of the answer."""
    rng = random.Random(0)
    problems = (synthetic.generate_splits(60, 0, seed=1)["train"]
                + synthetic.generate_splits(20, 0, seed=2, steps=8, digits=3)["train"])
    checked_errors = 0
    for rec in problems:
        ref = rec["solution"]
        decisive = synthetic.decisive_mask(ref)
        for trial in range(8):
            eos = rng.random() < 0.5
            text = ref if trial == 0 else _corrupt(rng, ref)
            pieces = _split_tokens(tok, text, eos)
            got = synthetic.token_classes(ref, pieces).tolist()
            assert len(got) == len(pieces)
            assert "".join(pieces[:len(pieces) - eos]) == text  # the tiny tokenizer round-trips
            starts = np.cumsum([0] + [len(p) for p in pieces[:len(pieces) - eos]])
            if text == ref:
                assert F not in got and A not in got
                error_at = len(pieces)
            else:
                d = next((i for i in range(min(len(ref), len(text))) if ref[i] != text[i]),
                         min(len(ref), len(text)))
                assert got.count(F) >= 1 or (d == len(text) and not eos)
                if F not in got:  # truncated by the length limit right at a boundary: no F
                    assert A not in got
                    error_at = len(pieces)
                else:
                    error_at = got.index(F)
                    last = len(got) - 1 - got[::-1].index(F)
                    assert set(got[error_at:last + 1]) == {F}
                    assert set(got[last + 1:]) <= {A}
                    checked_errors += 1
                    if d < len(text):  # the token holding the first differing character is F
                        # (or the one before it, when the response's number stops short:
                        # "= 1." for "= 12.")
                        at = d - 1 if (d < len(ref) and ref[d].isdigit() and not text[d].isdigit()
                                       and d > 0 and text[d - 1].isdigit()) else d
                        holder = int(np.searchsorted(starts, at, side="right")) - 1
                        assert got[holder] == F, (ref, text, pieces, got)
                        if text[d].isdigit() or (d < len(ref) and ref[d].isdigit()):
                            # In a number: the F tokens are those overlapping the whole digit
                            # run of the response at d (containing d or ending at d), or the
                            # character d when there is no such run ("-11" for "11").
                            lo = hi = d
                            while lo > 0 and text[lo - 1].isdigit():
                                lo -= 1
                            while hi < len(text) and text[hi].isdigit():
                                hi += 1
                            if lo == hi:
                                hi = d + 1
                            overlapping = [i for i in range(len(starts) - 1)
                                           if starts[i] < hi and starts[i + 1] > lo]
                            assert overlapping == list(range(error_at, last + 1)), \
                                (ref, text, pieces, got)
                    else:  # stopped short: the EOS or the number written so far
                        assert ref.startswith(text) and got[-1] in (F, A)
            for i in range(error_at):
                if eos and i == len(pieces) - 1:
                    assert got[i] == B
                    continue
                has_decisive = bool(decisive[starts[i]:starts[i + 1]].any())
                assert got[i] == (S if has_decisive else B), (ref, text, pieces, got, i)
    assert checked_errors > 300


# ----------------------------------------------------------------------------- the report


def brute_auc(pos, neg):
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_pairwise_auc_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        pos = rng.integers(0, 5, rng.integers(1, 9)).astype(float) / 4  # many ties
        neg = rng.integers(0, 5, rng.integers(1, 9)).astype(float) / 4
        assert credit.pairwise_auc(pos, neg) == pytest.approx(brute_auc(pos, neg), abs=1e-12)
    assert credit.pairwise_auc([2.0], [1.0]) == 1.0
    assert credit.pairwise_auc([1.0], [1.0]) == 0.5
    assert np.isnan(credit.pairwise_auc([], [1.0]))


def known_batch():
    """Three responses (R = 6): a wrong one (A < 0) whose first error weighs most, a right one
    (A > 0) with two step tokens, a zero-advantage one (neither side), and padding."""
    classes_ = np.array([
        [B, S, F, A, A, 0],
        [B, S, B, S, B, 0],
        [B, S, B, B, 0, 0],
    ])
    weights = np.array([
        [1.0, 1.0, 1.2, 0.8, 1.2, 0.0],   # F=1.2 vs {1, 1, .8, 1.2}: (3 + .5) / 4 = .875
        [0.9, 1.1, 0.9, 0.9, 1.0, 0.0],   # S {1.1, .9} vs B {.9, .9, 1}: (3 + 1) / 6 = 2/3
        [5.0, 5.0, 5.0, 5.0, 0.0, 0.0],
    ])
    mask = (classes_ > 0).astype(np.float32)
    return classes_, weights, np.array([-1.0, 0.5, 0.0]), mask


def test_credit_metrics_known_answer():
    classes_, weights, adv, mask = known_batch()
    m = credit.credit_metrics(classes_, weights, adv, mask)
    assert m["credit/auc_first_error_neg"] == pytest.approx(0.875)
    assert m["credit/auc_first_error_neg_responses"] == 1.0
    assert m["credit/auc_step_pos"] == pytest.approx(2 / 3)
    assert m["credit/auc_step_pos_responses"] == 1.0
    assert m["credit/weight_first_error_neg"] == pytest.approx(1.2)
    assert m["credit/weight_after_error_neg"] == pytest.approx(1.0)
    assert m["credit/weight_boilerplate_neg"] == pytest.approx(1.0)
    assert m["credit/weight_step_pos"] == pytest.approx(1.0)
    assert m["credit/weight_boilerplate_pos"] == pytest.approx(2.8 / 3)
    assert m["credit/tokens_boilerplate_pos"] == 3.0 and m["credit/tokens_step_pos"] == 2.0
    assert m["credit/tokens_first_error_neg"] == 1.0 and m["credit/tokens_after_error_neg"] == 2
    # No such tokens: the count is 0 and the mean absent (the zero-advantage row is on no side).
    assert m["credit/tokens_first_error_pos"] == 0.0 and "credit/weight_first_error_pos" not in m
    assert m["credit/tokens_step_neg"] == 1.0
    assert set(m) == ({credit.tokens_key(c, s) for c in credit.CLASS_NAMES[1:] for s in credit.SIDES}
                      | {credit.weight_key(c, s) for c, s in [
                          ("boilerplate", "pos"), ("step", "pos"), ("boilerplate", "neg"),
                          ("step", "neg"), ("first_error", "neg"), ("after_error", "neg")]}
                      | set(credit.AUCS) | {credit.count_key(k) for k in credit.AUCS})
    # Per-token advantages (the same values broadcast) give the same report.
    adv_tok = np.broadcast_to(adv[:, None], classes_.shape) * mask
    assert credit.credit_metrics(classes_, weights, adv_tok, mask) == m
    # Uniform weights (GRPO / DAPO): every AUC is 1/2.
    ones = credit.credit_metrics(classes_, mask, adv, mask)
    assert ones["credit/auc_first_error_neg"] == ones["credit/auc_step_pos"] == 0.5
    # No qualifying response: the AUCs are absent, their counts 0.
    none = credit.credit_metrics(classes_, weights, np.zeros(3), mask)
    assert "credit/auc_step_pos" not in none and none["credit/auc_step_pos_responses"] == 0.0
    with pytest.raises(ValueError):
        credit.credit_metrics(classes_[:, :3], weights, adv, mask)


def test_credit_metrics_auc_matches_brute_force_on_random_batches():
    rng = np.random.default_rng(1)
    for _ in range(20):
        N, R = 12, 10
        classes_ = rng.integers(1, 5, (N, R))
        lengths = rng.integers(1, R + 1, N)
        mask = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
        classes_ = np.where(mask > 0, classes_, 0)
        weights = rng.integers(0, 4, (N, R)) / 2.0 * mask
        adv = rng.choice([-1.0, 0.0, 1.0], N)
        m = credit.credit_metrics(classes_, weights, adv, mask)
        for key, side, pos_cls, neg_of in [
                ("credit/auc_first_error_neg", -1, F, lambda c: c != F),
                ("credit/auc_step_pos", 1, S, lambda c: c == B)]:
            aucs = []
            for i in range(N):
                c, w = classes_[i][mask[i] > 0], weights[i][mask[i] > 0]
                pos, neg = w[c == pos_cls], w[neg_of(c)]
                if np.sign(adv[i]) == side and len(pos) and len(neg):
                    aucs.append(brute_auc(pos, neg))
            assert m[credit.count_key(key)] == len(aucs)
            if aucs:
                assert m[key] == pytest.approx(np.mean(aucs), abs=1e-12)
            else:
                assert key not in m


def test_summarize_weights_by_tokens_and_responses():
    rows = [
        {"step": 1, "credit/tokens_step_pos": 2.0, "credit/weight_step_pos": 1.1,
         "credit/auc_step_pos": 0.8, "credit/auc_step_pos_responses": 1.0,
         "credit/tokens_first_error_neg": 0.0, "credit/auc_first_error_neg_responses": 0.0},
        {"step": 2, "loss": 0.3},  # no credit metrics: skipped
        {"step": 3, "credit/tokens_step_pos": 6.0, "credit/weight_step_pos": 0.9,
         "credit/auc_step_pos": 0.4, "credit/auc_step_pos_responses": 3.0,
         "credit/tokens_first_error_neg": 0.0, "credit/auc_first_error_neg_responses": 0.0},
    ]
    s = credit.summarize(rows)
    assert s["credit/tokens_step_pos"] == 8.0
    assert s["credit/weight_step_pos"] == pytest.approx((2 * 1.1 + 6 * 0.9) / 8)
    assert s["credit/auc_step_pos"] == pytest.approx((0.8 + 3 * 0.4) / 4)
    assert s["credit/auc_step_pos_responses"] == 4.0
    assert s["credit/tokens_first_error_neg"] == 0.0
    assert "credit/weight_first_error_neg" not in s and "credit/auc_first_error_neg" not in s
    assert s["credit/auc_first_error_neg_responses"] == 0.0
    assert "credit/tokens_after_error_pos" not in s  # never reported
    assert credit.summarize([]) == {}
    # Summarizing one step's report gives it back.
    m = credit.credit_metrics(*known_batch())
    assert credit.summarize([m]) == pytest.approx(m)


def test_label_batch_labels_the_valid_tokens_of_each_row():
    vocab = {5: "2", 6: " +", 7: " 3", 8: " =", 9: " 5", 10: ".", 1: EOS}
    ids = np.array([[5, 6, 7, 8, 9, 1, 0], [5, 6, 7, 8, 7, 1, 0]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]])
    calls = []

    def decode(t):
        calls.append(t)
        return vocab[t]

    out = credit.label_batch(["2 + 3 = 5.", "2 + 3 = 5."], ids, mask, decode,
                             synthetic.token_classes)
    assert out.dtype == np.int8
    assert out.tolist() == [classes("BBBBSF") + [0], classes("BBBBFA") + [0]]
    assert sorted(calls) == sorted(set(calls))  # each id decoded once
    with pytest.raises(ValueError):
        credit.label_batch(["x"], ids, mask, decode, synthetic.token_classes)


# ----------------------------------------------------------------------------- the RL step


def _decoded_classes(tokenizer, solution, ids):
    """token_classes of a response decoded one token at a time, special tokens by their text
    (an independent path from the run's labeller, which decodes them to "")."""
    return synthetic.token_classes(solution, [tokenizer.decode([int(t)]) for t in ids])


def test_one_rl_step_of_a_synthetic_run_writes_credit_metrics(tmp_path):
    import json

    from delta_jax.train import loop
    from tests.rl_fixtures import LOOP_WITHOUT_EVAL, build_scored_run, tiny_rl_config

    cfg = tiny_rl_config("delta", train=dict(LOOP_WITHOUT_EVAL, steps=1),
                         data=dict(synthetic_steps=2, synthetic_digits=3, max_prompt_len=64))
    prepared = {}
    run = build_scored_run(cfg, tmp_path)
    try:
        assert run.credit_labeller is not None
        # The difficulty knobs reached the task's files.
        recs = [json.loads(line) for line in open(run.assets["train"])]
        assert all(r["solution"].count(" = ") == 2 for r in recs)
        assert any(int(r["answer"]) > 99 for r in recs)
        _, run = loop.train(cfg, str(tmp_path), run=run,
                            step_hooks=[lambda run, step, out: prepared.update({step: out})])
        tokenizer = run.tokenizer
    finally:
        run.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    row = next(r for r in rows if "policy/loss" in r)
    for side in credit.SIDES:
        for name in credit.CLASS_NAMES[1:]:
            assert credit.tokens_key(name, side) in row
    for key in credit.AUCS:
        assert credit.count_key(key) in row
    assert "time/credit_s" in row and np.isfinite(row["time/credit_s"])
    out = prepared[1]
    prep = out.prepared
    rb = prep.packed
    classes = prep.credit_classes
    mask = rb.response_mask
    assert classes.shape == mask.shape and classes.dtype == np.int8
    assert np.all((classes > 0) == (mask > 0))
    # The packed rows' labels are token_classes of the decoded responses, against the solution
    # of each row's prompt (rows are prompt-major).
    G = cfg.rollout.group_size
    ids = rb.input_ids[:, rb.prompt_len:]
    for n in range(rb.num_rows):
        length = int(mask[n].sum())
        solution = prep.rollout.records[n // G]["solution"]
        assert classes[n, :length].tolist() == \
            _decoded_classes(tokenizer, solution, ids[n, :length]).tolist()
    # The logged report is credit_metrics of those labels with the loss's token weights.
    expected = credit.credit_metrics(classes, np.asarray(out.batch["token_weights"]),
                                     rb.advantages, mask)
    assert {k: row[k] for k in expected} == pytest.approx(expected)
    assert {k for k in row if k.startswith("credit/")} == set(expected)
    # Method delta: the weights are DelTA's, not all ones.
    w = np.asarray(out.batch["token_weights"])[mask > 0]
    assert w.std() > 0


def test_credit_labeller_labels_known_responses_with_the_runs_tokenizer(tmp_path):
    from delta_jax.train import rl_step as rl_step_lib
    from tests.rl_fixtures import build_scored_run, initial_state, tiny_rl_config

    cfg = tiny_rl_config("dapo")
    run = build_scored_run(cfg, tmp_path)
    try:
        tok = run.tokenizer
        eos = tok.eos_token_id
        records = [{"solution": REF}, {"solution": "1 + 2 = 3. \\boxed{3}"}]
        texts = [REF, REF.replace("= 10.", "= 12."), "1 + 2 = 3. \\boxed{3}", "1 + 2 = 3."]
        enc = [tok.encode(t) + [eos] for t in texts]
        R = max(map(len, enc)) + 2
        ids = np.zeros((4, R), np.int32)
        mask = np.zeros((4, R), np.float32)
        for n, e in enumerate(enc):
            ids[n, :len(e)] = e
            mask[n, :len(e)] = 1
        got = run.credit_labeller(records, ids, mask)
        assert got[0, :20].tolist() == classes("BBBBSBBBBBSSBBBBSSBB") and not got[0, 20:].any()
        assert got[1, :20].tolist() == classes("BBBBSBBBBBFFAAAAAAAA")
        assert got[2, :len(enc[2])].tolist()[-1] == B and F not in got[2].tolist()
        assert got[3, :len(enc[3])].tolist()[-1] == F  # stopped before the box
        with pytest.raises(ValueError, match="equal groups"):
            run.credit_labeller(records[:1] * 3, ids, mask)

        # One rl_step of a dapo run: the loss's weights are the mask, so every logged class
        # weighs 1 and every AUC is 1/2.
        out = rl_step_lib.rl_step(run, initial_state(run), 1)
        m = out.metrics
        weights = {k: v for k, v in m.items() if k.startswith("credit/weight_")}
        assert weights and all(v == pytest.approx(1.0) for v in weights.values())
        # The random policy's A < 0 responses depart from the reference, so the first-error AUC
        # averages some of them (the step AUC may have none: the stand-in scorer's A > 0
        # responses hold no step token here).
        assert m[credit.count_key("credit/auc_first_error_neg")] > 0
        for key in credit.AUCS:
            if m[credit.count_key(key)]:
                assert m[key] == pytest.approx(0.5)
        assert out.prepared.credit_classes is not None and "time/credit_s" in m
    finally:
        run.close()


def test_no_credit_labeller_off_the_synthetic_task(tmp_path):
    from delta_jax.train import run as run_lib
    from tests.rl_fixtures import tiny_rl_config

    paths = synthetic.write_synthetic_splits(str(tmp_path / "data"), num_train=16, num_test=2,
                                             levels=(1,))
    cfg = tiny_rl_config("grpo", data=dict(train=paths["train"]))
    run = run_lib.build_run(cfg, str(tmp_path / "run"), need_data=False, need_scorer=False)
    try:
        assert run.credit_labeller is None
    finally:
        run.close()
