"""MCP tools (workers/rollout/mcp_tools.py) against a real MCP server written with the `mcp` package
(tests/mcp_test_server.py), started over stdio or serving streamable HTTP on loopback: its tools in the agent loop
(scripted engine double: the loop, the client and the server are real), its failures as error observations,
its errors before start, and no server process left behind, even when the process that started it is killed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers_tokenizer import build_tokenizer
from rlframe.config.rollout import McpServerConfig
from rlframe.workers.rollout.agent_loop import END_ANSWER, AgentLoop
from rlframe.workers.rollout.mcp_tools import McpServer, mcp_server_settings
from rlframe.workers.rollout.tools import tool_prompt
from rlframe.workers.settings import MultiTurnSettings, SamplingSettings
from test_agent_loop import TOOLS, ScriptedEngine, ids, prompt_batch

SERVER = str(Path(__file__).with_name("mcp_test_server.py"))
SAMPLING = SamplingSettings(max_new_tokens=1024, temperature=1.0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stdio_server(**fields):
    return mcp_server_settings(McpServerConfig(command="python", args=[SERVER], **fields))


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # (a zombie is dead, not yet reaped)


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_mcp_tools_in_the_agent_loop(tok):
    """One trajectory through the server's tools next to a file tool of the same name (the prefix tells them
    apart): a result, the server's own error, bad arguments (checked against the listed schema), a timeout, the
    server dying mid-run; each failure an error observation naming what failed; close() stops the process."""
    turns = [call("mcp_add", a=2, b=3), call("mcp_fail", text="q"), call("mcp_add", a="two"),
             call("mcp_nap", seconds=8), call("mcp_pid") + call("echo", text="file tool"), call("mcp_crash"),
             call("mcp_echo", text="after"), "done"]
    prompt = ids(tok, "<|im_start|>user\nq", eos=False)
    engine = ScriptedEngine(tok, {tuple(prompt[:3]): [ids(tok, t) for t in turns]})
    settings = MultiTurnSettings(tools=((TOOLS, "echo"),), mcp_servers=(stdio_server(prefix="mcp_", name="calc"),),
                                 max_turns=len(turns), tool_prompt=False,
                                 tool_timeout_s=6.0)  # headroom on a loaded machine (the error prints a rich traceback)
    loop = AgentLoop(engine, settings, tok)
    try:
        assert {"echo", "mcp_add", "mcp_fail", "mcp_nap", "mcp_pid", "mcp_crash", "mcp_echo", "mcp_getenv"} == set(loop.tools)
        assert loop.tools["mcp_add"].parameters["required"] == ["a", "b"] and loop.tools["mcp_add"].path == "mcp:calc"
        assert '"name": "mcp_add"' in tool_prompt(loop.tools, "hermes")  # the tool prompt lists the MCP tools too
        out = loop.run(prompt_batch(tok, [prompt]), SAMPLING)
    finally:
        loop.close()
    nt = out.non_tensor_batch
    text = tok.decode(out.batch["responses"][0].tolist())
    assert nt["agent_end"][0] == END_ANSWER and nt["agent_turns"][0] == len(turns)
    assert "<|im_start|>tool\n5<|im_end|>" in text
    assert "Error: Error executing tool fail" in text  # the server's isError result
    assert "Error: bad arguments for mcp_add" in text
    assert "Error: the tool 'mcp_nap' timed out after 6 s" in text
    assert "echo:file tool" in text
    assert text.count("Error: the MCP server 'calc' failed on") == 2  # crash, and the call after it
    assert nt["agent_tool_errors"][0] == 5 and nt["agent_calls_by_tool"][0]["mcp_add"] == 2
    pid = int(text.split("<|im_start|>tool\n")[5].split("<|im_end|>")[0])
    assert wait_gone(pid, 1.0)  # it crashed; and close() left nothing


def test_a_streamable_http_server_on_loopback(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        spec = mcp_server_settings(McpServerConfig(url=f"http://127.0.0.1:{port}/mcp", tools=["add"]))
        server = McpServer(spec)
        listed = server.start()
        try:
            assert "add" in [t.name for t in listed] and server.label == f"127.0.0.1:{port}"
            assert server.call("add", {"a": 20, "b": 22}, timeout_s=5).text == "42"
        finally:
            server.close()
        assert process.poll() is None  # a url server is not ours to stop
    finally:
        process.terminate()
        process.wait(10)


def test_bad_servers_are_named_before_any_worker_starts():
    from rlframe.config import ConfigError, RLConfig, ToolConfig, validate_config

    cfg = RLConfig()
    mt = cfg.rollout.multi_turn
    mt.enable, mt.tools = True, [ToolConfig(path=TOOLS, name="echo")]
    mt.mcp_servers = [McpServerConfig(command="python", args=[SERVER, "--fail-at-start"], name="db"),
                      McpServerConfig(command="python", url="http://127.0.0.1:1/mcp"),
                      McpServerConfig(command="python", args=[SERVER], tools=["add", "nope"]),
                      McpServerConfig(command="python", args=[SERVER], tools=["echo"])]
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    text = str(error.value)
    assert "rollout.multi_turn.mcp_servers[0]" in text and "MCP server 'db'" in text and "did not start" in text
    assert "cannot open the database" in text  # its stderr
    assert "rollout.multi_turn.mcp_servers[1]" in text and "exactly one of command" in text
    assert "rollout.multi_turn.mcp_servers[2]" in text and "has no tool 'nope'" in text and "crash" in text
    assert "rollout.multi_turn.mcp_servers[3]" in text and "lists a tool 'echo', which rollout.multi_turn.tools[0]" \
        in text and "prefix" in text


# A worker with a call in flight: a busy server outlives a closed stdin (seen: still alive 4 s after its parent
# was killed, when started without the launcher), so only the launcher's PR_SET_PDEATHSIG stops it.
KILLED_PARENT = """
import sys, threading, time
from rlframe.config.rollout import McpServerConfig
from rlframe.workers.rollout.mcp_tools import McpServer, mcp_server_settings
server = McpServer(mcp_server_settings(McpServerConfig(command="python", args=[sys.argv[1]])))
server.start()
threading.Thread(target=server.call, args=("nap", {"seconds": 30}, 60), daemon=True).start()
print(server.call("pid", {}, timeout_s=5).text, flush=True)
time.sleep(60)
"""


def test_a_killed_worker_leaves_no_server(tmp_path):
    """A rollout worker is killed by Ray with SIGKILL (no atexit, no close): the server it started dies with it."""
    script = tmp_path / "parent.py"
    script.write_text(KILLED_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), SERVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid)
        time.sleep(0.3)  # (the nap is running)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(pid, 4.0), f"the MCP server {pid} outlived the process that started it"
    finally:
        parent.kill()


def test_a_server_does_not_see_our_secrets(monkeypatch):
    """A stdio server gets the MCP SDK's default environment plus its entry's `env`: HF_TOKEN (and the like) in
    rlframe's environment do not reach it; `inherit_env: true` hands it everything."""
    monkeypatch.setenv("HF_TOKEN", "hf-secret-x")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-y")
    for inherit, expected in ((False, "<unset>"), (True, "hf-secret-x")):
        server = McpServer(stdio_server(env={"MY_SETTING": "on"}, inherit_env=inherit))
        try:
            server.start()
            seen = {name: server.call("getenv", {"name": name}, timeout_s=10).text
                    for name in ("HF_TOKEN", "WANDB_API_KEY", "MY_SETTING", "PATH", "HOME")}
        finally:
            server.close()
        assert seen["HF_TOKEN"] == expected and seen["MY_SETTING"] == "on", (inherit, seen)
        assert seen["WANDB_API_KEY"] == ("wandb-secret-y" if inherit else "<unset>")
        assert seen["PATH"] != "<unset>" and seen["HOME"] != "<unset>"  # the SDK's default list


