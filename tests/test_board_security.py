"""The board's trust boundary (issue 39, findings 1 and 6 and the board's Low items), through the real served board
over HTTP: a login on every route (the printed token, a password from --auth-file, a lockout after wrong tries),
the Host / Origin allow-list (DNS rebinding refused), a Preview that starts none of the configuration's processes
(an MCP server command, an agent command), --auth on the command line refused, the paths Evaluate / Chat / Export
read and the Train tab's teacher folder confined to the workspace with no symbolic link followed, the upload and
max_new_tokens caps, `${` escaped.

One board is served for the module (in this process, as tests/test_board.py serves it); each test talks to it with
httpx, the gradio API calls as the page makes them (POST /gradio_api/call/<name>, then its event stream).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rlframe.board.actions import RECIPE_REWARD
from rlframe.board.app import FORM_FIELDS
from rlframe.board.forms import MAIN_KEYS

PASSWORD = "correct-horse-battery"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    from rlframe.board.__main__ import parse, serve

    root = tmp_path_factory.mktemp("board-security")
    (root / "password").write_text(PASSWORD + "\n")
    port = free_port()
    ws = root / "ws"
    app, url = serve(parse(["--port", str(port), "--workspace", str(ws), "--auth-file", str(root / "password"),
                            "--allowed-host", "board.internal", "--max-upload-mb", "1"]), block=False)
    base = f"http://127.0.0.1:{port}"
    token = url.split("?token=", 1)[1]
    assert url == f"{base}/?token={token}" and len(token) >= 32
    with httpx.Client(base_url=base, headers={"authorization": f"token {token}"}, timeout=120) as client:
        yield {"base": base, "port": port, "token": token, "ws": ws, "root": root, "client": client, "app": app}
    app.close()


def call(client: httpx.Client, name: str, data: list):
    """A gradio event as the page sends it: its outputs, or AssertionError with gradio's error."""
    r = client.post(f"/gradio_api/call/{name}", json={"data": data})
    assert r.status_code == 200, r.text
    event = r.json()["event_id"]
    kind = None
    with client.stream("GET", f"/gradio_api/call/{name}/{event}") as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line[7:].strip()
            elif line.startswith("data: ") and kind in ("complete", "error"):
                payload = json.loads(line[6:]) if line[6:].strip() not in ("", "null") else None
                assert kind == "complete", f"{name} failed: {payload}"
                return payload[0] if isinstance(payload, list) and len(payload) == 1 else payload
    raise AssertionError(f"{name}: no result")


def form(**values) -> list:
    """The Train tab's values in FORM_FIELDS order (the recipe's own everything, unless given)."""
    data = {"stage": "rl", "recipe": "grpo_math", "model_source": "embedded", "model_path": "", "teacher_path": "",
            "distillation_loss_mode": "", "data_source": "recipe", "train_files": "", "val_files": "", "prompt_key": "",
            "answer_key": "", "image_key": "", "video_key": "", "audio_key": "",
            "reward_path": RECIPE_REWARD, "reward_name": "compute_score", "judge_url": "", "judge_model": "",
            **{k: "" for k in MAIN_KEYS},
            "extra_yaml": ""}
    data.update(values)
    return [data[name] for name in FORM_FIELDS]


# ------------------------------------------------------------------ Host / Origin (DNS rebinding)


def test_a_foreign_host_or_origin_is_refused(board):
    client, port = board["client"], board["port"]
    for path in ("/", "/config", "/gradio_api/info", "/login"):
        r = client.get(path, headers={"host": f"evil.example:{port}"})  # the token is right; the name is not
        assert r.status_code == 403, (path, r.status_code)
        assert "DNS rebinding is refused" in r.json()["detail"]
    r = client.post("/gradio_api/call/on_preview", json={"data": form()}, headers={"host": "evil.example"})
    assert r.status_code == 403
    for origin in ("http://evil.example", f"http://evil.example:{port}", "http://127.0.0.1:1", "null"):
        r = client.get("/config", headers={"origin": origin})
        assert r.status_code == 403, origin
    # the board's own names (and --allowed-host) are answered
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"board.internal:{port}"):
        assert client.get("/config", headers={"host": host}).status_code == 200, host
    assert client.get("/config", headers={"origin": f"http://localhost:{port}"}).status_code == 200


# ------------------------------------------------------------------ the login


