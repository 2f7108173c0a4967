"""One front-end contract: every front end derives from ``gradzip.frontend.FrontEnd`` and offers
the same surface (names and signatures), and on 2 gloo ranks each one's ``stats(reset=True)``
intervals, ``routes()``, ``log_every``, ``save``/``load`` and owner check behave alike."""

from __future__ import annotations

import inspect
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradzip.frontend import FrontEnd
from tests.support import batch, make_model, run_ranks, train_steps
from tests.support.models import forget_dtensor_caches

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")

SURFACE = ("stats", "routes", "log_every", "state_dict", "load_state_dict", "save", "load", "check_owner")


def _front_end_classes() -> dict[str, type]:
    from gradzip import horovod
    from gradzip.fsdp import FSDPState
    from gradzip.hooks.ddp import HookState
    from gradzip.local_sgd import DiLoCo, LocalSGD
    from gradzip.onebit import OneBitAdam, ZeroOneAdam
    from gradzip.optim import DistributedOptimizer

    return {
        "ddp": HookState,
        "optim": DistributedOptimizer,
        "local_sgd": LocalSGD,
        "diloco": DiLoCo,
        "fsdp": FSDPState,
        "horovod": horovod._HorovodOptimizer,  # mixed into a subclass of the wrapped optimizer's class
        "onebit": OneBitAdam,
        "zero_one": ZeroOneAdam,
    }


def _same_surface(cls: type) -> list[str]:
    """What differs from the base's surface: each method must take the base's parameters, in
    order, with the same kinds and defaults; a front end may add keyword-only ones with defaults."""
    wrong = []
    for name in SURFACE:
        base = list(inspect.signature(getattr(FrontEnd, name)).parameters.values())
        mine = list(inspect.signature(getattr(cls, name)).parameters.values())
        head = [(p.name, p.kind, p.default) for p in mine[: len(base)]]
        if head != [(p.name, p.kind, p.default) for p in base]:
            wrong.append(f"{name}{inspect.signature(getattr(cls, name))}")
        extra = [p for p in mine[len(base) :] if p.kind is not p.KEYWORD_ONLY or p.default is p.empty]
        if extra:
            wrong.append(f"{name}: extra parameters {[p.name for p in extra]} must be keyword-only with defaults")
    return wrong


@pytest.mark.parametrize("label", list(_front_end_classes()))
def test_every_front_end_offers_the_same_surface(label):
    cls = _front_end_classes()[label]
    assert issubclass(cls, FrontEnd)
    assert _same_surface(cls) == []


def test_the_surface_check_sees_a_different_signature():
    class Odd(FrontEnd):
        def stats(self, which: str = "x") -> dict:  # the former FSDPState.stats
            return {}

        def load(self, directory, strict) -> None:
            pass

    assert len(_same_surface(Odd)) == 2


# -- on 2 gloo ranks ---------------------------------------------------------------------------


def _exercise(fe, train, rebuild, directory: str, rank: int, per_rank: bool = True) -> dict:
    """The contract's behaviour on one front end: ``train(n)`` runs ``n`` steps on it,
    ``rebuild()`` makes a fresh one alike (a collective where building one is)."""
    out: dict = {}
    train(2)
    first = fe.stats(reset=True)
    train(1)
    second = fe.stats(reset=True)
    total = fe.stats()
    out["steps"] = (first["steps"], second["steps"], total["steps"])
    out["link"] = (first["bytes_link"], second["bytes_link"], total["bytes_link"])
    out["ratio"] = total["ratio"]
    rows = fe.routes()
    out["routes"] = sorted({r["name"] for r in rows})
    out["route_keys"] = sorted(set().union(*(r.keys() for r in rows)))
    calls: list = []
    fe.log_every(1, lambda step, s: calls.append((step, s["steps"], s["bytes_link"] > 0)))
    train(2)
    fe.log_every(None)
    train(1)
    out["log"] = calls
    path = fe.save(directory)
    out["saved"] = os.path.exists(path)
    fresh = rebuild()
    fresh.load(directory)
    if per_rank:  # the counts travel with the engine's state (FSDP's holds the step and the pending update)
        out["loaded_stats"] = fresh.stats()["steps"] == fe.stats()["steps"]
        out["loaded_state"] = _equal(_untimed(fresh.state_dict()), _untimed(fe.state_dict()))
        dist.barrier()  # the other rank's file is written
        other = torch.load(
            os.path.join(directory, f"gradzip_rank{1 - rank}_of_2.pt"), weights_only=True, map_location="cpu"
        )
        out["refused"] = [_refusal(lambda: fresh.check_owner(other)), _refusal(lambda: fresh.load_state_dict(other))]
        out["own_passes"] = _refusal(lambda: fresh.check_owner(fe.state_dict()))
    return out


