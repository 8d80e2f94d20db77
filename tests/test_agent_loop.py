"""The multi-turn agent loop (workers/rollout/agent_loop.py): token layout, masks, limits, tool failures,
concurrency (scripted engine double: the loop itself is real), the real HF engine on the tiny model,
config validation, and a 2-step end-to-end run whose trainer log-probs match the engine's."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers_tokenizer import build_tokenizer
from rlframe.protocol import DataProto
from rlframe.trainer.agent_metrics import agent_metrics
from rlframe.workers.rollout.agent_loop import END_ANSWER, END_BUDGET, END_TURN_LIMIT, AgentLoop, ObservationRenderer
from rlframe.protocol import build_rollout_batch
from rlframe.workers.rollout.base import unpadded_prompts
from rlframe.workers.rollout.tools import ToolLoadError, load_tool, parse_hermes
from rlframe.workers.settings import MultiTurnSettings, SamplingSettings

TESTS = Path(__file__).parent
TOOLS = str(TESTS / "agent_tools.py")
CALC = str(TESTS.parent / "tools" / "calculator.py")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class ScriptedEngine:
    """A rollout-engine double: each prompt (keyed by its first 3 tokens) has a list of turns; turn k is
    returned when the sequence already holds k observations. Log-prob of every emitted token: -0.5.
    Records (time, keys) of every generate call."""

    def __init__(self, tok, scripts: dict[tuple, list[list[int]]], delay_s: float = 0.0):
        self.tok, self.scripts, self.delay_s = tok, scripts, delay_s
        self.eos_token_ids, self.pad_token_id = [tok.eos_token_id], tok.pad_token_id
        self.calls, self.base = [], {}

    def generate(self, prompts: DataProto, sampling: SamplingSettings) -> DataProto:
        time.sleep(self.delay_s)
        sequences = unpadded_prompts(prompts)
        keys = [tuple(s[:3]) for s in sequences]
        self.calls.append((time.monotonic(), keys))
        out = []
        start = self.tok.convert_tokens_to_ids("<|im_start|>")
        for seq, key in zip(sequences, keys):
            # each observation adds two messages (tool, assistant header): count them past the prompt's own
            base = self.base.setdefault(key, seq.count(start))
            turn = (seq.count(start) - base) // 2
            out.append(self.scripts[key][turn][: sampling.max_new_tokens])
        return build_rollout_batch(prompts, out, [[-0.5] * len(t) for t in out], sampling.max_new_tokens,
                                   self.pad_token_id)


def ids(tok, text: str, eos: bool = True) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])


def prompt_batch(tok, prompts: list[list[int]]) -> DataProto:
    from rlframe.workers.rollout.agent_loop import left_padded

    return left_padded(prompts, tok.pad_token_id)


def make_loop(engine, tok, tool_names=("echo",), path=TOOLS, **settings) -> AgentLoop:
    settings.setdefault("tool_prompt", False)
    mt = MultiTurnSettings(tools=tuple((path, n) for n in tool_names), **settings)
    return AgentLoop(engine, mt, tok)


SAMPLING = SamplingSettings(max_new_tokens=128, temperature=1.0)


def test_three_turn_trajectory_layout_and_mask(tok):
    prompt = ids(tok, "<|im_start|>user\nWhat is 2+3 times 4?", eos=False)
    turn1 = ids(tok, "<calculator>2+3</calculator>")
    turn2 = ids(tok, "<calculator>5*4</calculator>")
    turn3 = ids(tok, "The answer is \\boxed{20}")
    engine = ScriptedEngine(tok, {tuple(prompt[:3]): [turn1, turn2, turn3]})
    loop = make_loop(engine, tok, ("calculator",), path=CALC, format="tag", max_turns=5)
    out = loop.run(prompt_batch(tok, [prompt]), SAMPLING)

    renderer = ObservationRenderer(tok)
    assert renderer.text(["5"]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    obs1, obs2 = ids(tok, renderer.text(["5"]), eos=False), ids(tok, renderer.text(["20"]), eos=False)
    expected = turn1 + obs1 + turn2 + obs2 + turn3
    mask = [1] * len(turn1) + [0] * len(obs1) + [1] * len(turn2) + [0] * len(obs2) + [1] * len(turn3)
    n = len(expected)
    assert out.batch["responses"][0, :n].tolist() == expected
    assert out.batch["response_mask"][0, :n].tolist() == mask and out.batch["response_mask"][0, n:].sum() == 0
    assert out.batch["attention_mask"][0, -128:].sum() == n  # tool tokens are attended to
    lps = out.batch["rollout_log_probs"][0, :n]
    assert torch.all(lps[torch.tensor(mask) == 1] == -0.5) and torch.all(lps[torch.tensor(mask) == 0] == 0)
    assert out.batch["prompts"][0, -len(prompt):].tolist() == prompt
    assert out.non_tensor_batch["agent_end"][0] == END_ANSWER
    assert out.non_tensor_batch["agent_turns"][0] == 3 and out.non_tensor_batch["agent_tool_calls"][0] == 2
    assert out.non_tensor_batch["agent_tool_errors"][0] == 0
    # the full row is what the chat template renders for the whole conversation
    full = tok.decode(prompt + expected)
    assert "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n<calculator>5*4" in full


def test_model_tokens_are_never_retokenized(tok):
    """A model turn sampled as characters (' ', 'a', 'ns', 'wer') that the tokenizer would merge
    (' answer') stays as sampled across turns."""
    prompt = ids(tok, "<|im_start|>user\nq", eos=False)
    odd = [tok.convert_tokens_to_ids(t) for t in ["Ġ", "a", "ns", "wer"]] if "Ġ" in tok.get_vocab() else None
    if odd is None or tok.unk_token_id in odd:
        odd = ids(tok, " ", eos=False) + ids(tok, "a", eos=False) + ids(tok, "ns", eos=False) + ids(tok, "wer", eos=False)
    turn1 = odd + ids(tok, "<echo>hi</echo>")
    turn2 = odd + [tok.eos_token_id]
    assert tok(tok.decode(odd), add_special_tokens=False)["input_ids"] != odd  # a round trip would change them
    engine = ScriptedEngine(tok, {tuple(prompt[:3]): [turn1, turn2]})
    out = make_loop(engine, tok, ("echo",), format="tag").run(prompt_batch(tok, [prompt]), SAMPLING)
    row = out.batch["responses"][0].tolist()
    assert row[: len(turn1)] == turn1
    obs = ids(tok, ObservationRenderer(tok).text(["echo:hi"]), eos=False)
    assert row[len(turn1): len(turn1) + len(obs)] == obs
    assert row[len(turn1) + len(obs): len(turn1) + len(obs) + len(turn2)] == turn2
    # and the engine saw exactly those ids as context for turn 2
    assert engine.calls and len(engine.calls) == 2


def test_turn_limit_and_budget(tok):
    p1, p2 = ids(tok, "<|im_start|>user\nA", eos=False), ids(tok, "<|im_start|>user\nB", eos=False)
    call = ids(tok, "<echo>again</echo>")
    engine = ScriptedEngine(tok, {tuple(p1[:3]): [call] * 10, tuple(p2[:3]): [call] * 10})
    out = make_loop(engine, tok, format="tag", max_turns=2).run(prompt_batch(tok, [p1, p2]), SAMPLING)
    assert list(out.non_tensor_batch["agent_end"]) == [END_TURN_LIMIT] * 2
    assert list(out.non_tensor_batch["agent_turns"]) == [2, 2]
    assert list(out.non_tensor_batch["agent_tool_calls"]) == [1, 1]  # the limit turn's call is not run
    # a budget of 40 tokens: the trajectory stops when the next model turn or observation does not fit
    budget = SamplingSettings(max_new_tokens=40)
    out = make_loop(engine, tok, format="tag", max_turns=10).run(prompt_batch(tok, [p1]), budget)
    assert out.non_tensor_batch["agent_end"][0] == END_BUDGET
    assert out.batch["responses"].shape[1] == 40 and out.batch["attention_mask"][0, -40:].sum() <= 40
    assert out.batch["response_mask"][0].sum() > 0


def test_tool_errors_become_observations(tok):
    prompt = ids(tok, "<|im_start|>user\nq", eos=False)
    answer = ids(tok, "done")
    cases = {"boom": ids(tok, "<boom>x</boom>"), "hang": ids(tok, "<hang>x</hang>"),
             "unclosed": ids(tok, "<echo>x"), "unknown": ids(tok, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
             "badjson": ids(tok, "<tool_call>{not json</tool_call>")}
    for case, turn in cases.items():
        engine = ScriptedEngine(tok, {tuple(prompt[:3]): [turn, answer]})
        fmt = "hermes" if case in ("unknown", "badjson") else "tag"
        loop = make_loop(engine, tok, ("echo", "boom", "hang"), format=fmt, tool_timeout_s=0.5)
        start = time.monotonic()
        out = loop.run(prompt_batch(tok, [prompt]), SamplingSettings(max_new_tokens=256))
        assert time.monotonic() - start < 5, case  # a hanging tool does not hang the rollout
        nt = out.non_tensor_batch
        assert nt["agent_tool_errors"][0] == 1 and nt["agent_end"][0] == END_ANSWER, case
        text = tok.decode(out.batch["responses"][0][out.batch["attention_mask"][0, -256:].bool()].tolist())
        expected = {"boom": "Error: RuntimeError: the tool broke", "hang": "timed out after 0.5 s",
                    "unclosed": "without a closing", "unknown": "unknown tool 'nope'", "badjson": "not valid JSON"}[case]
        assert expected in text, (case, text)
    metrics = agent_metrics(nt, out.batch["response_mask"], out.batch["attention_mask"])
    assert metrics["agent/tool_error_rate"] == 1.0 and metrics["agent/end_answer"] == 1.0
    assert metrics["agent/context_tokens_mean"] > 0
    assert metrics["agent/tool_calls/(malformed)"] == 1.0  # the last case (bad JSON): one malformed call


def test_slow_tool_does_not_block_other_trajectories(tok):
    """Trajectory A calls a 1.5 s tool; B makes three fast calls and answers while A's tool still runs."""
    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    assert pa[:3] != pb[:3]
    engine = ScriptedEngine(tok, {tuple(pa[:3]): [ids(tok, "<slow>x</slow>"), ids(tok, "ok")],
                                  tuple(pb[:3]): [ids(tok, "<echo>1</echo>")] * 3 + [ids(tok, "ok")]}, delay_s=0.05)
    loop = make_loop(engine, tok, ("echo", "slow"), format="tag", max_turns=5)
    start = time.monotonic()
    out = loop.run(prompt_batch(tok, [pa, pb]), SAMPLING)
    total = time.monotonic() - start
    b_calls = [t - start for t, keys in engine.calls if tuple(pb[:3]) in keys]
    a_calls = [t - start for t, keys in engine.calls if tuple(pa[:3]) in keys]
    assert len(b_calls) == 4 and len(a_calls) == 2
    assert b_calls[-1] < 1.0 < a_calls[-1], (b_calls, a_calls)  # B finished all turns before A's tool returned
    assert total < 2.5
    assert list(out.non_tensor_batch["agent_end"]) == [END_ANSWER, END_ANSWER]
    assert list(out.non_tensor_batch["agent_turns"]) == [2, 4]


