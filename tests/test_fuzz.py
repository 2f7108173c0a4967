"""Fuzzing every compressor: 1,000 hypothesis cases each, on random shapes, dtypes and nasty values.

Nothing may raise (bad input raises documented ValueError/TypeError, tested elsewhere), shape and
dtype survive, and with error feedback the mass is conserved exactly: residual + sent == input.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip.codecs.base import TensorContext
from gradzip.feedback import ErrorFeedback

from .test_compressors import all_compressors

FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
FAMILIES = ["normal", "denormal", "max", "equal", "zero", "mixed"]


@st.composite
def nasty(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    shape = tuple(draw(st.lists(st.integers(0, 23), min_size=0, max_size=3)))
    n = math.prod(shape)
    family = draw(st.sampled_from(FAMILIES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    fi = torch.finfo(dtype)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    if family == "normal":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif family == "denormal":
        x = signs * fi.smallest_normal * torch.rand(n, generator=g, dtype=torch.float64)
    elif family == "max":
        x = signs * fi.max * torch.where(torch.rand(n, generator=g) < 0.5, 1.0, torch.rand(n, generator=g).double())
    elif family == "equal":
        x = torch.full((n,), draw(st.sampled_from([1.0, -3.5, 1e-3, fi.max, fi.tiny])), dtype=torch.float64)
    elif family == "zero":
        x = torch.zeros(n, dtype=torch.float64)
    else:  # magnitudes over the whole exponent range, mixed signs
        lo, hi = math.log2(fi.tiny), math.log2(fi.max) - 1
        x = signs * torch.exp2(lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64))
    x = x.to(dtype).reshape(shape)
    assert bool(torch.isfinite(x).all())
    return x


@pytest.mark.parametrize("comp", all_compressors(), ids=lambda c: repr(c)[:40])
@FUZZ
@given(x=nasty(), step=st.integers(0, 5))
def test_fuzz_compressor(comp, x, step):
    ctx = TensorContext(name="w", step=step, dtype=x.dtype, store={})
    y = comp.decompress(comp.compress(x, ctx))
    assert y.shape == x.shape and y.dtype == x.dtype
    mem = ErrorFeedback()
    c = mem.compensate("w", x)
    keep = c.clone()
    d = comp.decompress(comp.compress(c, TensorContext(name="w", step=step, dtype=x.dtype, store={})))
    mem.update("w", c, d)
    assert torch.equal(mem.residual("w").double() + d.double(), keep.double())


QUANTIZERS = [gz.SignSGD(), gz.SignSGD(block=7), gz.QSGD(levels=7, block=16), gz.TernGrad(clip=2.5), gz.Int8(block=5)]


@pytest.mark.parametrize("comp", QUANTIZERS, ids=lambda c: repr(c)[:40])
@FUZZ
@given(x=nasty(), step=st.integers(0, 5))
def test_fuzz_quantizer(comp, x, step):
    """Quantizers may decode far above a tiny input (±scale for 1e-8): there the float32
    residual is c - d correctly rounded; everywhere else, and always for Int8, it is exact."""
    y = comp.decompress(comp.compress(x, TensorContext(name="w", step=step, dtype=x.dtype, store={})))
    assert y.shape == x.shape and y.dtype == x.dtype
    mem = ErrorFeedback()
    c = mem.compensate("w", x)
    keep = c.double()
    d = comp.decompress(comp.compress(c, TensorContext(name="w", step=step, dtype=x.dtype, store={})))
    assert bool(torch.isfinite(d).all())
    mem.update("w", c, d)
    r = mem.residual("w")
    err = (r.double() + d.double() - keep).abs()
    ratio = d.double() / keep
    sterbenz = (d == 0) | ((ratio >= 0.5) & (ratio <= 2))
    assert torch.all(err[sterbenz] == 0)
    if type(comp).__name__ == "Int8":
        assert bool(sterbenz.all())
    ulp = torch.nextafter(r.abs(), torch.tensor(math.inf)).double() - r.abs().double()
    assert torch.all(err <= ulp / 2)
