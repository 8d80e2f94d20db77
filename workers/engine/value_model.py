"""The value model of PPO's critic: an HF causal-LM backbone with a scalar value head.

The model is the checkpoint's backbone (`AutoModel`, which loads a `...ForCausalLM` checkpoint
without its LM head) plus our own `Linear(hidden, 1)` value head. We do not use
`AutoModelForTokenClassification(num_labels=1)`: not every causal-LM architecture registers a
token-classification class, and those that do add a dropout layer and name the head differently
per architecture. `AutoModel` exists for every HF LM, and one head we own is one thing to read.
The head starts at zero, so the first values are exactly 0 (a neutral guess for rewards near 0-1);
the backbone starts from `critic.model_path` (default: the actor's model).

V[i, t] is the value of the state *before* response token t (the hidden state of the previous
column), aligned with the log-probs of the actor: values and log-probs share one [B, R] layout.
"""

from __future__ import annotations

import torch
from torch import nn

from rlframe.device import DeviceProfile
from rlframe.workers.engine.hf_model import trim_padding_columns


class ValueModel(nn.Module):
    """backbone (HF `AutoModel`) -> hidden states [B, S, H] -> value head -> values [B, S]."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone  # named like the causal LM's backbone, so decoder_layers() finds model.layers
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def build_value_model(path: str, profile: DeviceProfile, *, gradient_checkpointing: bool = False,
                      trust_remote_code: bool = False) -> ValueModel:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation=profile.attn_implementation,
                                         trust_remote_code=trust_remote_code)
    backbone.config.use_cache = False
    if gradient_checkpointing:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ValueModel(backbone, backbone.config.hidden_size)


def forward_response_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, response_width: int) -> torch.Tensor:
    """V of each response position, [B, response_width]; shared padding columns trimmed, zero-padded back."""
    start, end = trim_padding_columns(attention_mask, response_width)
    prompt_width = input_ids.size(1) - response_width
    values = model(input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, start:end],
                   position_ids=position_ids[:, start:end])
    response_values = values[:, prompt_width - start - 1: end - start - 1]
    pad = response_width - (end - prompt_width)
    return torch.nn.functional.pad(response_values, (0, pad)) if pad else response_values
