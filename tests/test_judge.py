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

    def __init__(self, scripts: dict[str, list[str]] | None = None, delay_s: float = 0.05):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.scripts, self.delay_s = {k: list(v) for k, v in (scripts or {}).items()}, delay_s
        self.lock, self.in_flight, self.most_in_flight, self.requests, self.auth = threading.Lock(), 0, 0, [], set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                import time as clock

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"]
                with server.lock:
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    server.requests.append((self.path, prompt))
                    server.auth.add(self.headers.get("Authorization"))
                    step = server.scripts.get(prompt, []).pop(0) if server.scripts.get(prompt) else "ok"
                try:
                    clock.sleep(server.delay_s if step != "hang" else 3.0)
                    if step in ("503", "429", "401"):
                        self.send_response(int(step))
                        if step == "429":
                            self.send_header("Retry-After", "0")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    reply = b"not json" if step == "garbage" else json.dumps(
                        {"choices": [{"message": {"role": "assistant", "content": f"Score: {prompt}"}}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a hung request
                    pass
                finally:
                    with server.lock:
                        server.in_flight -= 1

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
