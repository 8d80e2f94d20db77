"""teacher=: every evaluated response scored under a teacher too: per-token reverse KL to it and its log-prob.

    check_teacher(cfg, model_path)                        # the teacher's folder and tokenizer, before any engine
    scorer = TeacherScorer(cfg, model_path)               # two forward-only engines: the teacher, the evaluated model
    scores = scorer.score(batch)                          # TeacherScores: per response, the means over its tokens
    scorer.load_model(other_model_path)                   # checkpoints=: the evaluated model's next weights

Both engines are the teacher role's fsdp backend (workers/roles/teacher.py): a forward-only trainer engine built
from the teacher role's own settings (rlframe/trainer/worker_settings.py teacher_settings: the folder, device,
dtype, micro-batches, temperature 1), here in this process without Ray, and without the top-k outputs (the
evaluation reads the log-probs of the sampled tokens only; a top-k forward of image, video or audio rows is refused
by the engine). For each response token y_t (response_mask), both at temperature 1 (the models' own
distributions, whatever temperature sampled the tokens):

    reverse KL        = mean_t [log pi(y_t | x, y_<t) - log pi_T(y_t | x, y_<t)]     (k1 on the model's own samples)
    teacher_log_prob  = mean_t log pi_T(y_t | x, y_<t)

per response (the out= rows) and over every response token of a method (the metrics, `teacher_reverse_kl`,
`teacher_log_prob_mean`, `teacher_model_log_prob_mean`: token-weighted means, as training's distill/reverse_kl).
The tokenizers are compared as training compares them (rlframe/config/teacher.py teacher_tokenizer_matches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class TeacherInputError(ValueError):
    """A teacher= the evaluation cannot use (no such folder, another tokenizer, no weights)."""


@dataclass
class TeacherScores:
    """One pass's responses under the teacher: per response, means over its tokens, and its token count."""

    reverse_kl: np.ndarray  # mean_t log pi - log pi_T
    teacher_log_prob: np.ndarray  # mean_t log pi_T
    model_log_prob: np.ndarray  # mean_t log pi (the evaluated model, temperature 1)
    tokens: np.ndarray

    @classmethod
    def of(cls, model_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> TeacherScores:
        """[B, R] log-probs of the sampled tokens and the response mask -> the per-response means."""
        return cls(reverse_kl=response_means(model_log_probs.double() - teacher_log_probs.double(), mask),
                   teacher_log_prob=response_means(teacher_log_probs, mask),
                   model_log_prob=response_means(model_log_probs, mask), tokens=mask.double().sum(-1).numpy())


def response_means(values: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """[B, R] values -> [B]: each row's mean over its response tokens (float64; 0 for an empty response)."""
    mask = mask.double()
    return ((values.double() * mask).sum(-1) / mask.sum(-1).clamp(min=1)).numpy()


def teacher_extras(passes: list[TeacherScores]) -> dict[str, float]:
    """Token-weighted means over every response of every seed's pass (sum over tokens / number of tokens)."""
    tokens = np.concatenate([p.tokens for p in passes])
    total = max(float(tokens.sum()), 1.0)

    def weighted(name: str) -> float:
        return float(np.concatenate([getattr(p, name) for p in passes]) @ tokens / total)

    return {"teacher_reverse_kl": weighted("reverse_kl"), "teacher_log_prob_mean": weighted("teacher_log_prob"),
            "teacher_model_log_prob_mean": weighted("model_log_prob")}


def check_teacher(cfg, model_path: str) -> str:
    """cfg.teacher.path as a local folder with weights, whose tokenizer and chat template are the evaluated model's
    (training's checks, rlframe/config/teacher.py); the folder, or TeacherInputError naming what is wrong."""
    from rlframe.config.teacher import teacher_path_resolves, teacher_tokenizer_matches
    from rlframe.models.provision import resolve_model_path

    problems: list[str] = []

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            problems.append(message)

    given = cfg.teacher.path
    teacher_path_resolves(cfg, need)
    if problems:
        raise TeacherInputError(f"teacher={given}: {problems[0]}")
    folder = resolve_model_path(given)  # (an embedded model name: converted into the cache once)
    if not any(Path(folder).glob("*.safetensors")) and not any(Path(folder).glob("*.bin")):
        raise TeacherInputError(f"teacher={given}: {folder} holds no weights (*.safetensors, *.bin) to score with "
                                "(a served teacher's folder may hold its tokenizer only). Fix: teacher=<the teacher's "
                                "HF folder>")
    cfg.teacher.path = folder
    teacher_tokenizer_matches(cfg, need, model_path)
    if problems:
        raise TeacherInputError(f"teacher={given}: {problems[0]}")
    return folder


class TeacherScorer:
    """The teacher and the evaluated model as forward-only engines (the teacher role's fsdp backend, in-process)."""

    def __init__(self, cfg, model_path: str):
        from rlframe.trainer.worker_settings import teacher_settings

        settings = teacher_settings(cfg, cfg.teacher.path)
        self.engine_settings = dataclasses.replace(settings.engine, top_k=0)  # log-probs of the sampled tokens only
        self.forward = settings.forward  # micro-batches; temperature 1
        self.teacher = self.build(cfg.teacher.path, "teacher")
        self.model = self.build(model_path, "evaluated")

    def build(self, path: str, name: str):
        from rlframe.workers.engine import build_engine

        settings = dataclasses.replace(self.engine_settings, model_path=path)
        return build_engine(settings, settings.device.profile(), name=name)

    def load_model(self, model_path: str) -> None:
        self.model = self.build(model_path, "evaluated")

    @torch.no_grad()
    def score(self, batch) -> TeacherScores:
        """`batch`: the generation's rows (prompt + response tensors; images, videos, audios as the trainer's
        forward takes them: multi_modal_inputs)."""
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
        non_tensor = [k for k in ("multi_modal_inputs",) if k in batch.non_tensor_batch]
        inputs = batch.select(batch_keys=keys, non_tensor_keys=non_tensor, meta_info_keys=[])
        teacher = self.teacher.forward(inputs, self.forward)["log_probs"]
        model = self.model.forward(inputs, self.forward)["log_probs"]
        return TeacherScores.of(model, teacher, inputs.batch["response_mask"])
