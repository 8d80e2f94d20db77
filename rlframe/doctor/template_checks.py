"""Doctor checks of the tokenizer and chat template: stop ids, the generation prompt, append-only multi-turn."""

from __future__ import annotations

from rlframe.config import RLConfig
from rlframe.doctor.result import CheckResult, failed, passed, skipped, warned

GROUP = "template"
SENTINEL = "\u2063DOCTOR\u2063"


def token_label(tokenizer, token_id: int | None) -> str:
    return "none" if token_id is None else f"{token_id} {tokenizer.convert_ids_to_tokens(int(token_id))!r}"


def end_of_turn_id(tokenizer) -> int | None:
    """The first token the chat template writes after an assistant message's text (<|im_end|>, <|eot_id|>, ...)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": SENTINEL}],
                                         tokenize=False)
    tail = text[text.index(SENTINEL) + len(SENTINEL):]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return ids[0] if ids else None


def generation_config_eos(model_path: str) -> list[int] | None:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        return None
    if eos is None:
        return None
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def check_stop_ids(tokenizer, model_path: str) -> CheckResult:
    """The end-of-turn token of the template is one the engines stop at (tokenizer EOS + generation config EOS,
    workers/rollout/base.py eos_and_pad_ids); the tokenizer's and generation config's EOS agree."""
    from rlframe.workers.rollout.base import eos_and_pad_ids

    stop_ids, pad_id = eos_and_pad_ids(model_path)
    tok_eos, gen_eos = tokenizer.eos_token_id, generation_config_eos(model_path)
    turn_end = end_of_turn_id(tokenizer)
    label = lambda i: token_label(tokenizer, i)  # noqa: E731
    measured = (f"tokenizer EOS {label(tok_eos)}, generation config EOS "
                f"{[label(i) for i in gen_eos] if gen_eos is not None else 'none'}, template ends a turn with "
                f"{label(turn_end)}; engines stop at {[label(i) for i in stop_ids]}, pad {label(pad_id)}")
    if turn_end is not None and turn_end not in stop_ids:
        return failed(GROUP, "stop_ids", measured + ": responses never end before the length limit",
                      f"make {label(turn_end)} the EOS: eos_token_id in the model folder's generation_config.json "
                      "(or the tokenizer's eos_token)")
    if gen_eos is not None and tok_eos is not None and tok_eos not in gen_eos:
        return warned(GROUP, "stop_ids", measured + ": the tokenizer's EOS and the generation config's differ",
                      "make them name the same token (generation_config.json eos_token_id, tokenizer eos_token)")
    return passed(GROUP, "stop_ids", measured)


def check_generation_prompt(tokenizer) -> CheckResult:
    """The template opens an assistant turn when asked (add_generation_prompt=True), as the dataset renders prompts."""
    convo = [{"role": "user", "content": "What is 2 + 3?"}]
    try:
        plain = tokenizer.apply_chat_template(convo, tokenize=False)
        prompt = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    except Exception as error:
        return failed(GROUP, "generation_prompt", f"the chat template fails: {type(error).__name__}: {error}",
                      "set a working tokenizer.chat_template in the model folder")
    header = prompt[len(plain):] if prompt.startswith(plain) else ""
    if not header.strip():
        return failed(GROUP, "generation_prompt", "add_generation_prompt=True adds nothing: the model would continue "
                      "the user's message", "use a chat template that writes the assistant header "
                      "({% if add_generation_prompt %}...{% endif %})")
    return passed(GROUP, "generation_prompt", f"renders, and opens the assistant turn with {header!r}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two lists differ (the shorter one's length when one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def conversation(role: str) -> list[dict]:
    return [{"role": "user", "content": "What is 12 + 7? Put the answer in \\boxed{}."},
            {"role": "assistant", "content": "12 + 7 = 18. \\boxed{18}"},
            {"role": role, "content": "Wrong, try again."},
            {"role": "assistant", "content": "12 + 7 = 19. \\boxed{19}"}]


def check_append_only(tokenizer, cfg: RLConfig) -> CheckResult:
    """Multi-turn (token in, token out): the conversation encoded turn by turn, each turn's text appended to the
    ids so far as the agent loop does, equals the whole conversation encoded at once; the first differing
    token is named."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return skipped(GROUP, "append_only", "single-turn recipe: every response is appended to its prompt once")
    role = "user" if mt.environment.path and not mt.tools else "tool"
    messages = conversation(role)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    try:
        texts = [tokenizer.apply_chat_template(messages[:k], tokenize=False) for k in range(1, len(messages) + 1)]
    except Exception as error:
        return failed(GROUP, "append_only", f"the template cannot render a '{role}' message: {error}",
                      f"a chat template with a '{role}' role")
    # Each turn adds the ids of what its rendering adds after the previous rendering; the ids of the
    # earlier turns stay as they were sampled (a template that rewrites them makes the whole differ).
    turn_by_turn = encode(texts[0])
    for before, after in zip(texts, texts[1:]):
        turn_by_turn += encode(after[len(before):])
    whole = encode(texts[-1])
    index = first_difference(turn_by_turn, whole)
    if index is None:
        return passed(GROUP, "append_only", f"{len(messages)} turns ('{role}' feedback): turn by turn == whole "
                                            f"({len(whole)} tokens)")
    show = lambda ids: token_label(tokenizer, ids[index]) if index < len(ids) else "end"  # noqa: E731
    rewritten = next((k for k in range(1, len(texts)) if not texts[k].startswith(texts[k - 1])), None)
    why = (f"rendering turn {rewritten + 1} rewrites turn {rewritten} or earlier" if rewritten is not None
           else "the tokens merge across a turn boundary")
    return failed(GROUP, "append_only", f"turn-by-turn ids differ from the whole conversation's at token {index}: "
                  f"{show(turn_by_turn)} vs {show(whole)} ({why}): the trainer would score other tokens than were sampled",
                  "a chat template that only appends messages (no rewriting of earlier assistant turns, e.g. "
                  "stripping reasoning); set tokenizer.chat_template in the model folder")


def check_template(cfg: RLConfig, tokenizer, model_path: str) -> list[CheckResult]:
    return [check_stop_ids(tokenizer, model_path), check_generation_prompt(tokenizer), check_append_only(tokenizer, cfg)]
