"""Starting the workers: one path for one node and many, colocated and disaggregated.

    workers = start_workers(cfg, model_path)   # -> Workers: the groups, their pools, a handle per role
    workers.actor_rollout.generate_sequences(batch)
    workers.shutdown()

Two placements (`trainer.placement`):

- ``colocated`` (the hybrid engine): one pool of ``actor.world_size`` devices; every rank hosts the
  actor, its rollout engine and the ref (and critic, reward model). One node is the plain case.
- ``disaggregated``: the trainer roles on a pool of ``actor.world_size`` devices, the rollout
  engines on a pool of ``rollout.world_size`` devices of their own; after each update the actor's
  rank 0 broadcasts the weights to the engines (workers/weight_broadcast.py).

Pools are planned by the generic runtime (`rlframe/controller/placement.py`); this module decides
which roles go where and with which settings (`worker_settings.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlframe.algos.plugins import configured_estimator_needs
from rlframe.config import RLConfig, devices_needed, rollout_world_size
from rlframe.controller import ResourcePool, RoleHandle, WorkerGroup, process_group_backend
from rlframe.controller.cluster import ClusterRequest, NodeInfo, check_cluster, device_unit, list_nodes, uses_gpus
from rlframe.controller.placement import PoolPlan, make_pool, plan_pools
from rlframe.models.provision import resolve_model_path
from rlframe.trainer import worker_settings
from rlframe.trainer.startup import worker_group_parts
from rlframe.workers.roles.actor_rollout import ActorRolloutWorker, ActorWorker
from rlframe.workers.roles.critic import CriticWorker
from rlframe.workers.roles.ref import RefWorker
from rlframe.workers.roles.reward_model import RewardModelWorker
from rlframe.workers.roles.rollout import RolloutWorker
from rlframe.workers.roles.teacher import TeacherWorker


def cluster_request(cfg: RLConfig, nodes: list[NodeInfo]) -> ClusterRequest:
    """What the run asks of the cluster: trainer.nnodes x devices_per_node devices (default: what one
    node must hold) of trainer.cpus_per_worker CPUs (+ a GPU)."""
    t = cfg.trainer
    per_node = t.devices_per_node or devices_needed(cfg)
    gpus = uses_gpus(t.device, nodes)
    return ClusterRequest(nnodes=t.nnodes, devices_per_node=per_node,
                          unit=device_unit(gpus, t.cpus_per_worker, per_node, nodes),
                          node_resources=list(t.node_resources), key_prefix="trainer.")


def plan_placement(cfg: RLConfig) -> list[PoolPlan]:
    """The pools of the configured placement: [colocated] or [actor, rollout]."""
    sizes = ([("colocated", cfg.actor.world_size)] if cfg.trainer.placement == "colocated" else
             [("actor", cfg.actor.world_size), ("rollout", rollout_world_size(cfg))])
    return plan_pools(sizes, cfg.trainer.nnodes, cfg.trainer.devices_per_node or devices_needed(cfg))


class DisaggregatedActorRollout:
    """The ``actor_rollout`` handle when the engines live in their own group.

    Generation goes to the rollout group; ``sync_weights`` is the broadcast trainer -> engines;
    everything else (log-probs, updates, checkpoints, export) goes to the actor group.
    """

    def __init__(self, actor: RoleHandle, rollout: RoleHandle):
        self.actor = actor
        self.rollout = rollout
        self.policy_version: int | None = None  # the version the next load_checkpoint's weights have, when known

    def generate_sequences(self, prompts, **kwargs):
        return self.rollout.generate_sequences(prompts, **kwargs)

    def sync_weights(self, _timeout=None, policy_version: int | None = None, **kwargs) -> list[dict]:
        """Broadcast the actor's weights to the engines; `policy_version` is recorded on the samples they generate."""
        start = time.perf_counter()
        sending = self.actor.broadcast_weights(_blocking=False, _timeout=_timeout)
        receiving = self.rollout.receive_weights(policy_version, _blocking=False, _timeout=_timeout)
        sent, received = sending.result()[0], receiving.result()
        return [{"timing/weight_sync_s": time.perf_counter() - start, "weight_sync/tensors": sent["tensors"],
                 "weight_sync/buckets": sent["buckets"], "weight_sync/bytes": sent["bytes"],
                 "weight_sync/loaded_per_engine": min(r["loaded"] for r in received)}]

    def stage_weights(self, policy_version: int, _timeout=None, _load_timeout=None):
        """Without waiting for the engines: the actor puts its weights in the object store and each engine loads
        them after the generations already sent to it (trainer.max_staleness >= 2). Returns (metrics, the
        engines' Future of their load)."""
        start = time.perf_counter()
        staged = next(refs for refs in self.actor.stage_weights(_timeout=_timeout) if refs)
        loading = self.rollout.load_staged_weights(staged, policy_version, _blocking=False, _timeout=_load_timeout)
        return {"timing/weight_sync_s": time.perf_counter() - start}, loading

    def load_checkpoint(self, in_dir, **kwargs):
        info = self.actor.load_checkpoint(in_dir, **kwargs)
        self.sync_weights(policy_version=self.policy_version)
        return info

    def describe(self, **kwargs) -> list[dict]:
        actors, engines = self.actor.describe(**kwargs), self.rollout.describe(**kwargs)
        return [{**a, "engine": engines[0]["engine"]} for a in actors]

    def __getattr__(self, name):
        return getattr(self.__dict__["actor"], name)


