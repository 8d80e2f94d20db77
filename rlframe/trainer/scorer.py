"""The scorer: the rewards of a batch of responses, for training, validation, pair sampling and `rlframe.eval`.

    scores = scorer.start(batch, overlap=True)   # decode, then the reward functions in a background thread
    ...                                          # the log-prob passes run meanwhile
    metrics = scorer.join(batch, scores)         # token_level_scores (+ outcome_scores with overlong shaping)

A response's score = the rule-based reward functions' (reward.functions, through the RewardManager's process
pool) + reward_model.weight * the reward model's + a multi-turn environment's rewards; it is placed on the
response's last trained token (`last_trained_token`: multi-turn masks have holes where tool tokens sit), or
turn by turn (rollout.multi_turn.turn_rewards=per_turn). DAPO's overlong shaping adds its penalty there too.
With no reward function (`reward.functions=[]`: an environment or a reward model gives the reward) the
rule-based part is 0 and an environment's reward stands in for it (also in val/accuracy: reward >= 1).

With an LLM judge (reward.judge, rlframe/reward/judge.py; `Scorer.judge`, built by the driver) a training
sample's score adds reward.judge.weight * the judge's score, asked in the same scoring thread (so it overlaps
the log-prob passes too); a sample the judge gave no usable verdict is unscorable: column `scorable` False
(its judge part left out, never made up), so the advantage leaves it out of its group's baseline with
advantage 0 (rlframe/algos/advantages.py). Validation scores with the rule rewards only (val/* unchanged).

A reward function that fails on more than reward.max_failure_rate of its samples in each of
reward.max_failure_steps training batches in a row stops the run (`FailureWatch`): training on fallback
scores teaches nothing. The judge is watched the same way (its unscorable samples).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from rlframe.algos import overlong_penalty
from rlframe.config import RLConfig
from rlframe.protocol import DataProto
from rlframe.reward.manager import FunctionFailures, RewardError, RewardManager, RewardResult, RewardSpec

logger = logging.getLogger(__name__)


def last_trained_token(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] the position of each response's last trained token (mask > 0); 0 for a response with none.

    Not mask.sum() - 1: a multi-turn response holds tool tokens (mask 0) between its model turns."""
    positions = torch.arange(response_mask.size(-1), device=response_mask.device)
    return (positions * (response_mask > 0)).max(dim=-1).values


def reward_manager(cfg: RLConfig) -> RewardManager:
    """The user's reward functions (reward.functions), run in a process pool with reward.timeout_s."""
    return RewardManager(
        [RewardSpec(path=f.path, name=f.name, weight=f.weight, data_sources=f.data_sources, kwargs=dict(f.kwargs),
                    reward_type=f.reward_type) for f in cfg.reward.functions],
        num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s, batch_timeout_s=cfg.reward.batch_timeout_s,
        fallback_score=cfg.reward.fallback_score, fail_fast=cfg.reward.fail_fast, allow_no_functions=True,
        import_timeout_s=cfg.reward.import_timeout_s, max_output_bytes=cfg.reward.max_output_bytes)


JUDGE_LABEL = "reward.judge"  # the judge's entry among the reward functions' failures (FailureWatch)


class FailureWatch:
    """Stops a run whose reward function fails on nearly every sample: more than `max_rate` of the samples
    it scored failed, in each of `steps` training batches in a row (`max_rate` 1.0: never)."""

    def __init__(self, max_rate: float, steps: int):
        self.max_rate, self.steps = max_rate, steps
        self.streaks: dict[str, int] = {}
        self.first_errors: dict[str, str] = {}

    def observe(self, by_function: list[FunctionFailures]) -> None:
        """One training batch's failures per function; RewardError when a function's streak is complete."""
        for f in by_function:
            failing = f.scored > 0 and f.failed / f.scored > self.max_rate
            self.streaks[f.label] = self.streaks.get(f.label, 0) + 1 if failing else 0
            if failing:
                self.first_errors.setdefault(f.label, f.first_error or "")
            else:
                self.first_errors.pop(f.label, None)
            if self.streaks[f.label] >= self.steps:
                what = ("the LLM judge (reward.judge) gave no usable verdict" if f.label == JUDGE_LABEL
                        else f"reward function {f.label} failed")
                raise RewardError(
                    f"{what} on {f.failed} of {f.scored} samples in the last batch, and on "
                    f"more than {self.max_rate:.0%} of its samples in each of the last {self.steps} training "
                    f"batches (reward.max_failure_rate={self.max_rate:g}, reward.max_failure_steps={self.steps}): "
                    f"training on fallback scores teaches nothing, so the run stops. Its first failure:\n"
                    f"{self.first_errors[f.label]}\nFix the function (reward.num_workers=0 runs it in the "
                    f"driver, for a debugger), or set reward.max_failure_rate=1 to train on regardless")


