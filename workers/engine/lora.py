"""LoRA, DoRA, rsLoRA and QLoRA for the training engines: low-rank adapters trained over a frozen base model (peft).

    peft_config = apply_lora(model, settings.lora)     # in place, before sharding: base frozen
    with adapters_disabled(model): ...                 # the base model: the reference policy, for free
    iter_merged_weights(model)    # (HF name, W + (alpha / r) B A): for engines/exports that load full weights
    iter_adapter_weights(model)   # (name, A or B) only: adapter-only weight sync
    write_adapter_folder(...)     # peft's folder format: checkpoints and `python -m rlframe.export`

A LoRA layer computes  y = W x + (alpha / r) * B A dropout(x)  with W frozen, A (r x in) random and
B (out x r) zero at the start, so the adapted model starts equal to the base model. Only A and B get
gradients and optimizer state: for a 7B Llama at r=16 over all linear layers that is 40M parameters
(~0.6 GB of fp32 weights + grads + Adam moments instead of ~112 GB).

The adapted model stays the HF model object: peft replaces each targeted `nn.Linear` in place by a
LoRA layer whose `base_layer` is the original Linear, so the engine's forward (packing, attention
interface, `logits_to_keep`, gradient checkpointing, Ulysses) and FSDP2's per-layer sharding are
unchanged. State-dict names gain `.base_layer.` and `.lora_A.default.` / `.lora_B.default.`;
the functions here translate back to the base model's HF names.

Kinds (`model.lora.kind`, `ADAPTER_KINDS`):

    lora     y = W x + (alpha / r) B A x
    rslora   y = W x + (alpha / sqrt(r)) B A x              (rank-stabilised scaling; Kalajdzievski 2023)
    dora     y = m / ||W + s B A||_row * (W + s B A) x       (weight-decomposed; Liu et al. 2024): a trained
             magnitude m per output row; merged: W' = (m / ||W + s B A||_row)[:, None] * (W + s B A)

AdaLoRA and IA3 exist in peft but are refused before any worker starts (`adapter_kind_problem` says why).

QLoRA (`load_in_4bit`): the frozen base is loaded in NF4 by bitsandbytes (CUDA only); merged
weights dequantize it first. Driver-side helpers at the bottom check `model.lora.target_modules`
against the model's module names before any worker starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from rlframe.device import DeviceProfile
from rlframe.workers.settings import LoraSettings

ADAPTER = "default"  # peft's name for the (single) adapter
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# state-dict keys of adapter tensors: "<module>.lora_A.default.weight" (DoRA: "<module>.lora_magnitude_vector.default.weight")
_ADAPTER_KEY = re.compile(r"\.(lora_[AB]|lora_magnitude_vector)\.")
ADAPTER_KINDS = ("lora", "dora", "rslora")
REFUSED_KINDS = {
    "adalora": "AdaLoRA re-allocates ranks during training through peft's update_and_allocate(step), which must "
               "run after every optimizer step; rlframe's engines step the optimizer themselves and do not call it "
               "(and vLLM cannot load AdaLoRA adapters)",
    "ia3": "IA3 scales activations by learned vectors instead of adding B A; rlframe's merged weight sync, adapter "
           "checkpoints and export are written for low-rank A/B adapters (peft could merge IA3, but nothing here "
           "carries it, and vLLM serves no IA3 adapters)",
}


def adapter_kind(lora: LoraSettings) -> str:
    return lora.kind


def adapter_kind_problem(kind: str, weight_sync: str = "merged") -> str | None:
    """Why `model.lora.kind=kind` cannot run here, with the fix; None when it can."""
    if kind in ADAPTER_KINDS:
        if kind == "dora" and weight_sync == "adapter":
            return ("DoRA adapters cannot be synced as adapters: vLLM's and the HF engine's LoRA layers apply B A "
                    "only, not DoRA's magnitude. Fix: model.lora.weight_sync=merged")
        return None
    if kind in REFUSED_KINDS:
        return f"'{kind}' is not supported: {REFUSED_KINDS[kind]}. Fix: model.lora.kind=lora (or dora, rslora)"
    from peft import PeftType

    known = kind.upper() in PeftType.__members__
    what = "a peft adapter type that rlframe does not wire" if known else "not an adapter kind peft has"
    return f"'{kind}' is {what}. Fix: model.lora.kind=one of {', '.join(ADAPTER_KINDS)}"


# ---------------------------------------------------------------------------------------- building
def peft_lora_config(lora: LoraSettings, base_path: str | None = None, target_modules=None):
    """peft's LoraConfig for `lora` (bias untouched, task CAUSAL_LM). `target_modules` overrides the
    settings' (the rollout side writes the concrete module names it received)."""
    from peft import LoraConfig

    kind = adapter_kind(lora)
    problem = adapter_kind_problem(kind)
    if problem is not None:
        raise ValueError(f"model.lora.kind: {problem}")
    targets = target_modules if target_modules is not None else lora.target_modules
    targets = targets if isinstance(targets, str) else sorted(targets)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                      exclude_modules=sorted(lora.exclude_modules) or None, bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_path, use_dora=kind == "dora", use_rslora=kind == "rslora")


