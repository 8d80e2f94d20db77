"""Inference-time methods: what each one does to the prompts or the decoding, no weights changed.

    plain             the dataset's prompts, the model's samples
    cot               chain of thought: COT_INSTRUCTION (or cot_instruction=) appended to the last user message
    self_consistency  the plain samples, majority-voted: the most frequent extracted answer of the n (maj@n)
    self_check        a second turn: the conversation (prompt, the plain answer) goes on with CHECK_INSTRUCTION
                      as a new user message; the model's revision is scored (both answers are reported)
    constrained       the plain prompts decoded under a constraint the text must match: a regex or a JSON schema
                      (constraints.py: vLLM's structured outputs, or xgrammar's logits processor on HF generate)

The prompt edits work on the chat-templated text through the tokenizer's own chat template: a one-message
conversation is rendered around a marker, and the text after the marker (the end of the user turn and the
assistant header) is where an instruction goes in, or where a finished answer is continued from.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

METHODS = ("plain", "cot", "self_consistency", "self_check", "constrained")
COT_INSTRUCTION = "Think step by step, then give the final answer."
CHECK_INSTRUCTION = ("Check your answer above step by step. If it is wrong, correct it. End your reply with: "
                     "The answer is \\boxed{your number}.")
_MARK_USER, _MARK_ANSWER, _MARK_CHECK = "\u2063U\u2063", "\u2063A\u2063", "\u2063C\u2063"


class TemplateShapeError(ValueError):
    """The tokenizer's chat template does not render a conversation as prefix + continuation."""


@dataclass(frozen=True)
class TurnPieces:
    """The chat template's text around the turns: `user_end` closes a user message and opens the assistant's
    reply (what ends every generation prompt); `answer_to_user` closes an assistant message and opens a new
    user message; `user_to_answer` == `user_end` for the second turn."""

    user_end: str
    answer_to_user: str
    user_to_answer: str


def turn_pieces(tokenizer) -> TurnPieces:
    """Read the pieces off the tokenizer's chat template by rendering conversations around markers."""
    def render(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    one = render([{"role": "user", "content": _MARK_USER}])
    two = render([{"role": "user", "content": _MARK_USER}, {"role": "assistant", "content": _MARK_ANSWER},
                  {"role": "user", "content": _MARK_CHECK}])
    if one.count(_MARK_USER) != 1 or two.count(_MARK_ANSWER) != 1 or two.count(_MARK_CHECK) != 1:
        raise TemplateShapeError("the chat template drops or repeats message contents")
    prefix, user_end = one.split(_MARK_USER)
    if not two.startswith(prefix + _MARK_USER + user_end + _MARK_ANSWER):
        raise TemplateShapeError("the chat template renders an earlier reply differently from a generation "
                                 "prompt followed by that reply")
    answer_to_user, user_to_answer = two.split(_MARK_ANSWER)[1].split(_MARK_CHECK)
    return TurnPieces(user_end=user_end, answer_to_user=answer_to_user, user_to_answer=user_to_answer)


def with_instruction(raw_prompt: str, instruction: str, pieces: TurnPieces) -> str:
    """The generation prompt with `instruction` added (after a blank line) to its last user message:

        <... user message>{user_end}   ->   <... user message>\\n\\n{instruction}{user_end}"""
    if not raw_prompt.endswith(pieces.user_end):
        raise TemplateShapeError("a prompt does not end with the chat template's generation prompt")
    return raw_prompt[:len(raw_prompt) - len(pieces.user_end)] + "\n\n" + instruction + pieces.user_end


def second_turn(raw_prompt: str, answer: str, instruction: str, pieces: TurnPieces) -> str:
    """The self-check prompt: the first prompt, the model's answer as the assistant's message, then
    `instruction` as a new user message and the assistant header:

        {raw_prompt}{answer}{answer_to_user}{instruction}{user_to_answer}"""
    if not raw_prompt.endswith(pieces.user_end):
        raise TemplateShapeError("a prompt does not end with the chat template's generation prompt")
    # the template's rendering of the assistant message may strip it: keep the answer as the model wrote it
    return raw_prompt + answer + pieces.answer_to_user + instruction + pieces.user_to_answer


_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def boxed_answer(text: str) -> str | None:
    """The built-in answer extractor: the content of the last \\boxed{...} (one level of nested braces),
    stripped, else None. Used for maj@k when neither extractor= nor the reward's `pred` gives answers."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def extracted_answers(texts: list[str], extras: dict, extractor: Callable[[str], str | None] | None) -> list:
    """The answer of each response for the vote: `extractor(text)` when given (extractor=path:function),
    else the reward function's `pred` (reward_fns/math.py returns it; with several functions the first
    `<label>/pred`), else `boxed_answer`."""
    if extractor is not None:
        return [extractor(text) for text in texts]
    keys = ["pred"] if "pred" in extras else sorted(k for k in extras if k.endswith("/pred"))
    if keys:
        return [None if value is None or (isinstance(value, float) and value != value) else str(value)
                for value in extras[keys[0]]]
    return [boxed_answer(text) for text in texts]


def parse_methods(value: str) -> list[str]:
    """method=plain,cot,...: the methods in the table's order, plain first (every gain is measured
    against it); `all` is every method."""
    names = list(METHODS) if value.strip() == "all" else [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {', '.join(unknown)}; methods: {', '.join(METHODS)} (or all)")
    return ["plain"] + [m for m in dict.fromkeys(names) if m != "plain"]
