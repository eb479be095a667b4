"""delta_jax.train.run: what build_run wires from a config."""
import os

import jax
import jax.numpy as jnp
import pytest

from delta_jax.data import tiny_tokenizer
from delta_jax.train import run as run_lib
from tests.rl_fixtures import build_scored_run, tiny_rl_config


@pytest.mark.parametrize("method,delta,hidden_out", [
    ("dapo", {}, False),
    ("grpo", {}, False),
    ("delta", dict(feature_cache="recompute"), False),
    ("delta", dict(proxy="hidden_topk", topk=4), False),
    ("delta", dict(feature_cache="device"), True),
    ("delta", dict(feature_cache="host"), True),
])
def test_old_policy_pass_returns_h_only_when_delta_reads_it(tmp_path, method, delta, hidden_out):
    """The old-policy pass's [rows, R, H] hidden states leave the program only when DelTA reads
    them from it: not for grpo / dapo, the recompute cache (the trunk runs again) or the top-K
    proxy (it reads the top-K ids); the trunk pass exists only for the recompute cache."""
    run = build_scored_run(tiny_rl_config(method, delta=delta), tmp_path)
    try:
        ids = jax.ShapeDtypeStruct((4, 24), jnp.int32)
        out = jax.eval_shape(lambda p, i, a: run.old_pass(p, i, a, 8), run.initial_params, ids,
                             ids)
        assert (out[2] is not None) == hidden_out
        if hidden_out:
            assert out[2].shape == (4, 8, 32) and out[2].dtype == jnp.bfloat16
        assert (run.hidden_pass is not None) == (delta.get("feature_cache") == "recompute")
        assert run_lib.feature_cache_mode(run.cfg, run.with_delta) == (
            delta.get("feature_cache", "device") if hidden_out else "drop")
    finally:
        run.close()


def test_build_run_resolves_remat_auto_against_the_device(tmp_path, monkeypatch):
    """model.remat=auto: train mode builds the model with plan.choose_remat's policy for the
    device's allocator limit, or plan.device_memory_gb where the backend reports none (the
    CPU); eval builds it with full remat (no gradients). Each capacity sits just below what
    the lighter policy's planned update needs."""
    from delta_jax import plan
    from tests.rl_fixtures import single_device_mesh

    cfg = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32))
    mc = plan.model_config_from_run_config(cfg, remat="full")
    update = {p: plan.plan_from_config(cfg, mesh_shape=(1, 1, 1), model_cfg=mc.replace(remat=p)
                                       ).phases["update"] for p in plan.AUTO_REMAT_ORDER}
    mesh = single_device_mesh()

    def built_remat(c, name):
        run = run_lib.build_run(c, str(tmp_path / name), need_data=False, need_scorer=False,
                                mesh=mesh)
        try:
            assert run.model(run.initial_params).cfg.remat == run.cfg.model.remat
            return run.cfg.model.remat
        finally:
            run.close()

    below_none = (update["none"] - 1) / plan.AUTO_REMAT_FILL
    below_dots = (update["dots_with_no_batch_dims_saveable"] - 1) / plan.AUTO_REMAT_FILL
    if plan.device_memory_bytes() is None:  # the CPU: plan.device_memory_gb is the capacity
        assert built_remat(cfg, "default") == "none"
        assert run_lib.build_model(cfg, 100).cfg.remat == "none"  # alone, without a mesh
        small = tiny_rl_config("dapo", rollout=dict(max_new_tokens=32),
                               plan=dict(device_memory_gb=below_none / plan.GB))
        assert built_remat(small, "small") == "dots_with_no_batch_dims_saveable"
    else:  # a device that reports its limit (a GPU), which holds this tiny model many times
        assert built_remat(cfg, "default") == plan.auto_remat_order()[0]
    # A device that reports its limit: that, not plan.device_memory_gb.
    monkeypatch.setattr(plan, "device_memory_bytes", lambda device=None: int(below_dots))
    assert built_remat(cfg, "device") == "full"
    assert cfg.model.remat == "auto"  # the caller's config is not changed
    evaluate = cfg.copy_and_resolve_references()
    evaluate.mode = "eval"  # (eval's own validation wants benchmark files)
    assert run_lib.resolve_remat(evaluate, mesh, 100).model.remat == "full"
    fixed = tiny_rl_config("dapo", model=dict(remat="dots_saveable"))
    assert run_lib.resolve_remat(fixed, mesh, 100) is fixed


