"""checkpoints=all: every saved checkpoint of a run, measured through one engine with one setting.

    python -m rlframe.eval run=runs/x checkpoints=all          # every complete step_N, in step order
    python -m rlframe.eval run=runs/x checkpoints=0,all        # and the run's starting model as step 0
    python -m rlframe.eval run=runs/x checkpoints=4,8          # the named steps

The engine is built once (from the first model); each further model's weights are streamed into it
(`Evaluator.load_model`), so engine, sampling settings, seeds and prompts are the same at every point and a
difference between two rows is the weights' alone. Writes <run>/eval_checkpoints.{json,md,svg} and every
response with its step in <run>/eval_checkpoints_samples.jsonl.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class CheckpointSpecError(ValueError):
    """A checkpoints= value that names no usable checkpoint."""


@dataclass(frozen=True)
class ModelPoint:
    step: int
    label: str  # "base" or "step_N"
    path: str  # an HF folder, or a checkpoint folder (exported before use)


def checkpoint_points(run_dir: Path, spec: str, base_model: str) -> list[ModelPoint]:
    """checkpoints=<spec> -> the models to evaluate, in step order. `spec`: comma-separated `all` (every
    complete checkpoint), step numbers, and 0 (the run's model.path, before any update)."""
    from rlframe.trainer.checkpoint import checkpoints_dir, list_checkpoints, verify

    found = {c.step: c for c in list_checkpoints(checkpoints_dir(run_dir))}
    points: dict[int, ModelPoint] = {}
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        if item == "all":
            for step, ckpt in found.items():
                if verify(ckpt.path, hashes=False) is None:
                    points[step] = ModelPoint(step, ckpt.path.name, str(ckpt.path))
                else:
                    print(f"note: {ckpt.path} is incomplete ({verify(ckpt.path, hashes=False)}): left out", flush=True)
            continue
        if not item.isdigit():
            raise CheckpointSpecError(f"checkpoints={spec}: '{item}' is neither all nor a step number")
        step = int(item)
        if step == 0:
            points[0] = ModelPoint(0, "base", base_model)
        elif step not in found:
            have = ", ".join(str(s) for s in sorted(found)) or "none"
            raise CheckpointSpecError(f"checkpoints={spec}: no checkpoint step_{step} in {checkpoints_dir(run_dir)} "
                                      f"(saved steps: {have})")
        else:
            points[step] = ModelPoint(step, found[step].path.name, str(found[step].path))
    if not points:
        raise CheckpointSpecError(f"checkpoints={spec}: no complete checkpoint in {checkpoints_dir(run_dir)} "
                                  "(a run saves them with trainer.save_every=N and keeps trainer.max_checkpoints_to_keep)")
    return [points[step] for step in sorted(points)]


def evaluate_checkpoints(cfg, run_dir: Path, points: list[ModelPoint], files: list[str], options,
                         resolve_model, seed: int = 0) -> tuple[list[dict], list[Path]]:
    """Evaluate each point with one Evaluator (one engine); the rows and the files written."""
    from rlframe.evaluation.core import Evaluator
    from rlframe.evaluation.tables import flat_metrics, write_checkpoint_outputs, write_samples

    paths = [resolve_model(point.path, run_dir) for point in points]
    evaluator = Evaluator(cfg, paths[0], files, options)
    rows = []
    samples_path = run_dir / "eval_checkpoints_samples.jsonl"
    try:
        for index, (point, path) in enumerate(zip(points, paths)):
            if index > 0:
                evaluator.load_model(path)
            print(f"evaluating {point.label} (step {point.step}) with {evaluator.engine_name}", flush=True)
            results = evaluator.evaluate()
            write_samples(samples_path, results, options.n, {"step": point.step}, mode="w" if index == 0 else "a")
            rows.append({"step": point.step, "model": point.label, "path": path,
                         "metrics": flat_metrics(results, evaluator.count, options.n, seed, options.resamples)})
    finally:
        evaluator.close()
    settings = {"engine": evaluator.engine_name, "n": options.n, "temperature": cfg.rollout.val_temperature,
                "max_response_length": cfg.data.max_response_length, "prompts": evaluator.count,
                "seeds": rows[0]["metrics"]["seeds"] if rows else ""}
    return rows, write_checkpoint_outputs(rows, options.ks, run_dir, settings) + [samples_path]
