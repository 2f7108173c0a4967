"""orthonormalize_rows_ (PowerSGD's Gram-Schmidt): every backend against the reference, bit for bit.

The op's floats are defined step by step (:mod:`gradzip.kernels.orth`: float64 sums in
512 lanes folded by halves, one correctly rounded operation a step), so the Numba kernel,
the Triton kernel (the interpreter here; compiled for sm_90 in test_triton.py's AOT test)
and the reference agree bit for bit, and a matrix's result depends on it alone: not on the
other matrices of the call, its offset, or the threads. Also: orthonormal rows with the
input's span, zero rows kept zero, within rounding of torch's own Gram-Schmidt, and the
argument checks.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tph

import gradzip.kernels as K
from gradzip.kernels.orth import LANES, lanesum_reference, orthonormalize_rows_reference

pytest.importorskip("numba")

# (k, n): one row, k = n, fewer elements than the lanes, exactly the lanes, one past them,
# several blocks with a ragged tail, more rows than a Triton chunk (4).
SHAPES = [(1, 1), (1, 7), (2, 2), (2, 3), (3, 50), (4, 511), (4, 512), (5, 513), (7, 40), (3, 1100)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def layout(shapes, gap=3, start=0):
    """``(offset, k, n)`` rows for ``shapes`` laid out ``gap`` elements apart from ``start``."""
    rows, off = [], start
    for k, n in shapes:
        rows.append((off, k, n))
        off += k * n + gap
    return rows, off


def filled(rows, size, seed, dtype=torch.float32):
    """A buffer of ``size`` normal values (float64 drawn, then cast), with awkward matrices among
    ``rows``: a zero first row, an exactly dependent row, magnitudes near float32's ends."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(size, generator=g, dtype=torch.float64)
    for j, (off, k, n) in enumerate(rows):
        a = buf[off : off + k * n].view(k, n)
        if j % 5 == 1 and k > 1:
            a[0] = 0.0  # a zero column of P: must stay zero
        if j % 5 == 2 and k > 2:
            a[2] = 3.0 * a[1]  # dependent: its remainder is rounding noise
        if j % 5 == 3:
            a.mul_(1e-30 if j % 2 else 1e30)
        if j % 5 == 4:
            a.mul_(1e-42)  # float32 subnormals
    return buf.to(dtype)