@dataclass
class Workers:
    """What `start_workers` returns: the started groups, their pools, and a handle to each role."""

    groups: list[WorkerGroup]
    pools: list[ResourcePool]
    actor_rollout: RoleHandle | DisaggregatedActorRollout
    ref: RoleHandle | None = None
    critic: RoleHandle | None = None
    reward_model: RoleHandle | None = None
    teacher: RoleHandle | None = None  # on-policy distillation (teacher.path)
    placement: list[dict] = field(default_factory=list)
    startup_extra: dict[str, float] = field(default_factory=dict)  # start-up parts outside the groups' own

    @property
    def disaggregated(self) -> bool:
        """The engines live in their own group (they record the version of the weights they receive)."""
        return isinstance(self.actor_rollout, DisaggregatedActorRollout)

    def group_of(self, role: str) -> WorkerGroup:
        """The group that hosts `role` (the first group for start-up errors, role '<host>')."""
        return next((g for g in self.groups if role in g.roles), self.groups[0])

    def memory_peaks(self) -> dict[str, float]:
        """The peak memory (GiB) of each (role, method) called since the last read, over all groups and ranks
        (`WorkerGroup.memory_peaks`)."""
        peaks: dict[str, float] = {}
        for group in self.groups:
            for key, value in group.memory_peaks().items():
                peaks[key] = max(value, peaks.get(key, 0.0))
        return peaks

    def startup_parts(self) -> dict[str, float]:
        """Each group's start-up parts (rlframe/trainer/startup.py: spawn/<group>, init/<group>, ...)."""
        parts = dict(self.startup_extra)
        for group in self.groups:
            times = group.startup_times
            if times:
                parts.update(worker_group_parts(group.name, times.get("spawn", 0.0), times.get("init", 0.0),
                                                times.get("ranks", [])))
        return parts

    def shutdown(self) -> None:
        """Kill every worker and release the pools' reservations."""
        for group in self.groups:
            group.shutdown()
        for pool in self.pools:
            pool.remove()


def trainer_roles(cfg: RLConfig, model_path: str, *, with_rollout: bool) -> dict:
    """The roles of the trainer pool: the actor (+ its engine when colocated), + ref (KL; under LoRA
    the actor is the reference policy itself), + reward model, + teacher (distillation), + critic (an estimator that needs values: gae)."""
    actor_cls = ActorRolloutWorker if with_rollout else ActorWorker
    roles = {"actor_rollout": (actor_cls, {"settings": worker_settings.actor_settings(cfg, model_path,
                                                                                      with_rollout=with_rollout)})}
    if worker_settings.uses_reference_policy(cfg) and not worker_settings.reference_is_actor(cfg):
        roles["ref"] = (RefWorker, {"settings": worker_settings.ref_settings(cfg, model_path)})
    if cfg.reward_model.enable:
        rm_path = resolve_model_path(cfg.reward_model.path)
        roles["reward_model"] = (RewardModelWorker, {"settings": worker_settings.reward_model_settings(cfg, rm_path)})
    if worker_settings.uses_teacher(cfg):  # forward-only, on the actor's devices (workers/roles/teacher.py)
        roles["teacher"] = (TeacherWorker, {"settings": worker_settings.teacher_settings(
            cfg, resolve_model_path(cfg.teacher.path))})
    if configured_estimator_needs(cfg.algorithm).critic:
        critic_path = resolve_model_path(cfg.critic.model_path) if cfg.critic.model_path else model_path
        roles["critic"] = (CriticWorker, {"settings": worker_settings.critic_settings(cfg, critic_path)})
    return roles


