"""The doctor's entry: `python -m rlframe.doctor recipe=grpo_math [key=value ...] [--no-workers]`."""

from __future__ import annotations

import datetime
import logging
import sys
import time
from pathlib import Path

from rlframe.doctor.result import CheckResult, counts, failed, skipped, table, timed, write_doctor_json

USAGE = """usage: python -m rlframe.doctor recipe=<name> [key=value ...] [--no-workers]

Runs the configuration's checks (the same arguments as `python -m rlframe.main`) and, unless --no-workers,
starts its workers once for one real step. Writes <run_dir>/doctor.json; exits 1 when a check fails.
Give trainer.run_dir=<dir> and run the training there to see the doctor's checklist in its report."""


def doctor_run_dir(cfg) -> Path:
    """trainer.run_dir, else runs/<experiment_name>-doctor-<time>."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.trainer.run_dir or f"runs/{cfg.trainer.experiment_name}-doctor-{stamp}").resolve()


def pure_checks(cfg, run_dir: Path) -> tuple[list[CheckResult], dict | None]:
    """config, data, template, reward: no Ray. Returns the results and what the live checks need (None: stop)."""
    from transformers import AutoTokenizer

    from rlframe.doctor.data_checks import check_data
    from rlframe.doctor.media_checks import check_media
    from rlframe.doctor.reward_checks import check_reward_on_answers
    from rlframe.doctor.setup_checks import check_config, check_memory_plan, check_model_folder
    from rlframe.doctor.template_checks import check_template
    from rlframe.main import prepare_data

    results = timed(check_config, cfg)
    model, model_path = check_model_folder(cfg)
    results.append(model)
    if model_path is None or results[0].status == "fail":
        return results, None
    results += timed(check_memory_plan, cfg, model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.stage != "rl":  # the other stages read their own data layouts (rlframe/stages/)
        results += timed(check_template, cfg, tokenizer, model_path)
        results.append(skipped("data", "rows", f"stage={cfg.stage}: the data and reward checks cover the RL stage"))
        return results, None
    try:
        train_files, val_files = prepare_data(cfg, run_dir)
    except Exception as error:
        return results + [failed("data", "files", f"{type(error).__name__}: {error}", "data.train_files / data.source")], None
    start = time.perf_counter()
    data_results, train_set = check_data(cfg, tokenizer, train_files, val_files)
    for r in data_results:
        r.seconds = round((time.perf_counter() - start) / max(len(data_results), 1), 3)
    results += data_results
    results += timed(check_template, cfg, tokenizer, model_path)
    results += timed(check_media, cfg, tokenizer, model_path, train_set)
    results += timed(check_reward_on_answers, cfg, train_set)
    return results, {"model_path": model_path, "tokenizer": tokenizer, "train_files": train_files, "val_files": val_files}


def run_doctor(argv: list[str]) -> tuple[list[CheckResult], Path]:
    from rlframe.main import compose_config

    with_workers = "--no-workers" not in argv
    argv = [a for a in argv if a != "--no-workers"]
    cfg = compose_config(argv)
    run_dir = doctor_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"doctor: run directory {run_dir}", flush=True)
    start = time.perf_counter()
    results, live_inputs = pure_checks(cfg, run_dir)
    blocking = any(r.status == "fail" and r.group in ("config", "data") for r in results)
    if with_workers and live_inputs is not None and not blocking:
        from rlframe.doctor.live_checks import run_live_checks

        try:
            results += run_live_checks(cfg, live_inputs["model_path"], live_inputs["tokenizer"],
                                       live_inputs["train_files"], live_inputs["val_files"], run_dir)
        except Exception as error:  # a worker that fails to start or dies is the finding
            results.append(failed("live", "workers", f"{type(error).__name__}: {str(error)[:2000]}",
                                  "the error names the worker and the fix"))
    elif with_workers:
        why = (f"stage={cfg.stage}: the live checks cover the RL stage" if cfg.stage != "rl"
               else "not started: fix the failed config/data checks first")
        results.append(skipped("live", "workers", why))
    path = write_doctor_json(run_dir, results, argv, time.perf_counter() - start)
    print("\n" + table(results), flush=True)
    print(f"doctor: {path} ({time.perf_counter() - start:.0f} s)", flush=True)
    return results, run_dir


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    results, _ = run_doctor(argv)
    sys.exit(1 if counts(results)["fail"] else 0)


if __name__ == "__main__":
    main()
