"""The data of stage=pt: raw text documents, read, tokenised and packed into full-length rows.

    documents = read_documents(path, text_key)     # .txt: blank-line-separated blocks; jsonl/parquet/...: a column
    rows      = pack_documents(token lists, L)     # back to back, each document + EOS; rows of exactly L tokens
    batch     = collate_packed(rows)               # position ids restart at 0 where a document starts

A packed row keeps its documents apart through its position ids: the engine's packed forward (flash-attn
varlen / VARLEN_SDPA, `workers/attention.py`) starts a new causal sequence wherever a position id is 0,
so no token attends to another document. A document longer than what is left of a row continues in the
next row as a new segment (positions from 0 again: the cut-off part starts without the earlier context).
The loss mask is every token that has context in its own segment: all but each segment's first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from rlframe.data.dataset import read_rows
from rlframe.data.files import DatasetError
from rlframe.protocol import DataProto

TEXT_SUFFIXES = (".txt", ".text", ".md")


@dataclass
class PackedRow:
    """One row of `max_length` (or fewer, the last) tokens; `positions` restart at 0 per segment."""

    ids: list[int]
    positions: list[int]


def read_documents(path: str, text_key: str = "text") -> list[str]:
    """The non-empty documents of one file: .txt/.md blocks separated by blank lines, else `text_key` of each row."""
    file = Path(path).expanduser()
    if file.suffix.lower() in TEXT_SUFFIXES:
        if not file.exists():
            raise DatasetError(f"data file not found: {file}")
        text = file.read_text(encoding="utf-8", errors="replace")
        return [block.strip() for block in re.split(r"\n\s*\n", text) if block.strip()]
    rows = read_rows(path)
    if not rows:
        return []
    if text_key not in rows[0]:
        raise DatasetError(f"{path}: no '{text_key}' column (its columns: {', '.join(map(str, rows[0]))}). "
                           f"Fix: pt.text_key=<the column holding the text>, or a .txt file (one document per "
                           "blank-line-separated block)")
    documents = []
    for number, row in enumerate(rows):
        value = row.get(text_key)
        if value is not None and not isinstance(value, str):
            raise DatasetError(f"{path}, row {number}: '{text_key}' is a {type(value).__name__}, not text. "
                               f"Fix: pt.text_key=<a text column>")
        if value and value.strip():
            documents.append(value.strip())
    return documents


def text_column_problem(path: str, text_key: str) -> str | None:
    """For the config checks: why `path` has no text for stage=pt (None when it has, or is a .txt file)."""
    if Path(path).suffix.lower() in TEXT_SUFFIXES or not Path(path).expanduser().exists():
        return None
    try:
        rows = read_rows(path)
    except DatasetError as error:
        return str(error)
    if rows and text_key not in rows[0]:
        return (f"{path} has no '{text_key}' column (its columns: {', '.join(map(str, rows[0]))}). "
                f"Fix: pt.text_key=<the column holding the text>, or a .txt file")
    return None


def tokenize_documents(documents: list[str], tokenizer) -> list[list[int]]:
    """Each document's ids (no special tokens) + EOS: the model learns where a document ends."""
    eos = tokenizer.eos_token_id
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return [list(ids) + [eos] for ids in encoded if ids]


def pack_documents(documents: list[list[int]], max_length: int) -> list[PackedRow]:
    """Greedy, in order: documents back to back into rows of `max_length` tokens; a document that does not
    fit continues in the next row as a new segment. The last row may be shorter."""
    rows, ids, positions = [], [], []
    for doc in documents:
        start = 0
        while start < len(doc):
            take = min(max_length - len(ids), len(doc) - start)
            ids += doc[start:start + take]
            positions += list(range(take))
            start += take
            if len(ids) == max_length:
                rows.append(PackedRow(ids, positions))
                ids, positions = [], []
    if ids:
        rows.append(PackedRow(ids, positions))
    return rows


def collate_packed(rows: list[PackedRow], pad_token_id: int) -> DataProto:
    """The engines' layout: 'prompt' = each row's first token, 'response' = the rest (right-padded);
    position_ids restart per segment; response_mask = real tokens whose position id is > 0."""
    width = max(len(r.ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row.ids)] = torch.as_tensor(row.ids)
        attention_mask[i, :len(row.ids)] = 1
        position_ids[i, :len(row.ids)] = torch.as_tensor(row.positions)
    loss_mask = attention_mask * (position_ids > 0)
    return DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "responses": input_ids[:, 1:].clone(), "response_mask": loss_mask[:, 1:].clone()})


def load_documents(files: list[str], text_key: str) -> list[str]:
    documents = [doc for path in files for doc in read_documents(path, text_key)]
    if files and not documents:
        raise DatasetError(f"no text in {files} (pt.text_key={text_key})")
    return documents
