"""The `rollout:` section (the generation engines, multi-turn tool use, partial rollouts) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlframe.bounds import bounded, one_of
from rlframe.config.checks import RUN_USER_CODE

ENGINES = ("auto", "vllm", "hf")
TURN_REWARDS = ("final", "per_turn")
AGENT_ROWS = ("merged", "per_call")


@dataclass
class ToolConfig:
    # a Python file defining the function; its schema is the file's (TOOL_SCHEMAS, SCHEMA, TOOLS, a `schema`
    # attribute) or derived from the function's type hints and docstring (workers/rollout/tool_schemas.py)
    path: str = "tools/calculator.py"
    name: str = "calculator"  # the function in that file the model calls (also the tool's name it sees)


@dataclass
class McpServerConfig:
    """An MCP server whose tools the model may call (workers/rollout/mcp_tools.py): a `command` rlframe starts and
    talks to over stdio (stopped at the end), or the `url` of a running streamable-HTTP server."""

    command: str = ""  # e.g. python (the interpreter rlframe runs in), npx, uvx
    args: list[str] = field(default_factory=list)  # relative paths of files resolve like tool paths
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables (added to the MCP SDK's default)
    url: str = ""  # e.g. http://127.0.0.1:8931/mcp
    name: str = ""  # what errors call it; "" = the script's, command's or url's name
    tools: list[str] = field(default_factory=list)  # its tools the model gets; [] = every tool it lists
    prefix: str = ""  # the model sees each tool as prefix + name (two servers with the same tool names)
    startup_timeout_s: float = bounded(30.0, "> 0")  # to start and list its tools
    # true: the server inherits rlframe's whole environment (HF/W&B/cloud keys included); false: the MCP SDK's
    # default environment (HOME, LOGNAME, PATH, SHELL, TERM, USER) plus `env`
    inherit_env: bool = False


@dataclass
class EnvironmentConfig:
    # "" = no environment; else a Python file defining the class: our reset(row) / step(text) form, or a
    # gymnasium.Env with text observations and actions (workers/rollout/gym_environment.py)
    path: str = ""
    name: str = ""  # the environment class in that file


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (workers/rollout/agent_loop.py): model turns alternate with tool
    turns until an answer (a turn without a tool call), `max_turns` model turns, or the response budget
    (data.max_response_length, model + tool tokens). Tool tokens are context, never trained on."""

    # multi-turn rollouts (also turned on by naming rollout.agent.tools / mcp_servers / environment)
    enable: bool = False
    # No default tool: name each one (an environment alone needs none)
    tools: list[ToolConfig] = field(default_factory=list)
    # MCP servers whose tools join `tools` (listed and checked before any worker starts)
    mcp_servers: list[McpServerConfig] = field(default_factory=list)
    max_turns: int = bounded(3, ">= 1")  # model turns per rollout at most
    max_tokens_per_turn: int = bounded(0, ">= 0", "0: no cap")  # a model turn's cap (0: the remaining budget); a cut turn is still parsed
    max_tool_response_tokens: int = bounded(64, ">= 1")  # an observation is cut to this many tokens
    tool_timeout_s: float = bounded(5.0, "> 0")  # a call that takes longer becomes a timeout error the model sees
    format: str = "hermes"  # tool-call parser: hermes (<tool_call>{json}</tool_call>) | tag (<name>text</name>)
    #                         | path/to/parser.py:function (text, tools) -> list[ToolCall]
    tool_prompt: bool = True  # a system message describing the tools, in front of each prompt
    tool_prompt_tokens: int = bounded(256, ">= 0")  # room for it in the engine's max_model_len
    # An environment (class with reset(row) and step(model_text) -> (observation, reward, done)) judges
    # each model turn without a tool call: its observation becomes the next user message; the sum of its
    # rewards is added to the score (outcome reward on the last model token).
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    # where the environment's per-turn rewards go: final (their sum on the last model token, with the outcome
    # reward) | per_turn (each on the last token of the turn it judged; same total, so grpo/rloo see no change,
    # gae and reinforce_plus_plus with gamma < 1 credit each turn, and grpo_turn with turn_gamma < 1)
    turn_rewards: str = "final"