def test_parsers_and_tool_loading():
    tools = {"calculator": load_tool(CALC, "calculator")}
    calls = parse_hermes('x <tool_call>{"name": "calculator", "arguments": {"expression": "3*7"}}</tool_call>', tools)
    assert calls[0].name == "calculator" and calls[0].arguments == {"expression": "3*7"}
    assert tools["calculator"].function(**calls[0].arguments) == "21"
    with pytest.raises(ToolLoadError, match="no function 'nothing'"):
        load_tool(TOOLS, "nothing")
    with pytest.raises(ToolLoadError, match="not a valid JSON schema"):
        load_tool(TOOLS, "bad_schema")
    with pytest.raises(ToolLoadError, match="not found"):
        load_tool("tools/missing.py", "x")


def test_python_interpreter_tool_runs_in_the_sandbox():
    tool = load_tool(str(TESTS.parent / "tools" / "python_interpreter.py"), "python")
    assert tool.function(code="print(6 * 7)").strip() == "42"
    assert "ZeroDivisionError" in tool.function(code="1/0")


def test_config_validation_names_the_key(tmp_path):
    from rlframe.config import ConfigError, RLConfig, ToolConfig, validate_config

    cfg = RLConfig()
    cfg.rollout.multi_turn.enable = True
    cfg.rollout.multi_turn.tools = [ToolConfig(path=TOOLS, name="nothing"), ToolConfig(path=str(tmp_path / "no.py"))]
    cfg.rollout.multi_turn.format = "weird"
    cfg.rollout.tensor_parallel_size = 2  # TP ranks would schedule turns differently
    cfg.rollout.multi_turn.turn_rewards = "sometimes"
    cfg.rollout.multi_turn.environment.path, cfg.rollout.multi_turn.environment.name = TOOLS, "NotAnEnv"
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    text = str(error.value)
    assert "rollout.multi_turn.tools[0]" in text and "no function 'nothing'" in text
    assert "rollout.multi_turn.tools[1]" in text and "not found" in text
    assert "rollout.multi_turn.format" in text
    assert "rollout.multi_turn.environment" in text and "lacks the method(s) step" in text
    assert "multi-turn rollouts need rollout.tensor_parallel_size=1 (got 2)" in text
    assert "rollout.multi_turn.turn_rewards" in text and "'sometimes' is not final or per_turn" in text


