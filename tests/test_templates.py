"""Prompt templates: the literal Qwen-math prompt, plain-text base prompt, tokenizer chat templates."""
import pytest

from delta_jax.data import templates, tiny_tokenizer

PROBLEM = "What is $1 + \\frac{1}{2}$?"


def test_qwen_math_template_exact_text():
    prompt = templates.PromptTemplate("qwen_math")(PROBLEM)
    assert prompt == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>user\n" + PROBLEM + "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_base_and_plain_templates():
    base = templates.PromptTemplate("base")(PROBLEM)
    assert base.startswith("Question: " + PROBLEM + "\n")
    assert "\\boxed{}" in base and base.endswith("Let's think step by step.")
    assert templates.PromptTemplate("plain", instruction=None)(PROBLEM) == PROBLEM
    assert templates.make_template(None)(PROBLEM) == PROBLEM
    assert templates.PromptTemplate("plain")(PROBLEM) == PROBLEM + "\n" + templates.BOXED_INSTRUCTION


def test_bad_template_arguments():
    with pytest.raises(ValueError, match="unknown prompt template kind"):
        templates.PromptTemplate("nope")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        templates.PromptTemplate("chat")
    with pytest.raises(TypeError, match="problem must be a str"):
        templates.PromptTemplate("base")(None)


def test_chat_template_with_qwen3_tokenizer_matches_qwen_math_layout(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    chat = templates.PromptTemplate(
        "chat", tokenizer=tok, system=templates.BOXED_INSTRUCTION, instruction=None,
        chat_template_kwargs={"enable_thinking": False},
    )
    prompt = chat(PROBLEM)
    # Qwen3's template with a system turn and thinking off: the Qwen-math layout plus an empty
    # think block opening the assistant turn.
    expected_head = templates.PromptTemplate("qwen_math")(PROBLEM)
    assert prompt.startswith(expected_head)
    assert prompt[len(expected_head):].strip() == "<think>\n\n</think>"
    ids = tok.encode(expected_head, add_special_tokens=False)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # the literal template's special tokens are real specials


def test_chat_template_with_tiny_tokenizer(tmp_path):
    from delta_jax import models

    tok = models.load_tokenizer(tiny_tokenizer.build_tiny_tokenizer(str(tmp_path / "tok")))
    chat = templates.make_template("chat", tokenizer=tok, instruction=None)
    prompt = chat("What is 2 + 3?")
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids[0] == tok.token_to_id("<|im_start|>") == 2
    assert tok.decode(ids) == prompt


def test_code_template():
    prompt = templates.make_template("code")("Add two numbers.")
    assert prompt == (
        "<|im_start|>system\n" + templates.CODE_INSTRUCTION + "<|im_end|>\n<|im_start|>user\n"
        "Add two numbers.<|im_end|>\n<|im_start|>assistant\n")
    assert "```python" in templates.CODE_INSTRUCTION
    assert templates.PromptTemplate("code", instruction="Custom.")("x").count("Custom.") == 1


def test_for_task_asks_for_the_other_tasks_answer_in_the_same_layout():
    math, code = templates.make_template("qwen_math"), templates.make_template("code")
    assert templates.for_task(math, "code")("x") == code("x")
    assert templates.for_task(code, "math")("x") == math("x")
    assert templates.for_task(math, "math")("x") == math("x")
    base = templates.for_task(templates.make_template("base"), "code")("Add two numbers.")
    assert base == ("Question: Add two numbers.\n" + templates.CODE_INSTRUCTION +
                    "\nAnswer: Let's think step by step.")
    plain = templates.make_template(None)  # no instruction: the task's is added
    assert templates.for_task(plain, "math")("x") == "x\n" + templates.BOXED_INSTRUCTION
    custom = lambda problem: f"<{problem}>"  # noqa: E731
    assert templates.for_task(custom, "code") is custom
    with pytest.raises(ValueError, match="task must be 'math' or 'code'"):
        templates.for_task(math, "proof")
