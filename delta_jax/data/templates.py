"""Prompt templates: turn a problem into the text the policy continues.

Kinds:
  "qwen_math"  The Qwen(2.5)-Math chain-of-thought chat prompt written out literally (system:
               "Please reason step by step, and put your final answer within \\boxed{}."), the
               usual RLVR prompt for Qwen3 *base* models, which know the <|im_start|> tokens.
  "base"       Plain text for any base model: "Question: ...\\n<instruction>\\nAnswer: Let's think
               step by step."
  "chat"       The tokenizer's own chat template (tokenizer.apply_chat_template); the problem and
               the instruction form the user turn. Extra keywords (e.g. enable_thinking=False for
               Qwen3) go through chat_template_kwargs.
  "plain"      The problem text alone (plus the instruction when one is given).
  "code"       The same chat layout as "qwen_math" with a code instruction (CODE_INSTRUCTION: one
               complete program in a ```python block, which the code reward runs).

Every template is a callable `str -> str`; the pipeline adds its output as record["prompt"].
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

CODE_INSTRUCTION = ("Write a correct and efficient Python 3 solution. Put the complete program "
                    "in a single ```python code block at the end of your response.")

KINDS = ("qwen_math", "base", "chat", "plain", "code")


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """A prompt format; call it with a problem string to get the prompt string."""

    kind: str = "qwen_math"
    instruction: str | None = BOXED_INSTRUCTION
    system: str | None = None  # "chat" only: an extra system turn
    tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)  # "chat" only
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown prompt template kind {self.kind!r}; known: {KINDS}")
        if self.kind == "code" and self.instruction == BOXED_INSTRUCTION:
            object.__setattr__(self, "instruction", CODE_INSTRUCTION)  # the kind's default
        if self.kind == "chat":
            if self.tokenizer is None or not hasattr(self.tokenizer, "apply_chat_template"):
                raise ValueError("template kind 'chat' needs a tokenizer with apply_chat_template")

    def __call__(self, problem: str) -> str:
        if not isinstance(problem, str):
            raise TypeError(f"problem must be a str, got {type(problem).__name__}")
        if self.kind in ("qwen_math", "code"):
            system = self.instruction or ""
            return (
                f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{problem}<|im_end|>\n"
                "<|im_start|>assistant\n"
            )
        if self.kind == "base":
            instruction = f"\n{self.instruction}" if self.instruction else ""
            return f"Question: {problem}{instruction}\nAnswer: Let's think step by step."
        if self.kind == "plain":
            return f"{problem}\n{self.instruction}" if self.instruction else problem
        # chat
        user = f"{problem}\n{self.instruction}" if self.instruction else problem
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": user}
        ]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **dict(self.chat_template_kwargs)
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text


def for_task(template: Callable[[str], str], task: str) -> Callable[[str], str]:
    """`template`'s layout asking for the answer form of `task`: "math" (the \\boxed{}
    instruction; kind "code" becomes "qwen_math") or "code" (the code instruction; "qwen_math"
    becomes "code"). A run's prompt is its template for its reward's task (base / chat / plain
    ask for a program in a code run), and a benchmark of the other task is evaluated with the
    template for that one (a code run's AIME, a math run's HumanEval). A custom callable is
    returned as it is."""
    if task not in ("math", "code"):
        raise ValueError(f"task must be 'math' or 'code', got {task!r}")
    if not isinstance(template, PromptTemplate):
        return template
    kind = template.kind
    if kind in ("qwen_math", "code"):
        kind = "code" if task == "code" else "qwen_math"
    instruction = CODE_INSTRUCTION if task == "code" else BOXED_INSTRUCTION
    return dataclasses.replace(template, kind=kind, instruction=instruction)


def make_template(
    template: str | PromptTemplate | Callable[[str], str] | None = "qwen_math",
    tokenizer: Any = None,
    **kwargs,
) -> Callable[[str], str]:
    """A template from a kind name (kwargs: instruction, system, chat_template_kwargs), an
    existing PromptTemplate / callable (returned as is), or None (= "plain" without instruction)."""
    if template is None:
        return PromptTemplate(kind="plain", instruction=None)
    if isinstance(template, str):
        return PromptTemplate(kind=template, tokenizer=tokenizer, **kwargs)
    if callable(template):
        return template
    raise TypeError(f"template must be a kind name, a PromptTemplate or a callable, got {template!r}")
