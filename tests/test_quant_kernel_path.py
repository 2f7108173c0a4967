"""The quantizers' kernel path (``gradzip.kernels`` sign_ef / qsgd_encode / terngrad_encode /
decode_add_quant), run on CPU tensors with ``GRADZIP_KERNELS=triton`` and the Triton
interpreter, against the eager torch path and the kernel references.

* SignSGD frames are the eager path's bytes; QSGD / TernGrad frames are the Philox
  references' with the seed ``philox_seed(seed, ctx)`` (QSGD's norms to the reference's
  float32 ``vector_norm`` with rtol 1e-5, as in test_kernels_quant.py, the codes bit for bit
  given the norms).
* Decoding (``decompress``, ``accumulate_many``) gives the eager floats bit for bit, and
  corrupt frames raise the eager decoder's errors.
* ``uses_kernel`` follows the dispatch rules; float64 keeps the eager path.
"""
import os

import pytest
import torch

import gradzip.kernels as K
from gradzip.codecs.base import TensorContext
from gradzip.codecs.quant import QSGD, Int8, SignSGD, TernGrad, philox_seed
from gradzip.kernels import reference as R
from gradzip.wire import FMT_QSGD, FMT_TERN2, Payload

pytest.importorskip("triton", reason="triton is not importable; the kernel path needs it")

