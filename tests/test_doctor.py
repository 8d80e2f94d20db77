"""`python -m rlframe.doctor`: each failure made on purpose is caught by the check meant for it, and the healthy
grpo_math configuration passes every check.

Pure checks (no Ray) on small real components: a template that rewrites earlier turns, a constant reward, a
data file whose prompts all exceed the limit, mismatched EOS ids, a sync streamed past the engine (plain actor
+ HF engine objects). Two live doctor runs on the tiny model: the healthy grpo_math (vLLM where installed, as
the recipe's `engine: auto`), and grpo_math_lora with RLFRAME_DEBUG_SKIP_WEIGHT_LOAD=1 (every sync streams past
the engine: the engine keeps the base model, the adapted weights never land).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CPU_DEVICE, REPO_ROOT, TINY_RUN_OVERRIDES, vllm_installed
from helpers_tokenizer import CHAT_TEMPLATE, build_tokenizer
from rlframe.config import RLConfig
from rlframe.doctor.data_checks import check_data
from rlframe.doctor.live_checks import check_weight_sync
from rlframe.doctor.reward_checks import check_reward_on_answers, corrupt
from rlframe.doctor.template_checks import check_append_only, check_generation_prompt, check_stop_ids

LENGTH_REWARD = str(REPO_ROOT / "tests" / "length_reward.py")
CONSTANT_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"
# math decides own vs corrupted answers; a small length term gives the random tiny model's groups some signal
MATH_AND_LENGTH = ("reward.functions=[{path: reward_fns/math.py, name: compute_score, weight: 1.0}, "
                   "{path: " + LENGTH_REWARD + ", name: compute_score, weight: 0.01}]")


def tokenizer_with(template: str | None = None):
    """A fresh copy of the tests' ChatML tokenizer (build_tokenizer is cached), with `template` if given."""
    tokenizer = copy.deepcopy(build_tokenizer())
    tokenizer.chat_template = template or CHAT_TEMPLATE
    return tokenizer


def multi_turn_config() -> RLConfig:
    cfg = RLConfig()
    cfg.rollout.multi_turn.enable = True
    cfg.rollout.multi_turn.environment.path = "tools/feedback_math.py"
    return cfg


# A template that shows only the last assistant turn in full and earlier ones as "[...]" (what templates that
# strip earlier reasoning do): rendering a later turn rewrites an earlier one.
REWRITING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n[...]<|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_append_only_passes_chatml_and_names_the_first_token_a_rewriting_template_changes():
    healthy = check_append_only(tokenizer_with(), multi_turn_config())
    assert healthy.status == "pass", healthy
    broken = check_append_only(tokenizer_with(REWRITING_TEMPLATE), multi_turn_config())
    assert broken.status == "fail"
    assert "differ from the whole conversation's at token" in broken.measured
    assert "rendering turn 3 rewrites turn 2 or earlier" in broken.measured and "append" in broken.fix
    assert check_append_only(tokenizer_with(), RLConfig()).status == "skip"  # single-turn


