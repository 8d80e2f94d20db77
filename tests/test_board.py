"""The board (rlframe/board/): its pure parts, and the real page driven in headless Chromium (issue 28).

Unit tests: the train form -> overrides (and the YAML editor's changes), the command line as the run records
it, the schema's help text, the bind/auth rule, uploads (not Python, no function, no prompt column), the
read-only lock check. One browser session over one tiny 2-step grpo_math run carries the rest: bad input
(a non-Python upload, a reward that raises, a data file with no usable column, an invalid setting, a second
launch into the running run's folder) each shown in the page with nothing started; the form filled, the
preview's command equal to what runs; launch, a clean stop in step 1 and a resume into the same folder; the
curves and table showing both steps; the run in the Runs tab with its report; an export, and the chat tab
answering from the exported model; the Chinese labels.
"""

from __future__ import annotations

import contextlib

import json
import socket
import time
from pathlib import Path

import pytest
from conftest import TINY_RUN_OVERRIDES

from rlframe.board import forms
from rlframe.board.security import BoardError, bind_rules, checked_argv, keep_upload

# ------------------------------------------------------------------ pure parts


def test_form_to_overrides_and_the_command_line():
    form = forms.TrainForm(recipe="grpo_math", total_steps=2, lr=2e-6, model_source="folder", model_path="/m/x",
                           data_source="files", train_files=["/d/train.jsonl"], val_files=[], prompt_key="question",
                           answer_key="answer", reward_path="/ws/uploads/r.py", reward_name="score")
    args = forms.form_overrides(form)
    assert args == ["recipe=grpo_math", "model.path=/m/x", "data.train_files=[/d/train.jsonl]", "data.val_files=[]",
                    "data.prompt_key=question", "data.answer_key=answer",
                    "reward.functions=[{path: /ws/uploads/r.py, name: score, weight: 1.0}]",
                    "trainer.total_steps=2", "actor.optim.lr=2e-06"]
    # the embedded default adds no model.path (the recipe's own model); empty fields add nothing
    assert forms.form_overrides(forms.TrainForm(model_path="/ignored")) == ["recipe=grpo_math"]
    assert forms.form_overrides(forms.TrainForm(recipe="sft_math", stage="sft")) == ["recipe=sft_math"]
    assert forms.form_overrides(forms.TrainForm(stage="sft")) == ["recipe=grpo_math", "stage=sft"]
    # quoted as the run records its own command (owner.json), so the two can be compared as text
    line = forms.command_line(["recipe=grpo_math", "reward.functions=[{path: a.py}]", "trainer.run_dir=/r d"])
    assert line == "python -m rlframe.main recipe=grpo_math 'reward.functions=[{path: a.py}]' 'trainer.run_dir=/r d'"
    assert forms.value_text("12") == "'12'" and forms.value_text("true") == "'true'" and forms.value_text("a b") == "'a b'"
    assert forms.value_text(True) == "true" and forms.value_text(None) == "null" and forms.value_text(0.5) == "0.5"
    assert forms.TrainForm.from_dict({**form.to_dict(), "unknown": 1}) == form
    # an LLM judge in the loop (docs/judge.md): its URL and model from the Reward box, the rest from the YAML
    judged = forms.TrainForm(judge_url="http://127.0.0.1:8000/v1", judge_model="judge")
    assert forms.form_overrides(judged) == ["recipe=grpo_math", "reward.judge.url=http://127.0.0.1:8000/v1",
                                            "reward.judge.model=judge"]
    assert {"reward.judge.url", "reward.judge.model"} <= forms.owned_keys(judged)


def test_yaml_editor_changes_become_overrides():
    composed = {"trainer": {"total_steps": 2, "val_before_train": True}, "rollout": {"n": 4, "engine": "auto"}}
    owned = forms.owned_keys(forms.TrainForm(total_steps=2))
    text = "trainer:\n  total_steps: 9\n  val_before_train: false\nrollout: {n: 4, engine: hf}\nnew: {key: 1}\n"
    # total_steps is the form's (it wins); unchanged leaves add nothing; a key the schema lacks gets `+`
    assert forms.yaml_overrides(text, composed, owned) == ["trainer.val_before_train=false", "rollout.engine=hf",
                                                           "+new.key=1"]
    assert forms.yaml_overrides("", composed, owned) == []
    with pytest.raises(forms.YamlError, match=r"YAML, line 3, column 1: .*Fix: correct the YAML"):
        forms.yaml_overrides("a:\n b: [\n", composed, owned)
    with pytest.raises(forms.YamlError, match="mapping"):
        forms.yaml_overrides("- 1\n", composed, owned)


def test_help_text_is_the_schemas_own_comment():
    from rlframe.board.schema_help import key_help

    assert key_help("rollout.n") == "rollout.n (a whole number, default 4): samples per prompt"
    assert key_help("data.max_prompt_length").endswith("tokens, after the chat template")
    assert key_help("no.such.key") == "no.such.key"


