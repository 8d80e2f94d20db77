"""The gateway (workers/rollout/gateway.py) and agent-program episodes (workers/rollout/agent_program.py).

On the real HF engine with the tiny model, through the real `openai` client: chat and completions, streamed and
not, tools parsed into tool_calls, n, stop, logprobs, any model name; a follow-up call continuing the first is
encoded from the first's ids (token in, token out). The faults: an agent that hangs (with a child process), one
that crashes, one that sends malformed requests and a call with a wrong key, one whose detached helper calls
after its episode ended, one that returns a bad reward: each counted under its name, the rollout completes,
and no process or port is left. `check_gateway_run` is the recipe's end-to-end check (tests/test_recipes.py).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from rlframe.workers.rollout.tools import ToolCall

REPO = Path(__file__).resolve().parents[1]


def calculator_every_turn(text, tools):
    """A test tool-call parser: every model turn calls the calculator (so a random-init model makes tool calls)."""
    return [ToolCall(name="calculator", arguments={"expression": "2 + 3"})] if "calculator" in tools else []


# ------------------------------------------------------------------ the record against the rows
def read_jsonl(folder: Path, pattern: str) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob(pattern)) for line in path.read_text().splitlines()]


def check_rows_match_record(folder: Path) -> list[dict]:
    """Every row's tokens are exactly what the engine saw and sampled per the gateway's record: the prompt is the
    chain's first prompt, the trained tokens (mask 1) the sampled ids of its calls in order, and the context tokens
    between them the part of each call's prompt after the previous call's prompt + sampled ids."""
    calls = {(c["pid"], c["rollout"], c["row"], c["call"], c["choice"]): c
             for c in read_jsonl(folder, "calls-*.jsonl")}
    episodes = read_jsonl(folder, "episodes-*.jsonl")
    assert episodes, f"no episodes recorded in {folder}"
    for ep in episodes:
        links = [calls[(ep["pid"], ep["rollout"], ep["row"], call, choice)] for call, choice in ep["chain"]]
        mask = [int(m) for m in ep["response_mask"]]
        if not links:
            assert not any(mask), ep
            continue
        assert ep["prompt_ids"] == links[0]["prompt_ids"], ep["row"]
        expect_ids, expect_mask, done = [], [], list(links[0]["prompt_ids"])
        for link in links:
            assert link["prompt_ids"][: len(done)] == done, "a chained call's prompt re-encodes earlier tokens"
            between = link["prompt_ids"][len(done):]
            expect_ids += between + link["ids"]
            expect_mask += [0] * len(between) + [1] * len(link["ids"])
            done = link["prompt_ids"] + link["ids"]
            assert len(link["log_probs"]) == len(link["ids"]) and isinstance(link["policy_version"], int)
        trained = ep["failed"] == ""
        assert ep["response_ids"][: len(expect_ids)] == expect_ids, ep["row"]
        assert mask[: len(expect_ids)] == (expect_mask if trained else [0] * len(expect_ids)), ep["row"]
        assert not any(mask[len(expect_ids):])
    return episodes


def check_gateway_run(run_dir: Path) -> None:
    """recipe=grpo_gateway_math, 2 steps: the rows are the recorded calls, the engine and trainer agree on the
    sampled tokens, and the metrics show calls per episode, tokens and failures."""
    from conftest import read_metrics

    steps = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert len(steps) == 2, steps
    for m in steps:
        assert m["rollout/logprob_abs_diff"] < 1e-3, m
        assert m["gateway/calls_per_episode"] > 1.5 and m["gateway/merged_calls_per_row"] > 1.5, m  # multi-call
        assert m["gateway/tool_calls_per_episode"] >= 1 and m["gateway/context_tokens_mean"] > 0
        assert m["gateway/completion_tokens_per_episode"] > 0 and m["gateway/prompt_tokens_per_episode"] > 0
        assert m["gateway/failed_rate"] == 0 and m["gateway/failed/timeout"] == 0 and m["gateway/failed/crash"] == 0
        print({k: v for k, v in m.items() if k.startswith(("gateway/", "rollout/logprob", "critic/score"))})
    episodes = check_rows_match_record(run_dir / "gateway")
    train = [ep for ep in episodes if ep["kind"] == "train"]
    assert len({ep["rollout"] for ep in train}) == 2 and all(len(ep["chain"]) > 1 for ep in train)
    calls = read_jsonl(run_dir / "gateway", "calls-*.jsonl")
    assert {c["policy_version"] for c in calls if c["kind"] == "train"} == {0, 1}  # step 1: initial weights
    assert any(ep["kind"] == "validate" for ep in episodes)


# ------------------------------------------------------------------ the tiny HF engine, in this process
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from rlframe.workers.rollout.base import eos_and_pad_ids
    from rlframe.workers.rollout.hf_rollout import HFRollout
    from transformers import AutoTokenizer

    from rlframe.device import detect_profile

    eos, pad = eos_and_pad_ids(str(tiny_model_dir))
    rollout = HFRollout(str(tiny_model_dir), detect_profile("cpu", "float32", "sdpa", "hf"), eos_token_ids=eos,
                        pad_token_id=pad)
    return rollout, AutoTokenizer.from_pretrained(tiny_model_dir), set(eos), pad


def prompt_batch(tokenizer, n: int, pad: int):
    import numpy as np
    from rlframe.workers.rollout.agent_loop import left_padded

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i} plus 7?"}], tokenize=False,
                                           add_generation_prompt=True) for i in range(n)]
    batch = left_padded([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], pad)
    batch.non_tensor_batch["sample_seed"] = np.arange(n, dtype=np.int64)
    return batch


def episodes_runner(engine, tiny_model_dir, record_dir, **program):
    from rlframe.workers.rollout.agent_program import AgentEpisodes
    from rlframe.workers.settings import AgentProgramSettings, RolloutSettings

    rollout, tokenizer, eos, pad = engine
    settings = RolloutSettings(model_path=str(tiny_model_dir), max_model_len=1024,
                               agent_program=AgentProgramSettings(record_dir=str(record_dir), **program))
    return AgentEpisodes(rollout, settings, tokenizer, eos, pad)


def port_is_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


# ------------------------------------------------------------------ the server through the openai client
def test_openai_client_chat_completions_stream_tools_and_token_in_token_out(engine):
    """The real openai client against the gateway over the HF engine: a tool call comes back as tool_calls; the
    follow-up with the tool's result is encoded from the first call's ids; streaming, /v1/completions with token
    ids, n, stop and logprobs; malformed requests and a wrong key are refused and counted; stop frees the port."""
    import httpx
    import openai
    from rlframe.workers.rollout.gateway import Gateway
    from rlframe.workers.rollout.gateway_chat import ChatEncoder
    from rlframe.workers.rollout.gateway_engines import CallParams, request_engine

    rollout, tokenizer, eos, pad = engine
    gateway = Gateway(ChatEncoder(tokenizer, calculator_every_turn, "hermes"), max_model_len=1024)
    episode = gateway.open_episode(0, budget=64, params=CallParams(max_new_tokens=64, temperature=1.0), seed=3)
    url, stop = gateway.start(), threading.Event()
    requests = request_engine(rollout, tokenizer, eos, pad)
    pump = threading.Thread(target=lambda: [gateway.serve_engine(requests) for _ in iter(stop.is_set, True)])
    pump.start()
    try:
        client = openai.OpenAI(base_url=url, api_key=episode.key, max_retries=0)
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
            "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
        messages = [{"role": "user", "content": "What is 2 plus 3?"}]
        first = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=tools, max_tokens=6,
                                               logprobs=True)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "calculator"
        assert len(choice.logprobs.content) == first.usage.completion_tokens <= 6
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "5"}]
        second = client.chat.completions.create(model="any-name", messages=messages, tools=tools, max_tokens=6,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(second)
        assert chunks[-1].usage is not None and any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        call0, call1 = episode.calls
        assert call1.extends == (0, 0)  # continued from the first call's ids, not re-rendered
        assert call1.prompt_ids[: len(call0.prompt_ids) + len(call0.choices[0]["ids"])] == (
            call0.prompt_ids + call0.choices[0]["ids"])
        completion = client.completions.create(model="m", prompt=call0.prompt_ids, n=2, max_tokens=5, stop=["\n"],
                                               logprobs=1)
        assert len(completion.choices) == 2 and all(len(c.logprobs.token_logprobs) <= 5 for c in completion.choices)
        assert all("\n" not in c.text for c in completion.choices)
        with pytest.raises(openai.BadRequestError, match="context_length_exceeded|budget"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x " * 1200}])
        headers = {"Authorization": f"Bearer {episode.key}"}
        bad = [httpx.post(f"{url}/chat/completions", content=b"{nope", headers=headers),
               httpx.post(f"{url}/chat/completions", json={"messages": messages, "n": 0}, headers=headers),
               httpx.post(f"{url}/chat/completions", json={"messages": messages}, headers={"Authorization": "Bearer x"})]
        assert [r.status_code for r in bad] == [400, 400, 401] and bad[1].json()["error"]["param"] == "n"
        assert dict(episode.refused) == {"malformed": 2, "over_budget": 1} and gateway.unknown_key_calls == 1
    finally:
        stop.set()
        pump.join()
        gateway.stop()
    assert port_is_closed(int(url.rsplit(":", 1)[1].split("/")[0]))


# ------------------------------------------------------------------ episodes and faults
FAULT_AGENTS = '''
import json, os, subprocess, sys, time
import httpx
from openai import OpenAI

OUT = os.environ["GATEWAY_TEST_OUT"]
LATE = ("import sys, time, json, os, httpx; time.sleep(1.0); r = httpx.post(sys.argv[1] + '/chat/completions', "
        "json={'messages': [{'role': 'user', 'content': 'hi'}]}, headers={'Authorization': 'Bearer ' + sys.argv[2]}); "
        "open(sys.argv[3] + '/late.json', 'w').write(json.dumps({'status': r.status_code, 'pid': os.getpid(), "
        "'code': r.json()['error']['code']}))")


def agent(row):
    index, base, key = row["index"], os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    if index == 0:  # a well-behaved agent: two chained calls
        client = OpenAI()
        messages = list(row["prompt"])
        reply = client.chat.completions.create(model="whatever", messages=messages, max_tokens=4)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        return client.chat.completions.create(model="whatever", messages=messages, max_tokens=4).choices[0].message.content
    if index == 1:  # hangs, with a child in its process group
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open(OUT + "/hang_child.pid", "w").write(str(child.pid))
        time.sleep(300)
    if index == 2:
        raise RuntimeError("the agent crashed")
    if index == 3:  # malformed requests, a wrong key, then a call after the episode ended (a detached helper)
        auth = {"Authorization": "Bearer " + key}
        codes = [httpx.post(base + "/chat/completions", content=b"{not json", headers=auth).status_code,
                 httpx.post(base + "/chat/completions", json={"model": "m"}, headers=auth).status_code,
                 httpx.post(base + "/chat/completions", json={"messages": row["prompt"], "n": 0}, headers=auth).status_code,
                 httpx.post(base + "/embeddings", json={}, headers=auth).status_code,
                 httpx.post(base + "/chat/completions", json={"messages": row["prompt"]},
                            headers={"Authorization": "Bearer wrong"}).status_code]
        open(OUT + "/codes.json", "w").write(json.dumps(codes))
        subprocess.Popen([sys.executable, "-c", LATE, base, key, OUT], start_new_session=True)
        return {"answer": "done", "reward": 0.5}
    return {"answer": "x", "reward": "high"}  # a reward that is not a number
'''


def test_faults_counted_and_named_step_completes_nothing_leaks(engine, tiny_model_dir, tmp_path, monkeypatch):
    from rlframe.workers.settings import SamplingSettings

    from rlframe.trainer.agent_metrics import gateway_metrics

    agents = tmp_path / "agents.py"
    agents.write_text(FAULT_AGENTS)
    monkeypatch.setenv("GATEWAY_TEST_OUT", str(tmp_path))
    runner = episodes_runner(engine, tiny_model_dir, tmp_path / "record", path=str(agents), name="agent",
                             episode_timeout_s=10.0, max_concurrent_episodes=5,
                             inherit_env=True)  # (GATEWAY_TEST_OUT: not on the agents' allow-list)
    start = time.monotonic()
    out = runner.run(prompt_batch(engine[1], 5, engine[3]), SamplingSettings(max_new_tokens=32), {"step": 1})
    assert time.monotonic() - start < 30  # the hung agent cost its deadline, not the step
    nt = out.non_tensor_batch
    assert list(nt["gateway_failed"]) == ["", "timeout", "crash", "", "bad_answer"]
    assert nt["agent_answer"][3] == "done" and nt["agent_env_reward"][3] == 0.5 and nt["agent_answer"][0] is not None
    assert json.loads((tmp_path / "codes.json").read_text()) == [400, 400, 400, 404, 401]
    deadline = time.monotonic() + 10
    while not (tmp_path / "late.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    late = json.loads((tmp_path / "late.json").read_text())
    assert late["status"] == 401 and late["code"] == "episode_ended"
    metrics = gateway_metrics(nt, out.batch["response_mask"], out.batch["attention_mask"])
    assert metrics["gateway/failed/timeout"] == 1 and metrics["gateway/failed/crash"] == 1
    assert metrics["gateway/failed/bad_answer"] == 1 and metrics["gateway/failed_rate"] == pytest.approx(0.6)
    assert metrics["gateway/refused/malformed"] == 3 and metrics["gateway/refused/not_found"] == 1
    assert metrics["gateway/refused/unknown_key"] == 1 and metrics["gateway/refused/late"] == 1
    assert metrics["gateway/calls_per_episode"] == pytest.approx(2 / 5)
    assert out.batch["response_mask"][0].sum() > 0 and out.batch["response_mask"][1:3].sum() == 0
    check_rows_match_record(tmp_path / "record")
    # nothing leaks: the port, every agent process, the hung agent's child, the detached helper, the temp folders
    assert port_is_closed(runner.last_gateway.port or 0) or runner.last_gateway.server is None
    pids = [pid for run in runner.last_runs for pid in run.pids]
    pids += [int((tmp_path / "hang_child.pid").read_text()), late["pid"]]
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)]
    assert not any(Path(run.folder).exists() for run in runner.last_runs)
    assert runner.forks.process.poll() is not None  # the rollout's fork server ended with it


def test_command_agent_example_unchanged(engine, tiny_model_dir, tmp_path):
    """The example agent as a command (row JSON on stdin, answer on stdout): two episodes, three chained calls each."""
    from rlframe.workers.settings import SamplingSettings

    command = f"{sys.executable} {REPO / 'examples/agents/calculator_agent.py'}"  # (the python that has openai)
    runner = episodes_runner(engine, tiny_model_dir, tmp_path / "record", command=command, max_tokens_per_call=6,
                             tool_format=f"{REPO / 'tests/test_gateway.py'}:calculator_every_turn")
    out = runner.run(prompt_batch(engine[1], 2, engine[3]), SamplingSettings(max_new_tokens=96), {"validate": True})
    nt = out.non_tensor_batch
    assert list(nt["gateway_failed"]) == ["", ""] and list(nt["gateway_calls"]) == [3, 3]
    assert list(nt["gateway_unmerged_calls"]) == [0, 0] and list(nt["gateway_tool_calls"]) == [3, 3]
    assert [m["role"] for m in nt["agent_transcript"][0]][-2:] == ["tool", "assistant"]
    assert all(len(ep["chain"]) == 3 for ep in check_rows_match_record(tmp_path / "record"))


# ------------------------------------------------------------------ config and template checks
def test_config_refusals_name_the_key(tmp_path):
    from rlframe.config.rollout import agent_program_well_formed
    from rlframe.main import compose_config

    agent = tmp_path / "a.py"
    agent.write_text("def solve(row):\n    return 'x'\n")

    def problems(*overrides):
        cfg = compose_config(["recipe=grpo_math", *overrides])
        found = []
        agent_program_well_formed(cfg, lambda ok, key, message: found.append((key, message)) if not ok else None)
        return found

    assert problems(f"rollout.agent_program.path={agent}", "rollout.agent_program.name=solve") == []
    assert problems() == []  # off by default
    (key, message), = problems(f"rollout.agent_program.path={agent}", "rollout.agent_program.name=nope")
    assert key == "rollout.agent_program.path" and "solve" in message
    keys = [k for k, _ in problems(f"rollout.agent_program.path={agent}", "rollout.agent_program.name=solve",
                                   "rollout.agent_program.command=x", "rollout.agent_program.rows=per_call")]
    assert keys == ["rollout.agent_program", "rollout.agent_program.rows"]


def test_template_checks_and_row_messages(tiny_model_dir, tmp_path):
    from rlframe.workers.rollout.episode_files import prompt_messages, template_rewrites
    from transformers import AutoTokenizer

    assert template_rewrites(str(tiny_model_dir)) is None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert prompt_messages(tokenizer, text) == [{"role": "user", "content": "What is 3 + 4?"}]
    # a template that drops earlier assistant turns (as reasoning-stripping templates do) is refused for merging
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    tokenizer.save_pretrained(tmp_path / "rewriting")
    assert "rewrites" in template_rewrites(str(tmp_path / "rewriting"))
