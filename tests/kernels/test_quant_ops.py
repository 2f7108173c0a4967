"""The quantizer ops: Philox draws, the references (SignSGD, QSGD, TernGrad, Int8 encode;
frame decode), and the Triton kernels against them.

* The torch Philox4x32-10 matches Random123's known-answer vectors and, under
  TRITON_INTERPRET=1, ``tl.rand4x`` / ``tl.randint`` bit for bit.
* Each reference against an independent scalar oracle (:class:`Oracle`: Python floats,
  rounded to float32 after each operation for float32 arithmetic) on float32, float16,
  bfloat16 and float64 inputs, extreme values included (float64 beyond float32's range,
  float32 near its maximum, subnormals, zeros): every scale finite, blocks whose scale
  would not fit sent as zeros, QSGD decodes no larger than the norm.
* Each Triton kernel (interpreter) against its reference, bit for bit, on 0, 1, 31, 33 and
  4097 elements, blocks that are no multiple of the packing, both encoder routes, the
  residual written in place, and the same extreme values; frames encoded through
  ``gradzip.kernels`` with ``GRADZIP_KERNELS=triton`` are the CPU frames.
* ``@pytest.mark.gpu`` tests run the compiled kernels against the references when a CUDA
  device is present. The kernels' ahead-of-time compile for sm_90 is in
  tests/kernels/test_triton.py (one compile of every module).

The interpreter is slow: most calls use the default (interpreter) tile, one program for these
sizes, and a few use small tiles to cover programs that share blocks and ragged tails.
"""

import math
import os

import numpy as np
import pytest
import torch

import gradzip.kernels as K
from gradzip.kernels import quant as Q
from gradzip.kernels.bitpack import pack_bits, pack_nbit
from gradzip.kernels.philox import philox4x32, philox_randint, philox_uniform

try:
    import triton
except Exception:  # not installed: the kernel tests skip, the reference tests run
    triton = None

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
interp = pytest.mark.skipif(
    triton is None or not INTERPRETING, reason="needs triton and TRITON_INTERPRET=1 (conftest sets it without a GPU)"
)
gpu = pytest.mark.gpu
compiled = pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled")
# The interpreter computes masked-off lanes too (3e38 * 7, inf / inf) and numpy warns of it.
quiet = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 31, 33, 4097]
F32_MAX = 3.4028234663852886e38


def gen(seed):
    return torch.Generator().manual_seed(seed)


def bits(t):
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def data(n, dtype, seed=0):
    x = torch.randn(n, generator=gen(seed))
    x[x == 0] = 0.5  # random and non-zero
    return x.to(dtype)


def ulps(a, b):
    """Distance in float32 ulps (finite, same-sign values)."""
    return int((bits(a.float()).to(torch.int64) - bits(b.float()).to(torch.int64)).abs().max()) if a.numel() else 0


def extremes(dtype, subnormal=True):
    """Blocks of 8 that test the scales' range: values near float32's maximum (norms and
    squares beyond it), subnormals, zeros, mixed; for float64, values beyond float32's range.
    ``subnormal=False``: the smallest normal bfloat16 instead of subnormal ones (the Triton
    interpreter's bfloat16-to-float32 conversion garbles subnormals; the GPU's is exact)."""
    big = 3.0e38 if dtype != torch.float16 else 6.0e4
    tiny = {torch.float16: 6e-8, torch.bfloat16: 1e-40 if subnormal else 2.0**-126}.get(dtype, 1e-45)
    rows = [
        [big, -big, big, big, -big, big, big, -big],
        [tiny, -tiny, 0.0, tiny, 2 * tiny, -tiny, 0.0, tiny],
        [0.0] * 8,
        [big, 1.0, -0.5, 0.0, tiny, -big, 3.0, 0.25],
    ]
    if dtype == torch.float64:
        rows += [
            [1e39, -2e39, 1.0, 3e38, -1e300, 0.5, 1e-300, 2.0],
            [1e300, 1e300, -1e300, 1e300, 1e300, 1e300, 1e300, 1e300],
        ]
    return torch.tensor([v for row in rows for v in row], dtype=torch.float64).to(dtype)


def body(scales, codes):
    return torch.cat([scales.view(torch.uint8), codes.reshape(-1).view(torch.uint8)])


# -- Philox ---------------------------------------------------------------------------------------


def test_philox_matches_random123_known_answers():
    def run(key, ctr):
        out = philox4x32(key, *[torch.tensor([c], dtype=torch.int64) for c in ctr])
        return [int(o) for o in out]

    assert run(0, [0, 0, 0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run(2**64 - 1, [0xFFFFFFFF] * 4) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    key = (0x299F31D0 << 32) | 0xA4093822
    assert run(key, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]) == [
        0xD16CFE09,
        0x94FDCCEB,
        0x5001E420,
        0x24126EA1,
    ]


def test_philox_uniform_is_in_0_1_and_uniform():
    u = philox_uniform(123, 200_000)
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) < 1
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.005  # 6 standard errors
    assert torch.equal(philox_uniform(123, 50, offset=1000), u[1000:1050])
    assert K.philox_uniform is philox_uniform


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
        assert torch.equal(bits(u), bits(philox_uniform(seed, n, offset=base))), seed
        assert torch.equal(i.to(torch.int64) & 0xFFFFFFFF, philox_randint(seed, torch.arange(base, base + n))), seed


# -- the references against a scalar oracle ----------------------------------------------------


class Oracle:
    """The quantizers' arithmetic on Python floats, one element at a time: each operation in
    float64, then rounded to float32 where the arithmetic is float32 (exactly float32's own
    correctly rounded operation, since 53 >= 2 * 24 + 2). Block sums are math.fsum
    (correctly rounded), which the references' float64 sums equal on these data."""

    def __init__(self, x, block, residual=None):
        self.wide = x.dtype == torch.float64
        v = x.double() + (0 if residual is None else residual.double())
        self.v = [self.rd(a) for a in v.tolist()]
        n = len(self.v)
        b = max(1, n if block is None else min(block, n))
        self.blocks = [self.v[i : i + b] for i in range(0, n, b)]

    def rd(self, a):
        return a if self.wide else float(np.float32(a))

    @staticmethod
    def fit(wide, finite):
        return 0.0 if wide > F32_MAX and finite else float(np.float32(wide))

    @staticmethod
    def fsum(values):
        try:
            return math.fsum(values)
        except OverflowError:
            return math.inf

    def per_block(self, fn):
        """Each block's value and, per element, (element, its block's value)."""
        values = [fn(blk) for blk in self.blocks]
        return values, [(a, s) for blk, s in zip(self.blocks, values) for a in blk]

    def sign(self):
        scales, pairs = self.per_block(
            lambda blk: self.fit(self.fsum(abs(a) for a in blk) / len(blk), all(map(math.isfinite, blk)))
        )
        return scales, [a < 0 for a, _ in pairs], [self.rd(a - (-s if a < 0 else s)) for a, s in pairs]

    def qsgd(self, levels, u):
        norms, pairs = self.per_block(
            lambda blk: self.fit(math.sqrt(self.fsum(a * a for a in blk)), all(map(math.isfinite, blk)))
        )
        codes = []
        for (a, ne), ui in zip(pairs, u):
            r = min(max(self.rd(self.rd(abs(a) / ne) * levels), 0.0), levels) if ne > 0 else 0.0
            lvl = min(math.floor(r) + (ui < self.rd(r - math.floor(r))), levels)
            codes.append(int(levels + (-lvl if a < 0 else lvl)))
        return norms, codes

    def terngrad(self, clip, u):
        def scale(blk):
            s = max(abs(a) for a in blk)
            if clip is not None:
                s = min(s, self.rd(clip * math.sqrt(self.fsum(a * a for a in blk) / len(blk))))
            return self.fit(s, math.isfinite(max(abs(a) for a in blk)))

        scales, pairs = self.per_block(scale)
        codes = []
        for (a, s), ui in zip(pairs, u):
            p = min(self.rd(abs(a) / s), 1.0) if s > 0 else 0.0
            codes.append((2 if a < 0 else 1) if ui < p else 0)
        return scales, codes

    def int8(self):
        def scale(blk):
            amax = max(abs(a) for a in blk)
            s = np.float32(amax / 127)
            if float(s) * 127 > amax:
                s = np.nextafter(s, np.float32(0))
            s = max(float(s), 2.0**-149) if amax > 0 else 0.0
            return 0.0 if amax / 127 > F32_MAX and math.isfinite(amax) else s

        scales, pairs = self.per_block(scale)
        return scales, [int(max(-127, min(127, round(a / s)))) if s > 0 else 0 for a, s in pairs]


