"""Giving a CPU process's memory back to the OS without moving any tensor.

    release_host_pages(tensors)          # the pages read as zeros until written again
    release_file_mapped_pages(tensors)   # unwritten file-mapped pages only: they read back from the file

Both call madvise(MADV_DONTNEED) over the whole pages inside each tensor's storage; a storage's partial
first and last pages (shared with neighbouring allocations) are left alone, and a storage seen twice
(views) counts once. They return the bytes released.

- `release_host_pages` is the CPU form of vLLM's GPU sleep (workers/rollout/vllm_rollout.py): the
  engine's KV cache, and its weights when a weight load follows, leave the process between
  generations while every tensor, and every kernel holding a raw pointer to one, stays valid.
- `release_file_mapped_pages` is for weights that are a private mapping of a model file (safetensors
  loads an fp32 checkpoint that way when no conversion is needed): the reference policy's weights are
  read once per step, so between its passes the process drops its mapping of those pages; they stay in
  the OS page cache (reclaimable) and map back on the next read. Anything else is skipped, since
  dropping it would lose data: anonymous memory, shared mappings, and any range with a page that was
  written since it was mapped (the kernel's page map shows it as anonymous then).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
from collections.abc import Iterable, Iterator

import torch

MADV_DONTNEED = 4  # Linux <sys/mman.h>
_PAGE = mmap.PAGESIZE


def _madvise():
    madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _page_ranges(tensors: Iterable[torch.Tensor | None]) -> Iterator[tuple[int, int]]:
    """[start, end) of the whole pages inside each distinct CPU storage."""
    seen = set()
    for tensor in tensors:
        if tensor is None or tensor.device.type != "cpu":
            continue
        if hasattr(tensor, "to_local"):  # an FSDP2 (DTensor) parameter: its local shard holds the memory
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if pointer in seen:
            continue
        seen.add(pointer)
        start, end = -(-pointer // _PAGE) * _PAGE, (pointer + size) // _PAGE * _PAGE
        if end > start:
            yield start, end


def _drop(ranges: Iterable[tuple[int, int]]) -> int:
    madvise, released = _madvise(), 0
    for start, end in ranges:
        if madvise(start, end - start, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) on [{start:#x}, {end:#x}) failed")
        released += end - start
    return released


def release_host_pages(tensors: Iterable[torch.Tensor | None]) -> int:
    """Release the pages of these CPU tensors; their contents read as zeros until written again."""
    return _drop(_page_ranges(tensors))


def file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's private mappings of files (not anonymous memory, not shared)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[1].endswith("p") or fields[4] == "0" or not fields[5].startswith("/"):
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            found.append((low, high))
    return sorted(found)


_PRESENT, _SWAPPED, _FILE_OR_SHARED = 1 << 63, 1 << 62, 1 << 61


def pages_match_the_file(start: int, end: int) -> bool:
    """Whether no page of [start, end) (inside a private file mapping) was ever written: /proc/self/pagemap
    marks a page that a write copied out of the file as anonymous (present or swapped without the
    file bit)."""
    import numpy as np

    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start // _PAGE * 8)
        entries = np.frombuffer(pagemap.read((end - start) // _PAGE * 8), dtype=np.uint64)
    resident = (entries & np.uint64(_PRESENT | _SWAPPED)) != 0
    from_file = (entries & np.uint64(_FILE_OR_SHARED)) != 0
    return bool(np.all(from_file | ~resident))


def release_file_mapped_pages(tensors: Iterable[torch.Tensor | None]) -> int:
    """Release the pages of tensors that lie inside a private file mapping and were never written (they
    read back from the file); every other tensor is left alone."""
    mappings = file_mappings()
    starts = [low for low, _ in mappings]

    def unchanged_file_pages(start: int, end: int) -> bool:
        index = bisect.bisect_right(starts, start) - 1
        return index >= 0 and end <= mappings[index][1] and pages_match_the_file(start, end)

    return _drop(r for r in _page_ranges(tensors) if unchanged_file_pages(*r))
