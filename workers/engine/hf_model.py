"""Building, sharding and reading HF causal LMs inside a worker process (the FSDP engine's model code).

`build_causal_lm` loads the model in fp32 (the master copy); `shard_model` applies FSDP2
`fully_shard` per decoder layer and at the root (bf16 compute with fp32 reduction on GPU, optional
CPU offload of parameters). `iter_full_weights` yields each parameter unsharded, one tensor at a
time, which is what weight sync streams into the rollout engine.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rlframe.device import DeviceProfile
from rlframe.workers.attention import VARLEN_SDPA, register_varlen_attention
from rlframe.workers.distributed import world_size
from rlframe.workers.sequence_parallel import (ULYSSES_SDPA, SequenceParallelGroup, gather_tokens,
                                               register_ulysses_attention, sequence_parallel_forward)

# Token positions whose logits are upcast to float32 at once (bounds the fp32 copy to LOGIT_CHUNK x vocab).
LOGIT_CHUNK = 1024


def build_causal_lm(path: str, profile: DeviceProfile, *, gradient_checkpointing: bool = False,
                    trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
                    packed: bool = False, sequence_parallel: bool = False, **load_kwargs) -> nn.Module:
    """`packed`: the model will only see packed rows; without flash-attn it attends with VARLEN_SDPA.
    `sequence_parallel`: packed rows split over an SP group, attending with ULYSSES_SDPA.
    `load_kwargs`: more `from_pretrained` arguments (QLoRA's quantization_config and device_map).
    A vision-language model (a config with a `vision_config`) is loaded by `build_vision_language_model`."""
    from transformers import AutoModelForCausalLM

    freeze_vision_tower = load_kwargs.pop("freeze_vision_tower", False)
    if is_audio_language(path, trust_remote_code):
        if freeze_vision_tower:
            raise ValueError(f"actor.freeze_vision_tower=true but {path} is an audio-language model (no vision "
                             "tower). Fix: actor.freeze_vision_tower=false")
        return build_audio_language_model(path, profile, gradient_checkpointing=gradient_checkpointing,
                                          trust_remote_code=trust_remote_code, dtype=dtype, packed=packed,
                                          sequence_parallel=sequence_parallel, **load_kwargs)
    if is_vision_language(path, trust_remote_code):
        return build_vision_language_model(path, profile, gradient_checkpointing=gradient_checkpointing,
                                           trust_remote_code=trust_remote_code, dtype=dtype, packed=packed,
                                           sequence_parallel=sequence_parallel,
                                           freeze_vision_tower=freeze_vision_tower, **load_kwargs)
    if freeze_vision_tower:
        raise ValueError(f"actor.freeze_vision_tower=true but {path} is a text-only model (no vision_config). "
                         "Fix: actor.freeze_vision_tower=false, or a vision-language model.path")

    attn_implementation = profile.attn_implementation
    if sequence_parallel:
        register_ulysses_attention()
        attn_implementation = ULYSSES_SDPA
    elif packed and attn_implementation == "sdpa":
        register_varlen_attention()
        attn_implementation = VARLEN_SDPA
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, **load_kwargs)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF causal LM (Llama/Qwen/Mistral layout: model.model.layers; a
    vision-language model's language model: model.model.language_model.layers)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    base = getattr(base, "language_model", base)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}: expected model.model.layers")
    return list(layers)


def needs_sharding(profile: DeviceProfile) -> bool:
    """FSDP at world size 1 on CPU is the identity plus copies: skip it there."""
    return dist.is_initialized() and (world_size() > 1 or profile.is_gpu)


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


def _logits_at(model: nn.Module, keep: int | torch.Tensor, **inputs) -> torch.Tensor:
    """Logits at the kept sequence positions only: the last `keep` columns (int) or the given indices.

    Skipping the LM head on prompt positions saves its matmul (forward and backward) and the
    [B, T, vocab] activation, which for short responses is most of the logits. Models whose
    forward lacks `logits_to_keep` get the full logits, sliced afterwards (same result).
    """
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(**inputs, use_cache=False, logits_to_keep=keep).logits
    logits = model(**inputs, use_cache=False).logits
    return logits[:, -keep:] if isinstance(keep, int) else logits[:, keep]


@dataclass
class TopKRequest:
    """What a forward also computes per response position, for on-policy distillation (rlframe/algos/distillation.py).

    k > 0: this model's own top-k, out["topk_ids"] [B, R, k] (int64) and out["topk_log_probs"] [B, R, k];
    gather: name -> token ids [B, R, K]: this model's log-probs of those ids, out["at_" + name] [B, R, K].
    Log-probs at the forward's temperature; zero (ids 0) on padding positions. Filled in by the forward.
    """

    k: int = 0
    gather: dict[str, torch.Tensor] = field(default_factory=dict)
    out: dict[str, torch.Tensor] = field(default_factory=dict)

    def fill(self, logits: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor],
             to_grid: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """From the (temperature-scaled) logits of the response positions; `pick` maps a [B, R, K] grid to the
        logits' leading layout, `to_grid` maps back."""
        from rlframe.algos.distillation import log_probs_at, top_k_log_probs

        if self.k > 0:
            ids, values = top_k_log_probs(logits, self.k)
            self.out["topk_ids"], self.out["topk_log_probs"] = to_grid(ids), to_grid(values)
        for name, ids in self.gather.items():
            self.out["at_" + name] = to_grid(log_probs_at(logits, pick(ids.to(logits.device))))


def _response_scores(response_logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                     response_width: int, topk: TopKRequest | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of `targets` under `response_logits / temperature`, zero-padded on the
    right to `response_width` columns (the trimmed padding columns shared by all rows)."""
    from rlframe.algos import entropy_from_logits, log_probs_from_logits

    if temperature != 1.0:
        response_logits = response_logits / temperature
    log_probs = log_probs_from_logits(response_logits, targets, chunk_size=LOGIT_CHUNK)
    entropy = entropy_from_logits(response_logits, chunk_size=LOGIT_CHUNK) if with_entropy else None
    pad = response_width - targets.size(1)
    if topk is not None:
        kept = targets.size(1)
        topk.fill(response_logits, lambda grid: grid[:, :kept],
                  lambda values: torch.nn.functional.pad(values, (0, 0, 0, pad)) if pad else values)
    if pad:
        log_probs = torch.nn.functional.pad(log_probs, (0, pad))
        entropy = torch.nn.functional.pad(entropy, (0, pad)) if entropy is not None else None
    return log_probs, entropy


def forward_response_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               position_ids: torch.Tensor, response_width: int, temperature: float = 1.0,
                               with_entropy: bool = False, packed: bool = False,
                               sp: SequenceParallelGroup | None = None,
                               multi_modal_inputs=None, topk: TopKRequest | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens under `model`, shape [B, response_width].

    log p(y_t | x, y_<t) = log_softmax(logits_{t-1} / temperature)[y_t]; padding columns shared by
    all rows are trimmed before the forward pass and the result is zero-padded back. The LM head
    runs only on the positions that predict a response token. `sp` (packed only): Ulysses sequence
    parallelism; every rank of the group passes the same micro-batch and gets the same result. `topk`:
    top-k outputs for distillation (TopKRequest; text models, no sequence parallelism).
    """
    vision = getattr(getattr(model, "config", None), "vision_config", None) is not None
    if topk is not None and (multi_modal_inputs is not None or vision or sp is not None):
        raise ValueError("top-k log-probs (distillation) are computed for text models without sequence parallelism")
    if multi_modal_inputs is not None or vision:
        if multi_modal_inputs is None:  # a vision-language model on text rows: still 3-D (or 4-row packed) positions
            multi_modal_inputs = [None] * input_ids.size(0)
        return _multimodal_response_log_probs(model, input_ids, attention_mask, position_ids, response_width,
                                              temperature, with_entropy, packed, sp, multi_modal_inputs)
    if sp is not None and not packed:
        raise ValueError("sequence parallelism runs on packed rows (actor.use_remove_padding)")
    if packed:
        return _packed_response_log_probs(model, input_ids, attention_mask, position_ids, response_width,
                                          temperature, with_entropy, sp, topk)
    start, end = trim_padding_columns(attention_mask, response_width)
    prompt_width = input_ids.size(1) - response_width
    kept_response = end - prompt_width
    # logits at column c predict the token at column c + 1: keep columns prompt_width - 1 .. end - 2.
    # Kept in the model's dtype; the float32 upcast happens LOGIT_CHUNK positions at a time.
    response_logits = _logits_at(model, kept_response + 1, input_ids=input_ids[:, start:end],
                                 attention_mask=attention_mask[:, start:end],
                                 position_ids=position_ids[:, start:end])[:, :-1]
    return _response_scores(response_logits, input_ids[:, prompt_width:end], temperature, with_entropy,
                            response_width, topk)


def _packed_response_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               position_ids: torch.Tensor, response_width: int, temperature: float,
                               with_entropy: bool, sp: SequenceParallelGroup | None = None,
                               topk: TopKRequest | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padding-free variant: all real tokens of the micro-batch packed in one row.

    The model sees one sequence of sum(lengths) tokens whose position ids restart at 0 for each
    original row; attention is flash-attn varlen (GPU) or VARLEN_SDPA (`workers/attention.py`), so no
    compute is spent on padding and no token attends across rows. The packed token just before each
    response token predicts it; the LM head runs on those positions only and the results are
    scattered back to the padded [B, R] grid. With `sp`, this rank runs 1/P of the row (Ulysses).
    """
    from rlframe.algos import entropy_from_logits, log_probs_from_logits

    real = attention_mask.bool()
    prompt_width = input_ids.size(1) - response_width
    response_tokens = real.clone()
    response_tokens[:, :prompt_width] = False
    packed_position = real.flatten().cumsum(0).view_as(real) - 1  # index of each real token in the packed row
    predicting = packed_position[response_tokens] - 1  # every row has a prompt token, so never -1
    packed_ids, packed_position_ids = input_ids[real], position_ids[real]
    targets = input_ids[response_tokens]

    def per_token(fn, logits: torch.Tensor) -> torch.Tensor:
        return fn(logits / temperature if temperature != 1.0 else logits)

    if sp is None:
        logits = _logits_at(model, predicting, input_ids=packed_ids.unsqueeze(0),
                            position_ids=packed_position_ids.unsqueeze(0), attention_mask=None)[0]
        log_probs = per_token(lambda z: log_probs_from_logits(z, targets, chunk_size=LOGIT_CHUNK), logits)
        entropy = per_token(lambda z: entropy_from_logits(z, chunk_size=LOGIT_CHUNK), logits) if with_entropy else None
    else:
        # Pad the row to a multiple of P with a dummy sequence (position ids from 0: attends only to itself).
        pad = -packed_ids.numel() % sp.size
        packed_ids = torch.cat([packed_ids, packed_ids.new_zeros(pad)])
        packed_position_ids = torch.cat([packed_position_ids, torch.arange(pad, device=packed_ids.device)])
        width = packed_ids.numel() // sp.size
        first = sp.rank * width
        mine = (predicting >= first) & (predicting < first + width)
        local_keep = predicting[mine] - first
        with sequence_parallel_forward(sp, packed_position_ids.unsqueeze(0)):
            logits = _logits_at(model, local_keep, input_ids=packed_ids[first: first + width].unsqueeze(0),
                                position_ids=packed_position_ids[first: first + width].unsqueeze(0),
                                attention_mask=None)[0]

        def gathered(local: torch.Tensor) -> torch.Tensor:
            row = local.new_zeros(width).index_copy(0, local_keep, local)
            return gather_tokens(row, sp)[predicting]

        log_probs = gathered(per_token(lambda z: log_probs_from_logits(z, targets[mine], chunk_size=LOGIT_CHUNK), logits))
        entropy = gathered(per_token(lambda z: entropy_from_logits(z, chunk_size=LOGIT_CHUNK), logits)) if with_entropy else None
    in_response = response_tokens[:, prompt_width:]

    def to_response_grid(values: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(in_response.shape + values.shape[1:], dtype=values.dtype, device=values.device)
        grid[in_response] = values
        return grid

    if topk is not None:  # (sp is None: checked by the caller)
        topk.fill(logits / temperature if temperature != 1.0 else logits, lambda grid: grid[in_response],
                  to_response_grid)
    return to_response_grid(log_probs), (to_response_grid(entropy) if entropy is not None else None)


# ------------------------------------------------------------------ vision-language models (Qwen2-VL family)


def is_vision_language(path: str, trust_remote_code: bool = False) -> bool:
    """The model folder's config has a vision tower (Qwen2-VL / Qwen2.5-VL: `vision_config`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return False  # let the causal-LM loader report it
    return getattr(config, "vision_config", None) is not None


def build_vision_language_model(path: str, profile: DeviceProfile, *, gradient_checkpointing: bool = False,
                                trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
                                packed: bool = False, sequence_parallel: bool = False,
                                freeze_vision_tower: bool = False, **load_kwargs) -> nn.Module:
    """An image-text-to-text model (`Qwen2_5_VLForConditionalGeneration`) in fp32 (or `dtype`).

    Packed rows attend with VARLEN_SDPA in the language model only; the vision tower keeps SDPA (it
    separates images itself, by cu_seqlens). `freeze_vision_tower`: the vision tower and its merger
    get no gradient (the optimizer skips them)."""
    from transformers import AutoModelForImageTextToText

    if sequence_parallel:
        raise ValueError("Ulysses sequence parallelism is not supported for vision-language models yet. "
                         "Fix: actor.ulysses_sequence_parallel_size=1")
    attn_implementation = profile.attn_implementation
    if packed and attn_implementation == "sdpa":
        register_varlen_attention()
        attn_implementation = {"text_config": VARLEN_SDPA, "vision_config": "sdpa", "": VARLEN_SDPA}
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, **load_kwargs)
    model.config.use_cache = False
    if freeze_vision_tower:
        vision_tower(model).requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def is_audio_language(path: str, trust_remote_code: bool = False) -> bool:
    """The model folder's config has an audio encoder (Qwen2-Audio: `audio_config`) and no vision tower."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return False
    return getattr(config, "audio_config", None) is not None and getattr(config, "vision_config", None) is None


def is_audio_model(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "audio_config", None) is not None and getattr(config, "vision_config", None) is None


def build_audio_language_model(path: str, profile: DeviceProfile, *, gradient_checkpointing: bool = False,
                               trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
                               packed: bool = False, sequence_parallel: bool = False, **load_kwargs) -> nn.Module:
    """An audio-text-to-text model (`Qwen2AudioForConditionalGeneration`, the class its config names) in fp32.

    Packed rows attend with VARLEN_SDPA in the language model only; the audio encoder keeps SDPA (each
    audio is its own batch row there, with its padding mask)."""
    import transformers
    from transformers import AutoConfig

    if sequence_parallel:
        raise ValueError("Ulysses sequence parallelism is not supported for audio-language models yet. "
                         "Fix: actor.ulysses_sequence_parallel_size=1")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    name = (getattr(config, "architectures", None) or ["Qwen2AudioForConditionalGeneration"])[0]
    model_class = getattr(transformers, name, None)
    if model_class is None:
        raise ValueError(f"{path}: transformers has no model class {name} (the config's architectures)")
    attn_implementation = profile.attn_implementation
    if packed and attn_implementation == "sdpa":
        register_varlen_attention()
        attn_implementation = {"text_config": VARLEN_SDPA, "audio_config": "sdpa", "": VARLEN_SDPA}
    model = model_class.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                        trust_remote_code=trust_remote_code, **load_kwargs)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder (with its patch merger) of a Qwen2-VL-family model."""
    base = getattr(model, "model", model)
    tower = getattr(base, "visual", None)
    if tower is None:
        raise ValueError(f"{type(model).__name__} has no vision tower (model.model.visual)")
    return tower


def mrope_positions(model: nn.Module, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                    video_grid_thw: torch.Tensor | None = None,
                    second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen2-VL's 3-D rotary positions [3, L] of ONE sequence of real tokens (no padding).

    Text tokens advance all three (time, height, width) positions together by 1; the merged patches
    of an image get (start, start + row, start + column) and the text after it continues from
    start + max(rows, columns). A video's temporal patch k gets time start + k * tokens_per_second *
    second_per_grid_ts (Qwen2.5-VL: positions in time follow seconds, not frame counts). Computed per
    sequence, so the positions are the same whether the sequence is alone, left-padded in a batch, or
    packed with others.
    """
    base = getattr(model, "model", model)
    config = model.config
    token_type = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()
    if not bool(token_type.any()):
        return torch.arange(input_ids.numel(), device=input_ids.device).unsqueeze(0).expand(3, -1)
    extra = {} if video_grid_thw is None else {"video_grid_thw": video_grid_thw,
                                               "second_per_grid_ts": second_per_grid_ts}
    positions, _ = base.get_rope_index(input_ids.unsqueeze(0), mm_token_type_ids=token_type.unsqueeze(0),
                                       image_grid_thw=image_grid_thw, **extra)
    return positions[:, 0]


PIXEL_INPUT_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                    "input_features", "feature_attention_mask")  # (the last two: audios, Qwen2-Audio)


def _stack_pixel_inputs(multi_modal_inputs, device) -> dict:
    """Concatenate the rows' pixel inputs (images: pixel_values, image_grid_thw; videos: pixel_values_videos,
    video_grid_thw, second_per_grid_ts; audios: input_features, feature_attention_mask) in row order (rows
    without one kind add nothing to its keys)."""
    rows = [m for m in multi_modal_inputs if m is not None]
    out = {}
    for key in PIXEL_INPUT_KEYS:
        values = [torch.as_tensor(m[key]) for m in rows if key in m]
        if values:
            out[key] = torch.cat(values).to(device)
    return out


def _grid(m, key: str, device):
    return None if m is None or key not in m else torch.as_tensor(m[key]).to(device)


def _multimodal_response_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                   position_ids: torch.Tensor, response_width: int, temperature: float,
                                   with_entropy: bool, packed: bool, sp: SequenceParallelGroup | None,
                                   multi_modal_inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens of rows with images (`multi_modal_inputs[b]`: the row's
    pixel_values and image_grid_thw, or None for a text row), padded or packed.

    The text path's layout with two additions: the pixel inputs of the micro-batch's images, in row
    order (the model scatters the vision tower's output into the `<|image_pad|>` tokens in the same
    order), and position ids [4, 1, N] when packed (row 0: the 1-D positions restarting at 0 per
    sequence, which VARLEN_SDPA reads for the sequence borders; rows 1-3: `mrope_positions` of each
    sequence, concatenated) or [3, B, T] when padded (0 on padding).
    """
    if sp is not None:
        raise ValueError("Ulysses sequence parallelism is not supported with images")
    device = input_ids.device
    real = attention_mask.bool()
    pixel_inputs = _stack_pixel_inputs(multi_modal_inputs, device)
    if is_audio_model(model):  # Qwen2-Audio: 1-D rotary positions, the text path's layout plus the audio features
        return _audio_response_log_probs(model, input_ids, attention_mask, position_ids, response_width,
                                         temperature, with_entropy, packed, pixel_inputs)
    rope = [mrope_positions(model, input_ids[b][real[b]], *(_grid(m, key, device) for key in
                                                           ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")))
            for b, m in enumerate(multi_modal_inputs)]
    prompt_width = input_ids.size(1) - response_width
    if packed:
        response_tokens = real.clone()
        response_tokens[:, :prompt_width] = False
        packed_position = real.flatten().cumsum(0).view_as(real) - 1
        predicting = packed_position[response_tokens] - 1
        positions = torch.cat([position_ids[real].unsqueeze(0), torch.cat(rope, dim=1)]).unsqueeze(1)
        logits = _logits_at(model, predicting, input_ids=input_ids[real].unsqueeze(0), position_ids=positions,
                            attention_mask=None, **pixel_inputs)[0]
        return _packed_response_scores(logits, input_ids, response_tokens, prompt_width, temperature, with_entropy)
    positions = torch.zeros((3, *input_ids.shape), dtype=torch.long, device=device)
    for b in range(input_ids.size(0)):
        positions[:, b, real[b]] = rope[b]
    start, end = trim_padding_columns(attention_mask, response_width)
    kept_response = end - prompt_width
    response_logits = _logits_at(model, kept_response + 1, input_ids=input_ids[:, start:end],
                                 attention_mask=attention_mask[:, start:end], position_ids=positions[:, :, start:end],
                                 **pixel_inputs)[:, :-1]
    return _response_scores(response_logits, input_ids[:, prompt_width:end], temperature, with_entropy,
                            response_width)


def _packed_response_scores(logits: torch.Tensor, input_ids: torch.Tensor, response_tokens: torch.Tensor,
                            prompt_width: int, temperature: float, with_entropy: bool
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A packed multimodal forward's logits at the response tokens (`response_tokens`' order) -> log-probs of
    those tokens (and entropies) laid back on the rows' response grid, zero where a row has no token."""
    from rlframe.algos import entropy_from_logits, log_probs_from_logits

    if temperature != 1.0:
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, input_ids[response_tokens], chunk_size=LOGIT_CHUNK)
    entropy = entropy_from_logits(logits, chunk_size=LOGIT_CHUNK) if with_entropy else None
    in_response = response_tokens[:, prompt_width:]

    def to_grid(values: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(in_response.shape, dtype=values.dtype, device=values.device)
        grid[in_response] = values
        return grid

    return to_grid(log_probs), (to_grid(entropy) if entropy is not None else None)


def _audio_response_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              position_ids: torch.Tensor, response_width: int, temperature: float,
                              with_entropy: bool, packed: bool, audio_inputs: dict
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens of rows with audios: the text path's positions (1-D, restarting
    at 0 per sequence when packed, which VARLEN_SDPA reads for the borders) and the micro-batch's
    `input_features` / `feature_attention_mask` in row order (the model scatters the encoder's output
    into the `<|AUDIO|>` tokens in the same order)."""
    real = attention_mask.bool()
    prompt_width = input_ids.size(1) - response_width
    if packed:
        response_tokens = real.clone()
        response_tokens[:, :prompt_width] = False
        packed_position = real.flatten().cumsum(0).view_as(real) - 1
        predicting = packed_position[response_tokens] - 1
        logits = _logits_at(model, predicting, input_ids=input_ids[real].unsqueeze(0),
                            position_ids=position_ids[real].unsqueeze(0), attention_mask=None, **audio_inputs)[0]
        return _packed_response_scores(logits, input_ids, response_tokens, prompt_width, temperature, with_entropy)
    start, end = trim_padding_columns(attention_mask, response_width)
    kept_response = end - prompt_width
    response_logits = _logits_at(model, kept_response + 1, input_ids=input_ids[:, start:end],
                                 attention_mask=attention_mask[:, start:end], position_ids=position_ids[:, start:end],
                                 **audio_inputs)[:, :-1]
    return _response_scores(response_logits, input_ids[:, prompt_width:end], temperature, with_entropy,
                            response_width)
