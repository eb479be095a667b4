"""delta_jax.token_view: the ranking against a dictionary reference, and on a real tiny run the
coefficients equal (a) the weights the trainer used at the next RL step and (b) an independent
recomputation from a plain forward pass + rl.delta.delta_coefficients."""
import collections
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from delta_jax import models, token_view
from delta_jax.rl.delta import delta_coefficients
from delta_jax.train import loop, phases
from delta_jax.train import run as run_lib
from delta_jax.train.config import validate_config
from delta_jax.train.state import split_model
from tests.rl_fixtures import StepRecorder

REPO = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_rank_tokens_matches_a_dictionary_reference():
    rng = np.random.default_rng(0)
    n, r = 10, 12
    ids = rng.integers(0, 7, (n, r))
    w = rng.uniform(0.7, 1.3, (n, r))
    adv = rng.choice([-1.0, 0.0, 1.0], n)
    mask = (np.arange(r)[None] < rng.integers(3, r + 1, n)[:, None]).astype(np.float32)
    got = token_view.rank_tokens(ids, w, adv, mask, min_count=4, top=3)
    for side, sign in (("pos", 1), ("neg", -1)):
        acc = collections.defaultdict(list)
        for i in range(n):
            for t in range(r):
                if mask[i, t] and np.sign(adv[i]) == sign:
                    acc[int(ids[i, t])].append(w[i, t])
        ref = sorted((np.mean(v), k, len(v)) for k, v in acc.items() if len(v) >= 4)
        want_down = [(k, m, c) for m, k, c in ref[:3]]
        want_up = [(k, m, c) for m, k, c in sorted(ref, key=lambda x: (-x[0], -x[1]))[:3]]
        for kind, want in (("down", want_down), ("up", want_up)):
            assert [e[0] for e in got[side][kind]] == [e[0] for e in want]
            np.testing.assert_allclose([e[1] for e in got[side][kind]], [e[1] for e in want])
            assert [e[2] for e in got[side][kind]] == [e[2] for e in want]


def _tiny_cfg(**delta):
    import importlib.util
    spec = importlib.util.spec_from_file_location("tiny_exp", REPO / "experiments" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.model.update(dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, logprob_chunk_tokens=64))
    c.data.update(dict(synthetic_train=200, synthetic_test=8, synthetic_levels="1"))
    c.rollout.update(dict(batch_prompts=4, group_size=4, max_new_tokens=16))
    c.rewards.update(dict(num_workers=1, overlong_buffer=4))
    c.rl.mini_batch_prompts = 2
    c.rl.dynamic_sampling = False  # a 20-step warm start may leave every group all-wrong
    c.optim.lr = 1e-3
    c.train.update(dict(steps=2, save_every=1, keep=5, eval_before=False, eval_after=False,
                        export_final=False, progress_bar=False))
    c.sft.update(dict(steps=20, batch_size=8, max_len=64))  # enough for some correct answers
    c.sft.lr = 3e-3
    c.delta.update(delta)
    return validate_config(c)


def _train(workdir, cfg):
    """A 2-step run in-process, as delta_jax.main would run it; returns step 2's batch (trained
    with checkpoint 1's policy) and checkpoint 1's parameters, as host arrays."""
    run = run_lib.build_run(cfg, str(workdir))
    with open(workdir / "config.json", "w") as f:  # what delta_jax.main writes
        json.dump(cfg.to_dict(), f)
    record = StepRecorder()
    _, run = loop.train(cfg, str(workdir), run=run, step_hooks=(record,))
    run.close()
    return {"batch": record.batches[2], "params": record.params_after[1]}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step delta run (last-layer proxy) on the config's mesh (all 8 test devices)."""
    workdir = tmp_path_factory.mktemp("token_view") / "run"
    workdir.mkdir()
    return workdir, _train(workdir, _tiny_cfg())


@pytest.fixture(scope="module")
def view(tiny_run):
    workdir, _ = tiny_run
    return token_view.compute_token_view(str(workdir), step=1)


