"""rlframe/schema_types.py: a key's declared type and that type in words (beside rlframe/bounds.py)."""

from __future__ import annotations

from typing import Optional

from rlframe.schema_types import field_type, type_in_words


def test_field_type_follows_the_schema_through_sections_and_list_items():
    assert field_type("actor.optim.lr") is float
    assert field_type("trainer.total_steps") is int
    assert field_type("reward.functions[0].weight") is float  # OmegaConf's full_key of a list item
    assert field_type("reward.functions.0.path") is str
    assert field_type("trainer.nope") is None and field_type("actor.optim.lr.deeper") is None


def test_type_in_words():
    assert type_in_words(int) == "a whole number" and type_in_words(bool) == "true or false"
    assert type_in_words(Optional[float]) == "a number (or null)"
    assert type_in_words(list[float]) == "a list of numbers" and type_in_words(list[dict]) == "a list"
    assert type_in_words(dict[str, int]) == "a mapping" and type_in_words(bytes) == "another type"
    assert type_in_words(field_type("actor.optim.betas")) == "a list of numbers"


def test_main_keeps_the_names_it_used_to_define():
    import rlframe.main

    assert rlframe.main.field_type is field_type and rlframe.main.type_in_words is type_in_words
