"""The Numba CPU kernels (kernels/numba_ops.py) against the references, frame for frame.

Awkward lengths (short last blocks and bytes, fewer elements than a Philox quad), every input
dtype, magnitudes near float32's ends, and non-finite inputs (which the kernels hand to the
references). Each check runs the op through the dispatch unforced (Numba) and forced to the
reference, so it also covers the dispatch's choice. The grids loop inside a test over the
lengths (and blocks, thresholds): each case costs well under a millisecond, a test item more.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip.kernels as K
from gradzip.kernels import dispatch
from gradzip.kernels import quant as Q

pytest.importorskip("numba")

LENGTHS = [1, 3, 4, 5, 63, 64, 65, 1000, 4097, 40_003]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCALES = [1.0, 1e-30, 1e30, 1e-42]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so -0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False

    def raw(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).view(torch.uint8)

    return torch.equal(raw(a), raw(b))


def data(n: int, dtype, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    if n > 10:
        x[3], x[7] = 0.0, -0.0
    return x


@pytest.fixture
def both(monkeypatch):
    """``both(call)``: the call unforced (asserting Numba ran it) and under GRADZIP_KERNELS=reference."""

    def run(op: str, call):
        monkeypatch.delenv(K.ENV_VAR, raising=False)
        got = call()
        assert K.backend_report()["ops"][op]["chosen"]["cpu"]["backend"] == "numba", op
        monkeypatch.setenv(K.ENV_VAR, "reference")
        want = call()
        monkeypatch.delenv(K.ENV_VAR, raising=False)
        return got, want

    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_encoders_give_the_reference_frames(both, dtype, scale):
    for n in LENGTHS:
        x = data(n, dtype, scale, n)
        for levels, block in [(7, 64), (1, None), (127, 128), (3, 5)]:
            got, want = both("qsgd_encode", lambda: K.qsgd_encode(x, levels, 12345, block=block))
            assert all(same(a, b) for a, b in zip(got, want)), ("qsgd", n, levels, block)
        for block, clip in [(None, None), (64, 2.5), (7, None)]:
            got, want = both("terngrad_encode", lambda: K.terngrad_encode(x, 99, block=block, clip=clip))
            assert all(same(a, b) for a, b in zip(got, want)), ("terngrad", n, block, clip)
        for block in [None, 1024, 7, 256]:
            got, want = both("int8_encode", lambda: K.int8_encode(x, block=block))
            assert all(same(a, b) for a, b in zip(got, want)), ("int8", n, block)


@pytest.mark.parametrize("n", [1, 5, 1000, 4097])
def test_non_finite_inputs_take_the_reference_and_give_its_frames(n):
    x = data(n, torch.float32, 1.0, 1)
    x[n // 2] = float("nan")
    x[0] = float("inf")
    pairs = [
        (K.qsgd_encode(x, 7, 1), Q.qsgd_encode_reference(x, 7, 1)),
        (K.terngrad_encode(x, 1, block=64), Q.terngrad_encode_reference(x, 1, block=64)),
        (K.int8_encode(x, block=64), Q.int8_encode_reference(x, block=64)),
        (
            K.int8_encode(x, block=None, scales=torch.ones(1)),
            Q.int8_encode_reference(x, block=None, scales=torch.ones(1)),
        ),
    ]
    for got, want in pairs:
        assert all(same(a, b) for a, b in zip(got, want))


def test_int8_near_ties_are_computed_in_float64():
    """Quotients a float32 division rounds onto a half-integer: the float64 reference's codes."""
    s = torch.tensor([0.1], dtype=torch.float32)
    k = torch.arange(-127, 127, dtype=torch.float64) + 0.5
    x = (k * 0.1).to(torch.float32)  # v / S_b within float32 rounding of k + 1/2
    x = torch.cat([x, torch.nextafter(x, torch.zeros_like(x)), torch.nextafter(x, 2 * x)])
    got, want = K.int8_encode(x, block=None, scales=s), Q.int8_encode_reference(x, block=None, scales=s)
    assert all(same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("kind", ["qsgd", "tern2", "int8"])
@pytest.mark.parametrize("block", [None, 64, 7])
def test_decoders_add_the_reference_values(both, kind, block):
    for n in [1, 5, 1000, 4097, 40_003]:
        _decoder_adds_the_reference_values(both, kind, n, block)


def _decoder_adds_the_reference_values(both, kind, n, block):
    x = data(n, torch.float32, 1.0, n)
    if kind == "qsgd":
        kw = dict(block=block, levels=7, bits=4)
        scales, codes = Q.qsgd_encode_reference(x, 7, 5, block=block)
    elif kind == "tern2":
        kw = dict(block=block)
        scales, codes = Q.terngrad_encode_reference(x, 5, block=block)
    else:
        kw = dict(block=block)
        scales, codes = Q.int8_encode_reference(x, block=block)
    body = torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)])
    start = torch.randn(n, generator=torch.Generator().manual_seed(3))

    def add():
        out = start.clone()
        K.decode_add_quant(out, [body, body], kind, **kw)
        return out

    got, want = both("decode_add_quant", add)
    assert same(got, want), (kind, n, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("subtract", [False, True])
def test_int8_apply_adds_and_subtracts_as_the_reference(both, dtype, subtract):
    x = data(5000, torch.float32, 1.0, 9)
    scales, codes = Q.int8_encode_reference(x, block=333)
    body = torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)])
    start = torch.randn(5000, dtype=dtype, generator=torch.Generator().manual_seed(4))

    def apply():
        out = start.clone()
        K.int8_apply_(out, [body, body], block=333, subtract=subtract)
        return out

    got, want = both("int8_apply_", apply)
    assert same(got, want)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3000),
    block=st.one_of(st.none(), st.integers(1, 600)),
    levels=st.integers(1, 127),
    seed=st.integers(0, 2**63 - 1),
    exp=st.integers(-40, 38),
)
def test_qsgd_and_terngrad_frames_match_the_reference_on_any_layout(n, block, levels, seed, exp):
    x = data(n, torch.float32, 10.0**exp, seed % 1000)
    got, want = K.qsgd_encode(x, levels, seed, block=block), Q.qsgd_encode_reference(x, levels, seed, block=block)
    assert all(same(a, b) for a, b in zip(got, want))
    got, want = K.terngrad_encode(x, seed, block=block), Q.terngrad_encode_reference(x, seed, block=block)
    assert all(same(a, b) for a, b in zip(got, want))


