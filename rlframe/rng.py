"""RNG states of one process (python, numpy, torch) as plain lists: saved as JSON or tensors, no pickle;
and the per-sample sampling seeds that make vLLM's sampling independent of the engine's history."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def capture_rng_state() -> dict:
    """Python, numpy and torch RNG states as JSON-able lists (no pickle on load)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def sample_seed(seed: int, step: int, uid: str, index: int) -> int:
    """The sampling seed of one response: a 63-bit hash of (run seed, step, prompt uid, sample index).

    It depends on nothing else -- not on the engine's RNG history, the batch order or the rank that
    generates it -- so a resumed run (or another placement) draws exactly the same tokens.
    """
    digest = hashlib.blake2b(f"{seed}/{step}/{uid}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_seeds(seed: int, step: int, uids) -> np.ndarray:
    """Seeds for a batch whose rows are the samples of prompts named by `uids` (a uid repeated once per
    sample): the k-th row with a given uid is that prompt's sample k."""
    seen: dict[str, int] = {}
    seeds = []
    for uid in uids:
        index = seen.get(uid, 0)
        seen[uid] = index + 1
        seeds.append(sample_seed(seed, step, str(uid), index))
    return np.array(seeds, dtype=np.int64)