def _dtypes64():
    return DTYPES + [torch.float64]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", _dtypes64(), ids=str)
@pytest.mark.parametrize("case", ["random", "extreme"])
def test_references_are_the_oracle(dtype, case):
    """Every encoder reference, on 0, 1, 33 and 100 random elements and on extreme values,
    against the scalar oracle; every scale finite; the residual is v minus the decoded frame."""
    sets = (
        [(data(n, dtype, n), 8 if n > 40 else None) for n in (0, 1, 33, 100)]
        if case == "random"
        else [(extremes(dtype), 8)]
    )
    for x, block in sets:
        n = x.numel()
        u = philox_uniform(7, n).tolist()
        res = torch.randn(n, generator=gen(3)).to(K.accum_dtype(dtype)) * 0.25 if case == "random" else None
        o = Oracle(x, block, res)
        scales, words, r = K.sign_ef(x, res, block=block, new_residual=True)
        want_s, neg, want_r = o.sign()
        assert scales.tolist() == want_s and torch.equal(words, pack_bits(torch.tensor(neg, dtype=torch.bool)))
        assert r.tolist() == want_r
        nb, acc = K.quant_layout(n, block)[0], K.accum_dtype(dtype)
        v = x.to(acc) + (res if res is not None else 0)
        assert same(r, v - K.decode_quant(body(scales, words), n, "sign1", dtype=acc, block=block))
        for levels in (1, 7, 127):
            norms, codes = K.qsgd_encode(x, levels, 7, block=block)
            want_n, want_c = Oracle(x, block).qsgd(levels, u)
            assert norms.tolist() == want_n, levels
            assert torch.equal(codes, pack_nbit(torch.tensor(want_c, dtype=torch.uint8), K.qsgd_bits(levels))), levels
        for clip in (None, 0.5, 2.0):
            sc, codes = K.terngrad_encode(x, 7, block=block, clip=clip)
            want_s, want_c = Oracle(x, block).terngrad(clip, u)
            assert sc.tolist() == want_s and torch.equal(
                codes, pack_nbit(torch.tensor(want_c, dtype=torch.uint8), 2)
            ), clip
        sc, q = K.int8_encode(x, block=block)
        want_s, want_q = Oracle(x, block).int8()
        assert sc.tolist() == want_s and q.tolist() == want_q
        for t in (scales, norms, sc):
            assert t.dtype == torch.float32 and bool(torch.isfinite(t).all()) and t.numel() == nb


