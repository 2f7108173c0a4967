"""One rank of tests/frontends/test_horovod.py's horovodrun job: gradzip.horovod against real Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python tests/frontends/horovod_job.py OUT_PREFIX

Both ``horovod.torch`` and ``gradzip.horovod`` are initialised in the same processes (gradzip's
torch.distributed from horovodrun's environment and rendezvous server), so every check compares
the two on the same data. Each check records ``{"ok": bool, ...}`` or the error; the rank writes
``OUT_PREFIX.<rank>.json`` and the test asserts. Checks never stop the job: a failed check is
recorded, and the collectives of the next check still run in the same order on both ranks.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import horovod.torch as hv  # noqa: E402

import gradzip.horovod as gh  # noqa: E402

RESULTS: dict = {}


def check(name):
    def deco(fn):
        try:
            out = fn()
            RESULTS[name] = {"ok": True, **(out or {})}
        except Exception:  # noqa: BLE001 - recorded for the test to report
            RESULTS[name] = {"ok": False, "error": traceback.format_exc()}
        return fn

    return deco


def equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(list(a)) == len(list(b))


def model_and_data(seed: int, sparse: bool = False):
    torch.manual_seed(seed)
    if sparse:
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(24, 3))
        xs = [
            torch.randint(0, 50, (4, 3), generator=torch.Generator().manual_seed(100 * r + s))
            for r in range(2)
            for s in range(8)
        ]
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 3)
        )
        xs = [
            torch.randn(8, 20, generator=torch.Generator().manual_seed(100 * r + s)) for r in range(2) for s in range(8)
        ]
    ys = [torch.randint(0, 3, (x.shape[0],), generator=torch.Generator().manual_seed(7 + i)) for i, x in enumerate(xs)]
    return model, xs, ys


def train(make_opt, steps=4, passes=1, sparse=False, seed=0, set_passes=None, momentum=0.9):
    """Train the same model on rank-dependent data; the final parameters and the optimizer."""
    model, xs, ys = model_and_data(seed, sparse)
    opt = make_opt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), model)
    if set_passes:
        opt.set_backward_passes_per_step(set_passes)
        passes = set_passes
    r = hv.rank()
    for s in range(steps):
        opt.zero_grad()
        for k in range(passes):
            i = r * 8 + (s * passes + k) % 8
            F.cross_entropy(model(xs[i]), ys[i]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def both(steps=4, passes=1, sparse=False, set_passes=None, momentum=0.9, **kw):
    """(Horovod's parameters, gradzip's parameters, gradzip's optimizer) for the same kwargs."""
    h, hopt = train(
        lambda o, m: hv.DistributedOptimizer(o, named_parameters=m.named_parameters(), **kw),
        steps,
        passes,
        sparse,
        set_passes=set_passes,
        momentum=momentum,
    )
    g, gopt = train(
        lambda o, m: gh.DistributedOptimizer(o, named_parameters=m.named_parameters(), **kw),
        steps,
        passes,
        sparse,
        set_passes=set_passes,
        momentum=momentum,
    )
    return h, g, hopt, gopt


def main(prefix: str) -> None:
    warnings.simplefilter("ignore")
    gh.init()  # transport "torch": torch.distributed from horovodrun's environment
    hv.init()

    @check("init")
    def _():
        assert (gh.size(), gh.rank(), gh.local_rank(), gh.local_size()) == (
            hv.size(),
            hv.rank(),
            hv.local_rank(),
            hv.local_size(),
        )
        assert gh.transport() == "torch" and torch.distributed.get_world_size() == 2
        return {"size": gh.size(), "rank": gh.rank()}

    @check("identity_bit_exact")
    def _():
        h, g, hopt, gopt = both()
        assert equal(h, g), "parameters differ from horovod.torch's"
        assert isinstance(gopt, torch.optim.SGD) and isinstance(hopt, torch.optim.SGD)
        assert type(gopt).__name__ == type(hopt).__name__ == "SGD"
        return {"bytes_sent": gopt.stats()["bytes_sent"]}

    for name, kw in {
        "op_sum": dict(op=hv.Sum),
        "op_average_int": dict(op=hv.Average),
        "predivide_2": dict(gradient_predivide_factor=2.0),
        "groups_int": dict(groups=2),
        "num_groups": dict(num_groups=2),
        "backward_passes_2": dict(backward_passes_per_step=2, passes=2),
        "set_backward_passes": dict(set_passes=2),
        "process_set_global": dict(process_set=hv.global_process_set),
    }.items():

        @check(name)
        def _(kw=kw):
            h, g, _, _ = both(**kw)
            assert equal(h, g), "parameters differ from horovod.torch's"

    @check("groups_list")
    def _():
        def mk(lib):
            def f(o, m):
                ps = list(m.parameters())
                return lib.DistributedOptimizer(
                    o, named_parameters=m.named_parameters(), groups=[[ps[0], ps[3]], [ps[1]]]
                )

            return f

        h, _ = train(mk(hv))
        g, gopt = train(mk(gh))
        assert equal(h, g)
        return {"buckets": [len(b.params) for b in gopt._gz._buckets]}

    for name, sad in (("sparse_grads", False), ("sparse_as_dense", True)):

        @check(name)
        def _(sad=sad):
            h, g, hopt, gopt = both(sparse=True, sparse_as_dense=sad, momentum=0.0)
            worst = max(float((a - b).abs().max()) for a, b in zip(h, g))
            assert worst <= 1e-6, worst  # Horovod's sparse path sums in another order
            emb = next(iter(gopt.param_groups[0]["params"]))
            return {"max_abs_diff": worst, "grad_is_sparse": bool(emb.grad.is_sparse)}

    for name, comp, fp16 in (
        ("hvd_fp16", hv.Compression.fp16, True),
        ("gz_fp16", gh.Compression.fp16, True),
        ("hvd_none", hv.Compression.none, False),
    ):

        @check(name)
        def _(comp=comp, fp16=fp16):
            h, _ = train(
                lambda o, m: hv.DistributedOptimizer(
                    o,
                    named_parameters=m.named_parameters(),
                    compression=hv.Compression.fp16 if fp16 else hv.Compression.none,
                )
            )
            g, gopt = train(
                lambda o, m: gh.DistributedOptimizer(o, named_parameters=m.named_parameters(), compression=comp)
            )
            worst = max(float((a - b).abs().max()) for a, b in zip(h, g))
            assert worst <= (1e-2 if fp16 else 0.0), worst
            return {"max_abs_diff": worst, "error_feedback": gopt.engine.error_feedback}

    @check("load_plain_state")
    def _():
        p, plain = train(lambda o, m: o)  # a plain SGD, no communication
        g, gopt = train(lambda o, m: gh.DistributedOptimizer(o, named_parameters=m.named_parameters()), steps=1)
        sd = plain.state_dict()
        gopt.load_state_dict(sd)
        got = gopt.state_dict()
        assert "gradzip" in got
        assert all(
            torch.equal(got["state"][k]["momentum_buffer"], sd["state"][k]["momentum_buffer"]) for k in sd["state"]
        )
        gopt.load_state_dict(got)  # its own state, gradzip part included

    @check("zero_grad_mid_step_raises")
    def _():
        model, xs, ys = model_and_data(0)
        opt = gh.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        F.cross_entropy(model(xs[0]), ys[0]).backward()
        try:
            opt.zero_grad()
            raise RuntimeError("zero_grad() did not raise")
        except AssertionError:
            pass
        opt.step()

    @check("broadcasts")
    def _():
        torch.manual_seed(hv.rank())  # different models per rank
        m1 = torch.nn.Linear(5, 3)
        m2 = torch.nn.Linear(5, 3)
        m2.load_state_dict(m1.state_dict())
        o1 = torch.optim.SGD(m1.parameters(), lr=0.1 + hv.rank(), momentum=0.9)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.1 + hv.rank(), momentum=0.9)
        for m, o in ((m1, o1), (m2, o2)):
            m(torch.ones(2, 5)).sum().backward()
            o.step()
        hv.broadcast_parameters(m1.state_dict(), root_rank=0)
        hv.broadcast_optimizer_state(o1, root_rank=0)
        gh.broadcast_parameters(m2.state_dict(), root_rank=0)
        gh.broadcast_optimizer_state(o2, root_rank=0)
        assert equal(list(m1.parameters()), list(m2.parameters()))
        s1, s2 = o1.state_dict(), o2.state_dict()
        assert s1["param_groups"][0]["lr"] == s2["param_groups"][0]["lr"] == 0.1
        assert all(
            torch.equal(s1["state"][k]["momentum_buffer"], s2["state"][k]["momentum_buffer"]) for k in s1["state"]
        )
        assert gh.broadcast_object({"r": hv.rank()}, root_rank=1) == {"r": 1}

    @check("broadcast_gradzip_optimizer_state")
    def _():
        # the usual Horovod pattern (wrap, then broadcast rank 0's state) with a gradzip optimizer:
        # the hyper-parameters and buffers travel, the per-rank gradzip state stays each rank's own
        model, xs, ys = model_and_data(0)
        opt = gh.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1 + hv.rank(), momentum=0.9),
            named_parameters=model.named_parameters(),
            compression="TopK(0.1)",
        )
        F.cross_entropy(model(xs[hv.rank()]), ys[hv.rank()]).backward()
        opt.step()
        mine = opt.engine.state_dict()
        gh.broadcast_optimizer_state(opt, root_rank=0)
        assert opt.param_groups[0]["lr"] == 0.1
        after = opt.engine.state_dict()
        assert after["rank"] == hv.rank()
        assert all(torch.equal(mine["residuals"][k], after["residuals"][k]) for k in mine["residuals"])

    @check("allreduce")
    def _():
        t = torch.randn(1000, generator=torch.Generator().manual_seed(hv.rank())) * 10
        for op in (hv.Average, hv.Sum, hv.Min, hv.Max):
            assert torch.equal(gh.allreduce(t, op=op), hv.allreduce(t, op=op)), op
        assert torch.equal(gh.allreduce(t, average=False), hv.allreduce(t, average=False))
        assert torch.equal(
            gh.allreduce(t, prescale_factor=0.5, postscale_factor=3.0),
            hv.allreduce(t, prescale_factor=0.5, postscale_factor=3.0),
        )
        w = torch.randn(1000, generator=torch.Generator().manual_seed(5 + hv.rank()))  # a contiguous upstream
        x = t.clone().requires_grad_()  # gradient (Horovod's backward refuses .sum()'s expanded one)
        (gh.allreduce(x) * w).sum().backward()
        y = t.clone().requires_grad_()
        (hv.allreduce(y) * w).sum().backward()
        assert torch.equal(x.grad, y.grad)
        u = t.clone()
        gh.allreduce_(u, op=hv.Sum)
        assert torch.equal(u, hv.allreduce(t, op=hv.Sum))
        rows = torch.arange(3 * (hv.rank() + 1), dtype=torch.float32).view(-1, 3)
        assert torch.equal(gh.allgather(rows), hv.allgather(rows))

    @check("adapters_in_horovod")
    def _():
        t = torch.tensor([1e5, -7e4, 1.5, 65504.0]) * (hv.rank() + 1)
        mine, theirs = (
            hv.allreduce(t, compression=gh.Compression.fp16),
            hv.allreduce(t, compression=hv.Compression.fp16),
        )
        assert torch.equal(mine, theirs) and not bool(torch.isfinite(mine[:2]).any()), (mine, theirs)
        assert torch.equal(hv.allreduce(t, compression=gh.Compression.none), hv.allreduce(t))
        try:
            hv.allreduce(torch.ones(3, dtype=torch.bfloat16))
            raise RuntimeError("Horovod took a bfloat16 allreduce")
        except ValueError:
            pass
        return {"fp16_overflow": [str(v) for v in mine.tolist()]}

    @check("example_identity_bit_exact")
    def _():
        import horovod_mnist

        flags = ["--epochs", "1", "--train-size", "256", "--seed", "3"]  # 2 steps a rank, then the test set
        a = horovod_mnist.main(flags + ["--hvd", "horovod"])
        b = horovod_mnist.main(flags + ["--hvd", "gradzip"])
        assert a["params_sha256"] == b["params_sha256"], (a, b)
        return {"params_sha256": a["params_sha256"], "bytes_link": b["stats"]["bytes_link"]}

    # -- the rest of horovod.torch's API, result for result ----------------------------------
    @check("integer_reductions")
    def _():
        r = hv.rank()
        cases = [
            (torch.tensor([2, 4]), {}),
            (torch.tensor([2 + r, 5, -3 - r]), {}),
            (torch.tensor([3, 7]), dict(postscale_factor=0.5)),
            (torch.tensor([3, 7, -7]), dict(op=hv.Sum, prescale_factor=0.5)),
            (torch.tensor([5, 9], dtype=torch.int32) * (r + 1), dict(op=hv.Max)),
        ]
        got = []
        for t, kw in cases:
            a, b = gh.allreduce(t, **kw), hv.allreduce(t, **kw)
            assert a.dtype == b.dtype and torch.equal(a, b), (t, kw, a, b)
            got.append(a.tolist())
        return {"results": got}

    @check("async_handles")
    def _():
        t = torch.randn(64, generator=torch.Generator().manual_seed(hv.rank()))
        ours, theirs = gh.allreduce_async(t, op=hv.Sum), hv.allreduce_async(t, op=hv.Sum)
        a, b = gh.synchronize(ours), hv.synchronize(theirs)
        assert torch.equal(a, b)
        assert gh.synchronize(ours) is None and hv.synchronize(theirs) is None  # handles are used once
        u, v = t.clone(), t.clone()
        h1, h2 = gh.allreduce_async_(u, prescale_factor=2.0), hv.allreduce_async_(v, prescale_factor=2.0)
        while not gh.poll(h1):
            pass
        assert gh.synchronize(h1) is u and torch.equal(u, hv.synchronize(h2))
        g = [t[:10].clone(), t[10:].clone()]
        a = gh.synchronize(gh.grouped_allreduce_async(g))
        b = hv.synchronize(hv.grouped_allreduce_async(g))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        rows = torch.arange(3.0 * (hv.rank() + 1)).view(-1, 3)
        assert torch.equal(gh.synchronize(gh.allgather_async(rows)), hv.synchronize(hv.allgather_async(rows)))
        x = torch.arange(4.0) + hv.rank()
        assert torch.equal(gh.synchronize(gh.broadcast_async(x, 1)), hv.synchronize(hv.broadcast_async(x, 1)))
        y1, y2 = x.clone(), x.clone()
        gh.synchronize(gh.broadcast_async_(y1, 0))
        hv.synchronize(hv.broadcast_async_(y2, 0))
        assert torch.equal(y1, y2)

    @check("grouped_collectives")
    def _():
        r = hv.rank()
        ts = [torch.randn(5, generator=torch.Generator().manual_seed(r)), torch.arange(4) * (r + 1)]
        for op in (hv.Average, hv.Sum, hv.Max):
            a, b = gh.grouped_allreduce(ts, op=op), hv.grouped_allreduce(ts, op=op)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), op
        u, v = [t.clone() for t in ts], [t.clone() for t in ts]
        gh.grouped_allreduce_(u)
        hv.grouped_allreduce_(v)
        assert all(torch.equal(x, y) for x, y in zip(u, v))
        gs = [torch.arange(2.0 * (r + 1)).view(-1, 2), torch.ones(r + 1, dtype=torch.int32)]
        assert all(torch.equal(x, y) for x, y in zip(gh.grouped_allgather(gs), hv.grouped_allgather(gs)))
        rs = [torch.arange(6.0).view(3, 2) * (r + 1), torch.arange(4) * (r + 1)]
        a, b = gh.grouped_reducescatter(rs), hv.grouped_reducescatter(rs)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (a, b)
        a = gh.synchronize(gh.grouped_reducescatter_async(rs, op=hv.Sum))
        b = hv.synchronize(hv.grouped_reducescatter_async(rs, op=hv.Sum))
        assert all(torch.equal(x, y) for x, y in zip(a, b))

    @check("mismatched_ranks")
    def _():
        # Ranks that issue a collective with another shape, dtype or op: Horovod's coordinator
        # refuses it on every rank, and the next collective works (an audit of 2026-12-01: gradzip
        # hung, aborted gloo or returned a mixed result).
        r = hv.rank()
        cases = {
            "tensor shapes": lambda m: m.allreduce(torch.ones(3 + r), name="mm.shape"),
            "data types": lambda m: m.allreduce(torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64)),
            "reduction op": lambda m: m.allreduce(torch.ones(3), op=m.Sum if r == 0 else m.Max, name="mm.op"),
            "allgather inner": lambda m: m.allgather(torch.ones(2, 2 + r), name="mm.ag"),
            "broadcast shapes": lambda m: m.broadcast(torch.ones(2 + r), 0, name="mm.bc"),
            "reducescatter": lambda m: m.reducescatter(torch.ones(4, 1 + r), name="mm.rs"),
        }
        seen = {}
        for label, fn in cases.items():
            for mod in (gh, hv):
                try:
                    fn(mod)
                    seen[f"{mod.__name__} {label}"] = None
                except Exception as exc:  # noqa: BLE001 - both must raise, and the same kind
                    seen[f"{mod.__name__} {label}"] = f"{type(exc).__name__}: {exc}"
            assert torch.equal(gh.allreduce(torch.ones(2), op=gh.Sum), hv.allreduce(torch.ones(2), op=hv.Sum))
        for label in cases:
            ours, theirs = seen[f"gradzip.horovod {label}"], seen[f"horovod.torch {label}"]
            assert theirs is not None and theirs.startswith("HorovodInternalError: Mismatched"), (label, theirs)
            assert ours is not None and ours.startswith("HorovodInternalError: Mismatched"), (label, ours)
        return {"refusals": seen}

    @check("results_and_refusals_as_horovods")
    def _():
        r = hv.rank()
        # a Parameter broadcast in place is the Parameter (model.weight = hvd.broadcast_(...) works)
        for mod in (gh, hv):
            w = torch.nn.Parameter(torch.arange(3.0) + r)
            out = mod.broadcast_(w, 0)
            assert out is w and isinstance(out, torch.nn.Parameter) and torch.equal(w.detach(), torch.arange(3.0))
            assert mod.synchronize(mod.broadcast_async_(w, 1)) is w
        # a grouped handle's result is a tuple; grouped_allgather a tuple; grouped_allreduce a list
        ts = [torch.ones(3) * (r + 1), torch.arange(2.0)]
        for mod in (gh, hv):
            assert type(mod.synchronize(mod.grouped_allreduce_async(ts))) is tuple, mod
            assert type(mod.grouped_allreduce_([t.clone() for t in ts])) is tuple, mod
            assert type(mod.synchronize(mod.grouped_allgather_async(ts))) is tuple, mod
            assert type(mod.grouped_allgather(ts)) is tuple, mod
            assert type(mod.grouped_allreduce(ts)) is list, mod
            rows = [torch.ones(4, 2), torch.ones(2)]
            assert type(mod.synchronize(mod.grouped_reducescatter_async(rows))) is tuple, mod
        refusals = {}
        for mod in (gh, hv):
            for label, fn in {
                "poll of an unknown handle": lambda: mod.poll(123456),
                "a scalar reducescatter": lambda: mod.reducescatter(torch.tensor(1.0)),
                "an int16 allreduce": lambda: mod.allreduce(torch.ones(2, dtype=torch.int16)),
                "a root outside the set": lambda: mod.broadcast(torch.ones(2), 5),
            }.items():
                try:
                    fn()
                    refusals[f"{mod.__name__} {label}"] = None
                except ValueError as exc:
                    refusals[f"{mod.__name__} {label}"] = str(exc)
        for key, why in refusals.items():
            assert why is not None, key
        return {"refusals": refusals}

    @check("alltoall_reducescatter")
    def _():
        r = hv.rank()
        t = torch.arange(8.0).view(4, 2) + 10 * r
        assert torch.equal(gh.alltoall(t), hv.alltoall(t))
        splits = torch.tensor([1, 2] if r == 0 else [3, 0], dtype=torch.int32)
        x = torch.arange(3.0 * 2).view(3, 2) + 10 * r
        (a, ra), (b, rb) = gh.alltoall(x, splits=splits), hv.alltoall(x, splits=splits)
        assert torch.equal(a, b) and torch.equal(ra, rb) and ra.dtype == rb.dtype, (a, b, ra, rb)
        a = gh.synchronize(gh.alltoall_async(x, splits=splits))
        assert torch.equal(a[0], b) and torch.equal(a[1], rb)
        for t, kw in (
            (torch.arange(6.0).view(3, 2) * (r + 1), {}),
            (torch.arange(4) * (r + 1), {}),
            (torch.randn(5, 3, generator=torch.Generator().manual_seed(r)), dict(op=hv.Sum, prescale_factor=0.5)),
            (torch.randn(4, generator=torch.Generator().manual_seed(r)), dict(postscale_factor=3.0)),
        ):
            a, b = gh.reducescatter(t, **kw), hv.reducescatter(t, **kw)
            assert torch.equal(a, b), (kw, a, b)
        w = torch.randn(2, 2, generator=torch.Generator().manual_seed(9))
        xs = [torch.randn(4, 2, generator=torch.Generator().manual_seed(r)).requires_grad_() for _ in range(2)]
        (gh.reducescatter(xs[0], op=hv.Sum) * w).sum().backward()
        (hv.reducescatter(xs[1], op=hv.Sum) * w).sum().backward()
        assert torch.equal(xs[0].grad, xs[1].grad)

    @check("objects_join_barrier")
    def _():
        r = hv.rank()
        obj = {"rank": r, "f": (lambda: 3) if r == 0 else None}
        a, b = gh.allgather_object(obj), hv.allgather_object(obj)
        assert [o["rank"] for o in a] == [o["rank"] for o in b] == [0, 1] and a[0]["f"]() == 3
        assert gh.broadcast_object([r, "x"], root_rank=1) == hv.broadcast_object([r, "x"], root_rank=1) == [1, "x"]
        gh.barrier()
        last = gh.join()
        assert last in (0, 1) and isinstance(last, int)
        sp = torch.sparse_coo_tensor(torch.tensor([[r, 3]]), torch.tensor([1.0, 2.0 + r]), (5,))
        a = gh.sparse_allreduce_async(sp, "sp", hv.Average)()
        b = hv.sparse_allreduce_async(sp, "sp", hv.Average)()
        assert torch.equal(a.to_dense(), b.to_dense())

    @check("process_sets")
    def _():
        ps = gh.add_process_set([1])
        assert ps.process_set_id is not None and ps.ranks == [1] and ps.size() == 1
        assert ps.included() == (hv.rank() == 1)
        t = torch.tensor([1.0 + hv.rank()])
        if hv.rank() == 1:
            assert torch.equal(gh.allreduce(t, process_set=ps), t)
        else:
            try:
                gh.allreduce(t, process_set=ps)
                raise RuntimeError("a rank outside the set reduced in it")
            except ValueError:
                pass
        try:
            gh.add_process_set(gh.ProcessSet([1]))
            raise RuntimeError("a duplicate process set was accepted")
        except ValueError:
            pass
        assert gh.remove_process_set(ps) and ps.process_set_id is None
        assert not gh.remove_process_set(gh.global_process_set)
        assert torch.equal(gh.allreduce(t, process_set=gh.global_process_set), hv.allreduce(t))

    @check("build_queries")
    def _():
        names = ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built"]
        names += ["cuda_built", "rocm_built"]
        ours = {n: getattr(gh, n)() for n in names}
        theirs = {n: getattr(hv, n)() for n in names}
        # this Horovod wheel: gloo only, CPU only, no MPI; torch here: CPU only
        assert ours == {k: (bool(v) if k != "nccl_built" else int(v)) for k, v in theirs.items()}, (ours, theirs)
        for lib in (gh, hv):
            try:
                lib.mpi_threads_supported()
                raise RuntimeError("mpi_threads_supported() answered without MPI")
            except ValueError as exc:
                assert "MPI is not enabled" in str(exc)
        gh.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", gh.__file__, "mpi_lib_v2")
        return ours

    @check("timeline")
    def _():
        path = f"{prefix}.timeline.{hv.rank()}.json"
        gh.start_timeline(path)
        gh.allreduce(torch.ones(8))
        gh.stop_timeline()
        with open(path) as f:
            trace = json.load(f)
        assert "traceEvents" in trace
        try:  # Horovod's own needs HOROVOD_TIMELINE=DYNAMIC at init
            hv.start_timeline(path + ".hvd")
            hv.stop_timeline()
        except ValueError as exc:
            assert "HOROVOD_TIMELINE=DYNAMIC" in str(exc)

    @check("sync_batch_norm")
    def _():
        r = hv.rank()
        torch.manual_seed(0)
        bn = gh.SyncBatchNorm(3)
        ref = torch.nn.BatchNorm1d(3)
        xs = [torch.randn(4 + 2 * k, 3, generator=torch.Generator().manual_seed(k)) for k in range(2)]
        x = xs[r].clone().requires_grad_()
        w = torch.randn(6, 3, generator=torch.Generator().manual_seed(3))
        y = bn(x)
        (y * w[: x.shape[0]]).sum().backward()
        full = torch.cat(xs).requires_grad_()
        yf = ref(full)
        ws = torch.cat([w[:4], w[:6]])
        (yf * ws).sum().backward()
        lo = 0 if r == 0 else 4
        assert torch.allclose(y, yf[lo : lo + x.shape[0]], atol=1e-5)
        assert torch.allclose(x.grad, full.grad[lo : lo + x.shape[0]], atol=1e-5)
        assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6)
        assert torch.allclose(bn.running_var, ref.running_var, atol=1e-5)
        gb = torch.stack([bn.weight.grad, bn.bias.grad])
        assert torch.allclose(gh.allreduce(gb, op=hv.Sum), torch.stack([ref.weight.grad, ref.bias.grad]), atol=1e-4)

    @check("adasum")
    def _():
        r = hv.rank()
        a = torch.randn(50, generator=torch.Generator().manual_seed(0))
        b = torch.randn(50, generator=torch.Generator().manual_seed(1))
        mine = (a if r == 0 else b).clone()
        got = gh.allreduce(mine, op=hv.Adasum)
        a64, b64 = a.double(), b.double()
        dot = a64 @ b64
        want = ((1 - dot / (2 * (a64 @ a64))) * a64 + (1 - dot / (2 * (b64 @ b64))) * b64).float()
        assert torch.equal(got, want)
        assert torch.equal(gh.allreduce(a, op=hv.Adasum), a)  # equal vectors: Adasum is their average
        try:  # this Horovod build has no Adasum operation (CPU, gloo, no MPI)
            hv.allreduce(mine, op=hv.Adasum)
            raise RuntimeError("Horovod ran Adasum")
        except hv.HorovodInternalError as exc:
            assert "No Adasum operation enabled" in str(exc)
        p, opt = train(lambda o, m: gh.DistributedOptimizer(o, named_parameters=m.named_parameters(), op=gh.Adasum))
        every = gh.allgather(torch.cat([t.reshape(-1) for t in p])[None])
        assert torch.equal(every[0], every[1]), "Adasum left the replicas different"
        assert type(opt).__name__ == "SGD"

    for name, make, wd in (
        ("broadcast_state_adam_after_wrap", lambda ps: torch.optim.Adam(ps, lr=0.01), 0.0),
        (
            "broadcast_state_sgd_weight_decay",
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
            0.01,
        ),
    ):

        @check(name)
        def _(make=make, wd=wd):
            # Horovod's synthetic/ImageNet examples: wrap, then broadcast the parameters and the
            # (fresh) optimizer state, then train: bit for bit the same as Horovod
            out = []
            for lib in (hv, gh):
                model, xs, ys = model_and_data(1)
                torch.manual_seed(10 + hv.rank())  # replicas that differ before the broadcast
                for q in model.parameters():
                    q.data.add_(torch.randn_like(q) * 0.01)
                opt = lib.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters())
                lib.broadcast_parameters(model.state_dict(), root_rank=0)
                lib.broadcast_optimizer_state(opt, root_rank=0)
                state = {k: sorted(v) for k, v in opt.state_dict()["state"].items()}
                for s in range(3):
                    opt.zero_grad()
                    i = hv.rank() * 8 + s
                    F.cross_entropy(model(xs[i]), ys[i]).backward()
                    opt.step()
                out.append(([q.detach().clone() for q in model.parameters()], state))
            (h, hs), (g, gs) = out
            assert hs == gs, (hs, gs)
            assert equal(h, g), f"parameters differ from horovod.torch's: {sum(float(q.sum()) for q in g)} vs " + str(
                sum(float(q.sum()) for q in h)
            )
            return {"param_sum": sum(float(q.double().sum()) for q in g)}

    @check("wrap_drops_state")
    def _():
        sizes = []
        for lib in (hv, gh):
            model, xs, ys = model_and_data(0)
            plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            F.cross_entropy(model(xs[0]), ys[0]).backward()
            plain.step()  # the plain optimizer now has momentum buffers
            opt = lib.DistributedOptimizer(plain, named_parameters=model.named_parameters())
            sizes.append((len(plain.state), len(opt.state), opt.param_groups[0]["lr"]))
        assert sizes[0] == sizes[1] and sizes[1][1] == 0, sizes

    @check("reinit")
    def _():
        # shutdown() and init() again under horovodrun: a new rendezvous key per init()
        gh.shutdown()
        assert not gh.is_initialized()
        gh.init()
        t = torch.tensor([1.0 + hv.rank()])
        assert gh.size() == 2 and torch.equal(gh.allreduce(t), hv.allreduce(t))

    @check("compression_from_environment")
    def _():
        os.environ["GRADZIP_COMPRESSION"] = "TopK(0.01)"
        try:
            p, opt = train(
                lambda o, m: gh.DistributedOptimizer(
                    o, named_parameters=m.named_parameters(), compression=hv.Compression.none
                )
            )
            s = opt.stats()
            assert repr(opt.engine.method).startswith("TopK("), opt.engine.method
            assert s["ratio"] > 5, s["ratio"]
            _, keep = train(
                lambda o, m: gh.DistributedOptimizer(o, named_parameters=m.named_parameters(), compression="SignSGD()")
            )
            assert keep.stats()["ratio"] < s["ratio"]  # a method the script names is kept
        finally:
            del os.environ["GRADZIP_COMPRESSION"]
        return {"ratio": s["ratio"], "method": repr(opt.engine.method)}

    # -- the Horovod transport: gradzip's protocols on Horovod's collectives ----------------
    for method in ("TopK(0.01)", "SignSGD()", "PowerSGD(rank=1)", "TwoPhase(TopK(0.01))", "Identity()"):

        @check(f"transport {method}")
        def _(method=method):
            runs = {}
            for t in ("torch", "horovod"):
                runs[t] = train(
                    lambda o, m: gh.DistributedOptimizer(
                        o, named_parameters=m.named_parameters(), compression=method, transport=t
                    ),
                    steps=5,
                )
            (pt, ot), (ph, oh) = runs["torch"], runs["horovod"]
            assert type(oh._gz.engine.comm).__name__ == "HorovodCommunicator"
            st, sh = ot.stats(), oh.stats()
            keys = ("bytes_sent", "bytes_link", "bytes_raw", "bytes_allgather", "bytes_control", "collectives")
            assert equal(pt, ph), "parameters differ between the transports"
            assert all(st[k] == sh[k] for k in keys), {k: (st[k], sh[k]) for k in keys}
            assert sh["bytes_sent"] > 0 and sh["collectives"] > 0
            return {k: sh[k] for k in keys}

    @check("transport_bf16_refused")
    def _():
        model, xs, ys = model_and_data(0)
        for method in ("BF16()", "TwoPhase(BF16())"):  # refused at construction
            try:
                gh.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    named_parameters=model.named_parameters(),
                    compression=method,
                    transport="horovod",
                )
                raise RuntimeError(f"{method} accepted on Horovod")
            except ValueError as exc:
                assert "bfloat16" in str(exc)
        from gradzip.comm_horovod import HorovodCommunicator  # and at the collective, whatever sends it

        try:
            HorovodCommunicator().allreduce(torch.ones(4, dtype=torch.bfloat16))
            raise RuntimeError("bfloat16 went through Horovod")
        except TypeError as exc:
            assert "bfloat16" in str(exc)

    @check("init_transport_horovod")
    def _():
        # Horovod alone: no torch.distributed process group behind the optimizer (the first
        # step's parameter check runs on Horovod's collectives too)
        torch.distributed.destroy_process_group()
        gh.init(transport="horovod")
        assert gh.transport() == "horovod" and gh.size() == 2 and gh.rank() == hv.rank()
        t = torch.randn(10, generator=torch.Generator().manual_seed(hv.rank()))
        assert torch.equal(gh.allreduce(t), hv.allreduce(t))
        m = torch.nn.Linear(3, 2)
        gh.broadcast_parameters(m.state_dict(), root_rank=0)
        model, xs, ys = model_and_data(0)
        opt = gh.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression="TopK(0.01)",
        )
        F.cross_entropy(model(xs[hv.rank()]), ys[hv.rank()]).backward()
        opt.step()
        assert type(opt.engine.comm).__name__ == "HorovodCommunicator"
        torch.manual_seed(hv.rank())  # replicas that differ: refused on every rank at the first step
        other = torch.nn.Linear(3, 2)
        opt2 = gh.DistributedOptimizer(
            torch.optim.SGD(other.parameters(), lr=0.1),
            named_parameters=other.named_parameters(),
            compression="TopK(0.5)",
        )
        try:  # the check runs as the first bucket is submitted, inside backward
            other(torch.ones(1, 3)).sum().backward()
            opt2.step()
            raise RuntimeError("differing replicas accepted")
        except ValueError as exc:
            assert "differ across ranks" in str(exc), exc

    @check("transport_horovod_broadcast_state")
    def _():
        # on transport "horovod" (gh.init above), Horovod's synthetic-benchmark pattern: wrap Adam,
        # broadcast parameters and the fresh optimizer state, train. gradzip's broadcast_object
        # used to name its collectives after each rank's own object (bytes on the root, NoneType
        # elsewhere), so Horovod waited for ever; now the same as Horovod's, bit for bit
        assert gh.transport() == "horovod"
        out = []
        for lib in (hv, gh):
            model, xs, ys = model_and_data(2)
            opt = lib.DistributedOptimizer(
                torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
            )
            lib.broadcast_parameters(model.state_dict(), root_rank=0)
            lib.broadcast_optimizer_state(opt, root_rank=0)
            for s in range(3):
                opt.zero_grad()
                F.cross_entropy(model(xs[hv.rank() * 8 + s]), ys[hv.rank() * 8 + s]).backward()
                opt.step()
            out.append([q.detach().clone() for q in model.parameters()])
        assert equal(*out)
        assert gh.broadcast_object({"r": hv.rank()}, root_rank=1) == {"r": 1}

    @check("transport_horovod_collectives")
    def _():
        # on transport "horovod" the functions are horovod.torch's own
        r = hv.rank()
        ts = [torch.randn(5, generator=torch.Generator().manual_seed(r)), torch.arange(4) * (r + 1)]
        assert all(torch.equal(a, b) for a, b in zip(gh.grouped_allreduce(ts), hv.grouped_allreduce(ts)))
        h = gh.allreduce_async(ts[0], op=gh.Sum)
        assert torch.equal(gh.synchronize(h), hv.allreduce(ts[0], op=hv.Sum))
        x = torch.arange(8.0).view(4, 2) + 10 * r
        assert torch.equal(gh.alltoall(x), hv.alltoall(x)) and torch.equal(gh.reducescatter(x), hv.reducescatter(x))
        assert gh.allgather_object(r) == [0, 1] and gh.mpi_ops.is_homogeneous() and gh.gloo_enabled()
        gh.barrier()
        assert gh.join() in (0, 1)

    with open(f"{prefix}.{hv.rank()}.json", "w") as f:
        json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