def test_hf_engine_multi_turn_log_probs_match_a_forward_pass(tiny_model_dir, tok):
    """The real HF engine on the tiny model, every turn calling `echo` (a test parser): trajectories have
    tool tokens between model turns; the engine's log-probs on model tokens equal a teacher-forced pass."""
    from rlframe.device import detect_profile
    from rlframe.workers.rollout.hf_rollout import HFRollout

    profile = detect_profile(device="cpu", dtype="float32", attn_implementation="sdpa", rollout_engine="hf")
    engine = HFRollout(str(tiny_model_dir), profile, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    # a random model almost never samples EOS: raise its logit (for generation and the check pass alike)
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 4.0
    engine.model.lm_head.register_forward_hook(lambda module, args, output: output + bias)
    torch.manual_seed(0)
    prompts = [ids(tok, f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", eos=False)
               for q in ("one", "two plus two", "three")]
    loop = make_loop(engine, tok, ("echo",), format=f"{TOOLS}:every_turn", max_turns=3)
    sampling = SamplingSettings(max_new_tokens=64, temperature=1.0)
    out = loop.run(prompt_batch(tok, prompts), sampling)
    mask = out.batch["response_mask"]
    context = out.batch["attention_mask"][:, -64:].float() - mask
    assert context.sum() > 0 and torch.all(context >= 0)
    with torch.no_grad():
        logits = engine.model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                              position_ids=out.batch["position_ids"]).logits.float()
    width = out.batch["responses"].size(1)
    lp = torch.log_softmax(logits[:, -width - 1:-1], -1).gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)
    diff = ((lp - out.batch["rollout_log_probs"]).abs() * mask).sum() / mask.sum()
    assert diff < 1e-3, diff
    assert set(out.non_tensor_batch["agent_end"]) <= {END_TURN_LIMIT, END_BUDGET}


