"""How often does the embedded default call the calculator before any training? (recipe grpo_tool_math)

    python examples/benchmark/tool_call_probe.py [--samples 32] [--temperature 0.5]

Samples answers of SmolLM2-135M-Instruct (HF generate, 48 new tokens, seeded) to arithmetic word problems
under three system messages: the recipe's own tool prompt (workers/rollout/tools.py: tool_prompt, tag
format), the same with a worked example, and an imperative "always call the calculator first". Prints how
many answers contain a complete <calculator>...</calculator> call. GRPO can only reinforce a behaviour
that some samples show: a rate of 0 means the recipe cannot learn the tool format from its own samples.
Measured 2026-11-29 (32 samples each, temperature 0.5): 0/32, 0/32, 0/32.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlframe.data.arithmetic import INSTRUCTION, generate_problems
    from rlframe.models.provision import resolve_model_path
    from rlframe.workers.rollout.tools import load_tool, tool_prompt

    model_dir = resolve_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    recipe_prompt = tool_prompt({"calculator": load_tool("tools/calculator.py", "calculator")}, "tag")
    variants = {
        "recipe": recipe_prompt,
        "with example": recipe_prompt + "\nExample: to compute 12 + 7 write <calculator>12 + 7</calculator>",
        "imperative": "Before answering, always call the calculator by writing <calculator>expression</calculator>, "
                      "for example <calculator>12 + 7</calculator>. The result comes back in a tool message; "
                      "then give the answer.",
    }
    problems = generate_problems(args.samples, seed=1, max_operand=10)
    for name, system in variants.items():
        texts = [tok.apply_chat_template([{"role": "system", "content": system},
                                          {"role": "user", "content": q + " " + INSTRUCTION}],
                                         tokenize=False, add_generation_prompt=True) for q, _ in problems]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(0)
        start = time.time()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=args.temperature, max_new_tokens=48,
                                 pad_token_id=tok.pad_token_id)
        answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        calls = sum("<calculator>" in a and "</calculator>" in a for a in answers)
        print(f"{name:>13}: {calls}/{len(answers)} answers call the calculator ({time.time() - start:.0f} s); "
              f"e.g. {answers[0][:80]!r}", flush=True)


if __name__ == "__main__":
    main()
