"""Bring your own agent: each sample runs the user's agent once against the gateway; its calls become its row.

    rollout.agent_program={path: examples/agents/calculator_agent.py, name: solve}   # name(row) in a file
    rollout.agent_program={command: "python my_agent.py"}                           # row JSON on stdin

Per rollout (one `generate` call of the rollout worker): the gateway (workers/rollout/gateway.py) starts on a
free loopback port; every sample becomes an episode with its own OPENAI_API_KEY; at most
`max_concurrent_episodes` agent processes run at once (each in its own process group, so a hung agent and
everything it started is killed at `episode_timeout_s`); this thread drives the engine meanwhile (continuous
batching on vLLM: calls from different episodes share the running batch). The episode's answer is what the
function returns, or what the command prints: text, or {"answer": ..., "reward": ...}.

An episode's row (rows=merged): its calls chained from the last one back through the calls each continues
(gateway_chat.py: a call whose messages continue an earlier call reuses that call's ids), laid out as the
built-in agent loop lays out a trajectory:

    prompts   the chain's first prompt, as the engine saw it (left-padded)
    responses sampled ids of call 1 | the ids between (tool results, the next header) | sampled ids of call 2 | ...
    response_mask      1 on sampled ids only;  rollout_log_probs  the engine's log-probs there (0 elsewhere)

A failed episode (timeout, crash, bad answer) keeps its row with response_mask 0 (nothing of it is trained) and
no answer; calls outside the chain are counted (gateway_unmerged_calls), not trained. Per row the non-tensor
fields `agent_answer`, `agent_transcript` (the last call's messages + its reply), `agent_env_reward` (the agent's
own reward, 0 without one; the scorer adds it to the reward functions' score) and `gateway_*` counts, which
rlframe/trainer/agent_metrics.py turns into gateway/* metrics. Every call is written, token in and token out, to
<run_dir>/gateway/calls-<pid>.jsonl, and every row to episodes-<pid>.jsonl (tests check one against the other).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlframe.protocol import DataProto
from rlframe.workers.rollout.agent_loop import left_padded, object_array
from rlframe.workers.rollout.episode_files import prompt_messages
from rlframe.workers.rollout.episode_forks import ForkServer
from rlframe.workers.rollout.gateway import CallRecord, Episode, Gateway, GatewayLimits
from rlframe.workers.rollout.gateway_chat import ChatEncoder
from rlframe.workers.rollout.gateway_engines import CallParams, request_engine
from rlframe.workers.rollout.tools import get_parser

logger = logging.getLogger(__name__)
# What an agent inherits of this process's environment (with agent_program.inherit_env=false): the MCP SDK's default
# list, the locale, temp folder and Python path; then the gateway's OPENAI_BASE_URL / OPENAI_API_KEY are added.
AGENT_ENV_ALLOW = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
                   "PYTHONPATH", "VIRTUAL_ENV", "NO_PROXY", "no_proxy")


def agent_environment(inherit: bool, **added: str) -> dict[str, str]:
    """An agent's environment: the allow-list's variables (or, with `inherit`, all) of ours, plus `added`."""
    base = dict(os.environ) if inherit else {k: v for k, v in os.environ.items() if k in AGENT_ENV_ALLOW}
    return {**base, **added}


@dataclass
class AgentRun:
    """One episode's agent process and what came of it: `failed` names why it failed ("" if it did not)."""

    episode: Episode
    process: subprocess.Popen | None = None
    folder: str = ""
    started: float = 0.0
    deadline: float = 0.0
    answer: str | None = None
    reward: float | None = None
    failed: str = ""
    seconds: float = 0.0
    detail: str = ""
    pids: list[int] = field(default_factory=list)


