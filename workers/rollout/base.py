"""What every rollout engine returns, and the helpers that build it from token lists."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlframe.protocol import DataProto


@dataclass
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def unpadded_prompts(prompts: DataProto) -> list[list[int]]:
    """Token ids of each left-padded prompt without its padding."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def build_rollout_batch(prompts: DataProto, responses: list[list[int]], log_probs: list[list[float]],
                        response_width: int, pad_token_id: int) -> DataProto:
    """Pack generated responses next to their left-padded prompts.

    Returns prompts [B,P], responses [B,R] (right-padded), input_ids / attention_mask /
    position_ids [B,P+R], response_mask [B,R] (1 on generated tokens, EOS included) and
    rollout_log_probs [B,R] (the engine's log-probs of the sampled tokens).
    """
    batch_size = len(responses)
    response_ids = torch.full((batch_size, response_width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((batch_size, response_width), dtype=torch.float32)
    rollout_log_probs = torch.zeros((batch_size, response_width), dtype=torch.float32)
    for i, (tokens, lps) in enumerate(zip(responses, log_probs)):
        tokens = tokens[:response_width]
        response_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[i, : len(tokens)] = 1.0
        rollout_log_probs[i, : len(tokens)] = torch.tensor(lps[: len(tokens)], dtype=torch.float32)
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
    })
