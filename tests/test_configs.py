"""Experiment configs: every file loads and validates; bad fields and overrides name the field."""
import importlib.util
import pathlib

import pytest
from absl import flags
from ml_collections import config_dict, config_flags

from delta_jax import models
from delta_jax.train.config import (ConfigError, default_config, lora_targets, method_settings,
                                    unused_delta_fields, validate_config)

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
CONFIG_FILES = sorted(EXPERIMENTS.glob("*.py"))
REAL_MODEL_CONFIGS = ("qwen3_8b.py", "qwen3_14b.py", "qwen3_0_6b.py", "qwen3_1_7b.py",
                      "qwen3_8b_code.py")


def load(path):
    spec = importlib.util.spec_from_file_location(f"exp_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def parse(argv):
    """The same flag definitions as delta_jax.main, on a private FlagValues."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                    sys_argv=["prog"] + argv)
    fv(["prog"] + argv)
    return fv.config


def test_expected_files_present():
    names = {p.name for p in CONFIG_FILES}
    assert {"tiny.py", *REAL_MODEL_CONFIGS} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_every_config_loads_and_validates(path):
    cfg = load(path)
    if path.name in REAL_MODEL_CONFIGS:
        with pytest.raises(ConfigError, match=r"^model\.path"):
            validate_config(cfg)
        cfg.model.path = "/models/qwen3"
        with pytest.raises(ConfigError, match=r"^data\.train"):
            validate_config(cfg)
        cfg.data.train = "/data/train.jsonl"
    out = validate_config(cfg)
    assert out.rollout.batch_prompts % out.rl.mini_batch_prompts == 0


def test_paper_settings():
    for name, steps in (("qwen3_8b.py", 220), ("qwen3_14b.py", 300)):
        cfg = load(EXPERIMENTS / name)
        cfg.model.path, cfg.data.train = "/m", "/d.jsonl"
        c = validate_config(cfg)
        assert c.method == "delta" and c.train.steps == steps
        assert (c.rollout.batch_prompts, c.rollout.group_size, c.rl.mini_batch_prompts) == (
            128, 16, 32)
        assert (c.rl.eps_low, c.rl.eps_high, c.rl.dual_clip, c.rl.agg) == (
            0.2, 0.28, 10.0, "token-mean")
        assert (c.optim.lr, c.optim.weight_decay, c.optim.max_grad_norm) == (1e-6, 0.1, 1.0)
        assert c.optim.schedule == "constant" and c.optim.warmup_steps == 0
        assert (c.rollout.max_new_tokens, c.data.max_prompt_len) == (20480, 2048)
        assert (c.rewards.overlong, c.rewards.overlong_buffer, c.rewards.overlong_factor) == (
            True, 4096, 1.0)
        assert (c.delta.num_refine, c.delta.lam_min, c.delta.lam_max) == (1, 0.8, 1.2)
        assert c.rl.dynamic_sampling is False and c.rollout.temperature == 1.0
        assert (c.eval.k, c.eval.top_p, c.eval.max_new_tokens) == (16, 0.7, 30000)
        # sized for 8 x 80 GB with the parameters and optimizer state sharded over every device
        assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (1, -1, 1)
    for name in ("qwen3_0_6b.py", "qwen3_1_7b.py"):  # a replica per device fits these
        c = load(EXPERIMENTS / name)
        assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (-1, 1, 1)


# README's method table, written out here (independent of config.METHOD_DEFAULTS): advantage,
# clip low / high, dual clip (0 = off), aggregation, overlong penalty, DelTA weights.
README_METHODS = {
    "grpo": ("grpo", 0.2, 0.2, 0.0, "token-mean", False, False),
    "dapo": ("grpo", 0.2, 0.28, 10.0, "token-mean", True, False),
    "delta": ("grpo", 0.2, 0.28, 10.0, "token-mean", True, True),
}


@pytest.mark.parametrize("method", ["grpo", "dapo", "delta"])
def test_method_switch_is_one_flag(method):
    cfg = parse([f"--config={EXPERIMENTS / 'tiny.py'}", f"--config.method={method}"])
    c = validate_config(cfg)
    settings = method_settings(c)
    assert (c.rl.advantage, c.rl.eps_low, c.rl.eps_high, c.rl.dual_clip, c.rl.agg,
            c.rewards.overlong, settings.use_delta) == README_METHODS[method]
    assert c.rl.dynamic_sampling is True  # tiny.py sets it: an explicit value beats the method's
    base = default_config()
    base.method, base.model.random_init, base.model.preset = method, True, "tiny"
    base.data.train = base.tokenizer.path = "synthetic"
    assert validate_config(base).rl.dynamic_sampling is False  # the methods' default (paper)


def test_explicit_override_beats_method_default():
    cfg = parse([f"--config={EXPERIMENTS / 'tiny.py'}", "--config.method=grpo",
                 "--config.rl.eps_high=0.3"])
    assert validate_config(cfg).rl.eps_high == 0.3


def test_bad_overrides_name_the_field():
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    with pytest.raises(Exception, match="eps_hihg"):
        parse([base, "--config.rl.eps_hihg=0.3"])
    with pytest.raises(Exception, match="group_size"):
        parse([base, "--config.rollout.group_size=many"])
    cfg = parse([base, "--config.rl.mini_batch_prompts=3"])
    with pytest.raises(ConfigError, match=r"^rl\.mini_batch_prompts"):
        validate_config(cfg)
    cfg = parse([base, "--config.method=ppo"])
    with pytest.raises(ConfigError, match=r"^method"):
        validate_config(cfg)
    cfg = parse([base, "--config.delta.feature_cache=disk"])
    with pytest.raises(ConfigError, match=r"^delta\.feature_cache"):
        validate_config(cfg)
    cfg = parse([base, "--config.rl.micro_batch_size=5"])
    with pytest.raises(ConfigError, match=r"^rl\.micro_batch_size"):
        validate_config(cfg)
    cfg = parse([base, "--config.sft.batch_size=32", "--config.sft.micro_batch_size=5"])
    with pytest.raises(ConfigError, match=r"^sft\.micro_batch_size: 5 does not divide "
                                          r"sft\.batch_size=32"):
        validate_config(cfg)
    micro = validate_config(parse([base, "--config.sft.micro_batch_size=8"]))
    assert micro.sft.micro_batch_size == 8
    cfg = parse([base, "--config.rl.ratio_level=group"])
    with pytest.raises(ConfigError, match=r"^rl\.ratio_level"):
        validate_config(cfg)
    cfg = validate_config(parse([base, "--config.rl.ratio_level=sequence"]))
    assert cfg.rl.ratio_level == "sequence"
    cfg = validate_config(parse([base, "--config.rl.surrogate=sapo",
                                 "--config.rl.sapo_tau_neg=2.0"]))
    assert (cfg.rl.surrogate, cfg.rl.sapo_tau_pos, cfg.rl.sapo_tau_neg) == ("sapo", 1.0, 2.0)
    assert validate_config(cfg).rl.surrogate == "sapo"  # a saved (resolved) config, validated again
    cfg = validate_config(parse([base, "--config.rl.fipo=True", "--config.rl.epochs=2",
                                 "--config.rl.fipo_safety_threshold=0.0"]))
    assert cfg.rl.fipo and cfg.rl.fipo_safety_threshold == 0.0
    for overrides, field in [(["rl.surrogate=sapo", "rl.eps_high=0.3"], "rl.eps_high"),
                             (["rl.surrogate=sapo", "rl.dual_clip=3.0"], "rl.dual_clip"),
                             (["rl.surrogate=sapo", "rl.sapo_tau_pos=0.0"], "rl.sapo_tau_pos"),
                             (["rl.sapo_tau_pos=2.0"], "rl.sapo_tau_pos"),
                             (["rl.surrogate=soft"], "rl.surrogate"),
                             (["rl.fipo_clip=0.3"], "rl.fipo_clip"),
                             (["rl.fipo=True", "rl.mini_batch_prompts=16"], "rl.fipo"),
                             (["rl.fipo=True", "rl.epochs=2", "rl.surrogate=sapo"], "rl.fipo"),
                             (["rl.fipo=True", "rl.epochs=2", "rl.fipo_decay_rate=0.0"],
                              "rl.fipo_decay_rate"),
                             (["rl.fipo=True", "rl.epochs=2", "rl.fipo_safety_threshold=-1.0"],
                              "rl.fipo_safety_threshold")]:
        cfg = parse([base, *(f"--config.{o}" for o in overrides)])
        with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.")):
            validate_config(cfg)
    cfg = validate_config(parse([base, "--config.rl.dynamic_sampling_prompts_per_round=32",
                                 "--config.rl.dynamic_sampling_on_max_rounds=pad"]))
    assert (cfg.rl.dynamic_sampling_prompts_per_round, cfg.rl.dynamic_sampling_on_max_rounds) == (
        32, "pad")
    for override, field in [("rl.dynamic_sampling_prompts_per_round=24",  # tiny: 16 a batch
                             "rl.dynamic_sampling_prompts_per_round"),
                            ("rl.dynamic_sampling_prompts_per_round=-16",
                             "rl.dynamic_sampling_prompts_per_round"),
                            ("rl.dynamic_sampling_on_max_rounds=warn",
                             "rl.dynamic_sampling_on_max_rounds"),
                            ("model.lora_rank=-1", "model.lora_rank"),
                            ("model.lora_alpha=0", "model.lora_alpha"),
                            ("model.lora_targets=q_proj,qkv", "model.lora_targets"),
                            ("model.lora_targets=q_proj,q_proj", "model.lora_targets")]:
        with pytest.raises(ConfigError, match=rf"^{field}"):
            validate_config(parse([base, f"--config.{override}"]))
    cfg = validate_config(parse([base, "--config.model.lora_rank=8",
                                 "--config.model.lora_targets=q_proj, v_proj"]))
    assert lora_targets(cfg) == ("q_proj", "v_proj")
    assert lora_targets(default_config()) == models.LORA_TARGETS  # "all": the model's list


def test_unknown_and_mistyped_fields_in_a_config_file():
    d = default_config().to_dict()
    d["model"]["path"] = "/m"
    d["data"]["train"] = "/d.jsonl"
    d["rl"]["epsilon"] = 0.2
    with pytest.raises(ConfigError, match=r"^rl\.epsilon: unknown"):
        validate_config(config_dict.ConfigDict(d))
    del d["rl"]["epsilon"]
    d["rollout"]["group_size"] = "16"
    with pytest.raises(ConfigError, match=r"^rollout\.group_size: expected int"):
        validate_config(config_dict.ConfigDict(d))
    d["rollout"]["group_size"] = 16
    d["optim"]["lr"] = 1  # an int where a float is expected is fine
    assert validate_config(config_dict.ConfigDict(d)).optim.lr == 1.0
    d["model"]["random_init"] = True
    with pytest.raises(ConfigError, match=r"^model\.preset"):
        validate_config(config_dict.ConfigDict(d))


@pytest.mark.parametrize("override,field", [
    ("--config.train.log_every=0", "train.log_every"),
    ("--config.eval.temperature=-1.0", "eval.temperature"),
    ("--config.eval.top_p=0.0", "eval.top_p"),
    ("--config.rewards.name=math_typo", "rewards.name"),
    ("--config.rewards.num_workers=0", "rewards.num_workers"),
    ("--config.rewards.timeout_s=0.0", "rewards.timeout_s"),
    ("--config.rewards.python_batch_size=0", "rewards.python_batch_size"),
    ("--config.rewards.completion_format=chat", "rewards.completion_format"),
])
def test_fields_that_used_to_fail_late_fail_at_validation(override, field):
    """Each of these used to pass validation and fail only later (a ZeroDivisionError after SFT
    and step 1, the sampler, the reward pool): now validate_config names the field."""
    cfg = parse([f"--config={EXPERIMENTS / 'tiny.py'}", override])
    with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.")):
        validate_config(cfg)


def test_a_reward_of_your_own_is_named_with_its_field():
    """rewards.name=python needs rewards.python_fn, which no other reward takes (nor
    rewards.python_weights); several functions take one number each in python_weights; with it
    the code template is allowed (the user's reward reads what it asks for), and the run's task
    follows the template. (tiny.py's eval.maj_k votes on boxed answers, which a function of
    one's own need not read: it is turned off here, and refused with one in
    test_eval_maj_k_is_votes_over_at_most_eval_k_samples_with_a_math_reward.)"""
    from delta_jax.rl.rewards import user_reward_weights
    from delta_jax.train.run import reward_task
    base = f"--config={EXPERIMENTS / 'tiny.py'}", "--config.eval.maj_k="
    for overrides, message in [
            (["rewards.name=python"], r"^rewards\.python_fn: rewards\.name=python grades"),
            (["rewards.python_fn=r.py:f"], r"^rewards\.python_fn: is used by rewards\.name=py"),
            (["rewards.name=math", "data.template=code"], r"^data\.template: 'code' asks"),
            (["rewards.name=python", "rewards.python_fn=r.py:f,,r.py:g"],
             r"^rewards\.python_fn: 'r.py:f,,r.py:g' names no function"),
            (["rewards.name=python", "rewards.python_fn=r.py:f,r.py:g",
              "rewards.python_weights=1"], r"^rewards\.python_weights: '1' is not 2 comma-sep"),
            (["rewards.name=python", "rewards.python_fn=r.py:f", "rewards.python_weights=x"],
             r"^rewards\.python_weights: 'x' is not 1 comma-separated number"),
            (["rewards.name=python", "rewards.python_fn=r.py:f", "rewards.python_weights=inf"],
             r"^rewards\.python_weights: 'inf' is not 1"),
            (["rewards.python_weights=1"], r"^rewards\.python_weights: is used by rewards\.name="
             "python only")]:
        with pytest.raises(ConfigError, match=message):
            validate_config(parse([*base, *(f"--config.{o}" for o in overrides)]))
    cfg = validate_config(parse([*base, "--config.rewards.name=python",
                                 "--config.rewards.python_fn=r.py:f"]))
    assert reward_task(cfg) == "math"
    cfg = validate_config(parse([*base, "--config.rewards.name=python",
                                 "--config.rewards.python_fn=r.py:f, r.py:g",
                                 "--config.rewards.python_weights=1, -0.5"]))
    assert user_reward_weights(cfg.rewards.python_weights) == (1.0, -0.5)
    cfg = validate_config(parse([*base, "--config.rewards.name=python",
                                 "--config.rewards.python_fn=r.py:f", "--config.data.template=code"]))
    assert reward_task(cfg) == "code"


def test_validations_need_benchmarks_and_a_period():
    """data.val / eval.val_k: the validations run every train.eval_every steps (tiny.py's is 0)
    on data.val's benchmarks or data.eval's; train.best_metric may name their metrics, at
    their own k."""
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    for overrides, message in [
            (["data.val=v.jsonl"], r"^data\.val: validations run every train\.eval_every"),
            (["eval.val_k=-1"], r"^eval\.val_k: must be >= 0"),
            (["data.val=x/v.jsonl", "train.eval_every=4", "train.best_metric=val/average/avg@4"],
             r"^train\.best_metric: 'val/average/avg@4' is not a metric")]:
        with pytest.raises(ConfigError, match=message):
            validate_config(parse([base, *(f"--config.{o}" for o in overrides)]))
    cfg = validate_config(parse([base, "--config.data.val=x/v.jsonl", "--config.eval.val_k=8",
                                 "--config.train.eval_every=4",
                                 "--config.train.best_metric=val/benchmarks/v/avg@8"]))
    assert cfg.train.best_metric == "val/benchmarks/v/avg@8"


def test_eval_checkpoint_is_latest_none_or_a_step():
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    for value in ("latest", "none", "120"):
        assert validate_config(parse([base, f"--config.eval.checkpoint={value}"]))
    for value in ("best", "-1", "step_4"):
        with pytest.raises(ConfigError, match=r"^eval\.checkpoint: 'latest', 'none' or a step"):
            validate_config(parse([base, f"--config.eval.checkpoint={value}"]))


def test_entropy_top_frac_is_a_fraction():
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    assert validate_config(parse([base, "--config.rl.entropy_top_frac=0.2"])).rl.entropy_top_frac
    for value in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match=r"^rl\.entropy_top_frac: must be in \[0, 1\]"):
            validate_config(parse([base, f"--config.rl.entropy_top_frac={value}"]))


def test_random_init_takes_no_checkpoint_and_needs_a_tokenizer():
    """A checkpoint path given to a random-init config (tiny.py with --config.model.path=...) was
    dropped without a word: the run trained, and mode=eval evaluated, random weights (eval even
    printed "eval of <path>"). It is refused naming model.random_init and the path, in every mode;
    with random_init=False the same path validates. A random-init run with no tokenizer at all
    (tokenizer.path and model.path empty) passed validation and failed at load time naming
    model.path ('.: no tokenizer.json'); it is refused naming tokenizer.path."""
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    for mode in ("train", "eval", "sft", "plan"):
        with pytest.raises(ConfigError, match=r"^model\.random_init: True builds "
                           r"model\.preset='tiny' .*ignores model\.path='/ckpt/qwen3'"):
            validate_config(parse([base, "--config.model.path=/ckpt/qwen3",
                                   f"--config.mode={mode}"]))
    out = validate_config(parse([base, "--config.model.path=/ckpt/qwen3",
                                 "--config.model.random_init=False"]))
    assert out.model.path == "/ckpt/qwen3" and not out.model.random_init
    with pytest.raises(ConfigError, match=r"^tokenizer\.path: no tokenizer"):
        validate_config(parse([base, "--config.tokenizer.path="]))
    # plan mode reads shapes only: no tokenizer needed there
    assert validate_config(parse([base, "--config.tokenizer.path=", "--config.mode=plan"]))


def test_eval_maj_k_is_votes_over_at_most_eval_k_samples_with_a_math_reward():
    """eval.maj_k: "" (none) or comma separated k' in [1, eval.k]; the validations keep those
    <= eval.val_k; train.best_metric may name a maj@k'; a rewards.name=python run is refused (its
    function reads its own answers, not the boxed ones the votes are)."""
    from delta_jax.train.config import EVAL, VAL, eval_metric_names, eval_settings
    base = f"--config={EXPERIMENTS / 'qwen3_8b.py'}"
    paper = ["--config.model.path=/m", "--config.data.train=/d.jsonl",
             "--config.data.eval=/b/aime25.jsonl", "--config.eval.k=16"]
    cfg = validate_config(parse([base, *paper, "--config.eval.maj_k=4, 16",
                                 "--config.train.best_metric=val/benchmarks/aime25/maj@4"]))
    assert eval_settings(cfg, EVAL).maj_ks == (4, 16)
    assert eval_settings(cfg, VAL).maj_ks == (4,)  # the recipe's eval.val_k is 8
    assert "eval/average/maj@16" in eval_metric_names(cfg)
    assert "val/average/maj@16" not in eval_metric_names(cfg)
    assert eval_settings(validate_config(parse([base, *paper])), EVAL).maj_ks == ()
    for value in ("0", "17", "4,x", "-1"):
        with pytest.raises(ConfigError, match=r"^eval\.maj_k: comma separated ints in "
                                              r"\[1, eval\.k\]"):
            validate_config(parse([base, *paper, f"--config.eval.maj_k={value}"]))
    with pytest.raises(ConfigError, match=r"^eval\.maj_k: votes on each response's last "):
        validate_config(parse([base, *paper, "--config.eval.maj_k=4",
                               "--config.rewards.name=python",
                               "--config.rewards.python_fn=my_rewards.py:score"]))


def test_best_metric_names_a_metric_the_evaluations_log():
    """train.best_metric must be one of the accuracy metrics the training evals log (avg@eval.k
    and pass@p of each data.eval benchmark, by file stem, and of their average); it needs
    data.eval and an evaluation during training. The paper's choice validates."""
    base = f"--config={EXPERIMENTS / 'qwen3_8b.py'}"
    paper = ["--config.model.path=/m", "--config.data.train=/d.jsonl",
             "--config.data.eval=/b/aime25.jsonl,/b/hmmt_feb25.jsonl", "--config.eval.k=8",
             "--config.eval.pass_k=1,8"]
    cfg = validate_config(parse([base, *paper,
                                 "--config.train.best_metric=eval/benchmarks/aime25/avg@8"]))
    assert cfg.train.best_mode == "max"
    validate_config(parse([base, *paper, "--config.train.best_metric=eval/average/pass@8",
                           "--config.train.best_mode=min"]))
    with pytest.raises(ConfigError, match=r"^train\.best_metric: 'eval/benchmarks/aime24/avg@8' "
                                          r"is not a metric .* eval/benchmarks/aime25/avg@8, "
                                          r"eval/benchmarks/aime25/pass@1, "):
        validate_config(parse([base, *paper,
                               "--config.train.best_metric=eval/benchmarks/aime24/avg@8"]))
    with pytest.raises(ConfigError, match=r"^train\.best_metric: .*avg@16"):  # eval.k is 8
        validate_config(parse([base, *paper, "--config.train.best_metric=eval/average/avg@16"]))
    validate_config(parse([base, *paper, "--config.train.best_metric=eval/average/pass@8",
                           "--config.train.eval_best=True"]))
    with pytest.raises(ConfigError, match=r"^train\.eval_best: evaluates the policy train\."
                                          r"best_metric picks: set train\.best_metric"):
        validate_config(parse([base, *paper, "--config.train.eval_best=True"]))
    with pytest.raises(ConfigError, match=r"^train\.best_metric: needs evaluations: set data"):
        validate_config(parse([base, *paper[:2],
                               "--config.train.best_metric=eval/average/avg@16"]))
    with pytest.raises(ConfigError, match=r"^train\.best_metric: needs evaluations during"):
        validate_config(parse([base, *paper, "--config.train.best_metric=eval/average/avg@8",
                               "--config.train.eval_every=0", "--config.train.eval_before=False",
                               "--config.train.eval_after=False"]))
    with pytest.raises(ConfigError, match=r"^train\.best_mode"):
        validate_config(parse([base, *paper, "--config.train.best_mode=largest"]))
    tiny = validate_config(parse([f"--config={EXPERIMENTS / 'tiny.py'}",
                                  "--config.train.best_metric=eval/benchmarks/synthetic_test/avg@16"]))
    assert tiny.train.best_metric.endswith("synthetic_test/avg@16")


def test_delta_fields_of_another_method_are_named():
    """unused_delta_fields: a train run of grpo / dapo with DelTA's hyperparameters changed
    (a lam_max sweep of the baseline by mistake) names each one and its value; the memory
    settings the recipes set for every method, the defaults, method=delta and the other modes
    name none."""
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    swept = ["--config.delta.lam_max=1.5", "--config.delta.assignment=hard"]
    for method in ("grpo", "dapo"):
        cfg = validate_config(parse([base, f"--config.method={method}", *swept,
                                     "--config.delta.feature_cache=host"]))
        assert unused_delta_fields(cfg) == ["delta.lam_max=1.5", "delta.assignment='hard'"]
        assert unused_delta_fields(validate_config(parse([base, f"--config.method={method}"]))
                                   ) == []
    assert unused_delta_fields(validate_config(parse([base, *swept]))) == []  # tiny.py: delta
    assert unused_delta_fields(validate_config(parse(
        [base, "--config.method=dapo", "--config.mode=eval", *swept]))) == []


def test_decode_splits_field():
    """rollout.decode_splits: >= 0 (0 = auto), and auto refused beside rollout.batch_invariant
    (whose fixed summation order auto's per-call splits would break), each naming the field;
    a fixed count with it, and auto alone, validate."""
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    for bad in (["--config.rollout.decode_splits=-1"],
                ["--config.rollout.decode_splits=0", "--config.rollout.batch_invariant=True"]):
        with pytest.raises(ConfigError, match=r"^rollout\.decode_splits"):
            validate_config(parse([base, *bad]))
    assert validate_config(parse([base, "--config.rollout.decode_splits=0"])).rollout \
        .decode_splits == 0
    assert validate_config(parse([base, "--config.rollout.decode_splits=2",
                                  "--config.rollout.batch_invariant=True"])).rollout \
        .decode_splits == 2


def test_the_prompt_asks_for_what_the_reward_reads():
    """A task-specific template (code, qwen_math) with the other task's reward is refused; the
    task-neutral layouts (base, chat, plain) take the reward's instruction in the run."""
    tiny = f"--config={EXPERIMENTS / 'tiny.py'}"
    with pytest.raises(ConfigError, match=r"^data\.template: 'code' asks for a ```python"):
        validate_config(parse([tiny, "--config.data.template=code"]))
    with pytest.raises(ConfigError, match=r"^data\.template: 'qwen_math' .* set data\.template="):
        validate_config(parse([tiny, "--config.rewards.name=code"]))
    for template in ("code", "base", "plain"):
        validate_config(parse([tiny, "--config.rewards.name=code",
                               f"--config.data.template={template}"]))


@pytest.mark.parametrize("override,field", [
    ("--config.data.system_prompt=Be brief.", "data.system_prompt"),
    ("--config.data.enable_thinking=False", "data.enable_thinking"),
    ("--config.rewards.one_box_bonus=0.1", "rewards.one_box_bonus"),
    ("--config.rewards.no_box_penalty=0.5", "rewards.no_box_penalty"),
])
def test_options_of_one_template_or_reward_are_refused_elsewhere(override, field):
    """The chat template's system turn and thinking switch under another template, and
    math_format's shaping under another reward, would change nothing: refused, naming the
    field; accepted with the template or reward they belong to."""
    tiny = f"--config={EXPERIMENTS / 'tiny.py'}"
    with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.") + ": .* leave"):
        validate_config(parse([tiny, override]))
    owner = ("--config.data.template=chat" if field.startswith("data.")
             else "--config.rewards.name=math_format")
    validate_config(parse([tiny, override, owner]))


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo"])
def test_one_response_per_prompt_is_refused_for_every_advantage(advantage):
    """Group-relative advantages are all 0 with one response per prompt (RLOO has no
    leave-one-out baseline, Dr.GRPO subtracts the response's own reward): nothing would train."""
    cfg = parse([f"--config={EXPERIMENTS / 'tiny.py'}", f"--config.rl.advantage={advantage}",
                 "--config.rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"^rollout\.group_size: .*nothing is trained"):
        validate_config(cfg)


def test_resume_changes_lists_fields_that_change_results():
    from delta_jax.train.config import resume_changes

    old = validate_config(load(EXPERIMENTS / "tiny.py")).to_dict()
    new = validate_config(load(EXPERIMENTS / "tiny.py"))
    with new.unlocked():
        new.optim.lr = 0.5
        new.method = "grpo"
        new.train.steps = 999          # running longer is a resume, not a change
        new.eval.max_new_tokens = 7    # so is evaluating differently
        new.rollout.max_batch_size = 8  # and scheduling (results do not depend on it)
    new = validate_config(new)
    changes = resume_changes(old, new.to_dict())
    assert any(c.startswith("optim.lr: ") and c.endswith("-> 0.5") for c in changes)
    assert any(c.startswith("method: 'delta' -> 'grpo'") for c in changes)
    assert not any(c.startswith(("train.steps", "eval.", "rollout.max_batch_size"))
                   for c in changes)
    assert resume_changes(old, old) == []
    # A field a run's config.json predates: fine at its default, listed otherwise.
    del old["rl"]["epochs"], old["optim"]["lr"]
    listed = resume_changes(old, new.to_dict())
    assert "optim.lr: '<absent>' -> 0.5" in listed and not any("rl.epochs" in c for c in listed)
    old["model"]["logprob_chunk"] = 256  # a field retired from the schema since
    assert not any("logprob_chunk" in c for c in resume_changes(old, new.to_dict()))


def test_synthetic_gpu_config_size_estimate_and_plan(capsys):
    """experiments/synthetic_gpu.py: validates, is a 50-150M-parameter model on the long
    synthetic task, its own time estimate is under 8 minutes, and plan mode runs on it on CPU
    (shapes only, no weights)."""
    from delta_jax import main as main_lib
    spec = importlib.util.spec_from_file_location("exp_synthetic_gpu",
                                                  EXPERIMENTS / "synthetic_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = validate_config(module.get_config())
    assert c.data.train == c.data.eval == "synthetic" and c.tokenizer.path == "synthetic"
    assert 24 <= c.data.synthetic_steps <= 32 and c.data.synthetic_digits == 3
    assert c.model.dtype == "bfloat16" and c.method == "delta" and c.sft.steps > 0
    assert c.eval.max_new_tokens == c.rollout.max_new_tokens >= 352
    mc = module.model_config(c)
    assert 50e6 <= mc.num_params() <= 150e6
    # the docstring's 76.3M: 12 layers x 6,293,120 + final norm 768 + 2 x 512 x 768
    assert mc.num_params() == 76_304_640
    assert module.estimate_seconds(c)["total"] <= 8 * 60
    cfg = parse([f"--config={EXPERIMENTS / 'synthetic_gpu.py'}", "--config.mode=plan"])
    result = main_lib.run(cfg, None)
    out = capsys.readouterr().out
    assert "memory plan: tiny (0.08 B params" in out
    assert result.settings["num_devices"] == 1
    assert all(v <= 80e9 for v in result.phases.values())  # every phase fits one 80 GB GPU


@pytest.mark.parametrize("overrides,field", [
    (["--config.delta.assignment=hard", "--config.delta.pass_impl=kernel"], "delta.assignment"),
    (["--config.delta.random_lambda=True", "--config.delta.weight=alpha"], "delta.random_lambda"),
    (["--config.delta.fixed_gamma=-0.5"], "delta.fixed_gamma"),
    (["--config.delta.assignment=fuzzy"], "delta.assignment"),
])
def test_impossible_delta_ablations_name_the_field(overrides, field):
    """The delta.* ablation flags (issue #19): combinations without an implementation fail at
    validation; each flag alone (and e.g. hard with the jnp passes) validates."""
    base = f"--config={EXPERIMENTS / 'tiny.py'}"
    with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.")):
        validate_config(parse([base, *overrides]))
    ok = validate_config(parse([base, "--config.delta.assignment=hard",
                                "--config.delta.normalize=False", "--config.delta.fixed_gamma=0.5",
                                "--config.delta.random_lambda=True"]))
    assert ok.delta.assignment == "hard" and ok.delta.random_lambda


def test_completion_format_choices_are_the_scorers_and_auto():
    """rewards.completion_format's choices are RewardScorer's formats and "auto" (kept as
    literals so the config module imports no reward code)."""
    from delta_jax.rl.rewards import COMPLETION_FORMATS
    from delta_jax.train.config import CHOICES
    assert CHOICES["rewards.completion_format"] == ("auto", *COMPLETION_FORMATS)


def test_attention_choices_are_the_models_names():
    """The config's choices for model.attention and rollout.decode_attention are the attention
    module's own names (kept as literals so the config module needs no JAX): a name added on one
    side only, e.g. "mosaic_fused", would be refused at validation or reach the model unknown."""
    from delta_jax.models import attention
    from delta_jax.train.config import CHOICES
    assert CHOICES["model.attention"] == attention.IMPLS
    assert CHOICES["rollout.decode_attention"] == attention.DECODE_IMPLS
    cfg = parse([f"--config={EXPERIMENTS / 'tiny.py'}",
                 "--config.rollout.decode_attention=mosaic_fused"])
    assert validate_config(cfg).rollout.decode_attention == "mosaic_fused"
    cfg = parse([f"--config={EXPERIMENTS / 'tiny.py'}", "--config.rollout.decode_attention=fused"])
    with pytest.raises(ConfigError, match="rollout.decode_attention"):
        validate_config(cfg)