def start_workers(cfg: RLConfig, model_path: str) -> Workers:
    """Plan the pools for the configured placement, start the groups, and return them with their roles."""
    start = time.perf_counter()
    nodes = list_nodes()
    request = cluster_request(cfg, nodes)
    chosen = check_cluster(request, nodes)
    backend = process_group_backend(bool(request.gpus))  # GPU: cpu:gloo,cuda:nccl
    timeout = cfg.trainer.timeouts.init
    plans = plan_placement(cfg)
    pools = [make_pool(plan, request, chosen) for plan in plans]
    groups: list[WorkerGroup] = []
    extra: dict[str, float] = {}
    try:
        colocated = cfg.trainer.placement == "colocated"
        # The groups of independent roles start side by side: every group's actors are asked for first, then each
        # group's init is sent once its ranks run, then all are waited for.
        groups.append(WorkerGroup(pools[0], trainer_roles(cfg, model_path, with_rollout=colocated), backend=backend,
                                  name=plans[0].name, default_timeout_s=timeout, wait=False))
        if not colocated:
            rollout_settings = worker_settings.rollout_settings(cfg, model_path)
            groups.append(WorkerGroup(
                pools[1], {"rollout": (RolloutWorker, {"settings": rollout_settings,
                                                       "weight_sync_timeout_s": cfg.trainer.timeouts.weight_sync})},
                backend=backend, name=plans[1].name, default_timeout_s=timeout, wait=False))
        for group in groups:
            group.begin_init()
        for group in groups:
            group.wait_started()
        actor = groups[0].role("actor_rollout")
        if colocated:
            actor_rollout = actor
        else:
            rollout = groups[1].role("rollout")
            sync_start = time.perf_counter()
            _init_weight_sync(cfg, actor, rollout, "nccl" if request.gpus else "gloo", timeout)  # CUDA buffers only
            extra["weight_sync_init"] = time.perf_counter() - sync_start
            actor_rollout = DisaggregatedActorRollout(actor, rollout)
    except BaseException:
        Workers(groups, pools, actor_rollout=None).shutdown()
        raise
    roles = groups[0].roles
    workers = Workers(groups, pools, actor_rollout,
                      ref=groups[0].role("ref") if "ref" in roles else (
                          groups[0].role("actor_rollout") if worker_settings.reference_is_actor(cfg) else None),
                      critic=groups[0].role("critic") if "critic" in roles else None,
                      reward_model=groups[0].role("reward_model") if "reward_model" in roles else None,
                      teacher=groups[0].role("teacher") if "teacher" in roles else None,
                      placement=describe_placement(plans, groups, chosen), startup_extra=extra)
    info = actor_rollout.describe()[0]
    print(f"workers: {cfg.trainer.placement} placement; "
          + "; ".join(f"pool {p['pool']} = {p['world_size']} x {'+'.join(p['roles'])} on nodes {p['nodes']}"
                      for p in workers.placement)
          + f" (engine={info['engine']}, strategy={info['strategy']}, device={info['device']}, dtype={info['dtype']}, "
          f"sharded={info['sharded']}) in {time.perf_counter() - start:.1f}s", flush=True)
    return workers


def _init_weight_sync(cfg: RLConfig, actor: RoleHandle, rollout: RoleHandle, backend: str, timeout: float) -> None:
    """Form the broadcast group trainer rank 0 + all engines (both sides must join together)."""
    host, port = actor.weight_sync_address()[0]
    specs = actor.weight_spec()[0]
    world = 1 + rollout_world_size(cfg)
    bucket_bytes = cfg.rollout.weight_bucket_mb << 20
    sender = actor.init_weight_sync(host, port, world, backend, specs, bucket_bytes, _blocking=False, _timeout=timeout)
    receivers = rollout.init_weight_sync(host, port, world, backend, specs, bucket_bytes, _blocking=False,
                                         _timeout=timeout)
    sender.result()
    receivers.result()


def describe_placement(plans: list[PoolPlan], groups: list[WorkerGroup], nodes: list[NodeInfo]) -> list[dict]:
    out = []
    for plan, group in zip(plans, groups):
        node_ips = sorted({group.rank_info(r).node_ip for r in range(group.world_size)})
        out.append({"pool": plan.name, "world_size": plan.world_size, "roles": list(group.roles),
                    "nodes": [nodes[i].short_id for i in plan.node_indices] if nodes else node_ips,
                    "bundles_per_node": plan.bundles_per_node})
    return out