def apply_lora(model: nn.Module, lora: LoraSettings, base_path: str | None = None):
    """Inject LoRA layers into `model` in place and freeze everything else; returns the resolved peft
    config (concrete target module names). Call before sharding: FSDP2 then shards A and B with
    the rest of each decoder layer."""
    from peft import get_peft_model

    # Every rank must draw the same A: a rank-seeded RNG would give each rank a different adapter
    # (sharded: a model that depends on the world size; replicated: diverging replicas).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.seed)
        peft_model = get_peft_model(model, peft_lora_config(lora, base_path), autocast_adapter_dtype=True)
    config = peft_model.peft_config[ADAPTER]
    if base_path is not None:
        config.base_model_name_or_path = base_path
    # `model` itself now holds the LoRA layers (peft_model.base_model.model is model); the engine keeps
    # calling `model` directly, so nothing depends on the wrapper.
    assert peft_model.base_model.model is model
    return config


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> LoRA layer (peft's LoraLayer), for every adapted layer of `model`."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextmanager
def adapters_disabled(model: nn.Module):
    """Inside, every LoRA layer computes only its base layer: the model IS the base model, bit for bit.

    Only the flag that peft's forward reads is switched (peft's own `disable_adapter_layers` also
    toggles requires_grad, which must not change under a sharded optimizer).
    """
    layers = list(lora_layers(model).values())
    if not layers:
        raise RuntimeError("adapters_disabled: the model has no LoRA layers (model.lora.rank=0)")
    previous = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, previous):
            layer._disable_adapters = was


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------------------------------- weights out
def _full(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 DTensor gathered to the full tensor (a collective: every rank must call), else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _is_4bit_linear(module: nn.Module) -> bool:
    """bitsandbytes' Linear4bit (QLoRA base layers), recognised without importing bitsandbytes."""
    return type(getattr(module, "weight", None)).__name__ == "Params4bit"


def _base_entries(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(HF name, state-dict key, state-dict tensor) of the base model's tensors, in state-dict order.

    Adapter tensors are left out (they are merged into their base weight), and so is bitsandbytes'
    quantisation state ("<...>.weight.absmax", ...: the 4-bit weight is dequantized instead).
    """
    for key, tensor in model.state_dict().items():
        if _ADAPTER_KEY.search(key) or ".weight." in key:
            continue
        yield key.replace(".base_layer.", "."), key, tensor


def merge_weight(base: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """W + s * B @ A for one LoRA layer (s = layer.scaling: alpha / r, rsLoRA alpha / sqrt(r)): one fused
    addmm in fp32 on the full (gathered) tensors, returned in W's dtype; shape [out, in]. DoRA: that sum
    rescaled row by row to the trained magnitude, (m / ||W + s B A||_row)[:, None] * (W + s B A)."""
    lora_a = _full(layer.lora_A[ADAPTER].weight.detach()).float()
    lora_b = _full(layer.lora_B[ADAPTER].weight.detach()).float()
    merged = torch.addmm(base.float(), lora_b, lora_a, alpha=layer.scaling[ADAPTER])
    magnitude = getattr(layer, "lora_magnitude_vector", None)
    if magnitude is not None and ADAPTER in magnitude:  # DoRA (its norm is the one peft's forward divides by)
        m = _full(magnitude[ADAPTER].weight.detach()).float()
        merged = merged * (m / torch.linalg.norm(merged, dim=1)).unsqueeze(1)
    return merged.to(base.dtype)


def iter_merged_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the adapted model with each adapter merged: W' = W + (alpha / r) B A.

    The names and shapes are the base model's, so anything that loads full weights (vLLM, HF
    generate, `from_pretrained`) takes them unchanged. Every rank must iterate (gathers are
    collectives). The merge is computed in fp32, then cast to `dtype` (default: W's dtype).
    """
    layers = lora_layers(model)
    for name, key, tensor in _base_entries(model):
        module_path, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        if leaf == "weight" and _is_4bit_linear(module):
            from peft.utils.integrations import dequantize_module_weight

            full = dequantize_module_weight(module)
        else:
            full = _full(tensor)
        full = full.detach()
        owner = layers.get(name.rpartition(".")[0]) if leaf == "weight" else None
        if owner is not None:
            full = merge_weight(full, owner)
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield name, full


def merged_weight_view(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> a tensor of the merged weight's global shape and dtype, in `iter_merged_weights`
    order, without gathering anything (what the disaggregated broadcast plans its buckets from).
    A model without LoRA layers gives its plain state dict."""
    if not has_lora(model):
        return model.state_dict()
    view = {}
    for name, key, tensor in _base_entries(model):
        module_path, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        if leaf == "weight" and _is_4bit_linear(module):
            state = module.weight.quant_state
            tensor = torch.empty(state.shape, dtype=state.dtype, device="meta")
        view[name] = tensor
    return view


def iter_adapter_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict key, full tensor) of the adapter tensors only, e.g.
    "model.layers.0.self_attn.q_proj.lora_A.default.weight" (every rank must iterate)."""
    for key, tensor in model.state_dict().items():
        if _ADAPTER_KEY.search(key):
            full = _full(tensor).detach()
            yield key, full.to(dtype) if dtype is not None else full


# ---------------------------------------------------------------------------------------- peft folders
def to_peft_key(key: str) -> str:
    """Model state-dict key -> peft's saved key: "x.q_proj.lora_A.default.weight" ->
    "base_model.model.x.q_proj.lora_A.weight" (what `PeftModel.from_pretrained` and vLLM read); DoRA's
    "x.lora_magnitude_vector.default.weight" -> "base_model.model.x.lora_magnitude_vector"."""
    key = re.sub(rf"\.lora_magnitude_vector\.{ADAPTER}\.weight$", ".lora_magnitude_vector", key)
    return "base_model.model." + re.sub(rf"\.(lora_[AB])\.{ADAPTER}\.", r".\1.", key)


def from_peft_key(key: str) -> str:
    """The inverse of `to_peft_key`."""
    key = re.sub(r"\.lora_magnitude_vector$", f".lora_magnitude_vector.{ADAPTER}.weight", key)
    return re.sub(r"\.(lora_[AB])\.", rf".\1.{ADAPTER}.", key.removeprefix("base_model.model."))


def adapted_module_suffixes(keys: Iterable[str]) -> list[str]:
    """The module names adapted, as peft `target_modules` suffixes ("q_proj", ...), from adapter keys."""
    return sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in keys if _ADAPTER_KEY.search(key)})


def write_adapter_folder(out_dir: str | Path, adapter_state: dict[str, torch.Tensor], config,
                         tokenizer_source: str | Path | None = None, dtype: torch.dtype | None = None) -> Path:
    """A peft adapter folder: adapter_config.json + adapter_model.safetensors (+ tokenizer).

    `adapter_state`: model state-dict keys (`iter_adapter_weights`); `config`: peft's LoraConfig,
    whose `base_model_name_or_path` names the base. It loads with `PeftModel.from_pretrained(base,
    out_dir)`, with `AutoModelForCausalLM.from_pretrained(out_dir)` (peft installed), and in vLLM
    as a LoRARequest.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, tensor in adapter_state.items():
        tensor = tensor.detach().cpu()
        tensors[to_peft_key(key)] = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    if tokenizer_source is not None:
        from rlframe.workers.hf_folder import copy_tokenizer

        copy_tokenizer(tokenizer_source, out)
    return out


def read_adapter_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a peft folder, under the model's state-dict keys (`from_peft_key`)."""
    from safetensors.torch import load_file

    return {from_peft_key(k): v for k, v in load_file(str(Path(folder) / ADAPTER_WEIGHTS_FILE)).items()}


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG_FILE).is_file()


