"""The per-step metrics of multi-turn rollouts, from the per-row fields the agent loop writes (agent_*), and of a
user's agent program through the gateway (gateway_*: workers/rollout/agent_program.py)."""

from __future__ import annotations

import numpy as np
import torch

from rlframe.protocol import AGENT_END_REASONS


def agent_metrics(non_tensors: dict, response_mask: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
    """Per-step metrics from the loop's per-row fields: turns, tool calls and errors per trajectory,
    the share ending by answer / turn limit / budget, context (tool) vs trained tokens per trajectory."""
    if "gateway_calls" in non_tensors:
        return gateway_metrics(non_tensors, response_mask, attention_mask)
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


FAILURES = ("timeout", "crash", "no_result", "bad_answer", "spawn_error")
# gateway/refused/<kind> (docs/gateway.md, "Faults"): 400 malformed (a field, named in the answer), template (the chat
# template refused the messages), over_budget (past the chain's budget or the engine's context), engine_refused (the
# engine's submit refused the call); 401 unknown_key, late (the episode had ended); 404 not_found; 408 timeout (not
# received within read_timeout_s); 413 too_large (over max_body_bytes); 429 call_limit, token_budget (the episode's
# max_calls_per_episode / max_episode_tokens); 500 engine_error (the engine's step failed), internal (the gateway's
# own failure); 503 busy (max_connections open).
REFUSALS = ("malformed", "late", "over_budget", "unknown_key", "template", "not_found", "timeout", "too_large",
            "call_limit", "token_budget", "busy", "engine_refused", "engine_error", "internal")


def gateway_metrics(non_tensors: dict, response_mask: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
    """Per-step metrics of agent-program episodes (one row each): calls and tokens per episode, the calls merged
    into the row, failed episodes by reason (gateway/failed/<reason>: counts), refused calls by kind
    (gateway/refused/<kind>: counts, REFUSALS; late = after the episode ended), trained vs context tokens per row."""
    calls = np.asarray(non_tensors["gateway_calls"], dtype=float)
    unmerged = np.asarray(non_tensors["gateway_unmerged_calls"], dtype=float)
    failed = [str(f) for f in non_tensors["gateway_failed"]]
    width = response_mask.size(1)
    trained = response_mask.float().sum(-1)
    response_tokens = attention_mask[:, -width:].float().sum(-1)
    metrics = {"gateway/episodes": float(len(calls)), "gateway/calls_per_episode": float(calls.mean()),
               "gateway/merged_calls_per_row": float((calls - unmerged).mean()),
               "gateway/unmerged_calls": float(unmerged.sum()),
               "gateway/tool_calls_per_episode": float(np.mean(np.asarray(non_tensors["gateway_tool_calls"], dtype=float))),
               "gateway/prompt_tokens_per_episode": float(np.mean(np.asarray(non_tensors["gateway_prompt_tokens"], dtype=float))),
               "gateway/completion_tokens_per_episode": float(np.mean(
                   np.asarray(non_tensors["gateway_completion_tokens"], dtype=float))),
               "gateway/episode_seconds_mean": float(np.mean(np.asarray(non_tensors["gateway_seconds"], dtype=float))),
               "gateway/trained_tokens_mean": float(trained.mean()),
               "gateway/context_tokens_mean": float((response_tokens - trained).mean()),
               "gateway/failed_rate": float(np.mean([f != "" for f in failed]))}
    for reason in sorted(set(FAILURES) | {f for f in failed if f}):
        metrics[f"gateway/failed/{reason}"] = float(sum(f == reason for f in failed))
    refused: dict[str, float] = {kind: 0.0 for kind in REFUSALS}
    for by_kind in [*non_tensors.get("gateway_refused", []), *non_tensors.get("gateway_server_refused", [])]:
        for kind, count in by_kind.items():
            refused[kind] = refused.get(kind, 0.0) + count
    refused["unknown_key"] += float(np.sum(np.asarray(non_tensors.get("gateway_unknown_key_calls", [0]), dtype=float)))
    metrics.update({f"gateway/refused/{kind}": value for kind, value in refused.items()})
    if "agent_env_reward" in non_tensors:
        metrics["gateway/agent_reward_mean"] = float(np.mean(np.asarray(non_tensors["agent_env_reward"], dtype=float)))
    return metrics
