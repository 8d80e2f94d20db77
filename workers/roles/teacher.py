"""The teacher role (on-policy distillation): a frozen second model scoring the student's own samples.

Like the reference worker it is forward-only and colocated (it shares the actor's devices); it differs in
what it returns for every response position: the teacher's log-prob of the sampled token, its own top-k
tokens (ids + log-probs) and, when the batch carries the student's top-k ids (reverse_kl_student_topk),
its log-probs of those. Temperature 1 (the teacher's own distribution). Two backends (teacher.backend):

    fsdp   a forward-only trainer engine; between uses its weights leave the device (GPU: the model moves to
           the host; CPU: the file-mapped pages are released, as the reference's)
    vllm   a vLLM engine scoring each sequence with prompt_logprobs=K (workers/rollout/vllm_scoring.py); it
           sleeps between uses; it cannot score the student's top-k ids
    url    the same request to an OpenAI-compatible server (teacher.url); nothing on the device
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlframe.controller import Dispatch, register
from rlframe.protocol import DataProto
from rlframe.workers.engine import build_engine
from rlframe.workers.host_pages import release_file_mapped_pages
from rlframe.workers.settings import EngineSettings, ForwardSettings


@dataclass(frozen=True)
class TeacherSettings:
    engine: EngineSettings  # the teacher's folder; top_k > 0 (its top-k per position)
    forward: ForwardSettings  # micro-batch size; temperature 1
    offload: bool = True  # weights off the device between uses
    backend: str = "fsdp"  # fsdp | vllm
    max_model_len: int = 0  # vllm: the longest prompt + response (+ 1) it scores
    gpu_memory_utilization: float = 0.3  # vllm on GPU: its share of the device's memory
    cpu_kv_cache_gib: float = 0.5  # vllm on CPU: its KV cache
    url: str = ""  # url: the server's base URL
    served_model: str = ""  # url: the request's "model"
    api_key: str = field(default="", repr=False)  # url: the bearer token ("" none; never printed)
    timeout_s: float = 60.0  # url: seconds per request
    max_concurrency: int = 8  # url: requests in flight
    # teachers routed by data_source: ((data_sources, their TeacherSettings), ...); the other rows: this one
    routes: tuple = ()


class TeacherWorker:
    def __init__(self, settings: TeacherSettings):
        self.settings = settings
        self.profile = settings.engine.device.profile()
        self.scorer = None
        self.routes = [(frozenset(sources), TeacherWorker(route)) for sources, route in settings.routes]
        if settings.backend == "vllm":
            from rlframe.workers.rollout.vllm_scoring import VLLMScorer

            engine = settings.engine
            self.scorer = VLLMScorer(engine.model_path, self.profile, top_k=engine.top_k,
                                     max_model_len=settings.max_model_len, offload=settings.offload,
                                     gpu_memory_utilization=settings.gpu_memory_utilization,
                                     cpu_kv_cache_gib=settings.cpu_kv_cache_gib,
                                     trust_remote_code=engine.trust_remote_code)
            return
        if settings.backend == "url":  # nothing on the device: a client of the server
            from rlframe.workers.rollout.vllm_scoring import URLScorer

            self.scorer = URLScorer(settings.url, settings.served_model, top_k=settings.engine.top_k,
                                    timeout_s=settings.timeout_s, max_concurrency=settings.max_concurrency,
                                    api_key=settings.api_key)
            return
        self.engine = build_engine(settings.engine, self.profile, name="teacher")
        self.moves_model = self.profile.is_gpu and settings.offload and not self.engine.sharded
        if self.moves_model:
            self.engine.model.to("cpu")

    @contextmanager
    def on_device(self):
        """The weights on the device for one pass, and off it afterwards (settings.offload)."""
        if self.moves_model:
            self.engine.model.to(self.engine.device)
        try:
            yield
        finally:
            if self.moves_model:
                self.engine.model.to("cpu")
                torch.cuda.empty_cache()
            elif self.settings.offload and not self.profile.is_gpu:
                release_file_mapped_pages(self.engine.model.parameters())

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """teacher_log_prob [B, R]; teacher_topk_ids / teacher_topk_log_probs [B, R, K]; with student_topk_ids in
        the batch, teacher_at_student_topk [B, R, K] (fsdp only). With routes, each row by its data_source's
        teacher (the others by this one)."""
        if self.routes:
            return self.routed(data)
        return self.score(data)

    def routed(self, data: DataProto) -> DataProto:
        """Split the rows by data_source, score each part with its teacher, put the rows back in their places."""
        sources = [str(s) for s in data.non_tensor_batch["data_source"]]
        parts = [([i for i, s in enumerate(sources) if s in names], teacher) for names, teacher in self.routes]
        routed = {i for rows, _ in parts for i in rows}
        parts.append(([i for i in range(len(sources)) if i not in routed], self))
        out: dict[str, torch.Tensor] = {}
        for rows, teacher in parts:
            if not rows:
                continue
            scored = teacher.score(data[rows]).batch
            for key in scored.keys():
                if key not in out:
                    out[key] = torch.zeros((len(sources),) + tuple(scored[key].shape[1:]), dtype=scored[key].dtype)
                out[key][torch.tensor(rows)] = scored[key]
        return DataProto.from_dict(tensors=out)

    def score(self, data: DataProto) -> DataProto:
        """This teacher's outputs for every row of `data`."""
        if self.scorer is not None:
            return DataProto.from_dict(tensors=self.scorer.score(data))
        inputs = data.select(batch_keys=[k for k in ("input_ids", "attention_mask", "position_ids", "responses",
                                                     "response_mask", "student_topk_ids") if k in data.batch.keys()])
        with self.on_device():
            out = self.engine.forward(inputs, self.settings.forward)
        tensors = {"teacher_log_prob": out["log_probs"], "teacher_topk_ids": out["topk_ids"],
                   "teacher_topk_log_probs": out["topk_log_probs"]}
        if "at_student_topk_ids" in out:
            tensors["teacher_at_student_topk"] = out["at_student_topk_ids"]
        return DataProto.from_dict(tensors=tensors)
