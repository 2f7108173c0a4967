"""Host syncs, launches and ATen operations per bucket, counted through ``Engine.reduce``.

    GRADZIP_KERNELS=triton TRITON_INTERPRET=1 python -m benchmarks.host_syncs --gpu-branches \\
        --json benchmarks/results/host_syncs_cpu.json

A CUDA step is launch-bound when the host stops: every read of a device value (``item()``,
``bool()``, ``tolist()``, ``cpu()``, ``numpy()``) and every operation whose output size
depends on the data (``nonzero``, ``masked_select``, boolean indexing) waits for the device
to drain its queue. :class:`SyncSentinel` flags each of these on any device, so a CPU run
counts the syncs a GPU run would pay, and names where each one was called from.

The count covers the whole engine, not a dry run of the protocol alone: an
:class:`~gradzip.engine.Engine` runs each method against :class:`EngineLoopback` (a
communicator with ``world`` ranks that all send what this rank sends, nothing leaving the
process), over ResNet-50's gradients cut into DDP's buckets (each bucket one flat buffer, the
gradients its views and the result written back into it, as DDP hands them to the hook).
Steps 0 and 1 warm up (the configuration check, the first residuals); step 2 is counted. Per
bucket: ``host_syncs`` (the sentinel's events), ``launches`` (Triton kernel launches; under
``TRITON_INTERPRET=1`` each interpreted launch, whose own ATen operations are not counted)
and ``aten_ops`` (the operations that reach torch's dispatcher outside a launch; on a GPU each
that computes anything is a launch). A collective counts as one operation, as the one c10d
operation it is on a device; the loopback's copies that stand in for the peers count as none.

``--gpu-branches`` takes the GPU's side of the device-type branches on the CPU
(:func:`gradzip.kernels.gpu_side_on_cpu`). ``--sweep`` also counts synthetic buckets of
T = 2, 15 and 81 tensors at W = 4, 8 and 16, to show whether a bucket's count grows with its
tensors or its world.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradzip.kernels as K
from gradzip.comm import Communicator
from gradzip.costmodel.dryrun import LoopbackComm

METHODS = "Flat(Int8());Flat(SignSGD());PowerSGD(rank=4);Flat(TopK(0.01, mode='exact'))"

_aten = torch.ops.aten
#: Operations whose output size depends on the data, or that read a value to the host.
SYNC_OPS = {
    _aten._local_scalar_dense.default: "item/bool",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
}
_INDEX_OPS = (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default)
#: Tensor methods that hand a device tensor's values to the host.
SYNC_METHODS = ("cpu", "tolist", "numpy", "item")
#: Functions that build a tensor from host data: their results live on the host.
HOST_BUILDERS = ("tensor", "frombuffer", "from_numpy", "as_tensor")


class HostSync(RuntimeError):
    """Raised by :class:`SyncSentinel` with ``error=True`` at the first host sync."""


def _site() -> str:
    """The innermost gradzip or kernels frame of the current stack, as ``path:line (function)``."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        path = fr.filename.replace(os.sep, "/")
        if "/benchmarks/host_syncs.py" in path:
            continue
        for root in ("/gradzip/", "/kernels/", "/hooks/"):
            if root in path:
                return f"{root.strip('/')}/{path.split(root, 1)[1]}:{fr.lineno} ({fr.name})"
    return "<outside gradzip>"


