"""gradzip.fsdp with ZeRO++'s pieces on CPU/gloo: the compressed parameter all-gather (qwZ),
node-local secondary shards (hpZ: ``reshard_after_forward=L``) and the hierarchical
reduce-scatter (qgZ), with the test model of ``test_fsdp.py`` (three parameter groups,
padded shards).

4 ranks are 2 "nodes" of 2 (``local_size=2``): the collectives are the same as on two
machines, only the links are not (``benchmarks/fsdp_zeropp.py`` measures those).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.frontends.test_fsdp import _equal, _max_diff, batch, build, loss_of
from tests.support import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]


STEPS = 3  # of the 2-rank trainings; the 4-rank ones take 2


def train(rank, world, *, ag=None, rs=None, replicate=None, layout="fsdp", steps=STEPS, mp=False, raf=True, accum=1):
    """``steps`` SGD steps; full parameters, losses and the stats of every compressed collective."""
    import gradzip as gz

    model, mesh = build(world, layout, mp, raf)
    state = None
    if ag or rs or replicate:
        state = gz.fsdp.compress(
            model,
            gz.parse(rs) if rs else None,
            all_gather=gz.parse(ag) if ag else None,
            replicate=gz.parse(replicate) if replicate else None,
            replicate_group=mesh["replicate"] if replicate else None,
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        for mb in range(accum):
            if accum > 1:
                model.set_requires_gradient_sync(mb == accum - 1)
            idx, tgt = batch(rank, step * accum + mb)
            loss = loss_of(model, idx, tgt)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"params": {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}}
    out["losses"] = losses
    if state is not None:
        out["step"] = state.step
        out["stats"] = {k: state.stats(which=k) for k in state._engines()}
        out["all"] = state.stats()
        out["routes"] = state.routes()
    return out


def _close(a, b, tol):
    return max(abs(x - y) for x, y in zip(a, b)) < tol


# -- 2 ranks: Identity all-gather is FSDP2's own, bit for bit; Int8 weights stay in the band ----

COMBOS = [
    dict(),  # fp32, reshard_after_forward=True: all-gathers in forward and backward
    dict(mp=True, raf=False, accum=2),  # bf16 parameters (the all-gather moves bf16), fp32 reduce
]


def _two(rank, world):
    out = []
    for kw in COMBOS:
        plain = train(rank, world, **kw)
        ident = train(rank, world, ag="Identity()", rs="Identity()", **kw)
        gather_only = train(rank, world, ag="Identity()", **kw)
        int8 = train(rank, world, ag="Int8(block=64)", rs="Int8()", **kw)
        out.append((plain, ident, gather_only, int8))
    out.append(train(rank, world, ag="BF16()"))
    return out


def test_2_ranks_identity_all_gather_is_plain_fsdp2_and_int8_weights_train_alike():
    results = run_ranks(_two, 2)
    *combos, bf16 = results[0]
    for kw, (plain, ident, gather_only, int8) in zip(COMBOS, combos):
        assert _equal(plain["params"], ident["params"]) and plain["losses"] == ident["losses"], kw
        assert _equal(plain["params"], gather_only["params"]), kw
        # one step per synchronized backward, alike for every collective (accumulation included)
        assert ident["step"] == STEPS and all(s["steps"] == STEPS for s in ident["stats"].values()), kw
        assert gather_only["step"] == STEPS * kw.get("accum", 1), kw  # only the all-gather: every backward
        # Identity moves the raw shards: FSDP2's own bytes, and the first call's configuration check
        s = ident["stats"]["all_gather"]
        assert 0 < s["bytes_link_raw"] < s["bytes_link"] < s["bytes_link_raw"] + 1000, kw
        # Int8 weights (not error-fed) and Int8 gradients (error-fed): in plain FSDP2's band
        assert _close(int8["losses"], plain["losses"], 5e-3), (kw, int8["losses"], plain["losses"])
        assert 0 < _max_diff(int8["params"], plain["params"]) < 5e-3, kw
        g = int8["stats"]["all_gather"]
        ratio = 3.0 if not kw.get("mp") else 1.5  # fp32 -> int8 + a scale per 64; bf16 -> int8
        assert g["ratio"] > ratio and g["bytes_link_raw"] == pytest.approx(g["bytes_raw"]), (kw, g)
        assert {r["collective"] for r in int8["routes"]} == {"all_gather", "reduce_scatter"}
        assert int8["all"]["bytes_link"] == pytest.approx(
            int8["stats"]["all_gather"]["bytes_link"] + int8["stats"]["reduce_scatter"]["bytes_link"]
        )
    assert _close(bf16["losses"], combos[0][0]["losses"], 5e-3)
    for q in results[1:]:  # every rank holds the same parameters
        assert _equal(q[0][3]["params"], combos[0][3]["params"])


# -- 4 ranks, 2 nodes x 2: hpZ, qgZ, and HSDP 2x2 ---------------------------------------------


def _four(rank, world):
    out = {}
    n = 2  # the second step's Int8 gradients carry the first's residuals
    out["plain"] = train(rank, world, raf=2, steps=n)
    out["identity"] = train(rank, world, ag="Identity()", raf=2, steps=n)  # gloo's ring sum at 4 ranks: RS left alone
    out["hier identity"] = train(
        rank, world, ag="Identity()", rs="Hierarchical(Identity(), local_size=2)", raf=2, steps=n
    )
    out["zeropp"] = train(rank, world, ag="Int8(block=64)", rs="Hierarchical(Int8(), local_size=2)", raf=2, steps=n)
    out["native hsdp"] = train(rank, world, layout="hsdp", steps=2)
    out["hsdp identity"] = train(
        rank, world, layout="hsdp_shard", ag="Identity()", rs="Identity()", replicate="Identity()", steps=2
    )
    out["hsdp int8"] = train(rank, world, layout="hsdp_shard", ag="Int8()", rs="Int8()", replicate="Int8()", steps=2)
    return out


def test_4_ranks_node_local_backward_gather_and_hierarchical_reduce_scatter_and_hsdp():
    results = run_ranks(_four, 4, timeout=280)
    r = results[0]
    plain = r["plain"]
    # reshard_after_forward=2: FSDP's own all-gather over the node in backward, bit for bit
    assert _equal(r["identity"]["params"], plain["params"])
    # plain inside the node, Identity across: another summation order only
    assert _max_diff(r["hier identity"]["params"], plain["params"]) < 1e-6
    z = r["zeropp"]
    assert _close(z["losses"], plain["losses"], 5e-3) and _max_diff(z["params"], plain["params"]) < 5e-3
    ag, rs = z["stats"]["all_gather"], z["stats"]["reduce_scatter"]
    # hpZ: the backward all-gathers stay inside the node (plain), the forward's cross it (Int8)
    assert 0 < ag["bytes_link_intra"] < ag["bytes_link"]
    # qgZ: the node's plain reduce-scatter is intra-node; what crosses is Int8, ~1/4 of 1/2 of the call
    inter = rs["bytes_link"] - rs["bytes_link_intra"]
    assert rs["bytes_link_intra"] == pytest.approx(0.5 * rs["bytes_raw"])
    assert 0 < inter < 0.25 * rs["bytes_link_raw"]
    # HSDP 2x2 with every collective through gradzip's Identity: native HSDP, bit for bit
    assert _equal(r["hsdp identity"]["params"], r["native hsdp"]["params"])
    assert _close(r["hsdp int8"]["losses"], r["native hsdp"]["losses"], 5e-3)
    for q in results[1:]:
        for k in r:
            assert _equal(q[k]["params"], r[k]["params"]), k


# -- DCP: save on 4 ranks (Int8 weights, hierarchical Int8 gradients), load on 2 ------------------


def _pending(state):
    return {k: v.full_tensor().clone() for k, v in state.state_dict().items() if k != "step"}


SAVE_AT = 2  # steps before the save


def _save(rank, world, root):
    import torch.distributed.checkpoint as dcp

    import gradzip as gz

    model, _ = build(world, raf=2)
    state = gz.fsdp.compress(model, gz.Hierarchical(gz.Int8(), local_size=2), all_gather=gz.Int8(block=64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(SAVE_AT):
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": model.state_dict(), "gradzip": state.exact()}, checkpoint_id=root)
    out = {"pending": _pending(state), "step": state.step}
    losses = []
    for step in range(SAVE_AT, SAVE_AT + 2):  # the unbroken run goes on
        loss = loss_of(model, *batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out


def _resume(rank, world, root):
    """The same 4 ranks and methods from the checkpoint (exact), or 2 ranks (the pending update)."""
    import torch.distributed.checkpoint as dcp

    import gradzip as gz

    model, _ = build(world, raf=2 if world == 4 else True)
    rs = gz.Hierarchical(gz.Int8(), local_size=2) if world == 4 else gz.Int8()
    state = gz.fsdp.compress(model, rs, all_gather=gz.Int8(block=64))
    sd = {"model": model.state_dict(), "gradzip": state.exact()}
    dcp.load(sd, checkpoint_id=root)
    model.load_state_dict(sd["model"])
    out = {"pending": _pending(state), "step": state.step, "ag_step": state.all_gather_engine.step}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(SAVE_AT, SAVE_AT + 2):
        loss = loss_of(model, *batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return out


def test_dcp_save_on_4_ranks_with_the_new_paths_resumes_exactly_and_loads_on_2():
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(_save, 4, root, timeout=280)[0]
        again = run_ranks(_resume, 4, root, timeout=280)[0]
        two = run_ranks(_resume, 2, root, timeout=280)[0]
    assert saved["step"] == again["step"] == two["step"] == again["ag_step"] == SAVE_AT
    assert sum(v.abs().sum().item() for v in saved["pending"].values()) > 0
    # same ranks, layout and methods: every engine state back as it was, the run goes on bit for bit
    assert _equal(again["pending"], saved["pending"])
    assert again["losses"] == saved["losses"] and _equal(again["params"], saved["params"])
    # 2 ranks, a flat Int8 reduce-scatter: the hierarchical residuals' pending update, resharded
    assert _equal(two["pending"], saved["pending"])
    assert all(torch.isfinite(torch.tensor(two["losses"])))


# -- refusals, non-finite weights, a configuration that differs -----------------------------------


def _errors(rank, world):
    import gradzip as gz

    out = {}

    def catch(label, f, exc=ValueError):
        try:
            f()
        except exc as e:
            out[label] = str(e)
        else:
            out[label] = None

    m, _ = build(world)
    catch("topk", lambda: gz.fsdp.compress(m, all_gather=gz.TopK(0.1)))
    catch("int8 allreduce", lambda: gz.fsdp.compress(m, all_gather=gz.Int8(allreduce=True)))
    catch("hier protocol", lambda: gz.fsdp.compress(m, gz.Hierarchical(gz.PowerSGD(rank=1), local_size=2)))
    m.set_allocate_memory_from_process_group_for_comm(True)
    catch("allocator before", lambda: gz.fsdp.compress(m, all_gather=gz.Int8()))
    m, _ = build(world)
    state = gz.fsdp.compress(m, all_gather=gz.Int8())
    catch("allocator after", lambda: m.set_allocate_memory_from_process_group_for_comm(True))
    catch("twice", lambda: gz.fsdp.compress(m, all_gather=gz.Int8()))
    catch("which", lambda: state.stats(which="reduce_scatter"))
    state.remove()
    m.set_allocate_memory_from_process_group_for_comm(True)  # FSDP's own comms are back

    # a configuration that differs between the ranks: refused on every rank, naming the field
    m, _ = build(world)
    gz.fsdp.compress(m, all_gather=gz.Int8(block=64 if rank == 0 else 128))
    catch("mismatch", lambda: loss_of(m, *batch(rank, 0)))

    # a NaN in rank 1's shard of a weight: "skip" puts NaN in every rank's weights (its group's),
    # so the loss is NaN everywhere and the gradients too; "raise" raises on every rank
    for policy in ("skip", "raise"):
        m, _ = build(world)
        state = gz.fsdp.compress(m, gz.Int8(), all_gather=gz.Int8(block=64), on_nonfinite=policy)
        if rank == 1:
            with torch.no_grad():
                m.blocks[0].fc1.weight.to_local()[0, 0] = float("nan")
        try:
            loss = loss_of(m, *batch(rank, 0))
            loss.backward()
            out[policy] = ("ok", bool(loss.isnan()), all(bool(p.grad.to_local().isnan().all()) for p in m.parameters()))
        except FloatingPointError as e:
            out[policy] = ("FloatingPointError", str(e))
        out[policy + " step"] = state.step
    return out


def test_refusals_nonfinite_weights_and_config_mismatch():
    for rank, r in enumerate(run_ranks(_errors, 2)):
        assert "Int8(block=...)" in r["topk"] and "TopK" in r["topk"]
        assert "allreduce" in r["int8 allreduce"]
        assert "takes a codec across the nodes" in r["hier protocol"]
        assert "set_allocate_memory_from_process_group_for_comm(False)" in r["allocator before"]
        assert "all-gather" in r["allocator after"] and "cannot be combined" in r["allocator after"]
        assert "already" in r["twice"]
        assert "without reduce_scatter=" in r["which"]
        assert "configuration differs across ranks" in r["mismatch"] and "block" in r["mismatch"], r["mismatch"]
        assert r["skip"] == ("ok", True, True) and r["skip step"] == 1, (rank, r["skip"])
        kind, msg = r["raise"]
        assert kind == "FloatingPointError" and "blocks.0" in msg and "all-gather" in msg, (rank, msg)


# -- a rank dies in the middle of training: every survivor raises within the timeout ---------------


def _doomed(rank, world, port, q):
    import gradzip as gz
    import gradzip.kernels as K
    from gradzip.bench import init_worker

    # The codecs' torch reference path: what is tested is the collective a rank dies in, and a
    # fresh process need not import numba for the CPU kernels first (about a second of CPU).
    os.environ[K.ENV_VAR] = "reference"
    init_worker(rank, world, port, threads=1, timeout_s=10.0)
    model, _ = build(world, raf=True)
    gz.fsdp.compress(model, gz.Int8(), all_gather=gz.Int8(block=64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(50):
        if rank == 2 and s == 3:
            os._exit(1)  # the machine dies: no goodbye
        t0 = time.monotonic()
        try:
            loss_of(model, *batch(rank, s)).backward()
            opt.step()
            opt.zero_grad()
        except Exception as exc:  # noqa: BLE001
            q.put((rank, s, type(exc).__name__, str(exc)[:200], time.monotonic() - t0))
            return
    q.put((rank, None, None, None, None))


def test_survivors_raise_when_a_rank_dies_in_a_compressed_all_gather():
    import queue

    from gradzip.bench import free_port
    from tests.support.ranks import _context

    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_doomed, args=(r, 3, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 2:
            rank, step, kind, msg, waited = q.get(timeout=90)
            got[rank] = (step, kind, msg, waited)
    except queue.Empty:
        pytest.fail(f"survivors hung: reports {got}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert set(got) == {0, 1}
    for step, kind, _msg, waited in got.values():
        assert step == 3 and kind is not None, got
        assert waited < 10.0 + 20.0  # within the process group's timeout (plus slack)


# -- the protocols alone ------------------------------------------------------------------------


def test_weight_gather_and_hierarchical_reduce_scatter_in_dry_runs():
    import gradzip as gz
    from gradzip.costmodel import dry_run
    from gradzip.protocols.hierarchical_rs import HierarchicalReduceScatter
    from gradzip.protocols.weight_gather import WeightGather

    x = torch.randn(1000)
    x[7] = float("nan")
    run = dry_run(WeightGather(gz.Int8(block=64)), [x[:500], x[500:]], world_size=4, names=["a", "b"])
    out = run.out.view(4, 1000)
    assert out[:, :500].isnan().all() and not out[:, 500:].isnan().any()  # the flagged shard, on every rank
    ref = gz.Int8(block=64).decompress(gz.Int8(block=64).compress(x[500:]))
    assert torch.equal(out[2, 500:], ref)
    assert [c.kind for c in run.collectives] == ["allgather"]
    assert run.collectives[0].nbytes == 2 + 1000 + 4 * (8 + 8) + 8 + 2 * 6  # flags, codes, scales, frames
    ident = dry_run(WeightGather(gz.Identity()), [x[500:]], world_size=3)
    assert torch.equal(ident.out.view(3, 500)[1], x[500:])
    with pytest.raises(ValueError, match="Int8"):
        WeightGather(gz.TopK(0.1))
    assert WeightGather(gz.Int8()).link_raw(100, 4) == 300
    # 2 nodes of 2: the node's plain all-to-all, then Int8 across the nodes, on half the rows (Int8's
    # frame lengths follow from the rows' sizes: no all-to-all of the lengths first)
    h = HierarchicalReduceScatter(gz.Int8(), local_size=2)
    g = torch.randn(4, 256)
    run = dry_run(h, [g], world_size=4, decode=False)
    scopes = [(c.kind, c.scope) for c in run.collectives]
    assert scopes == [("alltoall", "intra"), ("alltoall", "cross")] and h.rounds == 2
    assert run.collectives[0].nbytes == 4 * 256 * 4
    assert run.collectives[1].nbytes < 2 * 256 * 1.1  # two rows of int8 codes (and scales)
    assert h.link_raw(4000, 4) == 3000
    assert h.biased and not WeightGather(gz.Int8()).biased
    with pytest.raises(ValueError, match="travel in frames"):
        HierarchicalReduceScatter(gz.RandomK(0.1), local_size=2)
    with pytest.raises(ValueError, match="not whole nodes"):
        HierarchicalReduceScatter(gz.Int8(), local_size=3).nodes(4)


# -- on a GPU: the compressed all-gather on CUDA tensors, against the CPU ---------------------------


class _Seen(nn.Module):
    """``loss = sum(w * c)``; keeps the weights the forward saw (the all-gathered ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 4099))
        self.seen: list = []

    def forward(self, c):
        self.seen.append(self.w.detach().float().cpu().clone())
        return (self.w * c).sum()


def _seen_rank(rank, world, device_kind):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import gradzip as gz

    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    model = _Seen().to(device)
    fully_shard(model, mesh=DeviceMesh.from_group(dist.group.WORLD, device.type))
    gz.fsdp.compress(model, gz.Int8(), all_gather=gz.Int8(block=256))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for t in range(3):
        c = torch.full((4099,), float(t + rank + 1), device=device)
        model(c).backward()
        opt.step()
        opt.zero_grad()
    return model.seen


@pytest.mark.gpu
def test_compressed_all_gather_on_cuda_matches_cpu_bit_for_bit():
    want = run_ranks(_seen_rank, 2, "cpu")
    got = run_ranks(_seen_rank, 2, "cuda", fresh=True)
    for r in range(2):
        assert len(got[r]) == len(want[r]) == 3  # the weights each forward saw
        for a, b in zip(got[r], want[r]):
            assert torch.equal(a, b)
