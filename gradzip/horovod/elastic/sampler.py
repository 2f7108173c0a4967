"""Horovod's ``ElasticSampler``: partitions a dataset over the ranks and, after a reset, the
samples of the epoch not yet processed over the new set of ranks."""

from __future__ import annotations

import math
import random

import torch.utils.data

from ..mpi_ops import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, and it records how many samples the job has processed this
    epoch (``record_batch``), so that a ``TorchState`` holding it repartitions the rest after a
    reset. ``set_epoch`` at the end of an epoch clears the record. ``shuffle`` orders the indices
    by ``random.Random(seed + epoch)``, the same on every rank."""

    def __init__(self, dataset, shuffle=True, seed=0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch) -> None:
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size) -> None:
        """Record that every rank processed ``batch_size`` more samples."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> dict:
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def reset(self) -> None:
        self.num_replicas = size()
        self.rank = rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = int(math.ceil(len(self.remaining_indices) * 1.0 / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        self.indices = self.remaining_indices[:]
        self.indices += self.indices[: (self.total_size - len(self.indices))]
        self.indices = self.indices[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
