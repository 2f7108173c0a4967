"""Fuzzing every codec: hypothesis cases on random shapes, dtypes and nasty values.

Finite in, finite out: nothing may raise (a format that cannot hold a value raises a
documented ValueError, checked here), shape and dtype survive, the decoded values and the
new residual are finite, and with error feedback the mass is conserved: residual + sent ==
input exactly (for quantizers, to half an ulp of the residual where a sent value is far
above the input). float32, float16, bfloat16 and float64, with each dtype's extremes (float64
well beyond float32's range).

The default run draws 40 cases a codec (derandomized: the same ones every run) and runs one
tensor of every family and dtype; the ``long`` run draws 400.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip.codecs.base import TensorContext
from tests.codecs.test_properties import all_codecs

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
FUZZ_LONG = settings(FUZZ, max_examples=400)
FAMILIES = ["normal", "denormal", "max", "equal", "zero", "mixed"]
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
F32_MAX = torch.finfo(torch.float32).max


BIGS_F64 = [F32_MAX, 1e60, 1e300]  # float64's "max" family: float32's maximum and far beyond it


def _equal_values(fi):
    return [1.0, -3.5, 1e-3, fi.max, fi.tiny]


def nasty_tensor(dtype, shape, family, seed, choice=None):
    """A finite ``dtype`` tensor of ``shape`` from ``family`` (``choice``: float64's maximum for
    "max", the value for "equal")."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    if family == "normal":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif family == "denormal":
        x = signs * fi.smallest_normal * torch.rand(n, generator=g, dtype=torch.float64)
    elif family == "max":
        big = fi.max if dtype != torch.float64 else choice
        x = signs * big * torch.where(torch.rand(n, generator=g) < 0.5, 1.0, torch.rand(n, generator=g).double())
    elif family == "equal":
        x = torch.full((n,), choice, dtype=torch.float64)
    elif family == "zero":
        x = torch.zeros(n, dtype=torch.float64)
    else:  # magnitudes over the whole exponent range, mixed signs
        lo, hi = math.log2(fi.tiny), math.log2(fi.max) - 1
        x = signs * torch.exp2(lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64))
    x = x.to(dtype).reshape(shape)
    assert bool(torch.isfinite(x).all())
    return x


@st.composite
def nasty(draw, dtypes=DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, 23), min_size=0, max_size=3)))
    family = draw(st.sampled_from(FAMILIES))
    seed = draw(st.integers(0, 2**31 - 1))
    choice = None
    if family == "max" and dtype == torch.float64:
        choice = draw(st.sampled_from(BIGS_F64))
    elif family == "equal":
        choice = draw(st.sampled_from(_equal_values(torch.finfo(dtype))))
    return nasty_tensor(dtype, shape, family, seed, choice)


SWEEP_SHAPES = [(3, 7), (), (2,), (1, 1), (23,), (0, 4)]


def every_family():
    """One tensor of every family and dtype (every float64 maximum and every equal value), the
    shapes in turn (0-d, one element, empty, ragged): what 40 random cases may miss."""
    out = []
    for dtype in DTYPES:
        for family in FAMILIES:
            choices = {
                "max": BIGS_F64 if dtype == torch.float64 else [None],
                "equal": _equal_values(torch.finfo(dtype)),
            }
            for choice in choices.get(family, [None]):
                shape = SWEEP_SHAPES[len(out) % len(SWEEP_SHAPES)]
                out.append(nasty_tensor(dtype, shape, family, 1000 + len(out), choice))
    return out


def _unrepresentable(comp, x) -> bool:
    """Threshold's frames (and TopK's with values="sign") carry a float32 scale: float64 values beyond float32's
    range cannot be sent exactly, and it says so."""
    carries_f32 = isinstance(comp, gz.Threshold) or getattr(comp, "values", None) == "sign"
    return carries_f32 and x.dtype == torch.float64 and x.numel() and float(x.abs().max()) > F32_MAX


