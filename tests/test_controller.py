"""Tests for rlframe.controller on a real local Ray instance with real torch.distributed (gloo).

The worker classes below are plain classes. Ray ships them to the actors by value (cloudpickle's
register_pickle_by_value), so the actors need not import this test module; they do import rlframe,
which the ray_session fixture (conftest.py) puts on the actors' PYTHONPATH.
"""

import contextlib
import os
import signal
import sys
import time

import pytest
import ray
import torch

from rlframe.controller import (
    Dispatch,
    Future,
    ResourcePool,
    WorkerDied,
    WorkerError,
    WorkerGroup,
    WorkerTimeout,
    register,
)
from rlframe.protocol import DataProto

# --------------------------------------------------------------------------- worker classes


class ActorRole:
    """Stands in for the trainer role of a hybrid engine."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        """Sum of (rank + 1) over all ranks, through torch.distributed."""
        value = torch.tensor([float(torch.distributed.get_rank() + 1)]) * self.scale
        torch.distributed.all_reduce(value)
        return value.item()

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RLFRAME_TEST_ENV"]
        return {"pid": os.getpid(), "threads": torch.get_num_threads(), **{k: os.environ.get(k) for k in keys}}


    @register(Dispatch.ONE_TO_ALL)
    def hold_memory(self, mib: int) -> int:
        """Touch `mib` MiB for the length of the call (freed on return)."""
        block = bytearray(mib * 2**20)
        block[::4096] = b"x" * len(block[::4096])
        return len(block)


class RefRole:
    """Stands in for the reference-model role colocated with ActorRole."""

    @register(Dispatch.ONE_TO_ALL)
    def ref_pid(self) -> int:
        return os.getpid()


class Calc:
    """Exercises every dispatch mode and every failure mode."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_with_rank(self, data: DataProto, offset: int = 0) -> DataProto:
        rank = torch.distributed.get_rank()
        data.batch["rank"] = torch.full((len(data),), rank)
        data.batch["y"] = data.batch["x"] * 2 + offset
        data.non_tensor_batch["who"] = data.non_tensor_batch["name"].copy()
        return data.select(batch_keys=["rank", "y"], non_tensor_keys=["who"])

    @register(Dispatch.DP_COMPUTE_PROTO)
    def count_rows(self, data: DataProto) -> int:
        return len(data)

    @register(Dispatch.ONE_TO_ALL)
    def length(self, data: DataProto) -> int:
        return len(data)

    @register(Dispatch.RANK_ZERO)
    def rank_and_value(self, value):
        return torch.distributed.get_rank(), value

    @register(Dispatch.ALL_TO_ALL)
    def echo(self, item, suffix="") -> tuple:
        return torch.distributed.get_rank(), f"{item}{suffix}"

    @register(Dispatch.ALL_TO_ALL)
    def sleep_for(self, seconds: float) -> int:
        time.sleep(seconds)
        return torch.distributed.get_rank()

    @register(Dispatch.RANK_ZERO)
    def sleep_on_rank_zero(self, seconds: float) -> None:
        time.sleep(seconds)

    @register(Dispatch.ALL_TO_ALL)
    def fail_if(self, should_fail: bool, sleep_s: float = 0.0) -> int:
        if should_fail:
            raise ValueError("deliberate failure in fail_if")
        time.sleep(sleep_s)
        return torch.distributed.get_rank()

    @register(Dispatch.ALL_TO_ALL)
    def kill_self_if(self, should_die: bool) -> int:
        if should_die:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.distributed.get_rank()

    @register(Dispatch.ALL_TO_ALL)
    def die_or_lose_peer(self, should_die: bool) -> int:
        """One rank dies a moment late; the other fails at once as a collective does when its peer is gone."""
        if should_die:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class BrokenRole:
    def __init__(self):
        raise RuntimeError("cannot build this role")


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pair(ray_session):
    """Two ranks, two colocated roles per rank (the hybrid engine shape)."""
    pool = ResourcePool([2], cpus_per_bundle=1, name="pair")
    group = WorkerGroup(
        pool,
        {"actor": (ActorRole, {"scale": 1.0}), "ref": (RefRole, {})},
        name="pair",
        env={"RLFRAME_TEST_ENV": "hello"},
        default_timeout_s=120,
    )
    yield group
    group.shutdown()
    pool.remove()


@pytest.fixture(scope="module")
def quad(ray_session):
    pool = ResourcePool([4], cpus_per_bundle=1, name="quad")
    group = WorkerGroup(pool, {"calc": (Calc, {})}, name="quad", default_timeout_s=120)
    yield group
    group.shutdown()
    pool.remove()


@contextlib.contextmanager
def temporary_group(name: str, world_size: int, roles: dict, **kwargs):
    """A group of its own for tests that break it; actors and reservation are released after."""
    pool = ResourcePool([world_size], cpus_per_bundle=1, name=name)
    try:
        with WorkerGroup(pool, roles, name=name, **kwargs) as group:
            yield group
    finally:
        pool.remove()


