"""The doctor's teacher checks (on-policy distillation): the teacher path scores what the student sampled, as it should.

    self_kl    the student as its own teacher (a teacher role of the student's folder, the run's teacher settings):
               the per-token reverse KL log pi(y_t) - log pi_T(y_t) on real samples is 0 to float precision
    vs_hf      the run's teacher (its backend: fsdp or vllm) against a plain transformers forward of the teacher's
               folder on the same samples: mean |log p_teacher_backend - log p_hf| under the dtype's threshold

A misaligned position (an off-by-one between prompt and response), a temperature other than 1, a mask or packing
bug, or a vLLM engine scoring another distribution shows here as a KL far above float noise.
"""

from __future__ import annotations

import dataclasses

import torch

from rlframe.doctor.result import CheckResult, failed, passed, skipped

GROUP = "live"
SELF_KL_MAX_FLOAT32 = 1e-6  # teacher = student in fp32: the bound for "0 to float precision"


def masked_stats(difference: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean of `difference` over the mask, max |difference| over the mask)."""
    mask = mask.to(difference.dtype)
    mean = float((difference * mask).sum() / mask.sum().clamp(min=1))
    largest = float((difference.abs() * mask).max()) if mask.any() else 0.0
    return mean, largest


def check_teacher_self_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor,
                          threshold: float) -> CheckResult:
    """The student scored by a teacher of its own weights: per-token reverse KL = log pi - log pi_T, each token within
    `threshold` (0 to float precision)."""
    mean, largest = masked_stats(student_log_probs.float() - teacher_log_probs.float(), response_mask)
    tokens = int(response_mask.sum())
    measured = (f"the student as its own teacher on {tokens} sampled tokens: mean reverse KL {mean:.2e}, "
                f"max |log pi - log pi_T| {largest:.2e} (threshold {threshold:g})")
    if largest > threshold:
        return failed(GROUP, "teacher_self_kl", measured, "the teacher path scores other positions or another "
                      "distribution than the student's forward: its temperature (must be 1), the prompt/response "
                      "alignment of its inputs, its masks or packing")
    return passed(GROUP, "teacher_self_kl", measured)


def check_teacher_vs_hf(backend: str, teacher_log_probs: torch.Tensor, hf_log_probs: torch.Tensor,
                        response_mask: torch.Tensor, threshold: float) -> CheckResult:
    """The teacher backend's log-probs of the sampled tokens against a plain transformers forward of its folder."""
    mean, largest = masked_stats((teacher_log_probs.float() - hf_log_probs.float()).abs(), response_mask)
    measured = (f"teacher.backend={backend} vs a plain HF forward of its folder: mean |diff| {mean:.2e}, "
                f"max {largest:.2e} over {int(response_mask.sum())} tokens (threshold {threshold:g})")
    if mean > threshold:
        return failed(GROUP, "teacher_vs_hf", measured, "the teacher engine scores another distribution than its "
                      "weights give: its dtype, its temperature (must be 1), a prompt_logprobs offset, or weights "
                      "that did not load")
    return passed(GROUP, "teacher_vs_hf", measured)


@torch.no_grad()
def hf_response_log_probs(folder: str, batch, trust_remote_code: bool = False) -> torch.Tensor:
    """log softmax(logits / 1)[y_t] of each response token, from a plain fp32 transformers forward on the CPU
    of the padded batch (prompt left-padded, response right-padded): the reference the teacher backends must match.

        logits of position P + t - 1 predict responses[:, t]     (P: the padded prompt width)
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code).eval()
    b = batch.batch
    responses = b["responses"]
    prompt_width = b["input_ids"].shape[1] - responses.shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, prompt_width - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def self_teacher_settings(settings, student_path: str):
    """The run's teacher settings with the student's folder as the teacher's weights (the teacher = student check)."""
    return dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, model_path=student_path), routes=())


def few_rows(batch, rows: int):
    """The first `rows` rows of a batch (the checks score a few real samples)."""
    return batch[:min(rows, len(batch))]


SAMPLES = 4  # rows of the doctor's probe batch the teacher checks score


def run_teacher_checks(cfg, trainer, batch, model_path: str, threshold: float, dtype: str) -> list[CheckResult]:
    """Both checks on a few rows of the doctor's step-0 probe (the actor still holds the student's folder weights):
    self_kl with a teacher role of the student's folder built in this process (the run's teacher settings and
    backend), vs_hf with the run's own teacher role."""
    from rlframe.models.provision import resolve_model_path
    from rlframe.trainer.worker_settings import teacher_settings
    from rlframe.workers.roles.teacher import TeacherWorker

    from rlframe.config.teacher import routed_teachers

    routed = {source for route in routed_teachers(cfg).values() for source in route.data_sources}
    if routed and "data_source" in batch.non_tensor_batch:  # the default teacher's rows only (teachers: routes)
        own = [i for i, source in enumerate(batch.non_tensor_batch["data_source"]) if str(source) not in routed]
        if not own:
            return [skipped(GROUP, "teacher_self_kl", "every probe row is routed to a teachers: entry"),
                    skipped(GROUP, "teacher_vs_hf", "every probe row is routed to a teachers: entry")]
        batch = batch[own]
    rows = few_rows(batch, SAMPLES)
    mask = rows.batch["response_mask"]
    student = trainer.actor_rollout.compute_log_prob(rows).batch["old_log_probs"]
    teacher = trainer.workers.teacher.compute_teacher_log_prob(rows).batch["teacher_log_prob"]
    if cfg.teacher.backend == "url":
        return url_teacher_checks(cfg, rows, teacher, threshold)
    settings = teacher_settings(cfg, model_path)
    own = TeacherWorker(self_teacher_settings(settings, model_path)).compute_teacher_log_prob(rows).batch["teacher_log_prob"]
    # fp32 fsdp: the student's own forward, float noise only; a vLLM teacher sums in other kernels: the gap threshold
    self_threshold = SELF_KL_MAX_FLOAT32 if dtype == "float32" and cfg.teacher.backend == "fsdp" else threshold
    results = [check_teacher_self_kl(student, own, mask, self_threshold)]
    if cfg.rollout.temperature != 1.0 and results[0].status == "fail":
        results[0].fix += f"; rollout.temperature={cfg.rollout.temperature}: the student's log-probs are tempered, " \
                          "the teacher's are not: set rollout.temperature=1"
    reference = hf_response_log_probs(resolve_model_path(cfg.teacher.path), rows, cfg.model.trust_remote_code)
    results.append(check_teacher_vs_hf(cfg.teacher.backend, teacher, reference, mask, threshold))
    return results


def url_teacher_checks(cfg, rows, teacher: torch.Tensor, threshold: float) -> list[CheckResult]:
    """A served teacher: its weights cannot be swapped for the student's (self_kl is skipped); vs_hf where
    teacher.path holds the weights too, not only the tokenizer."""
    from pathlib import Path

    from rlframe.models.provision import resolve_model_path

    results = [skipped(GROUP, "teacher_self_kl", "teacher.backend=url: the served teacher cannot score as the student")]
    folder = Path(resolve_model_path(cfg.teacher.path))
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return results + [skipped(GROUP, "teacher_vs_hf", f"teacher.backend=url: {folder} holds no weights to compare")]
    reference = hf_response_log_probs(str(folder), rows, cfg.model.trust_remote_code)
    return results + [check_teacher_vs_hf("url", teacher, reference, rows.batch["response_mask"], threshold)]
