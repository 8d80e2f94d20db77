"""Constrained output: decoding under a regex or a JSON schema the response must match.

    constrain=boxed                         free reasoning (no backslash), then "The answer is \\boxed{N}." (BOXED_REGEX)
    constrain=boxed_only                    the answer line alone, no reasoning (ANSWER_REGEX)
    constrain='regex:[0-9]+'                a regular expression the whole response must match
    constrain='{"type": "object", ...}'     a JSON schema (text starting with "{", json:<text>, or a .json file)

The constraint is compiled once with xgrammar (vLLM's default structured-output backend) against the
model's tokenizer, before anything is generated: a constraint that cannot be compiled is a one-line error.
JSON is compact (no free whitespace between tokens: a weak model otherwise fills its budget with newlines).
On the vLLM engine the generation goes through vLLM's structured outputs (SamplingParams.structured_outputs);
on the HF engine through xgrammar's logits processor for `generate` (the same token masks). Without
xgrammar installed the HF engine refuses (`ConstraintError`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from rlframe.protocol import DataProto, build_rollout_batch
from rlframe.workers.rollout.base import unpadded_prompts

ANSWER_REGEX = r"The answer is \\boxed\{-?[0-9]{1,9}(\.[0-9]{1,6})?\}\."
BOXED_REGEX = r"[^\\]*" + ANSWER_REGEX


class ConstraintError(ValueError):
    """A constraint that cannot be parsed, compiled, or applied on this engine."""


@dataclass(frozen=True)
class Constraint:
    kind: str  # "regex" | "json"
    text: str  # the regex, or the schema as JSON text

    def describe(self) -> str:
        return f"{self.kind} {self.text if len(self.text) <= 60 else self.text[:57] + '...'}"


def parse_constraint(value: str) -> Constraint:
    """constrain=<value> -> Constraint (see the module docstring for the forms)."""
    value = value.strip()
    if value == "boxed":
        return Constraint("regex", BOXED_REGEX)
    if value == "boxed_only":
        return Constraint("regex", ANSWER_REGEX)
    if value.startswith("regex:"):
        return Constraint("regex", value[len("regex:"):])
    if value.startswith("json:"):
        value = value[len("json:"):]
    elif not value.startswith("{") and not value.endswith(".json"):
        return Constraint("regex", value)
    text = Path(value).expanduser().read_text() if value.endswith(".json") and Path(value).expanduser().is_file() else value
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConstraintError(f"not a JSON schema ({error.msg} at character {error.pos})") from None
    return Constraint("json", json.dumps(schema))


def compile_constraint(constraint: Constraint, tokenizer, vocab_size: int):
    """The xgrammar CompiledGrammar of `constraint` for this tokenizer; ConstraintError when it cannot compile."""
    try:
        import xgrammar
    except ImportError:
        raise ConstraintError("xgrammar is not installed (it comes with vLLM; `pip install xgrammar` for the HF "
                              "engine)") from None
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    try:
        if constraint.kind == "regex":
            return compiler.compile_regex(constraint.text)
        return compiler.compile_json_schema(constraint.text, any_whitespace=False)
    except Exception as error:  # xgrammar raises RuntimeError / ValueError with its parser's message
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message)  # xgrammar's "[time] file.cc:83: "
        raise ConstraintError(f"the {constraint.kind} cannot be compiled ({message})") from None


def generate_constrained(engine, prompts: DataProto, sampling, constraint: Constraint, compiled) -> DataProto:
    """`engine.generate(prompts, sampling)` under `constraint`: vLLM's structured outputs, or xgrammar's
    logits processor on HF generate. The output has the rollout layout (log-probs: those of the masked
    distribution on vLLM, zeros on HF: an evaluation does not use them)."""
    from rlframe.workers.rollout.hf_rollout import HFRollout

    if isinstance(engine, HFRollout):
        return _generate_hf(engine, prompts, sampling, compiled)
    return _generate_vllm(engine, prompts, sampling, constraint)


def _generate_vllm(engine, prompts: DataProto, sampling, constraint: Constraint) -> DataProto:
    from vllm.sampling_params import StructuredOutputsParams

    from rlframe.workers.rollout.vllm_rollout import rollout_batch_from_outputs, sampling_params

    structured = (StructuredOutputsParams(regex=constraint.text) if constraint.kind == "regex"
                  else StructuredOutputsParams(json=constraint.text, disable_any_whitespace=True))
    engine.wake_up(tags=["weights", "kv_cache"])
    params = sampling_params(sampling, prompts.non_tensor_batch.get("sample_seed"), structured_outputs=structured)
    requests = [{"prompt_token_ids": ids} for ids in unpadded_prompts(prompts)]
    try:
        outputs = engine.llm.generate(requests, params, use_tqdm=False)
    except ValueError as error:  # vLLM refuses a structured-output request it cannot serve
        raise ConstraintError(f"vLLM refused it ({str(error).splitlines()[0]})") from None
    return rollout_batch_from_outputs(prompts, outputs, sampling.max_new_tokens, engine.pad_token_id)


@torch.no_grad()
def _generate_hf(engine, prompts: DataProto, sampling, compiled) -> DataProto:
    from xgrammar.contrib.hf import LogitsProcessor

    responses = []
    eos = set(engine.eos_token_ids)
    for part in prompts.split(engine.batch_size):
        kwargs = dict(do_sample=not sampling.greedy, max_new_tokens=sampling.max_new_tokens,
                      eos_token_id=engine.eos_token_ids, pad_token_id=engine.pad_token_id,
                      logits_processor=[LogitsProcessor(compiled)])  # one processor per generate call
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k if sampling.top_k > 0 else None)
        device = engine.profile.device
        input_ids = part.batch["input_ids"].to(device)
        out = engine.model.generate(input_ids=input_ids, attention_mask=part.batch["attention_mask"].to(device),
                                    **kwargs)
        for tokens in out[:, input_ids.size(1):].tolist():
            length = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            responses.append(tokens[:length])
    return build_rollout_batch(prompts, responses, [[0.0] * len(r) for r in responses], sampling.max_new_tokens,
                               engine.pad_token_id)
