"""Building, sharding and reading HF causal LMs inside a worker process.

`build_causal_lm` loads the model in fp32 (the master copy); `shard_model` applies FSDP2
`fully_shard` per decoder layer and at the root (bf16 compute with fp32 reduction on GPU, optional
CPU offload of parameters). `iter_full_weights` yields each parameter unsharded, one tensor at a
time, which is what weight sync streams into the rollout engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from rlframe.device import DeviceProfile

# Token positions whose logits are upcast to float32 at once (bounds the fp32 copy to LOGIT_CHUNK x vocab).
LOGIT_CHUNK = 1024


def build_causal_lm(path: str, profile: DeviceProfile, *, gradient_checkpointing: bool = False,
                    trust_remote_code: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=profile.attn_implementation, trust_remote_code=trust_remote_code)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (Llama/Qwen/Mistral layout: model.model.layers)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}: expected model.model.layers")
    return list(layers)


def needs_sharding(profile: DeviceProfile) -> bool:
    """FSDP at world size 1 on CPU is the identity plus copies: skip it there."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return dist.is_initialized() and (world > 1 or profile.is_gpu)


def shard_model(model: nn.Module, profile: DeviceProfile, *, offload_params: bool = False) -> nn.Module:
    """Apply FSDP2 to each decoder layer and the root; returns the same (now sharded) module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(profile.device, (dist.get_world_size(),))
    kwargs = {"mesh": mesh}
    if profile.is_gpu and profile.dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=profile.dtype, reduce_dtype=torch.float32)
    if offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def iter_full_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) per parameter and buffer, unsharding FSDP2 DTensors one at a time.

    Every rank must iterate (the unshard is a collective); the names are the HF checkpoint names.
    """
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor


def trim_padding_columns(attention_mask: torch.Tensor, response_width: int) -> tuple[int, int]:
    """Columns [start, end) that hold a real token in at least one row.

    Prompts are left-padded and responses right-padded, so the columns outside this window are
    padding in every row and need no compute. The response region keeps its left edge, so
    `end - (total - response_width)` response columns survive.
    """
    has_token = attention_mask.bool().any(dim=0)
    positions = torch.nonzero(has_token).flatten()
    total = attention_mask.size(1)
    prompt_width = total - response_width
    start = int(positions[0]) if len(positions) else 0
    end = max(int(positions[-1]) + 1 if len(positions) else total, prompt_width + 1)
    return min(start, prompt_width - 1), end


def forward_response_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               position_ids: torch.Tensor, response_width: int, temperature: float = 1.0,
                               with_entropy: bool = False, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens under `model`, shape [B, response_width].

    log p(y_t | x, y_<t) = log_softmax(logits_{t-1} / temperature)[y_t]; padding columns shared by
    all rows are trimmed before the forward pass and the result is zero-padded back.
    """
    from rlframe.algos import entropy_from_logits, log_probs_from_logits

    if packed:
        return _packed_response_log_probs(model, input_ids, attention_mask, position_ids, response_width,
                                          temperature, with_entropy)
    start, end = trim_padding_columns(attention_mask, response_width)
    prompt_width = input_ids.size(1) - response_width
    kept_response = end - prompt_width
    logits = model(input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, start:end],
                   position_ids=position_ids[:, start:end], use_cache=False).logits
    # logits at column c predict the token at column c + 1
    # Kept in the model's dtype; the float32 upcast happens LOGIT_CHUNK positions at a time.
    response_logits = logits[:, prompt_width - start - 1: end - start - 1]
    if temperature != 1.0:
        response_logits = response_logits / temperature
    targets = input_ids[:, prompt_width:end]
    log_probs = log_probs_from_logits(response_logits, targets, chunk_size=LOGIT_CHUNK)
    entropy = entropy_from_logits(response_logits, chunk_size=LOGIT_CHUNK) if with_entropy else None
    pad = response_width - kept_response
    if pad:
        log_probs = torch.nn.functional.pad(log_probs, (0, pad))
        entropy = torch.nn.functional.pad(entropy, (0, pad)) if entropy is not None else None
    return log_probs, entropy


def _packed_response_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               position_ids: torch.Tensor, response_width: int, temperature: float,
                               with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padding-free variant: all real tokens of the micro-batch packed into one row.

    The model sees one sequence of sum(lengths) tokens whose position ids restart at 0 for each
    original row; transformers turns that into flash-attn varlen (GPU) or a block-diagonal causal
    mask (SDPA), so no compute is spent on padding and no token attends across rows. Token j of
    the packed row predicts token j + 1; the result is scattered back to the padded [B, R] grid.
    """
    from rlframe.algos import entropy_from_logits, log_probs_from_logits

    real = attention_mask.bool()
    packed_ids = input_ids[real].unsqueeze(0)
    logits = model(input_ids=packed_ids, position_ids=position_ids[real].unsqueeze(0), attention_mask=None,
                   use_cache=False).logits[0, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    next_log_probs = log_probs_from_logits(logits, packed_ids[0, 1:], chunk_size=LOGIT_CHUNK)
    prompt_width = input_ids.size(1) - response_width
    response_mask = attention_mask[:, prompt_width:].to(next_log_probs.dtype)

    def to_response_grid(per_token: torch.Tensor) -> torch.Tensor:
        # value at a real token = prediction of the token after it; the response token at column
        # prompt_width + t is predicted at column prompt_width + t - 1.
        grid = torch.zeros(input_ids.shape, dtype=per_token.dtype, device=per_token.device)
        grid[real] = torch.nn.functional.pad(per_token, (0, 1))
        return grid[:, prompt_width - 1: prompt_width - 1 + response_width] * response_mask

    entropy = to_response_grid(entropy_from_logits(logits, chunk_size=LOGIT_CHUNK)) if with_entropy else None
    return to_response_grid(next_log_probs), entropy