_LOGGED: set[str] = set()


def log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def reported_accuracy(result: RewardResult) -> np.ndarray | None:
    """Per-response accuracy: the `acc` the reward functions report, or None when none reports one.

    One function: its `acc`. Several (keys `<label>/acc`): the mean of the ones that scored the
    response (NaN where none did, left out of the mean over responses); logged once.
    """
    keys = ["acc"] if "acc" in result.extras else sorted(k for k in result.extras if k.endswith("/acc"))
    if not keys:
        return None
    if keys != ["acc"]:
        log_once(f"accuracy: per response, the mean of {', '.join(keys)} over the functions that scored it")
    values = np.stack([result.extras[key].astype(float) for key in keys])
    reported = ~np.isnan(values)
    counts = reported.sum(axis=0)
    return np.where(counts > 0, np.where(reported, values, 0.0).sum(axis=0) / np.maximum(counts, 1), np.nan)


def validation_accuracy(result: RewardResult) -> np.ndarray:
    """What val/accuracy averages: the reported `acc`, else whether the rule-based reward is >= 1."""
    accuracy = reported_accuracy(result)
    if accuracy is None:
        log_once("no reward function returns an 'acc' key: val/accuracy is the share of responses whose "
                 "rule-based reward is >= 1")
        accuracy = (result.scores >= 1.0).astype(float)
    return accuracy


def place_scores_on_last_token(scores: np.ndarray, response_mask: torch.Tensor) -> torch.Tensor:
    """An outcome reward becomes a token-level reward on the last trained token (zero for an empty response)."""
    token_scores = torch.zeros_like(response_mask, dtype=torch.float32)
    last = last_trained_token(response_mask)
    token_scores[torch.arange(len(last)), last] = torch.as_tensor(scores, dtype=torch.float32)
    return token_scores * (response_mask.sum(-1, keepdim=True) > 0)