# As gradzip.kernels.triton.interpreting (conftest sets TRITON_INTERPRET=1 when there is no GPU).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
interp = pytest.mark.skipif(not INTERPRETING, reason="TRITON_INTERPRET is not set (conftest sets it without a GPU)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 1009]


def bits(t):
    return t.contiguous().view(torch.int32)


def same(a, b):
    """Bit for bit (float32, float16 or bfloat16)."""
    ints = torch.int32 if a.element_size() == 4 else torch.int16
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def data(n, dtype, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[x == 0] = 0.5
    return x.to(dtype)


def ctx_for(dtype, rank=1):
    return TensorContext(name="layer.w", step=5, dtype=dtype, rank=rank)


@pytest.fixture
def dispatch(monkeypatch):
    """Switch between the eager path (``eager()``) and the forced Triton kernels (``kernels()``)."""

    class Switch:
        def eager(self):
            monkeypatch.delenv(K.ENV_VAR, raising=False)

        def kernels(self):
            monkeypatch.setenv(K.ENV_VAR, "triton")

        def chosen(self, op):
            return K.backend_report()["ops"][op]["chosen"].get("cpu", {}).get("backend")

    K._reset_for_tests()
    yield Switch()
    K._reset_for_tests()


def both(dispatch, fn):
    dispatch.eager()
    a = fn()
    dispatch.kernels()
    return a, fn()


# -- uses_kernel ------------------------------------------------------------------------------


def test_uses_kernel_follows_the_dispatch(monkeypatch):
    K._reset_for_tests()
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    for op in ("sign_ef", "qsgd_encode", "terngrad_encode", "decode_add_quant"):
        assert K.uses_kernel(op, torch.device("cpu")) is False
    monkeypatch.setenv(K.ENV_VAR, "reference")
    assert K.uses_kernel("sign_ef", "cpu") is False
    monkeypatch.setenv(K.ENV_VAR, "cupy")  # no cupy kernel for the quantizers: the reference runs
    assert K.uses_kernel("qsgd_encode", "cpu") is False
    monkeypatch.setenv(K.ENV_VAR, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert K.uses_kernel("sign_ef", "cpu") is False  # the forced call would raise KernelBackendError
    with pytest.raises(ValueError, match="unknown op"):
        K.uses_kernel("no_such_op", "cpu")
    assert K.backend_report()["ops"]["sign_ef"]["chosen"] == {}  # nothing was called


@interp
def test_uses_kernel_with_forced_triton_under_the_interpreter(dispatch):
    dispatch.kernels()
    for op in ("sign_ef", "qsgd_encode", "terngrad_encode", "decode_add_quant"):
        assert K.uses_kernel(op, torch.device("cpu")) is True
    dispatch.eager()
    SignSGD(block=64).compress(data(100, torch.float32, 0))
    assert dispatch.chosen("sign_ef") is None  # the eager CPU path calls no kernel op


# -- encode -----------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_signsgd_kernel_frames_are_the_eager_bytes(dispatch, dtype, n):
    x = data(n, dtype, n)
    for block in (None, 64, 100):  # one pass (one block; b % 32 == 0) and two passes (100)
        comp = SignSGD(block=block)
        eager, kern = both(dispatch, lambda comp=comp: comp.compress(x, ctx_for(dtype)))
        assert torch.equal(kern.body, eager.body), block
        assert (kern.fmt, kern.shape, kern.dtype, kern.scale) == (eager.fmt, eager.shape, eager.dtype, eager.scale)
    assert dispatch.chosen("sign_ef") == "triton"


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_qsgd_kernel_frames_are_the_philox_reference(dispatch, dtype, n):
    dispatch.kernels()
    x = data(n, dtype, n + 1)
    # one pass: (7, 64), (1, 64), (100, 33), (7, None); two passes: 33 % 2 and 30 % 4 != 0
    for levels, block in ((7, 64), (1, 64), (100, 33), (7, None), (7, 33), (1, 30)):
        comp, ctx = QSGD(levels, block=block, seed=3), ctx_for(dtype)
        frame = comp.compress(x, ctx)
        seed = philox_seed(3, ctx)
        nb, _ = R.quant_layout(n, block)
        norms = frame.body[: 4 * nb].view(torch.float32)
        want_norms, _ = R.qsgd_encode_reference(x, levels, seed, block=block)
        assert torch.allclose(norms, want_norms, rtol=1e-5, atol=0), (levels, block)
        _, codes = R.qsgd_encode_reference(x, levels, seed, block=block, scales=norms)
        assert torch.equal(frame.body[4 * nb :], codes), (levels, block)
        assert (frame.fmt, frame.scale, frame.shape, frame.dtype) == (FMT_QSGD, float(levels), x.shape, dtype)
    assert dispatch.chosen("qsgd_encode") == "triton"


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_terngrad_kernel_frames_are_the_philox_reference(dispatch, dtype, n):
    dispatch.kernels()
    x = data(n, dtype, n + 2)
    for clip, block in ((None, None), (None, 64), (1.5, 64), (None, 50), (2.0, 30)):  # the last two: two passes
        comp, ctx = TernGrad(block=block, clip=clip, seed=4), ctx_for(dtype, rank=2)
        frame = comp.compress(x, ctx)
        scales, codes = R.terngrad_encode_reference(x, philox_seed(4, ctx), block=block, clip=clip)
        assert torch.equal(frame.body, torch.cat([scales.view(torch.uint8), codes])), (clip, block)
        assert frame.fmt == FMT_TERN2
    assert dispatch.chosen("terngrad_encode") == "triton"


@interp
def test_kernel_path_draws_per_rank_and_step(dispatch):
    dispatch.kernels()
    x = data(1009, torch.float32, 9)
    comp = QSGD(7, block=64)
    a, b, c = (comp.compress(x, TensorContext(name="w", step=s, rank=r)).body for s, r in ((1, 0), (1, 1), (2, 0)))
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, comp.compress(x, TensorContext(name="w", step=1, rank=0)).body)  # reproducible


@interp
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy, masked lanes
def test_qsgd_kernel_path_sends_norms_beyond_float32_as_zero(dispatch):
    x = data(256, torch.float32, 11)
    x[64:128] = 3e38  # this block's norm is 2.4e39: beyond float32
    comp, ctx = QSGD(7, block=64), ctx_for(torch.float32)
    eager, kern = both(dispatch, lambda: comp.compress(x, ctx))
    norms = kern.body[:16].view(torch.float32)
    assert float(norms[1]) == 0.0 and bool((norms[[0, 2, 3]] > 0).all())
    assert torch.allclose(norms, eager.body[:16].view(torch.float32), rtol=1e-5, atol=0)
    assert torch.equal(kern.body[16:], R.qsgd_encode_reference(x, 7, philox_seed(0, ctx), block=64, scales=norms)[1])
    assert torch.equal(kern.body[16 + 32 : 16 + 64], torch.full((32,), 0x77, dtype=torch.uint8))  # code s: zero


@interp
def test_float64_keeps_the_eager_path(dispatch):
    x = data(300, torch.float64, 12)
    for comp in (SignSGD(block=64), QSGD(7), TernGrad(block=64)):
        eager, kern = both(dispatch, lambda comp=comp: comp.compress(x, ctx_for(torch.float64)))
        assert torch.equal(eager.body, kern.body)
        d_eager, d_kern = both(dispatch, lambda comp=comp, kern=kern: comp.decompress(kern))
        assert torch.equal(d_eager, d_kern) and d_kern.dtype == torch.float64
    assert K.backend_report()["ops"]["qsgd_encode"]["chosen"] == {}


# -- decode -----------------------------------------------------------------------------------


def _peers(comp, n, dtype=torch.float32, peers=3):
    return [comp.compress(data(n, dtype, 100 * n + p), ctx_for(dtype, rank=p)) for p in range(peers)]


COMPS = {
    "sign1": lambda: SignSGD(block=100),
    "qsgd4": lambda: QSGD(7, block=64),
    "qsgd2": lambda: QSGD(1, block=None),
    "qsgd8": lambda: QSGD(100, block=33),
    "tern2": lambda: TernGrad(block=50),
    "int8": lambda: Int8(block=128),
}


@interp
@pytest.mark.parametrize("kind", list(COMPS))
@pytest.mark.parametrize("n", SIZES)
def test_kernel_decode_is_the_eager_decode(dispatch, kind, n):
    comp = COMPS[kind]()
    dispatch.eager()
    frames = _peers(comp, n)
    out0 = data(n, torch.float32, 5)
    out0[0] = -0.0

    def acc():
        out = out0.clone()
        comp.accumulate_many(frames, out)
        return out

    eager, kern = both(dispatch, acc)
    assert torch.equal(bits(kern), bits(eager))
    assert dispatch.chosen("decode_add_quant") == "triton"
    one = out0.clone()
    comp.accumulate(frames[1], one)
    dispatch.eager()
    want = out0.clone()
    comp.accumulate(frames[1], want)
    assert torch.equal(bits(one), bits(want))


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_decompress_is_the_eager_decompress(dispatch, dtype):
    for comp in (SignSGD(block=64), QSGD(7, block=64), TernGrad(block=64), Int8(block=64)):
        dispatch.eager()
        frame = comp.compress(data(1009, dtype, 6), ctx_for(dtype))
        eager, kern = both(dispatch, lambda comp=comp, frame=frame: comp.decompress(frame))
        assert kern.shape == frame.shape and same(kern, eager), comp
    # Signed zeros survive: QSGD codes below s with a zero norm decode to -0.0.
    body = torch.cat([torch.zeros(4, dtype=torch.uint8), torch.tensor([0x21, 0x77], dtype=torch.uint8)])
    frame = Payload(body=body, shape=(4,), dtype=torch.float32, fmt=FMT_QSGD, vdtype=torch.float32, scale=7.0)
    eager, kern = both(dispatch, lambda: QSGD(7, block=64).decompress(frame))
    assert torch.equal(bits(kern), bits(eager)) and bool(torch.signbit(kern[0]))


def _corrupt(frames, i, pos, value):
    body = frames[i].body.clone()
    body[pos] = value
    frames = list(frames)
    frames[i] = Payload(body=body, shape=frames[i].shape, dtype=frames[i].dtype, fmt=frames[i].fmt, vdtype=torch.float32, scale=frames[i].scale)
    return frames


def _same_error(dispatch, comp, frames, n, match):
    msgs = []
    for mode in (dispatch.eager, dispatch.kernels):
        mode()
        with pytest.raises(ValueError, match=match) as e:
            comp.accumulate_many(frames, torch.zeros(n))
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


@interp
def test_corrupt_frames_raise_the_eager_errors(dispatch):
    n = 1009
    dispatch.eager()
    q, t, i8, s = QSGD(7, block=64), TernGrad(block=64), Int8(block=64), SignSGD(block=64)
    qf, tf, i8f, sf = (_peers(c, n) for c in (q, t, i8, s))
    nbq = 16
    _same_error(dispatch, q, _corrupt(qf, 1, 4 * nbq + 10, 0xF7), n, "code 15 > 2 \\* levels")
    _same_error(dispatch, q, _corrupt(qf, 2, 4 * nbq + 504, 0x0F), n, "code 15 > 2 \\* levels")  # the last, half-used byte
    _same_error(dispatch, t, _corrupt(tf, 2, 4 * nbq + 200, 0x0C), n, "code 3")
    _same_error(dispatch, t, _corrupt(tf, 0, 4 * nbq + 252, 0x03), n, "code 3")  # code 1008, the last element
    _same_error(dispatch, i8, _corrupt(i8f, 1, 4 * nbq + 7, 0x80), n, "code -128")
    short = Payload(body=qf[1].body[:-8], shape=qf[1].shape, dtype=torch.float32, fmt=FMT_QSGD, vdtype=torch.float32, scale=7.0)
    _same_error(dispatch, q, [qf[0], short, qf[2]], n, "corrupt QSGD frame: .* bytes, expected")
    # peer 0's bad code comes before peer 1's bad length, as peer by peer
    _same_error(dispatch, q, [_corrupt(qf, 0, 4 * nbq, 0xFF)[0], short], n, "code 15")
    _same_error(dispatch, s, [sf[0], tf[1]], n, "SignSGD cannot decode frame format")
    _same_error(dispatch, QSGD(3, block=64), qf, n, "levels=7, this QSGD has levels=3")
    # Bits past the last element (the unused half of the last QSGD byte) are ignored by both.
    pad = _corrupt(qf, 1, 4 * nbq + 504, 0xF6)

    def decode():
        out = torch.zeros(n)
        q.accumulate_many(pad, out)
        return out

    eager, kern = both(dispatch, decode)
    assert torch.equal(bits(kern), bits(eager))