def make_rows(n: int) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n)}, non_tensors={"name": [f"row{i}" for i in range(n)]}, meta_info={"k": 1}
    )


# --------------------------------------------------------------------------- without Ray


def test_register_keeps_methods_plain():
    calc = Calc()
    assert Calc.tag_with_rank._rlframe_dispatch is Dispatch.DP_COMPUTE_PROTO
    assert calc.length(make_rows(3)) == 3  # still an ordinary method
    with pytest.raises(TypeError, match="register"):
        register(lambda self: None)


# --------------------------------------------------------------------------- two ranks, colocated roles


def test_all_reduce_across_two_actors(pair):
    assert pair.world_size == 2
    assert pair.actor.all_reduce_rank() == [3.0, 3.0]  # (0 + 1) + (1 + 1) on both ranks


def test_rank_environment(pair):
    info = pair.actor.whoami()
    assert [i["RANK"] for i in info] == ["0", "1"]
    assert [i["LOCAL_RANK"] for i in info] == ["0", "1"]
    assert {i["WORLD_SIZE"] for i in info} == {"2"}
    assert len({(i["MASTER_ADDR"], i["MASTER_PORT"]) for i in info}) == 1
    assert {i["RLFRAME_TEST_ENV"] for i in info} == {"hello"}
    assert {i["threads"] for i in info} == {1}  # torch threads = CPUs of the bundle


def test_colocated_roles_share_the_process(pair):
    actor_pids = [i["pid"] for i in pair.actor.whoami()]
    ref_pids = pair.role("ref").ref_pid()
    assert actor_pids == ref_pids and len(set(actor_pids)) == 2
    with pytest.raises(AttributeError, match="ref_pid"):
        pair.actor.ref_pid
    with pytest.raises(AttributeError, match="whoami"):
        pair.ref.whoami
    with pytest.raises(KeyError):
        pair.role("critic")


# --------------------------------------------------------------------------- dispatch modes on four ranks


def test_memory_peaks_per_call_are_reset_between_reads(pair):
    """Each (role, method)'s peak RSS is the call's own: 400 MiB held inside one call shows in its peak,
    and after the read the next peak starts from the current RSS again."""
    pair.memory_peaks()  # forget earlier calls
    pair.actor.hold_memory(0)
    baseline = pair.memory_peaks()["rss/actor.hold_memory"]
    pair.actor.hold_memory(400)
    pair.ref.ref_pid()
    peaks = pair.memory_peaks()
    assert peaks["rss/actor.hold_memory"] > baseline + 0.35  # GiB: 400 MiB = 0.39 GiB
    assert peaks["rss/ref.ref_pid"] < peaks["rss/actor.hold_memory"] - 0.3  # the block is gone again
    pair.actor.hold_memory(0)
    assert pair.memory_peaks()["rss/actor.hold_memory"] < baseline + 0.1
    assert pair.memory_peaks() == {}


def test_dp_compute_proto_keeps_rows_and_order(quad):
    data = make_rows(10)  # padded to 12, 3 rows per rank
    out = quad.calc.tag_with_rank(data, offset=5)
    assert len(out) == 10
    assert out.batch["y"].tolist() == [2 * i + 5 for i in range(10)]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert out.non_tensor_batch["who"].tolist() == [f"row{i}" for i in range(10)]
    assert len(data) == 10 and "rank" not in data  # the caller's batch is untouched
    # Non-DataProto results come back per rank: the chunk sizes after padding.
    assert quad.calc.count_rows(data) == [3, 3, 3, 3]


def test_one_to_all_broadcasts(quad):
    assert quad.calc.length(make_rows(7)) == [7, 7, 7, 7]


def test_rank_zero(quad):
    assert quad.calc.rank_and_value("v") == (0, "v")


def test_all_to_all(quad):
    assert quad.calc.echo(["a", "b", "c", "d"], suffix="!") == [(0, "a!"), (1, "b!"), (2, "c!"), (3, "d!")]
    with pytest.raises(ValueError, match="one element per rank"):
        quad.calc.echo(["a", "b"])


def test_non_blocking_futures(quad):
    start = time.monotonic()
    first = quad.calc.sleep_for([1.0] * 4, _blocking=False)
    second = quad.calc.tag_with_rank(make_rows(6), _blocking=False)
    assert isinstance(first, Future) and not first.done()
    assert time.monotonic() - start < 1.0  # submitting did not wait
    assert first.result() == [0, 1, 2, 3]
    assert second.result().batch["y"].tolist() == [0, 2, 4, 6, 8, 10]
    assert first.done() and first.result() == [0, 1, 2, 3]  # result is cached


