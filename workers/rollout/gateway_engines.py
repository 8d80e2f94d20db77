"""The rollout engines at the request level, for the gateway: token ids in, sampled ids and their log-probs out.

`submit(key, prompt_ids, params)` queues one completion; `step()` advances the engine and returns the completions
that finished as `Sampled`; `vocab_size`: the token ids the engine's model takes (None: not known). What an engine
raises from `submit` or `step` is caught by the gateway (Gateway.serve_engine): it answers those calls. vLLM (`VLLMRequests`): continuous batching, each request joins the running batch at
once (as VLLMStepper does for the built-in agent loop) with its own seed and stop strings. HF generate
(`HFRequests`): one blocking `generate` per group of waiting requests with the same sampling; stop strings are
applied to the sampled ids afterwards (the ids are cut after the token that completes the stop string).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlframe.workers.rollout.vllm_stepper import TokenRequests


@dataclass(frozen=True)
class CallParams:
    """One completion's sampling: the engine's temperature/top_p/top_k (the run's, unless the request's are
    honoured), its max new tokens, stop strings and seed."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sampled:
    """What the engine sampled for one request: ids, their log-probs (the engine's, as the trainer compares them)
    and why it stopped: "stop" (EOS or a stop string) or "length"."""

    key: object
    ids: list[int]
    log_probs: list[float]
    finish_reason: str
    stop_hit: str | None = None
    extra: dict = field(default_factory=dict)


class VLLMRequests(TokenRequests):
    """Request-level access to a VLLMRollout's in-process engine (continuous batching)."""

    def __init__(self, rollout, eos_ids: set[int]):
        self.rollout, self.eos_ids = rollout, eos_ids
        self.llm = rollout.llm
        self.engine = self.llm.llm_engine
        self.keys: dict[str, object] = {}
        self.counter = 0
        if getattr(rollout, "weights_discarded", False):
            raise RuntimeError("gateway: the vLLM engine's weights were discarded (level-2 sleep) and not reloaded")
        config = getattr(self.engine, "model_config", None)
        self.vocab_size = config.get_vocab_size() if config is not None else None
        if hasattr(rollout, "wake_up"):
            rollout.wake_up(tags=["weights", "kv_cache"])

    def submit(self, key, prompt_ids: list[int], params: CallParams) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = SamplingParams(n=1, max_tokens=max(1, params.max_new_tokens), logprobs=0,
                                  temperature=params.temperature, top_p=1.0 if params.greedy else params.top_p,
                                  top_k=-1 if params.greedy else params.top_k, stop=list(params.stop) or None,
                                  seed=None if params.greedy else params.seed, output_kind=RequestOutputKind.FINAL_ONLY)
        self.add_request(key, prompt_ids, sampling, "gateway")

    @property
    def busy(self) -> bool:
        return bool(self.keys)

    def step(self) -> list[Sampled]:
        return [Sampled(key, ids, log_probs, "length" if completion.finish_reason == "length" else "stop",
                        completion.stop_reason if isinstance(completion.stop_reason, str) else None)
                for key, completion, ids, log_probs in self.finished_requests()]

    def abort(self, keys: list) -> None:
        """Drop these requests (an ended episode's) from the running batch."""
        wanted = set(keys)
        ids = [request_id for request_id, key in self.keys.items() if key in wanted]
        if ids:
            self.engine.abort_request(ids)
            for request_id in ids:
                del self.keys[request_id]

class HFRequests:
    """Requests served by HF `generate` in groups of equal sampling (one blocking batch call per `step`)."""

    def __init__(self, rollout, tokenizer, eos_ids: set[int], pad_id: int):
        self.rollout, self.tokenizer, self.eos_ids, self.pad_id = rollout, tokenizer, eos_ids, pad_id
        self.waiting: list[tuple[object, list[int], CallParams]] = []
        embeddings = rollout.model.get_input_embeddings() if hasattr(rollout, "model") else None
        self.vocab_size = getattr(embeddings, "num_embeddings", None)

    def submit(self, key, prompt_ids: list[int], params: CallParams) -> None:
        self.waiting.append((key, list(prompt_ids), params))

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[Sampled]:
        from rlframe.workers.rollout.agent_loop import left_padded
        from rlframe.workers.settings import SamplingSettings

        if not self.waiting:
            return []
        first = self.waiting[0][2]
        same = lambda p: (p.max_new_tokens, p.temperature, p.top_p, p.top_k) == (
            first.max_new_tokens, first.temperature, first.top_p, first.top_k)
        group = [w for w in self.waiting if same(w[2])]
        self.waiting = [w for w in self.waiting if not same(w[2])]
        out = self.rollout.generate(left_padded([ids for _, ids, _ in group], self.pad_id),
                                    SamplingSettings(max_new_tokens=first.max_new_tokens, temperature=first.temperature,
                                                     top_p=first.top_p, top_k=first.top_k))
        responses, mask, lps = out.batch["responses"], out.batch["response_mask"], out.batch["rollout_log_probs"]
        finished = []
        for row, (key, _, params) in enumerate(group):
            n = int(mask[row].sum())
            ids, log_probs = responses[row, :n].tolist(), lps[row, :n].tolist()
            reason = "stop" if ids and ids[-1] in self.eos_ids else "length"
            cut, hit = self.cut_at_stop(ids, params.stop)
            if hit is not None:
                ids, log_probs, reason = ids[:cut], log_probs[:cut], "stop"
            finished.append(Sampled(key, ids, log_probs, reason, hit))
        return finished

    def cut_at_stop(self, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str | None]:
        """(the number of ids up to the token that completes the first stop string, that string) or (len, None)."""
        if not stops:
            return len(ids), None
        for k in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
            for stop in stops:
                if stop in text:
                    return k, stop
        return len(ids), None

    def abort(self, keys: list) -> None:
        wanted = set(keys)
        self.waiting = [w for w in self.waiting if w[0] not in wanted]

    def abort_all(self) -> None:
        self.waiting.clear()


def request_engine(rollout, tokenizer, eos_ids: set[int], pad_id: int):
    """The request-level interface of the rollout engine: vLLM's (continuous batching) or HF's (groups)."""
    if hasattr(rollout, "llm") and hasattr(rollout.llm, "llm_engine"):
        return VLLMRequests(rollout, eos_ids)
    return HFRequests(rollout, tokenizer, eos_ids, pad_id)