def test_no_route_answers_without_the_login(board):
    base, ws = board["base"], board["ws"]
    (ws / "uploads" / "visible.txt").write_text("secret")
    file_route = f"/gradio_api/file={ws / 'uploads' / 'visible.txt'}"
    with httpx.Client(base_url=base, timeout=30) as anonymous:
        r = anonymous.get("/", headers={"accept": "text/html"})
        assert r.status_code == 303 and r.headers["location"].startswith("/login")
        for path in ("/", "/config", "/gradio_api/info", file_route, "/gradio_api/queue/status", "/theme.css"):
            r = anonymous.get(path)
            assert r.status_code == 401, (path, r.status_code)
            assert "secret" not in r.text and "on_launch" not in r.text
        r = anonymous.post("/gradio_api/call/on_launch", json={"data": form()})
        assert r.status_code == 401
        r = anonymous.get("/config", headers={"authorization": "token not-the-token"})
        assert r.status_code == 401
    board["app"].board_login.failures.clear()
    # the token: as a header, or once in the URL (a session cookie, then the page without the token)
    assert board["client"].get(file_route).text == "secret"
    with httpx.Client(base_url=base, timeout=30) as browser:
        r = browser.get(f"/?token={board['token']}")
        assert r.status_code == 303 and r.headers["location"] == "/"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert browser.get("/config").status_code == 200
    # the password from --auth-file, on the login page
    with httpx.Client(base_url=base, timeout=30) as browser:
        assert "token or password" in browser.get("/login").text
        r = browser.post("/login", data={"secret": PASSWORD, "next": "/config"})
        assert r.status_code == 303 and r.headers["location"] == "/config"
        assert browser.get("/config").status_code == 200


def test_wrong_logins_are_locked_out(board):
    from rlframe.board.login import LOGIN_FAILURES

    login = board["app"].board_login
    try:
        with httpx.Client(base_url=board["base"], timeout=30) as browser:
            for _ in range(LOGIN_FAILURES):
                assert browser.post("/login", data={"secret": "guess"}).status_code == 401
            r = browser.post("/login", data={"secret": PASSWORD})  # even the right password waits now
            assert r.status_code == 429 and "wrong tries" in r.text and int(r.headers["retry-after"]) > 0
            r = browser.get("/config", headers={"authorization": f"token {board['token']}"})
            assert r.status_code == 429
    finally:
        login.failures.clear()
    assert board["client"].get("/config").status_code == 200


