"""Quantizer kernels (scaled sign + error feedback, QSGD/TernGrad with Philox draws,
decode-and-accumulate of quantizer frames) against their references.

* The torch Philox4x32-10 matches Random123's known-answer vectors and, under
  TRITON_INTERPRET=1, ``tl.rand4x`` / ``tl.randint`` bit for bit.
* Each reference is the compressor's own arithmetic: with ``_uniform`` swapped for the
  Philox draws, ``QSGD.compress`` / ``TernGrad.compress`` give the reference's bytes, and
  ``SignSGD.compress`` + ``decompress`` the sign reference's scales, words and residual.
* Each kernel (interpreter) against its reference on sizes 1, 7, the prime 1009 and 5003
  (no multiple of the program tile), fp32/fp16/bf16, random non-zero data. Block scales
  come from float64 block sums (bit-exact here: the data's range keeps them exact); on
  data whose sums are not exact the scale is compared to one float32 ulp and everything
  downstream of it bit for bit given the same scale. QSGD's reference norm is torch's
  float32 ``vector_norm``: the kernel's norm (float64, rounded once) is compared to it with
  rtol 1e-5 and to the float64 norm to 1 ulp, the codes bit for bit
  given the same norms. Decoding is bit-exact.
* Both encoder routes: the one-pass kernels (a program owns whole blocks) and the two-pass
  ones (block statistics, then encode) give the reference's results, and each other's bit
  for bit; the launcher picks one-pass exactly where :func:`one_pass_shape` says it applies.
* Every kernel compiles ahead of time for sm_90; ``@pytest.mark.gpu`` tests run the
  compiled kernels against the references when a CUDA device is present.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradzip.kernels as K
from gradzip.compressors.base import TensorContext
from gradzip.kernels import reference as R

triton = pytest.importorskip("triton", reason="triton is not importable; the Triton kernel tests need it")

from gradzip.kernels.triton import interpreting  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 1009, 5003]
TILE = 256  # elements per program in the tests: several programs and a ragged tail
interp = pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET is not set: see the gpu tests")
gpu = pytest.mark.gpu


def gen(seed):
    return torch.Generator().manual_seed(seed)


def bits(t):
    return t.contiguous().view(torch.int32)


def data(n, dtype, seed=0):
    x = torch.randn(n, generator=gen(seed))
    x[x == 0] = 0.5  # random and non-zero
    return x.to(dtype)


def ulps(a, b):
    """Distance in float32 ulps (finite, same-sign values)."""
    return int((bits(a.float()).to(torch.int64) - bits(b.float()).to(torch.int64)).abs().max()) if a.numel() else 0


# -- Philox ---------------------------------------------------------------------------------------


def test_philox_matches_random123_known_answers():
    def run(key, ctr):
        out = R.philox4x32(key, *[torch.tensor([c], dtype=torch.int64) for c in ctr])
        return [int(o) for o in out]

    assert run(0, [0, 0, 0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run(2**64 - 1, [0xFFFFFFFF] * 4) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    key = (0x299F31D0 << 32) | 0xA4093822
    assert run(key, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_philox_uniform_is_in_0_1_and_uniform():
    u = R.philox_uniform(123, 200_000)
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) < 1
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.005  # 6 standard errors
    assert torch.equal(R.philox_uniform(123, 50, offset=1000), u[1000:1050])


@interp
def test_philox_uniform_is_tl_rand4x_bit_for_bit():
    """Element i's draw is word i % 4 of tl.rand4x(seed, i // 4), at any start (``base``, aligned
    or not); tl.randint's word is the first one."""
    import triton.language as tl

    @triton.jit
    def draw(u_ptr, i_ptr, seed, base, n, B: tl.constexpr):
        offs = base + tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
        m = offs < base + n
        u0, u1, u2, u3 = tl.rand4x(seed, offs // 4)
        lane = offs % 4
        u = tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))
        tl.store(u_ptr + offs - base, u, mask=m)
        tl.store(i_ptr + offs - base, tl.randint(seed, offs), mask=m)

    n = 3001
    for seed, base in [(0, 0), (1, 0), (0x5EED, 3), (2**40 + 7, 0), (2**63 - 1, 1), (977, 2**33 + 5)]:
        u, i = torch.empty(n), torch.empty(n, dtype=torch.int32)
        draw[(triton.cdiv(n, 1024),)](u, i, seed, base, n, B=1024)
        assert torch.equal(bits(u), bits(R.philox_uniform(seed, n, offset=base))), seed
        assert torch.equal(i.to(torch.int64) & 0xFFFFFFFF, R.philox_randint(seed, torch.arange(base, base + n))), seed