def test_without_numba_cpu_calls_take_the_reference(monkeypatch):
    """Numba not importable: the dispatch says so and runs the references."""
    dispatch.reset_dispatch()
    monkeypatch.setitem(dispatch._import_errors, "numba", "numba is not importable (ImportError: test)")
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    x = data(100, torch.float32, 1.0, 2)
    assert all(same(a, b) for a, b in zip(K.qsgd_encode(x, 7, 5), Q.qsgd_encode_reference(x, 7, 5)))
    chosen = K.backend_report()["ops"]["qsgd_encode"]["chosen"]["cpu"]
    assert chosen["backend"] == "reference" and "not importable" in chosen["why"][0]
    assert not K.uses_kernel("qsgd_encode", "cpu")
    monkeypatch.setenv(K.ENV_VAR, "numba")
    with pytest.raises(K.KernelBackendError, match="numba"):
        K.qsgd_encode(x, 7, 5)
    dispatch.reset_dispatch()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["no residual", "residual", "into the residual", "into x", "new residual"])
def test_sign_ef_gives_the_reference_words_scales_and_residual(both, dtype, mode):
    for n in [1, 5, 8, 33, 1000, 4097]:
        for block in [None, 64, 7]:
            _sign_ef_gives_the_reference(both, n, dtype, block, mode)


