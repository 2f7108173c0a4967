"""Kernel dispatch and the sparsifying reference ops (CPU only; no triton or cupy needed).
The quantizer references are tested in tests/kernels/test_quant_ops.py."""

import math

import pytest
import torch

import gradzip.kernels as K
from gradzip.kernels import dispatch as D
from gradzip.kernels import reference as R
from tests.support import fresh

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def clean_dispatch(monkeypatch):
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    K.reset_dispatch()
    registry = {op: dict(impls) for op, impls in D._REGISTRY.items()}
    references = dict(D._REFERENCE)
    yield
    D._REGISTRY.clear()
    D._REGISTRY.update(registry)
    D._REFERENCE.clear()
    D._REFERENCE.update(references)
    K.reset_dispatch()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so -0.0 != 0.0 and NaN == NaN."""
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def rand(n, dtype=torch.float32, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- the reference ops --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1009])
def test_threshold_ef_reference_is_exact_error_feedback(dtype, n):
    x, r = rand(n, dtype, 1), rand(n, torch.float32, 2) * 0.25
    tau = 0.75
    res = R.threshold_ef_reference(x, tau, r)
    v = x.float() + r
    pos, neg = v >= tau, v <= -tau
    assert res.count == int((pos | neg).sum())
    assert res.amax == float(v.abs().max())
    sent = torch.zeros(n)
    sent[pos], sent[neg] = tau, -tau
    assert torch.equal(res.residual + sent, v)
    assert torch.equal(res.residual.double() + sent.double(), v.double())  # nothing lost to rounding
    codes = K.unpack_2bit(res.bitmap(), n)
    assert torch.equal(codes == 1, pos) and torch.equal(codes == 2, neg)
    idx, negative = K.decode_signed_indices(res.indices())
    assert torch.equal(idx, (pos | neg).nonzero().reshape(-1)) and torch.equal(negative, neg[idx])
    assert R.threshold_ef_reference(x, tau).residual is None
    x32 = x.float()
    sent_x = torch.zeros(n)
    sent_x[x32 >= tau], sent_x[x32 <= -tau] = tau, -tau
    assert torch.equal(R.threshold_ef_reference(x, tau, new_residual=True).residual, x32 - sent_x)


def test_threshold_ef_reference_amax_is_nan_aware_and_empty_is_zero():
    x = torch.tensor([1.0, float("nan"), -3.0])
    assert math.isnan(R.threshold_ef_reference(x, 0.5).amax)
    empty = R.threshold_ef_reference(torch.empty(0), 0.5)
    assert empty.count == 0 and empty.amax == 0.0 and empty.bitmap().numel() == 0 and empty.indices().numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_threshold_ef_writes_the_residual_into_out_even_over_its_inputs(dtype):
    """out= is the residual passed in (in place), x itself, or a separate tensor; the result's
    residual is that very tensor, and everything else is as without it."""
    n, tau = 1009, 0.75
    x, r = rand(n, dtype, 1), rand(n, dtype, 2) * 0.5
    want = R.threshold_ef_reference(x, tau, r)
    want_x = R.threshold_ef_reference(x, tau, new_residual=True)
    cases = [
        ("separate", x, r, torch.empty(n, dtype=dtype), want),
        ("residual", x, r, None, want),
        ("x", x, None, None, want_x),
    ]
    for name, x0, r0, out, ref in cases:
        x0, r0 = x0.clone(), None if r0 is None else r0.clone()
        out = {"residual": r0, "x": x0}.get(name, out)
        got = K.threshold_ef(x0, tau, r0, out=out)
        assert got.residual is out, name
        assert torch.equal(bits(out), bits(ref.residual)), name
        assert got.count == ref.count and got.amax == ref.amax and torch.equal(got.bitmap(), ref.bitmap()), name
        assert torch.equal(got.indices(), ref.indices()), name
    grid = torch.empty(3, 4)  # any contiguous shape of n elements: returned as it is
    got = K.threshold_ef(rand(12), tau, out=grid)
    assert got.residual is grid and torch.equal(
        grid.reshape(-1), R.threshold_ef_reference(rand(12), tau, new_residual=True).residual
    )


def test_out_is_checked():
    x = rand(8)
    with pytest.raises(ValueError, match="new_residual=False"):
        K.threshold_ef(x, 1.0, out=torch.empty(8), new_residual=False)
    with pytest.raises(TypeError, match="float32"):
        K.threshold_ef(x, 1.0, out=torch.empty(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="float64"):
        K.sign_ef(x.double(), out=torch.empty(8))
    with pytest.raises(ValueError, match="contiguous"):
        K.sign_ef(x, out=torch.empty(9))
    with pytest.raises(ValueError, match="contiguous"):
        K.threshold_ef(x, 1.0, out=torch.empty(16)[::2])


def test_decode_add_bitmap2_reference_adds_peers_in_order():
    n = 11
    codes = [
        torch.tensor([0, 1, 2, 3, 1, 1, 2, 0, 0, 2, 1], dtype=torch.uint8),
        torch.randint(0, 3, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)),
    ]
    bodies = [K.pack_2bit(c) for c in codes]
    out = rand(n)
    want = out.clone()
    for c, tau in zip(codes, [0.5, 0.25]):
        want = want + ((c == 1).float() * tau - (c == 2).float() * tau)
    R.decode_add_bitmap2_reference(out, bodies, [0.5, 0.25])
    assert torch.equal(out, want)


def test_scatter_adds_reference():
    out = torch.zeros(10)
    words = K.encode_signed_indices(torch.tensor([1, 4, 9]), torch.tensor([False, True, False]))
    R.scatter_add_signed_reference(out, words, 0.5)
    assert out.tolist() == [0, 0.5, 0, 0, -0.5, 0, 0, 0, 0, 0.5]
    R.scatter_add_sparse_reference(
        out, torch.tensor([0, 4], dtype=torch.int32), torch.tensor([2.0, 1.0], dtype=torch.bfloat16)
    )
    assert out.tolist() == [2, 0.5, 0, 0, 0.5, 0, 0, 0, 0, 0.5]


def test_abs_select_and_sampled_topk_reference():
    v = rand(10_000, seed=3)
    thr = v.abs().kthvalue(10_000 - 100).values
    idx = R.abs_select_reference(v, thr)
    assert torch.equal(idx, (v.abs() >= thr).nonzero().reshape(-1)) and idx.numel() == 101
    probe = torch.randint(10_000, (2000,), generator=torch.Generator().manual_seed(1))
    sel = R.sampled_topk_reference(v, 100, probe)
    assert sel.numel() <= 100 and torch.equal(sel, sel.sort().values)
    assert 90 <= sel.numel() <= 100
    thr_s = R.sampled_topk_threshold(v, 100, probe)
    survivors = R.abs_select_reference(v, thr_s)
    assert survivors.numel() > 100  # aimed 25% high, then trimmed to the exact top 100 of them
    dropped = survivors[~torch.isin(survivors, sel)]
    assert sel.numel() == 100 and v.abs()[sel].min() >= v.abs()[dropped].max()


def approx_cases():
    """Distributions for the approximate top-k: (name, v, k, sample size)."""
    g = torch.Generator().manual_seed(11)
    n = 200_000
    normal = torch.randn(n, generator=g)
    cases = [
        ("normal", normal, 200, 20_000),
        ("normal_tiny_k", normal, 7, 20_000),
        ("normal_big_k", normal, 20_000, 20_000),
        ("cauchy", torch.empty(n).cauchy_(generator=g), 500, 20_000),
        ("lognormal", torch.empty(n).log_normal_(generator=g), 2_000, 4_000),
        (
            "layers",
            torch.cat([torch.randn(n // 2, generator=g) * 1e-3, torch.randn(n // 2, generator=g)]),
            1_000,
            20_000,
        ),
        ("sparse_ties", torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.002), 1_000, 20_000),
        ("constant", torch.full((n,), 0.25), 300, 20_000),
    ]
    return [(name, v, k, torch.randint(n, (s,), generator=g)) for name, v, k, s in cases]


def test_sampled_topk_approx_stays_in_band_and_sends_the_largest():
    """The approximate top-k: a count within 10% of k, ascending distinct indices, and every
    element it leaves out no larger than any it sends (a threshold set); the cheap routes
    (no exact top-k) taken where no ties sit at the threshold."""
    routes = {}
    for name, v, k, probe in approx_cases():
        got = []
        idx = R.sampled_topk_approx_reference(v, k, probe, route=got)
        routes[name] = got[0]
        lo, hi = R.approx_band(k)
        assert lo <= idx.numel() <= hi, (name, idx.numel(), k)
        assert lo >= math.ceil(0.9 * k) and hi <= math.floor(1.1 * k)
        assert bool((idx.diff() > 0).all()), name
        out = torch.ones(v.numel(), dtype=torch.bool)
        out[idx] = False
        assert v[idx].abs().min() >= v[out].abs().max(), name
    assert routes["constant"] == "trim" and routes["sparse_ties"] in ("resampled", "trim")
    for name in ("normal", "cauchy", "lognormal", "layers", "normal_big_k"):
        assert routes[name] in ("survivors", "resampled"), (name, routes[name])
    assert routes["normal_big_k"] == "survivors"  # k s / n = 2000 samples: the first threshold lands in the band
    # A probe of the largest elements only overestimates the threshold: the exact route.
    v = rand(50_000, seed=4)
    top = torch.topk(v.abs(), 10).indices
    got = []
    idx = R.sampled_topk_approx_reference(v, 500, top.repeat(100), route=got)
    assert got == ["exact"] and torch.equal(idx, torch.topk(v.abs(), 500).indices.sort().values)
    assert R.approx_band(1) == (1, 1) and R.approx_band(10) == (9, 11) and R.approx_band(25) == (23, 27)


def test_topk_codec_approx_mode():
    import gradzip as gz
    from gradzip.codecs.base import TensorContext

    m = gz.TopK(0.001, mode="approx", sample=8192)
    assert gz.parse(repr(m)).config() == m.config() and gz.TopK().mode == "exact"
    x = rand(300_000, seed=9)
    k = 300
    for step in range(3):
        p = m.compress(x, TensorContext(name="w", step=step, dtype=x.dtype))
        sent = m.decompress(p).reshape(-1)
        nz = sent.nonzero().reshape(-1)
        lo, hi = R.approx_band(k)
        assert lo <= nz.numel() <= hi and torch.equal(sent[nz], x[nz])
    small = m.compress(x[:5000], TensorContext(name="s", dtype=x.dtype))  # <= sample: the exact route
    assert (m.decompress(small) != 0).sum() == 5
    with pytest.raises(ValueError, match="mode"):
        gz.TopK(0.01, mode="approximate")


# -- dispatch -------------------------------------------------------------------------------------


def test_cpu_tensors_use_numba_or_the_reference(clean_dispatch, monkeypatch):
    res = K.threshold_ef(rand(100), 0.5)
    assert res.backend == "numba"
    rep = K.backend_report()
    assert rep["ops"]["threshold_ef"]["chosen"]["cpu"]["backend"] == "numba"
    assert K.abs_select(rand(100), 0.5).numel()
    assert K.backend_report()["ops"]["abs_select"]["chosen"]["cpu"]["backend"] == "numba"
    K.scatter_add_sparse(rand(4), torch.tensor([1]), rand(1))  # no CPU kernel for this one
    assert K.backend_report()["ops"]["scatter_add_sparse"]["chosen"]["cpu"]["backend"] == "reference"
    assert set(rep["backends"]) == {"reference", "numba", "triton", "cupy"}
    assert rep["forced"] is None


def test_bad_env_value_raises_naming_the_variable(clean_dispatch, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=K.ENV_VAR):
        K.threshold_ef(rand(10), 0.5)


def test_forced_reference(clean_dispatch, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "reference")
    assert K.threshold_ef(rand(10), 0.5).backend == "reference"
    assert K.backend_report()["ops"]["threshold_ef"]["chosen"]["cpu"]["why"] == [f"{K.ENV_VAR}=reference"]


def test_forced_backend_that_cannot_run_raises(clean_dispatch, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "cupy")
    with pytest.raises(K.KernelBackendError, match="cupy"):
        K.threshold_ef(rand(10), 0.5)
    monkeypatch.setenv(K.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(K.KernelBackendError, match="TRITON_INTERPRET"):
        K.threshold_ef(rand(10), 0.5)


def test_forced_backend_without_a_kernel_for_the_op_uses_the_reference(clean_dispatch, monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "cupy")
    out = torch.zeros(8)
    K.scatter_add_sparse(out, torch.tensor([3]), torch.tensor([1.5]))
    assert out[3] == 1.5
    why = K.backend_report()["ops"]["scatter_add_sparse"]["chosen"]["cpu"]["why"][0]
    assert "no kernel" in why


def test_gpu_side_is_every_device_but_the_cpu_and_the_cpu_within_gpu_side_on_cpu():
    """The switch the GPU path's host-strategy branches ask (dryrun_profile --gpu-branches): on
    the CPU only inside the context, nested contexts restore the outer state, and an exception
    inside restores it too; bitpack's torch route is then taken, with the same bits."""
    from gradzip.kernels import bitpack

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device objects; nothing touches a GPU
    assert K.gpu_side(cuda) and not K.gpu_side(cpu)
    bits = torch.arange(77) % 3 == 0
    with K.gpu_side_on_cpu():
        assert K.gpu_side(cpu)
        with K.gpu_side_on_cpu():
            assert K.gpu_side(cpu)
        assert K.gpu_side(cpu)
        torch_words = bitpack.pack_bits(bits)
    assert not K.gpu_side(cpu)
    assert torch.equal(torch_words, bitpack.pack_bits(bits))
    with pytest.raises(RuntimeError, match="inside"):
        with K.gpu_side_on_cpu():
            raise RuntimeError("inside")
    assert not K.gpu_side(cpu)


