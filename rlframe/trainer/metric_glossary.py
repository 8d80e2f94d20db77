"""Every metric name a run logs, with its meaning and what a healthy run shows: the one list the docs are written from.

    meaning_of("actor/pg_clipfrac")      # the Metric entry (name, section, meaning, healthy), or None
    unknown_metrics(["actor/new_thing"]) # ["actor/new_thing"]: logged but not explained here

A name is exact (`actor/pg_loss`) or a family with `*` standing for one or more path parts (`timing/*`,
`perf/peak_mem_gib/*`), used only where the parts are open-ended (phases, tools, reward components). The
docs page docs/metrics.md is generated from this list (rlframe/docs_gen.py), and tests/test_docs_reference.py
fails when a run logs a name missing here. "Healthy" describes the embedded default's runs (SmolLM2-135M on
the generated arithmetic, tests' tiny random models excepted); other tasks differ in scale, not in shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Metric:
    name: str
    section: str
    meaning: str
    healthy: str = ""


# A healthy RL run at a glance, in report.html's charts (rendered above the tables of docs/metrics.md).
HEALTHY_RUN = (
    "Reward and accuracy (critic/score/mean, val/reward_mean, val/accuracy) rise, noisily per step, steadily over "
    "tens of steps; validation moves less often and more smoothly than the training score.",
    "The log-prob gap (rollout/logprob_abs_diff) stays flat at its dtype's floor: a step up means the engine "
    "samples from other weights than the trainer trains.",
    "KL to the reference (actor/kl_loss, or reward/kl_penalty) grows slowly from 0; entropy (actor/entropy, "
    "rollout/sampled_nll) falls slowly, never to 0 within a few steps.",
    "Clip fractions stay low (0 on exactly on-policy steps); actor/grad_norm stays within a small factor of its "
    "first values.",
    "Response length (response_length/mean) changes slowly; response_length/clip_ratio near 1 means answers stopped "
    "ending before the budget.",
    "Phase times (timing/*) are flat over the run; rollout and update dominate, weight_sync and reward stay small.",
)

SECTIONS = {
    "reward": "What the rollouts scored (training samples; `critic/score/mean` is the headline of the progress line).",
    "validation": "The validation set, at step 0 (before training), every trainer.val_every steps and after the last.",
    "actor": "The policy update (one value per step: the mean over its micro-batches, the last value for lr and "
             "skipped_updates).",
    "critic": "PPO's value model and the advantages (`critic/` also holds the score and advantage means, as in verl).",
    "rollout": "Generation: lengths, and agreement between the engine that sampled and the trainer that trains.",
    "weight sync": "Moving the trainer's weights into the rollout engines after each update.",
    "timing": "Seconds per phase of the step (the progress line's phase times; report.html's timing chart).",
    "performance": "Throughput, model FLOPs utilisation and peak memory.",
    "gates": "The run's health checks (rlframe/config/gates.py; docs/doctor.md): 1 on a step where a gate fired.",
    "algorithms": "Keys of the estimators and options that log their own (DAPO, partial and asynchronous rollouts).",
    "multi-turn": "Multi-turn rollouts with tools and environments, and agents through the gateway.",
    "stages": "The stages around RL: pt, sft, dpo, rm, rft and pair generation.",
    "distillation": "On-policy distillation (teacher.path): how far the student is from the teacher on its own samples.",
}

R, V, A, C, RO, W, T, P, G, AL, MT, S, D = SECTIONS  # (the section names, in order)

METRICS: tuple[Metric, ...] = (
    # reward
    Metric("critic/score/mean", R, "Mean score of the step's training samples (all reward functions, weighted, "
           "plus a reward model's or environment's part), before any KL or overlong shaping.",
           "Rises over the run, noisily per step (the main job's validation reward over its 14 steps: 0.2109 -> "
           "0.4922). Flat for many steps: no signal (see reward/zero_variance_groups)."),
    Metric("critic/rewards/mean", R, "Mean reward per sample after shaping (the KL penalty in the reward, the "
           "overlong penalty).", "Follows critic/score/mean, a little below it when a penalty is on."),
    Metric("critic/accuracy", R, "Share of training samples the reward function marked correct (its `acc` field).",
           "Rises with the score."),
    Metric("reward/score_mean", R, "Mean raw score of the step's samples, as the reward functions returned it.",
           "Equal to critic/score/mean without a reward model or environment."),
    Metric("reward/score_std", R, "Standard deviation of the step's scores.",
           "Above 0: the samples differ, so group estimators have a signal."),
    Metric("reward/*_mean", R, "Mean of one component of a reward function that returns a dict "
           "(reward_fns/math.py: acc, format), or of a weighted function's or reward model's part (rm_score, "
           "judge_score, env_reward, greedy_baseline for ReMax).",
           "The format part usually learns first, the accuracy part after it."),
    Metric("reward/failures", R, "Samples whose reward function raised, timed out or returned a bad score "
           "(they got reward.fallback_score).", "0. Above 0: read the first failure in the console/driver log."),
    Metric("reward/*/failures", R, "Failures of one reward function (by its name), when there are several.", "0."),
    Metric("reward/timeouts", R, "Samples whose scoring took longer than reward.timeout_s.", "0."),
    Metric("reward/zero_variance_groups", R, "Share of prompt groups whose n samples all scored the same: no "
           "GRPO/RLOO signal from them.", "Below ~0.9 and falling; near 1 for many steps: the task is too hard "
           "or too easy for the model (the zero_variance gate)."),
    Metric("reward/kl_penalty", R, "Mean KL-to-reference penalty subtracted from the reward (KL in the reward: "
           "rloo_math, reinforce_pp_math).", "Small (0.001-0.05) and slowly growing."),
    Metric("reward/kl_coef", R, "The KL coefficient of the step (fixed, or steered by an adaptive controller).",
           "Constant with a fixed controller."),
    Metric("reward/overlong_penalty", R, "Mean overlong penalty (DAPO's algorithm.overlong_buffer).",
           "Near 0 once responses fit the budget."),
    Metric("reward/overlong_frac", R, "Share of samples inside the overlong buffer.", "Falling."),
    Metric("reward/judge_parse_failure_rate", R, "Share of the step's samples whose LLM-judge reply came but did not "
           "parse to a score (reward.judge: rubric lines, verdict pattern or parser).",
           "0; above ~0.1: fix reward.judge.template / criteria / pattern / parser (judge_outputs.jsonl shows the replies)."),
    Metric("reward/judge_request_failure_rate", R, "Share of the step's samples whose request to the judge's URL "
           "failed after reward.judge.max_retries retries (timeouts, 429 / 5xx, broken replies).",
           "0; above 0: the server is overloaded (lower reward.judge.max_concurrency / max_rpm) or slow (timeout_s)."),
    Metric("reward/judge_unscorable_rate", R, "Share of the step's samples the LLM judge gave no usable verdict "
           "(reply unparsable or request failed): left out of their group's baseline with advantage 0, never "
           "given a made-up score (stage=rft: reward.judge.fallback_score).",
           "0; a steady rate above ~0.1 wastes samples; above reward.max_failure_rate for "
           "reward.max_failure_steps steps stops the run."),
    Metric("reward/judge_calls", R, "Judge prompts sent this step (one per sample; a retry is not counted).",
           "rollout.n x data.train_batch_size."),
    # validation
    Metric("val/reward_mean", V, "Mean score on the validation set (greedy at rollout.val_temperature=0).",
           "Rises from step 0's value; the main job's figures: 0.2109 -> 0.4922."),
    Metric("val/accuracy", V, "Share of validation prompts answered correctly.",
           "Rises; the main job's figures: 0.2344 -> 0.5469."),
    Metric("val/reward_mean_ci_low", V, "Lower end of the 95% confidence interval of val/reward_mean "
           "(bootstrap over prompts).", "Narrows with a larger validation set."),
    Metric("val/reward_mean_ci_high", V, "Upper end of that interval.", ""),
    Metric("val/accuracy_ci_low", V, "Lower end of the 95% confidence interval of val/accuracy.", ""),
    Metric("val/accuracy_ci_high", V, "Upper end of that interval.", ""),
    Metric("val/score_mean", V, "Mean raw score on the validation set (before a reward model's part).", ""),
    Metric("val/response_length", V, "Mean validation response length in tokens.",
           "Stable or slowly changing; a jump to data.max_response_length: responses stopped ending."),
    Metric("val/loss", V, "Stages: the mean loss on held-out rows (sft, pt, dpo).", "Falls, then flattens; "
           "rising while the training loss falls: over-fitting."),
    Metric("val/perplexity", V, "pt: exp(val/loss) on held-out documents.", "Falls."),
    Metric("val/tokens", V, "Held-out tokens the validation loss is over.", "Constant."),
    Metric("val/rm_accuracy", V, "rm: share of held-out pairs the reward model ranks right.", "Rises above 0.5."),
    Metric("val/rm_loss", V, "rm: the Bradley-Terry loss on held-out pairs.", "Falls from 0.693."),
    Metric("val/rm_margin", V, "rm: mean chosen - rejected score on held-out pairs.", "Grows."),
    Metric("val/rm_score_mean", V, "RL with a reward model: the reward model's mean score on validation.", ""),
    # actor
    Metric("actor/pg_loss", A, "The policy-gradient loss (the clipped surrogate, aggregated by actor.loss_agg_mode).",
           "Noisy around 0 (advantages are centred); its size says little. Not a curve to minimise."),
    Metric("actor/kl_loss", A, "KL to the reference policy in the actor's loss (algorithm.use_kl_loss; "
           "kl_loss_type).", "Starts at 0 and grows slowly (0.001-0.1); a steep climb: lr too high or the KL "
           "coefficient too low."),
    Metric("actor/grad_norm", A, "The gradient's global norm before clipping (actor.optim.grad_clip).",
           "Finite and roughly stable; spikes of 10x or more, or always above grad_clip: lower the lr."),
    Metric("actor/lr", A, "The learning rate of the step (warm-up, then constant).",
           "Rises over actor.optim.warmup_steps, then flat."),
    Metric("actor/pg_clipfrac", A, "Share of tokens where the ratio was clipped (PPO's upper/lower clip).",
           "0 on exactly on-policy steps (one epoch, one mini-batch: the main job); 0.01-0.2 with several "
           "mini-batches or epochs; above ~0.3: steps too large."),
    Metric("actor/pg_clipfrac_lower", A, "Share of tokens capped by the dual clip (A < 0, vanilla loss).",
           "Near 0."),
    Metric("actor/ppo_kl", A, "Mean approximate KL between the policy being updated and the one that sampled "
           "(old log-probs).", "0 on exactly on-policy steps; small (below ~0.02) otherwise."),
    Metric("actor/ratio_mean", A, "Mean importance ratio pi_new / pi_old over the step's tokens.", "Close to 1."),
    Metric("actor/entropy", A, "Mean per-token entropy of the policy on the trained tokens.",
           "Falls slowly; a collapse towards 0 early: the policy stopped exploring (entropy_collapse gate)."),
    Metric("actor/entropy_old", A, "Entropy from the old-log-prob pass (before the update).", "As actor/entropy."),
    Metric("actor/entropy_loss", A, "The entropy term of the loss (actor.entropy_coeff).", ""),
    Metric("actor/skipped_updates", A, "Optimiser steps in a row skipped for a non-finite loss or gradient.",
           "0; the run stops after trainer.max_consecutive_skipped_updates."),
    Metric("actor/tis_weight_mean", A, "Off-policy correction (TIS): mean truncated importance weight "
           "pi_trainer / pi_engine of the sampled tokens.", "Close to 1."),
    Metric("actor/tis_capped_frac", A, "TIS: share of tokens whose weight hit algorithm.tis_cap.", "Near 0."),
    Metric("actor/tis_log_ratio_abs", A, "TIS: mean |log pi_trainer - log pi_engine| of the sampled tokens.",
           "Small; grows with staleness."),
    # critic
    Metric("critic/vf_loss", C, "PPO's value loss (clipped regression of values onto returns).",
           "Falls over the first steps (trainer.critic_warmup helps), then noisy."),
    Metric("critic/vf_clipfrac", C, "Share of tokens where the value clip (critic.cliprange_value) acted.",
           "Below ~0.3."),
    Metric("critic/vpred_mean", C, "Mean predicted value over the trained tokens.",
           "Moves towards the mean reward."),
    Metric("critic/grad_norm", C, "The critic's gradient norm before clipping.", "Finite and roughly stable."),
    Metric("critic/lr", C, "The critic's learning rate of the step.", ""),
    Metric("critic/skipped_updates", C, "Critic optimiser steps skipped in a row (non-finite).", "0."),
    Metric("critic/advantages/mean", C, "Mean advantage over the step's response tokens.",
           "Near 0 for group estimators (centred); gae: small."),
    # rollout
    Metric("response_length/mean", RO, "Mean training response length in tokens.",
           "Stable or slowly changing; a steady climb to the limit: the model stopped ending its answers."),
    Metric("response_length/max", RO, "Longest training response of the step.", "At or below data.max_response_length."),
    Metric("response_length/clip_ratio", RO, "Share of responses cut at data.max_response_length.",
           "Low (below ~0.1); high: raise data.max_response_length or shape for length (DAPO)."),
    Metric("rollout/logprob_abs_diff", RO, "Mean |log p_engine - log p_trainer| of the sampled tokens: do the "
           "engine and the trainer hold the same policy?", "fp32: below 1e-3; bf16: below ~0.05 (the "
           "logprob_gap gate). Larger: a weight-sync or precision problem."),
    Metric("rollout/logprob_abs_diff_max", RO, "The largest such difference of one token.", "Small."),
    Metric("rollout/sampled_nll", RO, "Mean negative log-prob of the sampled tokens (an entropy estimate when "
           "actor/entropy is not computed).", "Falls slowly."),
    Metric("dynamic_sampling/rounds", AL, "DAPO: generation rounds the step needed to fill its batch with groups "
           "that have a signal.", "1-3; at max_attempts the step fails."),
    Metric("dynamic_sampling/kept_frac", AL, "DAPO: share of generated groups kept.", "Above ~0.2."),
    # weight sync
    Metric("weight_sync/seconds", W, "Seconds to move the weights into the engines.", "A small part of the step."),
    Metric("weight_sync/bytes", W, "Bytes sent.", "Constant per run (the model's size, or the adapters')."),
    Metric("weight_sync/tensors", W, "Tensors sent.", "Constant."),
    Metric("weight_sync/buckets", W, "Buckets of a bucketed broadcast.", "Constant."),
    Metric("weight_sync/loaded_per_engine", W, "Tensors each engine loaded.", "Constant."),
    Metric("weight_sync/check", W, "1 when the sync's log-prob check ran.", ""),
    Metric("weight_sync/checksum_tensors", W, "Tensors whose sampled checksum was compared after the sync.", ""),
    Metric("weight_sync/checksum_unequal", W, "Tensors whose engine checksum differs from the trainer's.",
           "0 (the weight_sync gate stops the run otherwise)."),
    Metric("weight_sync/engine_changed", W, "1 when the engine's weights changed with the trainer's.",
           "1 after every real update."),
    # timing
    Metric("timing/step", T, "Seconds of the whole step.", "Stable; the ETA of the progress line uses its mean."),
    Metric("timing/*", T, "Seconds of one phase: rollout, reward, reward_wait_s (how long the driver waited for "
           "overlapped scoring), old_log_prob, ref_log_prob, values, advantage, update_critic, update, "
           "weight_sync, validation, checkpoint, teacher_log_prob and student_topk (distillation), and the stages' own (pair_generation, rft_sampling).",
           "rollout and update dominate; weight_sync and reward stay small."),
    # the start-up profile (rlframe/trainer/startup.py), logged once: at step 0 with the validation before training
    # (without one, with the first step); also in <run_dir>/startup.json, with the exit
    Metric("timing/startup/total", T, "Seconds from the process's start to the start of step 1 (what a user waits "
           "for before the first step).", "A small part of a long run; tens of seconds on 2 CPU cores."),
    Metric("timing/startup/other", T, "Start-up seconds no other part names (total less the driver's parts).",
           "Small."),
    Metric("timing/startup/imports", T, "Seconds from the process's start to the entry point's first line: the "
           "interpreter and the entry module's imports.", "A few seconds."),
    Metric("timing/startup/config", T, "Composing and checking the configuration.", "Under a second."),
    Metric("timing/startup/prepare", T, "The checks before Ray: the run directory, the model folder, the memory "
           "plan, the tokenizer, and every data row read and templated.", "Grows with the data set."),
    Metric("timing/startup/ray_init", T, "Starting (or joining) the Ray cluster.", "A few seconds for a local one."),
    Metric("timing/startup/cluster_check", T, "Listing the nodes and checking they hold the run's devices.", ""),
    Metric("timing/startup/driver_setup", T, "The stage's driver set-up (datasets, scorer: its reward processes "
           "start here, tracker, plugins) outside `workers`: the RL driver sets up while its workers start, so only "
           "what is left before them counts here.", "Near 0 for RL runs."),
    Metric("timing/startup/workers", T, "Starting every worker group, from asking for them until all roles are "
           "built (spawn/* and init/* lie inside it).", "The largest part."),
    Metric("timing/startup/spawn/*", T, "One worker group (by pool name): from asking Ray for its actors until every "
           "rank answers (process start and its imports).", ""),
    Metric("timing/startup/init/*", T, "One worker group: joining its process group and building its roles, the "
           "slowest rank.", ""),
    Metric("timing/startup/process_group/*", T, "One worker group: torch.distributed's init, the slowest rank.", ""),
    Metric("timing/startup/build/*", T, "One role of a worker group (build/<role>/<group>): building it, the slowest "
           "rank.", ""),
    Metric("timing/startup/model_load/*", T, "The actor's trainer engine: loading the model and building its "
           "optimizer, the slowest rank.", ""),
    Metric("timing/startup/engine_init/*", T, "The rollout engine (vLLM or HF) of one group: its start, the slowest "
           "rank.", "vLLM: a few seconds."),
    Metric("timing/startup/weight_sync_init", T, "Disaggregated placement: forming the broadcast group trainer -> "
           "engines (inside `workers`).", ""),
    Metric("timing/startup/restore", T, "Loading the checkpoint a resumed run starts from.", ""),
    Metric("timing/startup/validation", T, "The validation before training (trainer.val_before_train).",
           "About what a rollout of as many samples costs."),
    # performance
    Metric("perf/mfu", P, "Model FLOPs utilisation: model_tflops / (peak TFLOP/s x devices) (trainer.peak_tflops).",
           "Stable over the run; its level depends on the hardware and trainer.peak_tflops (not yet measured on a "
           "GPU here; docs/benchmarks.md has the CPU figures)."),
    Metric("perf/model_tflops", P, "Model TFLOP/s of the step (6N per trained token, 2N per generated and "
           "forward token).", ""),
    Metric("perf/tokens_per_s/*", P, "Tokens per second of one phase (rollout, update, ref_log_prob, ...).",
           "Stable over the run."),
    Metric("perf/generated_tokens_per_s", P, "Generated tokens per second of the step's rollout.", ""),
    Metric("perf/generated_tokens", P, "Tokens generated in the step.", ""),
    Metric("perf/*_train_tokens_per_s", P, "Trained tokens per second of one role's update (actor, critic).", ""),
    Metric("perf/peak_mem_gib/*", P, "Peak memory (GiB) of one worker method (generate_sequences, update_actor, "
           "...), for the memory plan.", "Below the device's memory with headroom; close to the plan."),
    Metric("perf/weight_checksum_s", P, "Seconds spent on the weight checksums of the weight_sync gate.", "Small."),
    Metric("rss/*", P, "Peak resident memory (GiB) of a worker process in one method.", ""),
    Metric("device/*", P, "Peak GPU memory (GiB) allocated in one worker method.", ""),
    Metric("mem/*", P, "Memory readings of the memory plan's roles.", ""),
    # gates
    Metric("gates/*", G, "1 on a step where that gate fired (logprob_gap, weight_sync, zero_variance, "
           "constant_reward, entropy_collapse, non_finite_loss; topk_overlap on distillation runs), else 0.", "0 everywhere."),
    # algorithms
    Metric("partial/*", AL, "Partial rollouts (rollout.partial): rounds, held-back and carried responses and "
           "tokens, token staleness, restarted groups, mixed-version share.",
           "token_staleness_max within rollout.partial.max_token_staleness."),
    Metric("async/*", AL, "Asynchronous rollout (trainer.max_staleness): the policy version and the sample "
           "versions trained, their staleness.", "staleness_max within trainer.max_staleness."),
    # multi-turn
    Metric("agent/*", MT, "Multi-turn rollouts: turns, tool calls (per tool: agent/tool_calls/<name>), tool and "
           "environment error rates, environment reward, why episodes ended (agent/end_<reason>), trained and "
           "context tokens, engine calls.", "tool_error_rate low; turns_mean above 1 once the model uses its tools."),
    Metric("gateway/*", MT, "Agents through the gateway: episodes, calls and tokens per episode, failed and "
           "refused calls (by reason), merged calls, the agent's own reward.", "failed_rate near 0."),
    # stages
    Metric("sft/loss", S, "stage=sft: mean NLL of the target tokens of the step.", "Falls, fast at first, then "
           "flattens; the main SFT recipe's val/accuracy rises with it."),
    Metric("sft/loss_tokens", S, "stage=sft: target tokens the step's loss is over.", ""),
    Metric("sft/epoch", S, "stage=sft: the pass over the training rows the step is in.", ""),
    Metric("pt/loss", S, "stage=pt: mean next-token NLL of the step's packed rows.", "Falls; val/perplexity with it."),
    Metric("pt/loss_tokens", S, "stage=pt: tokens the step's loss is over.", "Constant (packed rows)."),
    Metric("pt/epoch", S, "stage=pt: the pass over the documents the step is in.", ""),
    Metric("dpo/loss", S, "stage=dpo: the preference loss (dpo.loss: sigmoid, ipo, simpo, orpo, kto).",
           "sigmoid falls from log 2 = 0.693."),
    Metric("dpo/rewards_chosen", S, "Implicit reward of the chosen replies: beta x (log pi - log pi_ref).",
           "Rises, or falls less than rewards_rejected."),
    Metric("dpo/rewards_rejected", S, "Implicit reward of the rejected replies.", "Falls."),
    Metric("dpo/reward_margin", S, "rewards_chosen - rewards_rejected.", "Grows from 0."),
    Metric("dpo/reward_accuracy", S, "Share of pairs whose chosen reply has the larger implicit reward.",
           "Rises above 0.5."),
    Metric("dpo/logps_chosen", S, "Mean log-prob of the chosen replies under the policy.",
           "Should not collapse: both falling fast is the known DPO failure (lower the lr or raise beta)."),
    Metric("dpo/logps_rejected", S, "Mean log-prob of the rejected replies under the policy.", "Falls."),
    Metric("dpo/kl", S, "kto: the batch's KL estimate to the reference (its reference point).", "Small, >= 0."),
    Metric("rm/loss", S, "stage=rm: the Bradley-Terry loss -log sigmoid(chosen - rejected - rm.margin).",
           "Falls from 0.693."),
    Metric("rm/accuracy", S, "Share of the step's pairs ranked right.", "Rises above 0.5."),
    Metric("rm/chosen_score", S, "Mean score of the chosen replies.", ""),
    Metric("rm/rejected_score", S, "Mean score of the rejected replies.", ""),
    Metric("rm/margin", S, "Mean chosen - rejected score.", "Grows."),
    Metric("rm/grad_norm", S, "The reward model's gradient norm before clipping.", "Finite, roughly stable."),
    Metric("rm/lr", S, "The reward model's learning rate of the step.", ""),
    Metric("rm/skipped_updates", S, "Reward-model optimiser steps skipped in a row (non-finite).", "0."),
    Metric("rft/round", S, "stage=rft: the round (one step of the run is one round).", ""),
    Metric("rft/sample_score_mean", S, "Mean score of the round's samples (before filtering).",
           "Rises round by round."),
    Metric("rft/sample_accuracy", S, "Share of the round's samples marked correct.", "Rises round by round."),
    Metric("rft/kept_prompts", S, "Prompts with at least one kept reply.", "Grows as the model improves."),
    Metric("rft/kept_rows", S, "SFT rows kept this round.", "Above 0 (else the round trains nothing)."),
    Metric("rft/optimizer_steps", S, "Optimiser steps of the round's SFT passes.", ""),
    Metric("rft/loss", S, "The round's mean training loss (sft: NLL of kept replies; rrhf: rank loss + NLL).",
           "Falls within a round."),
    Metric("rft/loss_tokens", S, "Target tokens of the round's loss.", ""),
    Metric("rft/epoch", S, "The pass over the round's rows.", ""),
    Metric("rft/rank_loss", S, "rrhf: the ranking part of the loss.", "Falls."),
    Metric("rft/nll_best", S, "rrhf: the NLL of each group's best reply.", "Falls."),
    Metric("pairs/prompts", S, "Pair generation (dpo/rm recipes, rlframe/pairs.py): prompts sampled.", ""),
    Metric("pairs/pairs", S, "Pairs kept (best and worst scores at least pairs.min_score_gap apart).",
           "Close to pairs/prompts: most prompts yield a pair."),
    Metric("pairs/sample_score_mean", S, "Mean score of the sampled replies.", ""),
    # on-policy distillation (teacher.path; rlframe/algos/distillation.py)
    Metric("distill/reverse_kl", D, "Per-token reverse KL estimate, mean of log pi(y_t) - log pi_T(y_t) over the "
           "student's sampled tokens (k1) in the update's forward.", "Falls towards 0 as the student "
           "approaches the teacher; 0 to float precision when teacher = student."),
    Metric("distill/reverse_kl_k3", D, "The same KL by the k3 estimator, mean of exp(r) - 1 - r with r = log pi_T - "
           "log pi (>= 0, lower variance).", "Falls; tracks distill/reverse_kl."),
    Metric("distill/loss", D, "The distillation loss term of the step (distillation.loss_mode other than k1: "
           "k3, forward_kl_topk, jsd, reverse_kl_student_topk), aggregated like the policy loss.", "Falls."),
    Metric("distill/teacher_log_prob", D, "Mean teacher log-prob of the student's sampled tokens.",
           "Rises towards 0 as the student samples what the teacher would."),
    Metric("distill/teacher_topk_mass", D, "Mean probability mass of the teacher's top distillation.top_k tokens "
           "per position.", "Near 1 for a confident teacher; low: the top-k losses see little of its distribution."),
    Metric("distill/student_topk_mass", D, "Mean probability mass of the student's own top-k tokens per position.",
           "Rises as the student sharpens."),
    Metric("distill/student_mass_on_teacher_topk", D, "Mean student probability of the teacher's top-k tokens per "
           "position.", "Rises towards distill/teacher_topk_mass."),
    Metric("distill/topk_overlap", D, "Share of the teacher's top-k tokens that are also in the student's top-k, "
           "per position.", "Rises towards 1; a collapse towards 0 makes top-k losses unstable."),
)


@lru_cache(maxsize=None)
def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + ".+".join(re.escape(part) for part in name.split("*")) + "$")


def meaning_of(key: str) -> Metric | None:
    """The exact entry of `key`, else the most specific family (`*`) that covers it; None when none does."""
    for metric in METRICS:
        if metric.name == key:
            return metric
    families = [m for m in METRICS if "*" in m.name and _pattern(m.name).match(key)]
    return max(families, key=lambda m: len(m.name.replace("*", "")), default=None)


def unknown_metrics(keys) -> list[str]:
    """The logged keys that no entry explains (the `step` counter is not a metric)."""
    return sorted(k for k in set(keys) if k != "step" and meaning_of(k) is None)
