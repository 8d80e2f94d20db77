"""Evaluation behind `python -m rlframe.eval` (rlframe/eval.py, the command line).

    stats.py        pass@k, mean@k, maj@k per prompt; bootstrap intervals over prompts; the spread over seeds
    core.py         Evaluator: one engine, the dataset, the scorer; each method's samples and per-prompt metrics
    methods.py      the inference-time methods' prompt edits (chain of thought, self-check) and answer extraction
    constraints.py  constrained output: a regex or JSON schema, compiled with xgrammar, on vLLM or HF generate
    checkpoints.py  checkpoints=all: every checkpoint of a run through one engine
    harness.py      lm-evaluation-harness tasks (local task YAMLs) on a model, in the same table format
    tables.py       the flat metrics, the markdown tables and the checkpoint curve
    teacher.py      teacher=: the responses under a teacher (per-token reverse KL, its log-prob)
"""
