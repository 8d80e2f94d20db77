"""Preview before launch: the checks `python -m rlframe.main` runs before Ray, their messages, the memory plan
and the command line, without starting the user's processes or writing into the run folder.

    preview = run_preview(form_args, run_dir, scratch)   # Preview(ok, error, notes, plan_table, command, ...)

The steps are main's own, in its order (rlframe/main.py: compose_config, validate_config, then prepare_run's
checks): the recipe and overrides composed onto the typed schema, every configuration check, the model folder
and the memory plan (`validate_before_workers`), the tokenizer, and every data row read, checked and templated
(`check_run_data`), through main's `check_before_ray` on the board's scratch folder (generated data sets are
written there, not into the run folder). An error is the same one-screen `error: ...` text the command line
prints. prepare_run's claim of the run folder is not called (it takes the lock and writes owner.json);
`run_dir_problem` checks the lock without taking it.

What a preview does not do, unlike the run: it starts no MCP server (`rollout.multi_turn.mcp_servers`: their
shape is checked, their tools are listed when the run starts) and imports no tool or environment file (read
with `ast`: the file and the name it defines), through `validate_config(cfg, run_user_code=False)`; an agent
command (`rollout.agent_program.command`) is never run before the run's rollouts. What it still runs: a reward
file is imported (first in a short-lived child process with the deadline reward.import_timeout_s, then here),
an `algorithm.custom_estimator` file is imported, and a model folder's own code when model.trust_remote_code
is true: those are code, as they are in the run (docs/board.md, Security).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rlframe.board.forms import command_line

# Hydra's compose state and our stdout capture are process-wide: one preview at a time.
PREVIEW_LOCK = threading.Lock()


@dataclass
class Preview:
    ok: bool
    args: list[str]
    command: str
    error: str = ""  # `error: ...` as the command line prints it
    notes: list[str] = field(default_factory=list)
    plan_table: str = ""
    composed: dict | None = None  # the composed configuration (for the editable YAML)
    stage: str = ""


def usage_text(err: BaseException) -> str:
    """Any of main's usage errors as the `error: ...` screen the command line prints."""
    from rlframe.main import UsageError

    if isinstance(err, SystemExit):
        return str(err.code)
    return str(UsageError(str(err)).code)


def run_dir_problem(run_dir: Path) -> str:
    """The lock check of rlframe/trainer/run_dir.py, read-only: the `in use by another run` message, or ''."""
    from rlframe.trainer.run_dir import LOCK_FILE, Owner, busy_message

    lock = Path(run_dir) / LOCK_FILE
    if not lock.exists():
        return ""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return ""
    except OSError:
        return busy_message(Path(run_dir).resolve(), Owner.read(Path(run_dir)))
    finally:
        os.close(fd)


def compose(args: list[str]):
    """main.compose_config + validate_config (without running the user's servers and tool files), capturing the
    notes they print; raises main's usage errors."""
    from rlframe.config import validate_config
    from rlframe.main import compose_config

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg = compose_config(list(args))
        validate_config(cfg, run_user_code=False)  # no MCP server started, no tool file imported
    return cfg, [line[6:] for line in out.getvalue().splitlines() if line.startswith("note: ")]


def composed_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def check_before_workers(cfg, scratch: Path) -> str:
    """main.check_before_ray (prepare_run's checks after the claim: model folder, memory plan, tokenizer, data) on
    the board's scratch folder; returns the memory plan table it printed."""
    from rlframe.main import check_before_ray

    scratch.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check_before_ray(cfg, scratch)
    return out.getvalue()


def run_preview(args: list[str], run_dir: Path, scratch: Path, *, deep: bool = True) -> Preview:
    """All of main's checks on `args` (which name trainer.run_dir=run_dir); nothing is written into run_dir and no
    MCP server, tool file or agent command of the configuration is started (see the module's docstring)."""
    from rlframe.main import usage_errors

    preview = Preview(ok=False, args=list(args), command=command_line(args))
    busy = run_dir_problem(run_dir)
    if busy:
        preview.error = usage_text(SystemExit(f"error: {busy}"))
        return preview
    with PREVIEW_LOCK:
        try:
            cfg, preview.notes = compose(args)
            preview.composed, preview.stage = composed_dict(cfg), cfg.stage
            if deep:
                table = check_before_workers(cfg, scratch)
                preview.plan_table = "\n".join(line for line in table.splitlines() if not line.startswith("note: "))
        except (SystemExit, *usage_errors()) as err:
            preview.error = usage_text(err)
            return preview
        except OSError as err:  # a model folder or hub id that cannot be read
            preview.error = usage_text(SystemExit(f"error: {err}. Fix: check model.path (a local HF folder or a hub id)"))
            return preview
    preview.ok = True
    return preview
