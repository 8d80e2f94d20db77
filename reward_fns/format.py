"""Format reward: ``<think>...</think><answer>...</answer>`` structure plus an overlong penalty.

Point a run at it with ``reward.functions=[{path: reward_fns/format.py}]`` (usually next to a correctness reward,
with a small weight). It is written in the batched EasyR1 form, because the length penalty wants
the response length in tokens, which the batched form receives::

    REWARD_TYPE = "batch"
    compute_score(reward_inputs: list[dict]) -> list[dict]

Each input needs ``response`` and ``response_length`` (tokens; when it is None the words are
counted instead); ``extra_info`` may carry
``max_response_length`` to override MAX_RESPONSE_LENGTH per row.

Format (``format`` key, in [0, 1]): 1.0 when the whole response is exactly one think block
followed by one answer block, whitespace around them allowed::

    <think> reasoning </think> <answer> final answer </answer>

Otherwise partial credit TAG_CREDIT for each of the four tags that appears exactly once, so a
policy that has the idea but not the order still gets a gradient. With ``THINK_OPENED_IN_PROMPT``
(the chat template already ends with ``<think>``) the response starts inside the think block.

Length penalty (``length_penalty`` key, in [-1, 0]), the DAPO "soft overlong punishment": 0 up to
``L_max - OVERLONG_BUFFER`` tokens, then falling linearly to -1 at ``L_max`` and staying there.

``overall = FORMAT_WEIGHT * format + LENGTH_PENALTY_WEIGHT * length_penalty``.
"""

import re

REWARD_TYPE = "batch"

THINK_OPENED_IN_PROMPT = False
FORMAT_WEIGHT = 1.0
TAG_CREDIT = 0.125                # per correctly-used tag when the structure is not exact
MAX_RESPONSE_LENGTH = 1024        # L_max, tokens
OVERLONG_BUFFER = 256             # the penalty ramps over the last this-many tokens
LENGTH_PENALTY_WEIGHT = 1.0

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_STRICT = re.compile(r"\s*<think>(?:(?!</?think>|</?answer>).)+</think>\s*"
                     r"<answer>(?:(?!</?think>|</?answer>).)+</answer>\s*", re.DOTALL)


def format_score(response):
    """1.0 for the exact structure, else TAG_CREDIT per tag used exactly once."""
    text = ("<think>" + response) if THINK_OPENED_IN_PROMPT else response
    if _STRICT.fullmatch(text):
        return 1.0
    return TAG_CREDIT * sum(text.count(tag) == 1 for tag in _TAGS)


def length_penalty(length, max_length=MAX_RESPONSE_LENGTH, buffer=OVERLONG_BUFFER):
    """0 below max_length - buffer, linear down to -1 at max_length, -1 beyond."""
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length >= max_length or buffer <= 0:
        return -1.0
    return -(length - start) / buffer


def compute_score(reward_inputs):
    outputs = []
    for item in reward_inputs:
        extra = item.get("extra_info") or {}
        max_length = extra.get("max_response_length", MAX_RESPONSE_LENGTH)
        fmt = format_score(item["response"])
        length = item.get("response_length")
        if length is None:  # no token count given: count whitespace-separated words
            length = len(item["response"].split())
        penalty = length_penalty(length, max_length,
                                 min(OVERLONG_BUFFER, max_length))
        outputs.append({"overall": FORMAT_WEIGHT * fmt + LENGTH_PENALTY_WEIGHT * penalty,
                        "format": fmt, "length_penalty": penalty})
    return outputs
