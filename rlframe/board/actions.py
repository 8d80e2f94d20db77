"""What each button of the page does, as plain methods on `Board` (the page wiring is app.py).

Every method takes and returns plain values (text, tables, paths), so tests call them without a browser;
bad input comes back as an `error: ...` message for the page, and nothing starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path

import pandas as pd

from rlframe.board import runs as runs_mod
from rlframe.board.datafiles import inspect_data
from rlframe.board.forms import TrainForm, command_line, form_overrides, teacher_paths, train_args
from rlframe.board.launcher import Launcher
from rlframe.board.preview import Preview, run_preview
from rlframe.board.security import (
    BoardError,
    check_python,
    clean_name,
    confined,
    keep_upload,
    model_or_path,
    no_links_inside,
    shipped_roots,
)
from rlframe.board.tools import (
    ChatModel,
    error_lines,
    eval_args,
    eval_table,
    export_args,
    run_tool,
)

RECIPE_REWARD = "(the recipe's own)"
MAX_NEW_TOKENS = 1024  # Chat's longest answer
MAX_CHAT_CHARS = 32_000  # the conversation's text (the message and the history the page sends)


def error_text(err: BaseException) -> str:
    message = str(err)
    return message if message.startswith("error: ") else f"error: {message}"


class Board:
    """The board's state: its workspace folder (runs/, uploads/, exports/, settings/, logs/), its processes,
    the chat model."""

    def __init__(self, workspace: str | Path):
        self.workspace = Path(workspace).resolve()
        for sub in ("runs", "uploads", "exports", "settings", "logs", "scratch"):
            (self.workspace / sub).mkdir(parents=True, exist_ok=True)
        self.launcher = Launcher(self.workspace)
        self.chat_model: ChatModel | None = None

    # ---------------------------------------------------------------- train form
    def run_dir(self, name: str) -> Path:
        return self.workspace / "runs" / clean_name(name)

    def default_run_name(self, form: TrainForm) -> str:
        return f"{Path(form.recipe).stem}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"

    def teacher_folder(self, value: str, what: str = "the teacher folder") -> str:
        """A teacher as the Train tab names it: a run name of this workspace -> its hf_model; a folder inside the
        workspace; or an embedded model name / hub id. BoardError for any other path (outside the workspace, or
        through a symbolic link), as Chat's model folder."""
        value = (value or "").strip()
        final = self.workspace / "runs" / clean_name(value) / "hf_model"
        if value and clean_name(value) == value and (final / "config.json").is_file():
            value = str(final)
        return model_or_path(value, self.roots(), what)

    def checked_form(self, form: TrainForm) -> TrainForm:
        """The form with its teacher folder confined to the workspace (its path resolved there); every teacher the
        YAML names (teacher.path, teachers.<name>.path) checked the same way. BoardError when one lies outside."""
        for key, value in teacher_paths(form):
            if key == "teacher.path" and value == form.teacher_path.strip():
                form = dataclasses.replace(form, teacher_path=self.teacher_folder(value))
            else:
                self.teacher_folder(value, f"the YAML's {key}")
        return form

    def teacher_choices(self) -> list[str]:
        """The Train tab's teacher proposals: the workspace's exports and finished runs' final models."""
        return self.chat_choices()

    def preview(self, form: TrainForm, run_name: str, deep: bool = True) -> tuple[Preview, str]:
        """(the preview, the run name used): the form's paths confined, the form composed once for the YAML's base,
        then every check."""
        run_name = clean_name(run_name.strip()) if run_name.strip() else self.default_run_name(form)
        try:
            form = self.checked_form(form)
        except BoardError as err:  # refused before anything composes or reads the folder
            args = form_overrides(form)
            return Preview(ok=False, args=args, command=command_line(args), error=error_text(err)), run_name
        run_dir = self.run_dir(run_name)
        scratch = self.workspace / "scratch" / run_name
        base = run_preview(form_overrides(form) + [f"trainer.run_dir={run_dir}"], run_dir, scratch, deep=False)
        if not base.ok:
            return base, run_name
        try:
            args = train_args(form, run_dir, base.composed)
        except ValueError as err:  # the YAML editor's text (forms.YamlError) or a value that cannot be written
            base.ok, base.error = False, error_text(err)
            return base, run_name
        return run_preview(args, run_dir, scratch, deep=deep), run_name

    def launch(self, form: TrainForm, run_name: str) -> tuple[Preview, str, str]:
        """Preview, then start exactly the previewed arguments; (preview, run name, message)."""
        preview, run_name = self.preview(form, run_name)
        if not preview.ok:
            return preview, run_name, "not started: fix the error above first"
        try:
            launched = self.launcher.launch(preview.args, self.run_dir(run_name))
        except BoardError as err:
            preview.ok, preview.error = False, error_text(err)
            return preview, run_name, "not started"
        return preview, run_name, f"started pid {launched.pid}: {launched.command}"

    def full_yaml(self, form: TrainForm, run_name: str) -> str:
        import yaml

        preview, _ = self.preview(form, run_name or "yaml-view", deep=False)
        if not preview.ok:
            raise BoardError(preview.error)
        return yaml.safe_dump(preview.composed, sort_keys=False, allow_unicode=True)

    def forget_incoming(self, path: str) -> None:
        """Delete gradio's own copy of an upload (in <workspace>/uploads/.incoming/) once it is handled."""
        incoming = (self.workspace / "uploads" / ".incoming").resolve()
        path = Path(path).resolve()
        if incoming in path.parents:
            path.unlink(missing_ok=True)
            if path.parent != incoming and not any(path.parent.iterdir()):
                path.parent.rmdir()

    def upload_data(self, path: str):
        """Keep an uploaded data file in the workspace and read its first rows; BoardError when unusable."""
        try:
            kept = keep_upload(path, self.workspace, "data")
            try:
                return kept, inspect_data(kept)
            except BoardError:
                kept.unlink()  # an unusable file is not kept
                raise
        finally:
            self.forget_incoming(path)

    def upload_reward(self, path: str) -> tuple[Path, list[str]]:
        try:
            kept = keep_upload(path, self.workspace, "reward")
        finally:
            self.forget_incoming(path)
        return kept, check_python(kept)

    def reward_choices(self) -> list[str]:
        from rlframe.main import shipped_dir

        shipped = sorted(f"reward_fns/{p.name}" for p in shipped_dir("reward_fns").glob("*.py") if p.name != "__init__.py")
        uploaded = sorted(str(p) for p in (self.workspace / "uploads").glob("*.py"))
        return [RECIPE_REWARD, *shipped, *uploaded]

    def try_reward(self, form: TrainForm):
        from rlframe.board.rewards import try_reward

        from rlframe.board.rewards import TryResult, empty_table

        try:
            form = self.checked_form(form)
        except BoardError as err:
            return TryResult(empty_table(), "", error_text(err))
        return try_reward(form_overrides(form), self.workspace / "scratch" / "try-reward")

    # ---------------------------------------------------------------- watch and runs
    def run_names(self) -> list[str]:
        folders = [p for p in (self.workspace / "runs").iterdir() if p.is_dir()]
        return [p.name for p in sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True)]

    def watch(self, run_name: str) -> dict:
        """Everything the Watch tab shows of one run."""
        empty = {"progress": "", "status": "", "plots": {t: runs_mod.curve_frame({}, t) for t, _ in runs_mod.CURVES},
                 "table": runs_mod.metric_table({}), "samples": runs_mod.samples_frame(Path("/nonexistent")), "log": ""}
        if not run_name:
            return empty
        run_dir = self.run_dir(run_name)
        if not run_dir.is_dir():
            return {**empty, "status": f"no run folder {run_dir}"}
        steps = runs_mod.read_steps(run_dir)
        return {"progress": runs_mod.progress(run_dir, steps).line(),
                "status": runs_mod.status(run_dir, self.launcher.exit_code(run_dir), self.launcher.alive(run_dir)),
                "plots": {t: runs_mod.curve_frame(steps, t) for t, _ in runs_mod.CURVES},
                "table": runs_mod.metric_table(steps), "samples": runs_mod.samples_frame(run_dir),
                "log": runs_mod.log_tail(self.launcher.log_of(run_dir))}

    def watch_stamp(self, run_name: str) -> tuple | None:
        """What changes when a run moves on (its files' sizes and times, its status); None: no such run."""
        if not run_name or not self.run_dir(run_name).is_dir():
            return None
        run_dir = self.run_dir(run_name)
        files = [run_dir / "metrics.jsonl", run_dir / "validation_samples.jsonl", self.launcher.log_of(run_dir)]
        sizes = tuple((f.stat().st_size, f.stat().st_mtime_ns) if f is not None and f.exists() else None for f in files)
        return sizes + (runs_mod.status(run_dir, self.launcher.exit_code(run_dir), self.launcher.alive(run_dir)),)

    def stop(self, run_name: str) -> str:
        return self.launcher.stop(self.run_dir(run_name))

    def resume(self, run_name: str) -> str:
        launched = self.launcher.resume(self.run_dir(run_name))
        return f"resumed, pid {launched.pid}: {launched.command}"

    def runs_table(self) -> pd.DataFrame:
        return runs_mod.list_runs(self.workspace / "runs", self.launcher.exit_codes())

    def compare(self, names: list[str], key: str) -> pd.DataFrame:
        return runs_mod.compare_frame([self.run_dir(n) for n in names or []], key)

    def report(self, run_name: str) -> str:
        return runs_mod.report_html(self.run_dir(run_name)) if run_name else ""

    # ---------------------------------------------------------------- evaluate, export, chat
    def roots(self, shipped: bool = False) -> list[Path]:
        """Where the Evaluate, Chat and Export paths may point: the workspace (and the project's own folders)."""
        return [self.workspace, *(shipped_roots() if shipped else [])]

    def target_path(self, value: str) -> str:
        """A run name of this workspace -> its folder; a folder path inside the workspace; or a hub id / embedded
        model name. BoardError for any other path (outside the workspace, or through a symbolic link)."""
        value = (value or "").strip()
        if value and (self.workspace / "runs" / clean_name(value)).is_dir() and clean_name(value) == value:
            return str(confined(str(self.run_dir(value)), self.roots(), "the run"))
        return model_or_path(value, self.roots(), "the folder") if value else value

    def evaluate(self, target: str, n: int, k: str, temperature: float, data: str, reward: str,
                 max_samples: int | None) -> tuple[pd.DataFrame, str]:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.target_path(target)
        data = str(confined(data, self.roots(shipped=True), "the data file")) if (data or "").strip() else ""
        reward = str(confined(reward, self.roots(shipped=True), "the reward file")) if (reward or "").strip() else ""
        out = self.workspace / "evals" / f"{clean_name(Path(target).name)}-{stamp}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        args = eval_args(target, n, k, temperature, data, reward, max_samples or None, out)
        code, output = run_tool(self.launcher, "rlframe.eval", args, self.workspace / "logs" / "eval.log")
        if code != 0:
            return eval_table(""), error_lines(output) or output[-4000:]
        return eval_table(output), output[-4000:]

    def export(self, source: str, name: str, merge: bool) -> str:
        if not (source or "").strip():
            raise BoardError("pick a run folder (its newest complete checkpoint) or a checkpoint folder to export")
        source = self.target_path(source)
        if not Path(source).is_dir():
            raise BoardError(f"{source} is not a run or checkpoint folder of the workspace. Fix: pick a run")
        no_links_inside(Path(source), "the export's source")
        name = clean_name(name.strip()) if name.strip() else f"{Path(source).name}-export"
        out = self.workspace / "exports" / name
        if (self.workspace / "exports").is_symlink() or out.is_symlink():
            raise BoardError(f"{out} is a symbolic link: the board writes no export through one. Fix: remove it")
        if out.exists() and any(out.iterdir()):
            raise BoardError(f"{out} exists already (an earlier export is not overwritten). Fix: another export name")
        run = Path(source)
        if (run / "owner.json").is_file() and not (run / "checkpoints").is_dir():
            return self.copy_final_model(run, out)
        code, output = run_tool(self.launcher, "rlframe.export", export_args(source, out, merge),
                                self.workspace / "logs" / "export.log")
        if code != 0:
            raise BoardError(error_lines(output) or output[-3000:])
        return f"exported to {out}"

    def copy_final_model(self, run: Path, out: Path) -> str:
        """A run that saved no checkpoint (trainer.save_every=0, the recipes' default) exported its final actor
        as <run>/hf_model (trainer.export_hf): that folder is the export."""
        import shutil

        if not (run / "hf_model" / "config.json").is_file():
            raise BoardError(f"{run.name} saved no checkpoint (trainer.save_every=0) and has no hf_model yet (it is "
                             "written when the run finishes). Fix: wait for the run to finish, or launch with "
                             "trainer.save_every > 0")
        no_links_inside(run / "hf_model", "the run's hf_model")
        shutil.copytree(run / "hf_model", out, symlinks=True, dirs_exist_ok=True)  # (no link is left to copy)
        return (f"exported to {out} (a copy of {run / 'hf_model'}, the final model: the run saved no "
                "checkpoint, trainer.save_every=0)")

    def chat_choices(self) -> list[str]:
        exports = [str(p) for p in sorted((self.workspace / "exports").iterdir()) if (p / "config.json").is_file()]
        trained = [str(p / "hf_model") for p in sorted((self.workspace / "runs").iterdir())
                   if (p / "hf_model" / "config.json").is_file()]
        return exports + trained

    def load_chat(self, folder: str) -> str:
        if not folder.strip():
            raise BoardError("pick a model folder first")
        folder = model_or_path(folder, self.roots(), "the model folder")
        self.chat_model = ChatModel(folder)
        return f"loaded {folder}"

    def chat(self, history: list[dict], message: str, max_new_tokens: int, temperature: float) -> list[dict]:
        if self.chat_model is None:
            raise BoardError("load a model first (the button above the conversation)")
        if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
            raise BoardError(f"max new tokens={max_new_tokens}: 1 to {MAX_NEW_TOKENS}. Fix: a number in that range")
        if not (temperature == temperature and 0 <= temperature <= 5):
            raise BoardError(f"temperature={temperature}: 0 (greedy) to 5")
        size = len(message or "") + sum(len(str(m.get("content", ""))) for m in history if isinstance(m, dict))
        if size > MAX_CHAT_CHARS:
            raise BoardError(f"the conversation holds {size} characters (at most {MAX_CHAT_CHARS}). "
                             "Fix: a shorter message, or clear the conversation")
        answer = self.chat_model.reply(history, message, max_new_tokens, temperature)
        return [*history, {"role": "user", "content": message}, {"role": "assistant", "content": answer}]