@dataclass
class PartialRolloutConfig:
    """Partial rollouts (rlframe/trainer/partial.py): each generation call gives a response at most
    max_tokens_per_round new tokens; a response not finished then is held back and continued, from its
    prompt + partial tokens, by a later call -- after a weight sync, with newer weights. Every token records
    the policy version that produced it (token_policy_version) beside its log-prob, so the off-policy
    correction (TIS) weighs each token against the weights that sampled it. A step trains
    data.train_batch_size prompt groups whose n samples have all finished (the oldest first); a step
    generates one round, more only while fewer groups than that have finished."""

    enable: bool = False  # partial rollouts (see the section's description)
    # New tokens per response per generation call; 0: ceil(data.max_response_length / span), where span =
    # max_token_staleness - trainer.max_staleness (0 when synchronous) + 1 is the steps a response may take.
    max_tokens_per_round: int = bounded(0, ">= 0", "0: the smallest budget the staleness bound allows")
    # A group is trained only while every token is at most this many policy versions behind the trainer;
    # older held-back groups are restarted from their prompt (partial/restarted_groups). >= max_staleness + 1.
    max_token_staleness: int = bounded(2, ">= 1")
    # Prompt batches kept in flight beyond the one a step trains (over-sampling): the held-back pool.
    oversample_batches: int = bounded(1, ">= 1", "a step trains one batch of finished groups; at least one more must be "
                                                "in flight to hold responses back")


@dataclass
class AgentProgramConfig:
    """Bring your own agent (workers/rollout/agent_program.py, docs/gateway.md): each sample runs the user's agent
    once, in its own process, with OPENAI_BASE_URL pointing at an OpenAI-compatible endpoint over this rank's
    engine (workers/rollout/gateway.py) and a per-episode OPENAI_API_KEY. Every call is recorded token in, token
    out; an episode's calls become its training row (`rows`). Set `path` + `name` (a function name(row) in a
    Python file) or `command` (the row as JSON on stdin, the answer on stdout); empty: off."""

    path: str = ""  # a Python file defining the agent function
    name: str = ""  # the function: name(row: dict) -> answer text | {"answer": ..., "reward": ...}
    command: str = ""  # or a shell command: the row as JSON on stdin, the answer (text or that dict as JSON) on stdout
    # merged: one row per episode, the calls chained (each call's prompt extends the previous call's prompt +
    # completion; the in-between tokens are context); needs an append-only chat template (checked on the model folder).
    rows: str = one_of("merged", AGENT_ROWS)
    max_concurrent_episodes: int = bounded(8, ">= 1")  # agent processes alive at once on each engine's rank
    episode_timeout_s: float = bounded(120.0, "> 0")  # an episode still running then is killed (a failed episode)
    max_tokens_per_call: int = bounded(0, ">= 0", "0: the episode's remaining budget")  # cap on a call's max_tokens
    tool_format: str = "hermes"  # tool-call parser for `tools` requests (as rollout.multi_turn.format)
    prompt_tokens: int = bounded(512, ">= 0")  # room for the agent's own prompt (system message, tools) in max_model_len
    host: str = "127.0.0.1"  # the endpoint's address (loopback: only this machine's agents reach it)
    allow_remote: bool = False  # true: a non-loopback host is allowed (plain HTTP to the network; a trusted one only)
    # The gateway's limits (docs/gateway.md, "What is checked"): a request's body; the time a request may take to
    # arrive (a slower one gets 408, an idle connection is closed); connections open at once (one more: 503); an
    # episode's calls and its prompt + completion tokens over all its calls (429 past either).
    max_body_bytes: int = bounded(4 << 20, "[1024, 268435456]")  # a request body larger than this is refused unread (413)
    read_timeout_s: float = bounded(10.0, "> 0")  # seconds for a request to arrive (408 after)
    max_connections: int = bounded(64, ">= 1")  # connections open at once (one more: 503)
    max_calls_per_episode: int = bounded(128, ">= 1")  # an episode's calls (429 past it)
    max_episode_tokens: int = bounded(0, ">= 0", "0: 32 x rollout.max_model_len")  # an episode's prompt + completion tokens over all its calls (429 past it)
    # false: training samples at rollout.temperature/top_p/top_k whatever the agent asks (the trainer scores tokens at
    # that temperature); true: the request's temperature/top_p are used (rollout/logprob_abs_diff then measures that)
    sampling_from_request: bool = False
    # true: the agent inherits rlframe's whole environment; false: an allow-list (workers/rollout/agent_program.py
    # AGENT_ENV_ALLOW) plus the gateway's OPENAI_BASE_URL / OPENAI_API_KEY
    inherit_env: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.command)


