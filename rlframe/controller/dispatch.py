"""Dispatch modes: how the driver splits one call across the ranks and joins the results.

A worker method declares its mode with ``@register``::

    class ActorWorker:
        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: DataProto) -> DataProto: ...

On the driver, ``group.actor.compute_log_prob(batch)`` then pads ``batch`` to a multiple of the
world size, sends one chunk to each rank, concatenates the returned chunks in rank order and drops
the padding. The method itself stays an ordinary method: calling it on a plain object works too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlframe.protocol import DataProto

DISPATCH_ATTR = "_rlframe_dispatch"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; returns the list of results
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProto arguments split across ranks; results joined
    RANK_ZERO = "rank_zero"  # only rank 0 runs; returns its result
    ALL_TO_ALL = "all_to_all"  # each positional argument is a per-rank list; returns the list of results


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL) -> Callable:
    """Method decorator that records the dispatch mode on the function (nothing else changes)."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register() takes a Dispatch mode, got {dispatch!r} (write @register(), not @register)")

    def decorate(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, dispatch)
        return fn

    return decorate


def dispatch_mode(fn: Callable) -> Dispatch:
    """The mode a method was registered with (ONE_TO_ALL when it was not decorated)."""
    return getattr(fn, DISPATCH_ATTR, Dispatch.ONE_TO_ALL)


@dataclass
class Plan:
    """What to send where: ``calls[i] = (rank, args, kwargs)``, and how to join the results."""

    calls: list[tuple[int, tuple, dict]]
    collect: Callable[[list[Any]], Any]


def plan_call(mode: Dispatch, world_size: int, args: tuple, kwargs: dict) -> Plan:
    if mode is Dispatch.ONE_TO_ALL:
        return Plan([(rank, args, kwargs) for rank in range(world_size)], list)
    if mode is Dispatch.RANK_ZERO:
        return Plan([(0, args, kwargs)], lambda results: results[0])
    if mode is Dispatch.ALL_TO_ALL:
        return _plan_all_to_all(world_size, args, kwargs)
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return _plan_dp_compute_proto(world_size, args, kwargs)
    raise ValueError(f"unknown dispatch mode {mode!r}")


def _plan_all_to_all(world_size: int, args: tuple, kwargs: dict) -> Plan:
    """Rank i gets element i of every positional argument; keyword arguments go to every rank."""
    for position, value in enumerate(args):
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            raise ValueError(
                f"ALL_TO_ALL positional argument {position} must be a list with one element per rank "
                f"(world size {world_size}), got {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
            )
    calls = [(rank, tuple(a[rank] for a in args), kwargs) for rank in range(world_size)]
    return Plan(calls, list)


def _plan_dp_compute_proto(world_size: int, args: tuple, kwargs: dict) -> Plan:
    """Pad every DataProto argument to a multiple of world_size and give rank i chunk i.

    Non-DataProto arguments go to every rank unchanged. DataProto results are concatenated in rank
    order and unpadded, so the caller gets the same rows in the same order it sent; other results
    come back as the per-rank list.
    """
    lengths = {len(v) for v in [*args, *kwargs.values()] if isinstance(v, DataProto)}
    if not lengths:
        raise TypeError("a DP_COMPUTE_PROTO method needs at least one DataProto argument")
    if len(lengths) > 1:
        raise ValueError(f"DataProto arguments of a DP_COMPUTE_PROTO call differ in length: {sorted(lengths)}")
    pad_size = -lengths.pop() % world_size

    def split(value):
        if isinstance(value, DataProto):
            return value.pad_to_divisor(world_size)[0].chunk(world_size)
        return [value] * world_size

    split_args = [split(a) for a in args]
    split_kwargs = {k: split(v) for k, v in kwargs.items()}
    calls = [
        (rank, tuple(a[rank] for a in split_args), {k: v[rank] for k, v in split_kwargs.items()})
        for rank in range(world_size)
    ]

    def collect(results: list[Any]) -> Any:
        if all(isinstance(r, DataProto) for r in results):
            return DataProto.concat(results).unpad(pad_size)
        return results

    return Plan(calls, collect)