def _tensors(tree) -> list:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class SyncSentinel(TorchDispatchMode):
    """Flags every operation that would stop the host on a GPU (module docstring), on any device.

    On the CPU every tensor is on the host, so the sentinel tells the two apart as a GPU run
    would place them: a tensor built from host data (``torch.tensor``, ``frombuffer``, ...) or
    copied by ``cpu()`` is a host tensor, and so is what an operation computes from host tensors
    alone; :func:`gradzip.kernels.host_to_device` makes a device tensor of one. Reading a host
    tensor is free; reading any other one is a sync.

    ``events``: one ``(kind, site)`` per flagged call; ``launches`` and ``ops``: Triton launches
    and the ATen operations outside them. ``error=True`` raises :class:`HostSync` at the first
    event instead (as ``torch.cuda.set_sync_debug_mode("error")`` does on a device).
    """

    def __init__(self, error: bool = False) -> None:
        super().__init__()
        self.error = error
        self.events: list[tuple[str, str]] = []
        self.ops = 0
        self.launches = 0
        self._in_launch = 0
        self._in_method = 0
        self._host: dict[int, weakref.ref] = {}
        self._undo: list = []

    # -- host tensors ----------------------------------------------------------------------
    def _mark(self, t) -> None:
        for x in _tensors(t):
            self._host[id(x)] = weakref.ref(x)

    def is_host(self, t: torch.Tensor) -> bool:
        r = self._host.get(id(t))
        return r is not None and r() is t

    def _flag(self, kind: str) -> None:
        site = _site()
        self.events.append((kind, site))
        if self.error:
            raise HostSync(f"host sync ({kind}) at {site}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._in_launch:
            return out
        self.ops += 1
        ins = _tensors((args, kwargs))
        host = bool(ins) and all(self.is_host(t) for t in ins)
        if host:
            self._mark(out)
        elif not self._in_method:
            kind = SYNC_OPS.get(func)
            if kind is None and func in _INDEX_OPS:
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
                    kind = "boolean index"
            if kind is not None:
                self._flag(kind)
        return out

    # -- patches -----------------------------------------------------------------------------
    def _patch(self, owner, name: str, new) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _reader(self, name: str):
        orig = getattr(torch.Tensor, name)
        sentinel = self

        def read(t, *a, **kw):
            if not sentinel._in_launch and not sentinel._in_method and not sentinel.is_host(t):
                sentinel._flag(name)
            sentinel._in_method += 1
            try:
                out = orig(t, *a, **kw)
            finally:
                sentinel._in_method -= 1
            if name == "cpu":
                if out is t:  # the CPU's cpu() is the tensor itself: on a GPU a copy on the host
                    sentinel._in_method += 1
                    try:
                        out = t.clone()
                    finally:
                        sentinel._in_method -= 1
                sentinel._mark(out)
            return out

        return read

    def _builder(self, orig):
        def build(*a, **kw):
            out = orig(*a, **kw)
            self._mark(out)
            return out

        return build

    def _upload(self, orig):
        def upload(t, device):
            out = orig(t, device)
            if out is t:  # the CPU's host_to_device is the tensor itself: on a GPU a copy
                out = t.view(t.shape)
            self._host.pop(id(out), None)
            return out

        return upload

    def _launches(self, run):
        sentinel = self

        def counted(fn, *a, **kw):
            sentinel.launches += 1
            sentinel._in_launch += 1
            try:
                return run(fn, *a, **kw)
            finally:
                sentinel._in_launch -= 1

        return counted

    @contextlib.contextmanager
    def collective(self, issue: bool):
        """A collective of :class:`EngineLoopback`: one operation where it is issued
        (``issue``; on a device, one c10d operation that the communication library runs),
        none for the loopback's copies that stand in for the peers' data."""
        self.ops += 1 if issue else 0
        self._in_launch += 1
        try:
            yield
        finally:
            self._in_launch -= 1

    def __enter__(self):
        _ACTIVE.append(self)
        for name in SYNC_METHODS:
            self._patch(torch.Tensor, name, self._reader(name))
        for name in HOST_BUILDERS:
            self._patch(torch, name, self._builder(getattr(torch, name)))
        from gradzip.kernels import dispatch

        orig = dispatch.host_to_device
        upload = self._upload(orig)
        for mod in list(sys.modules.values()):  # every module that imported it by name
            if mod is not None and vars(mod).get("host_to_device") is orig:
                self._patch(mod, "host_to_device", upload)
        if os.environ.get("TRITON_INTERPRET") == "1":
            from triton.runtime.interpreter import InterpretedFunction

            self._patch(InterpretedFunction, "run", self._launches(InterpretedFunction.run))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, orig in reversed(self._undo):
                setattr(owner, name, orig)
            self._undo = []
            _ACTIVE.remove(self)


#: The sentinels open now (innermost last): :class:`EngineLoopback` books its collectives there.
_ACTIVE: list[SyncSentinel] = []


def _collective(issue: bool = True):
    return _ACTIVE[-1].collective(issue) if _ACTIVE else contextlib.nullcontext()


class EngineLoopback(Communicator):
    """A :class:`~gradzip.comm.Communicator` for an engine in one process: ``world_size`` ranks
    that all send what this rank sends (:class:`~gradzip.costmodel.LoopbackComm` does the
    collectives and counts their bytes); each round's results are filled in before the
    protocol resumes, as a finished collective's would be."""

    def __init__(self, world_size: int) -> None:  # no process group: nothing to initialise
        self.loop = LoopbackComm(world_size)
        self.group, self.world_size, self.rank = None, world_size, 0
        self._start(self.loop.stats, defer=False)

    def split(self, local_size: int):
        raise NotImplementedError("EngineLoopback counts flat protocols; Hierarchical needs two")

    def allreduce(self, t, op=torch.distributed.ReduceOp.SUM, *, control: bool = False):
        with _collective():
            return self.loop.allreduce(t, op, control=control)

    def allgather(self, out, inp, *, control: bool = False):
        with _collective():
            return self.loop.allgather(out, inp, control=control)

    def alltoall(self, out, inp, out_splits=None, in_splits=None, *, control: bool = False):
        with _collective():
            return self.loop.alltoall(out, inp, out_splits, in_splits, control=control)

    def _advance(self, job) -> None:
        with _collective(issue=False):
            self.loop.complete()
        super()._advance(job)

    def _finish_when_done(self, job) -> None:
        with _collective(issue=False):
            self.loop.complete()
        super()._finish_when_done(job)


def buckets_of(grads: list, one: bool = False) -> list:
    """DDP's buckets of ``grads`` (``one``: a single bucket of them all), each one flat buffer
    with the gradients' values and their views."""
    from gradzip.costmodel import ddp_buckets

    out = []
    cut = [list(range(len(grads)))] if one else ddp_buckets([t.numel() * t.element_size() for t in grads])
    for b in cut:
        flat = torch.cat([grads[i].reshape(-1) for i in b])
        views, pos = [], 0
        for i in b:
            views.append(flat[pos : pos + grads[i].numel()].view(grads[i].shape))
            pos += grads[i].numel()
        out.append((b, flat, views))
    return out


def _reduce(engine, names, views, flat) -> None:
    """One bucket through the engine to its result: submitted, its later rounds issued, waited for."""
    fut = engine.reduce(names, views, dest=flat)
    engine.flush()
    fut.wait()


def count(spec: str, grads: list, names: list, world: int, counted_step: int = 2, one: bool = False) -> list[dict]:
    """Per bucket of step ``counted_step`` of an engine running ``spec`` on ``world`` loopback
    ranks: ``{"tensors", "host_syncs", "sites", "launches", "aten_ops"}``. ``one``: all the
    gradients in one bucket."""
    import gradzip as gz
    from gradzip.engine import Engine

    engine = Engine(gz.parse(spec), process_group=EngineLoopback(world))
    layout = buckets_of(grads, one)
    pristine = [flat.clone() for _, flat, _ in layout]
    rows = []
    for step in range(counted_step + 1):
        for (_, flat, _), p in zip(layout, pristine):
            flat.copy_(p)
        for b, flat, views in layout:
            bnames = [names[i] for i in b]
            if step < counted_step:
                _reduce(engine, bnames, views, flat)
                continue
            with SyncSentinel() as s:
                _reduce(engine, bnames, views, flat)
            rows.append(
                {
                    "tensors": len(b),
                    "host_syncs": len(s.events),
                    "sites": dict(Counter(f"{k} at {site}" for k, site in s.events)),
                    "launches": s.launches,
                    "aten_ops": s.ops,
                }
            )
        engine.end_step()
    return rows


def synthetic(tensors: int, seed: int = 0) -> tuple[list, list]:
    """``tensors`` gradients of awkward sizes: matrices of 256 to 4,374 rows of 16 (PowerSGD
    compresses them; a vector it would send as it is)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(256, 4375, (tensors,), generator=g)
    return [torch.randn(int(n), 16, generator=g) for n in rows], [f"t{i}" for i in range(tensors)]


def resnet50() -> tuple[list, list]:
    from benchmarks.gpu_step import ResNet

    named = list(ResNet().named_parameters())
    g = torch.Generator().manual_seed(0)
    return [torch.randn(p.shape, generator=g) for _, p in named], [n for n, _ in named]


def summary(rows: list[dict]) -> dict:
    keys = ("host_syncs", "launches", "aten_ops")
    out = {f"max_{k}": max(r[k] for r in rows) for k in keys}
    out.update({f"min_{k}": min(r[k] for r in rows) for k in keys})
    sites = Counter()
    for r in rows:
        sites.update(r["sites"])
    out["sites"] = dict(sites.most_common())
    out["buckets"] = len(rows)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default=METHODS, help=f"';'-separated specs (default {METHODS!r})")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "synthetic"])
    ap.add_argument("--sweep", action="store_true", help="also T = 2, 15, 81 tensors at W = 4, 8, 16")
    ap.add_argument("--gpu-branches", action="store_true", help="the GPU's side of the device-type branches")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    with K.gpu_side_on_cpu() if args.gpu_branches else contextlib.nullcontext():
        return _run(args, argv)


def _run(args, argv) -> int:
    torch.set_num_threads(1)
    grads, names = resnet50() if args.model == "resnet50" else synthetic(81)
    specs = [s.strip() for s in args.methods.split(";") if s.strip()]
    doc: dict = {}
    for spec in specs:
        rows = count(spec, grads, names, args.world)
        doc[spec] = {"model": summary(rows), "per_bucket": rows}
        s = doc[spec]["model"]
        print(
            f"{spec:36s} {s['buckets']:3d} buckets: host syncs {s['min_host_syncs']}-{s['max_host_syncs']}, "
            f"launches {s['min_launches']}-{s['max_launches']}, ATen ops {s['min_aten_ops']}-{s['max_aten_ops']}",
            flush=True,
        )
        for site, n in s["sites"].items():
            print(f"    {n:4d}  {site}", flush=True)
        if args.sweep:
            doc[spec]["sweep"] = {}
            for t in (2, 15, 81):
                sg, sn = synthetic(t)
                for w in (4, 8, 16):
                    (row,) = count(spec, sg, sn, w, one=True)
                    doc[spec]["sweep"][f"T={t},W={w}"] = {k: row[k] for k in ("host_syncs", "launches", "aten_ops")}
                    print(f"    T={t:2d} W={w:2d}: {doc[spec]['sweep'][f'T={t},W={w}']}", flush=True)
    if args.json:
        from benchmarks._common import write_result
        from gradzip.machine import machine

        write_result(
            args.json,
            {
                "benchmark": "benchmarks/host_syncs.py",
                "argv": list(argv if argv is not None else sys.argv[1:]),
                "machine": machine(),
                "torch": torch.__version__,
                "kernels": os.environ.get("GRADZIP_KERNELS", "auto"),
                "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
                "gpu_branches": args.gpu_branches,
                "world": args.world,
                "model": args.model,
                "methods": doc,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