def test_training_prompts_over_data_max_prompt_len_are_left_out_with_a_warning(tmp_path,
                                                                                caplog):
    """data.overlong_prompts: "drop" (default) leaves the training records whose templated
    prompt is over data.max_prompt_len tokens out of the prompt pipeline, with a warning that
    counts them; "error" refuses the run at build time naming the knobs. The expected count is
    read from the task's JSONL with the run's tokenizer and template."""
    import json
    import logging
    import os

    from tests.rl_fixtures import single_device_mesh

    first = run_lib.build_run(tiny_rl_config("grpo", data=dict(max_prompt_len=256)),
                              str(tmp_path), need_scorer=False, mesh=single_device_mesh())
    try:
        with open(first.assets["train"]) as f:
            problems = [json.loads(line)["problem"] for line in f]
        lengths = sorted(len(first.tokenizer.encode(first.template(p))) for p in problems)
        assert first.data_iter.num_overlong == 0
    finally:
        first.close()
    limit = lengths[len(lengths) // 2]
    over = sum(n > limit for n in lengths)
    assert 0 < over < len(lengths)
    cfg = tiny_rl_config("grpo", data=dict(max_prompt_len=limit))
    with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
        run = run_lib.build_run(cfg, str(tmp_path), need_scorer=False, mesh=single_device_mesh())
    try:
        assert run.data_iter.num_overlong == over
        assert (f"data.train: left out {over} of {len(lengths)} records whose prompt is over "
                f"data.max_prompt_len={limit} tokens (the longest: {lengths[-1]}") in caplog.text
        assert all(len(r["prompt_ids"]) <= limit for r in next(run.data_iter))
    finally:
        run.close()
    cfg = tiny_rl_config("grpo", data=dict(max_prompt_len=limit, overlong_prompts="error"))
    with pytest.raises(ValueError, match=f"{over} of {len(lengths)} records of data.train"):
        run_lib.build_run(cfg, str(tmp_path), need_scorer=False, mesh=single_device_mesh())
    assert os.path.isdir(tmp_path / "synthetic")


def test_data_shuffle_false_trains_on_the_records_in_file_order(tmp_path):
    """data.shuffle=False: the training batches follow data.train's record order (a curriculum);
    the default draws a shuffled order."""
    import json

    from tests.rl_fixtures import single_device_mesh

    def first_problems(shuffle):
        cfg = tiny_rl_config("grpo", data=dict(shuffle=shuffle, max_prompt_len=256))
        run = run_lib.build_run(cfg, str(tmp_path / f"shuffle{shuffle}"), need_scorer=False,
                                mesh=single_device_mesh())
        try:
            with open(run.assets["train"]) as f:
                in_file = [json.loads(line)["problem"] for line in f]
            drawn = [r["problem"] for _ in range(3) for r in next(run.data_iter)]
        finally:
            run.close()
        return drawn, in_file[:len(drawn)]

    drawn, in_file = first_problems(False)
    assert drawn == in_file and len(drawn) == 3 * tiny_rl_config("grpo").rollout.batch_prompts
    drawn, in_file = first_problems(True)
    assert drawn != in_file and len(set(drawn)) == len(drawn)


def test_the_reward_must_fit_the_training_answers():
    """rewards.name=code needs unit tests as answers, a math reward math answers: a mismatch in
    the first records stops the run at start-up, naming both."""
    import json

    from delta_jax.errors import InputError

    spec = json.dumps({"tests": ["assert f(1) == 2"]})
    math_rows, code_rows = [{"answer": "5"}] * 3, [{"answer": spec}] * 3
    run_lib.check_reward_fits_data(math_rows, "math")
    run_lib.check_reward_fits_data(math_rows, "math_format")
    run_lib.check_reward_fits_data(code_rows, "code")
    with pytest.raises(InputError, match=r"^rewards\.name=math: 1 of the first 4 records of "
                                         r"data\.train are code problems"):
        run_lib.check_reward_fits_data(math_rows + code_rows[:1], "math")
    with pytest.raises(InputError, match=r"^rewards\.name=code: 3 of the first 4 records .* "
                                         r"\(e\.g\. '5'\)"):
        run_lib.check_reward_fits_data(code_rows[:1] + math_rows, "code")
    # Only the first `sample` records are read.
    run_lib.check_reward_fits_data(code_rows + math_rows, "code", sample=3)


def test_a_neutral_template_asks_for_the_rewards_answer(tmp_path):
    from delta_jax.data import templates
    from tests.rl_fixtures import single_device_mesh

    for reward, instruction in (("code", templates.CODE_INSTRUCTION),
                                ("math", templates.BOXED_INSTRUCTION)):
        cfg = tiny_rl_config("grpo", rewards=dict(name=reward), data=dict(template="plain"))
        run = run_lib.build_run(cfg, str(tmp_path / reward), need_data=False, need_scorer=False,
                                mesh=single_device_mesh())
        try:
            assert run.template("Add 2.") == f"Add 2.\n{instruction}"
        finally:
            run.close()


# The tiny tokenizer's chat template plus Qwen3's handling of enable_thinking (an empty think
# block opens the answer when it is false): a stand-in that runs without ../shared.
THINKING_TEMPLATE = (tiny_tokenizer.CHAT_TEMPLATE + "{%- if add_generation_prompt and "
                     "enable_thinking is defined and enable_thinking is false %}"
                     "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


@pytest.mark.parametrize("tokenizer", ["tiny_thinking", "qwen3"])
def test_chat_template_options_reach_the_prompt(tmp_path, request, tokenizer):
    """data.system_prompt and data.enable_thinking reach the run's prompt through the
    tokenizer's chat template (Qwen3's own where ../shared has it): a system turn first, and
    with thinking off the empty think block that opens Qwen3's non-thinking answers; the
    reward's instruction stays in the user turn."""
    import json

    from delta_jax.data import templates
    from tests.rl_fixtures import single_device_mesh

    if tokenizer == "qwen3":
        tok_dir = str(request.getfixturevalue("qwen3_tokenizer_dir"))
    else:
        tok_dir = tiny_tokenizer.build_tiny_tokenizer(str(tmp_path / "tok"))
        config_file = os.path.join(tok_dir, "tokenizer_config.json")
        with open(config_file) as f:
            tok_config = json.load(f)
        tok_config["chat_template"] = THINKING_TEMPLATE
        with open(config_file, "w") as f:
            json.dump(tok_config, f)
    problem = "Add 2 and 3."
    user = f"<|im_start|>user\n{problem}\n{templates.BOXED_INSTRUCTION}<|im_end|>\n"
    for options, want in (
            (dict(), user + "<|im_start|>assistant\n"),
            (dict(system_prompt="Be brief.", enable_thinking=False),
             "<|im_start|>system\nBe brief.<|im_end|>\n" + user
             + "<|im_start|>assistant\n<think>\n\n</think>\n\n")):
        cfg = tiny_rl_config("grpo", data=dict(template="chat", **options),
                             tokenizer=dict(path=tok_dir))
        run = run_lib.build_run(cfg, str(tmp_path / f"run{len(options)}"), need_data=False,
                                need_scorer=False, mesh=single_device_mesh())
        try:
            assert run.template(problem) == want
        finally:
            run.close()


def test_data_instruction_replaces_the_tasks_instruction_in_its_prompts(tmp_path):
    """data.instruction is what the run's prompts and its own task's benchmark prompts ask for
    (qwen_math's system turn, plain's line after the problem), the other task's benchmarks keep
    theirs (a math run's code benchmark asks for a ```python program), and "" keeps the task's
    own (\\boxed{}), "none" none."""
    import json

    from delta_jax.data import templates
    from tests.rl_fixtures import single_device_mesh

    code, math = tmp_path / "code.jsonl", tmp_path / "math.jsonl"
    code.write_text(json.dumps({"problem": "f", "answer": json.dumps(
        {"tests": ["assert f() == 1"]})}) + "\n")
    math.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    said = "Reason, then end with a line 'Answer: <number>'."
    for template, instruction, want in (
            ("plain", said, f"Add 2 and 3.\n{said}"),
            ("plain", "", f"Add 2 and 3.\n{templates.BOXED_INSTRUCTION}"),
            ("plain", "none", "Add 2 and 3."),
            ("qwen_math", said, f"<|im_start|>system\n{said}<|im_end|>\n")):
        cfg = tiny_rl_config("grpo", data=dict(template=template, instruction=instruction,
                                                eval=f"{math},{code}"))
        run = run_lib.build_run(cfg, str(tmp_path / f"{template}{len(instruction)}"),
                                need_data=False, need_scorer=False, mesh=single_device_mesh())
        try:
            assert run.template("Add 2 and 3.").startswith(want)
            if instruction == "none":
                assert run.template("Add 2 and 3.") == want
            assert run.eval_prompts["math"]("Add 2 and 3.") == run.template("Add 2 and 3.")
            assert templates.CODE_INSTRUCTION in run.eval_prompts["code"]("f")
            assert said not in run.eval_prompts["code"]("f")
        finally:
            run.close()


def test_math_format_shaping_reaches_the_scorer():
    """rewards.one_box_bonus / no_box_penalty shape the training reward of rewards.name =
    math_format: correct with one box, wrong with one box, no box."""
    cfg = tiny_rl_config("grpo", rewards=dict(name="math_format", one_box_bonus=0.25,
                                                no_box_penalty=0.5))
    responses = ["so \\boxed{5}", "so \\boxed{6}", "so 5"]
    with run_lib.make_scorer(cfg, shaped=True) as scorer:
        rewards, info = scorer.score(responses, ["5"] * 3)
    assert rewards.tolist() == [1.25, 0.25, -0.5]
    assert info["accuracy"].tolist() == [1.0, 0.0, 0.0]


def test_math_eval_scorer_grades_in_the_training_scorers_pool(tmp_path):
    """A train run's math accuracy scorer shares the training scorer's verification pool (one
    set of rewards.num_workers workers) and grades there, and the run's close closes the pool
    once; a code benchmark's scorer has its own runner."""
    import json

    from tests.rl_fixtures import single_device_mesh

    spec = json.dumps({"tests": ["assert f(1) == 2"]})
    (tmp_path / "m.jsonl").write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    (tmp_path / "c.jsonl").write_text(json.dumps({"problem": "f(x) = x + 1", "answer": spec})
                                      + "\n")
    cfg = tiny_rl_config("grpo", data=dict(eval=f"{tmp_path}/m.jsonl,{tmp_path}/c.jsonl"),
                         rewards=dict(name="math_format", one_box_bonus=0.25, num_workers=1))
    run = run_lib.build_run(cfg, str(tmp_path / "w"), need_data=False, mesh=single_device_mesh())
    try:
        math_eval, code_eval = run.eval_scorers["math"], run.eval_scorers["code"]
        assert math_eval.pool is run.scorer.pool
        assert code_eval.pool is not run.scorer.pool
        responses, golds = ["so \\boxed{2}", "so \\boxed{3}"], ["2", "2"]
        assert run.scorer.score(responses, golds)[0].tolist() == [1.25, 0.25]  # shaped
        # Evaluation reads the accuracy (the reward has the run's math_format shaping).
        assert math_eval.score(responses, golds)[1]["accuracy"].tolist() == [1.0, 0.0]
    finally:
        run.close()
    assert run.scorer.closed and math_eval.closed and code_eval.closed


def test_a_reward_of_your_own_trains_and_evaluates(tmp_path):
    """rewards.name=python: the run's training rewards are the user's function's, given each
    response's problem text, plus DAPO's overlong shaping, 0 where it raised, counted in
    rollout/num_errors (one dapo step, its rollout written by train.rollouts_every), its math
    benchmark is graded by the same function in the same worker pool, and a file that does not
    load stops the start naming rewards.python_fn."""
    import json

    from delta_jax.errors import InputError
    from delta_jax.rl.rewards import overlong_penalty
    from delta_jax.train import loop
    from tests.rl_fixtures import LOOP_WITHOUT_EVAL, single_device_mesh

    (tmp_path / "parity.py").write_text(
        "def reward(response, answer, problem):\n"
        "    if len(response) % 3 == 0:\n"
        "        raise ValueError('a third of them')\n"
        "    return {'reward': (2.0 if len(response) % 2 == 0 else -1.0) + len(problem) / 1e3,\n"
        "            'correct': len(response) % 2 == 0}\n")
    fn = f"{tmp_path}/parity.py:reward"
    cfg = tiny_rl_config("dapo", rewards=dict(name="python", python_fn=fn, num_workers=1),
                         data=dict(eval="synthetic"),
                         eval=dict(k=2, pass_k="1,2", limit=2, max_new_tokens=8),
                         train=dict(LOOP_WITHOUT_EVAL, steps=1, rollouts_every=1))
    run = run_lib.build_run(cfg, str(tmp_path / "w"), mesh=single_device_mesh())
    try:
        assert run.eval_scorers["math"].pool is run.scorer.pool
        loop.train(cfg, str(tmp_path / "w"), run=run)
        with open(tmp_path / "w" / "rollouts" / "step_1.jsonl") as f:
            rows = [json.loads(line) for line in f]
        with open(tmp_path / "w" / "synthetic" / "train.jsonl") as f:
            problem_of = {r["id"]: r["problem"] for r in map(json.loads, f)}
        assert len(rows) == 16
        errors = [len(r["response"]) % 3 == 0 for r in rows]
        step = [json.loads(l) for l in open(tmp_path / "w" / "metrics.jsonl")][-1]
        assert step["step"] == 1 and step["rollout/num_errors"] == sum(errors)
        assert 0 < sum(errors) < len(rows)
        for r, error in zip(rows, errors):
            even = len(r["response"]) % 2 == 0 and not error
            own = 0.0 if error else (2.0 if even else -1.0) + len(problem_of[r["id"]]) / 1e3
            shaped = own + float(overlong_penalty(
                [r["response_tokens"]], cfg.rollout.max_new_tokens, cfg.rewards.overlong_buffer,
                cfg.rewards.overlong_factor)[0])
            assert r["reward"] == pytest.approx(shaped) and r["correct"] == float(even)
        _, info = run.eval_scorers["math"].score(["ab", "abc"], ["1", "1"], problems=["q"] * 2)
        assert info["accuracy"].tolist() == [1.0, 0.0]
    finally:
        run.close()
    bad = tiny_rl_config("dapo", rewards=dict(name="python", python_fn=f"{tmp_path}/nope.py:f"))
    with pytest.raises(InputError, match="^rewards.python_fn: .*nope.py: no such file"):
        run_lib.build_run(bad, str(tmp_path / "w2"), need_data=False, mesh=single_device_mesh())


def test_trl_reward_functions_train_unchanged(tmp_path, caplog):
    """TRL reward functions, fn(prompts, completions, solution, level, **kwargs) -> list,
    unchanged as rewards.python_fn, two of them with weights (TRL's reward_funcs,
    reward_weights): a training step calls each on rewards.python_batch_size responses at a time
    with their problems as prompts=, their records' solutions as solution= and the data set's
    "level" column as level= (strings under data.template=plain:
    completion_format auto), the responses' token ids as completion_ids= and the run's
    trainer_state= (global_step: the steps done before the rollout; max_steps); each response's
    reward is the weighted sum of its entries, and each function's mean reward is logged as
    rollout/reward_fn/<name>, and its reward of each response written with the step's
    rollouts."""
    import json
    import logging

    from delta_jax.train import loop
    from tests.rl_fixtures import LOOP_WITHOUT_EVAL, single_device_mesh

    (tmp_path / "trl_reward.py").write_text(
        "def reward(prompts, completions, solution, level, **kwargs):\n"
        "    return [len(completions) + (len(c) % 2 == 0) + len(p) / 1e2 + len(s) / 1e4\n"
        "            + lv / 1e3 for p, c, s, lv in zip(prompts, completions, solution, level)]\n\n"
        "def bonus(completions, completion_ids, trainer_state, **kwargs):\n"
        "    assert all(type(t) is int for ids in completion_ids for t in ids)\n"
        f"    with open({str(tmp_path / 'states.txt')!r}, 'a') as f:\n"
        "        f.write(f'{trainer_state.global_step} {len(completions)}\\n')\n"
        "    return [sum(ids) % 97 + 1000 * trainer_state.global_step\n"
        "            + 100 * trainer_state.max_steps for ids in completion_ids]\n")
    fns = f"{tmp_path}/trl_reward.py:reward,{tmp_path}/trl_reward.py:bonus"
    cfg = tiny_rl_config("grpo", rewards=dict(name="python", python_fn=fns, num_workers=1,
                                              python_batch_size=8, python_weights="1,-0.5"),
                         data=dict(eval="synthetic"),
                         eval=dict(k=2, pass_k="1,2", limit=2, max_new_tokens=8),
                         train=dict(LOOP_WITHOUT_EVAL, steps=2, rollouts_every=1,
                                    rollouts_token_weights=True, eval_after=True))
    with caplog.at_level(logging.INFO, logger="delta_jax.train"):
        run = run_lib.build_run(cfg, str(tmp_path / "w"), mesh=single_device_mesh())
    try:
        assert run.scorer.user_calls[0].batch and run.scorer.completion_format == "text"
        assert [m for m in caplog.messages if "a batch reward (TRL's form), called on 8 "
                "responses at a time" in m and "completions as strings" in m]
        loop.train(cfg, str(tmp_path / "w"), run=run)
    finally:
        run.close()
    with open(tmp_path / "w" / "synthetic" / "train.jsonl") as f:
        record = {r["id"]: r for r in map(json.loads, f)}
    steps = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
    for step in (1, 2):
        with open(tmp_path / "w" / "rollouts" / f"step_{step}.jsonl") as f:
            rows = [json.loads(line) for line in f]
        assert len(rows) == 16
        own, bonus = [], []
        for r in rows:
            own.append(8.0 + (len(r["response"]) % 2 == 0)
                       + len(record[r["id"]]["problem"]) / 1e2
                       + len(record[r["id"]]["solution"]) / 1e4
                       + record[r["id"]]["level"] / 1e3)
            assert len(r["token_ids"]) == r["response_tokens"]
            bonus.append(sum(r["token_ids"]) % 97 + 1000 * (step - 1) + 200)
            assert r["reward"] == pytest.approx(own[-1] - 0.5 * bonus[-1], rel=1e-6), r
            assert r["reward_fns"] == {"reward": pytest.approx(own[-1], rel=1e-6),
                                       "bonus": bonus[-1]}
        logged = [m for m in steps if m.get("step") == step and "rollout/reward_fn/reward" in m]
        assert logged[0]["rollout/reward_fn/reward"] == pytest.approx(sum(own) / len(own),
                                                                     rel=1e-6)
        assert logged[0]["rollout/reward_fn/bonus"] == pytest.approx(sum(bonus) / len(bonus),
                                                                    rel=1e-6)
    # each step's two calls of 8, then the evaluation after step 2 (2 questions x 2 samples)
    calls = (tmp_path / "states.txt").read_text().split("\n")[:-1]
    assert calls == ["0 8", "0 8", "1 8", "1 8", "2 4"], calls
    with open(tmp_path / "w" / "eval" / "step_2.json") as f:  # its rows had level= too
        assert json.load(f)["benchmarks"]["synthetic_test"]["num_errors"] == 0


@pytest.mark.parametrize("eval_data, field", [("synthetic", "data.eval"), ("", "data.train")])
def test_a_column_the_data_lacks_stops_the_start(tmp_path, eval_data, field):
    """A python_fn parameter without default that names no column of the data (a typo, or
    another data set's): the start stops at the benchmark or training file, naming its row, the
    field and why it is wanted."""
    from delta_jax.errors import InputError
    from tests.rl_fixtures import single_device_mesh

    (tmp_path / "r.py").write_text("def reward(completions, topic, **kwargs):\n"
                                   "    return [0.0] * len(completions)\n")
    cfg = tiny_rl_config("grpo", rewards=dict(name="python", python_fn=f"{tmp_path}/r.py:reward",
                                              num_workers=1), data=dict(eval=eval_data))
    with pytest.raises(InputError, match=f"^{field}: .*jsonl:line 1: missing field 'topic', a "
                                         "column the reward takes by name"):
        run_lib.build_run(cfg, str(tmp_path / "w"), mesh=single_device_mesh())


@pytest.mark.parametrize("template, setting, want", [
    ("qwen_math", "auto", "messages"), ("chat", "auto", "messages"), ("code", "auto", "messages"),
    ("base", "auto", "text"), ("plain", "auto", "text"), ("qwen_math", "text", "text"),
    ("plain", "messages", "messages")])
def test_a_batch_rewards_completion_format_follows_the_prompt_layout(template, setting, want):
    """rewards.completion_format=auto gives a TRL-style reward chat messages where the prompt is a
    chat (TRL's conversational form), strings for base / plain prompts."""
    from tests.rl_fixtures import apply_overrides

    cfg = apply_overrides(tiny_rl_config("grpo"), {"data": dict(template=template),
                                                   "rewards": dict(completion_format=setting)})
    assert run_lib.completion_format(cfg) == want


def test_a_verl_reward_gets_each_records_context_in_training_and_evaluation(tmp_path):
    """A verl custom reward, compute_score(data_source, solution_str, ground_truth,
    extra_info=None), unchanged as rewards.python_fn: in a training step each response is scored
    with its own record's answer, data_source and extra_info (the training file's columns, read
    through the ArrayRecord cache), and a benchmark's rows with theirs."""
    import json

    from delta_jax.train import loop
    from tests.rl_fixtures import single_device_mesh

    (tmp_path / "verl_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': extra_info['bonus'] + (100.0 if data_source == 'zoo' else 0.0)\n"
        "                     + float(ground_truth), 'acc': extra_info.get('right', True)}\n")
    rows = [{"id": f"r{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1),
             "data_source": "zoo" if i % 2 else "farm", "extra_info": {"bonus": i / 8}}
            for i in range(8)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"id": f"b{i}", "problem": "What is 1 + 1?", "answer": "2",
                                         "extra_info": {"bonus": 0, "right": i < 3}}) + "\n"
                             for i in range(4)))
    cfg = tiny_rl_config(
        "dapo", rewards=dict(name="python", python_fn=f"{tmp_path}/verl_reward.py:compute_score",
                             num_workers=1, overlong_buffer=0),
        data=dict(train=str(train), eval=str(bench)),
        eval=dict(k=2, pass_k="1,2", max_new_tokens=8),
        train=dict(steps=1, eval_before=False, eval_after=True, export_final=False,
                   rollouts_every=1))
    run = run_lib.build_run(cfg, str(tmp_path / "w"), mesh=single_device_mesh())
    try:
        loop.train(cfg, str(tmp_path / "w"), run=run)
    finally:
        run.close()
    with open(tmp_path / "w" / "rollouts" / "step_1.jsonl") as f:
        got = [json.loads(line) for line in f]
    by_id = {r["id"]: r for r in rows}
    assert len(got) == cfg.rollout.batch_prompts * cfg.rollout.group_size
    assert len({r["id"] for r in got}) == cfg.rollout.batch_prompts
    for r in got:
        row = by_id[r["id"]]
        want = (row["extra_info"]["bonus"] + 100.0 * (row["data_source"] == "zoo")
                + int(row["answer"]))
        assert r["reward"] == pytest.approx(want), (r, row)
    metrics = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
    evals = [m for m in metrics if "eval/benchmarks/bench/avg@2" in m]
    assert evals and evals[-1]["eval/benchmarks/bench/avg@2"] == pytest.approx(0.75)


