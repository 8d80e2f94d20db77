"""The vLLM rollout's sleep/wake hand-over, against a double of vLLM that enforces its GPU-only contract.

Sleep mode exists on GPU only, so the real engine cannot exercise it here. `StrictLLM` stands in for
`vllm.LLM` and fails the way the real engine misbehaves: waking what is awake (re-mapping weights over
freshly loaded ones), loading weights while they are asleep, generating with the KV cache asleep. The
code under test is `VLLMRollout`'s own state machine: sleep after generation, wake the weights for a
load, wake the KV cache (and only what is asleep) for the next generation; weights stream, not listed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlframe.protocol import DataProto
from rlframe.workers.settings import SamplingSettings

pytest.importorskip("vllm", reason="VLLMRollout imports vllm's SamplingParams")


class StrictLLM:
    def __init__(self):
        self.asleep: set[str] = set()
        self.calls: list[str] = []
        self.max_tensors_alive = 0
        runner = SimpleNamespace(reload_weights=self._reload)
        self.worker = SimpleNamespace(model_runner=runner)

    def sleep(self, level: int) -> None:
        assert not self.asleep, "sleep() while already asleep"
        self.asleep = {"weights", "kv_cache"}
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None) -> None:
        tags = tags or ["weights", "kv_cache"]
        for tag in tags:
            assert tag in self.asleep, f"wake_up({tag}) while {tag} is awake: would re-map it"
        self.asleep -= set(tags)
        self.calls.append("wake:" + "+".join(tags))

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]

    def _reload(self, weights_iterator):
        assert "weights" not in self.asleep, "weights loaded while asleep"
        assert not isinstance(weights_iterator, list)
        for name, tensor in weights_iterator:  # one at a time: count what the producer has made so far
            self.max_tensors_alive = max(self.max_tensors_alive, produced[0] - consumed[0])
            consumed[0] += 1
        self.calls.append("reload")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        assert not self.asleep, f"generate with {sorted(self.asleep)} asleep"
        self.calls.append("generate")
        token = SimpleNamespace(logprob=-0.5)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8], logprobs=[{7: token}, {8: token}])])
                for _ in requests]


produced, consumed = [0], [0]


def weights(n: int):
    for i in range(n):
        produced[0] += 1
        yield f"w{i}", torch.zeros(2)


def engine_with_sleep():
    from rlframe.workers.rollout.vllm_rollout import VLLMRollout

    engine = object.__new__(VLLMRollout)  # everything but vLLM itself
    engine.llm, engine.sleep_enabled, engine.asleep_tags = StrictLLM(), True, set()
    engine.pad_token_id, engine.lora_request = 0, None
    return engine


def prompts() -> DataProto:
    return DataProto.from_dict(tensors={"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]]),
                                        "position_ids": torch.tensor([[0, 0, 1]])})


def test_generate_sleep_load_generate_follows_vllm_contract():
    engine = engine_with_sleep()
    sampling = SamplingSettings(max_new_tokens=4)
    engine.generate(prompts(), sampling)
    engine.sleep()  # the role sleeps as soon as generation ends
    engine.sleep()  # idempotent
    produced[0] = consumed[0] = 0
    assert engine.load_weights(weights(5)) == 5
    assert engine.llm.max_tensors_alive <= 1  # streamed: never the whole model at once
    out = engine.generate(prompts(), sampling)
    assert out.batch["responses"][0, :2].tolist() == [7, 8]
    assert engine.llm.calls == ["generate", "sleep1", "wake:weights", "reload", "reset_prefix_cache",
                                "wake:kv_cache", "generate"]


def test_generate_after_sleep_without_a_load_wakes_everything_once():
    engine = engine_with_sleep()
    engine.sleep()
    engine.generate(prompts(), SamplingSettings(max_new_tokens=4))
    assert engine.llm.calls == ["sleep1", "wake:weights+kv_cache", "generate"]


def test_the_double_catches_the_old_order():
    """The old order (wake weights for the load, then wake everything) re-maps the weights."""
    llm = StrictLLM()
    llm.sleep(1)
    llm.wake_up(["weights"])
    with pytest.raises(AssertionError, match="re-map"):
        llm.wake_up(None)
