"""Call-wide selection (``scope="call"``) and ternary top-k values (``TopK(values="sign")``)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip as gz
from gradzip.codecs.base import TensorContext
from gradzip.codecs.topk import FMT_SPARSE_SIGN, FMT_SPARSE_SIGN2, call_counts
from gradzip.engine import Engine
from gradzip.protocols.base import as_protocol
from gradzip.protocols.reduce_scatter import ReduceScatter
from gradzip.wire import FMT_EMPTY, pack_frames, unpack_frames
from tests.support import run_ranks

settings.register_profile("gz", max_examples=60, deadline=None)
settings.load_profile("gz")


@st.composite
def vectors(draw, max_n=300):
    n = draw(st.integers(1, max_n))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 1e3]))
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    if draw(st.booleans()):
        x[:: max(1, n // 3)] = 0.0  # ties at zero
    return x.to(draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])))


@given(x=vectors(), ratio=st.sampled_from([0.003, 0.05, 0.3, 0.9]))
def test_sign_values_send_plus_minus_the_mean_at_the_top_k(x, ratio):
    codec = gz.TopK(ratio, values="sign")
    p = codec.compress(x, TensorContext(dtype=x.dtype))
    (q,) = unpack_frames(pack_frames([p]), [x.shape], [x.dtype])  # through the wire
    d = codec.decompress(q)
    assert d.shape == x.shape and d.dtype == x.dtype
    d = d.float()
    k = min(x.numel(), max(1, math.ceil(ratio * x.numel())))
    k = min(k, int((x != 0).sum()))  # zeros among the top k are not sent
    top = torch.topk(x.float().abs(), max(k, 1)).values
    if float(top.max()) == 0.0:  # nothing but zeros: nothing to send
        assert p.fmt == FMT_EMPTY and not d.any()
        return
    assert p.fmt in (FMT_SPARSE_SIGN, FMT_SPARSE_SIGN2)
    assert p.body.numel() <= (x.numel() + 3) // 4  # never more than the 2-bit map
    mu = float(torch.tensor(float(top.double().mean()), dtype=torch.float32))
    sent = d.float() != 0
    assert int(sent.sum()) == k
    assert float(x.float().abs()[sent].min()) >= float(top.min())  # the k largest magnitudes
    if x.dtype == torch.float32:  # narrower dtypes round mu on decoding
        vals = d[sent]
        assert torch.equal(vals.abs(), torch.full((k,), mu)) and torch.equal(vals.sign(), x[sent].sign())


@given(x=vectors())
def test_sign_values_error_feedback_keeps_everything(x):
    """residual + decoded == compensated, exactly where Sterbenz holds (|v| within a factor
    2 of mu) and elsewhere to half an ulp of the float32 residual, as for the quantizers."""
    codec = gz.TopK(0.1, values="sign")
    r = None
    for step in range(3):
        g = x if step == 0 else torch.randn(x.shape, generator=torch.Generator().manual_seed(step)).to(x.dtype)
        keep = (g.float() + (0.0 if r is None else r)).double()  # compensated in float32, as the engine does
        p, new = codec.encode(g, TensorContext(name="w", step=step, dtype=g.dtype), r, feedback=True)
        d = codec.decompress(p).double()
        err = (new.double() + d - keep).abs()
        ratio = d / keep
        sterbenz = (d == 0) | ((ratio >= 0.5) & (ratio <= 2))
        assert torch.all(err[sterbenz] == 0)
        ulp = torch.nextafter(new.abs(), torch.tensor(math.inf)).double() - new.abs().double()
        assert torch.all(err <= ulp / 2)
        r = new


def test_sign_frames_choose_the_smaller_form_and_refuse_corruption():
    x = torch.randn(400, generator=torch.Generator().manual_seed(0))
    sparse = gz.TopK(0.01, values="sign").compress(x)
    dense = gz.TopK(0.6, values="sign").compress(x)
    assert sparse.fmt == FMT_SPARSE_SIGN and sparse.body.numel() < 10
    assert dense.fmt == FMT_SPARSE_SIGN2 and dense.body.numel() == 100
    bad = gz.TopK(0.6, values="sign").compress(x)
    bad.body = bad.body.clone()
    bad.body[0] = 0xFF  # code 3 is no value
    with pytest.raises(ValueError, match="field body.codes: corrupt 2-bit map: code 3"):
        gz.TopK(values="sign").decompress(bad)
    with pytest.raises(ValueError, match="field format: .* cannot decode frame format 7 \\(SPARSE_SIGN2\\)"):
        gz.TopK().decompress(dense)  # TopK(values=None) never writes sign frames
    sparse.scale = float("nan")
    with pytest.raises(ValueError, match="field scale"):
        gz.TopK(values="sign").decompress(sparse)


@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=6),
    ratio=st.sampled_from([0.001, 0.02, 0.5, 1.0]),
    seed=st.integers(0, 1000),
)
def test_call_counts_allot_one_top_k_over_the_call(sizes, ratio, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) * (10.0 ** (i % 3)) for i, n in enumerate(sizes)]
    counts = call_counts(xs, ratio)
    total = sum(sizes)
    k = 0 if total == 0 else min(total, max(1, math.ceil(ratio * total)))
    assert sum(counts) == k and all(0 <= c <= n for c, n in zip(counts, sizes))
    if total:  # the kept elements are the call's k largest
        flat = torch.cat(xs).abs()
        cut = float(torch.topk(flat, k).values.min())
        for x, c in zip(xs, counts):
            kept = torch.topk(x.abs(), c).values if c else torch.empty(0)
            assert bool((kept >= cut).all())
            assert int((x.abs() > cut).sum()) <= c


def test_call_scope_runs_on_allgather_and_is_refused_by_two_phase():
    assert type(as_protocol(gz.TopK(0.01, scope="call"), 64)).__name__ == "AllGather"
    assert type(as_protocol(gz.TopK(0.01), 64)).__name__ == "TwoPhase"
    for make in (gz.TwoPhase, ReduceScatter):
        with pytest.raises(ValueError, match="cannot choose over the whole call"):
            make(gz.TopK(0.01, scope="call"))
    with pytest.raises(ValueError, match='needs policy="target"'):
        gz.Threshold(scope="call")
    with pytest.raises(ValueError, match="scope"):
        gz.TopK(scope="bucket")
    assert gz.parse("TopK(0.003, values='sign', scope='call')").scope == "call"


SHAPES = {"a": (30, 7), "b": (5,), "c": (64,)}


def _mass(rank, world, codec, steps):
    """Per step: this rank's gradients, residuals before and after, and the average."""
    eng = Engine(codec)
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        grads = [torch.randn(shape, generator=g) * (1 + 9 * (i == 1)) for i, shape in enumerate(SHAPES.values())]
        before = {
            n: (eng.memory.residual(n).clone() if eng.memory.residual(n) is not None else torch.zeros(sh))
            for n, sh in SHAPES.items()
        }
        fut = eng.reduce(list(SHAPES), grads)
        eng.flush()
        eng.end_step()
        avg = fut.wait()
        after = {n: eng.memory.residual(n).clone() for n in SHAPES}
        out.append({"grads": grads, "before": before, "after": after, "avg": avg})
    return out


