"""The vLLM rollout's sleep/wake hand-over, against a double of vLLM that enforces its GPU-only contract.

Sleep mode exists on GPU only, so the real engine cannot exercise it here. `StrictLLM` stands in for
`vllm.LLM` and fails the way the real engine misbehaves: waking what is awake (re-mapping weights over
freshly loaded ones), loading weights while they are asleep, generating with the KV cache asleep. The
code under test is `VLLMRollout`'s own state machine: sleep after generation, wake the weights for a
load, wake the KV cache (and only what is asleep) for the next generation; weights stream, not listed;
level 2 (weights discarded) only when the driver says an update follows, and never a generation on
discarded weights.
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
    engine.pad_token_id, engine.lora_request, engine.lora, engine.weights_discarded = 0, None, None, False
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


class StrictLLMWithLevels(StrictLLM):
    """Level 2 discards the weights: generating before a full reload would produce garbage."""

    def sleep(self, level: int) -> None:
        super().sleep(level)
        self.discarded = level == 2

    def _reload(self, weights_iterator):
        super()._reload(weights_iterator)
        self.discarded = False

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        assert not getattr(self, "discarded", False), "generate with discarded weights"
        return super().generate(requests, params, use_tqdm, lora_request)


def test_level_2_when_an_update_follows_and_never_generates_on_discarded_weights():
    engine = engine_with_sleep()
    engine.llm = StrictLLMWithLevels()
    sampling = SamplingSettings(max_new_tokens=4)
    engine.generate(prompts(), sampling)
    engine.sleep(discard_weights=True)  # the driver said: an update (and its weight load) comes next
    with pytest.raises(RuntimeError, match="level-2 sleep without load_weights"):
        engine.generate(prompts(), sampling)
    engine.load_weights(weights(3))
    engine.generate(prompts(), sampling)
    engine.sleep()  # no promise: level 1 keeps the weights
    engine.generate(prompts(), sampling)
    assert engine.llm.calls == ["generate", "sleep2", "wake:weights", "reload", "reset_prefix_cache",
                                "wake:kv_cache", "generate", "sleep1", "wake:weights+kv_cache", "generate"]


def test_the_actor_role_sleeps_at_level_2_only_when_the_driver_says_an_update_follows():
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    role = object.__new__(ActorRolloutWorker)  # the role's generate path around a strict engine
    role.rollout, role.tp = engine_with_sleep(), None
    role.rollout.llm = StrictLLMWithLevels()
    role.settings = SimpleNamespace(rollout=SimpleNamespace(multi_turn=None, train=SamplingSettings(max_new_tokens=4),
                                                            validation=SamplingSettings(max_new_tokens=4, temperature=0.0),
                                                            seed=0))
    batch = prompts()
    batch.meta_info.update(step=1, update_follows=True)
    ActorRolloutWorker.generate_sequences(role, batch)
    assert role.rollout.llm.calls[-1] == "sleep2"
    role.rollout.load_weights(weights(2))
    batch.meta_info.update(update_follows=False, validate=True)
    ActorRolloutWorker.generate_sequences(role, batch)
    assert role.rollout.llm.calls[-1] == "sleep1"
