"""Partial rollouts (rollout.partial): a long response is generated over several steps, a budget at a time.

Each generation call ("round") gives every unfinished response at most `budget` new tokens. The engine
gets the response so far as part of its prompt -- token ids in, token ids out, never re-tokenised:

    engine input  = [left pad] prompt partial                    (prompt + the tokens generated so far)
    engine output = continuation                                 (<= budget tokens, EOS included)
    response      = partial + continuation                       (trained once it has finished)

so a response cut at one step continues at a later step with the weights of that step. Every token
keeps the log-prob the engine gave it and the policy version (actor updates applied) of the weights that
produced it: `rollout_log_probs` and `token_policy_version` [B, R]. The off-policy correction (truncated IS,
rlframe/algos/off_policy.py) weighs each token by min(pi_old / mu_t, C) with mu_t the log-prob of the
version that sampled it, so a response whose tokens came from several versions is corrected token by token.

The pool (GRPO groups stay whole):
- each step draws one batch of prompts (the first step 1 + oversample_batches), n samples each, into the pool;
- a round continues every unfinished sample in the pool; a step runs one round, and more only while fewer
  than `batch_size` groups have all n samples finished;
- the step trains `batch_size` finished groups, those with the oldest tokens first; the rest stay in the pool
  (held back: unfinished ones are continued next step, finished ones wait their turn);
- a group is never trained with a token more than `max_token_staleness` versions behind the trainer: before a
  step generates, each group that would be is restarted from its prompt (partial/restarted_groups).

The driver (rlframe/trainer/rl_trainer.py) calls `draw` / `expire` / `requests` / `absorb` / `take_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlframe.protocol import DataProto
from rlframe.rng import sample_seed
from rlframe.protocol import build_rollout_batch


@dataclass
class PartialSample:
    """One response of one prompt group, as far as it has been generated."""

    group: str  # the prompt's uid (a GRPO group: its n samples)
    index: int  # the sample's index in its group
    prompt: list[int]  # the prompt's token ids, no padding
    row: dict  # the prompt's non-tensor fields (uid, ground_truth, data_source, ...)
    tokens: list[int] = field(default_factory=list)  # the response so far
    log_probs: list[float] = field(default_factory=list)  # the engine's log-prob of each token
    versions: list[int] = field(default_factory=list)  # the policy version that generated each token
    steps: list[int] = field(default_factory=list)  # the step whose generation produced each token
    finished: bool = False

    def restart(self) -> None:
        self.tokens, self.log_probs, self.versions, self.steps, self.finished = [], [], [], [], False


class PartialRolloutPool:
    """The held-back responses between steps and the rules above; pure bookkeeping on token lists."""

    def __init__(self, *, batch_size: int, group_size: int, budget: int, response_length: int,
                 max_token_staleness: int, oversample_batches: int, eos_token_ids: list[int], pad_token_id: int,
                 seed: int = 0, seed_each_sample: bool = True):
        self.batch_size, self.group_size, self.budget = batch_size, group_size, budget
        self.response_length, self.max_token_staleness = response_length, max_token_staleness
        self.oversample_batches = oversample_batches
        self.eos, self.pad_token_id, self.seed = set(eos_token_ids), pad_token_id, seed
        self.seed_each_sample = seed_each_sample  # rollout.seed_each_sample: a sampling seed per request
        self.groups: dict[str, list[PartialSample]] = {}  # insertion order: the order they were drawn
        self.step_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ filling the pool
    def batches_to_draw(self) -> int:
        """Prompt batches to draw before this step's generation: the pool holds (1 + oversample) batches' groups."""
        wanted = (1 + self.oversample_batches) * self.batch_size
        return max(0, -(-(wanted - len(self.groups)) // self.batch_size))

    def draw(self, rows: DataProto, prompts: DataProto) -> None:
        """Add new prompts: `rows` their non-tensor fields (uid, ground_truth, ...), `prompts` their left-padded
        input_ids / attention_mask; one row per prompt (not yet repeated n times)."""
        if "multi_modal_data" in prompts.non_tensor_batch or "multi_modal_inputs" in rows.non_tensor_batch:
            raise ValueError("rollout.partial does not continue responses to image prompts. Fix: rollout.partial.enable=false")
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        nt = rows.non_tensor_batch
        for i in range(len(rows)):
            row = {key: values[i] for key, values in nt.items()}
            group = str(row["uid"])
            prompt = ids[i][mask[i]].tolist()
            self.groups[group] = [PartialSample(group, k, prompt, row) for k in range(self.group_size)]

    def expire(self, train_version: int) -> int:
        """Restart every group that, trained by weights of `train_version`, would hold a token more than
        max_token_staleness versions older; returns how many groups were restarted."""
        restarted = 0
        for samples in self.groups.values():
            oldest = min((min(s.versions) for s in samples if s.versions), default=None)
            if oldest is not None and train_version - oldest > self.max_token_staleness:
                for sample in samples:
                    sample.restart()
                restarted += 1
        self.step_stats = {"partial/restarted_groups": float(restarted), "partial/rounds": 0.0,
                           "partial/generated_tokens": 0.0}
        return restarted

    # ------------------------------------------------------------------ one round
    def unfinished(self) -> list[PartialSample]:
        return [s for samples in self.groups.values() for s in samples if not s.finished]

    def requests(self, samples: list[PartialSample], step: int, round_index: int) -> DataProto:
        """The engine's input for `samples`: prompt + partial response, left-padded; meta_info max_new_tokens
        (the round's budget) and a sampling seed per sample (from the run seed, step, round, uid, index)."""
        sequences = [s.prompt + s.tokens for s in samples]
        width = max(len(seq) for seq in sequences)
        input_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            attention_mask[i, width - len(seq):] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        out = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                                           "position_ids": position_ids})
        if self.seed_each_sample:
            seeds = [sample_seed(self.seed, step, f"{s.group}/round{round_index}", s.index) for s in samples]
            out.non_tensor_batch["sample_seed"] = np.array(seeds, dtype=np.int64)
        # the engines seed their torch RNG from meta "step": a different stream for each round of a step
        out.meta_info.update(step=step * 1_000 + round_index, max_new_tokens=self.budget, update_follows=False)
        return out

    def absorb(self, samples: list[PartialSample], generated: DataProto, version: int, step: int) -> None:
        """Append each sample's continuation (rows of `generated` in the order of `samples`). `version`: the policy
        version of the weights that generated it (a disaggregated engine's own record, `policy_version`, wins)."""
        responses, mask = generated.batch["responses"], generated.batch["response_mask"]
        log_probs = generated.batch["rollout_log_probs"]
        engine_versions = generated.non_tensor_batch.get("policy_version")
        if len(generated) != len(samples):
            raise RuntimeError(f"partial rollout: {len(samples)} requests, {len(generated)} responses")
        for i, sample in enumerate(samples):
            length = int(mask[i].sum())
            tokens, lps = responses[i, :length].tolist(), log_probs[i, :length].tolist()
            stopped = length < self.budget or (length > 0 and tokens[-1] in self.eos)  # EOS (engines stop there)
            room = self.response_length - len(sample.tokens)
            tokens, lps = tokens[:room], lps[:room]
            v = int(engine_versions[i]) if engine_versions is not None else version
            sample.tokens += tokens
            sample.log_probs += lps
            sample.versions += [v] * len(tokens)
            sample.steps += [step] * len(tokens)
            sample.finished = stopped or len(sample.tokens) >= self.response_length
            self.step_stats["partial/generated_tokens"] = self.step_stats.get("partial/generated_tokens", 0.0) + len(tokens)
        self.step_stats["partial/rounds"] = self.step_stats.get("partial/rounds", 0.0) + 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, exclude: set[str] = frozenset()) -> dict:
        """The held-back responses as JSON-ready lists (for the checkpoint's driver_state.json), without the groups
        in `exclude` (those drawn for a generation still in flight: a resumed run draws them again)."""
        return {"groups": [[{**vars(s), "row": {k: _json_ready(v) for k, v in s.row.items()}} for s in samples]
                           for group, samples in self.groups.items() if group not in exclude]}

    def load_state_dict(self, state: dict) -> None:
        self.groups = {samples[0]["group"]: [PartialSample(**sample) for sample in samples]
                       for samples in state["groups"]}

    # ------------------------------------------------------------------ the step's batch
    def ready_groups(self) -> list[str]:
        """Groups whose n samples have all finished, the oldest tokens first (then the order drawn)."""
        ready = [g for g, samples in self.groups.items() if all(s.finished for s in samples)]
        order = {g: i for i, g in enumerate(self.groups)}
        return sorted(ready, key=lambda g: (min(min(s.versions, default=1 << 62) for s in self.groups[g]), order[g]))

    def take_batch(self, train_version: int, step: int) -> tuple[DataProto, dict[str, float]]:
        """Remove batch_size finished groups from the pool and lay them out as one rollout batch, the samples of a
        group together: the layout of protocol.py's build_rollout_batch (prompts left-padded, responses
        right-padded to response_length) + token_policy_version [B, R] (-1 on padding) + per sample
        policy_version (its oldest token's version) and the prompt's non-tensor fields."""
        chosen = self.ready_groups()[: self.batch_size]
        if len(chosen) < self.batch_size:
            raise RuntimeError(f"partial rollout: {len(chosen)} finished groups, {self.batch_size} needed")
        samples = [s for g in chosen for s in self.groups.pop(g)]
        width = max(len(s.prompt) for s in samples)
        prompt_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            prompt_ids[i, width - len(s.prompt):] = torch.tensor(s.prompt, dtype=torch.long)
            prompt_mask[i, width - len(s.prompt):] = 1
        prompts = DataProto.from_dict(tensors={"input_ids": prompt_ids, "attention_mask": prompt_mask})
        batch = build_rollout_batch(prompts, [s.tokens for s in samples], [s.log_probs for s in samples],
                                    self.response_length, self.pad_token_id)
        versions = torch.full((len(samples), self.response_length), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            versions[i, : len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
        batch.batch["token_policy_version"] = versions
        for key in samples[0].row:
            column = np.empty(len(samples), dtype=object)  # (elements may be lists: the chat prompt)
            for i, s in enumerate(samples):
                column[i] = s.row[key]
            batch.non_tensor_batch[key] = column
        batch.non_tensor_batch["policy_version"] = np.array([min(s.versions, default=train_version) for s in samples],
                                                            dtype=np.int64)
        return batch, self.metrics(samples, train_version, step)

    def metrics(self, trained: list[PartialSample], train_version: int, step: int) -> dict[str, float]:
        """partial/*: what was held back and carried over, and how stale the trained tokens are."""
        held_back = [s for samples in self.groups.values() for s in samples]
        staleness = [train_version - v for s in trained for v in s.versions]
        carried = [s for s in trained if s.steps and s.steps[0] < step]  # begun by an earlier step's generation
        if staleness and (max(staleness) > self.max_token_staleness or min(staleness) < 0):
            raise RuntimeError(f"step {step}: token staleness {min(staleness)}..{max(staleness)} outside "
                               f"[0, rollout.partial.max_token_staleness={self.max_token_staleness}]")
        return {**self.step_stats,
                "partial/held_back_responses": float(len(held_back)),
                "partial/held_back_unfinished": float(sum(not s.finished for s in held_back)),
                "partial/held_back_tokens": float(sum(len(s.tokens) for s in held_back)),
                "partial/carried_frac": len(carried) / len(trained),
                "partial/carried_tokens": float(sum(t < step for s in trained for t in s.steps)),
                "partial/mixed_version_frac": sum(len(set(s.versions)) > 1 for s in trained) / len(trained),
                "partial/token_staleness_max": float(max(staleness, default=0)),
                "partial/token_staleness_mean": float(np.mean(staleness)) if staleness else 0.0}


def _json_ready(value):
    """numpy scalars and arrays -> Python numbers and lists (a prompt row's fields, for JSON)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def pool_from_config(cfg, model_path: str) -> PartialRolloutPool | None:
    """The pool for rollout.partial.enable (None when off). (A vision-language policy was refused before the
    workers started: rlframe.config.rollout.partial_policy_is_text_only.)"""
    if not cfg.rollout.partial.enable:
        return None
    from rlframe.config import partial_tokens_per_round
    from rlframe.workers.rollout.base import eos_and_pad_ids

    eos_ids, pad_id = eos_and_pad_ids(model_path, cfg.model.trust_remote_code)
    partial = cfg.rollout.partial
    return PartialRolloutPool(batch_size=cfg.data.train_batch_size, group_size=cfg.rollout.n,
                              budget=partial_tokens_per_round(cfg), response_length=cfg.data.max_response_length,
                              max_token_staleness=partial.max_token_staleness,
                              oversample_batches=partial.oversample_batches, eos_token_ids=eos_ids,
                              pad_token_id=pad_id, seed=cfg.trainer.seed,
                              seed_each_sample=cfg.rollout.seed_each_sample)