def test_generation_prompt_check():
    assert check_generation_prompt(tokenizer_with()).status == "pass"
    no_header = CHAT_TEMPLATE.replace("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "")
    failed = check_generation_prompt(tokenizer_with(no_header))
    assert failed.status == "fail" and "adds nothing" in failed.measured


def model_folder(tmp_path: Path, name: str, *, tokenizer_eos: str, generation_eos: str) -> str:
    from transformers import GenerationConfig

    folder = tmp_path / name
    tok = tokenizer_with()
    tok.eos_token = tokenizer_eos
    tok.save_pretrained(folder)
    GenerationConfig(eos_token_id=tok.convert_tokens_to_ids(generation_eos)).save_pretrained(folder)
    return str(folder)


def test_stop_ids_mismatched_eos_ids_are_caught(tmp_path):
    from transformers import AutoTokenizer

    def check(folder):
        return check_stop_ids(AutoTokenizer.from_pretrained(folder), folder)

    healthy = check(model_folder(tmp_path, "ok", tokenizer_eos="<|im_end|>", generation_eos="<|im_end|>"))
    assert healthy.status == "pass", healthy
    # the generation config names another token: the engines still stop at the tokenizer's, but they disagree
    mismatched = check(model_folder(tmp_path, "mismatch", tokenizer_eos="<|im_end|>", generation_eos="<|im_start|>"))
    assert mismatched.status == "warn" and "differ" in mismatched.measured
    # neither names the token that ends a turn: responses run to the length limit
    neither = check(model_folder(tmp_path, "neither", tokenizer_eos="<|pad|>", generation_eos="<|im_start|>"))
    assert neither.status == "fail" and "never end" in neither.measured
    assert "'<|im_end|>'" in neither.fix


@pytest.fixture(scope="module")
def arithmetic_files(tmp_path_factory):
    from rlframe.data.arithmetic import generate_arithmetic_dataset

    train, val = generate_arithmetic_dataset(tmp_path_factory.mktemp("arith"), n_train=32, n_val=8, seed=0)
    return [str(train)], [str(val)]


def test_data_whose_prompts_all_exceed_the_limit_fails_and_names_the_length(arithmetic_files):
    cfg = RLConfig()
    cfg.data.max_prompt_length = 256  # (the tests' tokenizer is small: ~110 tokens a prompt)
    results, train = check_data(cfg, tokenizer_with(), *arithmetic_files)
    by_name = {r.name: r for r in results}
    assert by_name["train_rows"].status == "pass" and len(train) == 32
    assert by_name["train_prompt_lengths"].status == "pass", by_name["train_prompt_lengths"]
    cfg.data.max_prompt_length = 16
    results, _ = check_data(cfg, tokenizer_with(), *arithmetic_files)
    lengths = {r.name: r for r in results}["train_prompt_lengths"]
    assert lengths.status == "fail" and "32 of 32 over (every prompt)" in lengths.measured
    assert lengths.fix.startswith("data.max_prompt_length=")
    cfg.data.prompt_key = "question"  # a column the files do not have
    rows = {r.name: r for r in check_data(cfg, tokenizer_with(), *arithmetic_files)[0]}["train_rows"]
    assert rows.status == "fail" and "question" in rows.measured


def test_reward_on_the_datasets_own_answers_and_a_constant_reward(arithmetic_files, tmp_path):
    from rlframe.data.dataset import RLDataset

    dataset = RLDataset(arithmetic_files[0], tokenizer_with(), max_prompt_length=1024)
    cfg = RLConfig()
    cfg.reward.num_workers = 0  # in this process: the same scoring, no pool to start
    cfg.reward.functions[0].path = str(REPO_ROOT / "reward_fns" / "math.py")
    own, speed = check_reward_on_answers(cfg, dataset)
    assert own.status == "pass" and "16/16 rows tell them apart" in own.measured, own
    assert speed.status == "pass" and "ms per sample" in speed.measured
    constant = tmp_path / "constant.py"
    constant.write_text(CONSTANT_REWARD)
    cfg.reward.functions[0].path = str(constant)
    own, _ = check_reward_on_answers(cfg, dataset)
    assert own.status == "fail" and "every response scores 0.500" in own.measured and "constant" in own.fix
    assert corrupt("12") == "19" and corrupt("3/4") == "31/4" and corrupt("x+1").endswith("(not this)")


def test_a_sync_streamed_past_the_engine_is_caught_by_the_checksums(tiny_model_dir, monkeypatch):
    """The actor and its HF engine as plain objects: a real optimizer-free weight move, a real sync, and the
    same sync with RLFRAME_DEBUG_SKIP_WEIGHT_LOAD=1 (the engine keeps its old weights)."""
    import torch

    from rlframe.trainer.gates import weight_sync_gate
    from rlframe.workers.roles.actor_rollout import SKIP_LOAD_ENV, ActorRolloutWorker
    from rlframe.workers.settings import (ActorSettings, DeviceRequest, EngineSettings, ForwardSettings,
                                         PolicyLossSettings, RolloutSettings, UpdateLoop)

    device = DeviceRequest(**CPU_DEVICE)
    actor = ActorRolloutWorker(ActorSettings(
        engine=EngineSettings(model_path=str(tiny_model_dir), device=device), loop=UpdateLoop(),
        loss=PolicyLossSettings(), log_prob=ForwardSettings(), seed=0,
        rollout=RolloutSettings(model_path=str(tiny_model_dir), device=device)))

    def move_trainer():
        with torch.no_grad():
            for p in actor.engine.model.parameters():
                p.add_(1e-6 * torch.randn_like(p))

    first = actor.sync_weights(checksum=True)["weight_sync/check"]
    assert first["unequal"] == 0 and first["checked"] >= 20 and weight_sync_gate(1, first) is None
    before = actor.weight_checksums()
    move_trainer()
    healthy = actor.sync_weights(checksum=True)["weight_sync/check"]
    assert (healthy["unequal"], healthy["engine_changed"], healthy["trainer_changed"]) == (0, 1, 1)
    assert check_weight_sync(before, actor.weight_checksums(), healthy).status == "pass"
    before = actor.weight_checksums()
    move_trainer()
    monkeypatch.setenv(SKIP_LOAD_ENV, "1")
    skipped = actor.sync_weights(checksum=True)["weight_sync/check"]
    assert skipped["unequal"] == skipped["checked"] and skipped["engine_changed"] == 0
    event = weight_sync_gate(3, skipped)
    assert event is not None and "did not load the weights" in event.cause
    doctor = check_weight_sync(before, actor.weight_checksums(), skipped)
    assert doctor.status == "fail" and "kept its old weights" in doctor.fix
    monkeypatch.delenv(SKIP_LOAD_ENV)
    assert actor.sync_weights(checksum=True)["weight_sync/check"]["unequal"] == 0  # the next sync repairs it


def run_doctor(tmp_path: Path, model_dir: Path, recipe: str, *extra: str, env: dict | None = None):
    run_dir = tmp_path / "run"
    overrides = [o for o in TINY_RUN_OVERRIDES if not o.startswith("trainer.total_steps")]
    done = subprocess.run([sys.executable, "-m", "rlframe.doctor", f"recipe={recipe}", *overrides,
                           f"model.path={model_dir}", f"trainer.run_dir={run_dir}", "rollout.n=4", MATH_AND_LENGTH, *extra],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **(env or {})})
    doctor = json.loads((run_dir / "doctor.json").read_text()) if (run_dir / "doctor.json").is_file() else None
    assert doctor is not None, f"no doctor.json:\nSTDOUT:\n{done.stdout[-4000:]}\nSTDERR:\n{done.stderr[-6000:]}"
    return done, {f"{c['group']}/{c['name']}": c for c in doctor["checks"]}, run_dir