def _refusal(f) -> str | None:
    try:
        f()
    except ValueError as e:
        return str(e)
    return None


#: Wall-clock counters: a collective's time is added when it completes, which may be after the
#: save on a loaded machine (gradzip.stats.log_every's note), so they are compared apart.
TIMES = ("codec_seconds", "codec_cpu_seconds", "comm_seconds")


def _untimed(state):
    """``state`` without the wall-clock counters of its stats (every other entry kept)."""
    if isinstance(state, dict):
        return {k: _untimed(v) for k, v in state.items() if k not in TIMES}
    return state


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _counter(fn):
    """``train(n)``: ``fn(first, n)``, counting the steps already taken."""
    done = [0]

    def train(n: int) -> None:
        fn(done[0], n)
        done[0] += n

    return train


def _ddp(rank, root):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip as gz
    from gradzip.hooks import register_hook

    def build(seed):
        model = DDP(make_model(seed))
        return model, register_hook(model, gz.TopK(0.1)), torch.optim.SGD(model.parameters(), lr=0.1)

    model, state, opt = build(0)
    train = _counter(lambda first, n: train_steps(model, opt, n, rank, first))
    return _exercise(state, train, lambda: build(1)[1], root, rank)


def _optim(rank, root):
    import gradzip as gz

    def build(seed):
        model = make_model(seed)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, gz.DistributedOptimizer(sgd, model.named_parameters(), compression=gz.TopK(0.1))

    model, opt = build(0)
    train = _counter(lambda first, n: train_steps(model, opt, n, rank, first))
    return _exercise(opt, train, lambda: build(1)[1], root, rank)


def _local_sgd(rank, root, diloco):
    import gradzip as gz

    def build(seed):
        model = make_model(seed)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if diloco:
            return model, gz.DiLoCo(sgd, model, period=1, compression=gz.Int8())
        return model, gz.LocalSGD(sgd, model, period=1, compression=gz.TopK(0.1))

    model, opt = build(0)
    train = _counter(lambda first, n: train_steps(model, opt, n, rank, first))
    return _exercise(opt, train, lambda: build(0)[1], root, rank)


def _onebit(rank, root, zero_one):
    import gradzip as gz

    def build(seed):
        model = make_model(seed)
        if zero_one:  # variance frozen after step 1; a 1-bit sync every step (the interval stays 1)
            return model, gz.ZeroOneAdam(model.named_parameters(), lr=0.01, var_freeze_step=1)
        return model, gz.OneBitAdam(model.named_parameters(), lr=0.01, freeze_step=1)

    model, opt = build(0)
    train = _counter(lambda first, n: train_steps(model, opt, n, rank, first))
    return _exercise(opt, train, lambda: build(1)[1], root, rank)


def _horovod(rank, root):
    import gradzip as gz
    import gradzip.horovod as hvd

    def build(seed):
        model = make_model(seed)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(sgd, model.named_parameters(), compression=gz.TopK(0.1), transport="torch")
        return model, opt

    model, opt = build(0)
    train = _counter(lambda first, n: train_steps(model, opt, n, rank, first))
    out = _exercise(opt, train, lambda: build(1)[1], root, rank)
    out["is_front_end"] = isinstance(opt, FrontEnd) and isinstance(opt, torch.optim.SGD)
    out["surface"] = _same_surface(type(opt))
    return out


def _fsdp(rank, root, hsdp):
    """FSDP2 on CPU: the MLP sharded over both ranks; with ``hsdp`` on a 1 x 2 mesh whose
    replica dimension gradzip's second engine averages over (one rank: no link bytes), so that
    two engines report together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradzip as gz

    def build(seed):
        forget_dtensor_caches()  # a pooled rank: no mesh of an earlier process group
        model = make_model(seed)
        if hsdp:
            mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
            fmesh, rep = mesh["shard"], mesh["replicate"]
        else:
            fmesh, rep = init_device_mesh("cpu", (2,)), None
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=fmesh)
        fully_shard(model, mesh=fmesh)
        state = gz.fsdp.compress(model, gz.Int8(), replicate=gz.TopK(0.2) if hsdp else None, replicate_group=rep)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1)

    model, state, opt = build(0)

    def steps(first, n):
        for s in range(first, first + n):
            x, y = batch(s, rank)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    fresh = []
    out = _exercise(state, _counter(steps), lambda: fresh.append(build(1)) or fresh[-1][1], root, rank, per_rank=False)
    pending, again = _pending(state), _pending(fresh[-1][1])
    out["loaded_state"] = _equal(pending, again) and fresh[-1][1].step == state.step
    out["pending_mass"] = sum(float(v.abs().sum()) for v in pending.values())
    out["collectives"] = sorted({r.get("collective") for r in state.routes()})
    if hsdp:
        one = {w: state.stats(which=w) for w in ("reduce_scatter", "replicate")}
        both = state.stats()
        out["one"] = {w: s["steps"] for w, s in one.items()}
        out["one_link"] = {w: s["bytes_link"] for w, s in one.items()}
        out["sums"] = all(
            both[k] == pytest.approx(sum(s[k] for s in one.values()))
            for k in ("bytes_raw", "bytes_link", "bytes_link_raw", "collectives")
        )
        out["former_spelling"] = state.stats("replicate") == state.stats(which="replicate")
    return out


def _pending(state) -> dict:
    """The pending updates of an ``FSDPState`` (its DTensor entries), gathered whole (a collective)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() for k, v in state.state_dict().items() if isinstance(v, DTensor)}


