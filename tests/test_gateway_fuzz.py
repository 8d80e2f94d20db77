"""The gateway fuzzed during a real rollout (issue 39): two episodes on the HF engine whose agent
(tests/gateway_fuzz_agent.py) first sends 520 random and malformed requests each, then makes two ordinary chained
calls. Every request is answered 200 or 4xx within a second, every refusal is counted in the step's metrics, both
episodes complete with trained tokens, and no thread, process or port is left.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

from test_gateway import engine, episodes_runner, pid_alive, port_is_closed, prompt_batch  # noqa: F401

REQUESTS_PER_EPISODE = 520


def test_fuzzed_gateway_answers_every_request_counts_it_and_the_step_completes(engine, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    from rlframe.trainer.agent_metrics import gateway_metrics
    from rlframe.workers.settings import SamplingSettings

    monkeypatch.setenv("GATEWAY_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("GATEWAY_FUZZ_VOCAB", str(len(engine[1])))
    monkeypatch.setenv("GATEWAY_FUZZ_REQUESTS", str(REQUESTS_PER_EPISODE))
    agent = Path(__file__).with_name("gateway_fuzz_agent.py")
    runner = episodes_runner(engine, tiny_model_dir, tmp_path / "record", path=str(agent), name="fuzz",
                             episode_timeout_s=60.0, max_concurrent_episodes=2, max_tokens_per_call=2,
                             sampling_from_request=False, read_timeout_s=0.5, max_connections=32,
                             max_calls_per_episode=400,
                             inherit_env=True)  # (GATEWAY_TEST_OUT, GATEWAY_FUZZ_*: not on the agents' allow-list)
    threads = threading.active_count()
    start = time.monotonic()
    out = runner.run(prompt_batch(engine[1], 2, engine[3]), SamplingSettings(max_new_tokens=32), {"step": 1})
    seconds = time.monotonic() - start

    results = [r for i in range(2) for r in json.loads((tmp_path / f"fuzz-{i}.json").read_text())]
    statuses = Counter(status for _, status, *_ in results)
    by_category = Counter((category, status) for category, status, *_ in results)
    slowest = max(r[2] for r in results)
    print(f"\n{len(results)} requests in {seconds:.1f} s (the rollout), slowest answer {slowest:.2f} s; by status "
          f"{dict(sorted(statuses.items(), key=str))}\n{dict(sorted(by_category.items(), key=str))}")
    for category in sorted({r[0] for r in results}):
        times = sorted(r[2] for r in results if r[0] == category)
        print(category, len(times), [round(times[int(q * (len(times) - 1))], 3) for q in (0.5, 0.9, 0.99, 1.0)])
    assert len(results) == 2 * REQUESTS_PER_EPISODE >= 1000
    unanswered = [r for r in results if r[1] is None or not (r[1] == 200 or 400 <= r[1] < 500)]
    assert not unanswered, unanswered[:10]
    # a refusal is the gateway's own answer: within a second; a valid call also waits for the engine's batch, whose
    # time is the machine's load (1.95 s once with the suite's two test processes): a looser bound
    slowest_refusal = max(r[2] for r in results if r[1] != 200)
    assert slowest_refusal < 1.0, sorted((r for r in results if r[1] != 200), key=lambda r: -r[2])[:5]
    assert slowest < 10.0, sorted(results, key=lambda r: -r[2])[:5]
    assert statuses[200] > 50 and len(statuses) >= 8  # valid calls served among the refusals, of many kinds
    assert {c for c, s in by_category if s == 408} == {"slow", "content_length"}
    # every refusal is counted once in the step's metrics; every 200 POST is a recorded call
    nt = out.non_tensor_batch
    metrics = gateway_metrics(nt, out.batch["response_mask"], out.batch["attention_mask"])
    refused = {k.removeprefix("gateway/refused/"): v for k, v in metrics.items() if k.startswith("gateway/refused/")}
    # (+ the ordinary calls' refusals: on a loaded machine the openai client's body once took longer than 0.5 s)
    ordinary = sum(len(json.loads((tmp_path / f"ordinary-{i}.json").read_text())) for i in range(2))
    assert sum(refused.values()) == sum(n for status, n in statuses.items() if status != 200) + ordinary, refused
    assert refused["engine_error"] == refused["engine_refused"] == refused["internal"] == refused["busy"] == 0
    assert refused["timeout"] == statuses[408] + ordinary and refused["too_large"] == statuses[413]
    gets = sum(n for (c, s), n in by_category.items() if c == "bad_http" and s == 200)  # GET /v1/models
    assert sum(nt["gateway_calls"]) == statuses[200] - gets + 2 * 2  # + each episode's two ordinary calls
    # the episodes completed: answered, their ordinary calls chained and trained; nothing left behind
    assert list(nt["gateway_failed"]) == ["", ""] and all(a is not None for a in nt["agent_answer"])
    assert all(out.batch["response_mask"][i].sum() > 0 for i in range(2))
    assert port_is_closed(runner.last_gateway.port or 0) or runner.last_gateway.server is None
    pids = [pid for run in runner.last_runs for pid in run.pids]
    deadline = time.monotonic() + 5
    while (any(pid_alive(p) for p in pids) or threading.active_count() > threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)] and runner.forks.process.poll() is not None
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]
