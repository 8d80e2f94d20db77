"""Checkpoint folders (atomic save, manifest, `latest`, keep-K, fallback past a broken newest one) and
the actor state round trip on plain objects (no Ray): a resumed update is bit-identical."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rlframe.trainer import checkpoint as ckpt


def _save(run_dir, step, payload=b"weights", keep=0):
    tmp = ckpt.begin_save(run_dir, step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "model.safetensors").write_bytes(payload * 100)
    return ckpt.finish_save(tmp, step, {"step": step}, "a: 1\n", keep=keep)


def test_save_is_atomic_with_manifest_latest_and_keep_k(tmp_path):
    for step in (1, 2, 3):
        saved = _save(tmp_path, step, keep=2)
        assert saved.path.name == f"step_{step}"
    folder = ckpt.checkpoints_dir(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_2", "step_3"]
    assert (folder / "latest").read_text().strip() == "step_3"
    manifest = json.loads((folder / "step_3" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["step"] == 3
    assert set(manifest["files"]) == {"actor/model.safetensors", "driver_state.json", "config.yaml"}
    assert manifest["files"]["actor/model.safetensors"]["bytes"] == 700
    # a crash mid-save leaves only a .tmp folder, which is never taken for a checkpoint
    stale = ckpt.begin_save(tmp_path, 4)
    (stale / "driver_state.json").write_text("{}")
    assert ckpt.find_latest_complete(tmp_path).step == 3
    assert ckpt.should_save(4, 10, 2) and ckpt.should_save(10, 10, 3) and not ckpt.should_save(5, 10, 2)
    assert not ckpt.should_save(10, 10, 0)


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "truncated"),
    (lambda p: p.write_bytes(b"X" + p.read_bytes()[1:]), "sha256"),
    (lambda p: p.unlink(), "missing"),
])
def test_broken_newest_checkpoint_falls_back_saying_so(tmp_path, capsys, damage, reason):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    damage(newest.path / "actor" / "model.safetensors")
    found = ckpt.resolve_resume("auto", tmp_path)
    assert found.step == 1
    out = capsys.readouterr().out
    assert "step_2 is not usable" in out and "actor/model.safetensors" in out and reason in out
    assert "falling back to the previous complete checkpoint" in out
    with pytest.raises(ckpt.CheckpointError, match=reason):
        ckpt.resolve_resume(str(newest.path), tmp_path)
    assert ckpt.resolve_resume("disable", tmp_path) is None


def test_no_manifest_means_incomplete(tmp_path):
    saved = _save(tmp_path, 5)
    (saved.path / "manifest.json").unlink()
    assert "manifest.json is missing" in ckpt.verify(saved.path)
    assert ckpt.find_latest_complete(tmp_path) is None


def test_trim_metrics_log(tmp_path):
    lines = [{"step": s, "x": s} for s in (0, 1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    timeline = [{"step": s, "phase": "rollout", "start": 0.0, "end": 1.0} for s in (1, 2, 3, 3)]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(x) + "\n" for x in timeline) + '{"step": 4, "ph')
    assert ckpt.trim_metrics_log(tmp_path, 2) == 1
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    # the phase timeline too, and a last line a crash cut short
    assert [json.loads(x)["step"] for x in (tmp_path / "timeline.jsonl").read_text().splitlines()] == [1, 2]


def test_rng_state_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(ckpt.capture_rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def _policy(model_dir):
    from conftest import plain_actor

    return plain_actor(model_dir, lr=1e-2, mini_batch_size=8, micro_batch_size=4, shuffle=True, use_kl_loss=True,
                       kl_loss_coef=0.1, warmup_steps=3)


def _update(actor, batch):
    return actor.update_actor(batch).meta_info["metrics"]


def _batch(model_dir, step):
    from test_actor_data_parallel import synthetic_batch
    from transformers import AutoConfig

    batch = synthetic_batch(AutoConfig.from_pretrained(model_dir).vocab_size)
    batch.meta_info["step"] = step
    return batch


def test_actor_state_round_trip_resumes_bit_identically(tiny_model_dir, tmp_path):
    """Update, save, update again -> A. Fresh model, load, update -> B. A == B exactly (same process
    layout, same arithmetic: fp32 on CPU is deterministic), including LR warmup and RNG draws."""
    torch.manual_seed(0)
    first = _policy(tiny_model_dir)
    _update(first, _batch(tiny_model_dir, 1))  # the update's shuffle seed is seed + step
    first.engine.save_state(str(tmp_path / "actor"), tokenizer_source=str(tiny_model_dir))
    metrics_a = _update(first, _batch(tiny_model_dir, 2))
    noise_a = torch.rand(3)

    second = _policy(tiny_model_dir)
    torch.manual_seed(123)  # a different RNG state before loading: load must restore it
    second.engine.load_state(str(tmp_path / "actor"))
    assert second.engine.optimizer_steps == 1 and second.engine.scheduler.last_epoch == 1
    metrics_b = _update(second, _batch(tiny_model_dir, 2))
    noise_b = torch.rand(3)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"):
        assert metrics_a[key] == metrics_b[key], key
    for (name, a), b in zip(first.engine.model.state_dict().items(), second.engine.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(noise_a, noise_b)
    # the actor folder is a loadable HF model (config + tokenizer + safetensors, no pickle)
    assert {"model.safetensors", "optimizer.pt", "rank_0.pt", "config.json", "generation_config.json",
            "tokenizer.json"} <= {p.name for p in (tmp_path / "actor").iterdir()}
    torch.load(tmp_path / "actor" / "optimizer.pt", weights_only=True)
