"""Video rows as users have them on disk, run unchanged through `python -m rlframe.main` for 2 steps on the
tiny random Qwen2.5-VL (HF rollout, Ray, the update, the weight sync): a verl-layout parquet
(``videos: [{"video": path, "fps", "max_frames"}]``, a chat-list prompt, reward_model.ground_truth) and an
EasyR1-layout one (``videos: [path]``, a plain ``problem`` string with ``<video>``, an ``answer`` column).
The recipe itself (generated clips) runs in tests/test_recipes.py -k grpo_video_shapes.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT, read_metrics, run_main

LENGTH_REWARD = "reward.functions=[{path: " + str(REPO_ROOT / "tests" / "length_reward.py") + ", name: compute_score}]"
RUN = ["recipe=grpo_video_shapes", "trainer.total_steps=2", "data.max_response_length=8", "data.train_batch_size=2",
       "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_device=4", "rollout.n=2", "data.val_max_samples=2", "trainer.num_cpus=4",
       LENGTH_REWARD, "actor.optim.lr=1e-3"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from rlframe.data.video_shapes import generate_video_shapes_dataset

    return generate_video_shapes_dataset(tmp_path_factory.mktemp("clips"), n_train=4, n_val=2)


def easyr1_copy(src, dst):
    """The same rows in EasyR1's layout: problem (a string with <video>), answer, videos (a list of paths)."""
    rows = [{"problem": row["prompt"][0]["content"], "answer": row["reward_model"]["ground_truth"],
             "videos": [item["video"] for item in row["videos"]]} for row in pq.read_table(src).to_pylist()]
    pq.write_table(pa.Table.from_pylist(rows), dst)
    return dst


@pytest.mark.parametrize("layout", ["verl", "easyr1"])
def test_video_parquet_runs_2_steps_unchanged(layout, clips, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    train, val = clips
    args = list(RUN)
    if layout == "easyr1":  # next to the clips: the relative paths resolve from the data file's folder
        train = easyr1_copy(train, train.parent / "train_easyr1.parquet")
        val = easyr1_copy(val, val.parent / "val_easyr1.parquet")
        args += ["data.prompt_key=problem", "data.answer_key=answer", "data.video_fps=2.0"]
    run_dir = tmp_path / "run"
    result = run_main([*args, f"data.train_files={train}", f"data.val_files={val}", f"trainer.run_dir={run_dir}"],
                      cwd=tmp_path, timeout=300)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-5000:]}"
    trained = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2]
    for step in trained:
        # the engine (HF generate, with the frames and their times) and the trainer agree on the sampled tokens
        assert step["rollout/logprob_abs_diff"] < 1e-4, step
        assert step["actor/grad_norm"] > 0
    assert trained[1]["actor/kl_loss"] > 0  # step 2 sampled from the synced, updated weights
