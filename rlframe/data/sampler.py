"""A batch sampler whose position can be checkpointed, so a resumed run sees the same batches.

    sampler = StatefulSampler(len(dataset), batch_size=32, seed=0)
    for epoch in range(total_epochs):
        for indices in sampler:          # one epoch, from where the sampler stands
            batch = collate_prompts([dataset[i] for i in indices], pad_token_id)
            ...
            checkpoint["sampler"] = sampler.state_dict()

Epoch ``e`` visits the rows in the permutation drawn from ``numpy.random.default_rng(seed + e)``
(or in order with ``shuffle=False``). ``state_dict()`` is ``{"epoch", "position", "seed"}``, where
``position`` counts the batches of the current epoch already handed out; after
``load_state_dict`` iteration continues with the next batch, exactly as the first run would have.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


class StatefulSampler:
    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if num_samples < (batch_size if drop_last else 1):
            raise ValueError(f"{num_samples} samples cannot fill one batch of {batch_size}; use a "
                             f"smaller batch size or more data")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_samples)

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch; the next ``iter`` starts the next epoch."""
        order = self.epoch_order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            batch = order[start:start + self.batch_size].tolist()
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0

    def forever(self) -> Iterator[list[int]]:
        """Batches epoch after epoch, without end."""
        while True:
            yield from self

    def state_dict(self) -> dict:
        if self.position >= len(self):  # the epoch is used up: the next batch is the next epoch's
            return {"epoch": self.epoch + 1, "position": 0, "seed": self.seed}
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state has seed {state['seed']}, this sampler has seed "
                             f"{self.seed}: the batches would differ from the saved run's")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"sampler state position {state['position']} is outside 0..{len(self)}"
                             f" (did the dataset or batch size change?)")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