# The recipes on the tiny model (random weights: it never writes a tool call nor an answer, so the tool
# recipe uses a test parser that calls `echo` after every turn; the environment answers every turn).
TINY_TURNS = ["rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_tokens_per_turn=8",
              "rollout.multi_turn.max_tool_response_tokens=8", "data.max_response_length=48"]
TOOL_RECIPE_TINY = [f"rollout.multi_turn.tools=[{{path: {TOOLS}, name: echo}}]",
                    f"rollout.multi_turn.format={TOOLS}:every_turn", *TINY_TURNS]


def check_multi_turn_run(run_dir: Path, continuous: bool, environment: bool = False) -> list[dict]:
    from conftest import read_metrics

    steps = [m for m in read_metrics(run_dir) if "agent/turns_mean" in m]
    assert len(steps) == 2, read_metrics(run_dir)
    for m in steps:
        assert m["agent/turns_mean"] > 1.5 and m["agent/context_tokens_mean"] > 0  # really multi-turn
        assert m["agent/trained_tokens_mean"] > 0
        assert m["rollout/logprob_abs_diff"] < 1e-3, m  # trainer vs engine on model tokens
        assert m["agent/continuous_batching"] == float(continuous)
        if environment:
            assert m["agent/env_error_rate"] == 0 and "agent/env_reward_mean" in m
        else:
            assert m["agent/tool_calls_mean"] >= 1 and m["agent/tool_calls/echo"] >= 1
        print({k: v for k, v in m.items() if k.startswith(("agent/", "rollout/logprob", "critic/score", "val/"))})
    return steps


def test_e2e_tool_recipe_hf_rounds(tmp_path, tiny_model_dir):
    """recipe=grpo_tool_math on the HF engine (round scheduling): trainer log-probs match the engine's."""
    from conftest import run_tiny

    run_dir, _ = run_tiny(tmp_path, tiny_model_dir, "grpo_tool_math", "rollout.engine=hf", *TOOL_RECIPE_TINY)
    check_multi_turn_run(run_dir, continuous=False)