def test_view_is_what_the_trainer_trained_on(tiny_run, view):
    _, trained = tiny_run
    batch = trained["batch"]
    P = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    np.testing.assert_array_equal(view.token_ids, batch["input_ids"][:, P:])
    np.testing.assert_array_equal(view.mask, batch["response_mask"])
    np.testing.assert_array_equal(view.advantages, batch["advantages"])
    np.testing.assert_allclose(view.weights, batch["token_weights"], atol=1e-6)
    assert view.step == 1 and view.method == "delta"
    valid = view.mask > 0
    assert np.any(view.advantages != 0), "the test batch needs a group with reward variance"
    np.testing.assert_allclose(view.weights[valid].mean(), 1.0, atol=1e-5)
    assert np.all(view.weights[~valid] == 0)


def test_view_matches_an_independent_recomputation(tiny_run, view):
    _, trained = tiny_run
    cfg = _tiny_cfg()
    batch = trained["batch"]
    tok = models.load_tokenizer(str(tiny_run[0] / "tokenizer"))
    model = run_lib.build_model(cfg, tok.vocab_size)
    graphdef, _, rest = split_model(model)
    model = nnx.merge(graphdef, trained["params"], rest)  # checkpoint 1's parameters
    ids, attn = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    R = batch["response_mask"].shape[1]
    P = ids.shape[1] - R
    out = model(ids, attention_mask=attn)
    hidden = out.hidden[:, P - 1:-1]
    logp = jax.nn.log_softmax(out.logits[:, P - 1:-1] / cfg.rollout.temperature, axis=-1)
    p = jnp.exp(jnp.take_along_axis(logp, ids[:, P:, None], axis=-1)[..., 0])
    # The trainer caches h in bf16 (features.py); do the same here.
    want, _ = delta_coefficients(hidden.astype(jnp.bfloat16), p, jnp.asarray(view.advantages),
                                 jnp.asarray(view.mask), num_refine=cfg.delta.num_refine,
                                 lam_min=cfg.delta.lam_min, lam_max=cfg.delta.lam_max)
    np.testing.assert_allclose(view.weights, np.asarray(want), atol=2e-3)
    np.testing.assert_allclose(view.token_prob, np.asarray(p) * view.mask, atol=1e-4)


def test_html_escapes_token_texts(view):
    """A shown response token whose text is markup appears escaped, never as markup."""
    import dataclasses
    r, t = 0, int(np.flatnonzero(view.mask[0] > 0)[0])
    tid = int(view.token_ids[r, t])
    marked = dataclasses.replace(view, token_text={**view.token_text, tid: "<|im_end|>&"})
    ranking = token_view.rank_tokens(view.token_ids, view.weights, view.advantages, view.mask,
                                     min_count=1, top=3)
    page = token_view.render_html(marked, ranking)
    assert "&lt;|im_end|&gt;&amp;" in page and "<|im_end|>" not in page


