"""The actor's update on the DeepSpeed engine (ZeRO-2 / ZeRO-3, optionally CPU Adam) vs the FSDP engine.

    python examples/benchmark/deepspeed_vs_fsdp.py                  # SmolLM2-135M, one CPU process
    python examples/benchmark/deepspeed_vs_fsdp.py --model /path/to/hf_model --rows 32 --response 48

What differs between `recipe=grpo_math` and `recipe=grpo_math_deepspeed` is only the trainer engine:
rollout, rewards and validation are the same code. This times what the engine does per GRPO step,
`compute_log_prob` and one `update_actor` (forward + backward + optimizer step) on the same
synthetic rollout batch, for each engine in one process (world size 1; DeepSpeed over a one-rank
gloo group). Rounds are interleaved (FSDP, ZeRO-2, ..., FSDP, ZeRO-2, ...) so that other load on
the machine hits every engine alike; the median round is reported, and the engines' losses must agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from rlframe.protocol import DataProto


def rollout_batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0) -> DataProto:
    """A GRPO-shaped batch: left-padded prompts, right-padded responses, advantages per sequence."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, prompt), generator=g)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    responses = torch.randint(3, vocab, (rows, response), generator=g)
    response_mask = torch.ones(rows, response)
    for i in range(rows):  # varied lengths, as sampled responses are
        prompt_mask[i, : int(torch.randint(0, prompt // 3, (1,), generator=g))] = 0
        response_mask[i, int(torch.randint(response // 2, response + 1, (1,), generator=g)):] = 0
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return DataProto.from_dict(tensors={
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, response).contiguous() * response_mask,
        "ref_log_prob": -torch.rand(rows, response, generator=g) * 3,
    }, meta_info={"step": 1})


def build_actor(model: str, strategy: str, zero_stage: int, adam_offload: bool, rows: int, micro: int):
    from rlframe.config import RLConfig
    from rlframe.trainer.worker_settings import actor_settings
    from rlframe.workers.roles.actor_rollout import ActorRolloutWorker

    cfg = RLConfig()
    cfg.trainer.device, cfg.rollout.engine = "cpu", "hf"
    cfg.rollout.n = 8
    cfg.actor.strategy = strategy
    cfg.actor.ppo_mini_batch_size = rows // cfg.rollout.n  # the whole batch: one optimiser step
    cfg.actor.ppo_micro_batch_size_per_device = micro
    cfg.actor.optim.lr = 1e-5
    cfg.algorithm.use_kl_loss, cfg.algorithm.kl_loss_coef = True, 0.001
    cfg.deepspeed.zero_stage, cfg.deepspeed.adam_offload = zero_stage, adam_offload
    return ActorRolloutWorker(dataclasses.replace(actor_settings(cfg, model), rollout=None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=32, help="sequences per update (4 prompts x 8 samples)")
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from rlframe.models.provision import resolve_model_path

    model = resolve_model_path(args.model)
    engines = {"fsdp": ("fsdp", 2, False), "deepspeed zero2": ("deepspeed", 2, False),
               "deepspeed zero3": ("deepspeed", 3, False), "deepspeed zero2 + cpu adam": ("deepspeed", 2, True)}
    actors = {name: build_actor(model, *spec, rows=args.rows, micro=args.micro) for name, spec in engines.items()}
    vocab = next(iter(actors.values())).engine.model.config.vocab_size
    times: dict[str, list[float]] = {name: [] for name in engines}
    losses: dict[str, list[float]] = {name: [] for name in engines}
    print(f"{args.rows} sequences of <= {args.prompt} + {args.response} tokens, micro-batch {args.micro}, "
          f"{torch.get_num_threads()} threads; {args.rounds} interleaved rounds")
    for round_index in range(args.rounds):
        batch = rollout_batch(vocab, args.rows, args.prompt, args.response, seed=round_index)
        for name, actor in actors.items():
            begin = time.perf_counter()
            data = batch[list(range(len(batch)))]  # (a copy: union writes into it)
            data.union(actor.compute_log_prob(data).select(["old_log_probs"]))
            metrics = actor.update_actor(data).meta_info["metrics"]
            times[name].append(time.perf_counter() - begin)
            losses[name].append(metrics["actor/pg_loss"] + metrics["actor/kl_loss"])
            print(f"  round {round_index} {name:28s} {times[name][-1]:7.2f} s  loss {losses[name][-1]:+.6f}")
    reference = statistics.median(times["fsdp"])
    for name in engines:
        median = statistics.median(times[name])
        print(f"{name:28s} median {median:7.2f} s per log-prob pass + update  (x{median / reference:4.2f} of fsdp)")
    for name in engines:
        drift = max(abs(a - b) for a, b in zip(losses[name], losses["fsdp"]))
        print(f"{name:28s} max |loss - fsdp loss| over the rounds: {drift:.2e}")


if __name__ == "__main__":
    main()
