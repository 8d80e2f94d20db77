"""stage=rft keeps exactly the rows it says: the best k per prompt at or above min_score, identical replies
once, the sampled token ids themselves (prompt without padding, reply under its mask); rrhf keeps groups."""

import torch

from rlframe.protocol import DataProto
from rlframe.stages.rft import RFTTrainer, select_kept


def test_select_kept_by_hand():
    scores = [0.0, 1.0, 1.0, 0.9, 1.0]
    texts = ["a", "b", "b ", "c", "d"]  # sample 2 repeats sample 1 (stripped)
    assert select_kept(scores, texts, keep_top_k=1, min_score=1.0) == [1]
    assert select_kept(scores, texts, keep_top_k=2, min_score=1.0) == [1, 4]  # 2 is a duplicate of 1
    assert select_kept(scores, texts, keep_top_k=0, min_score=0.9) == [1, 4, 3]  # all >= 0.9, best first
    assert select_kept(scores, texts, keep_top_k=3, min_score=1.5) == []
    assert select_kept([0.5, 0.5], ["", "x"], keep_top_k=1, min_score=0.0) == [1]  # an empty reply is never kept


def _trainer(*overrides):
    from rlframe.main import compose_config

    trainer = object.__new__(RFTTrainer)  # the driver's selection alone: no workers
    trainer.cfg = compose_config(["recipe=rft_math", *overrides])
    return trainer


def _samples():
    """2 rows of one prompt: prompt width 3 (left-padded), response width 3 (right-padded)."""
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 0], [0, 5, 6, 9, 0, 0]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]])
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                                        "responses": input_ids[:, 3:], "response_mask": attention_mask[:, 3:]})


def test_keep_turns_the_chosen_samples_into_sft_rows():
    trainer = _trainer("rft.keep_top_k=1", "rft.min_score=1.0")
    kept = trainer.keep(_samples(), [0.0, 1.0], ["7 8", "9"], offset=0)
    assert len(kept) == 1
    assert kept[0].prompt_ids == [5, 6] and kept[0].response_ids == [9] and kept[0].extra["score"] == 1.0
    assert trainer.keep(_samples(), [0.0, 0.5], ["7 8", "9"], offset=0) == []


def test_rrhf_keeps_whole_groups_whose_best_reaches_min_score():
    trainer = _trainer("rft.loss=rrhf", "rft.n=2", "rft.min_score=1.0", "rft.batch_size=1")
    kept = trainer.keep(_samples(), [0.0, 1.0], ["7 8", "9"], offset=0)
    assert [(e.response_ids, e.extra["score"]) for e in kept] == [([7, 8], 0.0), ([9], 1.0)]
    assert trainer.keep(_samples(), [0.0, 0.5], ["7 8", "9"], offset=0) == []
    trainer.rows, trainer.pad_token_id = kept, 0
    batches = list(trainer.round_batches(0))  # rft.epochs=2 passes over the one group
    assert len(batches) == 2 and all(b.batch["rank_score"].tolist() == [0.0, 1.0] for b in batches)


def test_round_batches_cover_every_kept_row_once_per_epoch():
    from rlframe.stages.data import Example

    trainer = _trainer("rft.epochs=2", "rft.batch_size=2")
    trainer.pad_token_id = 0
    trainer.rows = [Example([5], [i], "rollout", i, {"score": 1.0}) for i in (7, 8, 9)]
    batches = list(trainer.round_batches(0))
    assert [len(b) for b in batches] == [2, 1, 2, 1]  # 3 rows in steps of 2, two passes
    for first, second in ((0, 1), (2, 3)):
        seen = torch.cat([batches[first].batch["responses"][:, 0], batches[second].batch["responses"][:, 0]])
        assert sorted(seen.tolist()) == [7, 8, 9]  # each pass: every kept row once
    trainer.rows = []
    assert list(trainer.round_batches(0)) == []  # nothing kept: no update
