"""Where worker groups run: pools of device slots handed out node by node.

    plans = plan_pools([("actor", 4), ("rollout", 2)], nnodes=2, devices_per_node=4)
    pools = [make_pool(plan, request, chosen_nodes) for plan in plans]

Devices are handed out node by node in the order the pools are asked for: with 2 nodes of 4
devices and pools of 4 + 2 the first pool fills node 0 and the second takes 2 slots of node 1.
A pool's bundles on one node form one STRICT_PACK placement group pinned to that node, by the
custom resource `request.node_resources[i]` when given, else (several nodes) by Ray node id.
One node is the plain case of the same plan: one pool, unpinned.

Generic: this module knows resource pools and nodes, not which roles go where (the driver's
`rlframe/trainer/launch.py` decides that).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlframe.controller.cluster import ClusterRequest, NodeInfo
from rlframe.controller.resource_pool import ResourcePool

NODE_ID_LABEL = "ray.io/node-id"
PIN_AMOUNT = 0.001  # of a node's custom resource, per bundle: pins without using it up


@dataclass
class PoolPlan:
    name: str
    bundles_per_node: list[int]  # bundles on each node entry that the pool uses
    node_indices: list[int]  # which of the run's nodes each entry is

    @property
    def world_size(self) -> int:
        return sum(self.bundles_per_node)


def plan_pools(pool_sizes: list[tuple[str, int]], nnodes: int, devices_per_node: int) -> list[PoolPlan]:
    """Hand out device slots node by node, to the pools in the order given."""
    slots = [node for node in range(nnodes) for _ in range(devices_per_node)]
    plans, start = [], 0
    for name, size in pool_sizes:
        taken = slots[start: start + size]
        start += size
        nodes = sorted(set(taken))
        plans.append(PoolPlan(name, [taken.count(n) for n in nodes], nodes))
    return plans


def make_pool(plan: PoolPlan, request: ClusterRequest, nodes: list[NodeInfo]) -> ResourcePool:
    """The placement groups of `plan`; `nodes`: the run's nodes as `check_cluster` chose them."""
    kwargs = {}
    if request.node_resources:
        kwargs["node_resources"] = [{request.node_resources[i]: PIN_AMOUNT} for i in plan.node_indices]
    elif request.nnodes > 1:
        kwargs["node_labels"] = [{NODE_ID_LABEL: nodes[i].node_id} for i in plan.node_indices]
    return ResourcePool(plan.bundles_per_node, cpus_per_bundle=request.unit["CPU"],
                        gpus_per_bundle=request.unit.get("GPU", 0), name=plan.name, **kwargs)


__all__ = ["NODE_ID_LABEL", "PoolPlan", "make_pool", "plan_pools"]
