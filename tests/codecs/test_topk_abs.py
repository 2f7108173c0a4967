"""``sparse.topk_abs``, the exact top-k behind TopK(mode="exact") and Threshold(policy="target"):
the same elements and values as ``torch.topk(v.abs(), k)`` on whatever the prefilter meets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.codecs.topk import topk_abs


def check(v: torch.Tensor, k: int) -> None:
    idx, vals = topk_abs(v, k)
    want = torch.topk(v.abs(), k, sorted=False)
    assert idx.numel() == k and idx.unique().numel() == k
    bits = lambda t: t.contiguous().view(torch.int32)  # noqa: E731 - NaN equal to itself
    assert torch.equal(bits(vals), bits(v.abs()[idx]))
    assert torch.equal(bits(vals.sort().values), bits(want.values.sort().values))  # NaN sorts last in both
    if torch.equal(want.values.unique(), want.values.sort().values):  # no ties among the top k
        kth = want.values.min()
        if not (v.abs() == kth).sum() > 1:
            assert torch.equal(idx.sort().values, want.indices.sort().values)


@pytest.mark.parametrize("n,k", [(100, 7), (70_000, 700), (1_000_000, 10_000), (1_000_000, 1), (300_000, 37_000)])
def test_random_gradients(n, k):
    check(torch.randn(n, generator=torch.Generator().manual_seed(n + k)), k)


def test_structured_tensors_defeat_the_sample_but_not_the_answer():
    n = 1 << 20
    check(torch.linspace(0, 1, n), 1000)  # sorted: the strided sample sees every part
    spike = torch.zeros(n)
    spike[12345] = 5.0
    check(spike, 10)  # the sample misses the only large element: the threshold is 0
    sparse = torch.zeros(n)  # 1% dense, k of them (TwoPhase's owner where the ranks agree)
    pos = torch.randperm(n, generator=torch.Generator().manual_seed(3))[: n // 100]
    sparse[pos] = torch.randn(pos.numel(), generator=torch.Generator().manual_seed(4))
    check(sparse, n // 100)
    check(sparse, n // 200)
    idx, vals = topk_abs(sparse, n // 50)  # fewer nonzeros than k: all of them, then zeros
    assert idx.unique().numel() == n // 50 and set(pos.tolist()) <= set(idx.tolist())
    assert int((vals > 0).sum()) == int((sparse != 0).sum()) and torch.equal(vals, sparse.abs()[idx])
    comb = torch.zeros(n)
    comb[1::64] = torch.arange(1, n // 64 + 1, dtype=torch.float32)  # nothing on the sample's stride
    check(comb, 500)


def test_nan_and_ties_take_torch_topk():
    v = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
    v[77] = float("nan")
    check(v, 100)
    # the NaN check is one sum: infinities of both signs make it NaN (the whole tensor, still
    # the right answer); finite values whose sum overflows to inf hide no NaN
    v[77] = float("inf")
    v[78] = -float("inf")
    check(v, 100)
    big = torch.rand(1 << 18, generator=torch.Generator().manual_seed(2)) * 3e38
    big[:1000] = 3.4e38
    assert torch.isinf(big.sum())
    check(big, 500)
    check(big, 2000)
    ties = torch.ones(1 << 18)
    idx, vals = topk_abs(ties, 1000)
    assert idx.unique().numel() == 1000 and bool((vals == 1).all())


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1 << 16, 1 << 18), frac=st.floats(1e-5, 0.12), seed=st.integers(0, 1000))
def test_any_size_and_ratio(n, frac, seed):
    k = max(1, int(frac * n))
    check(torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 7 - 3), k)