# recipe=grpo_tool_math on vLLM (continuous batching) for 2 steps, with the echo tool every turn: tests/test_recipes.py
# recipe=grpo_feedback_math on vLLM for 2 steps: tests/test_recipes.py (its case calls check_multi_turn_run).


def test_outcome_reward_lands_on_the_last_model_token():
    """With tool tokens (mask 0) between model turns the score goes on the last model token; on a
    contiguous single-turn mask the placement equals the former `mask.sum() - 1`."""
    from rlframe.trainer.scorer import place_scores_on_last_token

    holes = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], [0] * 8], dtype=torch.float32)
    placed = place_scores_on_last_token([2.0, 3.0, 4.0], holes)
    assert placed[0].tolist() == [0, 0, 0, 0, 0, 2.0, 0, 0] and placed[1, 0] == 3.0 and placed[2].sum() == 0
    torch.manual_seed(0)
    lengths = torch.randint(0, 9, (64,))
    contiguous = (torch.arange(8) < lengths[:, None]).float()
    scores = torch.randn(64).numpy()
    old = torch.zeros_like(contiguous)
    old[torch.arange(64), (contiguous.sum(-1).long() - 1).clamp(min=0)] = torch.as_tensor(scores)
    old = old * (contiguous.sum(-1, keepdim=True) > 0)
    assert torch.equal(place_scores_on_last_token(scores, contiguous), old)


def test_environment_feedback_turns_rewards_and_errors(tok):
    """The environment's feedback is appended as a user message (context), its rewards are returned per
    turn and summed; an environment that raises in reset ends its trajectory, counted, not the batch."""
    from rlframe.workers.rollout.agent_loop import left_padded

    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    turn = ids(tok, "maybe 7")
    engine = ScriptedEngine(tok, {tuple(pa[:3]): [turn] * 5, tuple(pb[:3]): [turn] * 5})
    mt = MultiTurnSettings(tools=(), format="tag", max_turns=5, tool_prompt=False, environment=(TOOLS, "CountdownEnv"))
    prompts = left_padded([pa, pb], tok.pad_token_id)
    prompts.non_tensor_batch["env_row"] = __import__("numpy").array([{"ground_truth": "1"}, {"ground_truth": "2"}],
                                                                    dtype=object)
    out = AgentLoop(engine, mt, tok).run(prompts, SAMPLING)
    nt = out.non_tensor_batch
    assert list(nt["agent_end"]) == [END_ANSWER, END_ANSWER] and list(nt["agent_turns"]) == [3, 3]
    assert list(nt["agent_turn_rewards"][0]) == [0.25, 0.25, 0.25] and nt["agent_env_reward"][1] == 0.75
    feedback = ids(tok, ObservationRenderer(tok).text(["again 1"], role="user"), eos=False)
    row = out.batch["responses"][0].tolist()
    assert row[len(turn): len(turn) + len(feedback)] == feedback
    assert out.batch["response_mask"][0, len(turn): len(turn) + len(feedback)].sum() == 0
    assert "<|im_start|>user\nagain 1<|im_end|>" in ObservationRenderer(tok).text(["again 1"], role="user")

    broken = MultiTurnSettings(tools=(), format="tag", tool_prompt=False, environment=(TOOLS, "BrokenResetEnv"))
    out = AgentLoop(engine, broken, tok).run(left_padded([pa], tok.pad_token_id), SAMPLING)
    assert out.non_tensor_batch["agent_end"][0] == "env_error" and out.non_tensor_batch["agent_env_errors"][0] == 1
    assert out.batch["response_mask"].sum() == 0  # nothing generated, nothing trained


def test_feedback_math_environment():
    from rlframe.workers.rollout.tools import ToolLoadError, load_environment

    env = load_environment(str(TESTS.parent / "tools" / "feedback_math.py"), "FeedbackMath")()
    env.reset({"ground_truth": "12"})
    assert env.step("I think 7 + 5 = 11. The answer is \\boxed{11}.")[1:] == (0.0, False)
    assert "wrong, try again" in env.step("The answer is \\boxed{11}")[0]
    assert env.step("Sorry: The answer is \\boxed{12}.") == (None, 0.25, True)  # third attempt: 0.5 ** 2
    env.reset({"ground_truth": "12"})
    assert env.step("The answer is 12.") == (None, 1.0, True)  # right at once: the full reward
    with pytest.raises(ToolLoadError, match="lacks the method"):
        load_environment(TOOLS, "NotAnEnv")