def run(buf, rows, eps, backend, monkeypatch):
    """``orthonormalize_rows_`` on a copy of ``buf`` with ``backend`` forced ("numba": unforced)."""
    if backend == "numba":
        monkeypatch.delenv(K.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(K.ENV_VAR, backend)
    out = K.orthonormalize_rows_(buf.clone(), rows, eps)
    chosen = K.backend_report()["ops"]["orthonormalize_rows_"]["chosen"]["cpu"]["backend"]
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    return out, chosen


# -- the definition -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, LANES - 1, LANES, LANES + 1, 3 * LANES + 17])
def test_lanesum_is_its_definition(n):
    """Lane l adds products l, l + LANES, ... in order to +0.0; lanes fold by halves."""
    p = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 1e3
    lanes = [0.0] * LANES
    for i, v in enumerate(p.tolist()):
        lanes[i % LANES] = lanes[i % LANES] + v
    h = LANES // 2
    while h >= 1:
        lanes = [lanes[i] + lanes[i + h] for i in range(h)]
        h //= 2
    got = lanesum_reference(p)
    assert got.dtype == torch.float64 and float(got) == lanes[0]
    assert torch.equal(
        lanesum_reference(torch.stack([p, -p])), torch.tensor([lanes[0], -lanes[0]], dtype=torch.float64)
    )


def wide(n: int, seed: int) -> torch.Tensor:
    """float32-representable values over 40 decades, whose float64 sums depend on their order;
    past LANES / 2 elements also 1e30, 1 and -1e30 in lanes 0, 1 and LANES / 2, which the
    halving fold cancels first (sum 1) and an adjacent-lanes fold would not (sum 0)."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.randint(-20, 21, (n,), generator=g).double()
    x = (torch.randn(n, generator=g, dtype=torch.float64) * mag).float().double()
    if n > LANES // 2:
        x[0], x[1], x[LANES // 2] = 1e30, 1.0, -1e30
    return x


@pytest.mark.parametrize("n", [1, LANES - 1, LANES + 1, 5 * LANES + 3])
def test_numba_lane_sum_is_the_definition(n):
    """The kernels' outputs are float32, which hides most float64 reorderings: check the
    Numba lane sum itself on sums whose value depends on the order."""
    import numpy as np

    from gradzip.kernels import numba_ops

    a, b = wide(n, n).float(), wide(n, n + 1).float()
    b[[0, 1, LANES // 2][: min(n, 3)]] = 1.0  # a's planted 1e30, 1, -1e30 as they are
    acc = np.empty(LANES, dtype=np.float64)
    got = numba_ops._lanesum(a.numpy(), b.numpy(), acc)
    want = float(lanesum_reference(a.double() * b.double()))
    assert got == want


@pytest.mark.parametrize("n", [1, LANES + 1, 5 * LANES + 3])
def test_triton_lane_sum_is_the_definition(n):
    """The Triton folds (``_total``, ``_total_rows``) on float64 lanes, against the reference."""
    pytest.importorskip("triton")
    from gradzip.kernels.triton import interpreting

    if not interpreting():
        pytest.skip("TRITON_INTERPRET is not set: this probe runs on CPU tensors")
    from tests.kernels.orth_probe import lane_sums

    x = torch.stack([wide(n, n + r) for r in range(4)])
    got = lane_sums(x)
    want = lanesum_reference(x)
    assert torch.equal(got[:4], want) and float(got[4]) == float(want[0])


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_within_rounding_of_torchs_gram_schmidt(k, eps):
    """torch's ``_orthogonalize_gram_schmidt`` (its path for k <= 2) with float32 sums; ours sums in
    float64: the same to a few ulps."""
    a = torch.randn(3, 50, k, generator=torch.Generator().manual_seed(k))
    theirs = a.clone()
    tph._orthogonalize_gram_schmidt(theirs, eps)
    buf = a.transpose(1, 2).contiguous().reshape(-1)  # each matrix's columns as rows
    rows, _ = layout([(k, 50)] * 3, gap=0)
    ours = K.orthonormalize_rows_(buf, rows, eps).view(3, k, 50).transpose(1, 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-6)


def test_zero_rows_stay_zero_where_torch_divides_by_zero():
    z = torch.zeros(2, 10, 2)
    z[1, :, 0] = 1.0  # second matrix: a unit first column, then a dependent zero remainder
    theirs = z.clone()
    tph._orthogonalize_gram_schmidt(theirs)
    assert theirs.isnan().any()  # torch: 0 / 0
    buf = z.transpose(1, 2).contiguous().reshape(-1)
    ours = K.orthonormalize_rows_(buf, layout([(2, 10)] * 2, gap=0)[0]).view(2, 2, 10)
    assert torch.isfinite(ours).all()
    assert not ours[0].any() and not ours[1, 1].any()
    torch.testing.assert_close(ours[1, 0], torch.full((10,), 10**-0.5), atol=1e-7, rtol=0)


def test_more_than_two_rows_are_orthonormal_with_the_same_span():
    """k > 2 runs the pass twice: orthonormal to working precision on ill-conditioned input,
    where one pass is not (the reason for the second)."""
    a = torch.randn(4, 5, 30, generator=torch.Generator().manual_seed(0))
    a[:, 4] = a[:, 3] + 1e-4 * a[:, 4]
    rows, size = layout([(5, 30)] * 4, gap=0)
    q = K.orthonormalize_rows_(a.reshape(-1).clone(), rows).view(4, 5, 30)
    eye = torch.eye(5).expand(4, 5, 5)
    torch.testing.assert_close(q @ q.transpose(1, 2), eye, atol=1e-6, rtol=0)
    torch.testing.assert_close((a @ q.transpose(1, 2)) @ q, a, atol=1e-5, rtol=0)  # a's rows lie in span(q)
    once = a.reshape(-1).clone()
    from gradzip.kernels.orth import _gram_schmidt_pass

    for j in range(4):
        _gram_schmidt_pass(once[j * 150 : (j + 1) * 150].view(5, 30), 0.0)
    once = once.view(4, 5, 30)
    assert (once @ once.transpose(1, 2) - eye).abs().max() > 1e-4  # why the second pass
    assert not K.orthonormalize_rows_(torch.zeros(24), [(0, 3, 8)]).any()


# -- backends, bit for bit --------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_numba_matches_reference_bit_for_bit(eps, monkeypatch):
    rows, size = layout(SHAPES)
    buf = filled(rows, size, seed=1)
    got, backend = run(buf, rows, eps, "numba", monkeypatch)
    want, ref = run(buf, rows, eps, "reference", monkeypatch)
    assert (backend, ref) == ("numba", "reference")
    assert torch.equal(bits(got), bits(want))
    off, k, n = rows[6]  # filled() zeroed its first row
    assert k > 1 and not got[off : off + n].any()


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 700)), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
    eps=st.sampled_from([0.0, 1e-8, 0.5]),
)
def test_numba_matches_reference_on_any_layout(shapes, seed, eps):
    shapes = [(k, max(n, k)) for k, n in shapes]
    rows, size = layout(shapes, gap=seed % 5)
    buf = filled(rows, size, seed)
    want = buf.clone()
    orthonormalize_rows_reference(want, rows, eps)
    got = K.orthonormalize_rows_(buf.clone(), rows, eps)
    assert torch.equal(bits(got), bits(want))


def test_a_matrix_alone_equals_it_among_others(monkeypatch):
    """What a resumed PowerSGD run relies on: the call's other matrices and the offset change nothing."""
    rows, size = layout(SHAPES, gap=5, start=1)
    buf = filled(rows, size, seed=2)
    together = K.orthonormalize_rows_(buf.clone(), rows)
    for off, k, n in rows:
        alone = buf[off : off + k * n].clone()
        K.orthonormalize_rows_(alone, [(0, k, n)])
        assert torch.equal(bits(alone), bits(together[off : off + k * n]))
    untouched = torch.ones(size, dtype=torch.bool)
    for off, k, n in rows:
        untouched[off : off + k * n] = False
    assert torch.equal(bits(together[untouched]), bits(buf[untouched]))  # the gaps are not written


def test_float64_takes_the_reference_and_is_orthonormal():
    rows, size = layout([(3, 40), (2, 9)])
    buf = torch.randn(size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    K.orthonormalize_rows_(buf, rows)
    assert K.backend_report()["ops"]["orthonormalize_rows_"]["chosen"]["cpu"]["backend"] == "reference"
    for off, k, n in rows:
        a = buf[off : off + k * n].view(k, n)
        torch.testing.assert_close(a @ a.t(), torch.eye(k, dtype=torch.float64), atol=1e-12, rtol=0)


# eps > 0 is the kernel's other variant (HAS_EPS): its awkward matrices (filled() by position: a
# zero row, a dependent row, 1e-30, subnormals), more rows than a chunk, past the lanes; the
# interpreter runs a program a matrix, so fewer and smaller than SHAPES.
EPS_SHAPES = [(1, 1), (2, 9), (3, 50), (2, 3), (3, 40), (5, 513)]


def test_triton_matches_reference_bit_for_bit(monkeypatch):
    pytest.importorskip("triton")
    from gradzip.kernels.triton import interpreting

    if not interpreting():
        pytest.skip("TRITON_INTERPRET is not set: the kernel is compiled for the GPU (tests/kernels/test_cuda.py)")
    for eps, shapes in ((0.0, SHAPES), (1e-8, EPS_SHAPES)):
        rows, size = layout(shapes)
        buf = filled(rows, size, seed=4)
        got, backend = run(buf, rows, eps, "triton", monkeypatch)
        want, _ = run(buf, rows, eps, "reference", monkeypatch)
        assert backend == "triton"
        assert torch.equal(bits(got), bits(want)), eps


# -- argument checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table,match",
    [
        ([(0, 3, 2)], "1 <= k <= n"),
        ([(0, 0, 4)], "1 <= k <= n"),
        ([(0, 2, 4), (7, 1, 4)], "overlaps"),
        ([(-1, 1, 4)], "negative offset"),
        ([(10, 2, 4)], "outside the buffer"),
    ],
)
def test_bad_tables_are_refused(table, match):
    with pytest.raises(ValueError, match=match):
        K.orthonormalize_rows_(torch.zeros(16), table)


def test_bad_buffers_and_eps_are_refused():
    with pytest.raises(TypeError, match="float32 or float64"):
        K.orthonormalize_rows_(torch.zeros(8, dtype=torch.float16), [(0, 1, 8)])
    with pytest.raises(ValueError, match="flat contiguous"):
        K.orthonormalize_rows_(torch.zeros(4, 4), [(0, 1, 8)])
    with pytest.raises(ValueError, match="flat contiguous"):
        K.orthonormalize_rows_(torch.zeros(32)[::2], [(0, 1, 8)])
    for eps in (-1e-8, math.inf, math.nan):
        with pytest.raises(ValueError, match="eps"):
            K.orthonormalize_rows_(torch.ones(8), [(0, 1, 8)], eps)
    buf = torch.ones(8)
    assert K.orthonormalize_rows_(buf, []) is buf and torch.equal(buf, torch.ones(8))  # nothing to do