def _sign_ef_gives_the_reference(both, n, dtype, block, mode):
    x, r = data(n, dtype, 1.0, n), data(n, torch.float32, 0.1, n + 1)

    def call():
        xx, rr = x.clone(), r.clone()
        if mode == "no residual":
            return K.sign_ef(xx, None, block=block)
        if mode == "residual":
            return K.sign_ef(xx, rr, block=block)
        if mode == "into x" and dtype == torch.float32:
            res = K.sign_ef(xx, rr, block=block, out=xx)
            assert res[2] is xx
            return res
        if mode == "new residual":
            return K.sign_ef(xx, None, block=block, new_residual=True)
        res = K.sign_ef(xx, rr, block=block, out=rr)
        assert res[2] is rr
        return res

    got, want = both("sign_ef", call)
    assert all((a is None and b is None) or same(a, b) for a, b in zip(got, want)), (n, block)


def test_sign_ef_on_non_finite_input_matches_the_reference():
    x, r = data(1000, torch.float32, 1.0, 5), data(1000, torch.float32, 0.1, 6)
    x[3], x[700] = float("nan"), float("inf")
    got, want = K.sign_ef(x, r.clone(), block=64), Q.sign_ef_reference(x, r.clone(), block=64)
    assert all(same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["no residual", "residual", "into the residual", "into x", "new residual"])
def test_threshold_ef_gives_the_reference_result(both, dtype, mode):
    """Bitmap, index words, count, max |v| and residual; ``tau`` lands on float32 values of both
    roundings (0.7 rounds down in float32, 0.3 up) and on a subnormal."""
    for n in [1, 3, 4, 5, 1000, 4097]:
        for tau in [0.7, 0.3, 1e-40, 2.5]:
            _threshold_ef_gives_the_reference(both, n, dtype, tau, mode)


def _threshold_ef_gives_the_reference(both, n, dtype, tau, mode):
    x, r = data(n, dtype, 1.0, n), data(n, torch.float32, 0.1, n + 1)
    if n > 4:
        x[1], x[2] = torch.tensor(tau).to(dtype), -torch.tensor(tau).to(dtype)

    def call():
        xx, rr = x.clone(), r.clone()
        if mode == "no residual":
            res = K.threshold_ef(xx, tau)
        elif mode == "residual":
            res = K.threshold_ef(xx, tau, rr)
        elif mode == "into x" and dtype == torch.float32:
            res = K.threshold_ef(xx, tau, rr, out=xx)
            assert res.residual is xx
        elif mode == "new residual":
            res = K.threshold_ef(xx, tau, new_residual=True)
        else:
            res = K.threshold_ef(xx, tau, rr, out=rr)
            assert res.residual is rr
        return res.bitmap(), res.indices(), torch.tensor([res.count]), torch.tensor([res.amax]), res.residual

    got, want = both("threshold_ef", call)
    assert all((a is None and b is None) or same(a, b) for a, b in zip(got, want)), (n, tau)


def test_threshold_ef_with_nan_reports_nan_as_the_reference():
    x = data(1000, torch.float32, 1.0, 3)
    x[10] = float("nan")
    got, want = K.threshold_ef(x, 0.5, new_residual=True), K.threshold_ef_reference(x, 0.5, new_residual=True)
    assert got.backend == "numba" and want.backend == "reference"
    assert got.count == want.count and np.isnan(got.amax) and np.isnan(want.amax)
    assert same(got.bitmap(), want.bitmap()) and same(got.residual, want.residual)


@pytest.mark.parametrize("thr", [0.0, 0.7, 1.3e-30, 1e30, "tensor"])
def test_abs_select_gives_the_reference_indices(both, thr):
    # every element, none, a buffer far too small (the second pass) or far too large; a 0-d
    # tensor threshold; -0.0, NaN and infinities among the values (NaN never reaches thr)
    for n in [1, 5, 1000, 40_003]:
        x = data(n, torch.float32, 1.0, n)
        if n > 10:
            x[1], x[2], x[4] = float("nan"), float("inf"), -float("inf")
        t = x.abs().nan_to_num(0.0).max().reshape(()) / 2 if thr == "tensor" else thr
        for expected in [None, 0, 3, 10**6]:
            got, want = both("abs_select", lambda: K.abs_select(x, t, expected))
            assert same(got, want) and got.dtype == torch.int64, (n, expected)


