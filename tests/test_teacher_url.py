"""The URL teacher (teacher.backend=url, workers/rollout/vllm_scoring.py URLScorer) against a small
OpenAI-compatible server started in the test.

The server answers POST /v1/completions with vLLM's `prompt_logprobs` extension (per position: the token there
and the top-k, keyed by token id, with ranks) from a real fp32 transformers forward of the tiny model, so the
URL teacher must give what the fsdp teacher gives on the same batch (tolerance 1e-5: two fp32 forwards of the
same weights, padded vs unpadded). It also fails its first request of each sequence with 503 once (the client
retries) and refuses a model it does not serve with 400 (no retry: an error naming the url).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import CPU_DEVICE, TINY_RUN_OVERRIDES, read_metrics, run_main

K = 4
TOLERANCE = 1e-5


class PromptLogprobServer:
    """/v1/completions with prompt_logprobs over a real HF model (the served teacher)."""

    def __init__(self, folder: str, name: str = "tiny-teacher", flaky: bool = False):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        self.name, self.flaky, self.lock = name, flaky, threading.Lock()
        self.requests, self.refused_once = 0, set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests += 1
                    key = tuple(body["prompt"])
                    first_try = server.flaky and key not in server.refused_once
                    server.refused_once.add(key)
                if self.path != "/v1/completions" or body.get("model") != server.name:
                    return self.reply(400, {"error": {"message": f"model {body.get('model')!r} is not served"}})
                if first_try:
                    return self.reply(503, {"error": {"message": "busy"}})
                self.reply(200, {"choices": [{"index": 0, "text": "", "prompt_logprobs":
                                              server.prompt_logprobs(body["prompt"], body["prompt_logprobs"])}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @torch.no_grad()
    def prompt_logprobs(self, ids: list[int], k: int) -> list:
        with self.lock:
            log_probs = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)
        out = [None]
        for position in range(1, len(ids)):
            row = log_probs[position - 1]
            ranks = torch.argsort(row, descending=True)
            entries = {str(int(t)): {"logprob": float(row[t]), "rank": r + 1, "decoded_token": ""}
                       for r, t in enumerate(ranks[:k].tolist())}
            token = ids[position]
            entries.setdefault(str(token), {"logprob": float(row[token]), "rank": int((row > row[token]).sum()) + 1,
                                            "decoded_token": ""})
            out.append(entries)
        return out

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def served(tiny_model_dir):
    server = PromptLogprobServer(str(tiny_model_dir), flaky=True)
    yield server
    server.close()


def _teacher(folder, backend: str, url: str = "", model: str = ""):
    from rlframe.workers.roles.teacher import TeacherSettings, TeacherWorker
    from rlframe.workers.settings import DeviceRequest, EngineSettings, ForwardSettings

    return TeacherWorker(TeacherSettings(
        engine=EngineSettings(model_path=str(folder), device=DeviceRequest(**CPU_DEVICE), top_k=K),
        forward=ForwardSettings(micro_batch_size=2), backend=backend, url=url, served_model=model, timeout_s=30.0))


def test_the_url_teacher_scores_as_the_fsdp_teacher_and_retries_a_busy_server(tiny_model_dir, served):
    from test_teacher_vllm import _batch

    fsdp = _teacher(tiny_model_dir, "fsdp")
    data = _batch(fsdp.engine.model.config.vocab_size)
    expected = fsdp.compute_teacher_log_prob(data).batch
    got = _teacher(tiny_model_dir, "url", served.url, served.name).compute_teacher_log_prob(data).batch
    mask = data.batch["response_mask"].bool()
    assert served.requests == 2 * len(data)  # one 503 then one answer per sequence
    assert (got["teacher_log_prob"] - expected["teacher_log_prob"]).abs()[mask].max() < TOLERANCE
    assert (got["teacher_topk_log_probs"] - expected["teacher_topk_log_probs"]).abs()[mask].max() < TOLERANCE
    assert torch.equal(got["teacher_topk_ids"][mask], expected["teacher_topk_ids"][mask])

    wrong = _teacher(tiny_model_dir, "url", served.url, "another-model")
    with pytest.raises(RuntimeError, match=r"the teacher at http://127\.0\.0\.1:\d+/v1/completions did not score a "
                                           r"sequence after 1 tries: HTTP 400.*is not served.*Fix: teacher.url"):
        wrong.compute_teacher_log_prob(data)


def test_a_two_step_opd_run_with_the_url_teacher(tiny_model_dir, tmp_path):
    """recipe=opd_math with teacher.backend=url at the test's server (the student's weights: KL ~0), k3."""
    server = PromptLogprobServer(str(tiny_model_dir))
    try:
        run_dir = tmp_path / "run"
        result = run_main(["recipe=opd_math", *TINY_RUN_OVERRIDES, f"model.path={tiny_model_dir}",
                           f"teacher.path={tiny_model_dir}", "teacher.backend=url", f"teacher.url={server.url}",
                           f"teacher.model={server.name}", "distillation.loss_mode=k3", "rollout.engine=hf",
                           f"trainer.run_dir={run_dir}"], cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        trained = [m for m in read_metrics(run_dir) if m["step"] > 0]
        assert [m["step"] for m in trained] == [1, 2]
        # step 1: the student is the served weights; step 2: AdamW turned step 1's float-noise gradient into a step
        # of ~lr per weight (docs/distillation.md; measured 4.2e-5), while the served teacher stays the folder's
        for step, bound in zip(trained, (TOLERANCE, 1e-3)):
            assert abs(step["distill/reverse_kl"]) < bound and abs(step["distill/loss"]) < bound, step
        assert server.requests == 2 * 4 * 2  # 2 steps x train_batch_size 4 x rollout.n 2 (TINY_RUN_OVERRIDES)
    finally:
        server.close()


def test_url_teacher_config_errors_name_the_key(tiny_model_dir):
    from rlframe.config import ConfigError, RLConfig, validate_config

    cfg = RLConfig()
    cfg.model.path = str(tiny_model_dir)  # the student: the teacher's tokenizer is compared with it
    cfg.teacher.path, cfg.teacher.backend = str(tiny_model_dir), "url"
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert "teacher.url: is None; teacher.backend=url needs the server's base URL" in str(error.value)
    cfg.teacher.backend, cfg.teacher.url = "fsdp", "http://localhost:8000/v1"
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert "teacher.url: is set but teacher.backend=fsdp" in str(error.value)
    cfg.teacher.backend = "url"
    validate_config(cfg)
