"""Where the roles run: resource pools over nodes, and which roles share them.

Two placements (`trainer.placement`):

- ``colocated`` (the hybrid engine): one pool of ``actor.world_size`` devices; every rank hosts the
  actor, its rollout engine and the ref (and critic). With ``trainer.nnodes`` > 1 the pool spreads
  over the nodes, ``devices_per_node`` bundles on each.
- ``disaggregated``: the trainer roles (actor, ref, critic) on a pool of ``actor.world_size``
  devices, the rollout engines on a pool of ``rollout.world_size`` devices of their own. After each
  update the trainer's rank 0 broadcasts the weights to the engines (workers/weight_broadcast.py).

Devices are handed out node by node: the trainer pool takes the first ``actor.world_size`` device
slots, the rollout pool the next ``rollout.world_size``; so with 2 nodes of 2 devices and world sizes
2 + 2 the trainers fill node 0 and the engines node 1. A pool's bundles on one node form one STRICT_PACK
placement group pinned to that node, by the custom resource ``trainer.node_resources[i]`` when given,
else by Ray node id (the nodes ``cluster.check_cluster`` picked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlframe.controller.cluster import NodeInfo, check_cluster, device_resources, uses_gpus
from rlframe.controller.resource_pool import ResourcePool
from rlframe.controller.worker_group import RoleHandle, WorkerGroup

PLACEMENTS = ("colocated", "disaggregated")
NODE_ID_LABEL = "ray.io/node-id"
PIN_AMOUNT = 0.001  # of a node's custom resource, per bundle: pins without using it up


def rollout_world_size(cfg) -> int:
    return cfg.rollout.world_size or cfg.actor.world_size


def devices_needed(cfg) -> int:
    if cfg.trainer.placement == "disaggregated":
        return cfg.actor.world_size + rollout_world_size(cfg)
    return cfg.actor.world_size


def uses_placement(cfg) -> bool:
    """False: the classic single-node colocated pool the trainer builds itself."""
    t = cfg.trainer
    return t.placement != "colocated" or t.nnodes > 1 or t.devices_per_node is not None or bool(t.node_resources)


def validate_placement(cfg, need) -> None:
    """Config checks (before Ray starts); the cluster itself is checked by cluster.check_cluster."""
    t = cfg.trainer
    need(t.placement in PLACEMENTS, "trainer.placement", f"'{t.placement}' is not one of {', '.join(PLACEMENTS)}")
    need(t.nnodes >= 1, "trainer.nnodes", "must be >= 1")
    need(t.devices_per_node is None or t.devices_per_node >= 1, "trainer.devices_per_node", "must be >= 1")
    need(t.nnodes == 1 or t.devices_per_node is not None, "trainer.devices_per_node",
         f"trainer.nnodes={t.nnodes} needs the devices of each node. Fix: trainer.devices_per_node=<GPUs per node>")
    need(not t.node_resources or len(t.node_resources) == t.nnodes, "trainer.node_resources",
         f"gives {len(t.node_resources)} resource names for trainer.nnodes={t.nnodes}. Fix: one per node")
    rw = cfg.rollout.world_size
    need(rw is None or rw >= 1, "rollout.world_size", "must be >= 1")
    need(rw is None or t.placement == "disaggregated" or rw == cfg.actor.world_size, "rollout.world_size",
         "in colocated placement the engines share the actor's devices (rollout.world_size = actor.world_size). "
         "Fix: drop rollout.world_size, or trainer.placement=disaggregated")
    need(cfg.rollout.weight_bucket_mb >= 1, "rollout.weight_bucket_mb", "must be >= 1")
    if t.devices_per_node is not None and t.nnodes >= 1 and t.placement in PLACEMENTS:
        have = t.nnodes * t.devices_per_node
        need(devices_needed(cfg) <= have, "trainer.devices_per_node",
             f"{t.placement} placement needs {devices_needed(cfg)} devices "
             + (f"(actor.world_size={cfg.actor.world_size} + rollout.world_size={rollout_world_size(cfg)})"
                if t.placement == "disaggregated" else f"(actor.world_size={cfg.actor.world_size})")
             + f" but trainer.nnodes x trainer.devices_per_node = {have}. Fix: raise one of them or lower the world sizes")


@dataclass
class PoolPlan:
    name: str
    bundles_per_node: list[int]  # bundles on each node entry that the pool uses
    node_indices: list[int]  # which of the run's nodes each entry is

    @property
    def world_size(self) -> int:
        return sum(self.bundles_per_node)


def plan_pools(cfg) -> list[PoolPlan]:
    """Hand out device slots node by node: trainer pool first, then the rollout pool (disaggregated)."""
    t = cfg.trainer
    per_node = t.devices_per_node or devices_needed(cfg)
    slots = [node for node in range(t.nnodes) for _ in range(per_node)]
    sizes = [("colocated", cfg.actor.world_size)] if t.placement == "colocated" else [
        ("actor", cfg.actor.world_size), ("rollout", rollout_world_size(cfg))]
    plans, start = [], 0
    for name, size in sizes:
        taken = slots[start: start + size]
        start += size
        nodes = sorted(set(taken))
        plans.append(PoolPlan(name, [taken.count(n) for n in nodes], nodes))
    return plans


def make_pool(plan: PoolPlan, cfg, nodes: list[NodeInfo], gpus: bool) -> ResourcePool:
    unit = device_resources(cfg, gpus)
    kwargs = {}
    if cfg.trainer.node_resources:
        kwargs["node_resources"] = [{cfg.trainer.node_resources[i]: PIN_AMOUNT} for i in plan.node_indices]
    elif cfg.trainer.nnodes > 1:
        kwargs["node_labels"] = [{NODE_ID_LABEL: nodes[i].node_id} for i in plan.node_indices]
    return ResourcePool(plan.bundles_per_node, cpus_per_bundle=unit["CPU"], gpus_per_bundle=unit.get("GPU", 0),
                        name=plan.name, **kwargs)


class WorkerGroups:
    """Several worker groups that the trainer treats as one (shutdown, fault reports)."""

    def __init__(self, groups: list[WorkerGroup]):
        self.groups = groups

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()

    def rank_info(self, rank: int):
        return self.groups[0].rank_info(rank)

    def __getattr__(self, name):
        return getattr(self.__dict__["groups"][0], name)


class ResourcePools:
    def __init__(self, pools: list[ResourcePool]):
        self.pools = pools

    def remove(self) -> None:
        for pool in self.pools:
            pool.remove()


class DisaggregatedActorRollout:
    """The trainer's ``actor_rollout`` handle when the engines live in their own group.

    Generation goes to the rollout group; ``sync_weights`` is the broadcast trainer -> engines;
    everything else (log-probs, updates, checkpoints, export) goes to the actor group.
    """

    def __init__(self, actor: RoleHandle, rollout: RoleHandle):
        self.actor = actor
        self.rollout = rollout

    def generate_sequences(self, prompts, **kwargs):
        return self.rollout.generate_sequences(prompts, **kwargs)

    def sync_weights(self, _timeout=None, **kwargs) -> list[dict]:
        start = time.perf_counter()
        sending = self.actor.broadcast_weights(_blocking=False, _timeout=_timeout)
        receiving = self.rollout.receive_weights(_blocking=False, _timeout=_timeout)
        sent, received = sending.result()[0], receiving.result()
        return [{"timing/weight_sync_s": time.perf_counter() - start, "weight_sync/tensors": sent["tensors"],
                 "weight_sync/buckets": sent["buckets"], "weight_sync/bytes": sent["bytes"],
                 "weight_sync/loaded_per_engine": min(r["loaded"] for r in received)}]

    def load_checkpoint(self, in_dir, **kwargs):
        info = self.actor.load_checkpoint(in_dir, **kwargs)
        self.sync_weights()
        return info

    def describe(self, **kwargs) -> list[dict]:
        actors, engines = self.actor.describe(**kwargs), self.rollout.describe(**kwargs)
        return [{**a, "engine": engines[0]["engine"]} for a in actors]

    def __getattr__(self, name):
        return getattr(self.__dict__["actor"], name)


def trainer_roles(cfg, worker_cfg: dict, model_path: str, actor_cls) -> dict:
    """The roles of the trainer pool (one-node and multi-node paths alike): the actor class given,
    + ref (KL), + reward model, + critic (gae)."""
    from rlframe.models.provision import resolve_model_path
    from rlframe.workers.fsdp_workers import RefWorker

    roles = {"actor_rollout": (actor_cls, {"cfg": worker_cfg, "model_path": model_path})}
    if cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        roles["ref"] = (RefWorker, {"cfg": worker_cfg, "model_path": model_path})
    reward_model = cfg.reward_model
    if reward_model.enable:
        from rlframe.workers.reward_model_worker import RewardModelWorker

        roles["reward_model"] = (RewardModelWorker, {"cfg": worker_cfg, "model_path": resolve_model_path(reward_model.path)})
    if cfg.algorithm.adv_estimator == "gae":
        from rlframe.workers.critic import CriticWorker

        critic_path = resolve_model_path(cfg.critic.model_path) if cfg.critic.model_path else model_path
        roles["critic"] = (CriticWorker, {"cfg": worker_cfg, "model_path": critic_path})
    return roles


def start_workers(trainer) -> None:
    """Build the pools and groups for the configured placement and attach them to ``trainer``.

    Sets ``trainer.pool``, ``trainer.workers``, ``trainer.actor_rollout``, ``trainer.ref``,
    ``trainer.critic`` (what the driver loop uses) and ``trainer.placement_info``.
    """
    from rlframe.config import to_container

    cfg = trainer.cfg
    nodes = check_cluster(cfg, quiet=True)
    gpus = uses_gpus(cfg, nodes)
    backend = "nccl" if gpus else "gloo"
    plans = plan_pools(cfg)
    worker_cfg = to_container(cfg)
    timeout = cfg.trainer.timeouts.init
    start = time.perf_counter()
    pools = [make_pool(plan, cfg, nodes, gpus) for plan in plans]
    trainer.pool = ResourcePools(pools)
    if cfg.trainer.placement == "colocated":
        from rlframe.workers.fsdp_workers import ActorRolloutWorker

        roles = trainer_roles(cfg, worker_cfg, trainer.model_path, ActorRolloutWorker)
        group = WorkerGroup(pools[0], roles, backend=backend, name="colocated", default_timeout_s=timeout)
        trainer.workers = WorkerGroups([group])
        trainer.actor_rollout = group.role("actor_rollout")
    else:
        from rlframe.workers.rollout_worker import ActorWorker, RolloutWorker

        roles = trainer_roles(cfg, worker_cfg, trainer.model_path, ActorWorker)
        actor_group = WorkerGroup(pools[0], roles, backend=backend, name="actor", default_timeout_s=timeout)
        try:
            rollout_group = WorkerGroup(pools[1], {"rollout": (RolloutWorker, {"cfg": worker_cfg,
                                                                               "model_path": trainer.model_path})},
                                        backend=backend, name="rollout", default_timeout_s=timeout)
        except BaseException:
            actor_group.shutdown()
            raise
        trainer.workers = WorkerGroups([actor_group, rollout_group])
        actor, rollout = actor_group.role("actor_rollout"), rollout_group.role("rollout")
        _init_weight_sync(cfg, actor, rollout, backend, timeout)
        trainer.actor_rollout = DisaggregatedActorRollout(actor, rollout)
    group = trainer.workers.groups[0]
    trainer.ref = group.role("ref") if "ref" in group.roles else None
    trainer.critic = group.role("critic") if "critic" in group.roles else None
    trainer.reward_model = group.role("reward_model") if "reward_model" in group.roles else None
    trainer.placement_info = describe_placement(plans, trainer.workers.groups, nodes)
    elapsed = time.perf_counter() - start
    trainer.phase_times["init_workers"] = trainer.phase_times.get("init_workers", 0.0) + elapsed
    info = trainer.actor_rollout.describe()[0]
    print(f"workers: placement={cfg.trainer.placement} "
          + "; ".join(f"{p['pool']}: {p['world_size']} x {'+'.join(p['roles'])} on nodes {p['nodes']}"
                      for p in trainer.placement_info)
          + f" (engine={info['engine']}, device={info['device']}, dtype={info['dtype']}, sharded={info['sharded']}) "
          f"in {elapsed:.1f}s", flush=True)


def _init_weight_sync(cfg, actor: RoleHandle, rollout: RoleHandle, backend: str, timeout: float) -> None:
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


__all__ = ["DisaggregatedActorRollout", "PoolPlan", "plan_pools", "start_workers", "uses_placement",
           "validate_placement"]