def test_abs_select_leaves_half_precision_to_the_reference(monkeypatch):
    # the reference compares in float16: a float32 comparison would round thr differently
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    x = data(1000, torch.float16, 1.0, 1)
    assert same(K.abs_select(x, 0.70001), (x.abs() >= 0.70001).nonzero().reshape(-1))
    assert K.backend_report()["ops"]["abs_select"]["chosen"]["cpu"]["backend"] == "reference"


def test_int8_scales_of_any_finite_maximum_match_the_reference():
    """Every binade (random float32 bit patterns, subnormals and the largest finite included): the
    compiled scales equal ``quant.int8_scales``, rounding down included; a NaN or Inf refuses."""
    from gradzip.kernels import numba_ops as N

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    bits = torch.cat([bits, torch.tensor([0, 1, 2, 0x7F7FFFFF, 0x00800000, 0x3F800000], dtype=torch.int32)])
    out = np.empty(bits.numel(), dtype=np.float32)
    assert N._int8_scales(bits.numpy(), out)
    want = Q.int8_scales(bits.view(torch.float32))
    assert same(torch.from_numpy(out), want)
    for bad in (0x7F800000, 0x7FC00000):
        assert not N._int8_scales(np.array([1, bad], dtype=np.int32), np.empty(2, dtype=np.float32))


def test_empty_tensors_give_the_reference_frames():
    x = torch.empty(0)
    for got, want in [
        (K.int8_encode(x), Q.int8_encode_reference(x)),
        (K.qsgd_encode(x, 7, 1), Q.qsgd_encode_reference(x, 7, 1)),
        (K.terngrad_encode(x, 1), Q.terngrad_encode_reference(x, 1)),
        (K.sign_ef(x, None, new_residual=True), Q.sign_ef_reference(x, None, new_residual=True)),
    ]:
        for a, b in zip(got, want):
            assert same(a, b) and a.stride() == (1,)
            a.view(torch.uint8)  # frames view their parts as bytes
    res = K.threshold_ef(x, 0.5, new_residual=True)
    assert res.count == 0 and res.bitmap().numel() == 0 and res.indices().numel() == 0


# -- the frame checks' pass over the bodies ----------------------------------------------------------

# (number of scales, elements); the last frame's 81 elements (1 past a multiple of 4 and of 8, as
# 1001 was) keep the message small: the interpreted Triton check runs a program per 8 bytes.
LAYOUT = [(1, 1), (2, 13), (0, 0), (3, 64), (1, 7), (5, 81)]


def _frames(kind, bits, gap):
    """``(offset, scales, elements)`` of LAYOUT's bodies, ``gap`` bytes apart, and the bytes in all."""
    frames, off = [], 0
    for nb, n in LAYOUT:
        frames.append((off, nb, n))
        off += 4 * nb + Q.quant_code_bytes(kind, n, bits) + gap
    return frames, off


def _clean(whole, kind, bits, frames):
    """``whole`` with every scale's sign bit cleared, no Int8 code byte 0x80 and packed codes 0
    (so a planted code or padding bit is the only large one): a clean message. The bytes
    between bodies keep what they held (negative scales and 0x80 codes, were they read)."""
    whole = whole.clone()
    for off, nb, n in frames:
        whole[off + 3 : off + 4 * nb : 4] &= 0x7F
        body = whole[off + 4 * nb : off + 4 * nb + Q.quant_code_bytes(kind, n, bits)]
        if kind == "int8":
            body[body == 0x80] = 0x7F
        elif kind != "sign1":
            body.zero_()
    return whole


