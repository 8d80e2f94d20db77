"""The Ray cluster a run uses: join one that is there, or start a local one; check it is big enough.

    connect(address, num_cpus, env)     # an address (e.g. auto) -> join; else start a local cluster
    shutdown()                          # at the end: a local cluster stops at once, nothing left behind
    nodes = list_nodes()
    chosen = check_cluster(request, nodes)  # raises ClusterTooSmall before any worker starts

A `ClusterRequest` asks for `nnodes` nodes with `devices_per_node` devices each, one device being
`unit` resources (a GPU plus CPUs for its process, or CPUs alone on CPU clusters); with
`node_resources`, node i must be the node that carries the custom resource `node_resources[i]`
(see `ray start --resources`). This module knows Ray, not the RL config: messages name the
caller's settings through `key_prefix`.
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


@dataclass
class ClusterRequest:
    nnodes: int
    devices_per_node: int
    unit: dict[str, float]  # what one device (one bundle) takes, e.g. {"CPU": 1, "GPU": 1}
    node_resources: list[str] = field(default_factory=list)
    key_prefix: str = ""  # how the caller's settings are spelled in messages, e.g. "trainer."

    @property
    def gpus(self) -> bool:
        return self.unit.get("GPU", 0) > 0


def uses_gpus(device: str, nodes: list[NodeInfo]) -> bool:
    """device: auto (GPUs when any node has one) | cpu | cuda."""
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    return any(n.resources.get("GPU", 0) > 0 for n in nodes)


def device_unit(gpus: bool, cpus_per_device: float | None, devices_per_node: int, nodes: list[NodeInfo]) -> dict[str, float]:
    """What one device takes. CPUs default to 1 per GPU, and on CPU clusters to an equal share of the
    smallest node's CPUs (so one-node runs use every core)."""
    if gpus:
        return {"CPU": cpus_per_device or 1, "GPU": 1}
    if cpus_per_device:
        return {"CPU": cpus_per_device}
    node_cpus = [n.resources.get("CPU", 0) for n in nodes if n.resources.get("CPU", 0) > 0]
    return {"CPU": max(min(node_cpus, default=1) / max(devices_per_node, 1), 1)}


def runtime_env(env_vars: dict[str, str], working_dir: str | None = None) -> dict:
    """A job-wide Ray runtime_env: env vars for every worker, and a working dir uploaded to every node."""
    env: dict = {"env_vars": {k: str(v) for k, v in env_vars.items()}}
    if working_dir:
        env["working_dir"] = str(Path(working_dir).resolve())
    return env


JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a `ray job submit` entrypoint


def job_runtime_env() -> dict | None:
    """The runtime env of the Ray job this driver runs as (`ray job submit --runtime-env-json / --working-dir`), or
    None when it is not a submitted job."""
    import json

    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        return dict(json.loads(raw).get("runtime_env") or {})
    except (ValueError, AttributeError):
        return None


def merge_with_job_env(ours: dict, job: dict | None) -> tuple[dict, list[str]]:
    """Our runtime env without what the submitted job's already sets, so Ray merges the two instead of refusing
    ("Failed to merge the Job's runtime env ... because of a conflict"). The job's value wins (the user gave it at
    submit time): an env var or field it sets is dropped from ours, with a note when the values differ. Pure."""
    if not job:
        return ours, []
    merged, notes = dict(ours), []
    job_vars = job.get("env_vars") or {}
    kept = {}
    for key, value in (ours.get("env_vars") or {}).items():
        if key not in job_vars:
            kept[key] = value
        elif str(job_vars[key]) != str(value):
            notes.append(f"env var {key}: the job's {job_vars[key]!r} (ours was {value!r})")
    merged["env_vars"] = kept
    for field in [k for k in ours if k != "env_vars" and k in job]:
        if job[field] != ours[field]:
            notes.append(f"runtime_env {field}: the job's {job[field]!r} (ours was {ours[field]!r})")
        merged.pop(field)
    return merged, notes


LOCAL_TASK_EVENTS_KEPT = 1_000


