"""stage=pt: documents read from txt / jsonl, packed into full rows whose documents never see each other
(the packed forward equals each document's own forward), and a file with no text column refused first."""

import json

import pytest
import torch

from rlframe.stages.pt_data import collate_packed, pack_documents, read_documents
from rlframe.workers.attention import VARLEN_SDPA, register_varlen_attention
from rlframe.workers.engine.hf_model import forward_response_log_probs


def test_pack_documents_by_hand():
    # documents of 3, 5 and 2 tokens into rows of 4: the second continues in row 2 as a new segment
    rows = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], 4)
    assert [r.ids for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert [r.positions for r in rows] == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1]]
    batch = collate_packed(rows, pad_token_id=0)
    # loss on every token with context in its segment: not on a segment's first token, not on padding
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert batch.batch["position_ids"][0].tolist() == [0, 1, 2, 0]


def test_packed_rows_attend_within_documents_only(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    register_varlen_attention()
    packed_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                        attn_implementation=VARLEN_SDPA).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, plain.config.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 3, 9)]
    rows = pack_documents(docs, 16)  # 31 tokens: rows of 16 and 15, the second document split over both
    batch = collate_packed(rows, pad_token_id=0)
    b = batch.batch
    with torch.no_grad():
        packed, _ = forward_response_log_probs(packed_model, b["input_ids"], b["attention_mask"], b["position_ids"],
                                               b["responses"].size(1), packed=True)
    # each segment (a document, or the piece of one in a row) on its own, plain causal attention
    expected = torch.zeros_like(packed)
    for i, row in enumerate(rows):
        starts = [j for j, p in enumerate(row.positions) if p == 0] + [len(row.ids)]
        for s, e in zip(starts, starts[1:]):
            ids = torch.tensor([row.ids[s:e]])
            with torch.no_grad():
                logits = plain(input_ids=ids).logits[0, :-1]
            expected[i, s:e - 1] = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    mask = b["response_mask"].bool()
    assert mask.sum() == 31 - 5  # 31 tokens, 5 segment starts (4 documents, one split)
    torch.testing.assert_close(packed[mask], expected[mask], rtol=1e-4, atol=1e-5)
    # the same rows as one unsegmented sequence per row differ: the boundaries are what keeps them apart
    with torch.no_grad():
        crossing, _ = forward_response_log_probs(plain, b["input_ids"], b["attention_mask"],
                                                 (b["attention_mask"].cumsum(1) - 1).clamp(min=0), b["responses"].size(1))
    assert (crossing[mask] - expected[mask]).abs().max() > 1e-3


def test_read_documents_txt_and_jsonl(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("First document,\nstill the first.\n\n\nSecond one.\n   \nThird.\n")
    assert read_documents(str(txt)) == ["First document,\nstill the first.", "Second one.", "Third."]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"content": t, "id": i}) for i, t in enumerate(["a b", "", "c"])) + "\n")
    assert read_documents(str(rows), "content") == ["a b", "c"]
    from rlframe.data.files import DatasetError

    with pytest.raises(DatasetError, match=r"no 'text' column \(its columns: content, id\).*pt.text_key"):
        read_documents(str(rows))


def test_a_file_without_a_text_column_is_refused_before_workers(tmp_path):
    from rlframe.config import ConfigError, validate_config
    from rlframe.main import compose_config

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "some text"}) + "\n")
    cfg = compose_config(["recipe=pt_text", f"data.train_files={rows}"])
    with pytest.raises(ConfigError, match=r"pt.text_key: .*rows.jsonl has no 'text' column \(its columns: body\)"):
        validate_config(cfg)
    ok = compose_config(["recipe=pt_text", f"data.train_files={rows}", "pt.text_key=body"])
    validate_config(ok)
    unpacked = compose_config(["recipe=pt_text", "actor.use_remove_padding=false"])
    with pytest.raises(ConfigError, match="actor.use_remove_padding: stage=pt packs"):
        validate_config(unpacked)

