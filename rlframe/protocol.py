"""DataProto: the one batch type that crosses process boundaries.

A ``DataProto`` holds N rows in three parts:

* ``batch``: a ``tensordict.TensorDict`` with ``batch_size=[N]`` (token ids, masks, log-probs ...),
  or ``None`` when the batch carries no tensors;
* ``non_tensor_batch``: ``{name: np.ndarray(dtype=object, shape=[N])}`` (raw prompts, ground
  truths, data sources ...);
* ``meta_info``: a plain dict that belongs to the batch as a whole (temperature, metrics ...).

Every row operation (indexing, repeat, pad, chunk ...) is applied to both the tensors and the
non-tensor arrays, so the two never drift apart. Operations return new ``DataProto`` objects unless
their docstring says "in place".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["DataProto"]


def _to_object_array(values: Any) -> np.ndarray:
    """Turn a list (or array) of per-row values into a 1-D object array of the same length.

    Filling element by element keeps rows that are themselves lists (chat messages, for example)
    as single Python objects instead of letting numpy build a 2-D array from them.
    """
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors, numpy arrays and ordinary Python values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if isinstance(a, np.ndarray) and a.dtype == object and isinstance(b, np.ndarray) and b.dtype == object:
            return a.shape == b.shape and all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:
            return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _as_index(idx: Any, length: int) -> slice | np.ndarray:
    """Normalise any supported row index to a slice or a 1-D int64 numpy array.

    An int becomes a one-element array so that indexing always keeps the row dimension.
    Boolean masks become the positions of their True entries.
    """
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, (int, np.integer)):
        if not -length <= idx < length:
            raise IndexError(f"row index {idx} out of range for DataProto of length {length}")
        return np.array([idx % length], dtype=np.int64)
    if isinstance(idx, torch.Tensor):
        idx = idx.detach().cpu().numpy()
    idx = np.asarray(idx)
    if idx.dtype == bool:
        if idx.shape != (length,):
            raise IndexError(f"boolean mask of shape {idx.shape} does not match DataProto of length {length}")
        return np.nonzero(idx)[0]
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"unsupported row index of dtype {idx.dtype}; use ints, a slice or a boolean mask")
    return idx.astype(np.int64).reshape(-1)


@dataclass
class DataProto:
    """A batch of N rows: tensors (``batch``), per-row Python objects and batch-level metadata."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: _to_object_array(v) for k, v in self.non_tensor_batch.items()}
        self.check_consistency()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, list | np.ndarray] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        """Build a DataProto; every tensor and non-tensor list must have the same first dimension."""
        batch = None
        if tensors:
            lengths = {k: v.shape[0] for k, v in tensors.items()}
            if len(set(lengths.values())) != 1:
                raise ValueError(f"tensors have different first dimensions: {lengths}")
            batch = TensorDict(dict(tensors), batch_size=[next(iter(lengths.values()))])
        non_tensor_batch = {k: _to_object_array(v) for k, v in (non_tensors or {}).items()}
        return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(meta_info or {}))

    def check_consistency(self) -> None:
        """Raise ValueError unless every field has the same number of rows."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(f"batch must have a 1-D batch_size, got {list(self.batch.batch_size)}")
        n = len(self)
        for key, values in self.non_tensor_batch.items():
            if values.ndim != 1 or len(values) != n:
                raise ValueError(f"non-tensor field {key!r} has shape {values.shape}, expected ({n},)")

    # ------------------------------------------------------------------ basic access

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for values in self.non_tensor_batch.values():
            return len(values)
        return 0

    @property
    def batch_keys(self) -> list[str]:
        return [] if self.batch is None else list(self.batch.keys())

    def __contains__(self, key: str) -> bool:
        return key in self.batch_keys or key in self.non_tensor_batch

    def __repr__(self) -> str:
        tensors = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in self.batch.items()} if self.batch is not None else {}
        return (
            f"DataProto(len={len(self)}, tensors={tensors}, "
            f"non_tensors={list(self.non_tensor_batch)}, meta_info={list(self.meta_info)})"
        )

    def __getitem__(self, idx: int | slice | list[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Select rows. Always returns a DataProto (an int gives one row); meta_info is shared."""
        index = _as_index(idx, len(self))
        batch = None
        if self.batch is not None:
            batch = self.batch[index] if isinstance(index, slice) else self.batch[torch.from_numpy(index)]
        non_tensors = {k: v[index] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=self.meta_info)

    def select(self, batch_keys=None, non_tensor_keys=None, meta_info_keys=None) -> DataProto:
        """A new DataProto with only the given keys (None keeps all keys of that part)."""
        batch = self.batch
        if batch is not None and batch_keys is not None:
            batch = batch.select(*batch_keys)
        elif batch is not None:
            batch = batch.copy()
        if batch_keys and self.batch is None:
            raise KeyError(f"batch keys {list(batch_keys)} requested from a DataProto without tensors")
        keys = self.non_tensor_batch.keys() if non_tensor_keys is None else non_tensor_keys
        non_tensors = {k: self.non_tensor_batch[k] for k in keys}
        keys = self.meta_info.keys() if meta_info_keys is None else meta_info_keys
        meta_info = {k: self.meta_info[k] for k in keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    def pop(self, batch_keys=(), non_tensor_keys=(), meta_info_keys=()) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto."""
        batch = None
        if batch_keys:
            if self.batch is None:
                raise KeyError(f"batch keys {list(batch_keys)} requested from a DataProto without tensors")
            batch = TensorDict({k: self.batch.pop(k) for k in batch_keys}, batch_size=self.batch.batch_size)
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in non_tensor_keys}
        meta_info = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other``'s fields into self (in place) and return self.

        A key present in both must hold equal values; otherwise ValueError names the key.
        """
        has_fields = self.batch is not None or bool(self.non_tensor_batch)
        if has_fields and (other.batch is not None or other.non_tensor_batch) and len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of different lengths ({len(self)} vs {len(other)})")
        if other.batch is not None:
            if self.batch is None:
                self.batch = TensorDict({}, batch_size=other.batch.batch_size)
            for key, value in other.batch.items():
                if key in self.batch.keys():
                    if not _values_equal(self.batch[key], value):
                        raise ValueError(f"union conflict: tensor {key!r} differs between the two DataProtos")
                else:
                    self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch:
                if not _values_equal(self.non_tensor_batch[key], value):
                    raise ValueError(f"union conflict: non-tensor {key!r} differs between the two DataProtos")
            else:
                self.non_tensor_batch[key] = value
        for key, value in other.meta_info.items():
            if key in self.meta_info:
                if not _values_equal(self.meta_info[key], value):
                    raise ValueError(f"union conflict: meta_info {key!r} differs between the two DataProtos")
            else:
                self.meta_info[key] = value
        return self

    # ------------------------------------------------------------------ splitting and joining

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts; the length must divide evenly."""
        if chunks <= 0:
            raise ValueError(f"chunks must be positive, got {chunks}")
        if len(self) % chunks:
            raise ValueError(
                f"DataProto of length {len(self)} cannot be split into {chunks} equal chunks; "
                f"call pad_to_divisor({chunks}) first (and unpad the result)"
            )
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into parts of ``split_size`` rows; the last part may be smaller."""
        if split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(items: list[DataProto]) -> DataProto:
        """Concatenate rows of several DataProtos; meta_info is taken from the first."""
        if not items:
            raise ValueError("concat needs at least one DataProto")
        with_batch = [item.batch is not None for item in items]
        if any(with_batch) and not all(with_batch):
            raise ValueError("cannot concat DataProtos where only some carry tensors")
        batch = torch.cat([item.batch for item in items], dim=0) if all(with_batch) else None
        keys = list(items[0].non_tensor_batch)
        for item in items[1:]:
            if set(item.non_tensor_batch) != set(keys):
                raise ValueError(f"cannot concat: non-tensor keys differ ({keys} vs {list(item.non_tensor_batch)})")
        non_tensors = {k: np.concatenate([item.non_tensor_batch[k] for item in items]) for k in keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(items[0].meta_info))

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Repeat every row. interleave=True gives a,a,b,b; interleave=False gives a,b,a,b."""
        rows = np.arange(len(self))
        index = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self[index]

    def reorder(self, indices) -> DataProto:
        """Reorder rows in place (row i becomes old row ``indices[i]``); returns self."""
        reordered = self[indices]
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Pad to a multiple of ``divisor`` by repeating rows from the start (cyclically).

        Returns ``(padded, pad_size)``; ``padded`` is self when no padding is needed.
        """
        if divisor <= 0:
            raise ValueError(f"divisor must be positive, got {divisor}")
        pad_size = -len(self) % divisor
        if pad_size == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("cannot pad an empty DataProto")
        padding = self[np.arange(pad_size) % len(self)]
        return DataProto.concat([self, padding]), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows (the inverse of pad_to_divisor)."""
        return self[: len(self) - pad_size] if pad_size else self

    def mini_batches(
        self, mini_batch_size: int, shuffle: bool = False, seed: int = 0, epochs: int = 1
    ) -> Iterator[DataProto]:
        """Yield mini-batches for ``epochs`` passes over the rows.

        With ``shuffle``, each epoch uses a fresh permutation drawn from one ``torch.Generator``
        seeded with ``seed``, so the sequence is reproducible. The last partial batch is kept.
        """
        generator = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
            for start in range(0, len(self), mini_batch_size):
                yield self[order[start : start + mini_batch_size]]

    def to(self, device: str | torch.device) -> DataProto:
        """A DataProto whose tensors live on ``device`` (non-tensor fields are shared)."""
        batch = self.batch.to(device) if self.batch is not None else None
        return DataProto(batch=batch, non_tensor_batch=dict(self.non_tensor_batch), meta_info=self.meta_info)

    # ------------------------------------------------------------------ serialisation

    def __getstate__(self) -> dict:
        """Store CPU tensors as raw numpy byte arrays so Ray can ship them without pickling.

        Measured with Ray 2.60: ``ray.put`` of a 256 MB torch tensor (plain, in a dict or in a
        TensorDict) takes ~0.7-1 s because tensors go through pickle in-band, while a numpy array
        of the same size takes ~0.03 s (pickle5 out-of-band buffer, no copy). Viewing each tensor's
        bytes as uint8 works for every dtype, bf16 included. Tensors on other devices or that need
        grad are pickled as they are.
        """
        tensors = batch_size = device = None
        if self.batch is not None:
            tensors = {k: _tensor_to_wire(v) for k, v in self.batch.items()}
            batch_size = list(self.batch.batch_size)
            device = None if self.batch.device is None else str(self.batch.device)
        return {
            "tensors": tensors,
            "batch_size": batch_size,
            "device": device,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        self.batch = None
        if state["tensors"] is not None:
            tensors = {k: _tensor_from_wire(v) for k, v in state["tensors"].items()}
            self.batch = TensorDict(tensors, batch_size=state["batch_size"], device=state["device"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


@dataclass
class _WireTensor:
    """A CPU tensor as its raw bytes (a uint8 numpy array) plus dtype and shape."""

    data: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]


def _tensor_to_wire(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.requires_grad:
        return value
    flat = value.detach().contiguous().reshape(-1)
    return _WireTensor(flat.view(torch.uint8).numpy(), value.dtype, tuple(value.shape))


def _tensor_from_wire(value: Any) -> Any:
    if not isinstance(value, _WireTensor):
        return value
    data = value.data
    if not data.flags.writeable:  # Ray hands out read-only views of its shared memory: copy once
        data = data.copy()
    return torch.from_numpy(data).view(value.dtype).reshape(value.shape)


# ---------------------------------------------------------------- the rows that cross the driver/worker line
AGENT_END_REASONS = ("answer", "turn_limit", "budget", "env_error")  # the values of a multi-turn row's agent_end


def build_rollout_batch(prompts: DataProto, responses: list[list[int]], log_probs: list[list[float]],
                        response_width: int, pad_token_id: int) -> DataProto:
    """Pack generated responses next to their left-padded prompts.

    Returns prompts [B,P], responses [B,R] (right-padded), input_ids / attention_mask /
    position_ids [B,P+R], response_mask [B,R] (1 on generated tokens, EOS included) and
    rollout_log_probs [B,R] (the engine's log-probs of the sampled tokens).
    """
    batch_size = len(responses)
    response_ids = torch.full((batch_size, response_width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((batch_size, response_width), dtype=torch.float32)
    rollout_log_probs = torch.zeros((batch_size, response_width), dtype=torch.float32)
    for i, (tokens, lps) in enumerate(zip(responses, log_probs)):
        tokens = tokens[:response_width]
        response_ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[i, : len(tokens)] = 1.0
        rollout_log_probs[i, : len(tokens)] = torch.tensor(lps[: len(tokens)], dtype=torch.float32)
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={
        "prompts": prompt_ids,
        "responses": response_ids,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
    })


def as_messages(prompt) -> list[dict]:
    """A row's raw_prompt (a string, or chat messages in any sequence type) as a list of plain message dicts."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [dict(m) for m in prompt]  # numpy object arrays, tuples, ... -> plain dicts
    if not all("role" in m and "content" in m for m in messages):
        raise ValueError("raw_prompt must be a string or a list of {'role', 'content'} messages")
    return messages


def render_for_scoring(tokenizer, prompt, response: str) -> str:
    """The text a reward model scores for (prompt, response): the tokenizer's chat template over the
    conversation, else the plain concatenation. Reward-model training renders its pairs the same way."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(as_messages(prompt) + [{"role": "assistant", "content": response}],
                                             tokenize=False)
    if not isinstance(prompt, str):
        prompt = "\n".join(m["content"] for m in as_messages(prompt))
    return prompt + response