def test_bind_rules_and_checked_arguments(tmp_path, monkeypatch):
    from rlframe.board.login import PASSWORD_ENV, read_password

    assert bind_rules("127.0.0.1") == "" and bind_rules("0.0.0.0", tls=True) == ""
    assert "serves plain HTTP to the network" in bind_rules("0.0.0.0")  # a login always; the warning names the tunnel
    with pytest.raises(BoardError, match="--auth puts the password on the command line"):
        bind_rules("127.0.0.1", "me:long-password")
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    assert read_password(None) is None
    (tmp_path / "pw").write_text("long-password\n")
    assert read_password(str(tmp_path / "pw")) == "long-password"
    monkeypatch.setenv(PASSWORD_ENV, "short")
    with pytest.raises(BoardError, match="8 characters"):
        read_password(None)
    assert checked_argv("rlframe.main", ["recipe=grpo_math"])[1:] == ["-m", "rlframe.main", "recipe=grpo_math"]
    for entry, args in (("os", []), ("rlframe.main", ["; rm -rf /"]), ("rlframe.main", ["--flag"]),
                        ("rlframe.export", ["a", "b", "--dtype=x"])):
        with pytest.raises(BoardError):
            checked_argv(entry, args)


def test_uploads_are_checked_and_kept_in_the_workspace(tmp_path):
    from rlframe.board.datafiles import inspect_data

    ws = tmp_path / "ws"
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "nofunc.py").write_text("X = 1\n")
    (tmp_path / "../r w.py").resolve().write_text("def compute_score(a, b, c, d=None):\n    return 1.0\n")
    for name, match in (("notes.txt", "not a Python file"), ("broken.py", "line 1: not valid Python"),
                        ("nofunc.py", "defines no function")):
        with pytest.raises(BoardError, match=match):
            keep_upload(tmp_path / name, ws, "reward")
    kept = keep_upload((tmp_path / "../r w.py").resolve(), ws, "reward")
    assert kept == (ws / "uploads" / "r_w.py").resolve() and kept.read_text().startswith("def compute_score")
    assert sorted(p.name for p in (ws / "uploads").iterdir()) == ["r_w.py"]
    (tmp_path / "rows.jsonl").write_text('{"x": 1, "y": [1, 2]}\n')
    with pytest.raises(BoardError, match="no column holds text prompts"):
        inspect_data(tmp_path / "rows.jsonl")
    (tmp_path / "ok.jsonl").write_text(json.dumps({"question": "1+1?", "reward_model": {"ground_truth": "2"}}) + "\n")
    info = inspect_data(tmp_path / "ok.jsonl")
    assert (info.prompt, info.answer, info.columns) == ("question", "reward_model.ground_truth",
                                                        ["question", "reward_model", "reward_model.ground_truth"])


def test_eval_and_export_arguments_and_run_status(tmp_path):
    from rlframe.board.runs import status
    from rlframe.board.tools import eval_args, export_args

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {total_steps: 2}\n")
    (run / "owner.json").write_text(json.dumps({"pid": 1, "host": "h", "started": "t", "command": "c", "ended": None}))
    assert eval_args(str(run), 4, "1, 4", 1.0, max_samples=8) == [f"run={run}", "n=4", "temperature=1.0", "k=1,4",
                                                                  "max_samples=8"]
    assert eval_args("/m", 1, "", 0.0, "d.jsonl", "r.py") == ["model=/m", "n=1", "temperature=0.0", "data=d.jsonl",
                                                             "reward=r.py"]
    with pytest.raises(BoardError, match="needs the data and the reward"):
        eval_args("/m", 1, "1", 0.0)
    with pytest.raises(BoardError, match="comma-separated whole numbers"):
        eval_args(str(run), 1, "1;rm", 0.0)
    assert export_args(str(run), tmp_path / "out", merge=True) == [str(run), str(tmp_path / "out"), "--merge"]
    # what the folder says, and what the board saw of its own process
    assert status(run) == "killed or crashed"  # owner.json never marked ended, the lock free
    assert status(run, exit_code=143) == "stopped" and status(run, exit_code=1) == "failed (exit 1)"
    assert status(run, alive=True).startswith("shutting down")
    (run / "summary.json").write_text("{}")
    assert status(run) == "finished" and status(tmp_path / "empty") == "not started"


