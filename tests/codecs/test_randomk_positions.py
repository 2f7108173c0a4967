"""RandomK's shared positions (``sparse.distinct_positions``): distinct, ascending, in range,
the same for the same seed, and uniform among the k-subsets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import gradzip as gz
from gradzip.codecs.base import TensorContext
from gradzip.codecs.randomk import distinct_positions


@pytest.mark.parametrize("n,k", [(1, 1), (5, 1), (10, 3), (100, 50), (100, 51), (1000, 999), (1_000_003, 10_007)])
def test_positions_are_k_distinct_ascending_in_range(n, k):
    p = distinct_positions(n, k, torch.Generator().manual_seed(n + k))
    assert p.dtype == torch.int64 and p.numel() == k
    assert torch.equal(p, p.unique())  # unique() sorts: distinct and ascending
    assert 0 <= int(p[0]) and int(p[-1]) < n


def test_every_k_subset_is_as_likely():
    """n = 6, k = 2 through the draw path (2k <= n): the 15 pairs' counts over 15,000 draws
    against the uniform expectation (chi-square, 14 degrees of freedom; 36.1 is p = 0.001)."""
    g = torch.Generator().manual_seed(0)
    counts = dict.fromkeys(itertools.combinations(range(6), 2), 0)
    trials = 15_000
    for _ in range(trials):
        counts[tuple(distinct_positions(6, 2, g).tolist())] += 1
    expected = trials / math.comb(6, 2)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 36.1, counts


def test_every_rank_draws_the_same_positions_for_a_seed_step_and_name():
    codec = gz.RandomK(0.01, seed=3)
    ctx = TensorContext(dtype=torch.float32, name="w", step=7)
    a, b = codec.indices(50_000, ctx, "cpu"), codec.indices(50_000, ctx, "cpu")
    assert torch.equal(a, b) and a.numel() == 500
    other = codec.indices(50_000, TensorContext(dtype=torch.float32, name="w", step=8), "cpu")
    assert not torch.equal(a, other)
