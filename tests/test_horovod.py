"""gradzip.horovod: the adapter's contract, checked with a fake allreduce (Horovod is not installed)."""
import pytest
import torch

import gradzip as gz
from gradzip.horovod import Compression, HorovodCompressor, adapt


def fake_allreduce(tensors, op="average"):
    """What Horovod does with the compressed tensors: an element-wise sum over ranks (then / size)."""
    out = torch.stack(tensors).sum(0)
    return out / len(tensors) if op == "average" else out


def grads(world, shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) * (r + 1) for r in range(world)]


def horovod_step(compression, tensors, op="average"):
    """Horovod's _allreduce_grad_async + synchronize, per rank, with the fake collective."""
    compressed, ctxs = zip(*(compression.compress(t) for t in tensors))
    reduced = fake_allreduce(list(compressed), op)
    return [compression.decompress(reduced, ctx) for ctx in ctxs], compressed


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("shape", [(7,), (5, 3), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_none_is_the_identity(world, shape, dtype):
    xs = grads(world, shape, dtype)
    out, compressed = horovod_step(Compression.none, xs)
    assert all(c.dtype == dtype and c.shape == torch.Size(shape) for c in compressed)
    for o in out:
        assert o.dtype == dtype and o.shape == torch.Size(shape)
        assert torch.equal(o, fake_allreduce(xs))


@pytest.mark.parametrize("name, wire", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("op", ["average", "sum"])
def test_casts_put_half_precision_on_the_wire_and_restore_dtype_and_shape(name, wire, op):
    comp = getattr(Compression, name)
    xs = grads(3, (6, 5))
    out, compressed = horovod_step(comp, xs, op)
    for c in compressed:
        assert c.dtype == wire and c.shape == (6, 5)
    expected = fake_allreduce([x.to(wire) for x in xs], op).to(torch.float32)
    for o in out:
        assert o.dtype == torch.float32 and o.shape == (6, 5)
        assert torch.equal(o, expected)
    # And it is what gradzip's own decode of the same payload gives.
    gz_comp = comp.gradzip_compressor
    c, ctx = comp.compress(xs[0])
    assert torch.equal(comp.decompress(c, ctx), gz_comp.decompress(gz_comp.compress(xs[0])))


def test_adapt_builds_a_static_interface_class():
    cls = adapt(gz.FP16())
    assert isinstance(cls, type) and issubclass(cls, HorovodCompressor)
    # Horovod calls the methods on the class itself, never on an instance.
    t = torch.randn(4, 4)
    c, ctx = cls.compress(t)
    assert c.dtype == torch.float16
    assert cls.decompress(c, ctx).dtype == torch.float32


def test_integer_tensors_pass_through_as_in_horovod():
    t = torch.arange(6, dtype=torch.int64)
    c, ctx = Compression.fp16.compress(t)
    assert c is t and ctx is None
    assert Compression.fp16.decompress(c, ctx) is t


@pytest.mark.parametrize(
    "comp, why",
    [
        (gz.TopK(ratio=0.1), "not summable"),
        (gz.Threshold(tau=1e-3), "not summable"),
        (gz.RandomK(ratio=0.1), "error feedback"),
        (gz.FP16(), None),
    ],
    ids=["topk", "threshold", "randomk", "fp16"],
)
def test_sparsifiers_are_refused_with_the_reason(comp, why):
    if why is None:
        adapt(comp)
        return
    with pytest.raises(ValueError, match=why):
        adapt(comp)


def test_why_sparsifiers_cannot_use_the_allreduce_path():
    """The documented reason, shown: adding two ranks' top-k payloads element-wise is not their sum."""
    topk = gz.TopK(ratio=0.25)
    a = torch.tensor([5.0, 1, 0, 0, 0, 0, 0, 0])  # keeps indices 0, 1
    b = torch.tensor([0.0, 0, 7, 2, 0, 0, 0, 0])  # keeps indices 2, 3
    pa, pb = topk.compress(a), topk.compress(b)
    assert pa.body.shape == pb.body.shape  # same length, so an allreduce would take them...
    assert torch.equal(topk.decompress(pa) + topk.decompress(pb), a + b)
    summed = gz.Payload(body=pa.body + pb.body, shape=pa.shape, dtype=pa.dtype, fmt=pa.fmt, vdtype=pa.vdtype)
    # ...but the byte-wise sum of two position masks is no mask of two positions: refused, not misread.
    with pytest.raises(ValueError, match="corrupt sparse frame"):
        topk.decompress(summed)


def test_bad_argument():
    with pytest.raises(TypeError, match="gradzip codec"):
        adapt("fp16")
