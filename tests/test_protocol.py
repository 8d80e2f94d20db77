"""Tests for rlframe.protocol.DataProto on small hand-made batches."""

import pickle

import numpy as np
import pytest
import torch

from rlframe.protocol import DataProto


def make(n: int = 4) -> DataProto:
    """Rows i = 0..n-1: ids=[i, 10i], score=i/10, text='t{i}', messages=[{'i': i}] (a list per row)."""
    return DataProto.from_dict(
        tensors={"ids": torch.tensor([[i, 10 * i] for i in range(n)]), "score": torch.arange(n) / 10},
        non_tensors={"text": [f"t{i}" for i in range(n)], "messages": [[{"i": i}] for i in range(n)]},
        meta_info={"temperature": 1.0},
    )


def rows(data: DataProto) -> list[int]:
    """The original row number of each row (from the ids column)."""
    return data.batch["ids"][:, 0].tolist()


def test_from_dict_and_len():
    data = make(4)
    assert len(data) == 4
    assert data.batch.batch_size == torch.Size([4])
    assert data.non_tensor_batch["messages"].dtype == object
    assert data.non_tensor_batch["messages"].shape == (4,)  # lists stay one object per row
    assert data.non_tensor_batch["messages"][2] == [{"i": 2}]
    assert "ids" in data and "text" in data and "nope" not in data
    with pytest.raises(ValueError):
        DataProto.from_dict(tensors={"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError):
        DataProto.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"b": [1, 2]})


def test_getitem_kinds():
    data = make(5)
    one = data[2]
    assert isinstance(one, DataProto) and len(one) == 1 and rows(one) == [2]
    assert one.non_tensor_batch["text"].tolist() == ["t2"]
    assert rows(data[-1]) == [4]
    assert rows(data[1:4]) == [1, 2, 3]
    assert rows(data[[4, 0]]) == [4, 0]
    assert data[[4, 0]].non_tensor_batch["text"].tolist() == ["t4", "t0"]
    assert rows(data[np.array([3, 1])]) == [3, 1]
    assert rows(data[torch.tensor([0, 0, 2])]) == [0, 0, 2]
    assert rows(data[np.array([True, False, True, False, False])]) == [0, 2]
    assert data[2].meta_info == {"temperature": 1.0}
    with pytest.raises(IndexError):
        data[5]


def test_select_returns_new_object():
    data = make(3)
    sub = data.select(batch_keys=["ids"], non_tensor_keys=["text"], meta_info_keys=[])
    assert sub.batch_keys == ["ids"] and list(sub.non_tensor_batch) == ["text"] and sub.meta_info == {}
    assert sorted(data.batch_keys) == ["ids", "score"]  # original untouched
    everything = data.select()
    assert sorted(everything.batch_keys) == ["ids", "score"] and everything is not data
    everything.batch["new"] = torch.zeros(3)
    assert "new" not in data.batch_keys


def test_pop_removes_from_self():
    data = make(3)
    popped = data.pop(batch_keys=["score"], non_tensor_keys=["text"], meta_info_keys=["temperature"])
    assert popped.batch_keys == ["score"] and list(popped.non_tensor_batch) == ["text"]
    assert popped.meta_info == {"temperature": 1.0} and len(popped) == 3
    assert data.batch_keys == ["ids"] and list(data.non_tensor_batch) == ["messages"] and data.meta_info == {}
    assert len(data) == 3