def test_a_password_on_the_command_line_is_refused():
    out = subprocess.run([sys.executable, "-m", "rlframe.board", "--port", str(free_port()), "--auth",
                          "me:a-long-password"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "--auth puts the password on the command line" in out.stderr and "--auth-file PATH" in out.stderr
    assert "RLFRAME_BOARD_PASSWORD" in out.stderr


# ------------------------------------------------------------------ Preview starts nothing


def test_preview_starts_no_mcp_server_and_no_agent_command(board, tiny_model_dir, tmp_path):
    client = board["client"]
    mcp_marker, agent_marker = tmp_path / "mcp-started", tmp_path / "agent-started"
    mcp_yaml = ("rollout:\n  multi_turn:\n    enable: true\n    mcp_servers:\n    - command: sh\n"
                f"      args: [-c, 'touch {mcp_marker}']\n")
    agent_yaml = f"rollout:\n  agent_program:\n    command: 'touch {agent_marker}'\n"
    for text, marker in ((mcp_yaml, mcp_marker), (agent_yaml, agent_marker)):
        values = form(model_source="folder", model_path=str(tiny_model_dir), extra_yaml=text)
        validation, _, command, _ = call(client, "on_preview", ["preview-run", *values])
        assert validation and "touch" in command  # previewed: the command line names it
        assert not marker.exists(), validation
        call(client, "on_yaml", ["preview-run", *values])  # Show YAML composes it too
        assert not marker.exists()
    assert not (board["ws"] / "runs" / "preview-run").exists()


def test_preview_imports_no_tool_file(board, tiny_model_dir, tmp_path):
    client, marker = board["client"], tmp_path / "tool-imported"
    tool = board["ws"] / "uploads" / "side_effect_tool.py"
    tool.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef calc(expression: str) -> str:\n    return expression\n")
    for name, expected in (("calc", None), ("nope", "defines no 'nope' (it defines: calc)")):
        text = (f"rollout:\n  multi_turn:\n    enable: true\n    tools:\n    - path: {tool}\n      name: {name}\n")
        values = form(model_source="folder", model_path=str(tiny_model_dir), extra_yaml=text)
        validation, _, _, _ = call(client, "on_preview", ["tool-run", *values])
        assert not marker.exists(), validation
        if expected:
            assert expected in validation and "rollout.multi_turn.tools[0]" in validation


# ------------------------------------------------------------------ paths, links, caps, interpolation


def test_paths_outside_the_workspace_and_links_are_refused(board, tiny_model_dir):
    client, ws = board["client"], board["ws"]
    _, output = call(client, "on_eval", ["/etc", 1, "1", 0.0, 0, "/etc/passwd", "/etc/passwd"])
    assert "outside the folders the board reads" in output
    status = call(client, "on_load", ["/etc"])
    assert "outside the folders the board reads" in status
    status = call(client, "on_load", [str(ws / ".." / ".." / "etc")])
    assert "outside the folders the board reads" in status
    # a run whose final model is a link to a file elsewhere: Export copies nothing into exports/
    run = ws / "runs" / "linked"
    (run / "hf_model").mkdir(parents=True)
    (run / "owner.json").write_text("{}")
    (run / "hf_model" / "config.json").symlink_to("/etc/passwd")
    message, _ = call(client, "on_export", ["linked", "leak", False])
    assert "is a symbolic link, which the board does not follow" in message
    assert not (ws / "exports" / "leak").exists()
    # a run folder that is itself a link out of the workspace
    (ws / "runs" / "elsewhere").symlink_to(tiny_model_dir)
    message, _ = call(client, "on_export", ["elsewhere", "leak2", False])
    assert "symbolic link" in message and not (ws / "exports" / "leak2").exists()
    status = call(client, "on_load", [str(ws / "runs" / "elsewhere")])
    assert "symbolic link" in status


def test_a_teacher_outside_the_workspace_is_refused(board, tiny_model_dir):
    """The Train tab's teacher folder (issue 40) as an attacker types it: refused before any check reads it."""
    client, ws = board["client"], board["ws"]
    (ws / "uploads" / "teacher-link").symlink_to(tiny_model_dir)
    for path, needle in (("../../etc", "outside the folders the board reads"), ("/etc", "outside the folders"),
                         (str(ws / ".." / ".." / "etc"), "outside the folders"),
                         (str(ws / "uploads" / "teacher-link"), "is a symbolic link, which the board does not follow")):
        values = form(model_source="folder", model_path=str(tiny_model_dir), teacher_path=path,
                      distillation_loss_mode="k3")
        validation, _, command, _ = call(client, "on_preview", ["teacher-run", *values])
        assert validation.startswith(f"error: the teacher folder '{path}'") and needle in validation, validation
        assert "distillation.loss_mode=k3" in command
        validation, _, _, _, message, _ = call(client, "on_launch", ["teacher-run", *values])
        assert needle in validation and message.startswith("not started")
    assert not (ws / "runs" / "teacher-run").exists()


def test_chat_answer_length_is_capped(board, tiny_model_dir):
    client, ws = board["client"], board["ws"]
    shutil.copytree(tiny_model_dir, ws / "exports" / "tiny")
    assert call(client, "on_load", [str(ws / "exports" / "tiny")]).startswith("loaded")
    history, message, status = call(client, "on_send", [[], "hi", 10**6, 0.0])
    assert "max new tokens=1000000: 1 to 1024" in status and history == [] and message == "hi"
    history, _, status = call(client, "on_send", [[], "hi", 4, 0.0])
    assert status == "" and len(history) == 2


def test_uploads_are_capped(board):
    client = board["client"]
    r = client.post("/gradio_api/upload", files={"files": ("big.jsonl", b"x" * (2 << 20))})
    assert r.status_code == 413, (r.status_code, r.text[:200])
    r = client.post("/gradio_api/upload", files={"files": ("small.jsonl", b'{"prompt": "1+1?"}\n')})
    assert r.status_code == 200


def test_yaml_box_does_not_interpolate(board):
    text = "trainer:\n  project_name: '${oc.env:HOME}'\n  experiment_name: 'a ${trainer.project_name} b'\n"
    shown = call(board["client"], "on_yaml", ["yaml-run", *form(extra_yaml=text)])
    import yaml

    trainer = yaml.safe_load(shown)["trainer"]
    assert trainer["project_name"] == "${oc.env:HOME}" != os.environ.get("HOME")
    assert trainer["experiment_name"] == "a ${trainer.project_name} b"


def test_https_with_the_given_certificate(tmp_path):
    from rlframe.board.__main__ import parse, serve
    from rlframe.board.security import BoardError

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    with pytest.raises(BoardError, match="needs both --ssl-certfile and --ssl-keyfile"):
        serve(parse(["--ssl-certfile", str(cert), "--workspace", str(tmp_path / "ws")]), block=False)
    port = free_port()
    app, url = serve(parse(["--port", str(port), "--workspace", str(tmp_path / "ws"), "--ssl-certfile", str(cert),
                            "--ssl-keyfile", str(key)]), block=False)
    try:
        assert url.startswith(f"https://127.0.0.1:{port}/?token=")
        with httpx.Client(verify=False, timeout=30) as browser:
            assert browser.get(f"https://127.0.0.1:{port}/config").status_code == 401
            r = browser.get(url)
            assert r.status_code == 303 and "; Secure" in r.headers["set-cookie"]
            assert browser.get(f"https://127.0.0.1:{port}/config").status_code == 200
            with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
                httpx.get(f"http://127.0.0.1:{port}/config", timeout=5)
    finally:
        app.close()
