"""Unpaired preference rows for dpo.loss=kto: one reply per row, labelled desirable or not.

Rows (TRL's unpaired preference layout), keys dpo.completion_key / dpo.label_key:

    prompt      a chat list or a string (data.prompt_key)
    completion  the reply (a string, or a chat list whose last message is the assistant's)
    label       true (desirable) | false (undesirable); also 1 / 0, "true" / "false"

A paired row (prompt, chosen, rejected) is read as two unpaired rows: chosen desirable, rejected not.
Bad rows and long rows follow data.bad_rows and data.overlong, as for the other stages' data.
"""

from __future__ import annotations

from rlframe.stages.data import BadRow, Example, Tokenize, _fit, _messages, _read_checked, _reply

LABELS = {True: True, False: False, 1: True, 0: False, "true": True, "false": False, "1": True, "0": False}


def _label(value, key: str) -> bool:
    label = LABELS.get(value.strip().lower() if isinstance(value, str) else value)
    if label is None:
        raise BadRow(f"field {key!r}: {value!r} is not a label (true: desirable, false: undesirable)")
    return label


def load_unpaired(files: list[str], tokenizer, *, prompt_key: str = "prompt", completion_key: str = "completion",
                  label_key: str = "label", chosen_key: str = "chosen", rejected_key: str = "rejected",
                  max_length: int = 512, overlong: str = "error", bad_rows: str = "error") -> list[Example]:
    """Examples (prompt ids + reply ids + EOS) with extra["label"]: True for a desirable reply."""
    tok = Tokenize(tokenizer)
    dropped = [0]

    def example(prompt, reply: str, label: bool, path: str, number: int, where: str) -> Example | None:
        reply_ids = tok.reply(reply)
        prompt_ids = _fit(tok.prompt(prompt), len(reply_ids), max_length, overlong, where)
        if prompt_ids is None:
            dropped[0] += 1
            return None
        return Example(prompt_ids, reply_ids, path, number, {"label": label})

    def build(row: dict, path: str, number: int, where: str) -> list[Example] | None:
        if prompt_key not in row:
            raise BadRow(f"field {prompt_key!r}: missing")
        prompt = _messages(row[prompt_key], prompt_key)
        if completion_key in row:
            if label_key not in row:
                raise BadRow(f"field {label_key!r}: missing (each {completion_key!r} needs a label)")
            items = [(_reply(row[completion_key], completion_key), _label(row[label_key], label_key))]
        elif chosen_key in row and rejected_key in row:
            items = [(_reply(row[chosen_key], chosen_key), True), (_reply(row[rejected_key], rejected_key), False)]
        else:
            raise BadRow(f"neither {completion_key!r} + {label_key!r} (unpaired) nor {chosen_key!r} + "
                         f"{rejected_key!r} (paired) fields")
        return [e for e in (example(prompt, reply, label, path, number, where) for reply, label in items) if e] or None

    groups = _read_checked(files, build, bad_rows, "unpaired preference")
    examples = [e for group in groups for e in group]
    if dropped[0]:
        print(f"note: unpaired preference data: {dropped[0]} replies longer than {max_length} tokens dropped "
              "(data.overlong)", flush=True)
    return examples