def test_lock_check_is_read_only(tmp_path):
    from rlframe.board.preview import run_dir_problem
    from rlframe.trainer.run_dir import RunDirLock

    assert run_dir_problem(tmp_path / "none") == "" and not (tmp_path / "none").exists()
    held = RunDirLock(tmp_path / "run")
    held.acquire()
    try:
        # the lock is this process's own here: fcntl locks do not stop their own process, so check through a child
        import subprocess
        import sys

        code = ("import sys; from rlframe.board.preview import run_dir_problem; "
                f"print(run_dir_problem(__import__('pathlib').Path({str(tmp_path / 'run')!r})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert "is in use by another run" in out
    finally:
        held.release()
    assert run_dir_problem(tmp_path / "run") == ""


# ------------------------------------------------------------------ the page in a browser

SLOW_REWARD = '''"""A length reward that takes 0.5 s per model sample (not for the board's "try it" answers), so that a
training step lasts long enough to be stopped inside it."""
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "answer" not in solution_str and "####" not in solution_str:
        time.sleep(0.5)
    return {"score": (len(solution_str) % 7) / 7.0}
'''
RAISING_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    raise ValueError('boom')\n"
def tiny_yaml(overrides: list[str]) -> str:
    """conftest's TINY_RUN_OVERRIDES (but the steps, which the form sets) as the YAML editor's text."""
    import yaml

    tree: dict = {}
    for arg in overrides:
        key, value = arg.split("=", 1)
        if key == "trainer.total_steps":
            continue
        *path, leaf = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return yaml.safe_dump(tree)


# the tiny run's sizes, the HF engine, no validation before the first step (so a stop lands in step 1)
TINY_YAML = tiny_yaml([*TINY_RUN_OVERRIDES, "rollout.engine=hf", "trainer.val_before_train=false"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_of(page, selector: str) -> str:
    return page.locator(f"{selector} textarea, {selector} input").first.input_value()


def wait_text(page, selector: str, needle: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    value = ""
    while time.monotonic() < deadline:
        value = text_of(page, selector)
        if needle in value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{selector} never showed {needle!r}; it shows:\n{value}")


def upload(page, selector: str, path: Path) -> None:
    page.locator(f"{selector} input[type=file]").set_input_files(str(path))


def set_value(page, selector: str, value: str) -> None:
    box = page.locator(f"{selector} textarea, {selector} input").first
    box.fill(value)
    box.press("Tab") if page.locator(f"{selector} textarea").count() == 0 else box.blur()


@contextlib.contextmanager
def board_page(browser, app, tmp_path):
    """A browser page for the served board `app`: on a failure its screenshot (<tmp_path>/failure.png, named in
    the output); the page and the board closed after."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        yield page
    except BaseException:
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
        print(f"screenshot of the page at the failure: {tmp_path / 'failure.png'}")
        raise
    finally:
        page.close()
        app.close()


def test_board_in_a_browser(browser, tmp_path, tiny_model_dir, monkeypatch):
    from rlframe.board.__main__ import parse, serve
    from rlframe.board.tools import ChatModel

    monkeypatch.chdir(tmp_path)
    ws = tmp_path / "ws"
    port = free_port()
    app, login_url = serve(parse(["--port", str(port), "--workspace", str(ws)]), block=False)
    with board_page(browser, app, tmp_path) as page:
        page.goto(login_url)  # the printed URL: its token sets the session cookie, then the page
        page.wait_for_selector("#preview")
        for name, text in (("not_python.txt", "hello"), ("raises.py", RAISING_REWARD), ("slow.py", SLOW_REWARD),
                           ("no_prompt.jsonl", '{"x": 1, "y": 2}\n')):
            (tmp_path / name).write_text(text)

        # the form: the tiny model, 2 steps, a checkpoint each step
        page.get_by_role("radio", name="folder").check()
        set_value(page, "#model_path", str(tiny_model_dir))
        set_value(page, "#total_steps", "2")
        set_value(page, "#save_every", "1")
        page.click("#yaml_box")
        set_value(page, "#yaml", TINY_YAML)

        # bad input 1-3: a non-Python upload, a reward that raises, a data file without a prompt column
        page.click("#reward_box")
        upload(page, "#reward_upload", tmp_path / "not_python.txt")
        wait_text(page, "#reward_message", "error: not_python.txt is not a Python file (.py)")
        upload(page, "#reward_upload", tmp_path / "raises.py")
        wait_text(page, "#reward_message", "kept raises.py in the workspace; functions: compute_score")
        page.click("#try_reward")
        message = wait_text(page, "#reward_message", "error: the reward function raised on")
        assert "ValueError: boom" in message and "Fix: correct the reward file" in message
        page.click("#data_box")
        upload(page, "#train_upload", tmp_path / "no_prompt.jsonl")
        wait_text(page, "#data_message", "error: no_prompt.jsonl: no column holds text prompts (columns: x, y)")
        assert text_of(page, "#train_files") == ""
        assert sorted(p.name for p in (ws / "uploads").iterdir() if p.is_file()) == ["raises.py"]  # what passed its checks
        # gradio's own copies of the uploads arrive inside the workspace and are deleted once handled
        incoming = ws / "uploads" / ".incoming"
        assert incoming.is_dir() and not [p for p in incoming.rglob("*") if p.suffix in (".txt", ".py", ".jsonl")]

        # bad input 4: an invalid setting: the named error, and nothing starts
        upload(page, "#reward_upload", tmp_path / "slow.py")
        wait_text(page, "#reward_message", "kept slow.py")
        set_value(page, "#rollout_n", "1")
        set_value(page, "#run_name", "board-run")
        page.click("#launch")
        error = wait_text(page, "#validation", "error: invalid configuration")
        assert "rollout.n: grpo compares samples of one prompt" in error and "set rollout.n >= 2" in error
        assert text_of(page, "#launch_message") == "not started: fix the error above first"
        assert not (ws / "runs" / "board-run").exists() and not (ws / "board_runs.json").exists()

        # preview: valid, the memory plan, the command; then launch: the command that runs is the one shown
        set_value(page, "#rollout_n", "")
        page.click("#preview")
        wait_text(page, "#validation", "valid: every check of python -m rlframe.main passed")
        assert "memory plan (cpu" in text_of(page, "#plan") and "-> fits" in text_of(page, "#plan")
        command = text_of(page, "#command")
        run_dir = ws / "runs" / "board-run"
        assert command.startswith("python -m rlframe.main recipe=grpo_math model.path=") and "trainer.total_steps=2" in command
        assert "rollout.engine=hf" in command and f"trainer.run_dir={run_dir}" in command
        assert not run_dir.exists()  # the preview wrote nothing there
        page.click("#launch")
        wait_text(page, "#launch_message", "started pid")
        log = ws / "logs" / "board-run.log"
        deadline = time.monotonic() + 120
        while "workers:" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads((run_dir / "owner.json").read_text())["command"] == command

        # bad input 5: a second launch into the running run's folder is refused; the run goes on untouched
        page.click("#launch")
        busy = wait_text(page, "#validation", "is in use by another run")
        assert f"trainer.run_dir={run_dir}" in busy and text_of(page, "#launch_message").startswith("not started")

        # a clean stop inside step 1 (SIGTERM: step 1 finishes, its checkpoint stays), then resume
        page.get_by_role("tab", name="Watch").click()
        page.click("#stop")
        wait_text(page, "#watch_message", "SIGTERM sent to pid")
        wait_text(page, "#watch_status", "stopped", timeout=120)
        assert "stopped by SIGTERM after step 1 of 2" in log.read_text()
        assert (run_dir / "checkpoints" / "step_1").is_dir() and not (run_dir / "summary.json").exists()
        page.click("#resume")
        wait_text(page, "#watch_message", "resumed, pid")
        wait_text(page, "#watch_status", "finished", timeout=180)
        assert wait_text(page, "#watch_progress", "step 2/2").startswith("step 2/2")
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]  # each step once, across the stop
        assert "resumed from" in log.read_text() or "step_1" in log.read_text()
        table = page.locator("#watch_table").inner_text()
        assert "1" in table and "2" in table
        assert page.locator("#plot_reward canvas, #plot_reward svg").count() > 0  # the curve is drawn

        # the Runs tab: the run, finished, and its report
        page.get_by_role("tab", name="Runs").click()
        page.click("#runs_refresh")
        page.wait_for_function("document.querySelector('#runs_table').innerText.includes('finished')", timeout=30000)
        assert "board-run" in page.locator("#runs_table").inner_text()
        set_value(page, "#report_run", "board-run")
        page.click("#open_report")
        page.wait_for_selector("#report iframe", timeout=30000)

        # export the run, then chat with the exported model
        page.get_by_role("tab", name="Export").click()
        set_value(page, "#export_source", "board-run")
        set_value(page, "#export_name", "tiny-export")
        page.click("#run_export")
        wait_text(page, "#export_output", f"exported to {ws / 'exports' / 'tiny-export'}", timeout=120)
        page.get_by_role("tab", name="Chat").click()
        assert text_of(page, "#chat_model") == str(ws / "exports" / "tiny-export")
        page.click("#chat_load")
        wait_text(page, "#chat_status", "loaded")
        set_value(page, "#chat_message", "What is 2 + 3?")
        page.click("#chat_send")
        expected = ChatModel(str(ws / "exports" / "tiny-export")).reply([], "What is 2 + 3?", 64, 0.0)
        page.wait_for_function("document.querySelector('#chatbot').innerText.includes('What is 2 + 3?')")
        page.wait_for_function(f"document.querySelector('#chatbot').innerText.includes({json.dumps(expected[:20])})")

        # Chinese labels
        page.click("#language input")
        page.get_by_role("option", name="zh").click()
        page.get_by_role("tab", name="训练").wait_for(timeout=10000)
