"""Multi-turn rollouts with tools: the agent loop, token-in token-out, on any rollout engine.

Each trajectory alternates model turns and tool turns until the model answers (a turn with no tool
call), the turn limit (`max_turns` model turns) or the response-token budget (the response width,
`data.max_response_length`, counting model AND tool tokens). One trajectory is one row of the usual
rollout layout (`build_rollout_batch`):

    prompts   [tool-prompt system message] + the prompt                  (left-padded)
    responses model turn 1 | observation 1 | model turn 2 | ... | model's last turn   (right-padded)
    response_mask      1 on model tokens only: observations are context, never trained on
    rollout_log_probs  the engine's log-probs on model tokens (0 elsewhere)
    attention_mask     1 on every real token (model and tool)

A turn may also be capped (`max_tokens_per_turn`): a turn cut there is still parsed for tool calls,
and its end-of-turn token is put in front of the observation as context. Token ids are kept exactly as sampled: a model turn's ids (EOS included) are appended as the engine
returned them, and an observation is rendered with the tokenizer's chat template (the tool messages and
the next assistant header, exactly what the template puts after the model's end-of-turn) and tokenized
once, then appended as ids. Nothing is decoded and re-tokenized, so the trainer's log-probs are computed
on the sampled tokens and `rollout/logprob_abs_diff` compares like with like.

Scheduling. On vLLM (continuous batching at the request level, `VLLMStepper`): each model turn is one
engine request; the loop steps the engine and handles a turn the moment it finishes (parse, start its
tools or the environment's step, both in threads), and submits the trajectory's next turn as soon as its
observation is in, while the engine keeps decoding the other trajectories' turns. No trajectory waits
for the slowest of its batch, for another's tool, or for a round to end. Environments start the same way:
every trajectory's `__init__` + `reset` runs in its own thread at once, and a trajectory joins the engine as
soon as its own reset is done. On the HF engine (`generate`
is one blocking batch call) the loop runs by rounds: every trajectory waiting for the model goes to
one `generate` call, tools run in threads meanwhile, and a trajectory whose tools have returned joins
the next round: a slow tool holds back only its own trajectory, but within a round a short turn waits
for the longest one. `scheduling = "rounds"` forces rounds on any engine (for comparisons).

Per row the loop also returns (non-tensor) `agent_turns`, `agent_tool_calls`, `agent_calls_by_tool` (per tool,
plus "(malformed)", "(unknown)" for names no tool has, and "(dropped)" for calls on the last allowed turn, not run),
`agent_tool_errors`, `agent_end` ("answer" | "turn_limit" | "budget" | "env_error") and, with an
environment, `agent_turn_rewards` / `agent_env_reward` / `agent_env_errors`; the driver turns them into
metrics and adds the environment's reward to the score.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from rlframe.protocol import AGENT_END_REASONS, DataProto
from rlframe.workers.rollout.tools import (Deferred, Tool, ToolCall, ToolCallRun, ToolLoadError, ToolResult, format_problem,
                                          get_parser, load_environment, load_tool, tool_prompt)
from rlframe.workers.rollout.vllm_stepper import VLLMStepper

logger = logging.getLogger(__name__)
END_ANSWER, END_TURN_LIMIT, END_BUDGET, END_ENV_ERROR = AGENT_END_REASONS
# agent_calls_by_tool keys besides the tools' names (agent/tool_calls/<key>)
MALFORMED, UNKNOWN, DROPPED = "(malformed)", "(unknown)", "(dropped)"


@dataclass
class Trajectory:
    """One prompt's conversation as token ids; `mask` is 1 on model tokens."""

    index: int
    prompt: list[int]
    budget: int  # response tokens allowed (model + tool)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end: str | None = None
    pending: list[ToolCallRun] = field(default_factory=list)  # tool calls running for this trajectory
    turn_open: bool = False  # the last model turn was cut by max_tokens_per_turn before its end-of-turn
    env: object = None  # the trajectory's environment instance, if any
    env_feedback: str | None = None  # the environment's observation waiting to be appended
    env_step: object = None  # the environment's step on the last model turn, running in a thread (Deferred)
    env_start: object = None  # the environment's __init__ + reset, running in a thread (Deferred)
    turn_rewards: list = field(default_factory=list)  # the environment's reward after each model turn
    turn_reward_positions: list = field(default_factory=list)  # the response index of that turn's last token
    env_errors: int = 0
    calls_by_tool: dict = field(default_factory=dict)
    ended_s: float | None = None  # seconds from the start of the rollout to the loop's seeing its end
    seed: int | None = None  # the sample's sampling seed (rollout.seed_each_sample), if the driver sent one

    def turn_seed(self) -> int | None:
        """The next model turn's seed: a function of the sample's seed and the turn number only, so a
        resumed run samples the same turns whatever the scheduling."""
        return None if self.seed is None else (self.seed + (self.turns + 1) * 0x9E3779B97F4A7C15) & (2**63 - 1)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    def append(self, tokens: list[int], trained: bool, log_probs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.mask += [1 if trained else 0] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


class ObservationRenderer:
    """Observation text -> token ids, as the chat template renders tool messages after a model turn.

    The template is rendered once around a sentinel assistant message; what follows the sentinel and the
    model's end-of-turn token up to the end (tool messages + the next assistant header) is the text the
    template puts between two model turns. It is tokenized once per observation and appended as ids."""

    SENTINEL = "\u2063SENTINEL\u2063"

    def __init__(self, tokenizer, role: str = "tool"):
        self.tokenizer, self.role = tokenizer, role

    def text(self, observations: list[str], close_turn: bool = False, role: str | None = None) -> str:
        """`close_turn`: the model's turn was cut before its end-of-turn token, which then comes first
        (as context, not as a model token)."""
        convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self.SENTINEL}]
        before = self.tokenizer.apply_chat_template(convo, tokenize=False)
        after = self.tokenizer.apply_chat_template(
            convo + [{"role": role or self.role, "content": o} for o in observations], tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template renders the conversation differently once tool messages follow; "
                             "multi-turn needs a template that appends messages")
        tail = before[before.index(self.SENTINEL) + len(self.SENTINEL):]  # e.g. "<|im_end|>\n"
        eos = self.tokenizer.eos_token or ""
        if eos and tail.startswith(eos) and not close_turn:
            tail = tail[len(eos):]  # the model's own EOS token is already in the trajectory
        return tail + after[len(before):]

    def ids(self, observations: list[str], close_turn: bool = False, role: str | None = None) -> list[int]:
        return self.tokenizer(self.text(observations, close_turn, role), add_special_tokens=False)["input_ids"]

    def with_user_message(self, prompt_ids: list[int], message: str) -> list[int]:
        """The prompt with one more user message before its generation prompt (an environment's first
        message from `reset`): context, as the rest of the prompt."""
        convo = [{"role": "user", "content": "q"}]
        base = self.tokenizer.apply_chat_template(convo, tokenize=False)
        header = self.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)[len(base):]
        middle = self.tokenizer.apply_chat_template(convo + [{"role": "user", "content": message}], tokenize=False,
                                                    add_generation_prompt=True)[len(base):]
        encode = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        header_ids = encode(header)
        if header_ids and prompt_ids[-len(header_ids):] == header_ids:
            prompt_ids = prompt_ids[: -len(header_ids)]
        return prompt_ids + encode(middle)

    def system_ids(self, content: str) -> list[int]:
        """A system message (the tool description) rendered on its own, to put in front of a prompt."""
        full = self.tokenizer.apply_chat_template([{"role": "system", "content": content}], tokenize=False)
        return self.tokenizer(full, add_special_tokens=False)["input_ids"]


