"""Triton kernels against their references, on the CPU.

* Under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no GPU) every
  kernel runs on CPU tensors and must match its reference bit for bit (the math here
  is exact: comparisons, bit packing, one float add per element in a fixed order).
* Every kernel is compiled ahead of time for sm_90 (PTX and cubin, no GPU needed),
  which catches lowering errors the interpreter does not (``long``: about 40 s; the
  default run compiles a representative few, a streaming kernel's 16-byte loads included).
* The compressors give the same payloads and decodes with GRADZIP_KERNELS=triton.
* ``benchmarks/kernels.py --smoke`` runs end to end (one size by default; both smoke sizes are ``long``).

Sizes: 0, 1, 31, 33 (around a 32-element word), 4097 (several small programs and a
ragged tail) and 20011 (the interpreter's default program size), kept small because the
interpreter is slow.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable; the Triton kernel tests need it")

import gradzip as gz  # noqa: E402
import gradzip.kernels as K  # noqa: E402
from gradzip.codecs.base import TensorContext  # noqa: E402
from gradzip.codecs.threshold import FMT_BITMAP2, FMT_SIGNED_INDEX  # noqa: E402
from gradzip.kernels import reference as R  # noqa: E402
from gradzip.kernels.triton import aot_specs, interpreting  # noqa: E402
from gradzip.wire import FMT_EMPTY, pack_frames, unpack_frames  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (n, rows): rows=16 makes 256-element programs, so 4097 spans several with a ragged tail.
SIZES = [(0, 16), (1, 16), (31, 16), (33, 16), (4097, 16), (20011, None)]

interp = pytest.mark.skipif(
    not interpreting(), reason="TRITON_INTERPRET is not set: kernels are compiled for the GPU (see the gpu tests)"
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so -0.0 != 0.0 and NaN == NaN."""
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def with_specials(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Random data plus exact ties at +-tau, signed zeros, a NaN-free infinity."""
    x = x.clone()
    n = x.numel()
    for i, v in zip(range(0, n, max(1, n // 5)), [tau, -tau, -0.0, float("inf"), 0.0, -tau]):
        x[i] = v
    return x


# -- threshold + error feedback --------------------------------------------------------------------


def _dtype_cases(sizes, flags=(None,)):
    """float32 at every size (and flag); float16 and bfloat16 at the sizes past 1, the flags in
    turn: every dtype, not the cross product (every interpreted launch costs)."""
    cases = [(torch.float32, *s, f) for s in sizes for f in flags]
    wide = [s for s in sizes if (s[0] if isinstance(s, tuple) else s) > 1]
    for j, dtype in enumerate((torch.float16, torch.bfloat16)):
        cases += [(dtype, *s, flags[(i + j) % len(flags)]) for i, s in enumerate(wide)]
    return cases


def _case_id(case):
    def word(v):
        if isinstance(v, bool):
            return "residual" if v else "plain"
        return str(v).replace("torch.", "")

    return "-".join(word(v) for v in case if v is not None)


THRESHOLD_CASES = _dtype_cases(SIZES, (True, False))


@interp
@pytest.mark.parametrize("dtype,n,rows,with_residual", THRESHOLD_CASES, ids=[_case_id(c) for c in THRESHOLD_CASES])
def test_threshold_ef_matches_reference(dtype, n, rows, with_residual):
    from gradzip.kernels.triton.threshold import threshold_ef_triton

    tau = 0.75
    x = with_specials(torch.randn(n, generator=gen(n)), tau).to(dtype)
    r = (torch.randn(n, generator=gen(n + 1)) * 0.5) if with_residual else None
    if r is not None and n > 3:
        r[3] = 0.0  # keep one exact tie after compensation
    got = threshold_ef_triton(x, tau, r, rows=rows, new_residual=True)
    want = R.threshold_ef_reference(x, tau, r, new_residual=True)
    assert got.count == want.count
    assert got.amax == want.amax
    assert torch.equal(bits(got.residual), bits(want.residual))
    assert torch.equal(got.bitmap(), want.bitmap())
    assert torch.equal(got.indices(), want.indices())


@interp
def test_threshold_ef_writes_the_residual_over_its_inputs():
    """out= the residual read (in place) or x itself: the reference's residual, in that tensor."""
    from gradzip.kernels.triton.threshold import threshold_ef_triton

    n, tau = 5003, 0.75
    x, r = torch.randn(n, generator=gen(3)), torch.randn(n, generator=gen(4)) * 0.5
    want = R.threshold_ef_reference(x, tau, r)
    r0 = r.clone()
    got = threshold_ef_triton(x, tau, r0, out=r0, rows=16)
    assert got.residual is r0 and torch.equal(bits(r0), bits(want.residual))
    assert got.count == want.count and torch.equal(got.indices(), want.indices())
    x0 = x.clone()
    got = threshold_ef_triton(x0, tau, out=x0, rows=16)
    assert got.residual is x0 and torch.equal(
        bits(x0), bits(R.threshold_ef_reference(x, tau, new_residual=True).residual)
    )
    assert got.amax == R.threshold_ef_reference(x, tau).amax


@interp
def test_threshold_ef_nan_amax_empty_and_nothing_selected():
    from gradzip.kernels.triton.threshold import threshold_ef_triton

    x = torch.randn(300, generator=gen(1))
    x[17] = float("nan")
    got = threshold_ef_triton(x, 0.5, rows=16)
    assert math.isnan(got.amax) and got.count == R.threshold_ef_reference(x, 0.5).count
    empty = threshold_ef_triton(torch.empty(0), 0.5)
    assert empty.count == 0 and empty.amax == 0.0 and empty.bitmap().numel() == 0 and empty.indices().numel() == 0
    none = threshold_ef_triton(torch.randn(1009, generator=gen(2)), 100.0, rows=16)
    assert none.count == 0 and not none.bitmap().any() and none.indices().numel() == 0


# -- decode and accumulate ------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("n", [1, 31, 33, 4097])
@pytest.mark.parametrize("shared", [True, False], ids=["gathered", "separate"])
def test_decode_add_bitmap2_matches_reference(n, shared):
    from gradzip.kernels.triton.decode import decode_add_bitmap2_triton

    nb = (n + 3) // 4
    peers = 3
    if shared:  # the layout of an all-gather: one buffer, each body at its own offset
        msg = torch.randint(0, 256, (peers, nb + 24), dtype=torch.uint8, generator=gen(n))
        bodies = [msg[p, 16 : 16 + nb] for p in range(peers)]
    else:
        bodies = [torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=gen(n + p)) for p in range(peers)]
    taus = [0.1, 1e-3 + 1e-12, 3.0]  # the second is not a float32: both round it the same way
    out0 = torch.randn(n, generator=gen(n + 9))
    out0[0] = -0.0
    got, want = out0.clone(), out0.clone()
    decode_add_bitmap2_triton(got, bodies, taus, block_bytes=64)
    R.decode_add_bitmap2_reference(want, bodies, taus)
    assert torch.equal(bits(got), bits(want))


