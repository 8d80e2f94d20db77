"""lm-evaluation-harness tasks on a model: `python -m rlframe.eval model=<folder> harness=<tasks>`.

    python -m rlframe.eval model=runs/x/hf_model harness=my_arith harness_include=tasks/ max_samples=50

`harness` names lm-eval tasks (comma-separated); `harness_include` is a folder of task YAMLs written in lm-eval's
own format (docs/evaluation.md has one whose data is a local jsonl: `dataset_path: json` with `data_files`),
for machines without the dataset hub. `harness_backend`: hf (default; transformers on this machine's device
and dtype) or vllm; `harness_fewshot`: few-shot examples (default: the task's); `max_samples`: lm-eval's
`limit`; `seed`: its random, numpy, torch and few-shot seeds. Results come in the eval table's form: one row
per task and metric, with a 95% interval from lm-eval's standard error (value +- 1.96 stderr: a normal
interval, not our bootstrap; lm-eval computes the stderr analytically for means and by its own bootstrap
for corpus metrics).

Needs the `lm_eval` package (`pip install 'rlframe[eval]'`).
"""

from __future__ import annotations

import json
from pathlib import Path

Z95 = 1.959963984540054


class HarnessError(ValueError):
    """A harness request that cannot run: lm_eval missing, a task not found, a dataset not reachable."""


def task_manager(tasks: list[str], include: str | None):
    """lm-eval's TaskManager that knows `tasks`: the YAMLs under `include` alone when they hold every task
    (indexing lm-eval's ~15k built-in task files takes seconds), else those and the built-in ones."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise HarnessError("harness=...: the lm_eval package is not installed (pip install 'rlframe[eval]' "
                           "or pip install lm_eval)") from None
    if include is not None:
        folder = Path(include).expanduser()
        if not folder.is_dir():
            raise HarnessError(f"harness_include={include}: not a folder of lm-eval task YAMLs")
        local = TaskManager(include_path=str(folder), include_defaults=False)
        if all(task in set(local.all_tasks) for task in tasks):
            return local
        return TaskManager(include_path=str(folder))
    return TaskManager()


def check_tasks(tasks: list[str], manager, include: str | None) -> None:
    """Every task name is known to lm-eval (built in or under harness_include), else a one-line error."""
    known = set(manager.all_tasks)
    missing = [task for task in tasks if task not in known]
    if missing:
        where = f"lm-eval's built-in tasks or harness_include={include}" if include else "lm-eval's built-in tasks"
        raise HarnessError(f"harness={','.join(tasks)}: task {', '.join(missing)} not found among {where} "
                           "(no dataset hub here: write a task YAML with a local dataset and pass "
                           "harness_include=<its folder>)")


def harness_rows(results: dict) -> list[dict]:
    """lm-eval's results -> [{task, metric, value, ci_low, ci_high, stderr}] (value +- 1.96 stderr)."""
    rows = []
    for task, values in sorted(results.get("results", {}).items()):
        for key, value in values.items():
            if not isinstance(value, (int, float)) or "_stderr" in key or key == "alias":
                continue
            metric, _, filt = key.partition(",")
            stderr = values.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            stderr = float(stderr) if isinstance(stderr, (int, float)) else float("nan")
            rows.append({"task": task, "metric": metric if filt in ("", "none") else f"{metric} ({filt})",
                         "value": float(value), "stderr": stderr,
                         "ci_low": float(value) - Z95 * stderr, "ci_high": float(value) + Z95 * stderr})
    return rows


def harness_table(rows: list[dict], samples: dict[str, int]) -> list[str]:
    lines = ["| task | metric | value [95% CI] | samples |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['task']} | {row['metric']} | {row['value']:.3f} [{row['ci_low']:.3f}, "
                     f"{row['ci_high']:.3f}] | {samples.get(row['task'], '')} |")
    lines += ["", "intervals: value +- 1.96 x lm-eval's standard error"]
    return lines


def model_args(backend: str, model_path: str) -> dict:
    """lm-eval's model arguments for the model on this machine's device profile."""
    from rlframe.workers.settings import DeviceRequest

    profile = DeviceRequest().profile()
    dtype = str(profile.dtype).removeprefix("torch.")
    if backend == "vllm":
        return {"pretrained": model_path, "dtype": dtype}
    return {"pretrained": model_path, "dtype": dtype, "device": str(profile.device)}


def run_harness(args: dict[str, str], model_path: str) -> dict:
    """Run the tasks; print the table and the `metrics:` line; return {"harness": rows}."""
    tasks = [task.strip() for task in args["harness"].split(",") if task.strip()]
    if not tasks:
        raise HarnessError("harness=: name at least one lm-eval task")
    backend = args.get("harness_backend", "hf")
    if backend not in ("hf", "vllm"):
        raise HarnessError(f"harness_backend={backend}: must be hf or vllm")
    include = args.get("harness_include")
    manager = task_manager(tasks, include)
    check_tasks(tasks, manager, include)
    from lm_eval import simple_evaluate

    seed = int(args.get("seed", 0))
    try:
        results = simple_evaluate(
            model=backend, model_args=model_args(backend, model_path), tasks=tasks, task_manager=manager,
            num_fewshot=int(args["harness_fewshot"]) if "harness_fewshot" in args else None,
            limit=int(args["max_samples"]) if "max_samples" in args else None, batch_size=8,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            log_samples=False)
    except (ConnectionError, OSError, FileNotFoundError) as error:  # a dataset on the hub, no hub here
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise HarnessError(f"harness={','.join(tasks)}: a task's dataset could not be loaded ({first[:200]}); "
                           "offline, point the task YAML at local files (dataset_path: json, "
                           "dataset_kwargs.data_files)") from None
    rows = harness_rows(results)
    samples = {task: int(v.get("effective", v.get("original", 0)))
               for task, v in results.get("n-samples", {}).items()}
    print("\n".join(harness_table(rows, samples)), flush=True)
    metrics = {"harness": rows, "backend": backend, "seed": seed}
    print("metrics: " + json.dumps(metrics), flush=True)
    return metrics