@pytest.mark.parametrize("gap", [0, 5])
@pytest.mark.parametrize("kind,bits", [("int8", 8), ("sign1", 1), ("qsgd", 2), ("qsgd", 4), ("qsgd", 8), ("tern2", 2)])
def test_quant_body_stats_matches_reference(kind, bits, gap, both, monkeypatch):
    """Random bytes (negative, NaN, infinite and -0.0 scales; every code), then a clean message
    with one planted fault at a time: the Numba pass, and the Triton kernel under the
    interpreter where bytes lie between the frames (small programs: several of bytes and of
    scales; one of the four random messages, and every planted fault; the dispatch's choice
    and default block on the random one), read what the reference reads, padding bits of a
    frame's last byte and the bytes between frames left out."""
    import os

    frames, size = _frames(kind, bits, gap)

    def stats(w, triton_too=True, dispatch=False):
        got, want = both("quant_body_stats", lambda: K.quant_body_stats(w, frames, kind, bits=bits))
        if triton_too and gap > 0 and os.environ.get("TRITON_INTERPRET") == "1":
            from gradzip.kernels.triton.decode import quant_body_stats_triton

            # small programs here; the dispatch below runs the default block
            assert torch.equal(quant_body_stats_triton(w, frames, kind, bits, block=8), want)
        if dispatch and gap > 0 and os.environ.get("TRITON_INTERPRET") == "1":
            monkeypatch.setenv(K.ENV_VAR, "triton")
            assert torch.equal(K.quant_body_stats(w, frames, kind, bits=bits), want)
            assert K.backend_report()["ops"]["quant_body_stats"]["chosen"]["cpu"]["backend"] == "triton"
            monkeypatch.delenv(K.ENV_VAR, raising=False)
        return got, want

    for seed in range(4):
        whole = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        got, want = stats(whole, seed == 0, dispatch=seed == 0)  # (the interpreter is slow: once)
        assert torch.equal(got, want), (seed, got, want)
        clean = _clean(whole, kind, bits, frames)
        got, want = stats(clean, seed == 0)
        assert torch.equal(got, want) and got.tolist() == [0, 0]
    off = frames[1][0]  # the second frame: 2 scales, 13 elements
    for value, sign in ((-0.0, 0), (float("-inf"), 1), (float("nan"), 0), (-1e-45, 1), (-3.0, 1)):
        bad = clean.clone()
        raw = torch.tensor([value], dtype=torch.float32).view(torch.uint8)
        if math.isnan(value):  # a NaN with its sign bit set
            raw = torch.tensor([0x7FC00000 | 0x80000000], dtype=torch.int64).to(torch.int32).view(torch.uint8)
        bad[off + 4 : off + 8] = raw
        got, want = stats(bad)
        assert torch.equal(got, want) and int(got[0]) == sign, value
    if kind != "sign1":
        bad = clean.clone()
        bad[off + 8] = 0x80 if kind == "int8" else (1 << bits) - 1  # the second frame's first code byte
        got, want = stats(bad)
        assert torch.equal(got, want) and int(got[1]) == (1 if kind == "int8" else (1 << bits) - 1)
    if kind in ("qsgd", "tern2") and bits < 8:  # padding bits of the 13-element frame's last byte
        per = 8 // bits
        bad = clean.clone()
        bad[off + 8 + Q.quant_code_bytes(kind, 13, bits) - 1] = (0xFF << ((13 % per) * bits)) & 0xFF
        got, want = stats(bad)
        assert torch.equal(got, want) and got.tolist() == [0, 0]


def test_quant_body_stats_refuses_frames_that_do_not_fit():
    whole = torch.zeros(4 + 5 + 3, dtype=torch.uint8)
    assert K.quant_body_stats(whole, [(0, 1, 5)], "int8").tolist() == [0, 0]
    assert K.quant_body_stats(whole, [(3, 1, 5)], "int8").tolist() == [0, 0]
    with pytest.raises(ValueError, match="past whole's 12"):
        K.quant_body_stats(whole, [(4, 1, 5)], "int8")
    with pytest.raises(ValueError, match="in order without overlap"):
        K.quant_body_stats(whole, [(0, 1, 1), (4, 1, 1)], "int8")
    with pytest.raises(TypeError, match="uint8"):
        K.quant_body_stats(whole.float(), [(0, 1, 5)], "int8")
    with pytest.raises(ValueError, match="bits"):
        K.quant_body_stats(whole, [(0, 1, 5)], "qsgd", bits=3)
    with pytest.raises(ValueError, match="kind"):
        K.quant_body_stats(whole, [(0, 1, 5)], "int4")
