"""The single-controller runtime: resource pools, worker groups and dispatch modes on Ray."""

from rlframe.controller.dispatch import Dispatch, register
from rlframe.controller.errors import WorkerDied, WorkerError, WorkerTimeout
from rlframe.controller.resource_pool import ResourcePool
from rlframe.controller.worker_group import Future, RoleHandle, WorkerGroup
from rlframe.controller.worker_host import WorkerHost, process_group_backend

__all__ = [
    "Dispatch",
    "Future",
    "ResourcePool",
    "RoleHandle",
    "WorkerDied",
    "WorkerError",
    "WorkerGroup",
    "WorkerHost",
    "WorkerTimeout",
    "process_group_backend",
    "register",
]