@dataclass
class RolloutConfig:
    engine: str = one_of("auto", ENGINES)  # auto (vllm when installed, else hf) | vllm | hf
    n: int = bounded(4, ">= 1")  # samples per prompt
    temperature: float = bounded(1.0, ">= 0", "0: greedy")  # sampling temperature of the training rollouts
    # nucleus sampling: sample from the smallest set of tokens holding this probability (1: off)
    top_p: float = bounded(1.0, "(0, 1]")
    top_k: int = bounded(-1, ">= -1", "-1 or 0: off")  # sample from the k most likely tokens only
    val_temperature: float = bounded(0.0, ">= 0", "0: greedy validation")  # sampling temperature of validation
    # Seed every training sample's sampling from (trainer.seed, step, prompt uid, sample index), so that a
    # resumed run samples the same tokens with vLLM (whose engine RNG is not checkpointed) as without
    # the interruption. Costs vLLM a per-request generator in its sampler (small on CPU; on GPU at
    # thousands of concurrent requests, turn it off if exact resume does not matter to you).
    seed_each_sample: bool = True
    # GPU: the share of device memory vLLM may take (weights + KV cache), colocated with the trainer
    gpu_memory_utilization: float = bounded(0.4, "(0, 1]")
    # vLLM CPU KV cache, at most (fractions allowed; pages released between generations): an engine whose 256
    # full-length sequences need less takes only that (a tiny model a few MiB, so it starts seconds sooner)
    cpu_kv_cache_gib: float = bounded(1.0, "> 0")
    # vLLM reuses the KV cache of shared prompt prefixes (the n samples of a prompt); reset after every weight sync
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True  # GPU only: CPU generators cannot rewind after a partial prefill
    max_num_batched_tokens: int = bounded(4096, ">= 1")  # vLLM: tokens per scheduler step (prefill chunk size)
    enable_sleep_mode: bool = True  # GPU only: free engine memory while the trainer trains
    # vLLM: no CUDA graphs (faster start, slower decoding on GPU; CUDA graphs do not exist on CPU)
    enforce_eager: bool = True
    # vLLM's limit_mm_per_prompt for a vision-language model: the most images / videos one prompt may hold
    # (vLLM sizes its multimodal encoder budget by them); rows with more fail in vLLM
    limit_images_per_prompt: int = bounded(4, ">= 0")
    limit_videos_per_prompt: int = bounded(1, ">= 0")  # (see limit_images_per_prompt)
    # Disaggregated placement (trainer.placement=disaggregated): data-parallel engines on their own
    # devices; default actor.world_size. Weights reach them by a bucketed broadcast after each update.
    world_size: Optional[int] = bounded(None, ">= 1")
    weight_bucket_mb: int = bounded(64, ">= 1")  # bucket size of that broadcast
    # Tensor-parallel vLLM: each engine spans this many consecutive ranks (colocated: of the actor's
    # world; disaggregated: of rollout.world_size), for policies too large for one device's engine.
    tensor_parallel_size: int = bounded(1, ">= 1")
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # `rollout.agent` is another name for `rollout.multi_turn` (read into it by rlframe.main before validation)
    agent: Optional[dict[str, Any]] = None
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    agent_program: AgentProgramConfig = field(default_factory=AgentProgramConfig)  # bring your own agent (off)


