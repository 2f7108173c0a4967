"""benchmarks/host_syncs.py: the sync sentinel, and counts through ``Engine.reduce``."""

from __future__ import annotations

import os

import pytest
import torch

import gradzip.kernels as K
from benchmarks.host_syncs import EngineLoopback, HostSync, SyncSentinel, count, synthetic


def test_the_sentinel_flags_what_stops_a_gpus_host_and_nothing_read_on_the_host():
    x = torch.randn(10)
    with SyncSentinel() as s:
        x.sum().item()
        t = torch.tensor([1, 2, 3])  # built on the host: reading it is free
        t.tolist()
        t.cumsum(0).tolist()
        K.host_to_device(t, "cpu").tolist()  # uploaded: now a device tensor
        x.cpu().numpy()
        x.cpu().tolist()  # the copy is the sync, not the read of the host copy
        x[x > 0]
        torch.nonzero(x)
        bool(x.sum() > 0)
        x.masked_select(x > 0)
    kinds = [k for k, _ in s.events]
    assert kinds == ["item", "tolist", "cpu", "cpu", "boolean index", "nonzero", "item/bool", "masked_select"]
    assert torch.Tensor.cpu is not s._reader  # patches undone
    with pytest.raises(HostSync, match=r"host sync \(tolist\) at gradzip/protocols/base.py:\d+ \(finite_flags\)"):
        with SyncSentinel(error=True):
            from gradzip.engine import all_finite

            all_finite([x])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.parametrize(
    "spec, launches, ops", [("Flat(Int8())", 6, 40), ("Flat(SignSGD())", 8, 40), ("Flat(TopK(0.01))", 10, 300)]
)
def test_through_the_engine_the_gpu_path_of_a_flat_bucket_reads_nothing(monkeypatch, spec, launches, ops):
    """Flat(Int8()) and Flat(SignSGD()) on the GPU's side, Triton forced, loopback ranks: the
    bucket's plan (``gradzip.protocols.planned``) checks everything on the device: no host
    sync, 6 or 8 launches and one count of at most 40 ATen operations, for 2 and 15 tensors
    and 4 and 8 ranks. Flat(TopK(0.01)) through TwoPhase's planned rounds (its Elias-Fano
    frames parsed and checked on the device): no host sync either, 10 launches, one count."""
    monkeypatch.setenv("GRADZIP_KERNELS", "triton")
    got = {}
    with K.gpu_side_on_cpu():
        for t, w in ((2, 4), (15, 8)):
            grads, names = synthetic(t)
            grads = [g[:128] for g in grads]  # 128 x 16 each: the interpreter is slow
            (row,) = count(spec, grads, names, w, one=True)
            got[(t, w)] = row
    for row in got.values():
        assert row["host_syncs"] == 0 and row["launches"] == launches and row["aten_ops"] <= ops, row
    assert len({row["aten_ops"] for row in got.values()}) == 1, got  # nothing a tensor or a rank


def test_the_loopback_communicator_gives_an_engine_the_average_of_identical_ranks():
    import gradzip as gz
    from gradzip.engine import Engine

    e = Engine(gz.parse("Int8()"), process_group=EngineLoopback(2))  # AllGather: every peer sends x
    x = torch.randn(4, 8)
    fut = e.reduce(["w"], [x.clone()])
    e.flush()
    out = fut.wait()
    e.end_step()
    assert out.shape == (32,) and float((out - x.reshape(-1)).abs().max()) < 0.05 * float(x.abs().max())
    assert e.stats()["collectives"] >= 1 and e.stats()["bytes_sent"] > 0
    # a collective issued is one operation, whatever the loopback does to stand in for it
    comm, out, row = EngineLoopback(4), torch.empty(4, 8), x[0]
    with SyncSentinel() as s:
        comm.allgather(out, row)
    comm.loop.complete()
    assert s.ops == 1 and torch.equal(out, row.expand(4, 8))


@pytest.mark.gpu
def test_on_cuda_the_engines_checks_read_nothing_and_a_nan_step_is_still_seen():
    """On a device: Flat(Int8()) through the engine (8 loopback ranks) reads nothing for its own
    checks inside a call, and a NaN in step 2 is the step's verdict, read when it ends."""
    import gradzip as gz
    from gradzip.engine import Engine

    e = Engine(gz.parse("Flat(Int8())"), process_group=EngineLoopback(8))
    grads = [torch.randn(4096, 16, device="cuda") for _ in range(3)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    views = [v.view(4096, 16) for v in flat.split(4096 * 16)]
    for step in range(3):
        flat.copy_(torch.cat([g.reshape(-1) for g in grads]))
        if step == 2:
            flat[5] = float("nan")
        with SyncSentinel() as s:
            fut = e.reduce(["a", "b", "c"], views, dest=flat)
            e.flush()
            out = fut.wait()
        assert not [site for _, site in s.events if "engine.py" in site or "protocols/base.py" in site]
        e.end_step()
        assert e.last_step_nonfinite == (step == 2) and bool(out.isnan().all()) == (step == 2)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["Flat(Int8())", "Flat(SignSGD())", "PowerSGD(rank=4)", "Flat(TopK(0.01))"])
def test_on_cuda_ten_steady_steps_read_nothing(spec):
    """On a device, 8 loopback ranks: after two steps (the configuration check, the first
    draws), ten steps of a planned method read nothing on the host inside a call, and CUDA's
    own sync check (``set_sync_debug_mode("error")``) passes over them."""
    import gradzip as gz
    from gradzip.engine import Engine

    e = Engine(gz.parse(spec), process_group=EngineLoopback(8))
    g = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(n, 16, device="cuda", generator=g) for n in (4096, 300, 1025)]
    flat = torch.cat([t.reshape(-1) for t in grads])
    views = [v.view(-1, 16) for v in flat.split([t.numel() for t in grads])]
    for step in range(12):
        flat.copy_(torch.cat([t.reshape(-1) for t in grads]))
        torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")
        try:
            with SyncSentinel(error=step >= 2):
                fut = e.reduce(["a", "b", "c"], views, dest=flat)
                e.flush()
                out = fut.wait()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        e.end_step()
        assert not e.last_step_nonfinite and bool(out.isfinite().all())
