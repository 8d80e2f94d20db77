"""WorkerGroup: N Ray actors (one per bundle of a ResourcePool) that act as one object.

    pool = ResourcePool([4], cpus_per_bundle=1)
    group = WorkerGroup(pool, {"actor": (ActorWorker, {"config": cfg}), "ref": (RefWorker, {})})
    log_probs = group.actor.compute_log_prob(batch)          # DP_COMPUTE_PROTO: split and joined
    future = group.ref.compute_ref_log_prob(batch, _blocking=False)
    ref_log_probs = future.result()

Every call waits with a deadline (``_timeout``, default the group's ``default_timeout_s``). The
first failing rank raises at once (WorkerError); a dead process raises WorkerDied; a call past its
deadline raises WorkerTimeout naming the ranks still running. Nothing waits forever unless asked
to (``_timeout=None``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlframe.controller.dispatch import Dispatch, Plan, dispatch_mode, plan_call
from rlframe.controller.errors import WorkerDied, WorkerError, WorkerTimeout, describe_worker
from rlframe.controller.resource_pool import ResourcePool
from rlframe.controller.worker_host import _WorkerHost
from rlframe.protocol import DataProto

_GROUP_DEFAULT = object()  # sentinel: "use the group's default timeout"
PEER_DEATH_GRACE_S = 5.0  # how long a rank's failed collective waits for the others to show whether one died
PEER_FAILURE_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL error")


def looks_like_peer_failure(error: WorkerError) -> bool:
    """A collective that failed because another rank went away (gloo / NCCL), not this rank's own error."""
    text = str(error)
    return any(sign in text for sign in PEER_FAILURE_SIGNS)


@dataclass
class RankInfo:
    """Where one rank runs; filled at startup so that errors can name it even after it died."""

    rank: int
    node_ip: str | None = None
    hostname: str | None = None
    pid: int | None = None

    def describe(self, role: str) -> str:
        return describe_worker(role, self.rank, self.node_ip, self.hostname, self.pid)