def partial_tokens_per_round(cfg) -> int:
    """rollout.partial.max_tokens_per_round with 0 resolved: the smallest budget with which a full-length response
    finishes within the steps the token staleness bound allows (ceil(max_response_length / span))."""
    chosen = cfg.rollout.partial.max_tokens_per_round
    return chosen if chosen > 0 else -(-cfg.data.max_response_length // partial_span_steps(cfg))


def partial_span_steps(cfg) -> int:
    """The steps a held-back response may span before its first tokens are too stale to train (>= 1)."""
    depth = cfg.trainer.max_staleness if cfg.trainer.async_rollout else 0
    return max(1, cfg.rollout.partial.max_token_staleness - depth + 1)


# ------------------------------------------------------------------------------------ checks


def tensor_parallel_divides_engine_ranks(cfg, need) -> None:
    """A tensor-parallel engine spans rollout.tensor_parallel_size consecutive ranks of the engines' ranks."""
    rollout, actor, colocated = cfg.rollout, cfg.actor, cfg.trainer.placement == "colocated"
    tp = rollout.tensor_parallel_size
    engine_ranks = actor.world_size if colocated else (rollout.world_size or actor.world_size)
    need(tp < 1 or engine_ranks < 1 or engine_ranks % tp == 0, "rollout.tensor_parallel_size",  # (< 1: bounds)
         f"{tp} must be >= 1 and divide the {engine_ranks} ranks that run rollout engines "
         f"({'actor.world_size' if colocated else 'rollout.world_size'}). Fix: a divisor of it")


def tensor_parallel_supported(cfg, need) -> None:
    """What a tensor-parallel engine does not run: the HF engine, multi-turn rollouts, adapter-only weight sync."""
    rollout, lora = cfg.rollout, cfg.model.lora
    tp = rollout.tensor_parallel_size
    need(tp == 1 or rollout.engine != "hf", "rollout.tensor_parallel_size",
         "the HF generate engine has no tensor parallelism. Fix: rollout.engine=vllm (or auto)")
    need(tp == 1 or not rollout.multi_turn.enable, "rollout.tensor_parallel_size",
         "multi-turn rollouts schedule turns as tools return, which differs between ranks; the ranks of a "
         "tensor-parallel engine must submit identical requests. Fix: rollout.tensor_parallel_size=1")
    need(tp == 1 or lora.weight_sync != "adapter" or lora.rank == 0, "rollout.tensor_parallel_size",
         "adapter-only weight sync is not wired for tensor-parallel engines. Fix: model.lora.weight_sync=merged")


def world_size_fits_placement(cfg, need) -> None:
    """rollout.world_size: >= 1; in colocated placement the actor's (the engines share its devices)."""
    rw = cfg.rollout.world_size
    need(rw is None or cfg.trainer.placement == "disaggregated" or rw == cfg.actor.world_size, "rollout.world_size",
         "in colocated placement the engines share the actor's devices (rollout.world_size = actor.world_size). "
         "Fix: drop rollout.world_size, or trainer.placement=disaggregated")



def turn_rewards_known(cfg, need) -> None:
    mt = cfg.rollout.multi_turn
    need(mt.turn_rewards in TURN_REWARDS, "rollout.multi_turn.turn_rewards",
         f"'{mt.turn_rewards}' is not final or per_turn. Fix: rollout.multi_turn.turn_rewards=per_turn")


def multi_turn_one_rank_per_engine(cfg, need) -> None:
    # tensor-parallel engine ranks must submit identical requests in the same order; the agent loop's
    # turns depend on when tools return, which differs between ranks
    tp = cfg.rollout.tensor_parallel_size
    need(not cfg.rollout.multi_turn.enable or tp == 1, "rollout.multi_turn.enable",
         f"multi-turn rollouts need rollout.tensor_parallel_size=1 (got {tp}). "
         "Fix: rollout.tensor_parallel_size=1 (data-parallel engines instead)")


def multi_turn_files_load(cfg, need) -> None:
    """The tool-call parser, and every tool and environment file / function / schema (imported here, in
    the driver, before any worker)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    from rlframe.workers.rollout.tools import ToolLoadError, get_parser, load_environment, load_tool

    try:
        get_parser(mt.format)
    except ToolLoadError as error:
        need(False, "rollout.multi_turn.format", str(error))
    need(bool(mt.tools) or bool(mt.environment.path) or bool(mt.mcp_servers), "rollout.multi_turn.tools",
         "no tool and no environment. Fix: rollout.multi_turn.tools=[{path: tools/calculator.py, name: calculator}]")
    imports = RUN_USER_CODE.get()  # off (the board's Preview): the files are read with ast, not imported
    if mt.environment.path:
        try:
            (load_environment if imports else defined_in_file)(mt.environment.path, mt.environment.name)
        except ToolLoadError as error:
            need(False, "rollout.multi_turn.environment", str(error))
    names = {}
    for i, tool in enumerate(mt.tools):
        try:
            (load_tool if imports else defined_in_file)(tool.path, tool.name)
            names[tool.name] = f"rollout.multi_turn.tools[{i}]"
        except ToolLoadError as error:
            need(False, f"rollout.multi_turn.tools[{i}]", str(error))
    mcp_servers_list_their_tools(mt, need, names)


def mcp_url_problem(url: str) -> str | None:
    """An MCP url must be https://, or http:// to a loopback host (as the MCP SDK's guidance: no plain HTTP
    across a network); None when fine."""
    import ipaddress
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return f"'{url}' is not an http(s) url. Fix: e.g. https://tools.example.com/mcp or http://127.0.0.1:8931/mcp"
    if parsed.scheme == "https":
        return None
    host = parsed.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost" or host.endswith(".localhost")
    if loopback:
        return None
    return (f"'{url}' is plain http to {host}, which is not this machine: tool calls and results would cross the "
            "network unencrypted and unauthenticated. Fix: https://" + url[len("http://"):] +
            " (or a loopback address: http://127.0.0.1:PORT/mcp)")


def mcp_servers_list_their_tools(mt, need, names: dict[str, str]) -> None:
    """Each MCP server: a command or a url (http/https), started (or reached) here, its tools listed and their
    schemas checked, no tool name twice; stopped again (each rollout worker starts its own)."""
    from rlframe.workers.rollout.mcp_tools import mcp_server_settings, start_mcp_tools
    from rlframe.workers.rollout.tools import ToolLoadError

    for i, server in enumerate(mt.mcp_servers):
        key = f"rollout.multi_turn.mcp_servers[{i}]"
        if bool(server.command) == bool(server.url):
            need(False, key, "give exactly one of command (a server rlframe starts over stdio) and url (a running "
                 "streamable-HTTP server). Fix: {command: python, args: [my_server.py]} or {url: http://127.0.0.1:8931/mcp}")
            continue
        problem = server.url and mcp_url_problem(server.url)
        if problem:
            need(False, f"{key}.url", problem)
            continue
        if not RUN_USER_CODE.get():  # the board's Preview: checked as written, not started
            continue
        try:
            servers, tools = start_mcp_tools([mcp_server_settings(server)], names, timeout_s=1.0)
        except ToolLoadError as error:
            need(False, key, str(error))
            continue
        for started in servers:
            started.close()
        names.update({name: key for name in tools})


def defined_in_file(path: str, name: str) -> None:
    """The tool / environment file exists and defines `name` at its top level (read with ast, not run);
    ToolLoadError otherwise."""
    import ast

    from rlframe.workers.rollout.tools import ToolLoadError, resolve_tool_path

    file = resolve_tool_path(path)
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (OSError, UnicodeDecodeError, SyntaxError) as error:
        raise ToolLoadError(f"{path} cannot be read as Python ({error}). Fix: point the path at the Python file "
                            "that defines it") from None
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    defined += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    defined += [(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names]
    if name not in defined:
        raise ToolLoadError(f"{path} defines no '{name}' (it defines: {', '.join(defined) or 'none'})")


def tag_format_tools_take_one_argument(cfg, need) -> None:
    """`format: tag` passes a call's text as one argument: a tool that requires more is refused here."""
    mt = cfg.rollout.multi_turn
    if not mt.enable or mt.format != "tag" or not RUN_USER_CODE.get():
        return
    from rlframe.workers.rollout.tools import ToolLoadError, format_problem, load_tool

    for i, tool in enumerate(mt.tools):
        try:
            problem = format_problem(load_tool(tool.path, tool.name), mt.format)
        except ToolLoadError:
            continue  # reported by multi_turn_files_load
        need(problem is None, f"rollout.multi_turn.tools[{i}]", problem or "")