def test_union_merges_and_checks_conflicts():
    data = make(3)
    extra = DataProto.from_dict(
        tensors={"ids": data.batch["ids"].clone(), "logp": torch.ones(3)},
        non_tensors={"text": ["t0", "t1", "t2"], "label": ["a", "b", "c"]},
        meta_info={"temperature": 1.0, "step": 7},
    )
    result = data.union(extra)
    assert result is data
    assert sorted(data.batch_keys) == ["ids", "logp", "score"]
    assert data.non_tensor_batch["label"].tolist() == ["a", "b", "c"]
    assert data.meta_info == {"temperature": 1.0, "step": 7}

    bad_tensor = DataProto.from_dict(tensors={"score": torch.zeros(3)})
    with pytest.raises(ValueError, match="score"):
        make(3).union(bad_tensor)
    bad_text = DataProto.from_dict(non_tensors={"text": ["x", "t1", "t2"]})
    with pytest.raises(ValueError, match="text"):
        make(3).union(bad_text)
    bad_meta = DataProto.from_dict(non_tensors={"z": [0, 0, 0]}, meta_info={"temperature": 0.5})
    with pytest.raises(ValueError, match="temperature"):
        make(3).union(bad_meta)
    with pytest.raises(ValueError, match="length"):
        make(3).union(make(4))


def test_union_into_empty_parts():
    tensors_only = DataProto.from_dict(tensors={"a": torch.arange(3)})
    text_only = DataProto.from_dict(non_tensors={"t": ["x", "y", "z"]})
    tensors_only.union(text_only)
    assert tensors_only.non_tensor_batch["t"].tolist() == ["x", "y", "z"]
    text_only.union(DataProto.from_dict(tensors={"a": torch.arange(3)}))
    assert text_only.batch["a"].tolist() == [0, 1, 2]
    empty = DataProto()
    assert len(empty) == 0
    empty.union(make(2))
    assert len(empty) == 2 and rows(empty) == [0, 1]


def test_chunk_and_split():
    data = make(6)
    chunks = data.chunk(3)
    assert [rows(c) for c in chunks] == [[0, 1], [2, 3], [4, 5]]
    assert [c.non_tensor_batch["text"].tolist() for c in chunks][1] == ["t2", "t3"]
    with pytest.raises(ValueError, match="pad_to_divisor"):
        data.chunk(4)
    assert [rows(s) for s in data.split(4)] == [[0, 1, 2, 3], [4, 5]]


def test_concat():
    data = make(5)
    joined = DataProto.concat([data[0:2], data[2:3], data[3:5]])
    assert rows(joined) == [0, 1, 2, 3, 4]
    assert joined.non_tensor_batch["text"].tolist() == ["t0", "t1", "t2", "t3", "t4"]
    assert joined.non_tensor_batch["messages"][4] == [{"i": 4}]
    assert joined.meta_info == {"temperature": 1.0}
    with pytest.raises(ValueError):
        DataProto.concat([data, DataProto.from_dict(non_tensors={"text": ["x"], "messages": [[]]})])


def test_repeat_both_modes():
    data = make(2)
    inter = data.repeat(3)
    assert rows(inter) == [0, 0, 0, 1, 1, 1]
    assert inter.non_tensor_batch["text"].tolist() == ["t0", "t0", "t0", "t1", "t1", "t1"]
    blocked = data.repeat(2, interleave=False)
    assert rows(blocked) == [0, 1, 0, 1]
    assert blocked.non_tensor_batch["text"].tolist() == ["t0", "t1", "t0", "t1"]


def test_reorder_in_place():
    data = make(4)
    result = data.reorder(torch.tensor([3, 1, 0, 2]))
    assert result is data
    assert rows(data) == [3, 1, 0, 2]
    assert data.non_tensor_batch["text"].tolist() == ["t3", "t1", "t0", "t2"]


def test_pad_unpad_round_trip():
    data = make(5)
    padded, pad_size = data.pad_to_divisor(4)
    assert pad_size == 3 and len(padded) == 8
    assert rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]  # cyclic from the start
    assert padded.non_tensor_batch["text"].tolist()[5:] == ["t0", "t1", "t2"]
    restored = padded.unpad(pad_size)
    assert rows(restored) == rows(data)
    assert restored.non_tensor_batch["text"].tolist() == data.non_tensor_batch["text"].tolist()
    assert torch.equal(restored.batch["score"], data.batch["score"])
    # Padding past the length wraps around more than once.
    padded, pad_size = make(2).pad_to_divisor(7)
    assert pad_size == 5 and rows(padded) == [0, 1, 0, 1, 0, 1, 0]
    same, zero = data.pad_to_divisor(5)
    assert zero == 0 and same is data and data.unpad(0) is data