@interp
@pytest.mark.parametrize("n,k", [(1, 1), (31, 3), (33, 33), (4097, 1500)])
def test_scatter_add_signed_matches_reference(n, k):
    from gradzip.kernels.triton.decode import scatter_add_signed_triton

    idx = torch.randperm(n, generator=gen(k))[:k].sort().values
    words = K.encode_signed_indices(idx, torch.rand(k, generator=gen(k + 1)) < 0.5)
    out0 = torch.randn(n, generator=gen(n))
    got, want = out0.clone(), out0.clone()
    scatter_add_signed_triton(got, words, 0.3, block=128)
    R.scatter_add_signed_reference(want, words, 0.3)
    assert torch.equal(bits(got), bits(want))


@interp
@pytest.mark.parametrize("vdtype", DTYPES, ids=str)
@pytest.mark.parametrize("idtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("n,k", [(1, 1), (31, 31), (33, 7), (4097, 777)])
def test_scatter_add_sparse_matches_reference(vdtype, idtype, n, k):
    from gradzip.kernels.triton.decode import scatter_add_sparse_triton

    idx = torch.randperm(n, generator=gen(k))[:k].to(idtype)
    vals = torch.randn(k, generator=gen(n)).to(vdtype)
    out0 = torch.randn(n, generator=gen(n + 1))
    got, want = out0.clone(), out0.clone()
    scatter_add_sparse_triton(got, idx, vals, block=128)
    R.scatter_add_sparse_reference(want, idx, vals)
    assert torch.equal(bits(got), bits(want))


def _peer_frames(n, peers, vdtype, seed):
    """``peers`` top-k frames of an ``n``-element tensor (distinct indices each, many shared
    between frames, one frame empty, int32 and int64 indices), and an output holding -0.0."""
    g = gen(seed)
    idxs, vals = [], []
    for p in range(peers):
        k = 0 if p == 1 else int(torch.randint(1, n + 1, (1,), generator=g))
        idx = torch.randperm(n, generator=g)[:k]
        idxs.append(idx.to(torch.int32 if p % 2 else torch.int64))
        v = torch.randn(k, generator=g) * 10.0 ** torch.randint(-3, 4, (k,), generator=g)
        v[: k // 5] = -0.0 if p % 3 else 0.0  # signed zeros: -0.0 + -0.0 stays -0.0
        vals.append(v.to(vdtype))
    out0 = torch.randn(n, generator=g)
    out0[::7] = -0.0
    return idxs, vals, out0


SPARSE_MANY_CASES = [(d, n, p) for d, n, p, _ in _dtype_cases([(1, 3), (33, 8), (4097, 5)])]


@interp
@pytest.mark.parametrize("vdtype,n,peers", SPARSE_MANY_CASES, ids=[_case_id(c) for c in SPARSE_MANY_CASES])
def test_scatter_add_sparse_many_matches_frame_by_frame(vdtype, n, peers):
    """Every peer's frame in one launch (a stable sort, then a program per element's run) against
    the reference frame by frame, bit for bit: indices shared by several peers (so each element's
    order of addition matters), an empty frame, signed zeros; small blocks (a run crossing
    programs) and the dispatch choosing the kernel where Triton is forced."""
    from gradzip.kernels.triton.decode import scatter_add_sparse_many_triton

    idxs, vals, out0 = _peer_frames(n, peers, vdtype, n * 10 + peers)
    want = out0.clone()
    R.scatter_add_sparse_many_reference(want, idxs, vals)
    for block in (None, 4 if n < 100 else 512):
        got = out0.clone()
        scatter_add_sparse_many_triton(got, [i for i in idxs if i.numel()], [v for v in vals if v.numel()], block=block)
        assert torch.equal(bits(got), bits(want)), block
    got = out0.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(K.ENV_VAR, "triton")
        K.scatter_add_sparse_many(got, idxs, vals)
        assert K.backend_report()["ops"]["scatter_add_sparse_many"]["chosen"]["cpu"]["backend"] == "triton"
    assert torch.equal(bits(got), bits(want))


# -- top-k compaction ----------------------------------------------------------------------------


ABS_SELECT_CASES = [(d, n) for d, n, _ in _dtype_cases([(n,) for n in (0, 1, 31, 33, 4097, 20011)])]


@interp
@pytest.mark.parametrize("dtype,n", ABS_SELECT_CASES, ids=[_case_id(c) for c in ABS_SELECT_CASES])
def test_abs_select_matches_reference(dtype, n):
    from gradzip.kernels.triton.topk import abs_select_triton

    v = torch.randn(n, generator=gen(n)).to(dtype)
    # A tensor of v's dtype, with ties on it.
    thr = v.abs().kthvalue(max(1, n - n // 10)).values if n else torch.tensor(0.5, dtype=dtype)
    want = R.abs_select_reference(v, thr)
    assert torch.equal(abs_select_triton(v, thr, block=512), want)
    assert torch.equal(abs_select_triton(v, float(thr), expected=1, block=512), want)  # buffer too small: rerun


@interp
def test_abs_select_reruns_when_the_guess_is_too_small():
    from gradzip.kernels.triton.topk import abs_select_triton

    v = torch.randn(20011, generator=gen(3))
    got = abs_select_triton(v, 0.1, expected=1)  # ~18000 pass; the first buffer holds 1026
    assert got.numel() > 10_000 and torch.equal(got, R.abs_select_reference(v, 0.1))


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sampled_topk_matches_reference_and_counts_within_10_percent(dtype, monkeypatch):
    n, k = 200_003, 200
    v = torch.randn(n, generator=gen(5)).to(dtype)
    probe = torch.randint(n, (20_000,), generator=gen(6))
    monkeypatch.setenv(K.ENV_VAR, "triton")
    got = K.sampled_topk(v, k, probe)
    assert K.backend_report()["ops"]["abs_select"]["chosen"]["cpu"]["backend"] == "triton"
    assert torch.equal(got, R.sampled_topk_reference(v, k, probe))
    assert 0.9 * k <= got.numel() <= 1.1 * k


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sampled_topk_approx_with_triton_compaction_matches_reference(dtype, monkeypatch):
    """The approximate top-k with both compactions in the Triton kernel (interpreter) gives the
    reference's indices, within 10% of k, on several distributions."""
    n = 60_013
    g = gen(21)
    cases = {
        "normal": (torch.randn(n, generator=g), 60),
        "cauchy": (torch.empty(n).cauchy_(generator=g), 600),
        "layers": (torch.cat([torch.randn(n // 3, generator=g) * 1e-2, torch.randn(n - n // 3, generator=g)]), 300),
        "sparse_ties": (torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.004), 300),
    }
    for name, (v, k) in cases.items():
        v = v.to(dtype)
        probe = torch.randint(n, (6000,), generator=g)
        monkeypatch.setenv(K.ENV_VAR, "triton")
        route = []
        got = K.sampled_topk(v, k, probe, approx=True, route=route)
        assert K.backend_report()["ops"]["abs_select"]["chosen"]["cpu"]["backend"] == "triton"
        monkeypatch.setenv(K.ENV_VAR, "reference")
        want_route = []
        assert torch.equal(got, K.sampled_topk(v, k, probe, approx=True, route=want_route)), name
        assert route == want_route
        lo, hi = K.approx_band(k)
        assert lo <= got.numel() <= hi, (name, got.numel())


# -- the compressors through the dispatch ---------------------------------------------------------


def _same_payload(a, b):
    return (a.fmt, a.scale, a.vdtype) == (b.fmt, b.scale, b.vdtype) and torch.equal(a.body, b.body)


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compressors_give_the_same_bytes_with_triton_kernels(dtype, monkeypatch):
    x = with_specials(torch.randn(5003, generator=gen(7)), 0.5).to(dtype)
    x[5] = float("nan")
    cases = [
        gz.Threshold(tau=3.0),
        gz.Threshold(tau=0.5),
        gz.Threshold(tau=1e3),
        gz.TopK(0.01, mode="sampled", sample=500),
    ]
    fmts = set()
    for comp, v in [(c, x) for c in cases] + [(gz.Threshold(tau=1e3), x.clamp(-10, 10))]:
        ctx = TensorContext(name="w", step=2, dtype=dtype)
        monkeypatch.setenv(K.ENV_VAR, "reference")
        want = comp.compress(v, ctx)
        dwant = comp.decompress(want)
        monkeypatch.setenv(K.ENV_VAR, "triton")
        got = comp.compress(v, ctx)
        assert _same_payload(got, want), comp
        assert torch.equal(bits(comp.decompress(got).float()), bits(dwant.float()))
        fmts.add(got.fmt)
    assert {FMT_SIGNED_INDEX, FMT_BITMAP2, FMT_EMPTY} <= fmts
    assert K.backend_report()["ops"]["threshold_ef"]["chosen"]["cpu"]["backend"] == "triton"


@interp
def test_threshold_accumulate_many_equals_accumulating_each_peer(monkeypatch):
    """N peers' frames of one tensor, taken from one gathered buffer, mixed formats."""
    n = 3001
    comp = gz.Threshold(tau=0.5)
    frames = []
    for p, tau in enumerate([0.5, 0.01, 3.0, 0.02, 2.5, 100.0]):
        x = torch.randn(n, generator=gen(p))
        frames.append(gz.Threshold(tau=tau).compress(x))
    fmts = [f.fmt for f in frames]
    assert fmts == [FMT_BITMAP2, FMT_BITMAP2, FMT_SIGNED_INDEX, FMT_BITMAP2, FMT_SIGNED_INDEX, FMT_EMPTY]
    msgs = [pack_frames([f]) for f in frames]
    width = max(m.numel() for m in msgs)
    gathered = torch.zeros(len(msgs), width, dtype=torch.uint8)
    for i, m in enumerate(msgs):
        gathered[i, : m.numel()] = m
    peers = [unpack_frames(gathered[i], [torch.Size([n])], [torch.float32])[0] for i in range(len(msgs))]
    monkeypatch.setenv(K.ENV_VAR, "reference")
    want = torch.randn(n, generator=gen(99))
    got = want.clone()
    for p in peers:
        comp.accumulate(p, want)
    monkeypatch.setenv(K.ENV_VAR, "triton")
    comp.accumulate_many(peers, got)
    assert torch.equal(bits(got), bits(want))
    assert K.backend_report()["ops"]["decode_add_bitmap2"]["chosen"]["cpu"]["backend"] == "triton"


# -- ahead-of-time compile for sm_90 -----------------------------------------------------------


SPECS = aot_specs()


def test_every_kernel_has_an_aot_spec():
    import inspect

    from gradzip.kernels import triton as gt

    declared = set()
    for m in gt.MODULES:
        mod = __import__(f"gradzip.kernels.triton.{m}", fromlist=["x"])
        declared |= {name for name, _ in inspect.getmembers(mod) if name.startswith("_") and name.endswith("_kernel")}
    covered = {s["kernel"].__name__ for s in SPECS}
    assert declared and declared == covered


#: What the default run compiles for sm_90 (a few seconds, where every spec takes ~40 s: that is
#: ``long``): the threshold kernel (streaming: a divisible spec must load 16 bytes; and a ragged
#: spec), a decoder and the top-k compaction (streaming too): each one's first divisible and
#: first ragged spec.
AOT_SMOKE = ("_threshold_ef_kernel", "_decode_add_bitmap2_kernel", "_abs_select_kernel")


def _smoke_specs():
    picked = {}
    for i, s in enumerate(SPECS):
        key = (s["kernel"].__name__, bool(s.get("divisible")))
        if key[0] in AOT_SMOKE:
            picked.setdefault(key, i)
    return sorted(picked.values())


SMOKE_SPECS = _smoke_specs()
#: The bandwidth-bound kernels, which load 16 bytes per instruction where the launcher specializes.
STREAMING = {
    "_threshold_ef_kernel",
    "_abs_select_kernel",
    "_sign_encode_kernel",
    "_sign_onepass_kernel",
    "_codes_encode_kernel",
    "_codes_onepass_kernel",
}

# The child compiles the specs (their indices in aot_specs()) of argv[1] (every spec where it is
# empty) with the module's own compile_all, and prints its rows.
_AOT_CHILD = """
import json, sys
from gradzip.kernels.triton import aot
picked = [int(i) for i in sys.argv[1].split(",") if i]
specs = aot.module_specs(None)
aot.module_specs = lambda modules: [specs[i] for i in picked] if picked else specs
for row in aot.compile_all(90):
    print(json.dumps(row))
"""


def _compile_in_child(tmp_path_factory, indices=()):
    """Compile specs in one child process without the interpreter (no GPU needed), into an
    empty cache, so nothing passes on a stale build: those of ``indices``, or every one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    out = subprocess.run(
        [sys.executable, "-c", _AOT_CHILD, ",".join(map(str, indices))],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=300,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")], out.stderr


@pytest.fixture(scope="module")
def aot_rows(tmp_path_factory):
    """Every spec compiled (``long``)."""
    rows, err = _compile_in_child(tmp_path_factory)
    assert len(rows) == len(SPECS), err[-3000:]
    return rows


@pytest.fixture(scope="module")
def aot_smoke_rows(tmp_path_factory):
    """The specs of :data:`SMOKE_SPECS`, by their index in :data:`SPECS`."""
    rows, err = _compile_in_child(tmp_path_factory, SMOKE_SPECS)
    assert len(rows) == len(SMOKE_SPECS), err[-3000:]
    return dict(zip(SMOKE_SPECS, rows))


def _spec_id(s):
    ptrs = "-".join(v[1:] for v in s["signature"].values() if v.startswith("*"))
    return f"{s['kernel'].__name__}-{ptrs}-{'div' if s.get('divisible') else 'ragged'}"


def _check_aot_row(row, spec):
    assert row["kernel"] == spec["kernel"].__name__ and row["signature"] == spec["signature"]
    assert row["ok"], row.get("error")
    assert row["ptx_target"] == "sm_90" and row["cubin_bytes"] > 1000
    assert row["num_warps_built"] == spec["num_warps"]


def _check_vector_loads(rows, streaming):
    """With aligned pointers and n % 16 == 0 (what the launcher specializes on), the
    bandwidth-bound kernels load 16 bytes per instruction."""
    rows = [row for row in rows if row["kernel"] in streaming and row["divisible"]]
    assert {row["kernel"] for row in rows} == streaming
    for row in rows:
        assert row["vector_loads"] > 0, row


def test_aot_smoke_covers_streaming_and_ragged_specs():
    """The default run's subset holds a streaming kernel's divisible and ragged specs."""
    smoke = [SPECS[i] for i in SMOKE_SPECS]
    assert {s["kernel"].__name__ for s in smoke} == set(AOT_SMOKE)
    assert any(s["kernel"].__name__ in STREAMING and s.get("divisible") for s in smoke)
    assert any(not s.get("divisible") for s in smoke)


@pytest.mark.parametrize("i", SMOKE_SPECS, ids=[_spec_id(SPECS[i]) for i in SMOKE_SPECS])
def test_aot_compile_for_sm90_of_representative_kernels(aot_smoke_rows, i):
    _check_aot_row(aot_smoke_rows[i], SPECS[i])


def test_aot_representative_streaming_kernels_use_16_byte_loads(aot_smoke_rows):
    _check_vector_loads(list(aot_smoke_rows.values()), STREAMING & set(AOT_SMOKE))


@pytest.mark.long
@pytest.mark.parametrize("i", range(len(SPECS)), ids=[_spec_id(s) for s in SPECS])
def test_aot_compile_for_sm90(aot_rows, i):
    _check_aot_row(aot_rows[i], SPECS[i])


@pytest.mark.long
def test_aot_streaming_kernels_use_16_byte_loads(aot_rows):
    _check_vector_loads(aot_rows, STREAMING)


def test_aot_specs_belong_to_their_modules():
    """Each module's AOT_SPECS covers exactly the kernels it declares (none imported from another)."""
    import importlib
    import inspect

    from gradzip.kernels import triton as gt

    for m in gt.MODULES:
        mod = importlib.import_module(f"gradzip.kernels.triton.{m}")
        declared = {name for name, _ in inspect.getmembers(mod) if name.startswith("_") and name.endswith("_kernel")}
        assert declared == {s["kernel"].__name__ for s in mod.AOT_SPECS}, m


# -- the benchmark runs end to end ----------------------------------------------------------------


@interp
@pytest.mark.parametrize(
    "sizes", [["--sizes", "4099"], pytest.param([], marks=pytest.mark.long)], ids=["one-size", "smoke-sizes"]
)
def test_benchmark_smoke(tmp_path, sizes):
    spec = importlib.util.spec_from_file_location("gz_bench_kernels", ROOT / "benchmarks" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "k.json"
    assert mod.main(["--smoke", *sizes, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["smoke"] is True and data["copy_bandwidth_gbps"] > 0
    names = {r["kernel"] for r in data["results"]}
    assert {
        "threshold_ef",
        "threshold_index",
        "decode_add_bitmap2",
        "scatter_add_signed",
        "scatter_add_sparse",
        "sampled_topk",
        "sampled_topk_approx",
    } <= names
    assert all(r["kernel_ms"] > 0 and r["reference_ms"] > 0 for r in data["results"])


# -- bit packing of any width (kernels/triton/bits.py) ------------------------------------------
# Every width at 37 elements (a ragged last byte, several programs a row of the small block);
# the empty and one-element rows at the extreme widths; 300 elements at one width (a larger
# small block: every interpreted program costs, so not the full cross product).
PACK_CASES = [(0, 1), (0, 63), (1, 1), (1, 63), *[(37, b) for b in (1, 3, 7, 8, 13, 33, 63)], (300, 13)]


@interp
@pytest.mark.parametrize("n,bits", PACK_CASES, ids=[f"{n}-{b}" for n, b in PACK_CASES])
def test_pack_and_unpack_uint_match_the_torch_route(bits, n, monkeypatch):
    """pack_uint_triton and unpack_uint_triton against bitpack's torch route (numpy off), bit for
    bit: 1-D streams and 2-D rows (each padded to a byte), several programs a row (a small
    block), values up to 2**bits - 1; and the dispatched K.pack_uint and K.unpack_uint choose
    them where Triton is forced (as on CUDA unforced)."""
    from gradzip.kernels import bitpack
    from gradzip.kernels.triton.bits import pack_uint_triton, unpack_uint_triton

    monkeypatch.setattr(bitpack, "_NUMPY_BITS", False)
    g = torch.Generator().manual_seed(bits * 1000 + n)
    hi = (1 << bits) - 1
    v = torch.randint(0, 1 << min(bits, 62), (3, n), generator=g, dtype=torch.int64)
    if n:
        v[0, -1] = hi  # the largest value, in the last place of a row
        v[1, 0] = hi
    want = bitpack.pack_uint(v, bits)
    small = 64 if n >= 100 else 16 if bits > 16 else 8  # several programs a row, packing and unpacking
    for block in (None, small):
        got = pack_uint_triton(v, bits, block=block)
        assert got.shape == want.shape and torch.equal(got, want)
        assert torch.equal(pack_uint_triton(v[1], bits, block=block), bitpack.pack_uint(v[1], bits))
        if n:
            assert torch.equal(unpack_uint_triton(want, n, bits, block=block), v)
            assert torch.equal(unpack_uint_triton(want[2], n, bits, block=block), v[2])
            wide = torch.cat([want, torch.full((3, 3), 0xFF, dtype=torch.uint8)], dim=1)  # rows apart
            assert torch.equal(unpack_uint_triton(wide, n, bits, block=block), v)
    monkeypatch.setenv(K.ENV_VAR, "triton")  # the dispatched ops take the kernels, as on CUDA
    assert torch.equal(K.pack_uint(v, bits), want)
    assert K.backend_report()["ops"]["pack_uint"]["chosen"]["cpu"]["backend"] == "triton"
    if n:
        assert torch.equal(K.unpack_uint(want, n, bits), v)
        assert K.backend_report()["ops"]["unpack_uint"]["chosen"]["cpu"]["backend"] == "triton"
