"""Property tests (hypothesis) for every compressor, plus argument validation."""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip import _names
from gradzip.codecs.base import TensorContext
from gradzip.codecs.positions import ef_nbytes, pack_gaps, unpack_ef
from gradzip.codecs.threshold import FMT_BITMAP2, FMT_SIGNED_INDEX, exact_tau
from gradzip.codecs.topk import FMT_SPARSE, FMT_SPARSE_EF
from gradzip.wire import ENTRY_BYTES, FMT_DENSE, FMT_EMPTY, HEADER_BYTES, pack_frames

settings.register_profile("gz", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("gz")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


#: The settings the properties below run, per codec of gradzip's table (``gradzip._names``):
#: a codec not named here runs with its defaults, so a new exported codec is tested by its
#: table entry alone. An empty tuple leaves a codec out: the quantizers, whose error feedback
#: rounds (``v - decompress(p)`` is not exact for SignSGD, QSGD, TernGrad), are checked in
#: ``tests/codecs/test_quant.py``; ``DCT`` (exact up to the transforms' rounding) in
#: ``tests/codecs/test_transform.py``.
SETTINGS = {
    "Threshold": (
        "Threshold(tau=0.05)",
        "Threshold(tau=1e-3, policy='adaptive')",
        "Threshold(policy='target', density=0.1)",
        "Threshold(tau=0.1, shake_every=2)",
    ),
    "TopK": ("TopK(ratio=0.1)", "TopK(ratio=0.1, mode='sampled', sample=16)"),
    "RandomK": ("RandomK(ratio=0.2, seed=3)",),
    "SignSGD": (),
    "QSGD": (),
    "TernGrad": (),
    "Int8": (),
    "DCT": (),  # its error feedback rounds in the transforms: tests/codecs/test_transform.py
    "ChunkTopK": ("ChunkTopK(k=8, chunk=16)", "ChunkTopK(k=8, chunk=16, values='bf16')"),
    "Int2": (),  # error feedback rounds like SignSGD's (c - d correctly rounded): tests/codecs/test_lowbit.py
}


def all_codecs():
    """Every codec of gradzip's table, in the settings of :data:`SETTINGS`."""
    return [gz.parse(spec) for name in _names.methods("codec") for spec in SETTINGS.get(name, (f"{name}()",))]


COMPRESSORS = all_codecs()
IDS = [repr(c)[:40] for c in COMPRESSORS]

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple),
)