def adapter_base_path(folder: str | Path) -> str:
    return json.loads((Path(folder) / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"]


def plain_config(config):
    """A copy of an HF config without `quantization_config` (a merged QLoRA model is a plain model)."""
    import copy

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


# ---------------------------------------------------------------------------------------- QLoRA (GPU)
def qlora_unavailable_reason(profile_is_gpu: bool) -> str | None:
    """Why QLoRA cannot run here, with the fix; None when it can (CUDA + bitsandbytes)."""
    import importlib.util

    if not profile_is_gpu:
        return ("QLoRA keeps the frozen base in NF4 with bitsandbytes' CUDA kernels; this run has no CUDA GPU. "
                "Fix: model.lora.load_in_4bit=false (LoRA over the full-precision base: on CPU that is fp32), "
                "or run on a GPU machine")
    if importlib.util.find_spec("bitsandbytes") is None:
        return "QLoRA needs the bitsandbytes package. Fix: pip install bitsandbytes (or model.lora.load_in_4bit=false)"
    return None


def build_qlora_base(path: str, profile: DeviceProfile, *, gradient_checkpointing: bool, trust_remote_code: bool,
                     packed: bool, sequence_parallel: bool) -> nn.Module:
    """The frozen base in NF4 (double-quantized, bf16 compute) on this rank's GPU, prepared for
    k-bit training (norms and embeddings in fp32, gradient checkpointing as configured)."""
    reason = qlora_unavailable_reason(profile.is_gpu)
    if reason is not None:
        raise ValueError(f"model.lora.load_in_4bit: {reason}")
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    from rlframe.workers.engine.hf_model import build_causal_lm

    compute_dtype = profile.dtype if profile.dtype != torch.float32 else torch.bfloat16
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=compute_dtype)
    model = build_causal_lm(path, profile, dtype=compute_dtype, packed=packed, sequence_parallel=sequence_parallel,
                            trust_remote_code=trust_remote_code, quantization_config=quantization,
                            device_map={"": torch.cuda.current_device()})
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


# ---------------------------------------------------------------------------------------- driver side
def model_linear_names(model_dir: str, trust_remote_code: bool = False) -> tuple[list[str], list[str], str | None]:
    """(names of the nn.Linear modules, names of all modules, the output layer's name) of the model
    at `model_dir`, built from its config on the meta device (no weights read, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    output = model.get_output_embeddings()
    output_name = next((n for n, m in model.named_modules() if m is output), None)
    names = [n for n, _ in model.named_modules() if n]
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linear, names, output_name


def _matches(entry: str, name: str) -> bool:
    """peft's rule for one list entry: the module's full name, or its last dotted components."""
    return name == entry or name.endswith("." + entry)


def target_module_problems(target_modules, exclude_modules, linear: list[str], all_names: list[str],
                           output_name: str | None) -> list[tuple[str, str]]:
    """(key, problem) for `model.lora.target_modules` / `exclude_modules` entries that match no
    linear layer of the model, or that leave nothing to adapt."""
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in linear})
    available = f"this model's linear layers: {', '.join(suffixes)}"
    problems = []
    if isinstance(target_modules, str) and target_modules == "all-linear":
        chosen = [n for n in linear if n != output_name]
    elif isinstance(target_modules, str):
        chosen = [n for n in linear if re.fullmatch(target_modules, n)]
        if not chosen:
            problems.append(("model.lora.target_modules", f"the regex '{target_modules}' matches no linear layer "
                                                          f"({available}). Fix: model.lora.target_modules=all-linear"))
    else:
        chosen = []
        for entry in target_modules:
            hits = [n for n in linear if _matches(entry, n)]
            if not hits:
                other = any(_matches(entry, n) for n in all_names)
                what = "is not a linear layer (LoRA here adapts linear layers)" if other else "matches no module"
                problems.append(("model.lora.target_modules",
                                 f"'{entry}' {what}; {available}. Fix: model.lora.target_modules=[{', '.join(suffixes[:3])}"
                                 f"{', ...' if len(suffixes) > 3 else ''}] or all-linear"))
            chosen += hits
    for entry in exclude_modules:
        if not any(_matches(entry, n) for n in all_names):
            problems.append(("model.lora.exclude_modules", f"'{entry}' matches no module; {available}. "
                                                           "Fix: remove it or name a module of the model"))
    remaining = [n for n in chosen if not any(_matches(e, n) for e in exclude_modules)]
    if chosen and not remaining:
        problems.append(("model.lora.exclude_modules", "excludes every targeted module: nothing would be trained. "
                                                       "Fix: exclude fewer modules"))
    return problems


__all__ = ["ADAPTER", "ADAPTER_CONFIG_FILE", "ADAPTER_KINDS", "ADAPTER_WEIGHTS_FILE", "adapter_base_path", "adapter_kind",
           "adapter_kind_problem", "adapters_disabled",
           "apply_lora", "build_qlora_base", "merge_weight", "from_peft_key", "has_lora", "is_adapter_folder",
           "iter_adapter_weights", "iter_merged_weights", "lora_layers", "merged_weight_view", "model_linear_names",
           "peft_lora_config", "plain_config", "qlora_unavailable_reason", "read_adapter_state",
           "target_module_problems", "to_peft_key", "trainable_parameters", "write_adapter_folder"]
