"""Seeded jagged (KeyedJaggedTensor-shaped) batches kept as numpy, so the parent process never needs torch."""

from __future__ import annotations

import numpy as np

from difftest import Batch, JaggedFeature

__all__ = ["Batch", "JaggedFeature", "jagged_feature"]


def jagged_feature(
    rng: np.random.Generator, batch_size: int, num_embeddings: int, max_bag: int, weighted: bool
) -> JaggedFeature:
    """Variable bag lengths with empty bags, and ids drawn from a small hot set so duplicates occur."""
    lengths = rng.integers(0, max_bag + 1, size=batch_size)
    lengths[rng.random(batch_size) < 0.15] = 0
    total = int(lengths.sum())
    hot = rng.integers(0, num_embeddings, size=max(1, min(num_embeddings, 4)))
    uniform_ids = rng.integers(0, num_embeddings, size=total)
    values = np.where(rng.random(total) < 0.3, rng.choice(hot, size=total), uniform_ids)
    weights = rng.uniform(0.5, 1.5, size=total).astype(np.float32) if weighted else None
    return JaggedFeature(lengths.astype(np.int64), values.astype(np.int64), weights)


# sizes no world size from 2 to 4 divides (1 and the numbers prime to 6 below 60): what the uneven model variants
# draw widths, heads and vocabularies from, so that shards come out of different sizes
UNEVEN_SIZES = tuple(n for n in range(1, 60) if n % 2 and n % 3)
