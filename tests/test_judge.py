"""The LLM-judge reward: the default 1-10 parser, the user's template and parser, parse failures counted
and logged, bad judge settings refused before any worker starts, and a real judge engine in an rft run."""

import json

import numpy as np
import pytest

from rlframe.reward.judge import JudgeReward, parse_score_1_to_10, template_problem


def test_default_parser_reads_a_1_to_10_score():
    assert parse_score_1_to_10("Score: 10") == 1.0
    assert parse_score_1_to_10("score=4 because ...") == pytest.approx(3 / 9)
    assert parse_score_1_to_10("I give it 7/10") == pytest.approx(6 / 9)  # the first bare number
    assert parse_score_1_to_10("Score: 11") is None and parse_score_1_to_10("no idea") is None


class ScriptedBackend:
    """Stands in for the judge model's replies (the parsing and logging are what is tested here)."""

    def __init__(self, replies):
        self.replies, self.asked = replies, []

    def generate(self, prompts):
        self.asked += prompts
        return [self.replies[len(self.asked) - len(prompts) + i] for i in range(len(prompts))]


def _judge_cfg(**kwargs):
    from rlframe.config.reward import JudgeConfig

    return JudgeConfig(model="x", batch_size=2, fallback_score=-1.0, **kwargs)


def test_judge_fills_the_template_and_counts_what_never_parses(tmp_path):
    backend = ScriptedBackend(["Score: 10", "I refuse to grade.", "Score: 1"])
    judge = JudgeReward(_judge_cfg(template="Q: {prompt} A: {response} truth {ground_truth} ({rubric})", rubric="R"),
                        backend, tmp_path / "judge.jsonl")
    result = judge.score(["1+1", "2+2", "3+3"], ["2", "5", "7"], ["2", "4", "6"])
    assert backend.asked[0] == "Q: 1+1 A: 2 truth 2 (R)"
    assert result.scores.tolist() == [1.0, -1.0, 0.0] and result.parsed.tolist() == [True, False, True]
    assert result.metrics() == {"reward/judge_parse_failure_rate": pytest.approx(1 / 3), "reward/judge_score_mean": 0.5}
    logged = [json.loads(line) for line in open(tmp_path / "judge.jsonl")]
    assert [row["score"] for row in logged] == [1.0, None, 0.0] and logged[1]["judge"] == "I refuse to grade."
    never = JudgeReward(_judge_cfg(), ScriptedBackend(["no"] * 4), None).score(["a"] * 4, ["b"] * 4, [""] * 4)
    assert never.metrics()["reward/judge_parse_failure_rate"] == 1.0 and np.all(never.scores == -1.0)


def test_a_user_parser_and_bad_settings(tmp_path):
    from rlframe.config import ConfigError, validate_config
    from rlframe.main import compose_config

    parser = tmp_path / "parse.py"
    parser.write_text("def grade(text):\n    return 1.0 if 'yes' in text else None\n")
    judge = JudgeReward(_judge_cfg(parser=f"{parser}:grade"), ScriptedBackend(["yes", "nope"]), None)
    assert judge.score(["p", "p"], ["r", "r"], ["", ""]).scores.tolist() == [1.0, -1.0]
    assert "no {response} field" in template_problem("Rate {prompt}")
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(["recipe=rft_math", "reward.judge.model=smollm2-135m-instruct",
                                        "reward.judge.template='Rate {prompt} {answer}'",
                                        f"reward.judge.parser={parser}:missing"]))
    message = str(error.value)
    assert "reward.judge.template: the template cannot be filled (KeyError: 'answer')" in message
    assert f"reward.judge.parser: {parser} defines no function 'missing'" in message
    with pytest.raises(ConfigError, match="reward.judge: the judge reward is wired into stage=rft"):
        validate_config(compose_config(["recipe=grpo_math", "reward.judge.model=smollm2-135m-instruct"]))


@pytest.mark.slow  # ~60 s: a second engine (the judge) in a 2-round rft run; the recipe itself runs in test_recipes
def test_rft_with_the_model_as_its_own_judge(tiny_model_dir, tmp_path):
    from conftest import read_metrics, run_tiny

    run_dir, result = run_tiny(tmp_path, tiny_model_dir, "rft_math", "rollout.engine=hf", "rft.rounds=2",
                               "rft.epochs=1", "rft.prompts_per_round=4", "rft.n=2", "rft.batch_size=2",
                               "rft.micro_batch_size=2", "rft.keep_top_k=0", "rft.min_score=-1000",
                               f"reward.judge.model={tiny_model_dir}", "reward.judge.engine=hf",
                               "reward.judge.max_new_tokens=4")
    assert result.returncode == 0, result.stderr[-4000:]
    rounds = [m for m in read_metrics(run_dir) if "rft/round" in m]
    assert len(rounds) == 2 and all("reward/judge_parse_failure_rate" in m for m in rounds)
    assert sum(1 for _ in open(run_dir / "judge_outputs.jsonl")) == 2 * 4 * 2
