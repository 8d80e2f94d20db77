"""A test reward that varies with the response (a random tiny model never answers correctly, so the
math reward is all zeros and GRPO's advantages vanish; this one gives every step a real update)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (len(solution_str) % 7) / 7.0}