def _all(rank, world, root):
    return {
        "ddp": _ddp(rank, os.path.join(root, "ddp")),
        "optim": _optim(rank, os.path.join(root, "optim")),
        "local_sgd": _local_sgd(rank, os.path.join(root, "local_sgd"), diloco=False),
        "diloco": _local_sgd(rank, os.path.join(root, "diloco"), diloco=True),
        "horovod": _horovod(rank, os.path.join(root, "horovod")),
        "onebit": _onebit(rank, os.path.join(root, "onebit"), zero_one=False),
        "zero_one": _onebit(rank, os.path.join(root, "zero_one"), zero_one=True),
        "fsdp": _fsdp(rank, os.path.join(root, "fsdp"), hsdp=False),
        "hsdp": _fsdp(rank, os.path.join(root, "hsdp"), hsdp=True),
    }


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        yield run_ranks(_all, 2, root)


FRONT_ENDS = ["ddp", "optim", "local_sgd", "diloco", "horovod", "onebit", "zero_one", "fsdp", "hsdp"]


@pytest.mark.parametrize("label", FRONT_ENDS)
def test_stats_reset_gives_intervals_and_leaves_the_totals(results, label):
    r = results[0][label]
    assert r["steps"] == (2, 1, 3)
    first, second, total = r["link"]
    assert first > 0 and second > 0 and first + second == pytest.approx(total)
    assert r["ratio"] > 1


@pytest.mark.parametrize("label", FRONT_ENDS)
def test_routes_name_every_tensor_with_its_method(results, label):
    r = results[0][label]
    names = {f"{i}.{w}" for i in (0, 2, 4, 6) for w in ("weight", "bias")}
    prefix = "module." if label == "ddp" else ""
    assert set(r["routes"]) == {prefix + n for n in names} or set(r["routes"]) == names
    assert {"name", "method", "protocol", "reason", "numel", "bytes_raw"} <= set(r["route_keys"])


@pytest.mark.parametrize("label", FRONT_ENDS)
def test_log_every_calls_once_a_step_with_that_steps_counts_until_stopped(results, label):
    assert results[0][label]["log"] == [(4, 1, True), (5, 1, True)]


@pytest.mark.parametrize("label", FRONT_ENDS)
def test_save_and_load_restore_the_state(results, label):
    for r in (results[0][label], results[1][label]):
        assert r["saved"] and r["loaded_state"]
        assert r["loaded_stats"] if label not in ("fsdp", "hsdp") else "loaded_stats" not in r


@pytest.mark.parametrize("label", ["ddp", "optim", "local_sgd", "diloco", "horovod", "onebit", "zero_one"])
def test_another_ranks_state_is_refused(results, label):
    for rank, res in enumerate(results):
        r = res[label]
        assert r["own_passes"] is None
        for msg in r["refused"]:
            assert msg is not None and f"saved by rank {1 - rank}" in msg and f"this is rank {rank}" in msg, msg


def test_the_horovod_optimizer_is_a_front_end_of_the_wrapped_class(results):
    assert results[0]["horovod"]["is_front_end"] and results[0]["horovod"]["surface"] == []


def test_fsdp_reports_its_engines_together_and_one_by_one(results):
    r = results[0]
    assert r["fsdp"]["collectives"] == ["reduce_scatter"]
    assert r["fsdp"]["pending_mass"] > 0  # Int8's error feedback owes an update: load restored it
    h = r["hsdp"]
    assert h["collectives"] == ["reduce_scatter", "replicate"]
    assert h["one"] == {"reduce_scatter": 6, "replicate": 6}  # each engine counts every backward
    assert h["former_spelling"]