def test_automatic_choice_falls_back_and_records_why(clean_dispatch):
    calls = []

    def ref(x):
        calls.append("reference")
        return "ref"

    def unsupported(x):
        calls.append("triton")
        raise K.Unsupported("float64 is not supported")

    def broken(x):
        calls.append("cupy")
        raise RuntimeError("boom")

    K.register_kernel("fake_op", "triton", unsupported, reference=ref)
    K.register_kernel("fake_op", "cupy", broken)
    D._import_errors.update({"triton": "", "cupy": ""})  # pretend both libraries import
    cuda = torch.device("cuda")  # a device object; nothing touches a GPU
    with pytest.warns(RuntimeWarning, match="cupy fake_op failed"):
        assert D._call("fake_op", cuda, 1) == "ref"
    assert calls == ["triton", "cupy", "reference"]
    chosen = K.backend_report()["ops"]["fake_op"]["chosen"]["cuda"]
    assert chosen["backend"] == "reference"
    assert "float64 is not supported" in chosen["why"][0] and "boom" in chosen["why"][1]
    calls.clear()
    assert D._call("fake_op", cuda, 1) == "ref"  # the broken backend is not retried
    assert calls == ["triton", "reference"]
    assert "disabled after an error" in K.backend_report()["ops"]["fake_op"]["chosen"]["cuda"]["why"][1]
    assert "boom" in K.backend_report()["ops"]["fake_op"]["disabled"]["cupy"]