# -- the references are the compressors' arithmetic --------------------------------------------


def _ctx(dtype=torch.float32):
    return TensorContext(name="w", step=3, dtype=dtype)


@pytest.mark.parametrize("block", [None, 64, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sign_reference_is_signsgd(dtype, block):
    from gradzip.compressors.quant import SignSGD

    x, r = data(1009, dtype, 1), torch.randn(1009, generator=gen(2)) * 0.3
    v = x.float() + r
    comp = SignSGD(block=block)
    frame = comp.compress(v, _ctx())
    scales, words, res = R.sign_ef_reference(x, r, block=block)
    assert torch.equal(frame.body, torch.cat([scales.view(torch.uint8), words.view(torch.uint8)]))
    assert torch.equal(bits(res), bits(v - comp.decompress(frame)))


def _philox_uniform_patch(monkeypatch, seed):
    import gradzip.compressors.quant as Q

    monkeypatch.setattr(Q, "_uniform", lambda n, ctx, s, dtype, device: R.philox_uniform(seed, n, device).to(dtype))


@pytest.mark.parametrize("levels,block", [(1, None), (7, 64), (100, 33)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qsgd_reference_is_qsgd_with_philox_draws(monkeypatch, dtype, levels, block):
    from gradzip.compressors.quant import QSGD

    _philox_uniform_patch(monkeypatch, 77)
    x = data(1009, dtype, 3)
    norms, codes = R.qsgd_encode_reference(x, levels, 77, block=block)
    assert torch.equal(QSGD(levels, block=block).compress(x, _ctx(dtype)).body, torch.cat([norms.view(torch.uint8), codes]))


@pytest.mark.parametrize("clip,block", [(None, None), (None, 50), (1.5, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_terngrad_reference_is_terngrad_with_philox_draws(monkeypatch, dtype, clip, block):
    from gradzip.compressors.quant import TernGrad

    _philox_uniform_patch(monkeypatch, 78)
    x = data(1009, dtype, 4)
    scales, codes = R.terngrad_encode_reference(x, 78, block=block, clip=clip)
    assert torch.equal(TernGrad(block=block, clip=clip).compress(x, _ctx(dtype)).body, torch.cat([scales.view(torch.uint8), codes]))


# -- kernels vs references (interpreter) -----------------------------------------------------------


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_sign_ef_kernel_matches_reference(dtype, n):
    from gradzip.kernels.triton.quant import sign_ef_triton

    x, r = data(n, dtype, n), torch.randn(n, generator=gen(n + 1)) * 0.3
    for block in (None, 96):  # one block; blocks of 96 (not a multiple of 32 or of the tile)
        got = sign_ef_triton(x, r, block=block, tile=TILE)
        want = R.sign_ef_reference(x, r, block=block)
        assert torch.equal(bits(got[0]), bits(want[0]))  # exact: these float64 sums are
        assert torch.equal(got[1], want[1]) and torch.equal(bits(got[2]), bits(want[2]))
    _, w, res = sign_ef_triton(x, None, block=64, tile=TILE)  # no residual in, none out
    assert res is None and torch.equal(w, R.sign_ef_reference(x, None, block=64)[1])


@interp
def test_sign_ef_kernel_on_sums_that_are_not_exact():
    """Values over ~90 binades: the float64 block sums depend on the order. The scale is
    within one float32 ulp; given the same scale, the residual is bit-exact."""
    from gradzip.kernels.triton.quant import sign_ef_triton

    n = 5003
    x = torch.randn(n, generator=gen(9)) * torch.exp2(torch.randint(-60, 30, (n,), generator=gen(10)).float())
    s, w, res = sign_ef_triton(x, None, block=1000, new_residual=True, tile=TILE)
    ws, ww, _ = R.sign_ef_reference(x, None, block=1000)
    assert ulps(s, ws) <= 1 and torch.equal(w, ww)
    assert torch.equal(bits(res), bits(R.sign_ef_reference(x, None, block=1000, new_residual=True, scales=s)[2]))


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_qsgd_kernel_matches_reference(dtype, n):
    from gradzip.kernels.triton.quant import qsgd_encode_triton

    x = data(n, dtype, n + 2)
    for levels, block in ((7, 64), (1, None), (100, 333)):  # 4, 2 and 8-bit codes
        norms, codes = qsgd_encode_triton(x, levels, 2**40 + n, block=block, tile=TILE)
        want_norms, _ = R.qsgd_encode_reference(x, levels, 2**40 + n, block=block)
        # torch's float32 norm drifts with the block length (5 ulp at 5003); the kernel's is
        # the float64 norm rounded once.
        assert torch.allclose(norms, want_norms, rtol=1e-5, atol=0)
        nb, b = R.quant_layout(n, block)
        wide = torch.linalg.vector_norm(R.quant_pad(x.double(), nb, b), dim=1).float()
        assert ulps(norms, wide) <= 1
        assert torch.equal(codes, R.qsgd_encode_reference(x, levels, 2**40 + n, block=block, scales=norms)[1])


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_terngrad_kernel_matches_reference(dtype, n):
    from gradzip.kernels.triton.quant import terngrad_encode_triton

    x = data(n, dtype, n + 3)
    for clip, block in ((None, None), (None, 50), (1.5, 300)):
        scales, codes = terngrad_encode_triton(x, 4242 + n, block=block, clip=clip, tile=TILE)
        want = R.terngrad_encode_reference(x, 4242 + n, block=block, clip=clip)
        assert torch.equal(bits(scales), bits(want[0])), clip  # max is exact; the clip's float64 sums are here
        assert torch.equal(codes, want[1])


# -- one-pass vs two-pass routes ------------------------------------------------------------------


def test_one_pass_shape_says_where_the_one_pass_route_applies():
    from gradzip.kernels.triton.quant import one_pass_shape

    assert one_pass_shape(1 << 26, 1024, 32, 4096) == (4, 32)  # sign, block 1024: 4 blocks a program
    assert one_pass_shape(1 << 26, 4096, 32, 4096) == (1, 128)
    assert one_pass_shape(1 << 26, 64, 2, 4096) == (64, 32)  # QSGD's default: 64 blocks of 32 bytes
    assert one_pass_shape(1 << 26, 1024, 4, 4096) == (4, 256)  # TernGrad, block 1024
    assert one_pass_shape(1 << 26, 8192, 32, 4096) is None  # a block longer than the tile
    assert one_pass_shape(1 << 26, None, 4, 4096) is None  # the whole tensor: two passes
    assert one_pass_shape(5003, 96, 32, 4096) == (32, 4)  # 96 % 32 == 0; padded to 128
    assert one_pass_shape(5003, 100, 32, 4096) is None  # a word would straddle two blocks
    assert one_pass_shape(5003, 33, 2, 4096) is None and one_pass_shape(5003, 33, 1, 4096) == (64, 64)
    assert one_pass_shape(1009, None, 32, 4096) == (1, 32) and one_pass_shape(7, 100, 4, 4096) == (1, 2)  # one block
    assert one_pass_shape(7, None, 32, 4096) == (1, 1) and one_pass_shape(0, 64, 32, 4096) is None
    assert one_pass_shape(1009, 64, 2, 4096) == (16, 32)  # no more rows than blocks (16)


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_one_pass_kernels_match_reference_and_two_pass(dtype, n):
    from gradzip.kernels.triton.quant import qsgd_encode_triton, sign_ef_triton, terngrad_encode_triton

    if n > 2000 and dtype != torch.float32:
        pytest.skip("the interpreter is slow: the largest size in float32 only")
    x, r = data(n, dtype, n + 4), torch.randn(n, generator=gen(n + 5)) * 0.3
    for block in (32, 96, TILE):  # b % 32 == 0, up to the tile itself
        for res, new in ((r, None), (None, False), (None, True)):
            one = sign_ef_triton(x, res, block=block, new_residual=new, tile=TILE, route="one")
            two = sign_ef_triton(x, res, block=block, new_residual=new, tile=TILE, route="two")
            want = R.sign_ef_reference(x, res, block=block, new_residual=new)
            assert torch.equal(bits(one[0]), bits(want[0])) and torch.equal(one[1], want[1]), block
            assert (one[2] is None) == (want[2] is None) and (one[2] is None or torch.equal(bits(one[2]), bits(want[2])))
            assert torch.equal(bits(one[0]), bits(two[0])) and torch.equal(one[1], two[1])
    for levels, block in ((7, 64), (1, 64), (100, 33), (7, 250)):  # 4, 2, 8 and 4-bit codes
        one = qsgd_encode_triton(x, levels, 2**41 + n, block=block, tile=TILE, route="one")
        two = qsgd_encode_triton(x, levels, 2**41 + n, block=block, tile=TILE, route="two")
        assert torch.equal(bits(one[0]), bits(two[0])) and torch.equal(one[1], two[1]), (levels, block)
        assert torch.allclose(one[0], R.qsgd_encode_reference(x, levels, 2**41 + n, block=block)[0], rtol=1e-5, atol=0)
        assert torch.equal(one[1], R.qsgd_encode_reference(x, levels, 2**41 + n, block=block, scales=one[0])[1])
    for clip, block in ((None, 64), (1.5, 128), (None, TILE), (0.5, 4)):
        one = terngrad_encode_triton(x, 77 + n, block=block, clip=clip, tile=TILE, route="one")
        two = terngrad_encode_triton(x, 77 + n, block=block, clip=clip, tile=TILE, route="two")
        want = R.terngrad_encode_reference(x, 77 + n, block=block, clip=clip)
        assert torch.equal(bits(one[0]), bits(want[0])) and torch.equal(one[1], want[1]), (clip, block)
        assert torch.equal(bits(one[0]), bits(two[0])) and torch.equal(one[1], two[1])


@interp
def test_one_pass_route_is_refused_where_it_does_not_apply():
    from gradzip.kernels import Unsupported
    from gradzip.kernels.triton.quant import qsgd_encode_triton, sign_ef_triton, terngrad_encode_triton

    x = data(1009, torch.float32, 1)
    with pytest.raises(Unsupported, match="no one-pass route"):
        sign_ef_triton(x, None, block=100, tile=TILE, route="one")  # words straddle blocks
    with pytest.raises(Unsupported, match="no one-pass route"):
        qsgd_encode_triton(x, 7, 1, block=None, tile=TILE, route="one")  # longer than the tile
    with pytest.raises(Unsupported, match="no one-pass route"):
        terngrad_encode_triton(x, 1, block=50, tile=TILE, route="one")
    with pytest.raises(ValueError, match="route must be"):
        sign_ef_triton(x, None, block=64, tile=TILE, route="fused")


@interp
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy: 3e38 * 7,
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf, in lanes the where drops
def test_one_pass_scales_on_sums_that_are_not_exact_and_beyond_float32():
    """Values over ~90 binades: the scale within one float32 ulp, the rest bit-exact given it.
    A QSGD block whose (finite) norm is beyond float32 is sent as 0, as by the reference; an
    infinite one stays infinite."""
    from gradzip.kernels.triton.quant import qsgd_encode_triton, sign_ef_triton, terngrad_encode_triton

    n = 5003
    x = torch.randn(n, generator=gen(19)) * torch.exp2(torch.randint(-60, 30, (n,), generator=gen(20)).float())
    s, w, res = sign_ef_triton(x, None, block=TILE, new_residual=True, tile=TILE, route="one")
    ws, ww, _ = R.sign_ef_reference(x, None, block=TILE)
    assert ulps(s, ws) <= 1 and torch.equal(w, ww)
    assert torch.equal(bits(res), bits(R.sign_ef_reference(x, None, block=TILE, new_residual=True, scales=s)[2]))
    sc, codes = terngrad_encode_triton(x, 5, block=128, clip=1.0, tile=TILE, route="one")
    assert ulps(sc, R.terngrad_encode_reference(x, 5, block=128, clip=1.0)[0]) <= 1
    assert torch.equal(codes, R.terngrad_encode_reference(x, 5, block=128, clip=1.0, scales=sc)[1])
    y = data(640, torch.float32, 21)
    y[64:128] = 3e38  # norm 2.4e39
    norms, codes = qsgd_encode_triton(y, 7, 3, block=64, tile=TILE, route="one")
    want = R.qsgd_encode_reference(y, 7, 3, block=64)
    assert float(norms[1]) == 0.0 and float(want[0][1]) == 0.0
    assert torch.allclose(norms, want[0], rtol=1e-5, atol=0) and torch.equal(codes, want[1])
    y[200] = float("inf")  # an infinite norm is kept (the reference: v is not finite)
    norms, _ = qsgd_encode_triton(y, 7, 3, block=64, tile=TILE, route="one")
    assert norms[3] == float("inf") and norms[1] == 0.0


def _frames(kind, n, peers=3):
    from gradzip.compressors.quant import QSGD, Int8, SignSGD, TernGrad

    comp, kw = {
        "sign1": (SignSGD(block=100), {"block": 100}),
        "qsgd": (QSGD(7, block=64), {"block": 64, "levels": 7, "bits": 4}),
        "qsgd2": (QSGD(1, block=None), {"block": None, "levels": 1, "bits": 2}),
        "qsgd8": (QSGD(100, block=33), {"block": 33, "levels": 100, "bits": 8}),
        "tern2": (TernGrad(block=50), {"block": 50}),
        "int8": (Int8(block=128), {"block": 128}),
    }[kind]
    ctx = [TensorContext(name="w", step=1, dtype=torch.float32, rank=p) for p in range(peers)]
    frames = [comp.compress(torch.randn(n, generator=gen(n + p)), ctx[p]) for p in range(peers)]
    return comp, frames, kw


QKINDS = ["sign1", "qsgd", "qsgd2", "qsgd8", "tern2", "int8"]


@interp
@pytest.mark.parametrize("kind", QKINDS)
@pytest.mark.parametrize("n", SIZES)
def test_decode_add_quant_kernel_matches_reference(kind, n):
    from gradzip.kernels.triton.quant import decode_add_quant_triton

    comp, frames, kw = _frames(kind, n)
    kind = kind[:4] if kind.startswith("qsgd") else kind
    bodies = [f.body for f in frames]
    out0 = torch.randn(n, generator=gen(5))
    out0[0] = -0.0
    want = out0.clone()
    for f in frames:  # the compressor, peer by peer
        comp.accumulate(f, want)
    ref = out0.clone()
    R.decode_add_quant_reference(ref, bodies, kind, **kw)
    assert torch.equal(bits(ref), bits(want))
    got = out0.clone()
    decode_add_quant_triton(got, bodies, kind, tile=TILE, **kw)  # separate bodies: copied into one buffer
    assert torch.equal(bits(got), bits(want))
    msg = torch.zeros(len(bodies), max(b.numel() for b in bodies) + 24, dtype=torch.uint8)
    for i, b in enumerate(bodies):  # the all-gather layout: one buffer, 8-byte aligned bodies
        msg[i, 8 : 8 + b.numel()] = b
    got = out0.clone()
    decode_add_quant_triton(got, [msg[i, 8 : 8 + b.numel()] for i, b in enumerate(bodies)], kind, tile=TILE, **kw)
    assert torch.equal(bits(got), bits(want))


# -- dispatch ----------------------------------------------------------------------------------


def test_cpu_tensors_use_the_references(monkeypatch):
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    x, r = data(300, torch.float32, 1), torch.randn(300, generator=gen(2))
    got = K.sign_ef(x, r, block=64)
    want = R.sign_ef_reference(x, r, block=64)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(K.qsgd_encode(x, 7, 5)[1], R.qsgd_encode_reference(x, 7, 5)[1])
    assert torch.equal(K.terngrad_encode(x, 5)[1], R.terngrad_encode_reference(x, 5)[1])
    ops = K.backend_report()["ops"]
    for op in ("sign_ef", "qsgd_encode", "terngrad_encode"):
        assert ops[op]["registered"] == ["triton"] and ops[op]["chosen"]["cpu"]["backend"] == "reference"
    with pytest.raises(ValueError, match="corrupt"):
        K.decode_add_quant(torch.zeros(300), [torch.zeros(5, dtype=torch.uint8)], "int8", block=64)


@interp
def test_forced_triton_runs_the_kernels(monkeypatch):
    monkeypatch.setenv(K.ENV_VAR, "triton")
    x = data(1009, torch.bfloat16, 7)
    got = K.terngrad_encode(x, 11, block=128)
    assert K.backend_report()["ops"]["terngrad_encode"]["chosen"]["cpu"]["backend"] == "triton"
    assert torch.equal(got[1], R.terngrad_encode_reference(x, 11, block=128)[1])
    _, frames, kw = _frames("qsgd", 1009)
    out = torch.zeros(1009)
    K.decode_add_quant(out, [f.body for f in frames], "qsgd", **kw)
    want = torch.zeros(1009)
    R.decode_add_quant_reference(want, [f.body for f in frames], "qsgd", **kw)
    assert torch.equal(bits(out), bits(want))
    assert K.backend_report()["ops"]["decode_add_quant"]["chosen"]["cpu"]["backend"] == "triton"


# -- ahead-of-time compile for sm_90 -------------------------------------------------------------


def test_aot_compile_quant_kernels_for_sm90(tmp_path):
    import inspect

    from gradzip.kernels.triton import quant

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-m", "gradzip.kernels.triton.aot", "--arch", "90", "--modules", "quant"],
        capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300, check=False,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(quant.AOT_SPECS), out.stderr[-3000:]
    bad = [(r["kernel"], r.get("error")) for r in rows if not (r["ok"] and r["ptx_target"] == "sm_90" and r["cubin_bytes"] > 1000)]
    assert not bad
    declared = {name for name, _ in inspect.getmembers(quant) if name.startswith("_") and name.endswith("_kernel")}
    assert declared == {r["kernel"] for r in rows}
    # The streaming encoders load 16 bytes per instruction on aligned, n % 16 == 0 launches.
    streaming = ("_sign_encode_kernel", "_qsgd_encode_kernel", "_sign_onepass_kernel", "_qsgd_onepass_kernel", "_terngrad_onepass_kernel")
    enc = [r for r in rows if r["kernel"] in streaming and r["divisible"]]
    assert {r["kernel"] for r in enc} == set(streaming) and all(r["vector_loads"] > 0 for r in enc)


# -- compiled kernels on a GPU ---------------------------------------------------------------


@gpu
@pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled")
@pytest.mark.parametrize("n", [1, 7, 1009, (1 << 20) + 3])
def test_compiled_quant_kernels_match_references(n):
    from gradzip.kernels.triton.quant import decode_add_quant_triton, qsgd_encode_triton, sign_ef_triton, terngrad_encode_triton

    for dtype in DTYPES:
        x = data(n, dtype, n)
        r = torch.randn(n, generator=gen(n + 1)) * 0.3
        xc, rc = x.cuda(), r.cuda()
        s, w, res = (t.cpu() for t in sign_ef_triton(xc, rc, block=1000))
        ws, ww, _ = R.sign_ef_reference(x, r, block=1000)
        assert ulps(s, ws) <= 1 and torch.equal(w, ww)
        assert torch.equal(bits(res), bits(R.sign_ef_reference(x, r, block=1000, scales=s)[2]))
        norms, codes = (t.cpu() for t in qsgd_encode_triton(xc, 7, 99, block=64))
        assert torch.allclose(norms, R.qsgd_encode_reference(x, 7, 99, block=64)[0], rtol=1e-5, atol=0)
        assert torch.equal(codes, R.qsgd_encode_reference(x, 7, 99, block=64, scales=norms)[1])
        sc, tc = (t.cpu() for t in terngrad_encode_triton(xc, 98, block=4096))
        assert torch.equal(tc, R.terngrad_encode_reference(x, 98, block=4096, scales=sc)[1])
        assert torch.equal(bits(sc), bits(R.terngrad_encode_reference(x, 98, block=4096)[0]))
    for kind in QKINDS:
        _, frames, kw = _frames(kind, n)
        k = kind[:4] if kind.startswith("qsgd") else kind
        want = torch.randn(n, generator=gen(3))
        got = want.cuda()
        R.decode_add_quant_reference(want, [f.body for f in frames], k, **kw)
        decode_add_quant_triton(got, [f.body.cuda() for f in frames], k, **kw)
        assert torch.equal(bits(got.cpu()), bits(want)), kind


@gpu
@pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled")
@pytest.mark.parametrize("n", [1009, (1 << 20) + 3])
def test_compiled_one_pass_routes_match_two_pass(n):
    from gradzip.kernels.triton.quant import qsgd_encode_triton, sign_ef_triton, terngrad_encode_triton

    for dtype in DTYPES:
        x = data(n, dtype, n + 7).cuda()
        r = (torch.randn(n, generator=gen(n + 8)) * 0.3).cuda()
        for block in (1024, 4096):
            one = sign_ef_triton(x, r, block=block, route="one")
            two = sign_ef_triton(x, r, block=block, route="two")
            assert ulps(one[0].cpu(), two[0].cpu()) <= 1 and torch.equal(one[1], two[1])
            want = R.sign_ef_reference(x.cpu(), r.cpu(), block=block, scales=one[0].cpu())
            assert torch.equal(bits(one[2].cpu()), bits(want[2]))
        for block in (64, 250):  # rows on a multiple of 4 (quads of draws), and not
            one = qsgd_encode_triton(x, 7, 5, block=block, route="one")
            two = qsgd_encode_triton(x, 7, 5, block=block, route="two")
            assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
            want = R.qsgd_encode_reference(x.cpu(), 7, 5, block=block, scales=one[0].cpu())[1]
            assert torch.equal(one[1].cpu(), want), block
        for clip in (None, 2.0):
            one = terngrad_encode_triton(x, 6, block=1024, clip=clip, route="one")
            two = terngrad_encode_triton(x, 6, block=1024, clip=clip, route="two")
            assert torch.equal(bits(one[0].cpu()), bits(two[0].cpu())) and torch.equal(one[1], two[1])


@gpu
def test_cuda_tensors_dispatch_to_triton(monkeypatch):
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    x = data(4099, torch.float32, 1).cuda()
    K.sign_ef(x, torch.zeros_like(x), block=256)
    assert K.backend_report()["ops"]["sign_ef"]["chosen"]["cuda"]["backend"] == "triton"