@pytest.mark.parametrize("url, ok", [("https://tools.example.com/mcp", True), ("http://127.0.0.1:8931/mcp", True),
                                     ("http://localhost:8931/mcp", True), ("http://[::1]:8931/mcp", True),
                                     ("http://tools.example.com/mcp", False), ("http://10.0.0.5:8931/mcp", False),
                                     ("ftp://127.0.0.1/mcp", False), ("http:///mcp", False)])
def test_mcp_urls_are_https_except_on_loopback(url, ok):
    from rlframe.config.rollout import mcp_url_problem

    problem = mcp_url_problem(url)
    assert (problem is None) == ok, problem
    assert ok or "Fix:" in problem


def test_plain_http_to_another_host_is_refused_before_connecting():
    """The check names the entry's url key and starts (reaches) nothing."""
    from types import SimpleNamespace

    from rlframe.config.rollout import mcp_servers_list_their_tools

    problems = []
    mt = SimpleNamespace(mcp_servers=[McpServerConfig(url="http://tools.example.com/mcp")])
    mcp_servers_list_their_tools(mt, lambda ok, key, message: ok or problems.append((key, message)), {})
    assert [key for key, _ in problems] == ["rollout.multi_turn.mcp_servers[0].url"]
    assert "plain http" in problems[0][1] and "https://tools.example.com/mcp" in problems[0][1]