def test_long_eval_prompts_are_reported_at_start_up(tmp_path, caplog):
    """Prompts of data.eval benchmarks over data.max_prompt_len (they would be evaluated from
    their last tokens) are counted per benchmark in a warning at start-up; a math run's code
    benchmark is measured with the code instruction it is asked with."""
    import json
    import logging

    from delta_jax.data import templates
    from tests.rl_fixtures import single_device_mesh

    spec = json.dumps({"tests": ["assert f(1) == 2"]})
    math_rows = [{"problem": "1 + 1?", "answer": "2"},
                 {"problem": "What is " + " plus ".join(["1"] * 40) + "?", "answer": "40"}]
    code_rows = [{"problem": "Write f(x) = x + 1.", "answer": spec}]
    for name, rows in (("m", math_rows), ("c", code_rows)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_rl_config("grpo", data=dict(eval=f"{tmp_path}/m.jsonl,{tmp_path}/c.jsonl"))
    with caplog.at_level(logging.WARNING, logger="delta_jax.train"):
        run = run_lib.build_run(cfg, str(tmp_path / "w"), need_data=False, need_scorer=False,
                                mesh=single_device_mesh())
    try:
        limit = cfg.data.max_prompt_len
        for name, rows, template in (("m", math_rows, run.template),
                                     ("c", code_rows, templates.for_task(run.template, "code"))):
            lengths = [len(run.tokenizer.encode(template(r["problem"]))) for r in rows]
            over = [n for n in lengths if n > limit]
            assert over, (name, lengths)  # the test's rows are long enough to be reported
            assert (f"data.eval: {name}: {len(over)} of {len(rows)} prompts are over "
                    f"data.max_prompt_len={limit} tokens (the longest: {max(lengths)})"
                    ) in caplog.text
        assert caplog.text.count("data.eval: m:") == 1  # one warning per benchmark
    finally:
        run.close()


@pytest.mark.devices(4)
def test_build_model_adds_lora_to_a_loaded_checkpoint_on_its_mesh(tmp_path):
    """model.path + model.lora_rank on a (1, 2, 2) mesh: the checkpoint's weights, plus fresh
    adapters on the targets asked for, every variable placed by the sharding rules (the
    adapters' rank axis replicated); the outputs are the checkpoint's (B = 0)."""
    import numpy as np
    from flax import nnx

    from delta_jax import models, sharding

    base = models.Transformer(models.get_preset("tiny"), rngs=nnx.Rngs(4))
    models.save_pretrained(base, tmp_path / "ckpt")
    cfg = tiny_rl_config("dapo", model=dict(random_init=False, path=str(tmp_path / "ckpt"),
                                            lora_rank=2, lora_targets="q_proj,up_proj"),
                         mesh=dict(data=1, fsdp=2, tensor=2))
    mesh = sharding.make_mesh(1, 2, 2, devices=jax.devices()[:4])
    model = run_lib.build_model(cfg, 256, mesh=mesh)
    assert model.layers.lora_names() == ("q_proj_lora_a", "q_proj_lora_b", "up_proj_lora_a",
                                         "up_proj_lora_b")
    state = nnx.state(model)
    want = sharding.tree_shardings(state, mesh)
    for got_var, want_var in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        assert got_var.sharding == want_var, (got_var.shape, got_var.sharding, want_var)
    up_b = model.layers.up_proj_lora_b[...]
    assert up_b.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")  # [L, r, mlp]
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 256, (2, 7)), jnp.int32)
    np.testing.assert_allclose(model(ids).logits, base(ids).logits, atol=1e-5)