def partial_can_continue(cfg, need) -> None:
    """What partial rollouts cannot continue: continuing a response means sending prompt + partial tokens back
    to the engine as a prompt. vLLM and HF generate take token ids; the multi-turn agent loop's turns (tool
    calls, observations) cannot be resumed mid-turn, and dynamic sampling / a greedy baseline (ReMax) need
    every sample of the step from the step's own weights."""
    if not cfg.rollout.partial.enable:
        return
    from rlframe.config.algorithm import run_estimator_needs

    key, algo = "rollout.partial.enable", cfg.algorithm
    need(not cfg.rollout.multi_turn.enable, key,
         "the multi-turn agent loop cannot resume a response cut mid-turn (its tool calls and observations are not "
         "token-in, token-out). Fix: rollout.partial.enable=false, or rollout.multi_turn.enable=false")
    need(not algo.dynamic_sampling.enable, key,
         "dynamic sampling regenerates until the groups' rewards differ, from the step's own weights; held-back "
         "groups would mix in. Fix: rollout.partial.enable=false, or algorithm.dynamic_sampling.enable=false")
    need(not run_estimator_needs(cfg).greedy_baseline, key,
         "ReMax's greedy baseline must come from the weights that sampled the whole response. Fix: another "
         "estimator (grpo, rloo), or rollout.partial.enable=false")
    need(cfg.data.source not in ("shapes", "tones"), key,
         "responses to image/audio prompts are not continued (the engine would need the pixels or audio features again). "
         "Fix: rollout.partial.enable=false")