def test_worker_exception_reaches_driver_at_once(quad):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        # rank 2 fails at once while the others work for 3 s: the error must not wait for them.
        quad.calc.fail_if([False, False, True, False], sleep_s=3.0)
    assert time.monotonic() - start < 2.5
    error = info.value
    assert type(error) is WorkerError and error.rank == 2 and error.method == "fail_if"
    text = str(error)
    assert "rank=2" in text and "fail_if" in text and "role='calc'" in text
    assert "deliberate failure in fail_if" in text and "Traceback" in text and "ValueError" in text
    assert error.node_ip and error.pid
    quad.calc.sleep_for([0.0] * 4)  # the group still works afterwards (once the sleepers are done)


# --------------------------------------------------------------------------- deadlines and dead workers


def test_timeout_names_the_slow_rank(ray_session):
    with temporary_group("slow", 2, {"calc": (Calc, {})}) as group:
        start = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            group.calc.sleep_for([0.0, 60.0], _timeout=2)
        assert time.monotonic() - start < 5
        assert info.value.ranks == [1]
        text = str(info.value)
        assert "calc.sleep_for" in text and "rank=1" in text and "[1]" in text and "2s" in text


@pytest.mark.timeout(120)
def test_killed_worker_raises_worker_died(ray_session):
    with temporary_group("doomed", 2, {"calc": (Calc, {})}, default_timeout_s=60) as group:
        pid_of_rank0 = group.rank_info(0).pid
        assert group.calc.pid()[0] == pid_of_rank0

        # Rank 1 SIGKILLs itself inside a method.
        start = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            group.calc.kill_self_if([False, True])
        assert time.monotonic() - start < 30
        assert info.value.rank == 1 and info.value.method == "kill_self_if"
        assert "rank=1" in str(info.value) and "kill_self_if" in str(info.value)

        # Rank 0 is killed from outside while it sleeps.
        future = group.calc.rank_and_value("x", _blocking=False)  # warm: rank 0 answers
        assert future.result() == (0, "x")
        sleeping = group.calc.sleep_on_rank_zero(60.0, _blocking=False)
        time.sleep(0.5)
        os.kill(pid_of_rank0, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            sleeping.result()
        assert time.monotonic() - start < 30
        assert info.value.rank == 0 and f"pid={pid_of_rank0}" in str(info.value)


@pytest.mark.timeout(120)
def test_a_peer_failure_names_the_rank_that_died(ray_session):
    """Rank 0's collective fails ("Connection reset by peer") before Ray reports that rank 1 died: the error
    names the dead rank (WorkerDied, which trainer.max_restarts restarts from), not the survivor."""
    with temporary_group("peers", 2, {"calc": (Calc, {})}, default_timeout_s=60) as group:
        with pytest.raises(WorkerDied) as info:
            group.calc.die_or_lose_peer([False, True])
        assert info.value.rank == 1 and info.value.method == "die_or_lose_peer"


def test_failing_role_constructor(ray_session):
    with pytest.raises(WorkerError) as info:
        with temporary_group("broken", 1, {"ok": (RefRole, {}), "broken": (BrokenRole, {})}, default_timeout_s=60):
            pass
    assert info.value.role == "broken" and info.value.method == "__init__"
    assert "cannot build this role" in str(info.value)


def test_pool_shortage_is_explained(ray_session):
    pool = ResourcePool([2], cpus_per_bundle=64, name="huge", ready_timeout_s=1)
    with pytest.raises(RuntimeError, match="CPU: need 128.*short"):
        pool.bundles()


def test_groups_started_side_by_side(ray_session):
    """wait=False: both groups' actors are asked for first, each init is sent once its ranks run, then both are
    waited for (launch.py starts independent roles so); the start-up times are kept per group."""
    pools = [ResourcePool([1], cpus_per_bundle=1, name=f"side{i}") for i in range(2)]
    groups = [WorkerGroup(pool, {"actor": (ActorRole, {"scale": 2.0})}, name=f"side{i}", wait=False)
              for i, pool in enumerate(pools)]
    try:
        assert all("init" not in g.startup_times for g in groups)  # nothing waited for yet
        for group in groups:
            group.begin_init()
        for group in groups:
            group.wait_started()
        for group in groups:
            times = group.startup_times
            assert times["spawn"] > 0 and times["init"] > 0 and "process_group" in times["ranks"][0]
            assert group.actor.all_reduce_rank() == [2.0]
    finally:
        for group in groups:
            group.shutdown()
        for pool in pools:
            pool.remove()
    # (its CPU asked for once the two above are given back: the module's other tests hold some of the 8)
    late_pool = ResourcePool([1], cpus_per_bundle=1, name="late")
    late = WorkerGroup(late_pool, {"actor": (ActorRole, {})}, name="late", wait=False, default_timeout_s=120)
    try:  # a call on a group not yet waited for waits for its start first
        assert late.actor.all_reduce_rank() == [1.0] and "init" in late.startup_times
    finally:
        late.shutdown()
        late_pool.remove()
