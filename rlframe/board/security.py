"""The board's safety rules: where it listens, what it keeps of uploads, which paths it reads, what it may run.

- Every route needs a login (rlframe/board/login.py: a token printed at start, or a password from `--auth-file`
  / RLFRAME_BOARD_PASSWORD), and a Host / Origin of the board's own (DNS rebinding refused). A login can run
  code on this machine: Launch runs the user's configuration, and a reward file, a tool file or an MCP server
  command is code. `--auth user:password` on the command line is refused (`ps` shows it to every user).
- It binds 127.0.0.1 unless told otherwise; another address without TLS is allowed with a warning on the
  start line (`bind_rules`): the token then crosses the network in clear text (an SSH tunnel avoids that).
- Uploads arrive in `<workspace>/uploads/.incoming/` (gradio's upload folder, set by __main__, at most
  `--max-upload-mb`) and are copied into `<workspace>/uploads/` under a cleaned name, checked for what they
  claim to be (`keep_upload`): a reward must be Python that parses and defines a function (read with `ast`,
  never run by the upload), a data file one of the formats the loader reads.
- The paths Evaluate, Chat and Export read (`confined`), and the Train tab's teacher folder (teacher.path, and
  the YAML's teachers.<name>.path: actions.Board.checked_form), lie inside the workspace (Evaluate's data and
  reward also the project's shipped folders reward_fns/, recipes/, examples/), with no symbolic link on the way
  or inside a folder.
- It starts only rlframe's own entry points (ENTRY_POINTS), as an argument list (no shell), each argument a
  `key=value` (or a flag the entry point declares) that `checked_argv` has validated. Preview starts nothing
  (rlframe/board/preview.py); what a launched run starts is that run's configuration.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import time
from pathlib import Path

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
ENTRY_POINTS = ("rlframe.main", "rlframe.eval", "rlframe.export")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".arrow")
ARG = re.compile(r"^[+~]?[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*=[^\x00\n\r]*$")
FLAGS = {"rlframe.export": ("--merge",)}
POSITIONAL = {"rlframe.export": 2}  # checkpoint and out folder
MAX_REWARD_BYTES = 1 << 20  # an uploaded reward file (Python source)
SHIPPED = ("reward_fns", "recipes", "examples")  # the project's own folders a path may name besides the workspace
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


class BoardError(ValueError):
    """Bad input on the page; the message is shown there as `error: ...` and names the fix."""


def bind_rules(host: str, auth: str | None = None, tls: bool = False) -> str:
    """The start line's warning for `host` ('' on loopback); BoardError for a password on the command line."""
    if auth is not None:
        raise BoardError("--auth puts the password on the command line, where every user of this machine reads it "
                         "(ps, /proc/<pid>/cmdline). Fix: no option (the board prints a login token at start), "
                         "--auth-file PATH (a file holding the password, chmod 600), or RLFRAME_BOARD_PASSWORD=...")
    if host in LOCAL_HOSTS or tls:
        return ""
    return (f"warning: --host {host} serves plain HTTP to the network: the login token and every page cross it "
            "unencrypted. Fix: --ssl-certfile/--ssl-keyfile, or keep 127.0.0.1 and use an SSH tunnel "
            "(ssh -L 7860:127.0.0.1:7860 this-machine; docs/board.md)")


def clean_name(name: str) -> str:
    """A file name with only letters, digits, `-`, `_` and `.` (no folders, no leading dot)."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(name).name).lstrip(".")
    return base or "upload"


def check_python(path: Path) -> list[str]:
    """The top-level function names of a Python file; BoardError when it is not Python or has none."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=path.name)
    except (UnicodeDecodeError, ValueError) as err:
        raise BoardError(f"{path.name} is not a Python text file ({type(err).__name__}). "
                         "Fix: upload the .py file that defines your reward function") from None
    except SyntaxError as err:
        raise BoardError(f"{path.name}, line {err.lineno}: not valid Python ({err.msg}). "
                         "Fix: correct the file (python -m py_compile <file> shows the same error), then upload it again") from None
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    if not names:
        raise BoardError(f"{path.name} defines no function at its top level. Fix: a reward file defines "
                         "`def compute_score(data_source, solution_str, ground_truth, extra_info=None)` "
                         "(see reward_fns/math.py)")
    return names