def partial_staleness_bounds(cfg, need) -> None:
    """At most one generation in flight; the token staleness bound above what fresh tokens already have; a
    budget with which a full-length response finishes within that bound."""
    partial, t = cfg.rollout.partial, cfg.trainer
    if not partial.enable:
        return
    key = "rollout.partial.enable"
    depth = t.max_staleness if t.async_rollout else 0
    need(depth <= 1, key,
         f"partial rollouts continue held-back responses in the next generation, so at most one generation may be in "
         f"flight (trainer.max_staleness={depth} sends {depth}). Fix: trainer.max_staleness=1, or "
         "rollout.partial.enable=false")
    need(partial.max_token_staleness >= depth + 1, "rollout.partial.max_token_staleness",
         f"{partial.max_token_staleness}: fresh tokens are already {depth} version(s) behind when trained "
         f"(trainer.max_staleness={depth if t.async_rollout else '0, synchronous'}); a held-back token is at least one "
         f"more. Fix: rollout.partial.max_token_staleness={depth + 1} or more")
    budget, length, steps = partial_tokens_per_round(cfg), cfg.data.max_response_length, partial_span_steps(cfg)
    need(budget * steps >= length, "rollout.partial.max_tokens_per_round",
         f"{budget} tokens per round x {steps} step(s) (the span rollout.partial.max_token_staleness="
         f"{partial.max_token_staleness} allows) < data.max_response_length={length}: a full-length response would be "
         f"restarted forever. Fix: rollout.partial.max_tokens_per_round={-(-length // steps)} or more (0 picks it), or "
         "raise rollout.partial.max_token_staleness")