def test_scales_beyond_float32_are_sent_as_zero_and_error_feedback_keeps_the_block():
    x = torch.tensor([1e39, -2e39, 3.0, 1e300, 1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    scales, words, r = K.sign_ef(x, block=4, new_residual=True)
    assert scales[0] == 0 and 0 < scales[1] < 2 and torch.equal(r[:4], x[:4])  # the whole block kept
    norms, _ = K.qsgd_encode(x, 7, 1, block=4)
    assert norms[0] == 0 and 0 < norms[1] < 3
    for clip in (None, 1.0):
        assert K.terngrad_encode(x, 1, block=4, clip=clip)[0][0] == 0
    s8, q = K.int8_encode(torch.tensor([3e41, 1.0, 2e39, -1.0], dtype=torch.float64), block=2)
    assert s8.tolist()[0] == 0 and s8[1] > 0 and q[:2].tolist() == [0, 0]
    f = torch.full((64,), 3.0e38)  # float32: norm 2.4e39 beyond float32, mean and max within
    assert K.qsgd_encode(f, 7, 1)[0].item() == 0 and K.sign_ef(f)[0].item() == np.float32(3.0e38)


def test_int8_scales():
    amax = torch.tensor([0.0, 1e-45, 1e-40, 1.0, 127.0, 3.4028234663852886e38, float("nan"), float("inf")])
    s = K.int8_scales(amax)
    assert s.dtype == torch.float32
    assert s[0] == 0 and s[1] == 2.0**-149 and s[6] == 0 and s[7] == float("inf")  # NaN blocks are sent as zeros
    # 127 * S <= amax wherever amax is at least 127 subnormals (below, S is the smallest subnormal).
    assert bool((s[2:6].double() * 127 <= amax[2:6].double()).all()) and bool(torch.isfinite(s[:7]).all())
    assert s[4] == 1.0 and (s[3].double() - 1 / 127).abs() < 2**-30
    wide = K.int8_scales(torch.tensor([127.0 * 3.4e38, 128.0 * 3.4028234663852886e38, 1e300], dtype=torch.float64))
    assert wide[0] > 0 and torch.equal(wide[1:], torch.zeros(2))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the oracle's float32 rounding
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_decode_reference_is_the_oracle(dtype):
    """Every kind decodes by the module's table, in float32 or float64; QSGD's values never
    exceed the norm (code 0 with levels 127 and a norm at float32's maximum is -N exactly)."""
    n, block = 100, 16
    g = gen(1)
    scales = torch.rand(7, generator=g) * 3
    scales[2], scales[5] = 3.4028234663852886e38, 0.0
    raw = {
        "sign1": (torch.randint(-(2**31), 2**31, (4,), generator=g, dtype=torch.int64).to(torch.int32), {}),
        "qsgd": (torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8), {"levels": 127, "bits": 8}),
        "tern2": (pack_nbit(torch.randint(0, 3, (n,), generator=g, dtype=torch.uint8), 2), {}),
        "int8": (torch.randint(-127, 128, (n,), generator=g, dtype=torch.int8), {}),
    }
    raw["qsgd"][0][2 * block] = 0
    rd = (lambda a: a) if dtype == torch.float64 else (lambda a: float(np.float32(a)))
    for kind, (codes, kw) in raw.items():
        got = K.decode_quant(body(scales, codes), n, kind, dtype=dtype, block=block, **kw)
        se = scales.double().repeat_interleave(block)[:n].tolist()
        if kind == "sign1":
            neg = [bool((int(codes[i // 32]) >> (i % 32)) & 1) for i in range(n)]
            want = [-s if ng else s for s, ng in zip(se, neg)]
        elif kind == "qsgd":
            want = [rd((c - 127) * rd(s / 127)) for c, s in zip(codes.tolist(), se)]
            want = [math.copysign(s, w) if abs(w) > s else w for w, s in zip(want, se)]
        elif kind == "tern2":
            want = [
                {0: 0.0, 1: s, 2: -s}[c]
                for c, s in zip(
                    torch.tensor([(int(b) >> (2 * j)) & 3 for b in codes for j in range(4)])[:n].tolist(), se
                )
            ]
        else:  # int8's scales keep 127 * S within float32; only the format is tested here
            want = [rd(q * s) for q, s in zip(codes.tolist(), se)]
        assert got.dtype == dtype and got.tolist() == want, kind
        assert kind == "int8" or bool(torch.isfinite(got).all()), kind
    assert (
        K.decode_quant(body(scales, raw["qsgd"][0]), n, "qsgd", dtype=torch.float32, block=block, levels=127)[2 * block]
        == -3.4028234663852886e38
    )


@pytest.mark.parametrize("kind", ["sign1", "qsgd", "tern2", "int8"])
def test_decode_add_quant_accumulates_peers_in_order_in_either_dtype(kind):
    """decode_add_quant == out + decode_quant per peer (in order), in float32 and float64;
    decode_quant keeps signed zeros; the CPU sign1 table decode is the where() decode."""
    n, block = 70_003, 1000  # more than one chunk of the CPU sign1 decode
    x = [data(n, torch.float32, p) for p in range(3)]
    enc = {
        "sign1": lambda v: body(*K.sign_ef(v, block=block)[:2]),
        "qsgd": lambda v: body(*K.qsgd_encode(v, 7, 3, block=block)),
        "tern2": lambda v: body(*K.terngrad_encode(v, 3, block=block)),
        "int8": lambda v: body(*K.int8_encode(v, block=block)),
    }[kind]
    kw = {"levels": 7, "bits": 4} if kind == "qsgd" else {}
    bodies = [enc(v) for v in x]
    for dtype in (torch.float32, torch.float64):
        out0 = torch.randn(n, generator=gen(9)).to(dtype)
        out0[0] = -0.0
        want = out0.clone()
        for b in bodies:
            want = want + K.decode_quant(b, n, kind, dtype=dtype, block=block, **kw)
        got = out0.clone()
        K.decode_add_quant(got, bodies, kind, block=block, **kw)
        assert same(got, want), dtype
    if kind == "sign1":
        scales = bodies[0][: 4 * 71].view(torch.float32)
        neg = torch.from_numpy(np.unpackbits(bodies[0][4 * 71 :].numpy(), bitorder="little")[:n].astype(bool))
        s = scales.repeat_interleave(block)[:n]
        assert same(K.decode_quant(bodies[0], n, "sign1", dtype=torch.float32, block=block), torch.where(neg, -s, s))
    zero = K.decode_quant(body(torch.zeros(1), torch.tensor([-1], dtype=torch.int32)), 3, "sign1", dtype=torch.bfloat16)
    assert (
        zero.dtype == torch.bfloat16
        and bits(zero).tolist() == bits(torch.tensor([-0.0] * 3, dtype=torch.bfloat16)).tolist()
    )


def test_sign_ef_writes_the_residual_into_out():
    for dtype in (torch.float32, torch.float64):
        x, r = data(1000, dtype, 1), torch.randn(1000, generator=gen(2)).to(dtype)
        want = Q.sign_ef_reference(x, r, block=96)
        for name in ("residual", "x", "separate"):
            x0, r0 = x.clone(), r.clone()
            out = {"residual": r0, "x": x0, "separate": torch.empty(1000, dtype=dtype)}[name]
            got = K.sign_ef(x0, r0 if name != "x" else None, block=96, out=out)
            ref = want if name != "x" else Q.sign_ef_reference(x, None, block=96, new_residual=True)
            assert got[2] is out and same(out, ref[2]) and same(got[0], ref[0]) and torch.equal(got[1], ref[1]), name


def test_arguments_are_checked():
    x = data(10, torch.float32)
    with pytest.raises(ValueError, match="levels"):
        K.qsgd_encode(x, 0, 1)
    with pytest.raises(ValueError, match="2 \\* levels"):
        K.qsgd_encode(x, 8, 1, bits=4)
    with pytest.raises(ValueError, match="seed"):
        K.terngrad_encode(x, -1)
    with pytest.raises(ValueError, match="clip"):
        K.terngrad_encode(x, 1, clip=0.0)
    with pytest.raises(ValueError, match="block"):
        K.sign_ef(x, block=0)
    with pytest.raises(ValueError, match="corrupt"):
        K.decode_add_quant(torch.zeros(300), [torch.zeros(5, dtype=torch.uint8)], "int8", block=64)
    with pytest.raises(TypeError, match="float32 or float64"):
        K.decode_add_quant(torch.zeros(3, dtype=torch.float16), [], "int8")
    with pytest.raises(ValueError, match="scales"):
        K.int8_encode(x, block=4, scales=torch.ones(2))


# -- the kernels against the references (interpreter) -------------------------------------------


def _kernels():
    from gradzip.kernels.triton.decode import decode_add_quant_triton
    from gradzip.kernels.triton.sign import sign_ef_triton
    from gradzip.kernels.triton.stochastic import qsgd_encode_triton, terngrad_encode_triton

    return sign_ef_triton, qsgd_encode_triton, terngrad_encode_triton, decode_add_quant_triton


def _check_encoders(
    x,
    r,
    *,
    tile=None,
    sign_blocks=(None, 32, 96, 100),
    qsgd_cases=((7, 64), (1, None), (100, 33), (7, 250)),
    tern_cases=((None, None), (None, 50), (1.5, 64), (0.5, 4)),
    routes=("auto",),
):
    sign, qsgd, tern, _ = _kernels()
    n = x.numel()
    for route in routes:
        for block in sign_blocks:
            got = sign(x, r, block=block, new_residual=True, tile=tile, route=route)
            want = Q.sign_ef_reference(x, r, block=block, new_residual=True)
            assert all(same(a, b) for a, b in zip(got, want)), ("sign", block, route)
        for levels, block in qsgd_cases:
            got, want = (
                qsgd(x, levels, 2**41 + n, block=block, tile=tile, route=route),
                Q.qsgd_encode_reference(x, levels, 2**41 + n, block=block),
            )
            assert same(got[0], want[0]) and torch.equal(got[1], want[1]), ("qsgd", levels, block, route)
        for clip, block in tern_cases:
            got, want = (
                tern(x, 77 + n, block=block, clip=clip, tile=tile, route=route),
                Q.terngrad_encode_reference(x, 77 + n, block=block, clip=clip),
            )
            assert same(got[0], want[0]) and torch.equal(got[1], want[1]), ("tern", clip, block, route)


# Every size once and every dtype at several (every interpreted launch costs, whatever its
# size: not the full cross product); 4097 (several programs, a ragged tail) in every dtype.
SIZE_DTYPES = [
    (0, torch.float32),
    (1, torch.float16),
    (31, torch.bfloat16),
    (33, torch.float32),
    (4097, torch.float32),
    (4097, torch.float16),
    (4097, torch.bfloat16),
]
SIZE_DTYPE_IDS = [f"{n}-{str(d).split('.')[-1]}" for n, d in SIZE_DTYPES]


@interp
@pytest.mark.parametrize("n,dtype", SIZE_DTYPES, ids=SIZE_DTYPE_IDS)
def test_encoder_kernels_match_references(dtype, n):
    """Scales, words, codes and residuals bit for bit (the float64 block sums of these data
    are exact), on both routes: one pass where it applies (see one_pass_shape), two passes."""
    x, r = data(n, dtype, n), torch.randn(n, generator=gen(n + 1)) * 0.3
    _check_encoders(x, r, routes=("auto", "two"))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # float16: above
def test_encoder_kernels_share_blocks_between_programs_and_end_ragged(dtype):
    """Small tiles: programs of several blocks (one pass), blocks across programs (two passes);
    2049 elements: five programs of the small tile, the last one ragged."""
    x, r = data(2049, dtype, 3), torch.randn(2049, generator=gen(4)) * 0.3
    _check_encoders(
        x,
        r,
        tile=512,
        sign_blocks=(32, 96, 100, None),
        qsgd_cases=((7, 64), (100, 33)),
        tern_cases=((1.5, 64), (None, 50)),
    )


@interp
def test_sign_kernel_writes_the_residual_over_its_inputs():
    sign = _kernels()[0]
    x, r = data(4097, torch.float32, 5), torch.randn(4097, generator=gen(6)) * 0.3
    for route, block in (("one", 1024), ("two", 1000)):
        want = Q.sign_ef_reference(x, r, block=block)
        r0 = r.clone()
        got = sign(x, r0, block=block, out=r0, tile=1024, route=route)
        assert got[2] is r0 and same(r0, want[2]) and same(got[0], want[0]), route
        x0 = x.clone()
        got = sign(x0, None, block=block, out=x0, tile=1024, route=route)
        assert got[2] is x0 and same(x0, Q.sign_ef_reference(x, None, block=block, new_residual=True)[2]), route


@interp
@quiet[0]
@quiet[1]
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encoder_kernels_on_extreme_values(dtype):
    """Values near float32's maximum, subnormals and zeros: the kernels' scales are the
    references' (finite; QSGD's norm beyond float32 sent as 0), and so are the codes."""
    x = extremes(dtype, subnormal=False)
    _check_encoders(
        x,
        None,
        sign_blocks=(8, 32),
        qsgd_cases=((7, 8), (127, 8), (7, None)),
        tern_cases=((None, 8), (2.0, 8)),
        routes=("auto", "two"),
    )
    norms, _ = _kernels()[1](x, 7, 1, block=8)
    assert bool(torch.isfinite(norms).all()) and (dtype == torch.float16 or norms[0] == 0)  # float16's max is 65504


def _int8_kernel():
    from gradzip.kernels.triton.int8 import int8_encode_triton

    return int8_encode_triton


def _check_int8(x, blocks, routes=("auto", "two"), tile=None):
    enc = _int8_kernel()
    for route in routes:
        for block in blocks:
            got, want = enc(x, block=block, route=route, tile=tile), Q.int8_encode_reference(x, block=block)
            assert same(got[0], want[0]) and torch.equal(got[1], want[1]), (block, route, tile)


@interp
@pytest.mark.parametrize("n,dtype", SIZE_DTYPES, ids=SIZE_DTYPE_IDS)
def test_int8_kernel_matches_reference(dtype, n):
    """Scales and codes bit for bit on both routes (one pass: blocks of at most the tile), with
    blocks that share a program, span programs (tile 512) and end ragged."""
    x = data(n, dtype, n + 11) * 3
    _check_int8(x, (None, 32, 96, 100, 1024))
    _check_int8(x, (None, 96, 1024), tile=512)


@interp
@quiet[0]
@quiet[1]
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_kernel_on_ties_and_extreme_values(dtype):
    """Quotients exactly halfway (ties to even), values near float32's maximum, the smallest
    subnormal (its scale clamped up), zero blocks, and blocks holding NaN (scale 0, codes 0)
    or an infinity (the other codes 0; inf / inf sent as 0, as the reference's cast gives here)."""
    ties = [127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 3.5, -3.5, 4.5, 0.0, -0.0, 1e-3, -127.0, 64.5]
    rows = ties + [float("nan"), 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0] + [float("inf"), 1.0, -2.0, 3.0, 1.0, 2.0, 3.0, 4.0]
    x = torch.cat([torch.tensor(rows), extremes(torch.float32, subnormal=dtype != torch.bfloat16)]).to(dtype)
    _check_int8(x, (8, 16, None))


def test_int8_one_pass_route_is_refused_where_it_does_not_apply():
    if triton is None:
        pytest.skip("needs triton")
    from gradzip.kernels.triton.int8 import one_pass_rows

    assert one_pass_rows(4097, 1024, 4096) == (4, 1024)
    assert one_pass_rows(100, 1024, 4096) == (1, 128)  # one block of 100
    assert one_pass_rows(5000, None, 4096) is None  # one block of 5000 > the tile
    assert one_pass_rows(0, 1024, 4096) is None


@interp
def test_kernels_on_sums_that_are_not_exact():
    """Values over ~90 binades: the float64 block sums depend on the order. A scale is within
    one float32 ulp of the reference's; given the same scales, the rest is bit-exact."""
    sign, qsgd, tern, _ = _kernels()
    n = 5003
    x = torch.randn(n, generator=gen(9)) * torch.exp2(torch.randint(-60, 30, (n,), generator=gen(10)).float())
    for route, block in (("one", 256), ("two", 1000)):
        s, w, res = sign(x, None, block=block, new_residual=True, tile=1024, route=route)
        ws, ww, _ = Q.sign_ef_reference(x, None, block=block)
        assert ulps(s, ws) <= 1 and torch.equal(w, ww)
        assert same(res, Q.sign_ef_reference(x, None, block=block, new_residual=True, scales=s)[2])
        norms, codes = qsgd(x, 7, 3, block=block, tile=1024, route=route)
        assert ulps(norms, Q.qsgd_encode_reference(x, 7, 3, block=block)[0]) <= 1
        assert torch.equal(codes, Q.qsgd_encode_reference(x, 7, 3, block=block, scales=norms)[1])
        sc, codes = tern(x, 5, block=block, clip=1.0, tile=1024, route=route)
        assert ulps(sc, Q.terngrad_encode_reference(x, 5, block=block, clip=1.0)[0]) <= 1
        assert torch.equal(codes, Q.terngrad_encode_reference(x, 5, block=block, clip=1.0, scales=sc)[1])


def test_one_pass_shape_says_where_the_one_pass_route_applies():
    pytest.importorskip("triton")
    from gradzip.kernels.triton.blocks import one_pass_shape

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
def test_one_pass_route_is_refused_where_it_does_not_apply():
    sign, qsgd, tern, _ = _kernels()
    x = data(1009, torch.float32, 1)
    with pytest.raises(K.Unsupported, match="no one-pass route"):
        sign(x, None, block=100, route="one")  # words straddle blocks
    with pytest.raises(K.Unsupported, match="no one-pass route"):
        qsgd(x, 7, 1, block=None, tile=256, route="one")  # longer than the tile
    with pytest.raises(K.Unsupported, match="no one-pass route"):
        tern(x, 1, block=50, route="one")
    with pytest.raises(ValueError, match="route must be"):
        sign(x, None, block=64, route="fused")


def _frames(kind, n, dtype=torch.float32, peers=3):
    """Peers' frame bodies of ``kind`` from the encoders, and decode_add_quant's keywords."""
    block, kw, enc = {
        "sign1": (100, {}, lambda v, p: K.sign_ef(v, block=100)[:2]),
        "qsgd": (64, {"levels": 7, "bits": 4}, lambda v, p: K.qsgd_encode(v, 7, p, block=64)),
        "qsgd2": (None, {"levels": 1, "bits": 2}, lambda v, p: K.qsgd_encode(v, 1, p, block=None)),
        "qsgd8": (33, {"levels": 127, "bits": 8}, lambda v, p: K.qsgd_encode(v, 127, p, block=33)),
        "tern2": (50, {}, lambda v, p: K.terngrad_encode(v, p, block=50)),
        "int8": (128, {}, lambda v, p: K.int8_encode(v, block=128)),
    }[kind]
    bodies = [body(*enc(data(n, dtype, n + p), p)) for p in range(peers)]
    return bodies, dict(kw, block=block)


QKINDS = ["sign1", "qsgd", "qsgd2", "qsgd8", "tern2", "int8"]


@interp
@pytest.mark.parametrize("kind", QKINDS)
def test_decode_add_quant_kernel_matches_reference(kind, monkeypatch):
    from gradzip.kernels.triton import decode as D

    read = []  # (base pointer, offsets) of every call: in place or copied
    real = D._bodies_in_one
    monkeypatch.setattr(D, "_bodies_in_one", lambda b, a: read.append(real(b, a)) or read[-1])
    decode = _kernels()[3]
    k = kind[:4] if kind.startswith("qsgd") else kind
    for n in SIZES:
        bodies, kw = _frames(kind, n)
        out0 = torch.randn(n, generator=gen(5))
        if n:
            out0[0] = -0.0
        want = out0.clone()
        Q.decode_add_quant_reference(want, bodies, k, **kw)
        got = out0.clone()
        decode(got, bodies, k, **kw)  # separate bodies: copied into one buffer
        assert same(got, want), n
        msg = torch.zeros(len(bodies), max(b.numel() for b in bodies) + 24, dtype=torch.uint8)
        for i, b in enumerate(bodies):  # the all-gather layout: one buffer, 8-byte aligned bodies
            msg[i, 8 : 8 + b.numel()] = b
        got = out0.clone()
        decode(got, [msg[i, 8 : 8 + b.numel()] for i, b in enumerate(bodies)], k, tile=1024 if n > 1024 else None, **kw)
        assert same(got, want), n
        # A round's frames where the messages put them: bodies at odd offsets of one buffer,
        # read in place (scales a byte at a time), by the kernel, Numba and the reference.
        views = [msg[i, 3 + i : 3 + i + b.numel()] for i, b in enumerate(bodies)]
        for i, b in enumerate(bodies):
            views[i].copy_(b)
        for run in (decode, K.decode_add_quant, Q.decode_add_quant_reference):
            got = out0.clone()
            run(got, views, k, **kw)
            assert same(got, want), (n, run)
        if n:  # the kernel read them in place (no copy), at their odd offsets
            base, offs = read[-1]
            assert base.data_ptr() == msg.data_ptr() and offs == [v.storage_offset() for v in views]


def _segments(kind, sizes, shared: bool):
    """Frames of ``kind`` for pieces of ``sizes`` elements, back to back in one message buffer
    (``shared``: the bodies are views of it at unaligned offsets) or apart; their ranges in a
    flat output with gaps between them; the decode keywords."""
    bodies, kw = [], None
    for n in sizes:
        got, kw = _frames(kind, n, peers=1)
        bodies.append(got[0])
    if shared:
        msg = torch.zeros(3 + sum(b.numel() + 1 for b in bodies), dtype=torch.uint8)
        views, pos = [], 3
        for b in bodies:
            msg[pos : pos + b.numel()] = b
            views.append(msg[pos : pos + b.numel()])
            pos += b.numel() + 1
        bodies = views
    starts, pos = [], 0
    for n in reversed(sizes):  # ranges in another order than the bodies
        starts.insert(0, pos)
        pos += n + 2
    return bodies, starts, pos, kw


@pytest.mark.parametrize("kind", QKINDS)
@pytest.mark.parametrize("shared", [True, False])
def test_decode_add_quant_segments_is_a_decode_per_range(kind, shared):
    """Every backend that runs here (the reference; Numba; Triton under the interpreter) gives
    each range of ``out`` the decode-add of its own frame, bit for bit, and leaves the rest."""
    k = kind[:4] if kind.startswith("qsgd") else kind
    sizes = [1, 4097, 0, 33, 130]
    bodies, starts, total, kw = _segments(kind, sizes, shared)
    out0 = torch.randn(total, generator=gen(2))
    want = out0.clone()
    for b, st, n in zip(bodies, starts, sizes):
        if n:
            Q.decode_add_quant_reference(want[st : st + n], [b.clone()], k, **kw)
    got = out0.clone()
    K.decode_add_quant_segments(got, bodies, starts, sizes, k, **kw)
    assert same(got, want)
    if INTERPRETING and triton is not None:
        from gradzip.kernels.triton.decode import decode_add_quant_segments_triton

        got = out0.clone()
        decode_add_quant_segments_triton(got, bodies, starts, sizes, k, tile=1024, **kw)
        assert same(got, want)


def test_decode_add_quant_segments_refuses_overlaps_and_wrong_lengths():
    bodies, starts, total, kw = _segments("int8", [10, 20], True)
    out = torch.zeros(total)
    with pytest.raises(ValueError, match="overlaps"):
        K.decode_add_quant_segments(out, bodies, [0, 5], [10, 20], "int8", **kw)
    with pytest.raises(ValueError, match="leaves"):
        K.decode_add_quant_segments(out, bodies, [0, total - 5], [10, 20], "int8", **kw)
    with pytest.raises(ValueError, match="corrupt int8 body"):
        K.decode_add_quant_segments(out, bodies, starts, [10, 21], "int8", **kw)


@interp
@pytest.mark.parametrize("subtract", [False, True])
def test_int8_apply_kernel_matches_reference(subtract):
    """Int8's decode-add and its error feedback's subtraction (``out -= decode``, peer by peer):
    one launch of the decode kernel, bit for bit with ``int8_apply_``'s reference."""
    from gradzip.kernels.triton.decode import int8_apply_triton

    for n in SIZES:
        bodies, kw = _frames("int8", n)
        out0 = torch.randn(n, generator=gen(9)) * 4
        want, got = out0.clone(), out0.clone()
        Q.int8_apply_(want, bodies, block=kw["block"], subtract=subtract)
        int8_apply_triton(got, bodies, block=kw["block"], subtract=subtract)
        assert same(got, want), (n, subtract)


SEGMENT_BOUNDS = [  # (n, bounds): equal pieces, empty and one-element pieces, a range inside x
    (4096, [0, 1024, 2048, 3072, 4096]),
    (1037, [0, 100, 100, 601, 602, 1037]),
    (5003, [3, 1250, 2500, 3751, 5000]),
    (9, [0, 9]),
]


def _segments_input(n, extreme=False):
    x = data(n, torch.float32, n + 5) * 3
    if extreme and n >= 96:  # ties, NaN and infinity blocks, float32's ends, zeros
        x[:32] = torch.tensor([0.5, 1.5, 2.5, -2.5, 126.5, 0.0, -0.0, 1e-3] * 4)
        x[40], x[70] = float("nan"), float("inf")
        x[80:88] = extremes(torch.float32)[:8]
    return x


def _extremes(n, extremes):
    """The ``extreme`` flags to run for ``n`` elements: below 96 the extreme input is the plain one."""
    return [e for e in extremes if not (e and n < 96)] or [False]


def _segments_check(encode, tile=None, blocks=(None, 8, 100, 1024, 8192), extremes=(False, True), bounds_of=None):
    """``encode(x, bounds, block=, residual=)`` against the reference and against
    ``int8_encode_reference`` and ``int8_apply_`` piece by piece, bit for bit: the bodies, the
    residual (apart, and written over x) and the elements outside the pieces left alone."""
    for n, bounds in bounds_of or SEGMENT_BOUNDS:
        for block in blocks:
            for extreme in _extremes(n, extremes):
                x = _segments_input(n, extreme)
                want, woffs = Q.int8_encode_segments_reference(x, bounds, block=block)
                r_want = torch.full((n,), 7.0)
                assert torch.equal(Q.int8_encode_segments_reference(x, bounds, block=block, residual=r_want)[0], want)
                for j, (a, b) in enumerate(zip(bounds, bounds[1:])):  # the reference is encode per piece
                    sc, codes = Q.int8_encode_reference(x[a:b], block=block)
                    body = want[woffs[j] : woffs[j] + 4 * sc.numel() + (b - a)]
                    assert same(body[: 4 * sc.numel()].view(torch.float32), sc) and woffs[j] % 4 == 0
                    assert torch.equal(body[4 * sc.numel() :].view(torch.int8), codes)
                    r = x[a:b].clone()
                    Q.int8_apply_(r, [body], block=block, subtract=True)
                    assert same(r_want[a:b], r)
                assert bool((r_want[: bounds[0]] == 7).all()) and bool((r_want[bounds[-1] :] == 7).all())
                kw = {} if tile is None else {"tile": tile}
                got, offs = encode(x, bounds, block=block, **kw)
                assert offs == woffs and torch.equal(got, want), (n, block, extreme)
                r = torch.full((n,), 7.0)
                assert torch.equal(encode(x, bounds, block=block, residual=r, **kw)[0], want)
                assert same(r, r_want), (n, block, extreme)
                inplace = x.clone()
                encode(inplace, bounds, block=block, residual=inplace, **kw)
                a, b = bounds[0], bounds[-1]
                assert same(inplace[a:b], r_want[a:b]) and same(inplace[:a], x[:a]) and same(inplace[b:], x[b:])


@quiet[0]
@quiet[1]
def test_int8_encode_segments_is_int8_encode_and_its_subtraction_per_piece():
    """The op through the dispatch (Numba on the CPU, else the reference) and the reference."""
    _segments_check(K.int8_encode_segments)


@interp
@quiet[0]
@quiet[1]
def test_int8_encode_segments_kernel_matches_reference():
    """The Triton kernel (one launch: pieces whose blocks share no program, blocks beyond the
    tile piece by piece), with the interpreter's tile and a small one (programs of 2 blocks
    of 256, a piece spanning many programs). Every interpreted program costs: with the
    interpreter's tile, blocks of 8 (many a program; 1024 is another power of two), 100 (padded
    to 128), 8192 (longer than any piece) and None (piece by piece) on the extreme inputs
    (random values with ties, NaN, infinity and float32's ends planted); with the small tile,
    the random ones."""
    from gradzip.kernels.triton.int8 import int8_encode_segments_triton

    _segments_check(int8_encode_segments_triton, blocks=(None, 8, 100, 8192), extremes=(True,))
    _segments_check(
        int8_encode_segments_triton, tile=512, blocks=(100,), extremes=(False,), bounds_of=SEGMENT_BOUNDS[:3]
    )
    # 1024: piece by piece, a two-pass encode of the small tile a piece
    _segments_check(
        int8_encode_segments_triton, tile=512, blocks=(1024,), extremes=(False,), bounds_of=SEGMENT_BOUNDS[2:3]
    )


@pytest.mark.parametrize("op", ["int8_encode_segments", "sign_ef_segments"])
def test_segmented_encoders_check_their_bounds_and_layout(op):
    x, encode = torch.zeros(10), getattr(K, op)
    with pytest.raises(ValueError, match="non-decreasing"):
        encode(x, [0, 6, 5, 10])
    with pytest.raises(ValueError, match="non-decreasing"):
        encode(x, [0, 11])
    with pytest.raises(ValueError, match="flat contiguous"):
        encode(x.view(2, 5), [0, 10])


def test_int8_encode_segments_checks_its_arguments():
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="flat contiguous"):
        K.int8_encode_segments(x.half(), [0, 10])
    with pytest.raises(ValueError, match="residual"):
        K.int8_encode_segments(x, [0, 10], residual=torch.zeros(10, dtype=torch.float64))


def _sign_segments_check(
    encode, tile=None, dtypes=(torch.float32, torch.bfloat16, torch.float16), extremes=(False, True)
):
    """``encode(x, bounds, residual=, out=)`` against the reference and against
    ``sign_ef_reference`` piece by piece, bit for bit: the bodies, the new residual (apart,
    written over the residual read, and over x compensated in place) and the elements outside
    the pieces left alone; extreme pieces too (NaN, infinity, float32's ends: a scale of 0 or
    NaN; a NaN residual matches any NaN: the backends' NaN payloads differ)."""

    def close(a, b):
        return torch.equal(a.isnan(), b.isnan()) and same(a.masked_fill(a.isnan(), 0.0), b.masked_fill(b.isnan(), 0.0))

    kw = {} if tile is None else {"tile": tile}
    for n, bounds in SEGMENT_BOUNDS:
        for dtype in dtypes:
            for extreme in _extremes(n, extremes):
                x = _segments_input(n, extreme).to(dtype)
                r = torch.randn(n, generator=gen(n)) * 0.5
                want, woffs = Q.sign_ef_segments_reference(x, bounds)
                assert woffs == Q.sign_segments_layout(bounds)[0]
                out_want = torch.full((n,), 7.0)
                want_r, _ = Q.sign_ef_segments_reference(x, bounds, residual=r, out=out_want)
                for j, (a, b) in enumerate(zip(bounds, bounds[1:])):  # the reference is sign_ef per piece
                    if a == b:
                        continue
                    sc, words, res = Q.sign_ef_reference(x[a:b], r[a:b], new_residual=True)
                    body = want_r[woffs[j] : woffs[j] + 4 + 4 * words.numel()]
                    assert same(body[:4].view(torch.float32), sc) and same(body[4:].view(torch.int32), words)
                    assert close(out_want[a:b], res)
                assert bool((out_want[: bounds[0]] == 7).all()) and bool((out_want[bounds[-1] :] == 7).all())
                got, offs = encode(x, bounds, **kw)
                assert offs == woffs and torch.equal(got, want), (n, dtype, extreme)
                out = torch.full((n,), 7.0)
                assert torch.equal(encode(x, bounds, residual=r, out=out, **kw)[0], want_r)
                assert close(out, out_want), (n, dtype, extreme)
                over = r.clone()  # the new residual over the one read
                assert torch.equal(encode(x, bounds, residual=over, out=over, **kw)[0], want_r)
                a, b = bounds[0], bounds[-1]
                assert close(over[a:b], out_want[a:b]) and same(over[:a], r[:a]) and same(over[b:], r[b:])
                if dtype == torch.float32:  # compensated already, encoded in place
                    v = x + r
                    assert torch.equal(encode(v, bounds, out=v, **kw)[0], want_r)
                    assert close(v[a:b], out_want[a:b]) and same(v[:a], (x + r)[:a])


@quiet[0]
@quiet[1]
def test_sign_ef_segments_is_sign_ef_per_piece():
    """The op through the dispatch (Numba on the CPU, else the reference) and the reference."""
    _sign_segments_check(K.sign_ef_segments)


@interp
@quiet[0]
@quiet[1]
def test_sign_ef_segments_kernels_match_reference():
    """The three Triton launches with the interpreter's tile and a small one (256: a piece spanning
    several programs, a program's words crossing no piece): every dtype on the extreme inputs
    (random values with NaN, infinity and float32's ends planted) with the interpreter's tile,
    float32 on the random ones with the small tile (every interpreted program costs)."""
    from gradzip.kernels.triton.sign import sign_ef_segments_triton

    _sign_segments_check(sign_ef_segments_triton, extremes=(True,))
    _sign_segments_check(sign_ef_segments_triton, tile=256, dtypes=(torch.float32,), extremes=(False,))


def test_sign_ef_segments_checks_its_arguments():
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="residual has 9"):
        K.sign_ef_segments(x, [0, 10], residual=torch.zeros(9))
    with pytest.raises(TypeError, match="out must be a torch.float32"):
        K.sign_ef_segments(x, [0, 10], out=torch.zeros(10, dtype=torch.float64))


@interp
@quiet[0]
@quiet[1]
def test_decode_kernel_caps_qsgd_values_at_the_norm():
    decode = _kernels()[3]
    norms = torch.tensor([3.4028234663852886e38, 1.0, float("nan"), 0.0])
    codes = torch.tensor([0, 254, 0, 127, 127, 0, 3, 200], dtype=torch.uint8).repeat_interleave(2)
    b = body(norms, codes)
    out = torch.full((16,), -0.0)
    decode(out, [b], "qsgd", block=4, levels=127, bits=8)
    want = torch.full((16,), -0.0)
    Q.decode_add_quant_reference(want, [b], "qsgd", block=4, levels=127, bits=8)
    assert same(out, want) and out[0] == -3.4028234663852886e38 and out[2] == 3.4028234663852886e38
    assert out[4:8].abs().max() <= 1.0 and out[8:12].isnan().all()


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_frames_through_the_dispatch_are_the_cpu_frames(dtype, monkeypatch):
    """gradzip.kernels with GRADZIP_KERNELS=triton (the interpreter) gives the CPU frames,
    byte for byte, and decodes them to the CPU floats; float64 still takes the reference."""
    x, r = data(4097, dtype, 11), torch.randn(4097, generator=gen(12)) * 0.1
    calls = [
        ("sign_ef", lambda: K.sign_ef(x, r, block=1024)),
        ("qsgd_encode", lambda: K.qsgd_encode(x, 7, 5)),
        ("terngrad_encode", lambda: K.terngrad_encode(x, 5, block=2048, clip=2.5)),
    ]
    for op, call in calls:
        monkeypatch.delenv(K.ENV_VAR, raising=False)
        want = call()
        monkeypatch.setenv(K.ENV_VAR, "triton")
        got = call()
        assert K.backend_report()["ops"][op]["chosen"]["cpu"]["backend"] == "triton"
        assert all(same(a, b) for a, b in zip(got, want)), op
    bodies, kw = _frames("qsgd", 4097, dtype)
    monkeypatch.setenv(K.ENV_VAR, "triton")
    got = K.decode_quant(bodies[0], 4097, "qsgd", dtype=dtype, **kw)
    monkeypatch.setenv(K.ENV_VAR, "reference")
    assert same(got, K.decode_quant(bodies[0], 4097, "qsgd", dtype=dtype, **kw))
    monkeypatch.setenv(K.ENV_VAR, "triton")
    K.qsgd_encode(x.double(), 7, 5)
    assert K.backend_report()["ops"]["qsgd_encode"]["chosen"]["cpu"]["backend"] == "reference"


def test_cpu_tensors_use_the_numba_kernels_where_an_op_has_one(monkeypatch):
    """Unforced CPU calls: SignSGD, QSGD, TernGrad and Int8 run their Numba kernels (the same
    frames as the references); GRADZIP_KERNELS=reference sends all to the references."""
    pytest.importorskip("numba")
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    x, r = data(300, torch.float32, 1), torch.randn(300, generator=gen(2))
    assert all(same(a, b) for a, b in zip(K.sign_ef(x, r, block=64), Q.sign_ef_reference(x, r, block=64)))
    assert all(same(a, b) for a, b in zip(K.qsgd_encode(x, 7, 5), Q.qsgd_encode_reference(x, 7, 5)))
    assert all(same(a, b) for a, b in zip(K.terngrad_encode(x, 5), Q.terngrad_encode_reference(x, 5)))
    assert all(same(a, b) for a, b in zip(K.int8_encode(x, block=64), Q.int8_encode_reference(x, block=64)))
    ops = K.backend_report()["ops"]
    for op in ("sign_ef", "qsgd_encode", "terngrad_encode", "int8_encode"):
        assert ops[op]["registered"][0] == "numba" and ops[op]["chosen"]["cpu"]["backend"] == "numba", op
    monkeypatch.setenv(K.ENV_VAR, "reference")
    K.qsgd_encode(x, 7, 5)
    assert K.backend_report()["ops"]["qsgd_encode"]["chosen"]["cpu"]["backend"] == "reference"


# -- compiled kernels on a GPU ---------------------------------------------------------------


@gpu
@compiled
@pytest.mark.parametrize("n", [1, 33, 4097, (1 << 20) + 3])
def test_compiled_quant_kernels_match_references(n):
    sign, qsgd, tern, decode = _kernels()
    for dtype in DTYPES:
        x = data(n, dtype, n)
        r = torch.randn(n, generator=gen(n + 1)) * 0.3
        xc, rc = x.cuda(), r.cuda()
        s, w, res = (t.cpu() for t in sign(xc, rc, block=1000))
        ws, ww, _ = Q.sign_ef_reference(x, r, block=1000)
        assert ulps(s, ws) <= 1 and torch.equal(w, ww)
        assert same(res, Q.sign_ef_reference(x, r, block=1000, scales=s)[2])
        norms, codes = (t.cpu() for t in qsgd(xc, 7, 99, block=64))
        assert ulps(norms, Q.qsgd_encode_reference(x, 7, 99, block=64)[0]) <= 1
        assert torch.equal(codes, Q.qsgd_encode_reference(x, 7, 99, block=64, scales=norms)[1])
        sc, tc = (t.cpu() for t in tern(xc, 98, block=4096))
        assert torch.equal(tc, Q.terngrad_encode_reference(x, 98, block=4096, scales=sc)[1])
        assert same(sc, Q.terngrad_encode_reference(x, 98, block=4096)[0])
    for kind in QKINDS:
        bodies, kw = _frames(kind, n)
        k = kind[:4] if kind.startswith("qsgd") else kind
        want = torch.randn(n, generator=gen(3))
        got = want.cuda()
        Q.decode_add_quant_reference(want, bodies, k, **kw)
        decode(got, [b.cuda() for b in bodies], k, **kw)
        assert same(got.cpu(), want), kind


@gpu
@compiled
@pytest.mark.parametrize("n", [1009, (1 << 20) + 3])
def test_compiled_one_pass_routes_match_two_pass(n):
    sign, qsgd, tern, _ = _kernels()
    for dtype in DTYPES:
        x = data(n, dtype, n + 7).cuda()
        r = (torch.randn(n, generator=gen(n + 8)) * 0.3).cuda()
        for block in (1024, 4096):
            one = sign(x, r, block=block, route="one")
            two = sign(x, r, block=block, route="two")
            assert ulps(one[0].cpu(), two[0].cpu()) <= 1 and torch.equal(one[1], two[1])
            want = Q.sign_ef_reference(x.cpu(), r.cpu(), block=block, scales=one[0].cpu())
            assert same(one[2].cpu(), want[2])
            r0 = r.clone()
            assert sign(x, r0, block=block, out=r0, route="one")[2] is r0 and same(r0, one[2])
        for block in (64, 250):  # rows on a multiple of 4 (quads of draws), and not
            one = qsgd(x, 7, 5, block=block, route="one")
            two = qsgd(x, 7, 5, block=block, route="two")
            assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
            want = Q.qsgd_encode_reference(x.cpu(), 7, 5, block=block, scales=one[0].cpu())[1]
            assert torch.equal(one[1].cpu(), want), block
        for clip in (None, 2.0):
            one = tern(x, 6, block=1024, clip=clip, route="one")
            two = tern(x, 6, block=1024, clip=clip, route="two")
            assert same(one[0].cpu(), two[0].cpu()) and torch.equal(one[1], two[1])


@gpu
@compiled
def test_compiled_kernels_on_extreme_values():
    sign, qsgd, tern, decode = _kernels()
    x = extremes(torch.float32)
    for got, want in (
        (sign(x.cuda(), None, block=8), Q.sign_ef_reference(x, None, block=8)),
        (qsgd(x.cuda(), 127, 3, block=8), Q.qsgd_encode_reference(x, 127, 3, block=8)),
        (tern(x.cuda(), 3, block=8, clip=2.0), Q.terngrad_encode_reference(x, 3, block=8, clip=2.0)),
    ):
        assert same(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    b = body(*Q.qsgd_encode_reference(x, 127, 3, block=8))
    out = torch.zeros(x.numel(), device="cuda")
    decode(out, [b.cuda()], "qsgd", block=8, levels=127, bits=8)
    want = torch.zeros(x.numel())
    Q.decode_add_quant_reference(want, [b], "qsgd", block=8, levels=127, bits=8)
    assert same(out.cpu(), want) and bool(torch.isfinite(want).all())


@gpu
@compiled
@pytest.mark.parametrize("n", [1, 4097, (1 << 20) + 3])
def test_compiled_int8_kernel_matches_reference(n):
    enc = _int8_kernel()
    for dtype in DTYPES:
        x = data(n, dtype, n + 5) * 3
        for block, route in ((1024, "one"), (1024, "two"), (64, "auto"), (None, "auto")):
            got = [t.cpu() for t in enc(x.cuda(), block=block, route=route)]
            want = Q.int8_encode_reference(x, block=block)
            assert same(got[0], want[0]) and torch.equal(got[1], want[1]), (dtype, block, route)
    x = torch.cat([torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 64.5]), extremes(torch.float32)])
    got = [t.cpu() for t in enc(x.cuda(), block=8)]
    want = Q.int8_encode_reference(x, block=8)
    assert same(got[0], want[0]) and torch.equal(got[1], want[1])


@gpu
def test_cuda_tensors_dispatch_to_triton(monkeypatch):
    monkeypatch.delenv(K.ENV_VAR, raising=False)
    x = data(4099, torch.float32, 1).cuda()
    K.sign_ef(x, torch.zeros_like(x), block=256)
    scales, codes = K.int8_encode(x, block=256)
    out = torch.zeros_like(x)
    K.int8_apply_(out, [body(scales, codes)], block=256, subtract=True)
    want = torch.zeros(x.numel())
    Q.int8_apply_(want, [body(scales.cpu(), codes.cpu())], block=256, subtract=True)
    assert same(out.cpu(), want)
    for op in ("sign_ef", "int8_encode", "int8_apply_"):
        assert K.backend_report()["ops"][op]["chosen"]["cuda"]["backend"] == "triton", op


def _int8_codes_f64(v: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The float64 definition of Int8's codes (what the GPU path computes)."""
    nb, b = Q.quant_layout(v.numel(), block)
    se = Q.quant_per_element(scales.to(torch.float64), nb, b, v.numel())
    q = torch.where(se > 0, v.to(torch.float64) / se, torch.zeros_like(se))
    return q.round_().clamp_(-127, 127).to(torch.int8)


@pytest.mark.parametrize("n, block", [(1, 1024), (1023, 1024), (300_001, 1024), (70_000, 64), (5000, None)])
def test_int8_float32_cpu_path_equals_the_float64_definition(n, block):
    """The CPU path (Numba) computes in float32 and redoes near-ties in float64: the same codes as
    the float64 definition everywhere, ties and values one ulp beside them included."""
    g = torch.Generator().manual_seed(n)
    v = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    if n > 8:
        v[::7] = 0.0
    scales, codes = K.int8_encode(v, block=block)
    assert torch.equal(codes, _int8_codes_f64(v, scales, block))
    # Exact half-integer quotients and their float32 neighbours, against scales given as agreed.
    nb, b = Q.quant_layout(n, block)
    s = torch.rand(nb, generator=g) + 0.5
    k = torch.randint(-127, 127, (n,), generator=g).to(torch.float32) + 0.5
    t = k * Q.quant_per_element(s, nb, b, n)
    for w in (t, torch.nextafter(t, torch.full_like(t, math.inf)), torch.nextafter(t, torch.full_like(t, -math.inf))):
        _, got = K.int8_encode(w, block=block, scales=s)
        assert torch.equal(got, _int8_codes_f64(w, s, block))
    # Scales of 0 (a block of zeros) and tiny ones (subnormal amax).
    w = torch.zeros(n)
    w[: n // 2] = torch.randn(n // 2, generator=g) * 1e-40
    sc, got = K.int8_encode(w, block=block)
    assert torch.equal(got, _int8_codes_f64(w, sc, block))


@pytest.mark.parametrize("n, block", [(1, 1024), (300_001, 1024), (600_000, 64), (5000, None), (262_145, 3)])
@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_int8_decode_equals_the_whole_frame_formula(n, block, acc):
    """The CPU decode of int8 frames (decode, decode-add of several peers through the dispatch, and
    the reference's error-feedback subtraction), bit for bit the whole-frame formula."""
    g = torch.Generator().manual_seed(n + (block or 0))
    bodies = []
    for _ in range(3):
        s, c = K.int8_encode(torch.randn(n, generator=g) * 3, block=block)
        bodies.append(torch.cat([s.view(torch.uint8), c.view(torch.uint8)]))
    nb, b = Q.quant_layout(n, block)

    def values(body):
        sc = body[: 4 * nb].view(torch.float32).to(acc)
        return body[4 * nb :].view(torch.int8).to(acc) * Q.quant_per_element(sc, nb, b, n)

    one = Q.decode_quant_reference(bodies[0], n, "int8", acc=acc, block=block)
    assert torch.equal(bits(one), bits(values(bodies[0])))
    start = torch.randn(n, generator=g, dtype=acc)
    got, want = start.clone(), start.clone()
    K.decode_add_quant(got, bodies, "int8", block=block)
    for body in bodies:
        want.add_(values(body))
    assert torch.equal(bits(got), bits(want))
    got = start.clone()
    Q.int8_apply_(got, bodies[:1], block=block, subtract=True)
    assert torch.equal(bits(got), bits(start - values(bodies[0])))


@interp
@pytest.mark.parametrize(
    "spec",
    ["TwoPhase(Int8(block=64))", "TwoPhase(SignSGD(block=64))", "TwoPhase(QSGD(7))", "TwoPhase(TernGrad(block=64))"],
)
def test_twophase_decodes_the_owners_pieces_by_the_kernels_as_by_the_reference(spec, monkeypatch):
    """A TwoPhase call as one of 4 ranks (loopback), the kernels forced (the Triton
    interpreter: encoders, both phases' decodes, the segmented decode of the owners' pieces)
    against the reference path: the same floats, and the segmented kernel is what ran."""
    import gradzip as gz
    from gradzip.costmodel import dry_run

    # Sizes that 4 owners split evenly: the loopback hands this rank's messages to every peer;
    # pieces of 1 element and of 259 (two sizes: every interpreted launch costs).
    tensors = [data(n, torch.float32, n) for n in (4, 1036)]

    def run(kernels):
        monkeypatch.setenv(K.ENV_VAR, kernels)
        K.reset_dispatch()
        out = dry_run(gz.parse(spec), tensors, world_size=4).out
        return out, K.backend_report()["ops"]

    want, _ = run("reference")
    got, ops = run("triton")
    assert same(got, want)
    assert ops["decode_add_quant_segments"]["chosen"]["cpu"]["backend"] == "triton"
