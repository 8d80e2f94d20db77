"""Errors that reach the driver when a worker fails, hangs or dies.

Every error names where it happened (role, rank, node, pid, method) so that a failure in a group
of many actors points at one process, and carries the worker's own traceback text.
"""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A method raised inside a worker. ``str()`` names the worker and includes its traceback."""

    def __init__(
        self,
        summary: str,
        *,
        role: str | None = None,
        rank: int | None = None,
        node_ip: str | None = None,
        hostname: str | None = None,
        pid: int | None = None,
        method: str | None = None,
        remote_traceback: str | None = None,
    ):
        super().__init__(summary)
        self.summary = summary
        self.role = role
        self.rank = rank
        self.node_ip = node_ip
        self.hostname = hostname
        self.pid = pid
        self.method = method
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        # Keep the keyword fields when the error is pickled across Ray's process boundary.
        return (_rebuild_error, (type(self), self.summary, dict(self.__dict__)))

    def where(self) -> str:
        return describe_worker(self.role, self.rank, self.node_ip, self.hostname, self.pid)

    def __str__(self) -> str:
        text = f"{self.summary} [{self.where()}, method={self.method!r}]"
        if self.remote_traceback:
            text += "\n--- traceback in the worker ---\n" + self.remote_traceback.rstrip()
        return text


class WorkerTimeout(WorkerError):
    """A call did not finish before its deadline; ``ranks`` lists the ranks still running."""

    def __init__(self, summary: str, *, ranks: list[int] | None = None, **fields):
        super().__init__(summary, **fields)
        self.ranks = list(ranks or [])

    def __str__(self) -> str:
        return self.summary


class WorkerDied(WorkerError):
    """The worker's process died (killed, out of memory, segfault) while running a call."""


def describe_worker(role, rank, node_ip, hostname, pid) -> str:
    return f"role={role!r} rank={rank} node={node_ip} ({hostname}) pid={pid}"


def _rebuild_error(cls, summary: str, fields: dict) -> WorkerError:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, summary)
    error.__dict__.update(fields)
    return error
