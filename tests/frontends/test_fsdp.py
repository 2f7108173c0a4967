"""gradzip.fsdp: FSDP2's reduce-scatter (and HSDP's replica all-reduce) through gradzip, on CPU/gloo.

The model is transformer-like without attention: an embedding, two MLP blocks with
LayerNorm, a final LayerNorm and a head; each block and the root get their own
``fully_shard`` (three parameter groups). Sizes 37 and 22 make the shards need padding.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.support import run_ranks
from tests.support.models import forget_dtensor_caches

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]

V, D = 37, 22


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 3 * D)
        self.fc2 = nn.Linear(3 * D, D)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def batch(rank: int, step: int, B: int = 4, T: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def loss_of(model, idx, tgt):
    return nn.functional.cross_entropy(model(idx).float().reshape(-1, V), tgt.reshape(-1))


def build(world: int, layout: str = "fsdp", mp: bool = False, raf: bool = True):
    """The model, sharded: ``layout`` is ``fsdp`` (1-D), ``hsdp`` (FSDP2's native HSDP on a
    2 x W/2 mesh) or ``hsdp_shard`` (FSDP on the shard sub-mesh, for gradzip's replica hook).
    The tests run in pooled ranks (FSDP's and gradzip's first-use costs paid once a pool), so
    the DTensor caches of an earlier call, which would hand out its meshes, are cleared first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    forget_dtensor_caches()
    torch.manual_seed(0)
    model = Net()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        fmesh = mesh
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fmesh = mesh if layout == "hsdp" else mesh["shard"]
    kw = dict(mesh=fmesh, reshard_after_forward=raf)
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model, mesh


def _method(spec):
    import gradzip as gz

    return None if spec is None else gz.parse(spec)


def train(
    rank, world, *, rs=None, replicate=None, layout="fsdp", steps=10, mp=False, raf=True, accum=1, lr=0.1, ef=None
):
    """Train ``steps`` SGD steps; full parameters, losses and stats on every rank."""
    import gradzip as gz

    model, mesh = build(world, layout, mp, raf)
    state = None
    if rs is not None or replicate is not None:
        state = gz.fsdp.compress(
            model,
            _method(rs),
            replicate=_method(replicate),
            replicate_group=mesh["replicate"] if replicate is not None else None,
            error_feedback=ef,
        )
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
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
    full = {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}
    out = {"params": full, "losses": losses}
    if state is not None:
        out["step"] = state.step
        if rs is not None:
            out["stats"] = state.stats()
        if replicate is not None:
            out["replicate_stats"] = state.stats("replicate")
    return out


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


# -- 2 ranks: Identity is plain FSDP2 bit for bit, in every configuration ----------------

COMBOS = [
    dict(),  # fp32, reshard_after_forward=True
    dict(mp=True, raf=False, accum=2),  # bf16 params, fp32 reduce, no reshard, 2 microbatches
    dict(raf=False, accum=3),
]


COMBO_STEPS = 3


def _combos(rank, world):
    out = []
    for kw in COMBOS:
        plain = train(rank, world, steps=COMBO_STEPS, **kw)
        ident = train(rank, world, rs="Identity()", steps=COMBO_STEPS, **kw)
        int8 = train(rank, world, rs="Int8()", steps=COMBO_STEPS, **kw)
        out.append((plain, ident, int8))
    # other framed codecs through the same protocol (default configuration, 3 steps)
    others = {spec: train(rank, world, rs=spec, steps=3) for spec in CODECS}
    return out, others


CODECS = ["TopK(0.1)", "SignSGD()", "QSGD()", "FP16()"]


def test_2_ranks_identity_is_plain_fsdp2_bit_for_bit_with_mixed_precision_accumulation_and_reshard():
    results = run_ranks(_combos, 2)
    combos, others = results[0]
    for kw, (plain, ident, int8) in zip(COMBOS, combos):
        assert _equal(plain["params"], ident["params"]), kw
        assert plain["losses"] == ident["losses"], kw
        # one engine step per synchronized backward; accumulation microbatches reduce nothing
        assert ident["step"] == COMBO_STEPS and ident["stats"]["steps"] == COMBO_STEPS, kw
        # Int8 with error feedback stays in plain FSDP2's band
        assert max(abs(a - b) for a, b in zip(int8["losses"], plain["losses"])) < 5e-3, kw
        assert 0 < _max_diff(int8["params"], plain["params"]) < 5e-3, kw
    assert _equal(results[1][0][0][2]["params"], combos[0][2]["params"])  # every rank holds the same parameters
    plain = combos[0][0]["losses"][:3]
    for spec, o in others.items():
        assert max(abs(a - b) for a, b in zip(o["losses"], plain)) < 2e-2, spec
        assert o["stats"]["ratio"] > 1.5, spec


# -- 4 ranks: the reduction order, Int8, stats ------------------------------------------


FOUR_STEPS = 3


def _four(rank, world):
    from torch.distributed.tensor import DTensor

    import gradzip as gz

    # One backward: FSDP + Identity against the mean of the local gradients summed in rank order.
    torch.manual_seed(0)
    ref = Net()
    idx, tgt = batch(rank, 0)
    loss_of(ref, idx, tgt).backward()
    names = [n for n, _ in ref.named_parameters()]
    local = {n: p.grad for n, p in ref.named_parameters()}
    gathered = {}
    for n in names:
        parts = [torch.empty_like(local[n]) for _ in range(world)]
        dist.all_gather(parts, local[n])
        acc = torch.zeros_like(local[n])
        for t in parts:  # rank order
            acc += t
        gathered[n] = (acc / world, sum(t.abs() for t in parts))
    grads = {}
    for mode in ("plain", "identity"):
        model, _ = build(world)
        if mode == "identity":
            gz.fsdp.compress(model, gz.Identity())
        loss_of(model, idx, tgt).backward()
        grads[mode] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    out = {"rank_order": {n: torch.equal(grads["identity"][n], gathered[n][0]) for n in names}}
    eps = torch.finfo(torch.float32).eps
    # two summation orders of W terms each round by at most (W-1) eps sum|g| / W
    out["within_bound"] = {
        n: bool(
            ((grads["identity"][n] - grads["plain"][n]).abs() <= 2 * (world - 1) * eps * gathered[n][1] / world).all()
        )
        for n in names
    }
    out["plain_equal"] = all(torch.equal(grads["identity"][n], grads["plain"][n]) for n in names)
    out["plain"] = train(rank, world, steps=FOUR_STEPS)
    out["identity"] = train(rank, world, rs="Identity()", steps=FOUR_STEPS)
    out["int8"] = train(rank, world, rs="Int8()", steps=FOUR_STEPS)
    return out


def test_4_ranks_identity_int8_and_stats():
    results = run_ranks(_four, 4, timeout=280)
    r = results[0]
    # Bit for bit with the float32 mean summed in rank order (gradzip's order on every backend).
    assert all(r["rank_order"].values()), r["rank_order"]
    # gloo's reduce-scatter sums in ring order ((x[j-1] + x[j-2]) + x[j-3]) + x[j]: the two
    # differ by float32 rounding only, within the bound of two orders of a 4-term sum.
    assert all(r["within_bound"].values()), r["within_bound"]
    # ... and the parameters stay that close after FOUR_STEPS steps (SGD with momentum, lr 0.1)
    assert _max_diff(r["identity"]["params"], r["plain"]["params"]) < 1e-6
    assert max(abs(a - b) for a, b in zip(r["identity"]["losses"], r["plain"]["losses"])) < 1e-5
    # Int8 with error feedback: within plain FSDP2's band
    assert max(abs(a - b) for a, b in zip(r["int8"]["losses"], r["plain"]["losses"])) < 5e-3
    assert _max_diff(r["int8"]["params"], r["plain"]["params"]) < 5e-3
    s = r["int8"]["stats"]
    assert s["steps"] == FOUR_STEPS and s["collectives"] > 0
    # bytes_link_raw is a plain reduce-scatter's (N-1)/N of the input, not an allreduce's
    assert s["bytes_link_raw"] == pytest.approx(3 / 4 * s["bytes_raw"])
    # even on this tiny model (3 groups of 0.2-3k elements, a 16-byte header per parameter
    # and destination) Int8 sends about 0.3 of a plain reduce-scatter's link bytes
    assert s["bytes_link"] < 0.35 * s["bytes_link_raw"]
    assert s["bytes_link"] < s["bytes_sent"]  # the self-addressed chunk never leaves the rank
    i = r["identity"]["stats"]
    assert 0.9 * i["bytes_link_raw"] < i["bytes_link"] < 1.2 * i["bytes_link_raw"]
    for q in results[1:]:  # every rank holds the same full parameters
        assert _equal(q["int8"]["params"], r["int8"]["params"])


# -- HSDP on a 2 x 2 mesh -----------------------------------------------------------------


HSDP_STEPS = 3


def _hsdp(rank, world):
    out = {}
    n = HSDP_STEPS
    out["native"] = train(rank, world, layout="hsdp", steps=n)
    out["identity"] = train(rank, world, layout="hsdp_shard", rs="Identity()", replicate="Identity()", steps=n)
    out["int8+powersgd"] = train(rank, world, layout="hsdp_shard", rs="Int8()", replicate="PowerSGD(rank=2)", steps=n)
    out["native+int8"] = train(rank, world, layout="hsdp", rs="Int8()", steps=n)
    out["replicate only"] = train(rank, world, layout="hsdp_shard", replicate="Int8()", steps=n, mp=True)
    return out


def test_hsdp_2x2_compressed_reduce_scatter_and_replica_allreduce():
    results = run_ranks(_hsdp, 4, timeout=280)
    r = results[0]
    native = r["native"]
    # FSDP on the shard sub-mesh + gradzip's replica average == FSDP2's native HSDP, bit for bit
    assert _equal(r["identity"]["params"], native["params"])
    assert r["identity"]["replicate_stats"]["steps"] == HSDP_STEPS
    for k in ("native+int8", "replicate only"):
        assert max(abs(a - b) for a, b in zip(r[k]["losses"], native["losses"])) < 5e-3, k
    # PowerSGD(rank=2) on the replica average is lossier: a wider band
    assert max(abs(a - b) for a, b in zip(r["int8+powersgd"]["losses"], native["losses"])) < 5e-2
    assert r["int8+powersgd"]["replicate_stats"]["ratio"] > 2
    # the replicas stay equal: every rank decodes the replica average alike
    for q in results[1:]:
        for k in r:
            assert _equal(q[k]["params"], r[k]["params"]), k


# -- DCP: save on 4 ranks, load on 2 --------------------------------------------------------


def _pending_full(state):
    """The pending update of every parameter, gathered whole (a collective)."""
    return {k: v.full_tensor().clone() for k, v in state.state_dict().items() if k != "step"}


SAVED_AT = 2  # steps before the save


def _save(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import gradzip as gz

    out = {}
    for name, layout, rs, rep in (("fsdp", "fsdp", gz.Int8(), None), ("hsdp", "hsdp_shard", gz.Int8(), gz.TopK(0.1))):
        model, mesh = build(world, layout)
        state = gz.fsdp.compress(model, rs, replicate=rep, replicate_group=mesh["replicate"] if rep else None)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(SAVED_AT):
            idx, tgt = batch(rank, step)
            loss_of(model, idx, tgt).backward()
            opt.step()
            opt.zero_grad()
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "gradzip": state}
        dcp.save(sd, checkpoint_id=os.path.join(root, name))
        out[name] = {
            "pending": _pending_full(state),
            "step": state.step,
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        }
    return out


def _load(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import gradzip as gz

    out = {}
    for name in ("fsdp", "hsdp"):
        model, _ = build(world, "fsdp")
        state = gz.fsdp.compress(model, gz.Int8())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        idx, tgt = batch(rank, 99)  # Adam's state exists once it has stepped
        loss_of(model, idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "gradzip": state}
        dcp.load(sd, checkpoint_id=os.path.join(root, name))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        res = {
            "pending": _pending_full(state),
            "step": state.step,
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        }
        losses = []
        for step in range(SAVED_AT, SAVED_AT + 2):  # training resumes
            idx, tgt = batch(rank, step)
            loss = loss_of(model, idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        res["losses"] = losses
        res["step_after"] = state.step
        out[name] = res
    return out


def test_dcp_save_on_4_ranks_load_on_2_keeps_the_pending_update():
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(_save, 4, root, timeout=280)[0]
        loaded = run_ranks(_load, 2, root, timeout=280)[0]
    for name in ("fsdp", "hsdp"):
        s, ld = saved[name], loaded[name]
        assert ld["step"] == s["step"] == SAVED_AT
        assert ld["step_after"] == SAVED_AT + 2
        assert _equal(ld["params"], s["params"])
        assert all(torch.isfinite(torch.tensor(ld["losses"])))
        # residual mass: the update error feedback still owed, resharded from 4 shards to 2
        mass = sum(v.abs().sum().item() for v in s["pending"].values())
        assert mass > 0
    s, ld = saved["fsdp"], loaded["fsdp"]
    assert _equal(ld["pending"], s["pending"])  # bit for bit
    # HSDP -> FSDP: the replica engine's pending update is carried by the reduce-scatter
    s, ld = saved["hsdp"], loaded["hsdp"]
    assert sum(s["pending"][k].abs().sum().item() for k in s["pending"] if k.startswith("replicate.")) > 0
    for k, v in ld["pending"].items():
        kind, name = k.split(".", 1)
        if kind == "reduce_scatter":
            assert torch.equal(v, s["pending"][f"reduce_scatter.{name}"] + s["pending"][f"replicate.{name}"]), k
        else:  # no replica engine in the 1-D run
            assert not v.any(), k


# -- clear errors where FSDP2 refuses; non-finite gradients ------------------------------------


class WithUnused(Net):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(D, D)


def _errors(rank, world):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    import gradzip as gz

    out = {}

    def catch(label, f, exc=ValueError):
        try:
            f()
        except exc as e:
            out[label] = str(e)
        else:
            out[label] = None

    forget_dtensor_caches()
    mesh = init_device_mesh("cpu", (world,))
    # several parameter groups per module (a per-parameter mesh)
    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"), shard_mesh_dim=0)
    torch.manual_seed(0)
    m = Net()
    fully_shard(
        m, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p.ndim == 1 else None
    )
    catch("groups", lambda: gz.fsdp.compress(m, gz.Int8()))
    # the process-group allocator, before and after compress
    m, _ = build(world)
    m.set_allocate_memory_from_process_group_for_comm(True)
    catch("allocator before", lambda: gz.fsdp.compress(m, gz.Int8()))
    m, _ = build(world)
    state = gz.fsdp.compress(m, gz.Int8())
    catch("allocator after", lambda: m.set_allocate_memory_from_process_group_for_comm(True))
    m.set_allocate_memory_from_process_group_for_comm(False)  # off is what it is: no error
    catch("twice", lambda: gz.fsdp.compress(m, gz.Int8()))
    state.remove()
    m.set_allocate_memory_from_process_group_for_comm(True)  # FSDP's own comm is back
    # native HSDP cannot take a replica codec
    m, mesh2 = build(world, "hsdp")
    catch("native hsdp", lambda: gz.fsdp.compress(m, replicate=gz.Int8(), replicate_group=mesh2["replicate"]))
    m, mesh2 = build(world, "hsdp_shard")
    catch("no group", lambda: gz.fsdp.compress(m, replicate=gz.Int8()))
    catch("protocol", lambda: gz.fsdp.compress(m, gz.PowerSGD(rank=2)))
    catch("nothing", lambda: gz.fsdp.compress(m))
    catch("not fsdp", lambda: gz.fsdp.compress(Net(), gz.Int8()), TypeError)
    # a parameter without a gradient: FSDP leaves it out of the reduce-scatter
    torch.manual_seed(0)
    m = WithUnused()
    fully_shard(m, mesh=mesh)
    gz.fsdp.compress(m, gz.Int8())
    idx, tgt = batch(rank, 0)
    catch("unused", lambda: loss_of(m, idx, tgt).backward())  # a ValueError out of backward()
    torch.manual_seed(0)
    m = WithUnused()
    fully_shard(m, mesh=mesh)
    m.set_reduce_scatter_unused_params(True)
    state = gz.fsdp.compress(m, gz.Int8())
    for step in range(2):
        idx, tgt = batch(rank, step)
        loss_of(m, idx, tgt).backward()
    out["unused ok"] = (state.step, state.engine.memory.residual("unused.weight"))

    # non-finite gradients: "skip" gives NaN gradients everywhere and rolls the residuals back
    for policy in ("skip", "raise"):
        m, _ = build(world)
        state = gz.fsdp.compress(m, gz.Int8(), on_nonfinite=policy)
        idx, tgt = batch(rank, 0)
        loss_of(m, idx, tgt).backward()
        m.zero_grad()
        before = {k: v.clone() for k, v in state.engine.memory.residuals.items()}
        idx, tgt = batch(rank, 1)
        loss = loss_of(m, idx, tgt) * (float("nan") if rank == 1 else 1.0)
        try:
            loss.backward()
            out[policy] = ("ok", all(bool(p.grad.to_local().isnan().all()) for p in m.parameters()))
        except FloatingPointError as e:
            out[policy] = ("FloatingPointError", str(e))
        after = state.engine.memory.residuals
        out[policy + " rolled back"] = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before
        )
        out[policy + " step"] = state.step
    return out


def test_clear_errors_and_nonfinite_steps():
    r = run_ranks(_errors, 2)[0]
    assert "2 FSDP parameter groups" in r["groups"] and "shard_placement_fn" in r["groups"]
    assert "set_allocate_memory_from_process_group_for_comm(False)" in r["allocator before"]
    assert "set_allocate_memory_from_process_group_for_comm(True) cannot be combined" in r["allocator after"]
    assert "already" in r["twice"]
    assert "native HSDP" in r["native hsdp"] and "mesh=mesh['shard']" in r["native hsdp"]
    assert "replicate_group" in r["no group"]
    assert "gradzip codec" in r["protocol"] and "replicate=" in r["protocol"]
    assert "reduce_scatter=" in r["nothing"]
    assert "fully_shard" in r["not fsdp"]
    assert "set_reduce_scatter_unused_params(True)" in r["unused"]
    step, residual = r["unused ok"]
    assert step == 2 and residual is None  # an unused parameter's zeros leave its residual alone
    assert r["skip"] == ("ok", True) and r["skip rolled back"] and r["skip step"] == 2
    assert r["raise"][0] == "FloatingPointError" and r["raise rolled back"] and r["raise step"] == 2


def test_reduce_scatter_protocol_refuses_what_it_cannot_carry():
    import gradzip as gz
    from gradzip.protocols import ReduceScatter

    assert gz.parse("ReduceScatter(Int8())") == ReduceScatter(gz.Int8())
    assert repr(ReduceScatter(gz.TopK(0.01))) == "ReduceScatter(TopK(ratio=0.01))"
    with pytest.raises(ValueError, match="travel in frames"):
        ReduceScatter(gz.RandomK(0.1))
    with pytest.raises(ValueError, match="travel in frames"):
        ReduceScatter(gz.PowerSGD())
    assert ReduceScatter(gz.Int8()).link_raw(4000, 4) == 3000


def test_param_groups_reads_the_list_of_torch_2_13_and_the_single_group_of_torch_2_11():
    from types import SimpleNamespace

    from gradzip.fsdp import _param_groups

    a, b = object(), object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[])) == []
    # torch 2.11 (the GPU image): one group or None, no list
    assert _param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
