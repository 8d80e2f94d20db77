"""The data of the stages around RL: supervised examples and preference pairs, read, checked, tokenized.

SFT rows (parquet / jsonl / ... as for RL data, `rlframe.data.dataset.read_rows`), either

    prompt    a chat list [{"role", "content"}, ...] or a string (one user message)
    response  the target reply (a string)                       (keys: data.prompt_key, sft.response_key)

or a whole conversation `messages` (sft.messages_key) whose last message is the assistant's reply.

Preference rows: `prompt` as above, `chosen` and `rejected` replies (strings, or chat lists whose
last message is the reply: TRL's conversational layout).

The prompt is rendered with the tokenizer's chat template (with the generation prompt, as the
rollout sees it in RL), the reply is tokenized after it and ends with EOS. A bad row — a missing or
empty field, chosen identical to rejected, a sequence longer than the limit — is named by file and
row; `data.bad_rows` (error | skip) decides for malformed rows and `data.overlong` (error | filter |
truncate_left: drop the prompt's first tokens) for long ones, exactly as for RL prompts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from rlframe.data.dataset import read_rows
from rlframe.data.files import DatasetError
from rlframe.protocol import DataProto

logger = logging.getLogger(__name__)


@dataclass
class Example:
    """One tokenized sequence: prompt ids (loss-free) + reply ids (the loss mask's tokens)."""

    prompt_ids: list[int]
    response_ids: list[int]
    file: str
    row: int
    extra: dict = field(default_factory=dict)


@dataclass
class Pair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    file: str
    row: int


class BadRow(ValueError):
    pass


def _messages(value: Any, key: str) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(f"field {key!r}: empty")
        return [{"role": "user", "content": value}]
    try:
        messages = [dict(m) for m in value]
    except (TypeError, ValueError):
        raise BadRow(f"field {key!r}: expected a string or a list of chat messages, got {type(value).__name__}")
    if not messages or not all(isinstance(m.get("content"), str) and m.get("role") for m in messages):
        raise BadRow(f"field {key!r}: expected a non-empty list of {{'role', 'content'}} messages")
    empty = next((j for j, m in enumerate(messages) if not m["content"].strip()), None)
    if empty is not None:
        raise BadRow(f"field '{key}[{empty}].content': empty ({messages[empty]['role']} message); fill it or drop the message")
    return messages


def _reply(value: Any, key: str) -> str:
    """A reply: a string, or a chat list whose last message is the assistant's."""
    if value is None:
        raise BadRow(f"field {key!r}: missing")
    if not isinstance(value, str):
        messages = _messages(value, key)
        if messages[-1]["role"] != "assistant":
            raise BadRow(f"field {key!r}: the last message must be the assistant's reply")
        value = messages[-1]["content"]
    if not value.strip():
        raise BadRow(f"field {key!r}: empty response")
    return value


class Tokenize:
    """prompt messages -> chat-templated ids (+ generation prompt); reply text -> ids + EOS."""

    def __init__(self, tokenizer):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DatasetError("the tokenizer has no chat template: use an instruct/chat model's tokenizer")
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id

    def prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reply(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.eos]


def _fit(prompt_ids: list[int], reply_len: int, max_length: int, overlong: str, where: str) -> list[int] | None:
    """The prompt ids that fit `max_length` with the reply; None: drop the row (filter)."""
    total = len(prompt_ids) + reply_len
    if total <= max_length:
        return prompt_ids
    if overlong == "error":
        raise DatasetError(f"{where}: prompt + response are {total} tokens, more than the limit {max_length}. "
                           "Fix: raise the stage's max_length, or data.overlong=filter (drop such rows) / "
                           "truncate_left (drop the prompt's first tokens)")
    keep = max_length - reply_len
    if overlong == "truncate_left" and keep >= 1:
        return prompt_ids[-keep:]
    return None


def _read_checked(files: list[str], build, bad_rows: str, kind: str) -> list:
    out, skipped, first = [], 0, None
    for path in files:
        for number, row in enumerate(read_rows(path)):
            where = f"{path}, row {number}"
            try:
                item = build(row, path, number, where)
            except BadRow as problem:
                if bad_rows == "error":
                    raise DatasetError(f"{where}: {problem} (data.bad_rows=skip drops such rows)") from None
                skipped, first = skipped + 1, first or f"{where}: {problem}"
                continue
            if item is not None:
                out.append(item)
    if skipped:
        logger.warning("%s data: skipped %d bad rows; the first: %s", kind, skipped, first)
        print(f"note: {kind} data: skipped {skipped} bad rows (data.bad_rows=skip); the first: {first}", flush=True)
    if not out:
        raise DatasetError(f"no usable {kind} rows in {files}")
    return out


def load_sft_examples(files: list[str], tokenizer, *, prompt_key: str = "prompt", response_key: str = "response",
                      messages_key: str = "messages", max_length: int = 512, overlong: str = "error",
                      bad_rows: str = "error") -> list[Example]:
    tok = Tokenize(tokenizer)
    dropped = [0]

    def build(row: dict, path: str, number: int, where: str) -> Example | None:
        if messages_key in row and row[messages_key] is not None:
            messages = _messages(row[messages_key], messages_key)
            if messages[-1]["role"] != "assistant" or len(messages) < 2:
                raise BadRow(f"field {messages_key!r}: needs a prompt and a last assistant message")
            prompt, reply = messages[:-1], _reply(messages[-1]["content"], messages_key)
        else:
            if prompt_key not in row:
                raise BadRow(f"field {prompt_key!r}: missing")
            prompt, reply = _messages(row[prompt_key], prompt_key), _reply(row.get(response_key), response_key)
        reply_ids = tok.reply(reply)
        prompt_ids = _fit(tok.prompt(prompt), len(reply_ids), max_length, overlong, where)
        if prompt_ids is None:
            dropped[0] += 1
            return None
        truth = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
        return Example(prompt_ids, reply_ids, path, number, {"ground_truth": truth})

    examples = _read_checked(files, build, bad_rows, "SFT")
    if dropped[0]:
        print(f"note: SFT data: {dropped[0]} rows longer than {max_length} tokens dropped (data.overlong)", flush=True)
    return examples


def _pair_fields(row: dict, prompt_key: str, chosen_key: str, rejected_key: str) -> tuple[list[dict], str, str]:
    if prompt_key not in row:
        raise BadRow(f"field {prompt_key!r}: missing")
    prompt = _messages(row[prompt_key], prompt_key)
    chosen, rejected = _reply(row.get(chosen_key), chosen_key), _reply(row.get(rejected_key), rejected_key)
    if chosen.strip() == rejected.strip():
        raise BadRow(f"fields {chosen_key!r} and {rejected_key!r} are identical: the pair teaches nothing")
    return prompt, chosen, rejected


def load_pairs(files: list[str], tokenizer, *, prompt_key: str = "prompt", chosen_key: str = "chosen",
               rejected_key: str = "rejected", max_length: int = 512, overlong: str = "error",
               bad_rows: str = "error") -> list[Pair]:
    """Pairs for DPO: the chat-templated prompt (with the generation prompt) + each reply + EOS."""
    tok = Tokenize(tokenizer)
    dropped = [0]

    def build(row: dict, path: str, number: int, where: str) -> Pair | None:
        prompt, chosen, rejected = _pair_fields(row, prompt_key, chosen_key, rejected_key)
        chosen_ids, rejected_ids = tok.reply(chosen), tok.reply(rejected)
        prompt_ids = _fit(tok.prompt(prompt), max(len(chosen_ids), len(rejected_ids)), max_length, overlong, where)
        if prompt_ids is None:
            dropped[0] += 1
            return None
        return Pair(prompt_ids, chosen_ids, rejected_ids, path, number)

    pairs = _read_checked(files, build, bad_rows, "preference")
    if dropped[0]:
        print(f"note: preference data: {dropped[0]} pairs longer than {max_length} tokens dropped (data.overlong)",
              flush=True)
    return pairs


def load_scored_pairs(files: list[str], render, tokenizer, *, prompt_key: str = "prompt", chosen_key: str = "chosen",
                      rejected_key: str = "rejected", max_length: int = 512, overlong: str = "error",
                      bad_rows: str = "error") -> list[Pair]:
    """Pairs for a reward model: `render(prompt, reply)` -> the full text a scalar RM scores (its chat
    template over the conversation, as `RewardModelWorker.render`); the ids up to the token the
    sequence-classification head reads (the last non-pad token) are the 'prompt', one pad token the
    'response' (its position holds that token's hidden state in the value layout). truncate_left keeps
    the text's end, as the RM worker does."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dropped = [0]

    def scored_ids(prompt, reply, where) -> list[int] | None:
        ids = list(tokenizer(render(prompt, reply), add_special_tokens=False)["input_ids"])
        while ids and ids[-1] == pad:  # the head reads the last non-pad token
            ids.pop()
        return _fit(ids, 0, max_length, overlong, where)

    def build(row: dict, path: str, number: int, where: str) -> Pair | None:
        prompt, chosen, rejected = _pair_fields(row, prompt_key, chosen_key, rejected_key)
        chosen_ids, rejected_ids = scored_ids(prompt, chosen, where), scored_ids(prompt, rejected, where)
        if chosen_ids is None or rejected_ids is None:
            dropped[0] += 1
            return None
        return Pair([], chosen_ids, rejected_ids, path, number)

    pairs = _read_checked(files, build, bad_rows, "reward-model")
    if dropped[0]:
        print(f"note: reward-model data: {dropped[0]} pairs longer than {max_length} tokens dropped", flush=True)
    return pairs


def collate_scored(sequences: list[list[int]], pad_token_id: int) -> DataProto:
    """Each full sequence as the 'prompt' + one pad 'response' token: values[:, 0] is the score."""
    return collate_sequences(sequences, [[pad_token_id]] * len(sequences), pad_token_id)


# ------------------------------------------------------------------ batching


def collate_sequences(prompts: list[list[int]], replies: list[list[int]], pad_token_id: int) -> DataProto:
    """Left-padded prompts + right-padded replies, the layout the engines read (as after a rollout).

    input_ids/attention_mask/position_ids [B, P + R]; responses [B, R]; response_mask [B, R]: the
    loss mask (1 on the reply tokens).
    """
    width_p, width_r = max(len(p) for p in prompts), max(len(r) for r in replies)
    n = len(prompts)
    input_ids = torch.full((n, width_p + width_r), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_r), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, replies)):
        input_ids[i, width_p - len(p):width_p] = torch.as_tensor(p, dtype=torch.long)
        input_ids[i, width_p:width_p + len(r)] = torch.as_tensor(r, dtype=torch.long)
        attention_mask[i, width_p - len(p):width_p + len(r)] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "responses": input_ids[:, width_p:].clone(), "response_mask": attention_mask[:, width_p:].clone()})


def collate_sft(examples: list[Example], pad_token_id: int, loss_on: str = "response") -> DataProto:
    """loss_on=response: the loss mask is the reply; all: every token but the first (the first token
    becomes the 'prompt', the rest the 'response')."""
    if loss_on == "all":
        full = [e.prompt_ids + e.response_ids for e in examples]
        return collate_sequences([ids[:1] for ids in full], [ids[1:] for ids in full], pad_token_id)
    return collate_sequences([e.prompt_ids for e in examples], [e.response_ids for e in examples], pad_token_id)


def collate_pairs(pairs: list[Pair], pad_token_id: int) -> DataProto:
    """Rows 2i (chosen) and 2i + 1 (rejected) of pair i, one layout for all."""
    prompts = [p.prompt_ids for p in pairs for _ in range(2)]
    replies = [ids for p in pairs for ids in (p.chosen_ids, p.rejected_ids)]
    return collate_sequences(prompts, replies, pad_token_id)
