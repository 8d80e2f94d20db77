"""Audio rows as users have them on disk, run unchanged through `python -m rlframe.main` for 2 steps on the
tiny random Qwen2-Audio (HF rollout, Ray, the update, the weight sync): a verl-layout parquet (``audios:
[path]`` to 8 kHz .wav files, a chat-list prompt with ``<audio>``, reward_model.ground_truth) and the same rows
with the audio inline (``audios: [{"array": [...], "sampling_rate": 8000}]``).
The recipe itself (generated tones, vLLM where installed) runs in tests/test_recipes.py -k grpo_audio_tones;
this file keeps the HF rollout (`rollout.engine=hf`) so that its audio path stays tested where vLLM is
installed too; tests/test_audio_vllm.py runs the vLLM rollout explicitly.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT, read_metrics, run_main

LENGTH_REWARD = "reward.functions=[{path: " + str(REPO_ROOT / "tests" / "length_reward.py") + ", name: compute_score}]"
RUN = ["recipe=grpo_audio_tones", "trainer.total_steps=2", "data.max_response_length=8", "data.train_batch_size=2",
       "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_device=4", "rollout.n=2", "data.val_max_samples=2",
       "trainer.num_cpus=4", LENGTH_REWARD, "actor.optim.lr=1e-3", "rollout.engine=hf"]


@pytest.fixture(scope="module")
def tones(tmp_path_factory):
    from rlframe.data.audio_tones import generate_audio_tones_dataset

    return generate_audio_tones_dataset(tmp_path_factory.mktemp("tones"), n_train=4, n_val=2)


def inline_copy(src, dst):
    """The same rows with each audio inline: {"array": samples, "sampling_rate": rate} (a decoded datasets Audio)."""
    from rlframe.data.audio import decode_audio

    rows = pq.read_table(src).to_pylist()
    for row in rows:
        arrays = [decode_audio(path, "audios", src.parent, target=None) for path in row["audios"]]
        row["audios"] = [{"array": x.tolist(), "sampling_rate": rate} for x, rate in arrays]
    pq.write_table(pa.Table.from_pylist(rows), dst)
    return dst


@pytest.mark.parametrize("layout", ["paths", "arrays"])
def test_audio_parquet_runs_2_steps_unchanged(layout, tones, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    train, val = tones
    if layout == "arrays":
        train = inline_copy(train, tmp_path / "train_inline.parquet")
        val = inline_copy(val, tmp_path / "val_inline.parquet")
    run_dir = tmp_path / "run"
    result = run_main([*RUN, f"data.train_files={train}", f"data.val_files={val}", f"trainer.run_dir={run_dir}"],
                      cwd=tmp_path, timeout=300)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-3000:]}\nSTDERR:\n{result.stderr[-5000:]}"
    trained = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2]
    for step in trained:
        # the engine (HF generate, with the audio features) and the trainer agree on the sampled tokens
        assert step["rollout/logprob_abs_diff"] < 1e-4, step
        assert step["actor/grad_norm"] > 0
    assert trained[1]["actor/kl_loss"] > 0  # step 2 sampled from the synced, updated weights