def test_the_healthy_grpo_math_configuration_passes_every_check(tmp_path, tiny_model_dir):
    done, checks, run_dir = run_doctor(tmp_path, tiny_model_dir, "grpo_math")
    not_passed = {name: (c["status"], c["measured"]) for name, c in checks.items() if c["status"] != "pass"}
    assert done.returncode == 0, f"{not_passed}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # single-turn, no LoRA, text only: skipped
    assert set(not_passed) == {"template/append_only", "live/lora_adapter", "media/placeholders"}, not_passed
    for name in ("config/memory_plan", "data/train_prompt_lengths", "template/stop_ids", "reward/own_answers",
                 "live/determinism", "live/logprob_gap_step0", "live/weight_sync", "live/logprob_gap_after_sync",
                 "reward/group_signal", "live/gates", "live/timing"):
        assert name in checks, name
    assert " 0 of " in checks["live/weight_sync"]["measured"] and "moved there too" in checks["live/weight_sync"]["measured"]
    assert "PASS  live/weight_sync" in done.stdout and "doctor: " in done.stdout
    # the quiet console of rlframe.main: no worker's own lines (vLLM, transformers) on it, they are in files
    assert not re.search(r"\(\w+ pid=\d+\)", done.stdout + done.stderr), (done.stdout + done.stderr)[-3000:]
    assert list(run_dir.glob("**/logs/worker-*.log"))
    if vllm_installed():  # the recipe's engine: auto -> vLLM, whose checksums read back what stays readable
        assert "engine=vllm" in done.stdout
    assert not (run_dir / "gates.jsonl").exists() or not (run_dir / "gates.jsonl").read_text()


def test_a_lora_adapter_that_never_reaches_the_engine_fails_the_sync_and_adapter_checks(tmp_path, tiny_model_dir):
    """Every sync streamed past the engine (the real sync path, RLFRAME_DEBUG_SKIP_WEIGHT_LOAD=1): the engine
    keeps the base model. The HF engine, the recipe's merged-weight sync; a learning rate that moves the tiny
    adapted model measurably in one step."""
    done, checks, _ = run_doctor(tmp_path, tiny_model_dir, "grpo_math_lora", "rollout.engine=hf", "actor.optim.lr=2e-3",
                                 env={"RLFRAME_DEBUG_SKIP_WEIGHT_LOAD": "1"})
    assert done.returncode == 1, done.stdout[-3000:]
    status = {name: c["status"] for name, c in checks.items()}
    assert status["live/weight_sync"] == "fail", checks["live/weight_sync"]
    assert status["live/lora_adapter"] == "fail", checks["live/lora_adapter"]
    assert "the engine samples the base model" in checks["live/lora_adapter"]["measured"]
    assert status["live/gates"] == "fail" and "gate weight_sync fired at step 1" in checks["live/gates"]["measured"]
    assert status["live/logprob_gap_step0"] == "pass"  # before the step, engine and trainer were the same model
    assert all(s in ("pass", "skip") for name, s in status.items() if name.split("/")[0] in ("config", "data", "reward",
                                                                                             "template"))


