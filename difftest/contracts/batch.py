"""A model's batches as the engine stores and hands them to settings: labels, dense features and jagged
(KeyedJaggedTensor-shaped) sparse features, kept as numpy so the parent process never needs torch. Generators make
them (`generators/inputs.py` draws the seeded ones)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from difftest.contracts.errors import Unsupported


@dataclass
class JaggedFeature:
    """One sparse feature, sample-major: sample i owns values[offsets[i]:offsets[i+1]]."""

    lengths: np.ndarray  # int64 [B]
    values: np.ndarray  # int64 [sum(lengths)]
    weights: np.ndarray | None = None  # float32 [sum(lengths)] for weighted features

    def slice(self, start: int, stop: int) -> JaggedFeature:
        offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        lo, hi = offsets[start], offsets[stop]
        weights = None if self.weights is None else self.weights[lo:hi]
        return JaggedFeature(self.lengths[start:stop], self.values[lo:hi], weights)

    def take(self, samples: np.ndarray) -> JaggedFeature:
        """The bags of `samples`, in that order."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        picked = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in samples] or [np.zeros(0, np.int64)])
        picked = picked.astype(np.int64)
        weights = None if self.weights is None else self.weights[picked]
        return JaggedFeature(self.lengths[samples], self.values[picked], weights)

    def shuffled_within_bags(self, rng: np.random.Generator) -> JaggedFeature:
        """The same bags, each bag's ids (and weights) in another order: a pooled sum over them is unchanged."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        order = np.concatenate([offsets[i] + rng.permutation(int(n)) for i, n in enumerate(self.lengths)]
                               or [np.zeros(0, np.int64)]).astype(np.int64)
        return JaggedFeature(self.lengths, self.values[order], None if self.weights is None else self.weights[order])


POSITIONAL = "*"  # a `Batch.named` input passed by position: "*0", "*1", … (no keyword argument is named so)


@dataclass
class Batch:
    """A batch of samples: dense features, sparse features and labels; `named` holds a model's several inputs (a
    user's dict of tensors, masks and ids; a tuple's as "*0", "*1", …), each split along its first axis like the rest."""

    labels: np.ndarray
    dense: np.ndarray | None = None
    sparse: dict[str, JaggedFeature] = field(default_factory=dict)
    named: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> Batch:
        dense = None if self.dense is None else self.dense[start:stop]
        sparse = {name: feature.slice(start, stop) for name, feature in self.sparse.items()}
        return Batch(self.labels[start:stop], dense, sparse, {k: v[start:stop] for k, v in self.named.items()})

    def take(self, samples: np.ndarray) -> Batch:
        """The samples at positions `samples`, in that order (a data loader's shuffled batch)."""
        dense = None if self.dense is None else self.dense[samples]
        return Batch(self.labels[samples], dense, {name: f.take(samples) for name, f in self.sparse.items()},
                     {k: v[samples] for k, v in self.named.items()})

    def reordered(self, rng: np.random.Generator) -> tuple[Batch, np.ndarray]:
        """The samples in another order, and each bag's ids too, with the order taken (sums over either are
        mathematically unchanged: a legitimate freedom of the arithmetic)."""
        order = rng.permutation(self.size)
        taken = self.take(order)
        taken.sparse = {name: f.shuffled_within_bags(rng) for name, f in taken.sparse.items()}
        return taken, order

    def shard(self, rank: int, world_size: int) -> Batch:
        """The contiguous share of rank `rank`; the global batch must divide evenly."""
        if self.size % world_size:  # the run's batch size does not suit the setting: nothing a library did
            raise Unsupported(f"batch of {self.size} samples does not split over {world_size} ranks (--batch-size "
                              "24 or a multiple of it splits everywhere)")
        per_rank = self.size // world_size
        return self.slice(rank * per_rank, (rank + 1) * per_rank)

    @staticmethod
    def labels_key(prefix: str) -> str:
        """The stored name of a split's labels: one array per split whose first axis is its batch."""
        return f"{prefix}.labels"

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        arrays = {self.labels_key(prefix): self.labels}
        if self.dense is not None:
            arrays[f"{prefix}.dense"] = self.dense
        for name, feature in self.sparse.items():
            arrays[f"{prefix}.sparse.{name}.lengths"] = feature.lengths
            arrays[f"{prefix}.sparse.{name}.values"] = feature.values
            if feature.weights is not None:
                arrays[f"{prefix}.sparse.{name}.weights"] = feature.weights
        arrays.update({f"{prefix}.named.{name}": array for name, array in self.named.items()})
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str) -> Batch:
        names = sorted({k.split(".")[2] for k in arrays if k.startswith(f"{prefix}.sparse.")})
        sparse = {
            name: JaggedFeature(
                arrays[f"{prefix}.sparse.{name}.lengths"],
                arrays[f"{prefix}.sparse.{name}.values"],
                arrays.get(f"{prefix}.sparse.{name}.weights"),
            )
            for name in names
        }
        named = {k[len(f"{prefix}.named."):]: v for k, v in arrays.items() if k.startswith(f"{prefix}.named.")}
        return cls(arrays[cls.labels_key(prefix)], arrays.get(f"{prefix}.dense"), sparse, named)