def agent_program_well_formed(cfg, need) -> None:
    """rollout.agent_program: a function (path + name, defined in the file) or a command, not both; merged or
    per_call rows; not with the built-in agent loop, partial rollouts or a tensor-parallel engine; a loopback host
    unless allow_remote."""
    ap, key = cfg.rollout.agent_program, "rollout.agent_program"
    if not ap.enabled:
        return
    need(not (ap.path and ap.command), key, "both path and command are set. Fix: one of them")
    need(bool(ap.command) or bool(ap.name), f"{key}.name", f"no function named for {ap.path}. Fix: "
         f"rollout.agent_program.name=<the function name(row) in {ap.path}>")
    need(ap.rows != "per_call", f"{key}.rows", "per_call (one training row per call) needs the driver to repeat an "
         "episode's prompt row per call, which is not wired yet. Fix: rollout.agent_program.rows=merged")
    need(not cfg.rollout.multi_turn.enable, key, "the built-in agent loop (rollout.multi_turn.enable) and an agent "
         "program both drive the rollout. Fix: rollout.multi_turn.enable=false")
    need(not cfg.rollout.partial.enable, key, "partial rollouts cannot resume an agent's episode. "
         "Fix: rollout.partial.enable=false")
    need(cfg.rollout.tensor_parallel_size == 1, key, "episodes are scheduled as the agents call, which differs "
         "between the ranks of a tensor-parallel engine. Fix: rollout.tensor_parallel_size=1")
    if ap.path:
        from rlframe.workers.rollout.episode_files import agent_function_problem

        problem = agent_function_problem(ap.path, ap.name)
        need(problem is None, f"{key}.path", problem or "")
    from rlframe.workers.rollout.gateway import host_problem

    problem = host_problem(ap.host, ap.allow_remote)
    need(problem is None, f"{key}.host", problem or "")
    from rlframe.workers.rollout.tools import ToolLoadError, get_parser

    try:
        get_parser(ap.tool_format)
    except ToolLoadError as error:
        need(False, f"{key}.tool_format", str(error))


CHECKS = (tensor_parallel_divides_engine_ranks, tensor_parallel_supported, world_size_fits_placement,
          turn_rewards_known, multi_turn_one_rank_per_engine, multi_turn_files_load, tag_format_tools_take_one_argument,
          partial_can_continue, partial_staleness_bounds, agent_program_well_formed)


# ---------------------------------------------------------------------- checks on the model folder
def partial_policy_is_text_only(cfg, need, model_dir: str | None) -> None:
    """Partial rollouts of an RL run refuse a vision-language policy (its responses are not continued)."""
    if not cfg.rollout.partial.enable or cfg.stage != "rl" or model_dir is None:
        return
    from rlframe.workers.engine.hf_model import is_vision_language

    need(not is_vision_language(model_dir, cfg.model.trust_remote_code), "rollout.partial.enable",
         f"{model_dir} is a vision-language model; responses to image prompts are not continued (the engine would "
         "need the pixels and 3-D positions again). Fix: rollout.partial.enable=false")


def agent_rows_merge_on_template(cfg, need, model_dir: str | None) -> None:
    """rollout.agent_program.rows=merged chains an episode's calls into one row: the model's chat template must only
    append messages (rendering a conversation one message longer keeps the shorter rendering as its prefix)."""
    ap = cfg.rollout.agent_program
    if not ap.enabled or ap.rows != "merged" or model_dir is None:
        return
    from rlframe.workers.rollout.episode_files import template_rewrites

    problem = template_rewrites(model_dir, cfg.model.trust_remote_code)
    need(problem is None, "rollout.agent_program.rows", f"merged rows need an append-only chat template: {problem}. "
         "Fix: a template that does not rewrite earlier turns (tokenizer.chat_template in the model folder)")


FOLDER_CHECKS = (partial_policy_is_text_only, agent_rows_merge_on_template)