# ------------------------------------------------------------------ the teacher checks (on-policy distillation)
def _scored_batch(vocab: int, rows: int = 4, prompt_width: int = 6, response_width: int = 5):
    """Left-padded prompts and right-padded responses (one short), the layout of a rollout batch."""
    import torch

    from rlframe.protocol import DataProto

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (rows, prompt_width), generator=generator)
    responses = torch.randint(3, vocab, (rows, response_width), generator=generator)
    prompt_mask = torch.ones(rows, prompt_width, dtype=torch.long)
    prompt_mask[0, :2] = 0
    response_mask = torch.ones(rows, response_width)
    response_mask[1, 3:] = 0
    attention_mask = torch.cat([prompt_mask, response_mask.long()], 1)
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": responses,
        "response_mask": response_mask})


def _plain_teacher(folder, temperature: float = 1.0):
    from rlframe.workers.roles.teacher import TeacherSettings, TeacherWorker
    from rlframe.workers.settings import DeviceRequest, EngineSettings, ForwardSettings

    return TeacherWorker(TeacherSettings(
        engine=EngineSettings(model_path=str(folder), device=DeviceRequest(**CPU_DEVICE), use_remove_padding="true",
                              top_k=4),
        forward=ForwardSettings(micro_batch_size=2, temperature=temperature)))


def test_teacher_checks_pass_teacher_equal_to_student_and_catch_another_teacher_and_a_tempered_engine(
        tiny_model_dir, tmp_path):
    """teacher_self_kl: the real actor's log-probs against a teacher role of the same folder (pass, < 1e-6 per
    token) and of other weights (fail). teacher_vs_hf: the fsdp teacher against a plain HF forward (pass) and a
    teacher engine at temperature 2 (fail: it scores another distribution than its weights give)."""
    from conftest import build_tiny_model_dir, plain_actor
    from rlframe.doctor.teacher_checks import (SELF_KL_MAX_FLOAT32, check_teacher_self_kl, check_teacher_vs_hf,
                                               hf_response_log_probs)

    actor = plain_actor(tiny_model_dir, packed="true")
    data = _scored_batch(actor.engine.model.config.vocab_size)
    mask = data.batch["response_mask"]
    student = actor.compute_log_prob(data).batch["old_log_probs"]
    own = _plain_teacher(tiny_model_dir).compute_teacher_log_prob(data).batch["teacher_log_prob"]
    healthy = check_teacher_self_kl(student, own, mask, SELF_KL_MAX_FLOAT32)
    assert healthy.status == "pass" and "on 18 sampled tokens" in healthy.measured, healthy
    other_dir = build_tiny_model_dir(tmp_path / "other", seed=1)
    other = _plain_teacher(other_dir).compute_teacher_log_prob(data).batch["teacher_log_prob"]
    broken = check_teacher_self_kl(student, other, mask, SELF_KL_MAX_FLOAT32)
    assert broken.status == "fail" and "temperature" in broken.fix, broken

    reference = hf_response_log_probs(str(tiny_model_dir), data)
    assert check_teacher_vs_hf("fsdp", own, reference, mask, 1e-3).status == "pass"
    assert float(((own - reference).abs() * mask).max()) < 1e-5  # fp32: packed fsdp vs padded HF, float noise
    tempered = _plain_teacher(tiny_model_dir, temperature=2.0).compute_teacher_log_prob(data).batch["teacher_log_prob"]
    caught = check_teacher_vs_hf("fsdp", tempered, reference, mask, 1e-3)
    assert caught.status == "fail" and "teacher.backend=fsdp" in caught.measured, caught


def test_the_doctor_runs_the_teacher_checks_on_opd_math_with_the_student_as_teacher(tmp_path, tiny_model_dir):
    """A live doctor run of recipe=opd_math, teacher.path = the student's folder: both teacher checks pass."""
    done, checks, _ = run_doctor(tmp_path, tiny_model_dir, "opd_math", f"teacher.path={tiny_model_dir}",
                                 "rollout.engine=hf")
    assert checks["live/teacher_self_kl"]["status"] == "pass", (checks.get("live/teacher_self_kl"), done.stdout[-3000:],
                                                                done.stderr[-3000:])
    assert checks["live/teacher_vs_hf"]["status"] == "pass", checks["live/teacher_vs_hf"]
    assert "mean reverse KL" in checks["live/teacher_self_kl"]["measured"]
