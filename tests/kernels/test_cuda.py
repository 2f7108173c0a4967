"""CUDA-side checks.

* CPU, always (compiles skipped without nvcc): every kernel file of ``kernels/cuda``
  compiles with ``nvcc -cubin -arch=sm_90`` with warnings as errors, every kernel name the
  CuPy launchers ask for exists, and the other ``.cu`` files (shared device helpers) are
  included by every kernel file.
* ``@pytest.mark.gpu`` (skipped without CUDA): the CuPy kernels and the compiled Triton
  kernels against their references on a real device, DLPack without copies, launches
  on PyTorch's current stream, the per-device kernel cache, and the dispatch.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import gradzip as gz
import gradzip.kernels as K
from gradzip.codecs.base import TensorContext
from gradzip.kernels import reference as R

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "kernels" / "cuda"
NVCC = shutil.which("nvcc")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 1009, 5003, (1 << 20) + 3]


def _declared(path: Path) -> list:
    return re.findall(r'extern "C" __global__ void (\w+)\(', path.read_text())


CU_FILES = sorted(p for p in CUDA_DIR.glob("*.cu") if _declared(p))  # the kernel files
HELPERS = sorted(p for p in CUDA_DIR.glob("*.cu") if not _declared(p))


def test_cuda_sources_are_the_ones_cupy_ops_loads():
    src = (ROOT / "kernels" / "cupy_ops.py").read_text()
    listed = re.search(r"CU_FILES = \(([^)]*)\)", src).group(1)
    assert sorted(re.findall(r'"([\w.]+\.cu)"', listed)) == [p.name for p in CU_FILES]
    assert [p.name for p in HELPERS] == ["common.cu"]
    for path in CU_FILES:
        assert f'#include "{HELPERS[0].name}"' in path.read_text(), path.name
    declared = {p.name: set(_declared(p)) for p in CU_FILES}
    suffixes = re.findall(r'torch\.\w+: "(\w+)"', re.search(r"_SUFFIX = \{([^}]*)\}", src).group(1))
    used = re.findall(r'_function\(\s*\w+,\s*"([\w.]+)",\s*f?"([\w{}\[\]. ]+)"', src)
    assert used
    for file, name in used:
        names = [re.sub(r"\{.*\}", s, name) for s in suffixes] if "{" in name else [name]
        for n in names:
            assert n in declared[file], f"{file} declares no kernel {n}"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_nvcc_compiles_for_sm90(path, tmp_path):
    cubin = tmp_path / f"{path.stem}.cubin"
    out = subprocess.run(
        [NVCC, "-cubin", "-arch=sm_90", "-Werror", "all-warnings", "-o", str(cubin), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    names = _declared(path)
    assert names
    for name in names:
        assert name.encode() in data, f"{name} missing from the cubin"


# -- on a GPU ----------------------------------------------------------------------------------


def bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.fixture
def cupy_ops():
    pytest.importorskip("cupy", reason="cupy is not installed (pip install gradzip[gpu])")
    from gradzip.kernels import cupy_ops

    return cupy_ops


def _data(n, dtype, tau, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=g)
    if n > 10:
        x[1], x[3], x[5], x[7] = tau, -tau, -0.0, float("inf")
    r = torch.randn(n, generator=g) * 0.5
    return x.to(dtype).cuda(), r.cuda()


def _check_threshold(got, want):
    assert got.count == want.count
    assert got.amax == want.amax
    if want.residual is not None:
        assert torch.equal(bits(got.residual), bits(want.residual.to(got.residual.device)))
    assert torch.equal(got.bitmap().cpu(), want.bitmap().cpu())
    assert torch.equal(got.indices().cpu(), want.indices().cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_cupy_threshold_ef_matches_reference(cupy_ops, dtype, n, with_residual):
    x, r = _data(n, dtype, 0.75)
    r = r if with_residual else None
    _check_threshold(
        cupy_ops.threshold_ef_cupy(x, 0.75, r, new_residual=True),
        R.threshold_ef_reference(x, 0.75, r, new_residual=True),
    )


@pytest.mark.gpu
def test_cupy_threshold_ef_writes_the_residual_over_its_inputs(cupy_ops):
    x, r = _data(5003, torch.float32, 0.75)
    want = R.threshold_ef_reference(x, 0.75, r)
    r0 = r.clone()
    got = cupy_ops.threshold_ef_cupy(x, 0.75, r0, out=r0)
    assert got.residual is r0
    _check_threshold(got, want)
    x0 = x.clone()
    got = cupy_ops.threshold_ef_cupy(x0, 0.75, out=x0)
    assert got.residual is x0
    _check_threshold(got, R.threshold_ef_reference(x, 0.75, new_residual=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_cupy_abs_select_matches_reference(cupy_ops, dtype, n):
    v = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype).cuda()
    thr = v.abs().float().kthvalue(max(1, n - n // 100)).values.to(dtype)
    want = R.abs_select_reference(v, thr)
    assert torch.equal(cupy_ops.abs_select_cupy(v, thr), want)
    assert torch.equal(cupy_ops.abs_select_cupy(v, thr, expected=1), want)  # too small a buffer: runs again


@pytest.mark.gpu
def test_cupy_dlpack_is_zero_copy_both_ways(cupy_ops):
    for dtype in DTYPES:
        t = torch.randn(1000, device="cuda").to(dtype)
        a = cupy_ops.as_cupy(t)
        assert a.data.ptr == t.data_ptr()
        back = cupy_ops.as_torch(a)
        assert back.data_ptr() == t.data_ptr()


@pytest.mark.gpu
def test_cupy_kernels_launch_on_the_current_stream_and_are_cached_per_device(cupy_ops):
    side = torch.cuda.Stream()
    x = torch.randn(1 << 22, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert cupy_ops._stream(x.device).ptr == side.cuda_stream
        y = x * 2.0  # queued on the side stream; the kernel must see it finished
        got = cupy_ops.threshold_ef_cupy(y, 1.0)
        idx = got.indices()
    side.synchronize()
    want = R.threshold_ef_reference(x * 2.0, 1.0)
    assert torch.equal(idx.cpu(), want.indices().cpu())
    dev = torch.cuda.current_device()
    assert (dev, "threshold_ballot.cu") in cupy_ops._modules and (dev, "compact.cu") in cupy_ops._modules
    before = dict(cupy_ops._functions)
    cupy_ops.threshold_ef_cupy(x, 1.0).indices()
    assert cupy_ops._functions == before  # nothing recompiled


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_compiled_triton_kernels_match_reference(dtype, n):
    pytest.importorskip("triton", reason="triton is not installed")
    from gradzip.kernels.triton import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET is set: the kernels were built for the interpreter")
    from gradzip.kernels.triton.decode import (
        decode_add_bitmap2_triton,
        scatter_add_signed_triton,
        scatter_add_sparse_triton,
    )
    from gradzip.kernels.triton.threshold import threshold_ef_triton
    from gradzip.kernels.triton.topk import abs_select_triton

    x, r = _data(n, dtype, 0.75)
    for res in (r, None):
        _check_threshold(
            threshold_ef_triton(x, 0.75, res, new_residual=True),
            R.threshold_ef_reference(x, 0.75, res, new_residual=True),
        )
    g = torch.Generator().manual_seed(n)
    nb = (n + 3) // 4
    msg = torch.randint(0, 256, (3, nb + 24), dtype=torch.uint8, generator=g).cuda()
    bodies, taus = [msg[p, 16 : 16 + nb] for p in range(3)], [0.1, 1e-3 + 1e-12, 3.0]
    out0 = torch.randn(n, generator=g).cuda()
    a, b = out0.clone(), out0.clone()
    decode_add_bitmap2_triton(a, bodies, taus)
    R.decode_add_bitmap2_reference(b, bodies, taus)
    assert torch.equal(bits(a), bits(b))
    k = max(1, n // 7)
    idx = torch.randperm(n, generator=g)[:k].sort().values.cuda()
    words = K.encode_signed_indices(idx, (torch.rand(k, generator=g) < 0.5).cuda())
    a, b = out0.clone(), out0.clone()
    scatter_add_signed_triton(a, words, 0.3)
    R.scatter_add_signed_reference(b, words, 0.3)
    assert torch.equal(bits(a), bits(b))
    vals = torch.randn(k, generator=g).to(dtype).cuda()
    a, b = out0.clone(), out0.clone()
    scatter_add_sparse_triton(a, idx.to(torch.int32), vals)
    R.scatter_add_sparse_reference(b, idx, vals)
    assert torch.equal(bits(a), bits(b))
    idxs = [idx, torch.randperm(n, generator=g)[:k].cuda(), idx.flip(0)]  # peers sharing elements
    peer_vals = [vals, torch.randn(k, generator=g).to(dtype).cuda(), -vals]
    a, b = out0.clone(), out0.clone()
    K.scatter_add_sparse_many(a, idxs, peer_vals)  # one launch after a stable sort
    R.scatter_add_sparse_many_reference(b, idxs, peer_vals)
    assert torch.equal(bits(a), bits(b))
    thr = x.abs().float().kthvalue(max(1, n - n // 100)).values.to(dtype)
    assert torch.equal(abs_select_triton(x, thr, expected=1), R.abs_select_reference(x, thr))


@pytest.mark.gpu
def test_dispatch_uses_a_kernel_for_cuda_tensors_and_compressors_match_the_cpu(monkeypatch):
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    for comp in (gz.Threshold(tau=3.0), gz.Threshold(tau=0.5), gz.TopK(0.001, mode="sampled", sample=20000)):
        ctx = lambda: TensorContext(name="w", step=1)  # noqa: E731
        cpu = comp.compress(x, ctx())
        gpu = comp.compress(x.cuda(), ctx())
        assert (gpu.fmt, gpu.scale, gpu.vdtype) == (cpu.fmt, cpu.scale, cpu.vdtype)
        assert torch.equal(gpu.body.cpu(), cpu.body)
        assert torch.equal(comp.decompress(gpu).cpu(), comp.decompress(cpu))
    rep = K.backend_report()
    assert rep["ops"]["threshold_ef"]["chosen"]["cuda"]["backend"] in ("triton", "cupy"), rep
    assert rep["ops"]["abs_select"]["chosen"]["cuda"]["backend"] in ("triton", "cupy"), rep
    print(rep)


@pytest.mark.gpu
def test_compiled_orthonormalize_rows_matches_reference_and_is_chosen(monkeypatch):
    """PowerSGD's Gram-Schmidt kernel on the device, bit for bit with the CPU reference, on
    the shapes a ResNet-50 and a GPT-2 call orthonormalize (n up to 50,257: the embedding's P)
    and awkward ones; chosen by the dispatch for CUDA tensors."""
    pytest.importorskip("triton", reason="triton is not installed")
    from gradzip.kernels.orth import orthonormalize_rows_reference

    monkeypatch.delenv(K.ENV_VAR, raising=False)
    shapes = [(1, 1), (2, 3), (4, 511), (4, 513), (7, 40), (4, 4608), (4, 2048), (4, 50257), (8, 768)]
    rows, off = [], 5
    for k, n in shapes:
        rows.append((off, k, n))
        off += k * n + 3
    buf = torch.randn(off, generator=torch.Generator().manual_seed(0))
    buf[rows[3][0] : rows[3][0] + 513] = 0.0  # a zero row stays zero
    for eps in (0.0, 1e-8):
        want = buf.clone()
        orthonormalize_rows_reference(want, rows, eps)
        got = K.orthonormalize_rows_(buf.cuda(), rows, eps).cpu()
        assert torch.equal(bits(got), bits(want)), eps
    assert K.backend_report()["ops"]["orthonormalize_rows_"]["chosen"]["cuda"]["backend"] == "triton"


@pytest.mark.gpu
def test_compiled_int8_encode_segments_matches_reference_and_is_chosen(monkeypatch):
    """A tensor's TwoPhase pieces with their error feedback in one launch, on the device: the
    bodies and the residual (written over the input, as Int8.encode_pieces asks) bit for bit
    with the CPU reference, on 8 pieces of a ResNet-50-sized bucket, ragged and empty pieces,
    blocks of 1024 (one launch) and of 8192 (beyond the tile: piece by piece); chosen by the
    dispatch for CUDA tensors."""
    pytest.importorskip("triton", reason="triton is not installed")
    from gradzip.kernels.quant import int8_encode_segments_reference

    monkeypatch.delenv(K.ENV_VAR, raising=False)
    g = torch.Generator().manual_seed(0)
    for n, bounds in ((6_553_600, [j * 6_553_600 // 8 for j in range(9)]), (5003, [3, 1250, 1250, 3751, 5000])):
        x = torch.randn(n, generator=g) * 3
        x[100], x[5000] = float("nan"), float("inf")
        for block in (1024, 8192, None):
            r_want = x.clone()
            want, offs = int8_encode_segments_reference(r_want, bounds, block=block, residual=r_want)
            xc = x.cuda()
            got, got_offs = K.int8_encode_segments(xc, bounds, block=block, residual=xc)
            assert got_offs == offs and torch.equal(got.cpu(), want), (n, block)
            assert torch.equal(bits(xc.cpu()), bits(r_want)), (n, block)
    assert K.backend_report()["ops"]["int8_encode_segments"]["chosen"]["cuda"]["backend"] == "triton"


@pytest.mark.gpu
def test_compiled_sign_ef_segments_matches_reference_and_is_chosen(monkeypatch):
    """A tensor's TwoPhase pieces, one scale each, with their error feedback in three launches
    on the device: the bodies bit for bit with the CPU reference and the residual (written over
    the input, as SignSGD.encode_pieces asks when TwoPhase compensated in place; a NaN matches
    any NaN) on 8 pieces of a ResNet-50-sized bucket and on ragged, empty and one-element
    pieces, float32 and bf16 inputs with a residual apart; chosen for CUDA tensors."""
    pytest.importorskip("triton", reason="triton is not installed")
    from gradzip.kernels.quant import sign_ef_segments_reference

    def close(a, b):
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(
            bits(a.masked_fill(a.isnan(), 0)), bits(b.masked_fill(b.isnan(), 0))
        )

    monkeypatch.delenv(K.ENV_VAR, raising=False)
    g = torch.Generator().manual_seed(0)
    for n, bounds in ((6_553_600, [j * 6_553_600 // 8 for j in range(9)]), (5003, [3, 1250, 1250, 1251, 3751, 5000])):
        x = torch.randn(n, generator=g) * 3
        x[100], x[4000] = float("nan"), float("inf")
        r_want = x.clone()
        want, offs = sign_ef_segments_reference(r_want, bounds, out=r_want)
        xc = x.cuda()
        got, got_offs = K.sign_ef_segments(xc, bounds, out=xc)
        assert got_offs == offs and torch.equal(got.cpu(), want), n
        assert close(xc.cpu(), r_want), n
        xb, r = x.bfloat16(), torch.randn(n, generator=g)
        out_want = torch.zeros(n)
        want, _ = sign_ef_segments_reference(xb, bounds, residual=r, out=out_want)
        out = torch.zeros(n, device="cuda")
        got, _ = K.sign_ef_segments(xb.cuda(), bounds, residual=r.cuda(), out=out)
        assert torch.equal(got.cpu(), want) and close(out.cpu(), out_want), n
    assert K.backend_report()["ops"]["sign_ef_segments"]["chosen"]["cuda"]["backend"] == "triton"


@pytest.mark.gpu
def test_compiled_bit_packing_matches_the_cpu(monkeypatch):
    """K.pack_uint and K.unpack_uint on CUDA tensors take the Triton kernels: the bytes and values
    of the CPU route, bit for bit, at the widths top-k's positions use (1 for the Elias-Fano
    bitmap, 6-7 low bits, wide gaps) and 63, for 1-D streams and 2-D rows (a round's frames, rows
    apart), a ResNet-50 bucket's piece among them."""
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    g = torch.Generator().manual_seed(0)
    for bits, n in ((1, 2 * 8192 + 130_000), (6, 8192), (7, 8193), (13, 1009), (63, 37)):
        v = torch.randint(0, 1 << min(bits, 62), (8, n), generator=g, dtype=torch.int64)
        v[:, -1] = (1 << bits) - 1
        want = K.pack_uint(v, bits)
        got = K.pack_uint(v.cuda(), bits)
        assert torch.equal(got.cpu(), want), bits
        assert torch.equal(K.pack_uint(v[3].cuda(), bits).cpu(), K.pack_uint(v[3], bits)), bits
        wide = torch.cat([want, torch.full((8, 5), 0xFF, dtype=torch.uint8)], dim=1).cuda()[:, : want.shape[1] + 2]
        assert torch.equal(K.unpack_uint(wide, n, bits).cpu(), v), bits
        assert torch.equal(K.unpack_uint(want[5].cuda(), n, bits).cpu(), v[5]), bits
    for op in ("pack_uint", "unpack_uint"):
        assert K.backend_report()["ops"][op]["chosen"]["cuda"]["backend"] == "triton", op


@pytest.mark.gpu
def test_host_to_device_and_packing_a_round_do_not_synchronize():
    """A host-built table reaches the device without a stream sync (``K.host_to_device``:
    pinned staging, an asynchronous copy; ``t.to("cuda")`` would wait for the stream), and so
    does packing a round of frames encoded on the device (``wire.pack_round``: its tables and
    their positions by that copy): torch's sync debug mode raises at any synchronizing call."""
    from gradzip import wire

    dev = torch.device("cuda", 0)
    codec = gz.Int8()
    groups = [[codec.compress(torch.randn(1000 + 37 * j, device=dev))] for j in range(4)]
    sizes = [wire.message_capacity(g) for g in groups]
    want = [wire.pack_frames(g, size=s).cpu() for g, s in zip(groups, sizes)]
    t = torch.arange(1000, dtype=torch.int64)
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = K.host_to_device(t, dev)
        msgs = wire.pack_round(groups, out, sizes)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.device == dev and torch.equal(got.cpu(), t)
    assert all(torch.equal(m.cpu(), w) for m, w in zip(msgs, want))
