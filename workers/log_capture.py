"""A quiet console: library chatter (vLLM, Ray, transformers, torch) goes to the run's log files, ours stays.

Worker processes: `capture_worker_output` is Ray's `worker_process_setup_hook` (set in the job's runtime_env
by rlframe.main.init_ray). When `$RLFRAME_WORKER_LOG_DIR` is set (trainer.verbose=false) it points the
process's stdout and stderr (file descriptors 1 and 2: Python prints, logging, tqdm bars, C++ warnings) at
`<run_dir>/logs/worker-<pid>.log`, and gives the `rlframe` loggers a handler on the original stderr at
WARNING, so that our own warnings still reach the driver's console through Ray.

The driver: `route_driver_logs(run_dir, verbose)` writes every log record (INFO and up, Ray's and Python
warnings included) to `<run_dir>/logs/driver.log`; on the console only our warnings (`rlframe.*`, WARNING
and up) and anyone's errors remain, next to what the driver prints (the progress line). `verbose=True`
leaves the console as it was (everything), and the file is still written.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

WORKER_LOG_DIR_ENV = "RLFRAME_WORKER_LOG_DIR"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OUR_LOGGERS = "rlframe"


def capture_worker_output() -> None:
    """Ray's worker_process_setup_hook: stdout and stderr to `$RLFRAME_WORKER_LOG_DIR/worker-<pid>.log`, our
    warnings to the original stderr (which Ray forwards to the driver). Nothing when the variable is unset or
    the folder cannot be made on this node."""
    folder = os.environ.get(WORKER_LOG_DIR_ENV)
    if not folder:
        return
    try:  # (a hook that raises would stop the worker from starting)
        Path(folder).mkdir(parents=True, exist_ok=True)
        log = os.open(os.path.join(folder, f"worker-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    console = os.fdopen(os.dup(2), "w", buffering=1)  # what Ray reads and forwards to the driver
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    handler = logging.StreamHandler(console)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(FORMAT))
    ours = logging.getLogger(OUR_LOGGERS)
    ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
    root = logging.getLogger()
    if not root.handlers:  # everything else, INFO and up, into the file (stderr is the file now)
        to_file = logging.StreamHandler(sys.stderr)
        to_file.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(to_file)
        root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings (FutureWarning, ...) as log records: into the file


def worker_log_env(run_dir: Path, verbose: bool) -> dict[str, str]:
    """The env var that turns the capture on in every worker (none when verbose)."""
    return {} if verbose else {WORKER_LOG_DIR_ENV: str(Path(run_dir).resolve() / "logs")}


class _ConsoleFilter(logging.Filter):
    """On the console: our warnings and everyone's errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == OUR_LOGGERS or record.name.startswith(OUR_LOGGERS + ".")
        return record.levelno >= logging.ERROR or (ours and record.levelno >= logging.WARNING)


def route_driver_logs(run_dir: Path, verbose: bool) -> Path:
    """Every log record of the driver into <run_dir>/logs/driver.log; the console filtered (unless verbose).
    Call it once the run directory exists, before Ray starts. Returns the log file's path."""
    folder = Path(run_dir) / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "driver.log"
    to_file = logging.FileHandler(path)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.addHandler(to_file)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    # Ray's logger has handlers of its own and does not propagate: give it the file, and filter its console
    ray_logger = logging.getLogger("ray")
    ray_logger.addHandler(to_file)
    if not verbose:
        for logger in (root, ray_logger):
            for handler in logger.handlers:
                if writes_to_console(handler):
                    handler.addFilter(_ConsoleFilter())
    return path


def writes_to_console(handler: logging.Handler) -> bool:
    """A handler that writes to this process's stdout or stderr: not a file, not a test's log capture."""
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    return getattr(handler, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