def test_automatic_choice_skips_unimportable_backends(clean_dispatch):
    K.register_kernel("fake_op", "cupy", lambda x: "cupy", reference=lambda x: "ref")
    D._import_errors["cupy"] = "cupy is not importable (test)"
    assert D._call("fake_op", torch.device("cuda"), 1) == "ref"
    assert "not importable" in K.backend_report()["ops"]["fake_op"]["chosen"]["cuda"]["why"][0]
    D._import_errors["cupy"] = ""
    assert D._call("fake_op", torch.device("cuda"), 1) == "cupy"
    K.register_kernel("fake_op", "triton", lambda x: "triton", first=True)
    D._import_errors["triton"] = ""
    assert D._call("fake_op", torch.device("cuda"), 1) == "triton"


def test_float64_calls_take_the_reference_whatever_is_forced(clean_dispatch, monkeypatch):
    """No kernel loads float64: such calls go to the reference under every setting (a forced
    backend does not raise) and the choice says why."""
    x = rand(100, torch.float64)
    for forced in ("cupy", "triton"):
        monkeypatch.setenv(K.ENV_VAR, forced)
        res = K.threshold_ef(x, 0.5, torch.zeros(100, dtype=torch.float64))
        assert res.backend == "reference" and res.residual.dtype == torch.float64
        scales, _, r = K.sign_ef(x, block=32, new_residual=True)
        assert r.dtype == torch.float64 and scales.dtype == torch.float32
        for op in ("threshold_ef", "sign_ef"):
            assert K.backend_report()["ops"][op]["chosen"]["cpu"]["why"] == ["torch.float64 tensors use the reference"]


