"""ResourcePool: the slots (bundles) that a worker group's actors occupy, as Ray placement groups.

One placement group per node entry, with strategy STRICT_PACK, so the bundles of one entry land on
one node (their ranks can share memory or NVLink). A bundle is one device: a GPU, or a few CPU
cores on a CPU machine. Ranks are numbered node entry by node entry, bundle by bundle.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


class ResourcePool:
    """Reserve ``bundles_per_node[i]`` bundles on node entry i.

    Args:
        bundles_per_node: bundles for each node, e.g. ``[8, 8]`` for two 8-GPU nodes.
        cpus_per_bundle / gpus_per_bundle: resources of each bundle.
        name: prefix of the placement group names (shows up in ``ray status``).
        node_resources: optional extra Ray resources per node entry, added to each of its bundles
            (e.g. ``[{"node:10.0.0.2": 0.001}]`` pins the entry to that node).
        node_labels: optional Ray label selector per node entry, applied to each of its bundles
            (e.g. ``[{"ray.io/node-id": node_id}]`` pins the entry to that node by id).
        ready_timeout_s: how long to wait for Ray to grant the reservation.

    Placement groups are created on first use (``bundles()``), so a pool can be built before Ray
    starts.
    """

    def __init__(
        self,
        bundles_per_node: list[int],
        cpus_per_bundle: float = 1,
        gpus_per_bundle: float = 0,
        name: str = "pool",
        node_resources: list[dict] | None = None,
        ready_timeout_s: float = 120,
        node_labels: list[dict] | None = None,
    ):
        if not bundles_per_node or any(n <= 0 for n in bundles_per_node):
            raise ValueError(f"bundles_per_node must be a non-empty list of positive ints, got {bundles_per_node}")
        if node_resources is not None and len(node_resources) != len(bundles_per_node):
            raise ValueError("node_resources needs one dict per entry of bundles_per_node")
        self.bundles_per_node = list(bundles_per_node)
        self.cpus_per_bundle = cpus_per_bundle
        self.gpus_per_bundle = gpus_per_bundle
        self.name = name
        self.node_resources = node_resources or [{} for _ in bundles_per_node]
        if node_labels is not None and len(node_labels) != len(bundles_per_node):
            raise ValueError("node_labels needs one dict per entry of bundles_per_node")
        self.node_labels = node_labels
        self.ready_timeout_s = ready_timeout_s
        self._placement_groups: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.bundles_per_node)

    def bundle_resources(self, node_index: int) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_bundle}
        if self.gpus_per_bundle:
            bundle["GPU"] = self.gpus_per_bundle
        bundle.update(self.node_resources[node_index])
        return bundle

    def bundles(self) -> list[tuple[PlacementGroup, int]]:
        """``(placement_group, bundle_index)`` for every rank, in rank order."""
        placement_groups = self._create()
        return [(pg, i) for pg, n in zip(placement_groups, self.bundles_per_node) for i in range(n)]

    def local_ranks(self) -> list[tuple[int, int]]:
        """``(local_rank, local_world_size)`` for every rank: its position within its node entry."""
        return [(i, n) for n in self.bundles_per_node for i in range(n)]

    def remove(self) -> None:
        """Release the reservation (actors still running in it are killed by Ray)."""
        for pg in self._placement_groups or []:
            remove_placement_group(pg)
        self._placement_groups = None

    def _create(self) -> list[PlacementGroup]:
        if self._placement_groups is None:
            placement_groups = [
                placement_group(
                    [self.bundle_resources(i)] * n, strategy="STRICT_PACK", name=f"{self.name}_{i}",
                    **({"bundle_label_selector": [dict(self.node_labels[i])] * n} if self.node_labels else {}),
                )
                for i, n in enumerate(self.bundles_per_node)
            ]
            self._placement_groups = placement_groups
            self._wait_ready(placement_groups)
        return self._placement_groups

    def _wait_ready(self, placement_groups: list[PlacementGroup]) -> None:
        ready, _ = ray.wait([pg.ready() for pg in placement_groups], num_returns=len(placement_groups),
                            timeout=self.ready_timeout_s)
        if len(ready) == len(placement_groups):
            return
        self.remove()
        raise RuntimeError(self._shortage_message())

    def _shortage_message(self) -> str:
        """Say which resource is short: what was asked for against what the cluster has."""
        wanted: dict[str, float] = {}
        for i, n in enumerate(self.bundles_per_node):
            for key, amount in self.bundle_resources(i).items():
                wanted[key] = wanted.get(key, 0) + amount * n
        total, free = ray.cluster_resources(), ray.available_resources()
        lines = [
            f"resource pool {self.name!r} could not be placed within {self.ready_timeout_s:.0f}s "
            f"({self.bundles_per_node} bundles of {self.bundle_resources(0)}, each node entry on one node)."
        ]
        for key, amount in wanted.items():
            if amount > total.get(key, 0):
                short = " <- short: the cluster does not have this much"
            elif amount > free.get(key, 0):
                short = " <- short: held by other pools or actors"
            else:
                short = ""
            lines.append(f"  {key}: need {amount:g}, cluster total {total.get(key, 0):g}, free {free.get(key, 0):g}{short}")
        biggest = max((n for n in self.bundles_per_node), default=0)
        lines.append(f"  note: STRICT_PACK needs one node with room for {biggest} bundles of this pool.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ResourcePool(name={self.name!r}, bundles_per_node={self.bundles_per_node}, "
                f"cpus_per_bundle={self.cpus_per_bundle}, gpus_per_bundle={self.gpus_per_bundle})")