def test_mini_batches_seeded_and_covering():
    data = make(10)
    plain = [rows(mb) for mb in data.mini_batches(4)]
    assert plain == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

    first = [rows(mb) for mb in data.mini_batches(3, shuffle=True, seed=1, epochs=2)]
    again = [rows(mb) for mb in data.mini_batches(3, shuffle=True, seed=1, epochs=2)]
    other = [rows(mb) for mb in data.mini_batches(3, shuffle=True, seed=2, epochs=2)]
    assert first == again and first != other
    assert [len(b) for b in first] == [3, 3, 3, 1] * 2
    epoch0 = sum(first[:4], [])
    epoch1 = sum(first[4:], [])
    assert sorted(epoch0) == list(range(10)) and sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # a fresh permutation per epoch
    assert epoch0 != list(range(10))


def test_pickle_round_trip():
    data = make(3)
    state = data.__getstate__()
    assert set(state["tensors"]) == {"ids", "score"} and state["batch_size"] == [3]
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    assert torch.equal(loaded.batch["ids"], data.batch["ids"])
    assert loaded.batch.batch_size == torch.Size([3])
    assert loaded.non_tensor_batch["messages"][1] == [{"i": 1}]
    assert loaded.meta_info == {"temperature": 1.0}
    text_only = pickle.loads(pickle.dumps(DataProto.from_dict(non_tensors={"t": ["a"]})))
    assert text_only.batch is None and len(text_only) == 1


def test_non_tensor_only_operations():
    data = DataProto.from_dict(non_tensors={"t": ["a", "b", "c"]})
    assert data.batch is None and len(data) == 3
    assert data[1].non_tensor_batch["t"].tolist() == ["b"]
    assert data.repeat(2).non_tensor_batch["t"].tolist() == ["a", "a", "b", "b", "c", "c"]
    padded, pad = data.pad_to_divisor(2)
    assert padded.non_tensor_batch["t"].tolist() == ["a", "b", "c", "a"] and pad == 1
    assert [c.non_tensor_batch["t"].tolist() for c in padded.chunk(2)] == [["a", "b"], ["c", "a"]]
    assert DataProto.concat(data.split(2)).non_tensor_batch["t"].tolist() == ["a", "b", "c"]
    assert data.to("cpu").batch is None


def test_tensor_only_operations():
    data = DataProto.from_dict(tensors={"x": torch.arange(4)})
    assert data.non_tensor_batch == {} and len(data) == 4
    assert data.repeat(2, interleave=False).batch["x"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert DataProto.concat(data.chunk(2)).batch["x"].tolist() == [0, 1, 2, 3]
    assert [mb.batch["x"].tolist() for mb in data.mini_batches(3)] == [[0, 1, 2], [3]]
    moved = data.to("cpu")
    assert moved.batch["x"].device.type == "cpu"


def test_pickle_keeps_every_dtype_and_shape():
    tensors = {
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "bool": torch.tensor([True, False, True]),
        "int8": torch.tensor([[-1], [2], [3]], dtype=torch.int8),
        "strided": torch.arange(12.0).view(3, 4)[:, ::2],  # non-contiguous
        "empty": torch.zeros(3, 0),
        "grad": torch.ones(3, requires_grad=True),
    }
    data = DataProto.from_dict(tensors=tensors)
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    for key, value in tensors.items():
        back = loaded.batch[key]
        assert back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value), key
    loaded.batch["bf16"][0, 0] = 7.0  # the loaded tensors are writable and do not alias the source
    assert data.batch["bf16"][0, 0] != 7.0