def test_register_kernel_validates():
    with pytest.raises(ValueError, match="backend"):
        K.register_kernel("threshold_ef", "opencl", lambda: None)
    with pytest.raises(ValueError, match="reference"):
        K.register_kernel("brand_new_op", "triton", lambda: None)


def test_op_arguments_are_validated():
    with pytest.raises(ValueError, match="corrupt bitmap"):
        K.decode_add_bitmap2(torch.zeros(9), [torch.zeros(2, dtype=torch.uint8)], [1.0])
    with pytest.raises(ValueError, match="residual"):
        K.threshold_ef(torch.zeros(4), 1.0, torch.zeros(5))
    with pytest.raises(TypeError, match="int32"):
        K.scatter_add_signed(torch.zeros(4), torch.zeros(2, dtype=torch.int64), 1.0)
    with pytest.raises(ValueError, match="k must be"):
        K.sampled_topk(torch.zeros(4), 5, torch.tensor([0]))


def test_cpu_codec_never_imports_triton_or_cupy():
    # a fresh interpreter: Threshold and sampled TopK compress and decompress (tests/support/fresh.py)
    assert fresh.facts()["heavy_after_cpu_codecs"] == []


def test_host_to_device_is_the_tensor_itself_on_the_cpu():
    """``K.host_to_device``: on the CPU no copy (the same tensor); its CUDA side (pinned
    staging, no stream sync) is checked on a device in tests/kernels/test_cuda.py."""
    t = torch.arange(5)
    assert K.host_to_device(t, torch.device("cpu")) is t and K.host_to_device(t, "cpu") is t