def place_turn_rewards(token_scores: torch.Tensor, turn_rewards, positions, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-turn credit (rollout.multi_turn.turn_rewards=per_turn): each environment reward moves from the
    last trained token (where the outcome placement put their sum) to the last token of the turn it judged.
    A row's total is unchanged, so outcome estimators (grpo, rloo, ...) see the same score; estimators
    that discount along the sequence (gae, reinforce_plus_plus with gamma < 1) credit each turn."""
    out = token_scores.clone()
    last = last_trained_token(response_mask)
    for i, (rewards, where) in enumerate(zip(turn_rewards, positions)):
        if response_mask[i].sum() == 0:
            continue
        for reward, position in zip(rewards, where):
            out[i, int(last[i])] -= float(reward)
            out[i, int(position)] += float(reward)
    return out


def overlong_penalties(response_mask: torch.Tensor, cfg: RLConfig) -> torch.Tensor | None:
    """DAPO overlong shaping: penalty_factor * overlong_penalty(length) per response [B]; None when off."""
    buffer = cfg.algorithm.overlong_buffer
    if not buffer.enable:
        return None
    return buffer.penalty_factor * overlong_penalty(response_mask.sum(-1), cfg.data.max_response_length, buffer.len)


def shape_overlong(batch: DataProto, cfg: RLConfig) -> dict[str, float]:
    """Add the overlong penalty to each response's score on its last trained token (in place).

    The unshaped score stays in `outcome_scores` [B], for dynamic sampling (keep_informative).
    """
    mask = batch.batch["response_mask"]
    penalty = overlong_penalties(mask, cfg)
    if penalty is None:
        return {}
    scores = batch.batch["token_level_scores"]
    batch.batch["outcome_scores"] = scores.sum(-1)
    last = last_trained_token(mask)
    scores[torch.arange(len(last)), last] += penalty * (mask.sum(-1) > 0)
    return {"reward/overlong_penalty": float(penalty.mean()),
            "reward/overlong_frac": float((penalty < 0).float().mean())}


class PendingScores:
    """The scores of one batch: a Future of (scored copy, metrics, start, end), from the scoring
    thread or already set (`sequential`). `reorder` records a reordering of the batch's rows made
    after the scoring started, so that `Scorer.join` puts each score on its row."""

    def __init__(self, future: Future | None, batch: DataProto | None = None, sequential: bool = True):
        self.future, self.sequential = future, sequential
        self.old_keys = set(batch.batch.keys()) if batch is not None else set()
        self.order: list[int] | None = None

    @classmethod
    def joined(cls) -> PendingScores:
        return cls(None)

    @property
    def new_keys(self) -> list[str]:
        """The columns the scoring added (token_level_scores, outcome_scores with overlong shaping)."""
        scored = self.future.result()[0]
        return [key for key in scored.batch.keys() if key not in self.old_keys]

    def reorder(self, order: list[int]) -> None:
        self.order = list(order) if self.order is None else [self.order[i] for i in order]


class Scorer:
    """Decode and score responses; `clock` (trainer/phases.py) times the scoring and names a reward model's failure.

    `reward_model`: the reward-model role's handle (compute_rm_score), set once the workers run; None without one.
    """

    def __init__(self, cfg: RLConfig, tokenizer, clock):
        self.cfg, self.tokenizer, self.clock = cfg, tokenizer, clock
        self.rewards = reward_manager(cfg)
        self.failure_watch = FailureWatch(cfg.reward.max_failure_rate, cfg.reward.max_failure_steps)
        self.reward_model = None
        self.judge = None  # a JudgeReward (rlframe/reward/judge.py) when reward.judge is set (trainer/rl_trainer.py)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlframe-reward")

    def decode(self, batch: DataProto) -> list[str]:
        """Each response's text up to its last trained token; an agent program's own final answer where it gave one
        (non-tensor `agent_answer`, workers/rollout/agent_program.py; None for a failed episode)."""
        responses, mask = batch.batch["responses"], batch.batch["response_mask"]
        lengths = ((last_trained_token(mask) + 1) * (mask.sum(-1) > 0)).tolist()
        texts = self.tokenizer.batch_decode([r[:n].tolist() for r, n in zip(responses, lengths)],
                                            skip_special_tokens=True)
        answers = batch.non_tensor_batch.get("agent_answer")
        if answers is not None:
            texts = [text if answer is None else str(answer) for text, answer in zip(texts, answers)]
        return texts

    def rule_and_model_scores(self, batch: DataProto, texts: list[str]) -> tuple[RewardResult, np.ndarray, dict]:
        """(the reward functions' result, score = rule-based + reward_model.weight * RM score [B], metrics)."""
        nt = batch.non_tensor_batch
        extra_infos = list(nt["extra_info"])
        if "agent_transcript" in nt:  # an agent program's conversation, for reward functions that read it
            extra_infos = [{**(e or {}), "transcript": t} for e, t in zip(extra_infos, nt["agent_transcript"])]
        result = self.rewards.score(texts, list(nt["ground_truth"]), list(nt["data_source"]), extra_infos,
                                    response_lengths=batch.batch["response_mask"].sum(-1).long().tolist())
        scores = result.scores
        if "agent_env_reward" in nt:  # a multi-turn environment's rewards (summed over the turns)
            env_reward = np.asarray(nt["agent_env_reward"], dtype=float)
            if not self.rewards.specs:  # the environment gives the whole rule-based reward
                result.scores = env_reward
            scores = scores + env_reward
        metrics = dict(result.metrics)
        if self.reward_model is not None:  # model-based reward on top of the rule-based ones
            rm_input = DataProto.from_dict(non_tensors={"raw_prompt": list(nt["raw_prompt"]), "responses_text": texts})
            rm_scores = self.reward_model.compute_rm_score(rm_input).batch["rm_scores"].double().numpy()
            scores = scores + self.cfg.reward_model.weight * rm_scores
            metrics["reward/rm_score_mean"] = float(rm_scores.mean())
        return result, scores, metrics

    def score(self, batch: DataProto, texts: list[str] | None = None) -> tuple[DataProto, dict[str, float]]:
        """token_level_scores: the score (rule-based + RM) on each response's last trained token (or per turn)."""
        scored, metrics, _ = self.score_with_result(batch, texts)
        return scored, metrics

    def score_with_result(self, batch: DataProto, texts: list[str] | None = None):
        """`score`, and the reward functions' RewardResult (+ the judge's verdicts: column `scorable`)."""
        texts = self.decode(batch) if texts is None else texts
        result, scores, metrics = self.rule_and_model_scores(batch, texts)
        if self.judge is not None:
            judged, judge_metrics = self.judge_scores(batch, texts)
            scores = scores + self.cfg.reward.judge.weight * np.where(judged.scorable, judged.scores, 0.0)
            batch.batch["scorable"] = torch.as_tensor(judged.scorable, dtype=torch.bool)
            metrics.update(judge_metrics)
            result.by_function = [*result.by_function, FunctionFailures(
                JUDGE_LABEL, int((~judged.scorable).sum()), len(texts), first_unscorable(judged))]
        batch.batch["token_level_scores"] = place_scores_on_last_token(scores, batch.batch["response_mask"])
        nt = batch.non_tensor_batch
        if self.cfg.rollout.multi_turn.turn_rewards == "per_turn" and "agent_turn_reward_positions" in nt:
            batch.batch["token_level_scores"] = place_turn_rewards(
                batch.batch["token_level_scores"], nt["agent_turn_rewards"], nt["agent_turn_reward_positions"],
                batch.batch["response_mask"])
        metrics["critic/score/mean"] = float(np.mean(scores))
        if self.judge is not None:  # over the samples that have a score (a judge's unscorable rows have none)
            scorable = batch.batch["scorable"].numpy()
            metrics["critic/score/mean"] = float(np.mean(scores[scorable])) if scorable.any() else float("nan")
        accuracy = reported_accuracy(result)
        if accuracy is not None:
            metrics["critic/accuracy"] = float(np.nanmean(accuracy))
        return batch, metrics, result

    def judge_scores(self, batch: DataProto, texts: list[str]):
        """The judge's verdicts on the batch's responses (one request per sample), each logged with its step and uid."""
        from rlframe.reward.judge import prompt_text

        nt = batch.non_tensor_batch
        uids = list(nt["uid"]) if "uid" in nt else [None] * len(texts)
        step = batch.meta_info.get("step", self.clock.step)
        before = self.judge.calls
        unwrap = chat_unwrapper(self.tokenizer)
        judged = self.judge.score([unwrap(prompt_text(p)) for p in nt["raw_prompt"]], texts, list(nt["ground_truth"]),
                                  rows={"step": [step] * len(texts), "uid": uids, "row": list(range(len(texts)))})
        return judged, {**judged.metrics(), "reward/judge_calls": float(self.judge.calls - before)}

    def score_shaped(self, batch: DataProto, texts: list[str] | None = None) -> tuple[DataProto, dict[str, float]]:
        """`score`, then the overlong shaping: the reward training uses (its failures watched: FailureWatch)."""
        scored, metrics, result = self.score_with_result(batch, texts)
        self.failure_watch.observe(result.by_function)
        metrics.update(shape_overlong(scored, self.cfg))
        return scored, metrics

    def start(self, batch: DataProto, overlap: bool) -> PendingScores:
        """Score `batch` (its rows in their present order): in the scoring thread when `overlap`,
        else here and now. The scoring works on a shallow copy: `batch` is not changed."""
        start = time.perf_counter()
        scored, texts = batch.select(), self.decode(batch)

        def score() -> tuple[DataProto, dict[str, float], float, float]:
            scored_batch, metrics = self.score_shaped(scored, texts)
            return scored_batch, metrics, start, time.perf_counter()

        if overlap:
            return PendingScores(self.thread.submit(score), batch, sequential=False)
        done: Future = Future()
        with self.clock.naming_failures("reward"):  # (the reward model runs on a worker)
            done.set_result(score())
        return PendingScores(done, batch, sequential=True)

    def join(self, batch: DataProto, scores: PendingScores) -> dict[str, float]:
        """Wait for the scores and add their columns (token_level_scores, ...) to `batch`; the reward metrics.

        timing/reward: the scoring's own seconds; timing/reward_wait_s: how long the driver blocked here
        (with reward.overlap=false: the whole scoring, which ran before the log-prob passes).
        """
        if scores.future is None:  # joined already (dynamic sampling)
            return {}
        wait_start = time.perf_counter()
        with self.clock.naming_failures("reward"):  # (the reward model runs on a worker)
            scored, metrics, start, end = scores.future.result()
        waited = end - start if scores.sequential else time.perf_counter() - wait_start
        self.clock.record("reward", start, end)
        columns = scored.select(batch_keys=scores.new_keys, non_tensor_keys=[], meta_info_keys=[])
        if scores.order is not None:
            columns.reorder(scores.order)
        batch.union(columns)
        scores.future = None
        return {**metrics, "timing/reward_wait_s": waited}

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)  # before its reward workers stop
        self.rewards.close()
        if self.judge is not None:
            self.judge.close()


def chat_unwrapper(tokenizer):
    """templated prompt -> the user's message, for the judge's {prompt}: the chat template's text around one user
    message (its system prompt and headers) is cut off; a prompt it does not wrap that way (several messages, an
    image) stays whole."""
    marker = "\u0000RLFRAME-USER\u0000"
    try:
        wrapped = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                                tokenize=False)
    except Exception:
        return lambda text: text
    if not isinstance(wrapped, str) or wrapped.count(marker) != 1:
        return lambda text: text
    head, tail = wrapped.split(marker)

    def unwrap(text: str) -> str:
        if text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail):
            return text[len(head):len(text) - len(tail)]
        return text

    return unwrap


def first_unscorable(judged) -> str | None:
    """The first unscorable sample's judge reply, for the message of a run the judge stops (FailureWatch)."""
    rows = np.flatnonzero(~judged.scorable)
    if not len(rows):
        return None
    return (f"the judge's reply to row {rows[0]} was {judged.outputs[rows[0]][:300]!r} (empty: its request failed); "
            "it does not parse. Read <run_dir>/judge_outputs.jsonl, and fix reward.judge.template / criteria / "
            "pattern / parser")