class SteppedScriptedEngine(ScriptedEngine):
    """The scripted double with a request-level interface (continuous batching, like VLLMStepper): a
    submitted request emits one token per engine step and finishes when its scripted turn is out. Its
    `generate` (round scheduling) costs as many steps as the longest turn of the batch."""

    def __init__(self, tok, scripts):
        super().__init__(tok, scripts)
        self.steps, self.finished_at = 0, []  # (key, turn length, the step it finished at)
        self.seeds = []  # (sequence key, the seed its turn was sampled with)

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        seeds = prompts.non_tensor_batch.get("sample_seed")
        self.seeds += [(key, None if seeds is None else int(seeds[row])) for row, key in enumerate(self.calls[-1][1])]
        longest = int(out.batch["response_mask"].sum(-1).max())
        for row, key in enumerate(self.calls[-1][1]):
            self.finished_at.append((key, int(out.batch["response_mask"][row].sum()), self.steps + longest))
        self.steps += longest
        return out

    def agent_stepper(self):
        engine = self

        class Stepper:
            def __init__(self):
                self.running = []  # [key, tokens, emitted, sequence key]

            def submit(self, key, token_ids, sampling, seed=None):
                batch = prompt_batch(engine.tok, [token_ids])
                tokens = ScriptedEngine.generate(engine, batch, sampling).batch["responses"][0]
                n = int((tokens != engine.pad_token_id).sum())
                engine.seeds.append((engine.calls[-1][1][0], seed))
                self.running.append([key, tokens[:n].tolist(), 0, engine.calls[-1][1][0]])

            def abort_all(self):
                self.running = []

            def step(self):
                engine.steps += 1
                done = []
                for item in self.running:
                    item[2] += 1
                    if item[2] >= len(item[1]):
                        done.append(item)
                        engine.finished_at.append((item[3], len(item[1]), engine.steps))
                self.running = [i for i in self.running if i not in done]
                return [(k, toks, [-0.5] * len(toks)) for k, toks, _, _ in done]

        return Stepper()


def test_continuous_batching_no_trajectory_waits_for_the_longest_turn(tok):
    """A writes one long turn (60 tokens); B makes three short tool turns then answers. Continuous
    batching (the request-level interface vLLM has): B's turns start as soon as its tool returns, and B
    is done while A still decodes. Rounds (HF): each of B's turns waits for the longest turn of its round.
    The token layout is the same either way."""
    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    long_turn = ids(tok, " ".join(["word"] * 80), eos=False)[:59] + [tok.eos_token_id]
    short_call, answer = ids(tok, "<echo>1</echo>"), ids(tok, "ok")
    scripts = {tuple(pa[:3]): [long_turn], tuple(pb[:3]): [short_call] * 3 + [answer]}
    results, seeds = {}, {}
    for mode in ("continuous", "rounds"):
        engine = SteppedScriptedEngine(tok, scripts)
        loop = make_loop(engine, tok, ("echo",), format="tag", max_turns=5)
        loop.scheduling = "auto" if mode == "continuous" else "rounds"
        batch = prompt_batch(tok, [pa, pb])
        batch.non_tensor_batch["sample_seed"] = np.array([11, 22], dtype=np.int64)  # rollout.seed_each_sample
        out = loop.run(batch, SAMPLING)
        assert out.meta_info["agent/scheduling"] == mode
        seeds[mode] = sorted(engine.seeds, key=str)
        b_done = max(step for key, _, step in engine.finished_at if key == tuple(pb[:3]))
        a_done = max(step for key, _, step in engine.finished_at if key == tuple(pa[:3]))
        results[mode] = (b_done, a_done, engine.steps, out)
    b_done, a_done, steps, out_c = results["continuous"]
    b_turns = sum(len(t) for t in scripts[tuple(pb[:3])])
    assert a_done == len(long_turn) == steps and b_done == b_turns < a_done  # B never waited for A
    b_done_r, _, steps_r, out_r = results["rounds"]
    assert b_done_r == len(long_turn) + 2 * len(short_call) + len(answer)  # B's first turn waited for A's
    assert steps_r > steps
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(out_c.batch[key], out_r.batch[key]), key
    assert list(out_c.non_tensor_batch["agent_turns"]) == [1, 4]
    # per-turn seeds: from the sample's seed and the turn number only, the same under both schedulers
    assert seeds["continuous"] == seeds["rounds"] and len({s for _, s in seeds["rounds"]}) == 5
    assert None not in {s for _, s in seeds["rounds"]}


