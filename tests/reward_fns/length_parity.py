"""A test reward that varies within a group on any model: 1 if the response has an even length."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 2 == 0), "acc": float(len(solution_str) % 2 == 0)}