def local_cluster_settings(dashboard: bool = False) -> dict[str, str]:
    """The Ray settings (env vars its daemons read) of a local cluster we start; a value the user set wins.

    Without the dashboard nothing reads Ray's own metrics: its agents skip collecting and exporting them. Nor the
    event record the GCS keeps of every task call, up to Ray's 100,000 (for the dashboard and `ray list tasks`): on
    the soak (examples/benchmark/soak.py) it grew the GCS by ~1.9 MiB per 100 steps, a few KiB per call; kept to the
    latest LOCAL_TASK_EVENTS_KEPT, the GCS levelled off at ~51 MiB after ~240 steps. And Ray starts idle workers for
    the first driver (one per CPU, as many at once as it has cores) to serve its tasks; ours are actors with a
    runtime env of their own, which those workers never get: each was a Python process importing Ray for nothing
    (~1 s of CPU each, on the cores the run's own workers start on)."""
    settings = {} if dashboard else {"RAY_enable_metrics_collection": "0",
                                     "RAY_task_events_max_num_task_in_gcs": str(LOCAL_TASK_EVENTS_KEPT)}
    settings["RAY_prestart_worker_first_driver"] = "0"
    return {key: os.environ.get(key, value) for key, value in settings.items()}


def connect(address: str | None, num_cpus: int | None, env: dict, dashboard: bool = False) -> None:
    """Join the cluster at `address` or $RAY_ADDRESS (``auto`` finds a local head), else start a local one (with
    Ray's dashboard only when `dashboard`, and local_cluster_settings). Run as a submitted Ray job, our runtime env
    joins the job's (merge_with_job_env)."""
    if ray.is_initialized():
        return
    env, notes = merge_with_job_env(env, job_runtime_env())
    for note in notes:
        print(f"note: ray job: {note}", flush=True)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        os.environ.update(local_cluster_settings(dashboard))
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=dashboard, runtime_env=env, log_to_driver=True)


def shutdown() -> None:
    """Disconnect; a local cluster this process started stops now (its raylet, GCS and daemons, each reaped: none
    is left behind). Ray's own sweep terminates them one at a time and gives each a second to exit: the autoscaler's
    monitor, which a local cluster does not use, takes all of it, so it is killed first (it keeps no state)."""
    if not ray.is_initialized():
        return
    try:
        from ray._private import ray_constants
        from ray._private.worker import _global_node as node

        monitors = (node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []) if node is not None else [])
        for info in monitors:
            if info.process.poll() is None:
                info.process.kill()
                info.process.wait(timeout=10)
    except Exception:  # (Ray's internals moved: its own sweep below still stops everything, only slower)
        pass
    ray.shutdown()


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


def print_nodes(nodes: list[NodeInfo]) -> None:
    print(f"ray cluster: {len(nodes)} node(s)", flush=True)
    for node in nodes:
        print(f"  {node.describe()}", flush=True)


def check_cluster(request: ClusterRequest, nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Pick ``request.nnodes`` nodes that each hold ``devices_per_node`` devices.

    Returns the chosen nodes in node-entry order. Raises ClusterTooSmall naming the resource that is
    short and the node it is short on. Totals are compared (what other jobs hold shows up later as a
    placement-group wait, reported by ResourcePool).
    """
    t, p = request, request.key_prefix
    per_node, unit = t.devices_per_node, t.unit
    want = {key: amount * per_node for key, amount in unit.items()}
    asked = (f"{p}nnodes={t.nnodes} x {p}devices_per_node={per_node} "
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
                                f"({p}node_resources[{i}]). Fix: ray start ... --resources='{{\"{resource}\": 1}}' "
                                f"on that node, or drop {p}node_resources")
                continue
            short = shortfall(holders[0])
            if short:
                problems.append(f"node {i} ('{resource}'): short of " + "; ".join(short))
            chosen.append(holders[0])
        if problems:
            raise ClusterTooSmall(f"the cluster cannot hold {asked}:\n  " + "\n  ".join(problems) + _cluster_lines(nodes))
        return chosen
    fitting = [n for n in nodes if not shortfall(n)]
    if len(fitting) < t.nnodes:
        lines = [f"{len(fitting)} of {len(nodes)} node(s) fit, {t.nnodes} needed"]
        lines += [f"short: {s}" for n in nodes for s in shortfall(n)]
        if len(nodes) < t.nnodes:
            lines.append(f"nodes: the cluster has {len(nodes)}, {p}nnodes asks for {t.nnodes}")
        raise ClusterTooSmall(
            f"the cluster cannot hold {asked}:\n  " + "\n  ".join(lines)
            + f"\n  Fix: add nodes (ray start --address=...), or lower {p}nnodes / {p}devices_per_node"
            + (f" / {p}cpus_per_worker" if not t.gpus else "") + _cluster_lines(nodes))
    return fitting[: t.nnodes]


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _cluster_lines(nodes: list[NodeInfo]) -> str:
    return "\n  cluster nodes:\n" + "\n".join(f"    {n.describe()}" for n in nodes)
