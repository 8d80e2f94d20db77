"""The HF engine's sampling is seeded as vLLM's is (issue 44): per step, and per sample (`rollout.seed_each_sample`).

The synchronous loop's prompts carry the step (`split_prompts` kept only the tensors, so the engines never seeded
the step); a row with a `sample_seed` is drawn from its own generator (`SeededSampling`), so its tokens depend on
that seed alone: not on the other rows, their order or the process's torch RNG. Two HF-engine runs of one seed,
end to end, give equal per-step metrics.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CPU_DEVICE, read_metrics, run_main, TINY_RUN_OVERRIDES

from rlframe.protocol import DataProto


def prompt_batch(rows: list[list[int]], pad: int) -> DataProto:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def test_split_prompts_keeps_the_step_the_engines_seed_from():
    from rlframe.config import RLConfig
    from rlframe.trainer.validation import split_prompts

    batch = prompt_batch([[5, 6, 7], [8, 9]], pad=0)
    batch.meta_info["step"] = 7
    assert split_prompts(batch, RLConfig()).meta_info["step"] == 7


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoTokenizer

    from rlframe.workers.rollout.hf_rollout import HFRollout
    from rlframe.workers.settings import DeviceRequest

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFRollout(str(tiny_model_dir), DeviceRequest(**CPU_DEVICE).profile(), eos_token_ids=[tok.eos_token_id],
                     pad_token_id=tok.pad_token_id), tok.pad_token_id


def generate(engine, rows, seeds, torch_seed: int, **sampling):
    from rlframe.workers.settings import SamplingSettings

    rollout, pad = engine
    prompts = prompt_batch(rows, pad)
    prompts.non_tensor_batch["sample_seed"] = np.array(seeds, dtype=np.int64)
    torch.manual_seed(torch_seed)  # whatever the process's RNG holds, a seeded row does not read it
    out = rollout.generate(prompts, SamplingSettings(max_new_tokens=12, **{"temperature": 1.0, **sampling}))
    return [row[mask.bool()].tolist() for row, mask in zip(out.batch["responses"], out.batch["response_mask"])]


def test_a_seeded_row_depends_on_its_seed_alone(engine):
    a, b = [11, 12, 13, 14], [21, 22, 23, 24]  # equal lengths: the same padding in either order
    first = generate(engine, [a, b], [101, 202], torch_seed=0)
    swapped = generate(engine, [b, a], [202, 101], torch_seed=12345)
    assert first == swapped[::-1]
    assert generate(engine, [a, a], [101, 101], torch_seed=7)[1] == first[0]
    other = generate(engine, [a, a], [303, 404], torch_seed=0)
    assert other[0] != first[0] or other[1] != first[0]  # another seed, another draw (a 12-token tie is ~impossible)
    assert generate(engine, [a, b], [101, 202], torch_seed=0, top_k=5, top_p=0.9) != first  # the warpers apply


def test_seeded_sampling_draws_from_the_warped_distribution():
    """Gumbel-max with temperature and top-k: the frequencies over many seeds are softmax(z / T) on the top k."""
    from rlframe.workers.rollout.hf_rollout import SeededSampling
    from rlframe.workers.settings import SamplingSettings

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = 4000
    sampler = SeededSampling(SamplingSettings(max_new_tokens=1, temperature=0.7, top_k=3), range(draws), "cpu")
    picked = sampler(torch.zeros((draws, 1), dtype=torch.long), logits.repeat(draws, 1)).argmax(-1)
    frequencies = torch.bincount(picked, minlength=5).double() / draws
    expected = torch.zeros(5, dtype=torch.double)
    expected[:3] = torch.softmax(logits[:3].double() / 0.7, dim=0)
    assert torch.allclose(frequencies, expected, atol=0.03), (frequencies, expected)


def comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "perf/", "memory/")) and "seconds" not in k
             and not k.endswith("_s")} for m in metrics]


def test_two_hf_engine_runs_of_one_seed_give_equal_per_step_metrics(tmp_path, tiny_model_dir):
    runs = []
    for name in ("first", "second"):
        run_dir = tmp_path / name
        done = run_main(["recipe=grpo_math", *TINY_RUN_OVERRIDES, f"model.path={tiny_model_dir}",
                         f"trainer.run_dir={run_dir}", "rollout.engine=hf", "trainer.val_before_train=false",
                         "actor.optim.lr=1e-3"], cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
        runs.append(comparable(read_metrics(run_dir)))
    assert len(runs[0]) >= 2 and runs[0] == runs[1]