@pytest.mark.parametrize(
    "codec",
    [gz.TopK(0.05, values="sign", scope="call"), gz.Threshold(policy="target", density=0.05, scope="call")],
    ids=["topk", "threshold"],
)
def test_call_scope_conserves_mass_and_sends_one_top_k_per_rank(codec):
    world, steps = 4, 4
    res = run_ranks(_mass, world, codec, steps, timeout=120)
    total = sum(math.prod(s) for s in SHAPES.values())
    k = math.ceil(0.05 * total)
    for s in range(steps):
        avg = res[0][s]["avg"]
        assert all(torch.equal(r[s]["avg"], avg) for r in res)  # every rank the same floats
        put = sum(
            torch.cat(
                [
                    (g.reshape(-1).double() + r[s]["before"][n].reshape(-1).double())
                    for g, n in zip(r[s]["grads"], SHAPES)
                ]
            )
            for r in res
        )
        kept = sum(torch.cat([r[s]["after"][n].reshape(-1).double() for n in SHAPES]) for r in res)
        assert torch.allclose(put, world * avg.double() + kept, atol=1e-5)
        for r in res:  # each rank sent k positions of the call, wherever they were
            sent = torch.cat(
                [
                    (r[s]["grads"][i].reshape(-1) + r[s]["before"][n].reshape(-1) - r[s]["after"][n].reshape(-1)) != 0
                    for i, n in enumerate(SHAPES)
                ]
            )
            assert int(sent.sum()) >= k - 1 and int(sent.sum()) <= k + 2  # ties aside
