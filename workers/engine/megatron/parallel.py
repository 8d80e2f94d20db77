"""Megatron's process groups over our (gloo / nccl) world, and megatron-core imported quietly."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from rlframe.workers.sequence_parallel import SequenceParallelGroup


def import_megatron():
    """megatron.core, without its warnings about transformer-engine / apex being absent (expected here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
    return parallel_state, GPTModel, get_gpt_layer_local_spec, TransformerConfig


_world_of_megatron_groups: list = [None]  # the default process group megatron's groups were made in


def init_model_parallel(tp: int, pp: int = 1, cp: int = 1, ep: int = 1) -> None:
    """Megatron's process groups over our (gloo / nccl) world; once per process (actor and ref share them)."""
    parallel_state = import_megatron()[0]
    if not dist.is_initialized():  # a plain object in a test process: a one-rank group
        from rlframe.controller.worker_host import find_free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    world = dist.distributed_c10d._get_default_group()
    if parallel_state.model_parallel_is_initialized() and world is not _world_of_megatron_groups[0]:
        # megatron's groups belong to a world destroyed since (a test process that ran vLLM in-process,
        # whose shutdown destroys the default group): they cannot be used, so they are rebuilt over this one
        parallel_state.destroy_model_parallel()
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, cp, ep):
            raise ValueError(f"this process already runs Megatron with (TP, PP, CP, EP)={have}, asked for "
                             f"{(tp, pp, cp, ep)}")
        return
    if dist.get_world_size() % (tp * pp * cp):
        raise ValueError(f"world size {dist.get_world_size()} is not divisible by TP x PP x CP = {tp * pp * cp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep)
    _world_of_megatron_groups[0] = world
    from megatron.core import tensor_parallel

    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # (the RNG states its dropout forks expect)
    else:  # every dropout is 0 here: the sequence-parallel embedding's RNG fork is a no-op on CPU
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)


def replica_row_group(dp_rank: int) -> SequenceParallelGroup:
    """The ranks of this rank's model replica (TP x PP x CP: those with its data-parallel rank) as a group,
    for the row exchange (`gather_rows`). Every rank creates every replica's group, in the same order."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dp_rank)
    mine = None
    for value in sorted(set(ranks)):
        members = [r for r, v in enumerate(ranks) if v == value]
        group = dist.new_group(members)
        if value == dp_rank:
            mine = SequenceParallelGroup(group, len(members), members.index(dist.get_rank()))
    return mine
