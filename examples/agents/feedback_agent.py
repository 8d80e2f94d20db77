"""The feedback task as a team's own agent (OpenAI SDK): answer, hear "wrong, try again", retry, up to 3 attempts.

The same task as the built-in environment tools/feedback_math.py (recipe grpo_feedback_math), written as an agent
would be: it checks the answer against the row's ground truth itself and returns {"answer", "reward"} (1.0 on the
first attempt, halved per retry). examples/benchmark/gateway_vs_builtin.py trains it through the gateway.

    rollout.agent_program={path: examples/agents/feedback_agent.py, name: solve}
"""

import json
import re
import sys

from openai import BadRequestError, OpenAI

MAX_ATTEMPTS, RETRY_DISCOUNT = 3, 0.5
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer is[:\s]*\$?(-?[\d,]*\.?\d+)", re.IGNORECASE)
ASK = "End your reply with: The answer is \\boxed{your number}."


def extract_answer(text: str):
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    found = _ANSWER_IS.findall(text)
    return found[-1] if found else None


def number(value):
    try:
        return float(str(value).replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def solve(row: dict) -> dict:
    client = OpenAI()
    messages, truth, text = list(row["prompt"]), number(row.get("ground_truth")), ""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=48)
        except BadRequestError:  # the conversation no longer fits
            break
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answer = extract_answer(text)
        if answer is not None and truth is not None and number(answer) == truth:
            return {"answer": text, "reward": RETRY_DISCOUNT ** (attempt - 1)}
        messages.append({"role": "user", "content": (f"{answer} is wrong, try again. " if answer else
                                                     "No answer found. ") + ASK})
    return {"answer": text, "reward": 0.0}


if __name__ == "__main__":
    print(json.dumps(solve(json.load(sys.stdin))))
