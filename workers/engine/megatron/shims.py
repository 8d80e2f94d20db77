"""megatron-core 0.16 patched where it assumes CUDA (a CPU process over gloo) or transformer-engine.

`on_cpu(gpt, ...)` is what `model.build_gpt` calls for a CPU profile: the rotary embedding, the pipeline
schedule, the sequence-parallel mappings and the MoE router then allocate on the CPU and run their
collectives as gloo can. `moe_without_transformer_engine()` is needed on any device without TE.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.distributed as dist

from rlframe.workers.engine.megatron.attention import cp_positions


def on_cpu(gpt, *, pp: int, cp: int, sequence_parallel: bool, moe: bool) -> None:
    """Patch `gpt` and megatron-core's modules for a CPU process (once is enough; repeating is harmless)."""
    # megatron-core 0.16's RotaryEmbedding.get_emb moves its inv_freq to CUDA on first use: on CPU
    # the same embedding without that move.
    gpt.rotary_pos_emb.get_emb = types.MethodType(_rope_emb_in_place, gpt.rotary_pos_emb)
    if cp > 1:  # (its CP cut, get_pos_emb_on_this_cp_rank, builds its index with .cuda())
        gpt.rotary_pos_emb.forward = types.MethodType(_rope_on_cp_rank, gpt.rotary_pos_emb)
    if pp > 1:
        _pipeline_on_cpu()
    if sequence_parallel or moe:  # (the all-gather token dispatcher: the same mappings)
        _sequence_parallel_on_cpu()
    if moe:
        _moe_on_cpu()


def _rope_on_cp_rank(rope, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
    """RotaryEmbedding.forward on CPU under context parallelism: the table of the whole (padded) sequence,
    cut to this rank's chunks (`cp_positions`: the columns its tokens sit at)."""
    emb = rope.get_emb(max_seq_len, offset)
    group = cp_group if cp_group is not None else rope.cp_group
    if packed_seq or group is None or group.size() == 1:
        return emb
    return emb[cp_positions(emb.size(0), group.size(), group.rank(), device=emb.device)]


def _rope_emb_in_place(rope, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb on the device inv_freq is on ([s, 1, 1, dim], halves not interleaved)."""
    if rope.rotary_interleaved:
        raise NotImplementedError("interleaved RoPE on CPU")
    freqs = rope.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


class _TorchOnCPU:
    """`torch` as megatron-core 0.16's pipeline schedule and p2p code see it on CPU: they allocate their
    receive buffers and shape messages on `torch.cuda.current_device()`, call `torch.cuda.synchronize()`
    after batched p2p, and count tokens in `torch.zeros(..., device="cuda")`; here those land on the
    CPU and the synchronisation is a no-op (gloo's isend/irecv complete on wait()). Everything else is torch."""

    class cuda:  # (stands in for the torch.cuda module)
        @staticmethod
        def current_device() -> str:
            return "cpu"

        @staticmethod
        def synchronize(*_, **__) -> None:
            return None

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


class _FreshBuffer:
    """megatron-core's global memory buffer on CPU: a new tensor each time (its buffer allocates on CUDA)."""

    @staticmethod
    def get_tensor(shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


def _sequence_parallel_on_cpu() -> None:
    """Sequence parallelism on CPU (gloo): megatron-core 0.16's tensor-parallel layers and mappings allocate
    their gather / reduce-scatter outputs on `torch.cuda.current_device()` and in a global CUDA buffer;
    here `_TorchOnCPU` and a fresh CPU tensor. Their collectives, `all_gather_into_tensor` and
    `reduce_scatter_tensor`, are replaced by `_gloo_all_gather` / `_gloo_reduce_scatter` (a list
    all_gather; an all_reduce and a slice): older torch's gloo has neither, and on CPU the cost is moot."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.tensor_parallel import layers, mappings
    for module in (layers, mappings):
        if not isinstance(module.torch, _TorchOnCPU):
            module.torch = _TorchOnCPU()
        module.get_global_memory_buffer = lambda: _FreshBuffer
        module.dist_all_gather_func, module.dist_reduce_scatter_func = _gloo_all_gather, _gloo_reduce_scatter


class _Done:
    """The handle of a collective that already completed (megatron's async_op=True callers `wait()` on it)."""

    @staticmethod
    def wait() -> None:
        return None


def _gloo_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """all_gather_into_tensor (concatenated along dim 0) as a list all_gather into views of `output`."""
    dist.all_gather(list(output.chunk(dist.get_world_size(group), dim=0)), input.contiguous(), group=group)
    return _Done() if async_op else None


def _gloo_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """reduce_scatter_tensor (sum; dim 0 split evenly) as an all_reduce of a copy and this rank's slice."""
    total = input.contiguous().clone()
    dist.all_reduce(total, group=group)
    output.copy_(total.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)])
    return _Done() if async_op else None


def _moe_on_cpu() -> None:
    """megatron-core 0.16's MoE router moves its weight to `torch.cuda.current_device()` on first use when it
    finds it on the CPU: on CPU processes that is a no-op (`_TorchOnCPU`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.transformer.moe import router
    if not isinstance(router.torch, _TorchOnCPU):
        router.torch = _TorchOnCPU()


def _pipeline_on_cpu() -> None:
    """Point megatron-core's pipeline schedule and p2p modules at `_TorchOnCPU` (CPU processes only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.pipeline_parallel import p2p_communication, schedules
    for module in (p2p_communication, schedules):
        if not isinstance(module.torch, _TorchOnCPU):
            module.torch = _TorchOnCPU()


def moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router gating (moe_utils.RouterGatingLinearFunction) tests
    `te_general_gemm is not None`, a name moe_utils binds only when transformer-engine imports: without TE
    a NameError ("name 'te_general_gemm' is not defined"). Bound to None there, it takes its torch.mm path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