class Future:
    """The pending result of a group call; ``result()`` waits (up to the call's deadline) and joins."""

    def __init__(self, group: WorkerGroup, role: str, method: str, refs: dict[int, ray.ObjectRef],
                 collect: Callable[[list[Any]], Any], timeout_s: float | None):
        self._group, self._role, self._method = group, role, method
        self._refs = refs  # rank -> ObjectRef
        self._collect = collect
        self._started = time.monotonic()
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else self._started + timeout_s
        self._value: Any = None
        self._finished = False

    def done(self) -> bool:
        """True when every rank has finished (successfully or not); never blocks."""
        ready, _ = ray.wait(list(self._refs.values()), num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def result(self) -> Any:
        if not self._finished:
            results = self._wait_all()
            self._value = self._collect([results[rank] for rank in sorted(results)])
            self._finished = True
        return self._value

    def _wait_all(self) -> dict[int, Any]:
        """Collect every rank's result, raising at the first failure or at the deadline."""
        pending = {ref: rank for rank, ref in self._refs.items()}
        results: dict[int, Any] = {}
        while pending:
            remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if not ready:
                raise self._timeout_error(sorted(pending.values()))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = self._get(ref, rank)
                except WorkerDied:
                    raise
                except WorkerError as error:
                    if not (pending and looks_like_peer_failure(error)):
                        raise
                    raise self._root_cause(error, pending) from None
        return results

    def _root_cause(self, error: WorkerError, pending: dict) -> WorkerError:
        """A rank whose peer died fails in its collective ("Connection reset by peer") a moment before Ray
        reports the death: wait briefly for the other ranks, and name the one that died if one did."""
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
        for ref in ready:
            try:
                self._get(ref, pending[ref])
            except WorkerDied as died:
                return died
            except WorkerError:
                pass
        return error

    def _get(self, ref: ray.ObjectRef, rank: int) -> Any:
        """ray.get one rank's result, turning Ray's errors into WorkerError / WorkerDied."""
        info = self._group.rank_info(rank)
        fields = dict(role=self._role, rank=rank, node_ip=info.node_ip, hostname=info.hostname,
                      pid=info.pid, method=self._method)
        try:
            return ray.get(ref)
        except RayTaskError as error:
            if isinstance(error.cause, WorkerError):
                raise error.cause from None
            raise WorkerError(f"{type(error.cause).__name__}: {error.cause}", remote_traceback=str(error),
                              **fields) from None
        except RayActorError as error:
            raise WorkerDied(f"worker process died while running {self._role}.{self._method}",
                             remote_traceback=str(error), **fields) from None
        except RayError as error:
            raise WorkerError(f"{type(error).__name__} while running {self._role}.{self._method}",
                              remote_traceback=str(error), **fields) from None

    def _timeout_error(self, ranks: list[int]) -> WorkerTimeout:
        waited = time.monotonic() - self._started
        running = "\n".join(f"  {self._group.rank_info(r).describe(self._role)}" for r in ranks)
        info = self._group.rank_info(ranks[0])
        return WorkerTimeout(
            f"{self._role}.{self._method} did not finish within its deadline of {self._timeout_s:g}s "
            f"(waited {waited:.1f}s); ranks still running: {ranks}\n{running}\n"
            "Raise the deadline with _timeout=..., or look at these ranks (py-spy dump --pid on their node); "
            "the group may be stuck and is best shut down.",
            ranks=ranks, role=self._role, rank=ranks[0], node_ip=info.node_ip, hostname=info.hostname,
            pid=info.pid, method=self._method,
        )


class RoleHandle:
    """One role of a WorkerGroup. ``handle.some_method(...)`` calls it on the ranks.

    The dispatch mode comes from the method's ``@register`` on the role class (looked up here, on
    the driver). Keyword-only control arguments, removed before the call:
    ``_blocking`` (default True; False returns a Future) and ``_timeout`` (seconds, None = no deadline).
    """

    def __init__(self, group: WorkerGroup, name: str, cls: type):
        self._group, self._name, self._cls = group, name, cls

    def __getattr__(self, method: str) -> Callable:
        fn = getattr(self._cls, method, None) if not method.startswith("_") else None
        if not callable(fn):
            public = sorted(m for m in dir(self._cls) if not m.startswith("_") and callable(getattr(self._cls, m)))
            raise AttributeError(f"role {self._name!r} ({self._cls.__qualname__}) has no method {method!r}; "
                                 f"it has: {public}")
        mode = dispatch_mode(fn)

        def group_method(*args, _blocking: bool = True, _timeout: Any = _GROUP_DEFAULT, **kwargs):
            return self._group._call(self._name, method, mode, args, kwargs, _blocking, _timeout)

        group_method.__name__ = method
        group_method.__qualname__ = f"{self._name}.{method}"
        group_method.__doc__ = fn.__doc__
        return group_method

    def __repr__(self) -> str:
        return f"RoleHandle({self._name!r}, {self._cls.__qualname__}, world_size={self._group.world_size})"


class WorkerGroup:
    """Start one ``_WorkerHost`` actor per bundle of ``pool`` and build ``roles`` in each.

    Args:
        pool: where the actors go; rank i takes bundle i.
        roles: ``{role_name: (cls, kwargs)}``; each host builds ``cls(**kwargs)`` for every role,
            after ``torch.distributed.init_process_group``. Classes must be importable (or
            picklable) in the actor processes.
        backend: process group backend ("gloo" on CPU, "nccl" on GPU); None skips the process group.
        name: shown in the actors' log prefixes and in errors.
        env: environment variables for every actor (Ray runtime_env env_vars).
        default_timeout_s: deadline for calls that do not pass ``_timeout`` (None = wait forever);
            also the deadline of startup and of torch.distributed collectives.
        wait: False returns once the actors are asked for: ``begin_init()`` then ``wait_started()`` finish the
            start (several groups so start side by side); a call before that waits for the start first.
    """

    def __init__(self, pool: ResourcePool, roles: dict[str, tuple[type, dict]], *, backend: str | None = "gloo",
                 name: str = "rlframe", env: dict[str, str] | None = None, default_timeout_s: float | None = 600,
                 wait: bool = True):
        if not roles:
            raise ValueError("a WorkerGroup needs at least one role")
        self.pool = pool
        self.roles = dict(roles)
        self.backend = backend
        self.name = name
        self.env = dict(env or {})
        self.default_timeout_s = default_timeout_s
        self.world_size = pool.world_size
        self._rank_infos = [RankInfo(rank) for rank in range(self.world_size)]
        # how long the start took: {"spawn": s, "init": s, "ranks": [each rank's init parts (WorkerHost.init_roles)]}
        self.startup_times: dict = {}
        self._spawn_started = time.perf_counter()
        self._init_future: Future | None = None
        self._hosts = self._spawn_hosts()
        if wait:
            try:
                self._start()
            except BaseException:
                self.shutdown()
                raise

    # ------------------------------------------------------------------ startup

    def _spawn_hosts(self) -> list:
        runtime_env = {"env_vars": {k: str(v) for k, v in self.env.items()}} if self.env else None
        hosts = []
        for rank, ((pg, bundle_index), (local_rank, local_world_size)) in enumerate(
            zip(self.pool.bundles(), self.pool.local_ranks())
        ):
            options = dict(
                num_cpus=self.pool.cpus_per_bundle,
                num_gpus=self.pool.gpus_per_bundle,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
            )
            if runtime_env:
                options["runtime_env"] = runtime_env
            hosts.append(_WorkerHost.options(**options).remote(
                rank, self.world_size, local_rank, local_world_size, self.pool.cpus_per_bundle, self.name, list(self.roles)
            ))
        return hosts

    def _start(self) -> None:
        """Learn where each rank runs, then init the process group and build the roles everywhere."""
        self.begin_init()
        self.wait_started()

    def begin_init(self) -> None:
        """Wait until every rank runs, then send each its init (process group, roles) without waiting for it: the
        caller may start other groups meanwhile and then `wait_started()` (launch.py starts independent groups so)."""
        if self._init_future is not None:
            return
        timeout = self.default_timeout_s
        try:
            infos = self._submit("<host>", "info", [(r, h.info.remote()) for r, h in enumerate(self._hosts)],
                                 list, timeout).result()
        except WorkerTimeout as error:
            error.summary += (
                "\nThe actors did not start in time. If the pool's bundles are already taken by another "
                "WorkerGroup, colocate the roles in one group instead (roles={...}); otherwise check "
                "`ray status` for pending actors."
            )
            raise
        for info in infos:
            self._rank_infos[info["rank"]] = RankInfo(info["rank"], info["node_ip"], info["hostname"], info["pid"])
        self._init_started = time.perf_counter()
        self.startup_times["spawn"] = self._init_started - self._spawn_started
        master_addr, master_port = infos[0]["node_ip"], infos[0]["master_port"]
        refs = [
            (rank, host.init_roles.remote(master_addr, master_port, self.backend, self.roles, timeout))
            for rank, host in enumerate(self._hosts)
        ]
        self._init_future = self._submit("<host>", "__init__", refs, list, timeout)

    def wait_started(self) -> None:
        """Until every rank has built its roles (after `begin_init`); a failure shuts the group down and raises."""
        if "init" in self.startup_times:
            return
        try:
            self.begin_init()
            self.startup_times["ranks"] = self._init_future.result()
        except BaseException:
            self.shutdown()
            raise
        self.startup_times["init"] = time.perf_counter() - self._init_started

    # ------------------------------------------------------------------ calls

    def role(self, name: str) -> RoleHandle:
        if name not in self.roles:
            raise KeyError(f"worker group {self.name!r} has no role {name!r}; roles: {list(self.roles)}")
        return RoleHandle(self, name, self.roles[name][0])

    def __getattr__(self, name: str) -> RoleHandle:
        roles = self.__dict__.get("roles", {})
        if name in roles:
            return self.role(name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute or role {name!r}")

    def rank_info(self, rank: int) -> RankInfo:
        return self._rank_infos[rank]

    def _call(self, role: str, method: str, mode: Dispatch, args: tuple, kwargs: dict,
              blocking: bool, timeout: Any) -> Any:
        if not self._hosts:
            raise RuntimeError(f"worker group {self.name!r} has been shut down")
        self.wait_started()
        timeout = self.default_timeout_s if timeout is _GROUP_DEFAULT else timeout
        plan: Plan = plan_call(mode, self.world_size, args, kwargs)
        shared: dict[int, Any] = {}
        refs = [
            (rank, self._hosts[rank].execute.remote(
                role, method, *_share(a, shared), **dict(zip(k, _share(k.values(), shared)))))
            for rank, a, k in plan.calls
        ]
        future = self._submit(role, method, refs, plan.collect, timeout)
        return future.result() if blocking else future

    def _submit(self, role: str, method: str, refs: list[tuple[int, ray.ObjectRef]],
                collect: Callable, timeout: float | None) -> Future:
        return Future(self, role, method, dict(refs), collect, timeout)

    def memory_peaks(self, timeout: float | None = 60) -> dict[str, float]:
        """The peak memory of each (role, method) called since the last read, the largest over the ranks
        (see ``WorkerHost.memory_peaks``), in GiB."""
        per_rank = self._submit("<host>", "memory_peaks",
                                [(r, h.memory_peaks.remote()) for r, h in enumerate(self._hosts)], list, timeout).result()
        peaks: dict[str, float] = {}
        for found in per_rank:
            for key, value in found.items():
                peaks[key] = max(value, peaks.get(key, 0.0))
        return peaks

    # ------------------------------------------------------------------ teardown

    def shutdown(self) -> None:
        """Kill the actors (the pool's reservation stays; ``pool.remove()`` releases it)."""
        for host in self._hosts:
            ray.kill(host, no_restart=True)
        self._hosts = []

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup(name={self.name!r}, world_size={self.world_size}, roles={list(self.roles)})"


def _share(values, shared: dict[int, Any]) -> list:
    """Put each DataProto / tensor argument into Ray's object store once, however many ranks get it.

    Ray resolves ObjectRefs passed as top-level arguments, so the worker still receives the value.
    """
    out = []
    for value in values:
        if isinstance(value, (DataProto, torch.Tensor)):
            if id(value) not in shared:
                shared[id(value)] = (value, ray.put(value))  # keep value alive so id() stays unique
            value = shared[id(value)][1]
        out.append(value)
    return out