def test_bad_input_named_before_workers_start(tmp_path):
    """A tool file that fails to import, a schema that is not a valid JSON schema, an environment file
    that fails to import: config validation (before any worker) names the key, the file and the function."""
    from rlframe.config import ConfigError, RLConfig, ToolConfig, validate_config

    broken = tmp_path / "broken_tool.py"
    broken.write_text("import a_module_that_does_not_exist\n\ndef lookup(key):\n    return key\n")
    broken_env = tmp_path / "broken_env.py"
    broken_env.write_text("class Game:\n    def reset(self, row):\n        pass\n    oops(\n")
    cfg = RLConfig()
    cfg.rollout.multi_turn.enable = True
    cfg.rollout.multi_turn.tools = [ToolConfig(path=str(broken), name="lookup"), ToolConfig(path=TOOLS, name="bad_schema")]
    cfg.rollout.multi_turn.environment.path, cfg.rollout.multi_turn.environment.name = str(broken_env), "Game"
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    text = str(error.value)
    assert "rollout.multi_turn.tools[0]" in text and "tool 'lookup'" in text and str(broken) in text
    assert "ModuleNotFoundError" in text and "a_module_that_does_not_exist" in text
    assert "rollout.multi_turn.tools[1]" in text and "TOOL_SCHEMAS['bad_schema']" in text
    assert "not a valid JSON schema" in text and "agent_tools.py" in text
    assert "rollout.multi_turn.environment" in text and "environment 'Game'" in text and "SyntaxError" in text


def test_environment_errors_are_counted_and_logged(tok, caplog):
    """An environment raising in reset (or step) ends that trajectory only, counted; the log names the
    file, the class and the method once."""
    from rlframe.workers.rollout.agent_loop import left_padded

    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    engine = ScriptedEngine(tok, {tuple(pa[:3]): [ids(tok, "7")], tuple(pb[:3]): [ids(tok, "7")]})
    broken = MultiTurnSettings(tools=(), format="tag", tool_prompt=False, environment=(TOOLS, "BrokenResetEnv"))
    with caplog.at_level("WARNING"):
        out = AgentLoop(engine, broken, tok).run(left_padded([pa, pb], tok.pad_token_id), SAMPLING)
    assert list(out.non_tensor_batch["agent_env_errors"]) == [1, 1] and not engine.calls
    metrics = agent_metrics(out.non_tensor_batch, out.batch["response_mask"], out.batch["attention_mask"])
    assert metrics["agent/env_error_rate"] == 1.0 and metrics["agent/end_env_error"] == 1.0
    warnings = [r.getMessage() for r in caplog.records if "BrokenResetEnv.reset failed" in r.getMessage()]
    assert len(warnings) == 1 and "ValueError: reset failed" in warnings[0] and "agent_tools.py" in warnings[0]


def test_per_turn_rewards_move_to_their_turns():
    """rollout.multi_turn.turn_rewards=per_turn, by hand: row 0 has two model turns (tokens 0-1 and 4-5)
    judged 0.5 and 1.0, outcome 1.0; the outcome placement put 2.5 on token 5. Per turn: 0.5 on token 1,
    2.0 on token 5 (1.0 + 1.0); the total stays 2.5. Row 1 (nothing generated) stays 0."""
    from rlframe.trainer.scorer import place_scores_on_last_token
    from rlframe.trainer.scorer import place_turn_rewards

    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [0] * 8], dtype=torch.float32)
    placed = place_scores_on_last_token(np.array([2.5, 0.0]), mask)
    out = place_turn_rewards(placed, [[0.5, 1.0], []], [[1, 5], []], mask)
    assert out[0].tolist() == [0, 0.5, 0, 0, 0, 2.0, 0, 0] and out[1].sum() == 0
    assert torch.allclose(out.sum(-1), placed.sum(-1))