def test_cli_writes_html_and_png_and_prints_the_ranking(tiny_run, tmp_path, capsys):
    workdir, _ = tiny_run
    html_path, png_path = tmp_path / "view.html", tmp_path / "view.png"
    assert token_view.main([f"--workdir={workdir}", f"--out={html_path}", f"--png={png_path}",
                            "--min_count=1", "--top=5"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step 2:" in out  # the latest checkpoint by default
    assert "most down-weighted tokens, side A > 0" in out and f"html: {html_path}" in out
    page = html_path.read_text()
    assert page.startswith("<!doctype html>") and page.count("class='tok'") > 10
    assert "<|im_end|>" not in page     # token texts are escaped (below, whatever was sampled)
    assert png_path.read_bytes().startswith(PNG_MAGIC)
    # The synthetic task: credit classes on the tokens, per class weights, a marked response.
    assert "mean DelTA weight per credit class, side A < 0" in out
    assert "AUC of the weight, first_error vs the other tokens, A < 0" in out
    assert "credit classes under the tokens" in out
    assert "Ground-truth credit class of each token" in page
    assert any(f" class={c}'" in page for c in token_view.CLASS_NAMES[1:])  # token titles
    assert "Mean DelTA weight per credit class" in page


def test_bad_step_is_a_clear_error(tiny_run):
    with pytest.raises(ValueError, match="--step 7: no such checkpoint"):
        token_view.compute_token_view(str(tiny_run[0]), step=7)


def test_cli_input_errors_are_one_line(tiny_run, tmp_path, capsys):
    """The CLI says what is wrong with its --workdir / --step in one line (exit code 1), not a
    traceback: a directory delta_jax.main did not write, a step it has no checkpoint of."""
    assert token_view.main([f"--workdir={tmp_path / 'nothing'}"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'nothing' / 'config.json'} not found: --workdir must be a run "
        "directory written by python -m delta_jax.main")
    assert token_view.main([f"--workdir={tiny_run[0]}", "--step=7"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --step 7: no such checkpoint in "), err


def test_a_run_config_with_retired_fields_loads_and_names_them(tiny_run, tmp_path, capsys):
    """A run written by an earlier version: its config.json holds fields since retired from the
    schema (a section, a renamed field, a removed rollout option). They are skipped and named;
    every field today's schema has still takes the run's value."""
    saved = json.loads((tiny_run[0] / "config.json").read_text())
    saved["debug"] = {"hook": 1}
    saved["model"]["logprob_chunk"] = 256
    saved["rollout"]["decode_split_k"] = 2
    saved["delta"]["lam_max"] = 1.7
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = token_view.load_run_config(str(tmp_path))
    err = capsys.readouterr().err
    assert "debug, model.logprob_chunk, rollout.decode_split_k" in err, err
    assert cfg.delta.lam_max == 1.7 and cfg.mode == "train"
    del saved["rollout"]["decode_split_k"], saved["model"]["logprob_chunk"]
    assert json.loads(json.dumps(cfg.rollout.to_dict())) == saved["rollout"]
    assert json.loads(json.dumps(cfg.model.to_dict())) == saved["model"]


@pytest.mark.devices(8)
def test_view_of_a_topk_proxy_run_on_a_mesh(tmp_path, monkeypatch):
    """delta.proxy=hidden_topk (a 5-output old-policy pass) on an explicit (4, 2, 1) mesh, with
    two ablation flags on (random lambda, drawn from the step's key; fixed gamma): the view
    computes step 2's weights exactly as the trainer did, from rows placed on the mesh."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    cfg = _tiny_cfg(proxy="hidden_topk", topk=8, random_lambda=True, fixed_gamma=0.5)
    cfg.mesh.update(dict(data=4, fsdp=2, tensor=1))
    trained = _train(workdir, cfg)
    placed = []
    real = phases.old_policy_features

    def spy(old_pass, params, ids, *args, **kwargs):
        placed.append(len(ids.sharding.device_set))
        return real(old_pass, params, ids, *args, **kwargs)

    monkeypatch.setattr(phases, "old_policy_features", spy)
    view = token_view.compute_token_view(str(workdir), step=1)
    # the old-policy pass and, with tiny.py's KL term (rl.kl_coef > 0), the reference pass
    assert placed == [8] * (2 if cfg.rl.kl_coef > 0 else 1)
    batch = trained["batch"]
    np.testing.assert_array_equal(view.mask, batch["response_mask"])
    np.testing.assert_array_equal(view.advantages, batch["advantages"])
    assert np.any(view.advantages != 0)
    np.testing.assert_allclose(view.weights, batch["token_weights"], atol=1e-6)
    assert view.settings["random_lambda"] is True and view.settings["fixed_gamma"] == 0.5
    page = token_view.render_html(view, token_view.rank_tokens(view.token_ids, view.weights, view.advantages, view.mask))
    assert "random_lambda = True" in page and "proxy = hidden_topk" in page


def test_view_credit_classes_reproduce_the_trainers_credit_metrics(tiny_run, view):
    """The view labels step 2's batch with the run's credit_labeller; scored with the weights the
    trainer used, its classes give exactly the credit/* metrics the trainer logged at step 2."""
    from delta_jax.rl import credit
    workdir, trained = tiny_run
    assert view.classes is not None and view.classes.shape == view.mask.shape
    valid = view.mask > 0
    assert np.all(view.classes[~valid] == credit.NONE) and np.all(view.classes[valid] > 0)
    got = credit.credit_metrics(view.classes, trained["batch"]["token_weights"],
                                view.advantages, view.mask)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r.get("step") == 2 and "credit/tokens_step_pos" in r][-1]
    want = {k: v for k, v in logged.items() if k.startswith("credit/")}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-6), k
    # and the view's own per-class table is credit_metrics with DelTA's weights (= the trainer's
    # for a delta run)
    mine = token_view.class_weights(view)
    for k in want:
        assert mine[k] == pytest.approx(want[k], abs=1e-5), k


def _hand_view(with_classes=True):
    """2 prompts x 2 responses of 6 tokens; response 1 is wrong at its result " 4"."""
    text = {1: "1", 2: " +", 3: " 2", 4: " =", 5: " 3", 6: ".", 7: "<|im_end|>", 8: " 4"}
    ids = np.array([[1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 8, 6], [1, 2, 3, 4, 5, 7],
                    [1, 2, 3, 4, 8, 7]], np.int32)
    mask = np.ones(ids.shape, np.float32)
    mask[2, 5] = 0.0
    B, S, F, A = 1, 2, 3, 4
    classes = np.array([[B, B, B, B, S, B], [B, B, B, B, F, A], [B, B, B, B, S, 0],
                        [B, B, B, B, F, A]], np.int8)
    weights = np.array([[0.9, 0.9, 0.95, 0.9, 1.2, 0.9], [0.8, 0.85, 0.8, 0.8, 1.3, 1.1],
                        [0.9, 0.9, 0.9, 0.9, 1.1, 0.0], [0.85, 0.8, 0.85, 0.8, 1.4, 1.0]],
                       np.float32)
    return token_view.TokenView(
        step=3, method="delta", group_size=2, token_ids=ids, mask=mask, weights=weights * mask,
        token_prob=np.full(ids.shape, 0.5, np.float32) * mask,
        advantages=np.array([0.7, -0.7, 0.7, -0.7], np.float32),
        rewards=np.array([1, 0, 1, 0], np.float32), accuracy=np.array([1, 0, 1, 0], np.float32),
        problems=["What is 1 + 2?", "What is 1 + 2?"], answers=["3", "3"], token_text=text,
        diagnostics={"gamma_pos": 0.5}, settings={"lam_min": 0.8, "lam_max": 1.2,
                                                  "num_refine": 1, "temperature": 1.0},
        classes=classes if with_classes else None)


def test_class_marks_in_text_html_and_png_on_a_hand_made_view(tmp_path):
    from delta_jax.rl import credit
    v = _hand_view()
    metrics = token_view.class_weights(v)
    assert metrics == credit.credit_metrics(v.classes, v.weights, v.advantages, v.mask)
    # A < 0: first_error tokens " 4" weigh 1.3 and 1.4; boilerplate 8 tokens.
    assert metrics["credit/weight_first_error_neg"] == pytest.approx(1.35)
    assert metrics["credit/tokens_boilerplate_neg"] == 8
    table = token_view.format_class_weights(metrics)
    assert "first_error  mean weight 1.350  (2 tokens)" in table
    assert "after_error  (no tokens)" in table.split("side A < 0")[0]  # none on A > 0
    assert "first_error vs the other tokens, A < 0: 1.000 over 2 responses" in table
    text = token_view.format_credit_responses(v)
    lines = text.splitlines()
    i = lines.index(next(ln for ln in lines if ln.startswith("response 1 ")))
    assert lines[i + 1] == "  1\u00b7+\u00b72\u00b7=\u00b74."
    assert lines[i + 2] == "         XX~"  # " 4" is first_error, "." after it
    ranking = token_view.rank_tokens(v.token_ids, v.weights, v.advantages, v.mask, min_count=1)
    page = token_view.render_html(v, ranking)
    assert "Ground-truth credit class of each token" in page
    assert page.count("class=first_error") == 2 and page.count("class=step") == 2
    assert "outline:2px solid #000" in page and "Mean DelTA weight per credit class" in page
    png = token_view.render_png(v, str(tmp_path / "v.png"))
    assert pathlib.Path(png).read_bytes().startswith(PNG_MAGIC)

    plain = _hand_view(with_classes=False)
    assert token_view.class_weights(plain) == {}
    assert token_view.format_credit_responses(plain) == ""
    page = token_view.render_html(plain, ranking)
    assert "credit class" not in page and "class=boilerplate" not in page
    assert pathlib.Path(token_view.render_png(plain, str(tmp_path / "p.png"))).is_file()
