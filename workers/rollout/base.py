"""What every rollout engine offers and returns, and the helpers that build its output from token lists.

A rollout engine has two methods: `generate(prompts, sampling) -> DataProto` (the layout of
`build_rollout_batch`) and `load_weights(iterable of (HF name, tensor)) -> tensors loaded`;
optionally `sleep()` (free device memory while the trainer trains). `workers/rollout/factory.py`
builds the configured one.
"""

from __future__ import annotations

import dataclasses

import torch

from rlframe.protocol import DataProto, build_rollout_batch  # noqa: F401  (the engines' output layout)


def eos_and_pad_ids(model_path: str, trust_remote_code: bool = False) -> tuple[list[int], int]:
    """The EOS ids (tokenizer's and generation config's) and the pad id (EOS when there is none)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    eos = {tokenizer.eos_token_id}
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    except OSError:
        pass
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return sorted(e for e in eos if e is not None), pad


def unpadded_prompts(prompts: DataProto) -> list[list[int]]:
    """Token ids of each left-padded prompt without its padding."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def generate_sequences(engine, settings, prompts: DataProto, rank: int) -> DataProto:
    """Generate for `prompts` with the sampling its meta_info asks for (training, `validate`, `greedy`).

    Training samples are seeded per step and data-parallel rank, so a step draws the same samples
    whatever the placement (colocated or disaggregated engines). `settings`: RolloutSettings.
    """
    import time

    meta = prompts.meta_info
    if meta.get("greedy", False):  # one greedy sample per prompt (ReMax's baseline)
        sampling = settings.greedy()
    elif meta.get("validate", False):
        sampling = settings.validation
    else:
        sampling = settings.train
        if "max_new_tokens" in meta:  # a partial rollout's round budget (rlframe/trainer/partial.py)
            sampling = dataclasses.replace(sampling, max_new_tokens=int(meta["max_new_tokens"]))
        if "step" in meta:
            torch.manual_seed(settings.seed * 1_000_003 + int(meta["step"]) * 1_009 + rank)
    start = time.perf_counter()
    if getattr(settings, "agent_program", None) is not None:  # a user's agent through the gateway
        from rlframe.workers.rollout.agent_program import agent_episodes_for

        out = agent_episodes_for(engine, settings, eos_and_pad_ids).run(prompts, sampling, meta)
    elif getattr(settings, "multi_turn", None) is None:
        out = engine.generate(prompts, sampling)
    else:  # multi-turn rollouts with tools (workers/rollout/agent_loop.py)
        from rlframe.workers.rollout.agent_loop import agent_loop_for

        out = agent_loop_for(engine, settings, eos_and_pad_ids).run(prompts, sampling)
    out.meta_info["timing/generate_rank0"] = time.perf_counter() - start
    out.meta_info["perf/generated_tokens"] = float(out.batch["response_mask"].sum())
    return out
