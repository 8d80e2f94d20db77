"""Request-level access to a vLLM engine for the agent loop (continuous batching): submit a turn, step, collect."""

from __future__ import annotations


class TokenRequests:
    """What VLLMStepper and the gateway's VLLMRequests share over an in-process vLLM engine (`self.llm`,
    `self.engine`, `self.rollout`): a token-id request added under a key, the finished ones collected, all aborted."""

    llm: object
    engine: object
    rollout: object
    keys: dict
    counter: int

    def add_request(self, key, token_ids: list[int], sampling_params, prefix: str) -> None:
        request_id = f"{prefix}-{self.counter}"
        self.counter += 1
        prompt = {"prompt_token_ids": list(token_ids)}
        render = getattr(self.llm, "_preprocess_cmpl_one", None)  # vLLM's own rendering of a token prompt
        if render is not None:
            prompt = render(prompt)
        self.engine.add_request(request_id, prompt, sampling_params,
                                lora_request=getattr(self.rollout, "lora_request", None))
        self.keys[request_id] = key

    def finished_requests(self) -> list[tuple[object, object, list[int], list[float]]]:
        """One engine step: (key, vLLM completion, sampled ids, their log-probs) of each request it finished."""
        finished = []
        for out in self.engine.step():
            if not out.finished or out.request_id not in self.keys:
                continue
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            log_probs = [lp[token].logprob for lp, token in zip(completion.logprobs, ids)]
            finished.append((self.keys.pop(out.request_id), completion, ids, log_probs))
        return finished

    def abort_all(self) -> None:
        if self.keys:
            self.engine.abort_request(list(self.keys))
            self.keys.clear()


class VLLMStepper(TokenRequests):
    """Request-level access to a VLLMRollout's engine (continuous batching): `submit` adds one request
    (token ids in), `step` runs one engine step (vLLM schedules every unfinished request together, new
    ones joining at once) and returns the requests that finished in it as (key, token ids, log-probs).

    Sampling parameters as VLLMRollout.generate builds them (the temperature-scaled, processed log-probs of
    the sampled tokens); the engine's current LoRA adapter, if any, applies."""

    def __init__(self, rollout):
        self.rollout, self.llm = rollout, rollout.llm
        self.engine = self.llm.llm_engine
        self.keys: dict[str, object] = {}
        self.counter = 0
        self.steps = 0
        if getattr(rollout, "weights_discarded", False):
            raise RuntimeError("agent loop: the vLLM engine's weights were discarded (level-2 sleep) and not "
                               "reloaded; generating now would use garbage weights")
        if hasattr(rollout, "wake_up"):
            rollout.wake_up(tags=["weights", "kv_cache"])
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the vLLM engine has unfinished requests; the agent loop needs it to itself")

    def params(self, sampling, seed: int | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(n=1, max_tokens=max(1, sampling.max_new_tokens), logprobs=0,
                              temperature=sampling.temperature, top_p=sampling.top_p if not sampling.greedy else 1.0,
                              top_k=sampling.top_k if not sampling.greedy else -1,
                              seed=None if sampling.greedy else seed, output_kind=RequestOutputKind.FINAL_ONLY)

    def submit(self, key, token_ids: list[int], sampling, seed: int | None = None) -> None:
        self.add_request(key, token_ids, self.params(sampling, seed), "agent")

    def step(self) -> list[tuple[object, list[int], list[float]]]:
        self.steps += 1
        return [(key, ids, log_probs) for key, _, ids, log_probs in self.finished_requests()]
