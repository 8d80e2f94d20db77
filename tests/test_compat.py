"""verl- and EasyR1-style command lines resolve to the expected rlframe config, with notices."""

from __future__ import annotations

import pytest

from rlframe.compat import CompatError, translate_overrides
from rlframe.main import UsageError, compose_config


def test_verl_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    for name in ("train", "test"):
        (tmp_path / "data" / "gsm8k" / f"{name}.parquet").write_bytes(b"")
    reward = tmp_path / "my_reward.py"
    reward.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                      "    return scale * float(solution_str.strip() == str(ground_truth))\n")
    cfg = compose_config([
        "recipe=grpo_math",
        "algorithm.adv_estimator=grpo",
        "data.train_files=~/data/gsm8k/train.parquet",
        "data.val_files=~/data/gsm8k/test.parquet",
        "data.train_batch_size=16",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.002",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"custom_reward_function.path={reward}",
        "custom_reward_function.name=my_score",
        "+custom_reward_function.reward_kwargs.scale=2.0",
        "trainer.logger=['console','wandb']",
        "trainer.project_name=verl_example",
        "trainer.save_freq=10",
        "trainer.test_freq=-1",
        "trainer.total_epochs=3",
    ])
    out = capsys.readouterr().out
    assert cfg.data.source == "files"
    assert cfg.data.train_files == [str(tmp_path / "data/gsm8k/train.parquet")]
    assert cfg.data.val_files == [str(tmp_path / "data/gsm8k/test.parquet")]
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.actor.optim.lr == 3e-6
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_device) == (8, 4)
    assert cfg.algorithm.use_kl_loss is True and cfg.algorithm.kl_loss_coef == 0.002
    assert cfg.rollout.engine == "vllm" and cfg.rollout.n == 5
    assert len(cfg.reward.functions) == 1
    fn = cfg.reward.functions[0]
    assert (fn.path, fn.name, fn.kwargs) == (str(reward), "my_score", {"scale": 2.0})
    assert cfg.trainer.loggers == ["console", "wandb"] and cfg.trainer.project_name == "verl_example"
    assert (cfg.trainer.save_every, cfg.trainer.val_every, cfg.trainer.total_epochs) == (10, 0, 3)
    for line in ("actor_rollout_ref.actor.optim.lr=3e-6 -> actor.optim.lr=3e-6",
                 "trainer.save_freq=10 -> trainer.save_every=10", "trainer.test_freq=-1 -> trainer.val_every=0",
                 "actor_rollout_ref.rollout.n=5 -> rollout.n=5", "custom_reward_function.path=",
                 "data.train_files given -> data.source=files", "trainer.total_epochs=3"):
        assert line in out, (line, out)


def test_easyr1_command_line(tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text("")
    cfg = compose_config([
        f"data.train_files={tmp_path}/*.jsonl",
        "data.rollout_batch_size=8",
        "data.format_prompt=./examples/format_prompt/math.jinja",
        "worker.actor.model.model_path=Qwen/Qwen2.5-7B-Instruct",
        "worker.actor.global_batch_size=4",
        "worker.actor.optim.lr=1e-6",
        "worker.rollout.n=4",
        "worker.reward.reward_function=./examples/reward_function/math.py:compute_score",
        "algorithm.disable_kl=True",
        "trainer.max_steps=7",
        "trainer.val_freq=5",
        "trainer.save_freq=-1",
    ])
    out = capsys.readouterr().out
    assert cfg.data.train_files == [str(train)] and cfg.data.source == "files"
    assert cfg.data.train_batch_size == 8 and cfg.actor.ppo_mini_batch_size == 4
    assert cfg.data.prompt_template == "./examples/format_prompt/math.jinja"
    assert cfg.model.path == "Qwen/Qwen2.5-7B-Instruct" and cfg.actor.optim.lr == 1e-6 and cfg.rollout.n == 4
    assert (cfg.reward.functions[0].path, cfg.reward.functions[0].name) == ("examples/reward_function/math.py",
                                                                            "compute_score")
    assert cfg.algorithm.use_kl_loss is False
    assert (cfg.trainer.total_steps, cfg.trainer.val_every, cfg.trainer.save_every) == (7, 5, 0)
    assert "algorithm.disable_kl=True -> algorithm.use_kl_loss=false" in out


def test_image_keys_map_to_the_image_fields():
    translated, _ = translate_overrides(["data.image_key=pics", "data.max_pixels=4194304", "data.min_pixels=262144",
                                         "worker.actor.model.freeze_vision_tower=true"])
    assert translated == ["data.image_key=pics", "data.max_pixels=4194304", "data.min_pixels=262144",
                          "actor.freeze_vision_tower=true"]


def test_peer_key_without_equivalent_names_closest():
    # (data.video_key translates since videos are read: rlframe/data/video.py)
    assert translate_overrides(["data.video_key=clips", "data.video_fps=1.0"])[0] == ["data.video_key=clips",
                                                                                   "data.video_fps=1.0"]
    assert translate_overrides(["data.audio_key=sounds"])[0] == ["data.audio_key=sounds"]  # verl's (rlframe/data/audio.py)
    with pytest.raises(CompatError, match=r"tensor_model_parallel_size=2.*rollout.world_size"):
        translate_overrides(["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    with pytest.raises(CompatError, match=r"actor_rollout_ref.actor.foo_bar.*no translation"):
        translate_overrides(["actor_rollout_ref.actor.foo_bar=1"])


def test_unknown_key_gets_did_you_mean_never_plus_hint():
    with pytest.raises(UsageError) as err:
        compose_config(["actor.lrr=1"])
    message = str(err.value)
    assert "unknown config key 'actor.lrr'" in message and "Did you mean" in message
    assert "+actor" not in message
    with pytest.raises(UsageError, match=r"actor\.optim\.lr"):
        compose_config(["actor.optim.lrr=1"])
    # Our own keys, dicts under them, deletions and additions of known keys pass through.
    out, notices = translate_overrides(["actor.optim.lr=1e-6", "trainer.runtime_env.env_vars.FOO=1",
                                        "~trainer.run_dir", "data.train_files=[a.parquet]"])
    assert notices == [] and len(out) == 4


def test_data_source_conflict_is_an_error(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"")
    with pytest.raises(UsageError, match="data.source=arithmetic together with data.train_files"):
        compose_config([f"data.train_files={tmp_path}/a.parquet", "data.source=arithmetic"])


def test_gpus_per_node_times_nodes_is_the_world_size():
    out, notices = translate_overrides(["trainer.n_gpus_per_node=8", "trainer.nnodes=2"])
    assert out == ["actor.world_size=16", "trainer.devices_per_node=8", "trainer.nnodes=2"]
    assert notices == ["trainer.n_gpus_per_node=8 -> actor.world_size=16, trainer.devices_per_node=8"]
    assert translate_overrides(["trainer.n_gpus_per_node=2"])[0] == ["actor.world_size=2"]