def test_build_run_gives_the_sampler_the_rollout_settings(tmp_path):
    """rollout.page_size, decode_steps_per_call, max_batch_size, shrink_batch,
    batch_invariant and decode_splits reach the Sampler that the trainer and the evaluator
    share."""
    from tests.rl_fixtures import single_device_mesh

    for shrink in (True, False):
        cfg = tiny_rl_config("dapo", rollout=dict(page_size=16, decode_steps_per_call=8,
                                                  max_batch_size=32, shrink_batch=shrink,
                                                  batch_invariant=shrink,
                                                  decode_splits=2 if shrink else 0))
        run = run_lib.build_run(cfg, str(tmp_path / str(shrink)), need_data=False,
                                need_scorer=False, mesh=single_device_mesh())
        try:
            s = run.sampler
            assert (s.page_size, s.decode_steps_per_call, s.num_slots) == (16, 8, 32)
            assert s.shrink_batch is shrink and s.batch_invariant is shrink
            assert s.decode_splits == (2 if shrink else 0)
        finally:
            run.close()


def test_a_code_benchmark_in_a_run_with_eval_maj_k_stops_it_at_start_up(tmp_path):
    """eval.maj_k votes on final answers: a code benchmark of data.eval / data.val (MBPP's layout
    here) is an InputError naming the field, the benchmark and its file when the benchmarks are
    read, before anything trains; a math one, or the code one without voting, loads."""
    import json

    from delta_jax.errors import InputError
    code, math = tmp_path / "mbpp.jsonl", tmp_path / "toy.jsonl"
    code.write_text(json.dumps({"task_id": 3, "text": "Write f.",
                                "test_list": ["assert f(1) == 2"]}) + "\n")
    math.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    assert set(run_lib.load_benchmarks({"toy": str(math), "mbpp": str(code)})) == {"toy", "mbpp"}
    assert set(run_lib.load_benchmarks({"toy": str(math)}, majority=True)) == {"toy"}
    with pytest.raises(InputError, match=r"^eval\.maj_k: data\.val benchmark 'mbpp' \(.*mbpp"
                                         r"\.jsonl\) is a code benchmark"):
        run_lib.load_benchmarks({"toy": str(math), "mbpp": str(code)}, "data.val",
                                majority=True)
    cfg = tiny_rl_config("grpo", data=dict(eval=f"{math},{code}"), eval=dict(k=2, maj_k="2"))
    with pytest.raises(InputError, match=r"^eval\.maj_k: data\.eval benchmark 'mbpp'"):
        run_lib.build_run(cfg, str(tmp_path / "run"))
