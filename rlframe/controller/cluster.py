"""The Ray cluster a run uses: join one that is there, or start a local one; check it is big enough.

    connect(cfg, env_vars)      # RAY_ADDRESS / trainer.ray_address (e.g. auto) -> join; else local
    nodes = check_cluster(cfg)  # prints the nodes; raises ClusterTooSmall before any worker starts

A "device" is a GPU (plus one CPU for its process) on GPU clusters, or `trainer.cpus_per_worker`
CPUs (default 1) on CPU clusters. A run asks for `trainer.nnodes` nodes with
`trainer.devices_per_node` devices each; with `trainer.node_resources` node i must be the node
that carries the custom resource `node_resources[i]` (see `ray start --resources`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import ray


class ClusterTooSmall(RuntimeError):
    """The cluster cannot hold the requested nodes x devices; the message says what is short where."""


@dataclass
class NodeInfo:
    node_id: str
    ip: str
    resources: dict[str, float]
    is_head: bool = False
    custom: dict[str, float] = field(default_factory=dict)

    @property
    def short_id(self) -> str:
        return self.node_id[:8]

    def describe(self) -> str:
        custom = ", ".join(f"{k}={v:g}" for k, v in sorted(self.custom.items()))
        return (f"{self.short_id} {self.ip:<15} CPU={self.resources.get('CPU', 0):g} GPU={self.resources.get('GPU', 0):g}"
                f"{' head' if self.is_head else ''}{'  ' + custom if custom else ''}")


def runtime_env(cfg, base_env: dict[str, str] | None = None) -> dict:
    """The job-wide Ray runtime_env: our env vars + the user's (trainer.runtime_env), and a working dir."""
    env_vars = {**(base_env or {}), **{k: str(v) for k, v in cfg.trainer.runtime_env.env_vars.items()}}
    env: dict = {"env_vars": env_vars}
    working_dir = cfg.trainer.runtime_env.working_dir
    if working_dir:
        env["working_dir"] = str(Path(working_dir).resolve())
    return env


def connect(cfg, base_env: dict[str, str] | None = None) -> None:
    """Join the cluster at trainer.ray_address or $RAY_ADDRESS (``auto`` finds a local head), else start one."""
    if ray.is_initialized():
        return
    env = runtime_env(cfg, base_env)
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        ray.init(num_cpus=cfg.trainer.num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=env,
                 log_to_driver=True)


def list_nodes() -> list[NodeInfo]:
    """The alive nodes, the head first."""
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = dict(node.get("Resources", {}))
        custom = {k: v for k, v in resources.items()
                  if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")
                  and not k.startswith("accelerator_type")}
        nodes.append(NodeInfo(node["NodeID"], node["NodeManagerAddress"], resources, custom=custom,
                              is_head="node:__internal_head__" in resources))
    return sorted(nodes, key=lambda n: (not n.is_head, n.ip, n.node_id))


def uses_gpus(cfg, nodes: list[NodeInfo]) -> bool:
    if cfg.trainer.device == "cpu":
        return False
    if cfg.trainer.device == "cuda":
        return True
    return any(n.resources.get("GPU", 0) > 0 for n in nodes)


def device_resources(cfg, gpus: bool) -> dict[str, float]:
    """What one device (one bundle) takes."""
    if gpus:
        return {"CPU": cfg.trainer.cpus_per_worker or 1, "GPU": 1}
    return {"CPU": cfg.trainer.cpus_per_worker or 1}


def check_cluster(cfg, nodes: list[NodeInfo] | None = None, quiet: bool = False) -> list[NodeInfo]:
    """Print the cluster and pick ``trainer.nnodes`` nodes that each hold ``devices_per_node`` devices.

    Returns the chosen nodes in node-entry order. Raises ClusterTooSmall naming the resource that is
    short and the node it is short on. Totals are compared (what other jobs hold shows up later as a
    placement-group wait, reported by ResourcePool).
    """
    nodes = list_nodes() if nodes is None else nodes
    if not quiet:
        print(f"ray cluster: {len(nodes)} node(s)", flush=True)
        for node in nodes:
            print(f"  {node.describe()}", flush=True)
    from rlframe.controller.placement import devices_needed, uses_placement

    if not uses_placement(cfg):  # the classic one-node pool: the trainer sizes it to the cluster
        return nodes
    t = cfg.trainer

    per_node = t.devices_per_node or devices_needed(cfg)
    gpus = uses_gpus(cfg, nodes)
    unit = device_resources(cfg, gpus)
    want = {key: amount * per_node for key, amount in unit.items()}
    request = (f"trainer.nnodes={t.nnodes} x trainer.devices_per_node={per_node} "
               f"({per_node} x {_fmt(unit)} = {_fmt(want)} per node)")

    def shortfall(node: NodeInfo) -> list[str]:
        return [f"{key}: node {node.short_id} ({node.ip}) has {node.resources.get(key, 0):g}, needs {amount:g}"
                for key, amount in want.items() if node.resources.get(key, 0) < amount]

    if t.node_resources:
        chosen = []
        problems = []
        for i, resource in enumerate(t.node_resources):
            holders = [n for n in nodes if n.resources.get(resource, 0) > 0 and n not in chosen]
            if not holders:
                problems.append(f"node {i}: no node carries the custom resource '{resource}' "
                                f"(trainer.node_resources[{i}]). Fix: ray start ... --resources='{{\"{resource}\": 1}}' "
                                "on that node, or drop trainer.node_resources")
                continue
            short = shortfall(holders[0])
            if short:
                problems.append(f"node {i} ('{resource}'): short of " + "; ".join(short))
            chosen.append(holders[0])
        if problems:
            raise ClusterTooSmall(f"the cluster cannot hold {request}:\n  " + "\n  ".join(problems) + _cluster_lines(nodes))
        return chosen
    fitting = [n for n in nodes if not shortfall(n)]
    if len(fitting) < t.nnodes:
        lines = [f"{len(fitting)} of {len(nodes)} node(s) fit, {t.nnodes} needed"]
        lines += [f"short: {s}" for n in nodes for s in shortfall(n)]
        if len(nodes) < t.nnodes:
            lines.append(f"nodes: the cluster has {len(nodes)}, trainer.nnodes asks for {t.nnodes}")
        raise ClusterTooSmall(
            f"the cluster cannot hold {request}:\n  " + "\n  ".join(lines)
            + "\n  Fix: add nodes (ray start --address=...), or lower trainer.nnodes / trainer.devices_per_node"
            + (" / trainer.cpus_per_worker" if not gpus else "") + _cluster_lines(nodes))
    return fitting[: t.nnodes]


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _cluster_lines(nodes: list[NodeInfo]) -> str:
    return "\n  cluster nodes:\n" + "\n".join(f"    {n.describe()}" for n in nodes)