@st.composite
def tensors(draw, dtype=torch.float32, max_abs=1e4):
    shape = draw(shapes)
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 100.0, max_abs]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if n and draw(st.booleans()):  # a few ties and exact zeros
        x[:: max(1, n // 3)] = 0.0
    return x.clamp(-max_abs, max_abs).to(dtype).reshape(shape)


def ctx_for(x, step=0, name="w"):
    return TensorContext(name=name, step=step, dtype=x.dtype, store={})


# The dtype is drawn with the tensor (each of the 40 cases a codec runs, not a parametrization
# each): every dtype occurs (a dtype missing from 40 draws: about 1e-7).
@pytest.mark.parametrize("comp", COMPRESSORS, ids=IDS)
@settings(max_examples=40)
@given(data=st.data())
def test_shape_and_dtype_survive(comp, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    x = data.draw(tensors(dtype=dtype, max_abs=6e4))
    p = comp.compress(x, ctx_for(x))
    y = comp.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("comp", COMPRESSORS, ids=IDS)
@settings(max_examples=40)
@given(data=st.data())
def test_error_feedback_is_exact(comp, data):
    """``encode`` with feedback: residual + decompressed == gradient + old residual, exactly,
    over several steps (the residual written into a reused buffer, as the engine does)."""
    dtype = data.draw(st.sampled_from(DTYPES))
    store: dict = {}
    r, spare = None, None
    for step in range(3):
        g = data.draw(tensors(dtype=dtype, max_abs=6e4))
        if step and g.shape != r.shape:
            g = torch.randn(r.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        keep = g.float() + (r if r is not None else 0.0)
        out = spare if spare is not None and spare.shape == g.shape else torch.empty(g.shape)
        p, new = comp.encode(
            g, TensorContext(name="w", step=step, dtype=g.dtype, store=store), r, feedback=True, out=out
        )
        d = comp.decompress(p)
        assert new.dtype == torch.float32 and new.data_ptr() == out.data_ptr()
        assert torch.equal(new + d, keep)
        assert torch.equal(new.double() + d.double(), keep.double())  # no rounding hid a loss
        spare, r = r, new


@given(data=st.data())
def test_threshold_sends_sign_tau_at_and_above_tau(data):
    x = data.draw(tensors())
    tau = data.draw(st.sampled_from([1e-7, 1e-3, 0.3, 2.0, 1e3]))
    p = gz.Threshold(tau=tau).compress(x)
    y = gz.Threshold(tau=tau).decompress(p)
    if p.fmt == FMT_EMPTY:
        assert not torch.any(y)
        return
    t = p.scale
    assert t == exact_tau(tau, float(x.abs().max()))
    assert t <= tau and t >= tau * (1 - 2**-8) or float(x.abs().max()) >= 2**16 * tau
    sel = x.abs() >= t
    assert torch.equal(y != 0, sel)
    assert torch.equal(y[sel], torch.sign(x[sel]) * t)


@given(data=st.data())
def test_threshold_frame_never_exceeds_the_bitmap_bound(data):
    x = data.draw(tensors())
    tau = data.draw(st.sampled_from([1e-9, 1e-3, 0.5, 1e9]))
    p = gz.Threshold(tau=tau).compress(x)
    n = x.numel()
    framed = pack_frames([p])
    assert framed.numel() <= math.ceil(n / 4) + HEADER_BYTES + ENTRY_BYTES + 4  # the entry carries tau
    if p.fmt == FMT_SIGNED_INDEX:
        assert p.body.numel() <= math.ceil(n / 4)
    if p.fmt == FMT_BITMAP2:
        assert p.body.numel() == math.ceil(n / 4)


def test_threshold_switches_to_bitmap_when_dense():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert gz.Threshold(tau=3.0).compress(x).fmt == FMT_SIGNED_INDEX
    assert gz.Threshold(tau=0.01).compress(x).fmt == FMT_BITMAP2
    assert gz.Threshold(tau=100.0).compress(x).fmt == FMT_EMPTY


def test_threshold_exact_residual_where_naive_subtraction_rounds():
    # |v| / tau = 1e6: with tau = 1e-6 taken literally, v - tau rounds in float32.
    v = torch.tensor([1.0, -0.75, 3e-7], dtype=torch.float32)
    naive = v[0] - torch.tensor(1e-6)
    assert (naive + torch.tensor(1e-6)).double() != 1.0 or naive.double() + 1e-6 != 1.0
    comp = gz.Threshold(tau=1e-6)
    p, r = comp.encode(v, feedback=True)
    d = comp.decompress(p)
    assert torch.equal(r.double() + d.double(), v.double())


@pytest.mark.parametrize("density", [0.001, 0.3, 0.9])  # index frames, then 2-bit maps
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_threshold_subtract_is_the_dense_subtraction(density, dtype):
    # the sparse subtract (v + -tau where sent) against v - decompress(p), bit for bit; float16
    # takes the dense way (its decoded tau rounds first)
    comp = gz.Threshold(policy="target", density=density)
    v = (torch.randn(5000, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 3).to(dtype)
    v[::97] = 0.0
    p = comp.compress(v)
    a, b = v.clone(), v.clone()
    comp.subtract(p, a)
    b.sub_(comp.decompress(p))
    assert torch.equal(a, b) and not torch.equal(a, v)
    with pytest.raises(ValueError, match="subtracted from"):
        comp.subtract(p, v[:-1].clone())


def test_threshold_adaptive_moves_tau_into_band():
    comp = gz.Threshold(tau=10.0, policy="adaptive", band=(0.01, 0.05), decay=0.5)
    ctx = TensorContext(name="w")
    g = torch.Generator().manual_seed(0)
    fracs = []
    for step in range(40):
        ctx.step = step
        x = torch.randn(10_000, generator=g)
        p = comp.compress(x, ctx)
        fracs.append(float((comp.decompress(p) != 0).float().mean()))
    assert ctx.store["tau"] < 10.0
    assert all(0.005 <= f <= 0.1 for f in fracs[-10:]), fracs[-10:]


def test_threshold_target_density():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    p = gz.Threshold(policy="target", density=0.001).compress(x)
    sent = int((gz.Threshold().decompress(p) != 0).sum())
    assert 100 <= sent <= 102


def test_threshold_shake_up_uses_smaller_tau_every_k_steps():
    comp = gz.Threshold(tau=1.0, shake_every=3, shake_factor=4.0)
    x = torch.full((10,), 0.5)
    taus = [comp.compress(x, TensorContext(name="w", step=s)).scale for s in range(6)]
    sent = [comp.compress(x, TensorContext(name="w", step=s)).fmt != FMT_EMPTY for s in range(6)]
    assert sent == [False, False, True, False, False, True]
    assert taus[2] == taus[5] == 0.25


def test_threshold_nothing_selected_gives_header_only_frame():
    p = gz.Threshold(tau=1.0).compress(torch.full((1000,), 1e-3))
    assert p.fmt == FMT_EMPTY and p.body.numel() == 0
    assert pack_frames([p]).numel() == HEADER_BYTES + ENTRY_BYTES + 4  # header, entry, tau: no body


@pytest.mark.parametrize("mode", ["exact", "sampled"])
@given(data=st.data())
def test_topk_keeps_the_k_largest(mode, data):
    x = data.draw(tensors())
    assume(x.numel() > 0)
    ratio = data.draw(st.sampled_from([0.01, 0.1, 0.3]))
    comp = gz.TopK(ratio=ratio, mode=mode, sample=8)
    p = comp.compress(x, ctx_for(x))
    y = comp.decompress(p)
    if p.fmt == FMT_DENSE:  # sparse would not be smaller: everything is sent
        assert torch.equal(y, x)
        return
    k = min(x.numel(), max(1, math.ceil(ratio * x.numel())))
    sel = y != 0
    kept = x[sel].abs()
    dropped = x[~sel].abs()
    assert int(sel.sum()) <= k  # fewer only where selected values are exactly zero
    if mode == "exact":
        assert int(sel.sum()) == min(k, int((x != 0).sum()))
    assert torch.equal(y[sel], x[sel])
    if kept.numel() and dropped.numel() and mode == "exact":
        assert kept.min() >= dropped.max()


def test_topk_exact_selects_exactly_k():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    comp = gz.TopK(ratio=0.05)
    p = comp.compress(x)
    y = comp.decompress(p)
    idx = (y != 0).nonzero().reshape(-1)
    # exact mode: the positions in Elias-Fano code, 4 low bits each (floor(log2(1000 / 50))) and a
    # bitmap of 50 + (999 >> 4) + 1 = 113 bits, after a one-byte count: 1 + 25 + 15 bytes
    assert p.fmt == FMT_SPARSE_EF and p.body.numel() == ef_nbytes(1000, 50) + 50 * 4 == 41 + 200
    assert torch.equal(unpack_ef(p.body, 1000, 4)[0], idx)
    sampled = gz.TopK(ratio=0.05, mode="sampled", sample=64).compress(x)  # counts vary: the gaps
    assert sampled.fmt == FMT_SPARSE and not gz.TopK(0.05, mode="sampled").fixed_frames
    gaps = pack_gaps(idx)  # width, count, the gaps at the width of the largest (< 1000: 10 bits at most)
    assert gaps.numel() <= 2 + math.ceil(50 * 10 / 8)
    assert int((y != 0).sum()) == 50
    assert torch.equal(
        torch.sort(x.abs(), descending=True).values[:50], torch.sort(y.abs(), descending=True).values[:50]
    )


def test_topk_sampled_count_close_to_k():
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    comp = gz.TopK(ratio=0.001, mode="sampled", sample=100_000)
    y = comp.decompress(comp.compress(x, TensorContext(name="w")))
    assert 900 <= int((y != 0).sum()) <= 1000


def test_topk_falls_back_to_a_mask_then_to_dense():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    p = gz.TopK(ratio=0.5).compress(x)  # a bit per element (13 bytes) and 50 values beat the gaps
    assert p.fmt == 5 and p.body.numel() == 13 + 50 * 4
    assert torch.equal(gz.TopK(ratio=0.5).decompress(p) != 0, x.abs() >= x.abs().sort().values[50])
    assert gz.TopK(ratio=0.99).compress(x).fmt == FMT_DENSE  # 99 values and a mask: more than 400 bytes


def test_topk_values_in_gradient_dtype_unless_they_overflow_it():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    # the counts of exact mode are fixed, and so is the frame: one value dtype, overflow saturating
    p = gz.TopK(ratio=0.01).compress(x, TensorContext(dtype=torch.float16))
    assert p.vdtype == torch.float16 and p.body.numel() == ef_nbytes(1000, 10) + 10 * 2
    x[3] = 1e6  # a compensated float32 value beyond float16's range
    q, r = gz.TopK(ratio=0.01).encode(x, TensorContext(dtype=torch.float16), feedback=True)
    assert q.vdtype == torch.float16 and q.body.numel() == p.body.numel()
    d = gz.TopK().decompress(q)
    assert float(d[3]) == 65504.0 and torch.equal(r.double() + d.double(), x.double())  # nothing lost
    # sampled counts vary anyway: a frame whose value outgrew the gradient's dtype goes in the input's
    x[3] = 1.0
    sampled = gz.TopK(ratio=0.01, mode="sampled", sample=100)
    p = sampled.compress(x, TensorContext(dtype=torch.float16))
    gaps = pack_gaps((sampled.decompress(p) != 0).nonzero().reshape(-1)).numel()
    assert p.vdtype == torch.float16 and p.fmt == FMT_SPARSE and p.body.numel() == gaps + p.parsed[0].numel() * 2
    x[3] = 1e6
    p = sampled.compress(x, TensorContext(dtype=torch.float16))
    assert p.vdtype == torch.float32 and p.body.numel() > 10 * 4
    assert sampled.decompress(p)[3] == 1e6
    # values="fp16" asks for half values: finite ones saturate, error feedback keeps the rest
    q, r = gz.TopK(ratio=0.01, values="fp16").encode(x, feedback=True)
    assert q.vdtype == torch.float16
    d = gz.TopK().decompress(q)
    assert float(d[3]) == 65504.0 and torch.equal(r.double() + d.double(), x.double())


def test_randomk_indices_are_shared_and_change_per_step():
    comp = gz.RandomK(ratio=0.1, seed=7)
    a = comp.indices(1000, TensorContext(name="layer.weight", step=3), "cpu")
    b = gz.RandomK(ratio=0.1, seed=7).indices(1000, TensorContext(name="layer.weight", step=3), "cpu")
    c = comp.indices(1000, TensorContext(name="layer.weight", step=4), "cpu")
    d = comp.indices(1000, TensorContext(name="layer.bias", step=3), "cpu")
    assert torch.equal(a, b) and a.numel() == 100 and a.unique().numel() == 100
    assert not torch.equal(a, c) and not torch.equal(a, d)


@pytest.mark.parametrize("comp", [gz.Identity(), gz.FP16(), gz.BF16(), gz.RandomK(0.3)], ids=str)
def test_summable_payloads_add_up(comp):
    xs = [torch.randn(57, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ctx = TensorContext(name="w", step=5)
    ps = [comp.compress(x, ctx) for x in xs]
    total = dataclasses.replace(ps[0], body=sum(p.body.double() for p in ps).to(ps[0].body.dtype))
    assert comp.summable
    torch.testing.assert_close(comp.decompress(total), sum(comp.decompress(p) for p in ps), rtol=1e-2, atol=1e-2)


DENSE_WIRE = [c for c in COMPRESSORS if c.dense_wire(torch.float32) is not None]


@pytest.mark.parametrize("comp", DENSE_WIRE, ids=str)
@given(data=st.data())
def test_compress_into_and_decompress_into_are_compress_and_decompress_bit_for_bit(comp, data):
    # the casts' one-buffer path (Allreduce): the same body bytes, and the same decoded values in
    # every output dtype; values beyond the wire's range (saturated) and non-finite ones included;
    # the input dtype drawn too (each of the 4 occurs in 60 draws but for about 1e-7)
    dtype = data.draw(st.sampled_from(DTYPES + [torch.float64]))
    x = data.draw(tensors(dtype=torch.float64, max_abs=1e6)).to(dtype)
    if x.numel() and data.draw(st.booleans()):
        x.view(-1)[0] = data.draw(st.sampled_from([math.inf, -math.inf, math.nan, 1e30, -7e4]))
    wire = comp.dense_wire(dtype)
    ref = comp.compress(x, ctx_for(x))
    body = torch.full((x.numel() + 2,), 3.0, dtype=wire)  # the call's buffer: neighbours untouched
    got = comp.compress_into(x, body[1:-1], ctx_for(x))
    assert (got.shape, got.dtype, got.vdtype) == (ref.shape, ref.dtype, ref.vdtype)
    assert got.body.data_ptr() == body[1:].data_ptr() or not x.numel()
    assert torch.equal(got.body.reshape(-1).view(torch.int16), ref.body.reshape(-1).view(torch.int16))
    assert body[0].item() == body[-1].item() == 3.0
    dec = comp.decompress(ref).reshape(-1)
    for out_dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        out = torch.full((x.numel() + 2,), 5.0, dtype=out_dtype)
        comp.decompress_into(ref, out[1:-1])
        assert _same(out[1:-1], dec.to(out_dtype))
        assert out[0].item() == out[-1].item() == 5.0
    with pytest.raises(ValueError, match="body must hold"):
        comp.compress_into(x, torch.empty(x.numel() + 1, dtype=wire))


def _same(a, b):
    """Equal element for element, NaN where NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("comp", COMPRESSORS, ids=IDS)
@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_single_element(comp, n):
    for shape in ([n], [n, 3], ()) if n else ([0], [0, 5]):
        x = torch.full(shape, 0.7)
        y = comp.decompress(comp.compress(x, ctx_for(x)))
        assert y.shape == x.shape


@pytest.mark.parametrize("comp", COMPRESSORS, ids=IDS)
def test_non_floating_input_raises_type_error(comp):
    with pytest.raises(TypeError, match="floating point"):
        comp.compress(torch.arange(10), TensorContext())


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: gz.Threshold(tau=0), "tau"),
        (lambda: gz.Threshold(tau=-1.0), "tau"),
        (lambda: gz.Threshold(tau=float("nan")), "tau"),
        (lambda: gz.Threshold(policy="magic"), "policy"),
        (lambda: gz.Threshold(band=(0.5, 0.1)), "band"),
        (lambda: gz.Threshold(decay=1.5), "decay"),
        (lambda: gz.Threshold(growth=0.9), "growth"),
        (lambda: gz.Threshold(density=0), "density"),
        (lambda: gz.Threshold(shake_every=-1), "shake_every"),
        (lambda: gz.Threshold(shake_factor=1.0), "shake_factor"),
        (lambda: gz.TopK(ratio=0), "ratio"),
        (lambda: gz.TopK(ratio=1.5), "ratio"),
        (lambda: gz.TopK(ratio="0.1"), "ratio"),
        (lambda: gz.TopK(mode="fast"), "mode"),
        (lambda: gz.TopK(sample=0), "sample"),
        (lambda: gz.RandomK(ratio=-0.1), "ratio"),
        (lambda: gz.RandomK(seed=1.5), "seed"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg) as e:
        make()
    assert "must be" in str(e.value)


# -- error feedback inside the codec call: the fused one-pass kernels ---------------------------
def _run_call(method, names, tensors, memory, step, stores, world=2):
    """One protocol call against a loopback communicator, error feedback in ``memory``."""
    from gradzip.costmodel.dryrun import LoopbackComm
    from gradzip.protocols import Call, as_protocol

    comm = LoopbackComm(world)
    ctx = lambda n, d: TensorContext(name=n, step=step, dtype=d, store=stores.setdefault(n, {}), world_size=world)  # noqa: E731
    call = Call(
        comm=comm,
        names=names,
        tensors=tensors,
        contexts=[ctx(n, t.dtype) for n, t in zip(names, tensors)],
        memory=memory,
        out_dtype=tensors[0].dtype,
        make_context=ctx,
    )
    gen = as_protocol(method, world).exchange(call)
    try:
        while True:
            next(gen)
            comm.complete()
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize(
    "codec, op, module",
    [
        (gz.Threshold(tau=0.3), "threshold_ef", ("gradzip.kernels.triton.threshold", "threshold_ef_triton")),
        (gz.SignSGD(block=64), "sign_ef", ("gradzip.kernels.triton.sign", "sign_ef_triton")),
    ],
    ids=["Threshold", "SignSGD"],
)
def test_error_feedback_runs_the_fused_kernel_once_per_tensor_and_equals_the_unfused_path(
    codec, op, module, monkeypatch
):
    """Through a protocol call with error feedback (the engine's path), the Triton kernel (the
    interpreter here) runs once per tensor with the residual, and payloads and residuals equal
    the unfused reference: compensate, compress, decompress, subtract, bit for bit."""
    import importlib

    from gradzip import kernels as K
    from gradzip.feedback import ErrorFeedback
    from tests.support import RefMemory

    pytest.importorskip("triton")
    real = getattr(importlib.import_module(module[0]), module[1])
    calls = []

    def counting(x, *a, **kw):
        calls.append(
            kw.get("out") is not None
            and (len(a) > 1 and a[1] is not None or a and op == "sign_ef" and a[0] is not None)
        )
        return real(x, *a, **kw)

    monkeypatch.setenv("GRADZIP_KERNELS", "triton")
    K.register_kernel(op, "triton", counting, first=True)
    try:
        gen = torch.Generator().manual_seed(0)
        names = ["a", "b", "c"]
        mem, ref, stores = ErrorFeedback(), RefMemory(), {}
        for step in range(3):
            grads = [(torch.rand(s, generator=gen) * 1.2 - 0.6) for s in ((40, 8), (130,), (3, 7))]
            calls.clear()
            snapshot = {n: dict(s) for n, s in stores.items()}
            _run_call(codec, names, grads, mem, step, stores)
            if step:  # a residual exists: one fused call per tensor, each with it
                assert calls == [True] * len(names), calls
            for n, g in zip(names, grads):
                c = ref.compensate(n, g)
                st = snapshot.get(n, {})
                p = codec.compress(c, TensorContext(name=n, step=step, dtype=c.dtype, store=dict(st)))
                ref.update(n, c, codec.decompress(p))
                assert torch.equal(mem.residual(n), ref.residual(n)), (step, n)
            assert K.backend_report()["ops"][op]["chosen"]["cpu"]["backend"] == "triton"
    finally:
        K.register_kernel(op, "triton", module)


@pytest.mark.parametrize(
    "codec",
    [gz.QSGD(levels=7, block=64), gz.QSGD(levels=1, block=None), gz.TernGrad(block=256), gz.TernGrad(clip=2.0)],
    ids=repr,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_stochastic_quantizer_frames_are_the_same_on_cpu_and_in_the_triton_kernel(codec, dtype, monkeypatch):
    """One implementation: the CPU reference draws Philox like the kernel, so a frame is the
    same bit for bit whichever runs it (the Triton interpreter stands in for the GPU)."""
    pytest.importorskip("triton")
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    ctx = TensorContext(name="layer.weight", step=11, dtype=dtype, rank=1, world_size=4)
    monkeypatch.setenv("GRADZIP_KERNELS", "reference")
    cpu = codec.compress(x, ctx)
    monkeypatch.setenv("GRADZIP_KERNELS", "triton")
    tri = codec.compress(x, ctx)
    assert torch.equal(cpu.body, tri.body) and cpu.fmt == tri.fmt
