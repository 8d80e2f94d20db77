"""The per-step metrics of multi-turn rollouts, from the per-row fields the agent loop writes (agent_*)."""

from __future__ import annotations

import numpy as np
import torch

from rlframe.protocol import AGENT_END_REASONS


def agent_metrics(non_tensors: dict, response_mask: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
    """Per-step metrics from the loop's per-row fields: turns, tool calls and errors per trajectory,
    the share ending by answer / turn limit / budget, context (tool) vs trained tokens per trajectory."""
    if "agent_turns" not in non_tensors:
        return {}
    turns = np.asarray(non_tensors["agent_turns"], dtype=float)
    calls = np.asarray(non_tensors["agent_tool_calls"], dtype=float)
    errors = np.asarray(non_tensors["agent_tool_errors"], dtype=float)
    ends = list(non_tensors["agent_end"])
    width = response_mask.size(1)
    response_tokens = attention_mask[:, -width:].float().sum(-1)
    trained = response_mask.float().sum(-1)
    metrics = {"agent/turns_mean": float(turns.mean()), "agent/tool_calls_mean": float(calls.mean()),
               "agent/tool_call_rate": float((calls > 0).mean()),
               "agent/tool_error_rate": float(errors.sum() / max(calls.sum(), 1.0)),
               "agent/trained_tokens_mean": float(trained.mean()),
               "agent/context_tokens_mean": float((response_tokens - trained).mean())}
    for by_tool in non_tensors.get("agent_calls_by_tool", []):
        for name, count in by_tool.items():
            metrics[f"agent/tool_calls/{name}"] = metrics.get(f"agent/tool_calls/{name}", 0.0) + count / len(turns)
    if "agent_continuous" in non_tensors:  # 1: continuous batching (vLLM), 0: rounds (HF)
        metrics["agent/continuous_batching"] = float(np.mean(np.asarray(non_tensors["agent_continuous"], dtype=float)))
    if "agent_env_errors" in non_tensors:
        metrics["agent/env_error_rate"] = float(np.mean([e > 0 for e in non_tensors["agent_env_errors"]]))
        metrics["agent/env_reward_mean"] = float(np.mean(np.asarray(non_tensors["agent_env_reward"], dtype=float)))
    for reason in AGENT_END_REASONS:
        metrics[f"agent/end_{reason}"] = float(np.mean([e == reason for e in ends]))
    return metrics