def test_environment_reward_positions_are_the_judged_turns_last_tokens(tok):
    from rlframe.workers.rollout.agent_loop import left_padded

    pa = ids(tok, "Alpha <|im_start|>user\nA", eos=False)
    turn = ids(tok, "maybe 7")
    engine = ScriptedEngine(tok, {tuple(pa[:3]): [turn] * 5})
    mt = MultiTurnSettings(tools=(), format="tag", max_turns=5, tool_prompt=False, environment=(TOOLS, "CountdownEnv"))
    out = AgentLoop(engine, mt, tok).run(left_padded([pa], tok.pad_token_id), SAMPLING)
    feedback = len(ids(tok, ObservationRenderer(tok).text(["again None"], role="user"), eos=False))
    step = len(turn) + feedback
    positions = list(out.non_tensor_batch["agent_turn_reward_positions"][0])
    assert positions == [len(turn) - 1, step + len(turn) - 1, 2 * step + len(turn) - 1]
    assert all(out.batch["response_mask"][0, p] == 1 for p in positions)
    assert out.batch["response_mask"][0, positions[-1] + 1:].sum() == 0  # the last judged turn ends the row


def test_environment_first_message_from_reset_joins_the_prompt(tok):
    """reset(row) returning text: a user message appended to the prompt before its generation prompt
    (context, in `prompts`, not in the trained response); the engine sees it."""
    from rlframe.workers.rollout.agent_loop import left_padded

    prompt = ids(tok, "<|im_start|>user\nplay<|im_end|>\n<|im_start|>assistant\n", eos=False)
    engine = ScriptedEngine(tok, {tuple(prompt[:3]): [ids(tok, "move")]})
    mt = MultiTurnSettings(tools=(), format="tag", max_turns=3, tool_prompt=False, environment=(TOOLS, "GameEnv"))
    batch = left_padded([prompt], tok.pad_token_id)
    batch.non_tensor_batch["env_row"] = np.array([{"ground_truth": "7"}], dtype=object)
    out = AgentLoop(engine, mt, tok).run(batch, SAMPLING)
    expected = ids(tok, "<|im_start|>user\nplay<|im_end|>\n<|im_start|>user\nBoard for 7: X.O<|im_end|>\n"
                        "<|im_start|>assistant\n", eos=False)
    assert out.batch["prompts"][0, -len(expected):].tolist() == expected
    assert out.batch["responses"][0, : len(ids(tok, "move"))].tolist() == ids(tok, "move")
    assert out.non_tensor_batch["agent_env_reward"][0] == 1.0


def test_a_failing_user_parser_is_a_malformed_call(tok):
    prompt = ids(tok, "<|im_start|>user\nq", eos=False)
    engine = ScriptedEngine(tok, {tuple(prompt[:3]): [ids(tok, "x"), ids(tok, "y")]})
    out = make_loop(engine, tok, ("echo",), format=f"{TOOLS}:broken_parser", max_turns=2).run(
        prompt_batch(tok, [prompt]), SAMPLING)
    nt = out.non_tensor_batch
    assert nt["agent_tool_errors"][0] == 1 and nt["agent_end"][0] == END_TURN_LIMIT
    text = tok.decode(out.batch["responses"][0][out.batch["attention_mask"][0, -128:].bool()].tolist())
    assert "the tool-call parser failed: KeyError" in text


def test_slow_environment_does_not_block_other_trajectories(tok):
    """Environment steps run in threads like tools: A's environment takes 1 s per verdict; B's three
    turns and verdicts are all done before A's first verdict is in (continuous batching, measured)."""
    pa, pb = ids(tok, "Alpha <|im_start|>user\nA", eos=False), ids(tok, "Beta <|im_start|>user\nB", eos=False)
    engine = SteppedScriptedEngine(tok, {tuple(pa[:3]): [ids(tok, "7")] * 3, tuple(pb[:3]): [ids(tok, "8")] * 3})
    mt = MultiTurnSettings(tools=(), format="tag", max_turns=3, tool_prompt=False, environment=(TOOLS, "SlowWhenToldEnv"))
    batch = prompt_batch(tok, [pa, pb])
    batch.non_tensor_batch["env_row"] = np.array([{"ground_truth": "slow"}, {"ground_truth": "fast"}], dtype=object)
    loop = AgentLoop(engine, mt, tok)
    out = loop.run(batch, SAMPLING)
    a, b = loop.last_trajectories
    assert list(out.non_tensor_batch["agent_turns"]) == [3, 3] and list(out.non_tensor_batch["agent_env_reward"]) == [1.0, 1.0]
    assert b.ended_s < 0.9 < 1.0 < a.ended_s, (a.ended_s, b.ended_s)