def _encode(comp, x, step, feedback):
    ctx = TensorContext(name="w", step=step, dtype=x.dtype, store={})
    if _unrepresentable(comp, x):
        with pytest.raises(ValueError, match="float32"):
            comp.encode(x, ctx, feedback=feedback)
        return None, None
    return comp.encode(x, ctx, feedback=feedback)


EXACT = [c for c in all_codecs()]
QUANTIZERS = [
    gz.SignSGD(),
    gz.SignSGD(block=7),
    gz.QSGD(levels=7, block=16),
    gz.QSGD(levels=127),
    gz.TernGrad(clip=2.5),
    gz.Int8(block=5),
    gz.TopK(0.1, values="sign"),
    gz.TopK(0.5, values="sign", scope="call"),
]


def _check_codec(comp, x, step):
    p, _ = _encode(comp, x, step, feedback=False)
    if p is None:
        return
    y = comp.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(torch.isfinite(y).all())
    p, r = _encode(comp, x, step, feedback=True)
    d = comp.decompress(p)
    assert bool(torch.isfinite(d).all()) and bool(torch.isfinite(r).all())
    keep = x.double()
    assert torch.equal(r.double() + d.double(), keep)


def _check_quantizer(comp, x, step):
    """Quantizers may decode far above a tiny input (±scale for 1e-8): there the residual is
    c - d correctly rounded; everywhere else, and always for Int8, it is exact."""
    p, _ = _encode(comp, x, step, feedback=False)
    if p is None:
        return
    y = comp.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())
    p, r = _encode(comp, x, step, feedback=True)
    d = comp.decompress(p)
    assert bool(torch.isfinite(d).all()) and bool(torch.isfinite(r).all())
    keep = x.double()
    err = (r.double() + d.double() - keep).abs()
    ratio = d.double() / keep
    sterbenz = (d == 0) | ((ratio >= 0.5) & (ratio <= 2))
    assert torch.all(err[sterbenz] == 0)
    if type(comp).__name__ == "Int8":
        assert bool(sterbenz.all())
    ulp = torch.nextafter(r.abs(), torch.tensor(math.inf, dtype=r.dtype)).double() - r.abs().double()
    assert torch.all(err <= ulp / 2)


@pytest.mark.parametrize("comp", EXACT, ids=lambda c: repr(c)[:40])
@FUZZ
@given(x=nasty(), step=st.integers(0, 5))
def test_fuzz_codec(comp, x, step):
    _check_codec(comp, x, step)


@pytest.mark.parametrize("comp", QUANTIZERS, ids=lambda c: repr(c)[:40])
@FUZZ
@given(x=nasty(), step=st.integers(0, 5))
def test_fuzz_quantizer(comp, x, step):
    _check_quantizer(comp, x, step)


@pytest.mark.parametrize("comp", EXACT, ids=lambda c: repr(c)[:40])
def test_every_family_and_dtype_codec(comp):
    for step, x in enumerate(every_family()):
        _check_codec(comp, x, step % 6)


@pytest.mark.parametrize("comp", QUANTIZERS, ids=lambda c: repr(c)[:40])
def test_every_family_and_dtype_quantizer(comp):
    for step, x in enumerate(every_family()):
        _check_quantizer(comp, x, step % 6)


@pytest.mark.long
@pytest.mark.parametrize("comp", EXACT, ids=lambda c: repr(c)[:40])
@FUZZ_LONG
@given(x=nasty(), step=st.integers(0, 5))
def test_fuzz_codec_long(comp, x, step):
    _check_codec(comp, x, step)


@pytest.mark.long
@pytest.mark.parametrize("comp", QUANTIZERS, ids=lambda c: repr(c)[:40])
@FUZZ_LONG
@given(x=nasty(), step=st.integers(0, 5))
def test_fuzz_quantizer_long(comp, x, step):
    _check_quantizer(comp, x, step)