class AgentEpisodes:
    """Runs the configured agent once per prompt row of a rollout and returns the rows (see the module doc)."""

    def __init__(self, engine, settings, tokenizer, eos_ids: set[int], pad_id: int):
        self.engine, self.settings, self.tokenizer = engine, settings, tokenizer
        self.program = settings.agent_program
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.encoder = ChatEncoder(tokenizer, get_parser(self.program.tool_format), self.program.tool_format)
        self.warned: set[str] = set()
        self.last_gateway: Gateway | None = None  # for tests: the port it held, the counts
        self.last_runs: list[AgentRun] = []
        self.forks: ForkServer | None = None
        self.train_rollouts = 0  # training rollouts run by this process (the policy version when no step is sent)
        self.rollouts = 0  # rollouts run by this process (the record's `rollout`: validations have no step)

    # ------------------------------------------------------------------ one rollout
    def run(self, prompts: DataProto, sampling, meta: dict) -> DataProto:
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        prompt_ids = [row[m].tolist() for row, m in zip(ids, mask)]
        nt = prompts.non_tensor_batch
        seeds, env_rows = nt.get("sample_seed"), nt.get("env_row")
        # the updates behind the weights: the step's (when the driver sends it), else the training rollouts so far
        # (synchronous training: one update after each)
        version = int(meta["step"]) - 1 if "step" in meta else self.train_rollouts
        self.train_rollouts += 0 if meta.get("validate") or meta.get("greedy") else 1
        engine = request_engine(self.engine, self.tokenizer, self.eos_ids, self.pad_id)
        p = self.program
        gateway = Gateway(self.encoder, host=p.host, max_model_len=self.settings.max_model_len,
                          max_tokens_per_call=p.max_tokens_per_call, sampling_from_request=p.sampling_from_request,
                          policy_version=version, call_timeout_s=p.episode_timeout_s, allow_remote=p.allow_remote,
                          vocab_size=min(len(self.tokenizer), engine.vocab_size or len(self.tokenizer)),
                          limits=GatewayLimits(max_body_bytes=p.max_body_bytes, read_timeout_s=p.read_timeout_s,
                                               max_connections=p.max_connections,
                                               max_calls_per_episode=p.max_calls_per_episode,
                                               max_episode_tokens=p.max_episode_tokens))
        params = CallParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                            top_p=sampling.top_p, top_k=sampling.top_k)
        runs = [AgentRun(gateway.open_episode(i, sampling.max_new_tokens, params,
                                              None if seeds is None else int(seeds[i])))
                for i in range(len(prompt_ids))]
        rows = [self.agent_row(i, prompt_ids[i], None if env_rows is None else env_rows[i]) for i in range(len(runs))]
        url = gateway.start()
        # a function agent: episodes forked from one server that imported the client libraries once (per rollout)
        self.forks = None if self.program.command else ForkServer(agent_environment(self.program.inherit_env))
        try:
            self.drive(gateway, engine, runs, rows, url)
        finally:
            for run in runs:
                self.end(run, gateway, "timeout" if run.process is not None and run.process.poll() is None else None)
            engine.abort_all()
            gateway.stop()
            if self.forks is not None:
                self.forks.close()
        self.last_gateway, self.last_runs = gateway, runs
        out = self.to_batch(runs, prompt_ids, sampling.max_new_tokens, gateway)
        self.write_record(runs, out, meta, version)
        return out

    def agent_row(self, index: int, prompt_ids: list[int], env_row) -> dict:
        """The row the agent gets: the prompt's messages (recovered from its template), and the dataset fields."""
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        row = {"prompt": prompt_messages(self.tokenizer, text), "index": index}
        if isinstance(env_row, dict):
            row.update({k: v for k, v in env_row.items() if k not in row})
        return row

    def drive(self, gateway: Gateway, engine, runs: list[AgentRun], rows: list[dict], url: str) -> None:
        """Start agents up to the concurrency bound, drive the engine, end each episode when its process exits or
        its deadline passes."""
        waiting, running = list(range(len(runs))), []
        limit = self.program.max_concurrent_episodes
        while waiting or running:
            while waiting and len(running) < limit:
                index = waiting.pop(0)
                self.start(runs[index], rows[index], url)
                if runs[index].process is not None:
                    running.append(runs[index])
            gateway.serve_engine(engine, wait_s=0.005)
            now = time.monotonic()
            for run in list(running):
                exited = run.process.poll() is not None
                if exited or now >= run.deadline:
                    self.end(run, gateway, None if exited else "timeout")
                    running.remove(run)

    def start(self, run: AgentRun, row: dict, url: str) -> None:
        """The agent's process, in a new session (its own process group), with the episode's key and the endpoint."""
        run.folder = tempfile.mkdtemp(prefix="rlframe-episode-")
        env = agent_environment(self.program.inherit_env, OPENAI_BASE_URL=url, OPENAI_API_KEY=run.episode.key,
                                RLFRAME_EPISODE_ROW=str(run.episode.row))
        env["NO_PROXY"] = ",".join(filter(None, [env.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
        files = {name: os.path.join(run.folder, name) for name in ("stdin.json", "stdout.txt", "stderr.txt")}
        run.started = time.monotonic()
        run.deadline = run.started + self.program.episode_timeout_s
        try:
            with open(files["stdin.json"], "w") as f:
                json.dump(row, f, default=str)
            if self.forks is not None:
                run.process = self.forks.spawn({
                    "path": self.program.path, "name": self.program.name, "result": os.path.join(run.folder, "result.json"),
                    "stdin": files["stdin.json"], "stdout": files["stdout.txt"], "stderr": files["stderr.txt"], "env": env})
            else:
                with open(files["stdin.json"]) as stdin, open(files["stdout.txt"], "w") as stdout, \
                        open(files["stderr.txt"], "w") as stderr:
                    run.process = subprocess.Popen(self.program.command, shell=True, stdin=stdin, stdout=stdout,
                                                   stderr=stderr, env=env, start_new_session=True, cwd=os.getcwd())
            run.pids.append(run.process.pid)
        except OSError as error:
            run.failed, run.detail = "spawn_error", f"{type(error).__name__}: {error}"

    def end(self, run: AgentRun, gateway: Gateway, reason: str | None) -> None:
        """Close the episode (its key refused from now on), kill its process group, read its answer."""
        if run.process is None or not run.episode.open:
            gateway.close_episode(run.episode)
            return
        gateway.close_episode(run.episode)
        run.seconds = time.monotonic() - run.started
        try:
            os.killpg(run.process.pid, signal.SIGKILL)  # the agent and anything it started in its group
        except (ProcessLookupError, PermissionError):
            try:  # (a forked child killed before its setsid has no group yet)
                os.kill(run.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        code = run.process.wait()
        if reason is None and code != 0:
            reason = "crash"
        if reason is None:
            self.read_answer(run)
        else:
            run.failed = reason
            run.detail = self.stderr_tail(run)
        if run.failed:
            self.warn(run)
        self.remove_folder(run)

    def read_answer(self, run: AgentRun) -> None:
        """The function's result file, or the command's standard output: text, or {"answer", "reward"}."""
        if self.program.command:
            text = Path(run.folder, "stdout.txt").read_text(errors="replace").strip()
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            value = value if isinstance(value, dict) and "answer" in value else text
        else:
            try:
                value = json.loads(Path(run.folder, "result.json").read_text())["answer"]
            except (OSError, ValueError, KeyError) as error:
                run.failed, run.detail = "no_result", f"{type(error).__name__}: {error}"
                return
        if isinstance(value, dict):
            reward = value.get("reward")
            if reward is not None and not isinstance(reward, (int, float)):
                run.failed, run.detail = "bad_answer", f"'reward' must be a number, got {reward!r}"[:300]
                return
            run.reward = None if reward is None else float(reward)
            value = value.get("answer")
        run.answer = None if value is None else str(value)

    def stderr_tail(self, run: AgentRun) -> str:
        try:
            return Path(run.folder, "stderr.txt").read_text(errors="replace")[-1500:]
        except OSError:
            return ""

    def warn(self, run: AgentRun) -> None:
        """One warning per failure kind, naming the agent and what its stderr ended with."""
        if run.failed in self.warned:
            return
        self.warned.add(run.failed)
        what = self.program.command or f"{self.program.path}:{self.program.name}"
        logger.warning("agent program %s: episode of row %d failed (%s) after %.1f s; counted in gateway/failed/%s. %s",
                       what, run.episode.row, run.failed, run.seconds, run.failed, run.detail[-800:])

    @staticmethod
    def remove_folder(run: AgentRun) -> None:
        import shutil

        shutil.rmtree(run.folder, ignore_errors=True)

    # ------------------------------------------------------------------ rows
    def chain(self, episode: Episode) -> list[tuple[CallRecord, int]]:
        """The last call and the calls it continues, oldest first: (call, choice)."""
        if not episode.calls:
            return []
        out, call, choice = [], episode.calls[-1], 0
        while True:
            out.append((call, choice))
            if call.extends is None:
                return out[::-1]
            call, choice = episode.calls[call.extends[0]], call.extends[1]

    def trajectory(self, episode: Episode, fallback_prompt: list[int]):
        """(prompt ids, response ids, mask, log-probs) of the episode's chain; the dataset prompt if no call."""
        links = self.chain(episode)
        if not links:
            return fallback_prompt, [], [], []
        prompt = links[0][0].prompt_ids
        tokens, mask, lps = [], [], []
        for call, choice in links:
            between = call.prompt_ids[len(prompt) + len(tokens):]
            tokens += between
            mask += [0] * len(between)
            lps += [0.0] * len(between)
            sampled = call.choices[choice]
            tokens += sampled["ids"]
            mask += [1] * len(sampled["ids"])
            lps += list(sampled["log_probs"])
        return prompt, tokens, mask, lps

    def to_batch(self, runs: list[AgentRun], prompt_ids: list[list[int]], width: int, gateway: Gateway) -> DataProto:
        n = len(runs)
        parts = [self.trajectory(run.episode, prompt_ids[i]) for i, run in enumerate(runs)]
        prompt_part = left_padded([p[0] for p in parts], self.pad_id)
        responses = torch.full((n, width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((n, width), dtype=torch.float32)
        response_attention = torch.zeros((n, width), dtype=torch.long)
        rollout_log_probs = torch.zeros((n, width), dtype=torch.float32)
        for i, (run, (_, tokens, mask, lps)) in enumerate(zip(runs, parts)):
            k = min(len(tokens), width)
            responses[i, :k] = torch.tensor(tokens[:k], dtype=torch.long)
            response_mask[i, :k] = torch.tensor(mask[:k], dtype=torch.float32) * (0.0 if run.failed else 1.0)
            response_attention[i, :k] = 1
            rollout_log_probs[i, :k] = torch.tensor(lps[:k], dtype=torch.float32)
        ids, attention = prompt_part.batch["input_ids"], prompt_part.batch["attention_mask"]
        attention_mask = torch.cat([attention, response_attention], dim=1)
        out = DataProto.from_dict(tensors={
            "prompts": ids, "responses": responses, "input_ids": torch.cat([ids, responses], dim=1),
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask, "rollout_log_probs": rollout_log_probs,
        }, non_tensors=self.row_fields(runs, gateway))
        return out

    def row_fields(self, runs: list[AgentRun], gateway: Gateway) -> dict:
        def per_run(f):
            return object_array([f(run) for run in runs])

        chains = [self.chain(run.episode) for run in runs]
        return {
            "agent_answer": per_run(lambda r: None if r.failed else r.answer),
            "agent_transcript": per_run(self.transcript),
            "agent_env_reward": np.array([0.0 if r.failed or r.reward is None else r.reward for r in runs], dtype=object),
            "gateway_calls": np.array([len(r.episode.calls) for r in runs], dtype=object),
            "gateway_unmerged_calls": np.array([len(r.episode.calls) - len(c) for r, c in zip(runs, chains)],
                                               dtype=object),
            "gateway_failed": np.array([r.failed for r in runs], dtype=object),
            "gateway_refused": per_run(lambda r: dict(r.episode.refused)),
            "gateway_tool_calls": np.array([sum(c.tool_calls for c in r.episode.calls) for r in runs], dtype=object),
            "gateway_prompt_tokens": np.array([sum(len(c.prompt_ids) for c in r.episode.calls) for r in runs],
                                              dtype=object),
            "gateway_completion_tokens": np.array([sum(len(ch["ids"]) for c in r.episode.calls for ch in c.choices)
                                                   for r in runs], dtype=object),
            "gateway_seconds": np.array([r.seconds for r in runs], dtype=object),
            "gateway_unknown_key_calls": np.array([gateway.unknown_key_calls if i == 0 else 0
                                                   for i in range(len(runs))], dtype=object),
            # refusals before any episode was known (busy, a slow or malformed HTTP request), on the first row
            "gateway_server_refused": object_array([{k: v for k, v in gateway.refused.items() if k != "unknown_key"}
                                                    if i == 0 else {} for i in range(len(runs))]),
        }

    @staticmethod
    def transcript(run: AgentRun) -> list[dict]:
        """The last call's messages and the reply it got (the whole conversation an agent keeps), else []."""
        if not run.episode.calls:
            return []
        last = run.episode.calls[-1]
        reply = last.choices[0]["message"] or {"role": "assistant", "content": last.choices[0]["text"]}
        return [*(last.messages or [{"role": "user", "content": "(a /v1/completions prompt)"}]), reply]

    # ------------------------------------------------------------------ the record
    def write_record(self, runs: list[AgentRun], out: DataProto, meta: dict, version: int) -> None:
        """Every call (prompt ids, sampled ids, log-probs, policy version) and every row, as jsonl."""
        folder = self.program.record_dir
        if not folder:
            return
        os.makedirs(folder, exist_ok=True)
        kind = "validate" if meta.get("validate") else "train"
        step, pid = meta.get("step"), os.getpid()
        self.rollouts += 1
        with open(os.path.join(folder, f"calls-{pid}.jsonl"), "a") as calls:
            for run in runs:
                for call in run.episode.calls:
                    calls.writelines(json.dumps({
                            "pid": pid, "rollout": self.rollouts, "kind": kind, "step": step, "row": run.episode.row,
                            "call": call.index, "choice": c,
                            "endpoint": call.endpoint, "prompt_ids": call.prompt_ids, "ids": choice["ids"],
                            "log_probs": choice["log_probs"], "finish_reason": choice["finish_reason"],
                            "policy_version": call.policy_version, "extends": call.extends}) + "\n" for c, choice in enumerate(call.choices))
        responses, mask = out.batch["responses"], out.batch["response_mask"]
        prompts, prompt_mask = out.batch["prompts"], out.batch["attention_mask"][:, : out.batch["prompts"].size(1)]
        with open(os.path.join(folder, f"episodes-{pid}.jsonl"), "a") as episodes:
            for i, run in enumerate(runs):
                episodes.write(json.dumps({
                    "pid": pid, "rollout": self.rollouts, "kind": kind, "step": step, "row": run.episode.row,
                    "calls": len(run.episode.calls),
                    "chain": [[c.index, choice] for c, choice in self.chain(run.episode)], "failed": run.failed,
                    "refused": dict(run.episode.refused), "answer": None if run.failed else run.answer,
                    "reward": run.reward, "seconds": round(run.seconds, 3), "pids": run.pids,
                    "prompt_ids": prompts[i][prompt_mask[i].bool()].tolist(),
                    "response_ids": responses[i].tolist(), "response_mask": mask[i].tolist()}) + "\n")


def agent_episodes_for(engine, settings, eos_and_pad_ids) -> AgentEpisodes:
    """The engine's episode runner, built once (tokenizer, parser) and kept on the engine."""
    runner = getattr(engine, "_agent_episodes", None)
    if runner is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(settings.model_path, trust_remote_code=settings.trust_remote_code)
        eos, pad = eos_and_pad_ids(settings.model_path, settings.trust_remote_code)
        runner = AgentEpisodes(engine, settings, tokenizer, set(eos), pad)
        engine._agent_episodes = runner
    return runner
