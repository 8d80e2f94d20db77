"""A test reward: the length parity on odd-indexed prompts, a constant on even-indexed ones (whose groups always
agree, so DAPO's dynamic sampling drops them)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 2 == 0:
        return {"score": 0.0, "acc": 0.0}
    right = float(len(solution_str) % 2 == 0)
    return {"score": right, "acc": right}