class AgentLoop:
    """Runs multi-turn trajectories on a rollout engine (anything with `generate(DataProto, sampling)`).

    `settings`: MultiTurnSettings (workers/settings.py). `tools`: name -> Tool (loaded from the settings'
    files unless given)."""

    def __init__(self, engine, settings, tokenizer, tools: dict[str, Tool] | None = None):
        self.engine, self.settings, self.tokenizer = engine, settings, tokenizer
        self.tools = tools if tools is not None else {
            name: load_tool(path, name) for path, name in settings.tools}
        self.mcp_servers = []  # MCP servers whose tools joined self.tools (workers/rollout/mcp_tools.py)
        if getattr(settings, "mcp_servers", ()):
            from rlframe.workers.rollout.mcp_tools import start_mcp_tools

            self.mcp_servers, mcp = start_mcp_tools(settings.mcp_servers, {n: t.path for n, t in self.tools.items()},
                                                    settings.tool_timeout_s)
            self.tools = {**self.tools, **mcp}
        self.parse = get_parser(settings.format)
        for tool in self.tools.values():
            problem = format_problem(tool, settings.format)
            if problem:
                raise ToolLoadError(problem)
        self.renderer = ObservationRenderer(tokenizer)
        self.eos_ids = set(getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.pad_id = getattr(engine, "pad_token_id", None)
        if self.pad_id is None:
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.environment = load_environment(*settings.environment) if settings.environment else None
        self.prefix = (self.renderer.system_ids(tool_prompt(self.tools, settings.format))
                       if settings.tool_prompt and self.tools else [])
        self.engine_calls = 0  # rounds that reached the engine (round scheduling; for tests and timing)
        # "auto": continuous batching where the engine has a request-level interface (vLLM), else rounds (HF);
        # "rounds" forces rounds (for comparisons: examples/benchmark/agent_scheduling.py)
        self.scheduling = getattr(settings, "scheduling", "auto")

    # ------------------------------------------------------------------ the loop
    def run(self, prompts: DataProto, sampling) -> DataProto:
        budget = sampling.max_new_tokens
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        trajectories = [Trajectory(i, self.prefix + row[m].tolist(), budget) for i, (row, m) in enumerate(zip(ids, mask))]
        seeds = prompts.non_tensor_batch.get("sample_seed")
        if seeds is not None:
            for t in trajectories:
                t.seed = int(seeds[t.index])
        if self.environment is not None:  # every trajectory's environment starts at once, each in its thread
            rows = prompts.non_tensor_batch.get("env_row")
            for t in trajectories:
                t.env_start = Deferred(self.new_environment, self.settings.tool_timeout_s,
                                       None if rows is None else rows[t.index])
        stepper = self.stepper_for(self.engine) if self.scheduling != "rounds" else None
        self.started = time.monotonic()
        if stepper is not None:
            try:
                self.run_continuous(trajectories, sampling, stepper)
            finally:
                stepper.abort_all()  # nothing of this rollout stays in the engine if it failed midway
        else:
            self.run_rounds(trajectories, sampling)
        self.stamp(trajectories)
        self.close_environments(trajectories)
        self.last_trajectories = trajectories  # for benchmarks (examples/benchmark/agent_scheduling.py)
        out = self.to_batch(trajectories, prompts, budget)
        out.meta_info["agent/scheduling"] = "continuous" if stepper is not None else "rounds"
        out.non_tensor_batch["agent_continuous"] = np.array([stepper is not None] * len(trajectories), dtype=object)
        return out

    def close(self) -> None:
        """Stop the MCP servers this loop started (a worker killed by Ray stops them too: mcp_tools.py)."""
        for server in self.mcp_servers:
            server.close()

    @staticmethod
    def stepper_for(engine):
        """The engine's request-level interface (continuous batching), or None (rounds): an engine may
        offer `agent_stepper()` itself; vLLM's engine gets VLLMStepper."""
        if hasattr(engine, "agent_stepper"):
            return engine.agent_stepper()
        if hasattr(engine, "llm") and hasattr(getattr(engine, "llm"), "llm_engine"):
            return VLLMStepper(engine)
        return None

    def stamp(self, trajectories: list[Trajectory]) -> None:
        now = time.monotonic() - self.started
        for t in trajectories:
            if t.end is not None and t.ended_s is None:
                t.ended_s = now

    def run_rounds(self, trajectories: list[Trajectory], sampling) -> None:
        """Round-based batching (engines with a blocking batch `generate` only, e.g. HF): every trajectory
        waiting for the model goes to one `generate` call; tools run in threads meanwhile."""
        waiting_for_model = [t for t in trajectories if t.end is None and t.env_start is None]
        with_tools = [t for t in trajectories if t.env_start is not None]  # (their environments are starting)
        while waiting_for_model or with_tools:
            if waiting_for_model:
                self.model_round(waiting_for_model, sampling)
                self.stamp(waiting_for_model)
                with_tools += [t for t in waiting_for_model if t.end is None]
                waiting_for_model = []
            # trajectories whose tools have all returned go back to the model; wait only when nothing else can run
            while with_tools and not waiting_for_model:
                ready = self.collect_observed(with_tools)
                if not ready:
                    time.sleep(0.005)
                waiting_for_model += ready
            self.stamp(trajectories)

    def run_continuous(self, trajectories: list[Trajectory], sampling, stepper) -> None:
        """Continuous batching at the request level: a trajectory's next turn is submitted to the engine
        as soon as its observation is in, while the engine keeps decoding the other trajectories' turns;
        a turn that ends is handled at once (no waiting for the rest of the batch, nor for other tools)."""
        per_turn = self.settings.max_tokens_per_turn
        ready = [t for t in trajectories if t.end is None and t.env_start is None]
        in_engine: dict[int, Trajectory] = {}
        with_tools = [t for t in trajectories if t.env_start is not None]  # (their environments are starting)
        while ready or in_engine or with_tools:
            for t in ready:
                cap = min(t.remaining, per_turn) if per_turn > 0 else t.remaining
                stepper.submit(t.index, t.prompt + t.tokens, replace(sampling, max_new_tokens=cap), seed=t.turn_seed())
                in_engine[t.index] = t
            ready = []
            if in_engine:
                for key, tokens, log_probs in stepper.step():
                    t = in_engine.pop(key)
                    self.finish_turn(t, tokens, log_probs)
                    if t.end is None:
                        with_tools.append(t)
            elif with_tools:
                time.sleep(0.002)  # only tools are running
            ready = self.collect_observed(with_tools)
            self.stamp(trajectories)

    def collect_observed(self, with_tools: list[Trajectory]) -> list[Trajectory]:
        """Trajectories whose tool calls have all returned: their observations appended; those that can
        continue are returned (to go back to the model)."""
        back = []
        for t in [t for t in with_tools if all(run.done() for run in t.pending)
                  and (t.env_step is None or t.env_step.done()) and (t.env_start is None or t.env_start.done())]:
            with_tools.remove(t)
            self.observe(t)
            if t.end is None:
                back.append(t)
        return back

    def model_round(self, batch: list[Trajectory], sampling) -> None:
        """One engine call for every trajectory waiting for the model; each then ends or starts its tools."""
        new_tokens = max(t.remaining for t in batch)
        per_turn = self.settings.max_tokens_per_turn
        if per_turn > 0:
            new_tokens = min(new_tokens, per_turn)
        inputs = left_padded([t.prompt + t.tokens for t in batch], self.pad_id)
        if all(t.seed is not None for t in batch):
            inputs.non_tensor_batch["sample_seed"] = np.array([t.turn_seed() for t in batch], dtype=np.int64)
        out = self.engine.generate(inputs, replace(sampling, max_new_tokens=new_tokens))
        self.engine_calls += 1
        responses, mask, lps = out.batch["responses"], out.batch["response_mask"], out.batch["rollout_log_probs"]
        for row, t in enumerate(batch):
            length = int(mask[row].sum())
            self.finish_turn(t, responses[row, :length].tolist(), lps[row, :length].tolist())

    def finish_turn(self, t: Trajectory, tokens: list[int], log_probs: list[float]) -> None:
        """A model turn's tokens (as sampled) appended; the trajectory then ends, waits for the
        environment's feedback, or starts its tool calls."""
        per_turn = self.settings.max_tokens_per_turn
        tokens = tokens[: t.remaining]
        t.append(tokens, trained=True, log_probs=log_probs[: len(tokens)])
        t.turns += 1
        t.turn_open = not tokens or tokens[-1] not in self.eos_ids
        if t.turn_open and (not tokens or t.remaining <= 0 or per_turn <= 0 or len(tokens) < per_turn):
            t.end = END_BUDGET  # cut by the budget before its end-of-turn
            return
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        try:
            calls = self.parse(text, self.tools) if self.tools else []
        except Exception as exc:  # a user parser's bug is a malformed call the model sees, not a crash
            calls = [ToolCall(name="", arguments=None, error=f"the tool-call parser failed: {type(exc).__name__}: {exc}")]
        if not calls and t.env is not None:  # the environment judges the turn, in a thread (as tools run)
            t.env_step = Deferred(t.env.step, self.settings.tool_timeout_s, text)
            t.env_step.position = len(t.tokens) - 1  # the judged turn's last token
        elif not calls:
            t.end = END_ANSWER
        elif t.turns >= self.settings.max_turns:  # calls on the last allowed turn: not run, counted as dropped
            t.end = END_TURN_LIMIT
            t.calls_by_tool[DROPPED] = t.calls_by_tool.get(DROPPED, 0) + len(calls)
        else:
            t.tool_calls += len(calls)
            for call in calls:
                key = self.call_key(call)
                t.calls_by_tool[key] = t.calls_by_tool.get(key, 0) + 1
            t.pending = [ToolCallRun(self.tools.get(c.name), c, self.settings.tool_timeout_s, list(self.tools))
                         for c in calls]

    def call_key(self, call: ToolCall) -> str:
        """The agent/tool_calls/<key> a call counts under: its tool, or one key for every malformed call and
        one for every unknown name (model-written names must not become metric keys)."""
        if not call.name:
            return MALFORMED
        return call.name if call.name in self.tools else UNKNOWN

    def new_environment(self, row) -> tuple:
        """(environment, first message, failed method, error): a fresh environment and its `reset(row)`, run in the
        trajectory's thread (Deferred); never raises."""
        try:
            env = self.environment()
        except Exception as exc:
            return None, None, "__init__", f"{type(exc).__name__}: {exc}"
        try:
            return env, env.reset(row), None, None
        except Exception as exc:
            return env, None, "reset", f"{type(exc).__name__}: {exc}"

    def environment_started(self, t: Trajectory) -> None:
        """The trajectory's environment is built and reset: `reset`'s first message joins the prompt (a user message,
        context); a failure (or a timeout) ends the trajectory, counted."""
        (result, error), t.env_start = t.env_start.outcome(), None
        env, first, where, failure = result if result is not None else (None, None, "reset", None)
        error = failure or error
        if error is None and isinstance(first, str) and first:
            t.prompt = self.renderer.with_user_message(t.prompt, self.truncate(first))
        if error is not None:
            t.env_errors += 1
            t.end = END_ENV_ERROR
            self.warn_environment(where or "reset", error)
        t.env = env

    def close_environments(self, trajectories: list[Trajectory]) -> None:
        """Each ended trajectory's environment closed, if it has `close` (a Gymnasium env does), in its thread."""
        for t in trajectories:
            if callable(getattr(t.env, "close", None)):
                Deferred(t.env.close, self.settings.tool_timeout_s)

    def environment_result(self, t: Trajectory) -> None:
        """The environment's verdict on a turn without tool calls: its feedback becomes the next (user)
        message, or the trajectory ends (done, no feedback, the turn limit, or an error, counted)."""
        (result, error), position = t.env_step.outcome(), t.env_step.position
        t.env_step = None
        if error is None:
            try:
                observation, reward, done = result
                t.turn_rewards.append(float(reward))
                t.turn_reward_positions.append(position)
            except (TypeError, ValueError):
                error = f"step returned {result!r}, not (observation, reward, done)"
        if error is not None:
            t.env_errors += 1
            t.end = END_ENV_ERROR
            self.warn_environment("step", error)
        elif done or observation is None:  # (a Gymnasium env's truncation counts as a turn limit)
            t.end = END_TURN_LIMIT if getattr(t.env, "truncated", False) is True else END_ANSWER
        elif t.turns >= self.settings.max_turns:
            t.end = END_TURN_LIMIT
        else:
            t.env_feedback = str(observation)

    def warn_environment(self, method: str, error: str) -> None:
        """An environment's failure ends its trajectory (counted in agent/env_error_rate); its message is
        logged once per distinct text (a few at most), naming the file, class and method."""
        seen = self.__dict__.setdefault("_env_warnings", set())
        if error not in seen and len(seen) < 5:
            seen.add(error)
            path, name = self.settings.environment
            logger.warning("environment %s:%s.%s failed (%s); the trajectory ends, counted in agent/env_error_rate",
                           path, name, method, error)

    def observe(self, t: Trajectory) -> None:
        """Append the finished tool calls' observations (one tool message each) or the environment's
        feedback (one user message), or end (the environment's verdict, the budget)."""
        if t.env_start is not None:  # the environment has started: the trajectory's first turn comes next
            self.environment_started(t)
            return
        if t.env_step is not None:
            self.environment_result(t)
            if t.env_feedback is None:  # the environment ended the trajectory
                return
        if t.env_feedback is not None:
            ids = self.renderer.ids([self.truncate(t.env_feedback)], close_turn=t.turn_open, role="user")
            t.env_feedback = None
        else:
            results: list[ToolResult] = [run.result() for run in t.pending]
            t.pending = []
            t.tool_errors += sum(r.error is not None for r in results)
            ids = self.renderer.ids([self.truncate(r.text) for r in results], close_turn=t.turn_open)
        if len(ids) >= t.remaining:  # no room for the observation and a model token after it
            t.end = END_BUDGET
            return
        t.append(ids, trained=False)

    def truncate(self, text: str) -> str:
        limit = self.settings.max_tool_response_tokens
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit]) + "...(truncated)"

    # ------------------------------------------------------------------ output
    def to_batch(self, trajectories: list[Trajectory], prompts: DataProto, width: int) -> DataProto:
        prompt_part = left_padded([t.prompt for t in trajectories], self.pad_id)
        n = len(trajectories)
        responses = torch.full((n, width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((n, width), dtype=torch.float32)
        response_attention = torch.zeros((n, width), dtype=torch.long)
        rollout_log_probs = torch.zeros((n, width), dtype=torch.float32)
        for i, t in enumerate(trajectories):
            k = len(t.tokens)
            responses[i, :k] = torch.tensor(t.tokens, dtype=torch.long)
            response_mask[i, :k] = torch.tensor(t.mask, dtype=torch.float32)
            response_attention[i, :k] = 1
            rollout_log_probs[i, :k] = torch.tensor(t.log_probs, dtype=torch.float32)
        prompt_ids, prompt_mask = prompt_part.batch["input_ids"], prompt_part.batch["attention_mask"]
        attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
        out = DataProto.from_dict(tensors={
            "prompts": prompt_ids, "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask, "rollout_log_probs": rollout_log_probs,
        }, non_tensors={
            "agent_turns": np.array([t.turns for t in trajectories], dtype=object),
            "agent_tool_calls": np.array([t.tool_calls for t in trajectories], dtype=object),
            "agent_tool_errors": np.array([t.tool_errors for t in trajectories], dtype=object),
            "agent_end": np.array([t.end for t in trajectories], dtype=object),
            "agent_calls_by_tool": object_array([dict(t.calls_by_tool) for t in trajectories]),
            "agent_env_errors": np.array([t.env_errors for t in trajectories], dtype=object),
            # the environment's rewards: per model turn (for estimators that use them) and their sum
            "agent_turn_rewards": object_array([list(t.turn_rewards) for t in trajectories]),
            "agent_env_reward": np.array([float(sum(t.turn_rewards)) for t in trajectories], dtype=object),
            "agent_turn_reward_positions": object_array([list(t.turn_reward_positions) for t in trajectories]),
        })
        out.meta_info["agent/engine_calls"] = self.engine_calls
        return out


def object_array(values: list) -> np.ndarray:
    """A 1-D object array of arbitrary values (lists stay lists, whatever their lengths)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def left_padded(sequences: list[list[int]], pad_id: int) -> DataProto:
    """Token lists as a left-padded prompt batch (input_ids, attention_mask, position_ids)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0)})


def agent_loop_for(engine, settings, eos_and_pad_ids) -> AgentLoop:
    """The engine's agent loop, built once (tools imported, tokenizer loaded) and kept on the engine.

    `settings`: RolloutSettings with `multi_turn` set; `eos_and_pad_ids`: rollout.base's (passed in, so
    that this module does not import base, which imports it)."""
    loop = getattr(engine, "_agent_loop", None)
    if loop is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(settings.model_path, trust_remote_code=settings.trust_remote_code)
        loop = AgentLoop(engine, settings.multi_turn, tokenizer)
        loop.eos_ids = set(eos_and_pad_ids(settings.model_path, settings.trust_remote_code)[0])
        engine._agent_loop = loop
    return loop
