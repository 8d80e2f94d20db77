"""A deliberately slow test reward (tests/test_reward_overlap.py): 0.25 s per sample, a score that varies
with the response, and a failure (an exception) on every response whose length is a multiple of 5."""

import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.25)
    if len(solution_str) % 5 == 0:
        raise ValueError(f"deliberate failure on a response of {len(solution_str)} characters")
    return {"score": (len(solution_str) % 7) / 7.0, "acc": float(len(solution_str) % 2)}
