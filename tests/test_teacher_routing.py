"""Several teachers routed by data_source (`teachers: {name: {path, ..., data_sources: [...]}}`): each row is
scored by its data_source's teacher, the rows no route lists by `teacher:`; the config errors before workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CPU_DEVICE


def _settings(folder, routes=()):
    from rlframe.workers.roles.teacher import TeacherSettings
    from rlframe.workers.settings import DeviceRequest, EngineSettings, ForwardSettings

    return TeacherSettings(engine=EngineSettings(model_path=str(folder), device=DeviceRequest(**CPU_DEVICE), top_k=4),
                           forward=ForwardSettings(micro_batch_size=2), routes=routes)


@pytest.fixture(scope="module")
def other_teacher_dir(tmp_path_factory):
    from conftest import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_other"), seed=1)


def test_rows_go_to_their_data_sources_teacher(tiny_model_dir, other_teacher_dir):
    """Rows of 'gsm8k' to the other teacher, the rest (arithmetic, an unlisted one) to the default: each row equals
    what its own teacher alone gives it; the two teachers disagree (so a row scored by the wrong one would show)."""
    from test_teacher_vllm import _batch
    from rlframe.workers.roles.teacher import TeacherWorker

    data = _batch(64, rows=4)
    data.non_tensor_batch["data_source"] = np.array(["arithmetic", "gsm8k", "other", "gsm8k"], dtype=object)
    routed = TeacherWorker(_settings(tiny_model_dir, routes=((("gsm8k",), _settings(other_teacher_dir)),)))
    got = routed.compute_teacher_log_prob(data).batch
    default = TeacherWorker(_settings(tiny_model_dir)).compute_teacher_log_prob(data).batch
    other = TeacherWorker(_settings(other_teacher_dir)).compute_teacher_log_prob(data).batch
    mask = data.batch["response_mask"].bool()
    for key in ("teacher_log_prob", "teacher_topk_log_probs"):
        for row, expected in ((0, default), (1, other), (2, default), (3, other)):
            assert torch.allclose(got[key][row][mask[row]], expected[key][row][mask[row]], atol=1e-5), (key, row)
    assert torch.equal(got["teacher_topk_ids"][1], other["teacher_topk_ids"][1])
    assert (default["teacher_log_prob"] - other["teacher_log_prob"]).abs()[mask].min() > 1e-4  # they do disagree


def test_routed_teacher_config_errors_name_the_route(tiny_model_dir, tmp_path):
    from rlframe.config import ConfigError, RLConfig, validate_config, validate_model_folder
    from rlframe.config.teacher import RoutedTeacherConfig

    cfg = RLConfig()
    cfg.teachers = {"math": RoutedTeacherConfig(path=str(tiny_model_dir), data_sources=["gsm8k"]),
                    "code": RoutedTeacherConfig(path=str(tmp_path / "missing"), data_sources=["gsm8k"]),
                    "empty": RoutedTeacherConfig(path=str(tiny_model_dir), backend="url")}
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    message = str(error.value)
    assert "teachers: routed teachers need the default teacher.path too" in message
    assert "teachers.code.data_sources: 'gsm8k' is routed to teachers.math too" in message
    assert "teachers.code.path: '" in message and "is not a model folder" in message
    assert "teachers.empty.data_sources: is empty" in message
    assert "teachers.empty.url: is None; teacher.backend=url needs the server's base URL" in message
    cfg = RLConfig()
    cfg.model.path = str(tiny_model_dir)  # the student: the teacher's tokenizer is compared with it
    cfg.teacher.path = str(tiny_model_dir)
    cfg.teachers = {"math": RoutedTeacherConfig(path=str(tiny_model_dir), data_sources=["gsm8k"])}
    validate_config(cfg)
    validate_model_folder(cfg, str(tiny_model_dir))
    other = tmp_path / "other_template"
    import shutil

    shutil.copytree(tiny_model_dir, other)
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    cfg.teachers["math"].path = str(other)
    with pytest.raises(ConfigError) as error:
        validate_model_folder(cfg, str(tiny_model_dir))
    assert "teachers.math.path: the teacher" in str(error.value) and "chat template" in str(error.value)


def test_teachers_compose_from_the_command_line(tiny_model_dir):
    from rlframe.main import compose_config

    from rlframe.config import ConfigError, validate_config
    from rlframe.config.teacher import routed_teachers

    cfg = compose_config(["recipe=opd_math", f"model.path={tiny_model_dir}", f"teacher.path={tiny_model_dir}",
                          f"+teachers.math={{path: {tiny_model_dir}, data_sources: [gsm8k]}}"])
    route = routed_teachers(cfg)["math"]
    assert (route.path, route.data_sources, route.backend) == (str(tiny_model_dir), ["gsm8k"], "fsdp")
    validate_config(cfg)
    cfg.teachers["math"]["data_source"] = ["typo"]
    with pytest.raises(ConfigError, match=r"teachers.math.data_source: not a key of a routed teacher"):
        validate_config(cfg)


def test_a_two_step_run_routes_the_arithmetic_rows_to_their_teacher(tiny_model_dir, other_teacher_dir, tmp_path):
    """recipe=opd_math, the default teacher = the student, `teachers.other` (other weights) for data_source
    arithmetic (every row): the KL at step 1 is the other teacher's (far above 0), not the default's (0)."""
    from conftest import TINY_RUN_OVERRIDES, read_metrics, run_main

    run_dir = tmp_path / "run"
    result = run_main(["recipe=opd_math", *TINY_RUN_OVERRIDES, f"model.path={tiny_model_dir}",
                       f"teacher.path={tiny_model_dir}",
                       f"+teachers.other={{path: {other_teacher_dir}, data_sources: [arithmetic]}}",
                       "rollout.engine=hf", f"trainer.run_dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    trained = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2]
    assert trained[0]["distill/reverse_kl_k3"] > 1e-3, trained[0]  # (the default teacher would give < 1e-6)


def test_the_memory_plan_counts_every_local_teacher_and_no_served_one(tiny_model_dir):
    from rlframe.config import RLConfig
    from rlframe.memory_plan import plan_memory, read_shape

    def teachers(cfg):
        plan = plan_memory(cfg, read_shape(str(tiny_model_dir)), gpu=True, capacity_gib=80.0)
        return [item for item in plan.devices[0].items if item.role == "teacher" and "weights" in item.what]

    cfg = RLConfig()
    cfg.teacher.path = str(tiny_model_dir)
    one = len(teachers(cfg))
    cfg.teachers = {"math": {"path": str(tiny_model_dir), "data_sources": ["gsm8k"]},
                    "served": {"path": str(tiny_model_dir), "backend": "url", "url": "http://h:1/v1",
                               "data_sources": ["code"]}}
    assert one >= 1 and len(teachers(cfg)) == 2 * one