def keep_upload(src: str | Path, workspace: Path, kind: str) -> Path:
    """Copy an uploaded file into <workspace>/uploads/ after checking it is a `kind` ("reward" or "data")."""
    src = Path(src)
    name = clean_name(src.name)
    if kind == "reward" and not name.endswith(".py"):
        raise BoardError(f"{src.name} is not a Python file (.py). Fix: upload the .py file that defines your reward function")
    if kind == "data" and not name.lower().endswith(DATA_SUFFIXES):
        raise BoardError(f"{src.name}: the loader reads {', '.join(DATA_SUFFIXES)} files. "
                         "Fix: save the data in one of those formats (rlframe/data/files.py)")
    if kind == "reward":
        if src.stat().st_size > MAX_REWARD_BYTES:
            raise BoardError(f"{src.name} is larger than {MAX_REWARD_BYTES >> 20} MiB: not a reward file. "
                             "Fix: upload the .py file that defines your reward function")
        check_python(src)
    folder = workspace / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    if target.exists() and target.read_bytes() != src.read_bytes():  # never overwrite an earlier upload
        target = folder / f"{target.stem}-{time.strftime('%Y%m%d-%H%M%S')}{target.suffix}"
    shutil.copyfile(src, target)
    return target.resolve()


def checked_argv(entry: str, args: list[str]) -> list[str]:
    """`[python, -m, entry, *args]` after checking the entry point and every argument; BoardError otherwise."""
    import sys

    if entry not in ENTRY_POINTS:
        raise BoardError(f"the board runs only {', '.join(ENTRY_POINTS)}, not '{entry}'")
    positional = POSITIONAL.get(entry, 0)
    for i, arg in enumerate(args):
        if i < positional or arg in FLAGS.get(entry, ()):
            if arg.startswith("-") and arg not in FLAGS.get(entry, ()):
                raise BoardError(f"argument '{arg}' is not one {entry} takes from the board")
            continue
        if not ARG.match(arg):
            raise BoardError(f"argument '{arg[:80]}' is not of the form key=value. "
                             "Fix: write settings as key=value (e.g. trainer.total_steps=2)")
    return [sys.executable, "-m", entry, *args]


def shipped_roots() -> list[Path]:
    """The project's own folders (reward_fns/, recipes/, examples/) that exist here, resolved."""
    from rlframe.main import shipped_dir

    return [shipped_dir(name).resolve() for name in SHIPPED if shipped_dir(name).is_dir()]


def confined(value: str, roots: list[Path], what: str) -> Path:
    """`value` (absolute, or relative to the working directory) as a path inside one of `roots`, with no symbolic
    link from the root down to it (`..` is resolved by its text, not through links); BoardError otherwise."""
    raw = Path(str(value).strip()).expanduser()
    path = Path(os.path.normpath(raw if raw.is_absolute() else Path.cwd() / raw))
    root = next((r for r in roots if path == r or r in path.parents), None)
    if root is None:
        raise BoardError(f"{what} '{value}' is outside the folders the board reads ({', '.join(str(r) for r in roots)}"
                         "). Fix: upload the file, or pick a run or export of the workspace (the board reads no "
                         "other path of this machine)")
    node = root
    for part in path.relative_to(root).parts:
        node = node / part
        if node.is_symlink():
            raise BoardError(f"{what} '{value}': {node} is a symbolic link, which the board does not follow. "
                             "Fix: copy the files into the workspace")
    return path


def no_links_inside(folder: Path, what: str) -> None:
    """BoardError when any entry under `folder` is a symbolic link (the board copies and reads no link)."""
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            if (Path(top) / name).is_symlink():
                raise BoardError(f"{what}: {Path(top) / name} is a symbolic link, which the board does not follow. "
                                 "Fix: replace it with the file itself")


def model_or_path(value: str, roots: list[Path], what: str) -> str:
    """A model folder confined to `roots` (no link on the way or inside), or a hub id / embedded model name that
    names no local path (`org/name`, `smollm2-135m-instruct`)."""
    value = str(value).strip()
    local = Path(value).expanduser()
    if HUB_ID.match(value) and not local.exists() and ".." not in value:
        return value
    path = confined(value, roots, what)
    if path.is_dir():
        no_links_inside(path, what)
    return str(path)
