"""The vLLM teacher backend (teacher.backend=vllm, workers/rollout/vllm_scoring.py) against the fsdp teacher.

The same tiny model, the same batch (left-padded prompts, one short response): vLLM's prompt_logprobs must give
the fsdp teacher's log-probs of the sampled tokens and its top-k ids and log-probs. Tolerance: 1e-4 per log-prob
(fp32 on both sides; vLLM's CPU kernels sum in another order than torch's SDPA forward: measured 4.8e-7 here).
Then a 2-step opd_math run with the vLLM teacher (teacher = student: per-token KL ~0) and the config errors.
"""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_DEVICE, TINY_RUN_OVERRIDES, read_metrics, run_main, vllm_installed

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
K = 4
TOLERANCE = 1e-4


def _batch(vocab: int, rows: int = 4, prompt_width: int = 6, response_width: int = 5):
    from rlframe.protocol import DataProto

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (rows, prompt_width), generator=generator)
    responses = torch.randint(3, vocab, (rows, response_width), generator=generator)
    prompt_mask = torch.ones(rows, prompt_width, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompts[0, :2] = 0
    response_mask = torch.ones(rows, response_width)
    response_mask[1, 3:] = 0  # a short response (right padding)
    responses[1, 3:] = 0
    attention_mask = torch.cat([prompt_mask, response_mask.long()], 1)
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": responses,
        "response_mask": response_mask})


def _teacher(folder, backend: str):
    from rlframe.workers.roles.teacher import TeacherSettings, TeacherWorker
    from rlframe.workers.settings import DeviceRequest, EngineSettings, ForwardSettings

    return TeacherWorker(TeacherSettings(
        engine=EngineSettings(model_path=str(folder), device=DeviceRequest(**CPU_DEVICE), top_k=K),
        forward=ForwardSettings(micro_batch_size=2), backend=backend, max_model_len=32, cpu_kv_cache_gib=0.25))


def test_the_vllm_teacher_scores_as_the_fsdp_teacher(tiny_model_dir):
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    fsdp = _teacher(tiny_model_dir, "fsdp")
    data = _batch(fsdp.engine.model.config.vocab_size)
    expected = fsdp.compute_teacher_log_prob(data).batch
    got = _teacher(tiny_model_dir, "vllm").compute_teacher_log_prob(data).batch
    mask = data.batch["response_mask"].bool()
    assert set(got.keys()) == {"teacher_log_prob", "teacher_topk_ids", "teacher_topk_log_probs"}
    diff = (got["teacher_log_prob"] - expected["teacher_log_prob"]).abs()[mask]
    print(f"vllm vs fsdp teacher: max |diff| {diff.max():.2e} over {int(mask.sum())} tokens")
    assert diff.max() < TOLERANCE, diff.max()
    topk_diff = (got["teacher_topk_log_probs"] - expected["teacher_topk_log_probs"]).abs()[mask]
    assert topk_diff.max() < TOLERANCE, topk_diff.max()
    # the same top-k tokens, in the same order (the random tiny model's top log-probs are ~0.02 apart, far above
    # the tolerance: no ties to reorder)
    assert torch.equal(got["teacher_topk_ids"][mask], expected["teacher_topk_ids"][mask])
    assert got["teacher_topk_ids"].dtype == torch.long and got["teacher_log_prob"].dtype == torch.float32
    assert torch.isfinite(got["teacher_topk_log_probs"]).all()  # padding positions too (masked, never NaN)


def test_a_two_step_opd_run_with_the_vllm_teacher(tiny_model_dir, tmp_path):
    """recipe=opd_math, teacher.backend=vllm, the student as teacher, forward_kl_topk (reads the teacher's top-k):
    two real steps through Ray, KL ~0 at each (vLLM vs the trainer's forward: float noise, not 1e-6)."""
    run_dir = tmp_path / "run"
    result = run_main(["recipe=opd_math", *TINY_RUN_OVERRIDES, f"model.path={tiny_model_dir}",
                       f"teacher.path={tiny_model_dir}", "teacher.backend=vllm", "teacher.cpu_kv_cache_gib=0.25",
                       "distillation.loss_mode=forward_kl_topk", "rollout.engine=hf", f"trainer.run_dir={run_dir}"],
                      cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    trained = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2]
    for step in trained:
        assert abs(step["distill/reverse_kl"]) < TOLERANCE and abs(step["distill/loss"]) < TOLERANCE, step
        assert step["distill/topk_overlap"] == pytest.approx(1.0)
        assert "timing/teacher_log_prob" in step
    worker_logs = "".join(path.read_text() for path in (run_dir / "logs").glob("worker-*.log"))
    assert "Initializing a V1 LLM engine" in worker_logs  # rollout.engine=hf: the one vLLM engine is the teacher's


def test_the_doctor_checks_the_vllm_teacher_against_its_hf_forward(tmp_path, tiny_model_dir):
    """python -m rlframe.doctor recipe=opd_math teacher.backend=vllm: live/teacher_vs_hf compares the vLLM teacher
    with a plain HF forward of its folder; live/teacher_self_kl scores the student with a vLLM teacher of itself."""
    from test_doctor import run_doctor

    done, checks, _ = run_doctor(tmp_path, tiny_model_dir, "opd_math", f"teacher.path={tiny_model_dir}",
                                 "teacher.backend=vllm", "teacher.cpu_kv_cache_gib=0.25", "rollout.engine=hf")
    vs_hf, self_kl = checks.get("live/teacher_vs_hf"), checks.get("live/teacher_self_kl")
    assert vs_hf and vs_hf["status"] == "pass", (vs_hf, done.stdout[-3000:], done.stderr[-3000:])
    assert "teacher.backend=vllm" in vs_hf["measured"]
    assert self_kl["status"] == "pass", self_kl


def test_vllm_teacher_config_errors_name_the_key(tiny_model_dir):
    from rlframe.config import ConfigError, RLConfig, validate_config

    cfg = RLConfig()
    cfg.teacher.path, cfg.teacher.backend = str(tiny_model_dir), "vllm"
    cfg.distillation.loss_mode, cfg.distillation.top_k = "reverse_kl_student_topk", 32
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    message = str(error.value)
    assert "distillation.top_k: is 32; a vllm teacher returns at most 20" in message
    assert "distillation.loss_mode: reverse_kl_student_topk needs the teacher's log-probs at the student's" in message
    cfg.teacher.backend = "sglang"
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert "teacher.backend" in str(error.value)
