"""Prompt + response lengths beyond the model's positions are a config error before any worker starts
(vLLM would refuse them only inside the workers)."""

from __future__ import annotations

import pytest

from rlframe.config import ConfigError, RLConfig, validate_config


def _config(model_dir, prompt: int, response: int) -> RLConfig:
    cfg = RLConfig()
    cfg.model.path = str(model_dir)
    cfg.data.max_prompt_length, cfg.data.max_response_length = prompt, response
    return cfg


def test_lengths_beyond_the_positions_are_refused(tiny_model_dir):  # the tiny model has 1024 positions
    validate_config(_config(tiny_model_dir, 1000, 24))
    with pytest.raises(ConfigError, match=r"data.max_prompt_length: 1000 \+ data.max_response_length 25 = 1025 "
                                          r"tokens exceeds the model's max_position_embeddings \(1024"):
        validate_config(_config(tiny_model_dir, 1000, 25))


def test_rope_scaling_stretches_the_positions(tiny_model_dir, tmp_path):
    import json
    import shutil

    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_model_dir, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (scaled / "config.json").write_text(json.dumps(config))
    validate_config(_config(scaled, 2000, 25))  # not ours to judge: vLLM applies the factor
