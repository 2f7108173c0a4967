"""``horovod.torch.mpi_ops`` on torch.distributed: init, the process layout, process sets, and
every collective, blocking and asynchronous (a handle for :func:`poll` and :func:`synchronize`).

On transport ``"torch"`` (the default) each collective is a ``torch.distributed`` call on the
process set's group; on ``"horovod"`` it is ``horovod.torch``'s own (the handles are then
Horovod's). Results follow Horovod 0.28.1: ``prescale_factor`` scales each rank's input,
``postscale_factor`` (and ``1 / size`` for ``Average``) the sum; an integer tensor is scaled in
double precision and cast back, truncating towards zero as Horovod's C++ does (``[2, 5]`` and
``[3, 5]`` average to ``[2, 5]``). ``reducescatter`` gives the first ``n % size`` ranks one row
more, as Horovod. ``Adasum`` runs :func:`adasum_` (Maleki et al.) on power-of-two worlds.

Every collective is first agreed on by the set's ranks (:func:`_agree`: one allreduce(MAX) of a
62-bit hash of its kind, dtypes, shapes, op, root and scales and its negation, the same small
collective whatever the kind); on a mismatch every rank raises ``HorovodInternalError`` naming
the field, as Horovod's coordinator does, before any data moves.
"""

from __future__ import annotations

import atexit
import io
import itertools
import json
import os
import pickle
import socket
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

import gradzip.args as args
from gradzip.comm import track
from gradzip.sync import differ_across_ranks, value_hash

from .compression import Compression

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "transport",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "adasum_",
    "join",
    "barrier",
    "poll",
    "synchronize",
    "start_timeline",
    "stop_timeline",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
]

# Horovod's reduce-op constants (the same integers as horovod.torch.mpi_ops).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
TRANSPORTS = ("torch", "horovod")
_RDZV_TIMEOUT_S = 300.0


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer left, the connection broke): Horovod's exception, which
    ``hvd.elastic.run`` answers by restoring the last committed state."""


_state: dict = {
    "transport": None,
    "local_rank": 0,
    "local_size": 1,
    "cross_rank": 0,
    "cross_size": 1,
    "inits": 0,  # init() calls in this process: the same sequence on every rank
}


# -- init and the process layout --------------------------------------------------------
def _env_int(*names: str) -> int | None:
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    return None


def horovod():
    """``horovod.torch``, initialised (under horovodrun); ImportError with the reason otherwise."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ImportError(f"transport='horovod' needs Horovod (horovod.torch): {exc}") from exc
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def _kv(url: str, value: str | None = None) -> str | None:
    """GET (``value`` None; None while the key is missing) or PUT a key of horovodrun's rendezvous server."""
    req = urllib.request.Request(
        url, data=None if value is None else value.encode(), method="GET" if value is None else "PUT"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and value is None:
            return None
        raise


def _init_from_horovodrun(rank_: int, world: int, backend: str, generation: int) -> None:
    """torch.distributed from horovodrun's environment: rank 0 starts a TCPStore on a free port and
    publishes ``host:port`` on horovodrun's rendezvous server under a key of this ``init()``'s own
    (``gradzip/store.<generation>``: after ``shutdown(); init()`` the others never read the old
    store's address), the others read it."""
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        raise RuntimeError(
            "HOROVOD_RANK is set but HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT are not: run with `horovodrun --gloo`"
        )
    if os.environ.get("HOROVOD_GLOO_IFACE") and not os.environ.get("GLOO_SOCKET_IFACE"):
        os.environ["GLOO_SOCKET_IFACE"] = os.environ["HOROVOD_GLOO_IFACE"]
    url = f"http://{addr}:{port}/gradzip/store.{generation}"
    timeout = timedelta(seconds=_RDZV_TIMEOUT_S)
    if rank_ == 0:
        host = socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        _kv(url, f"{host}:{store.port}")
    else:
        deadline = time.monotonic() + _RDZV_TIMEOUT_S
        while (where := _kv(url)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not publish its store at {url} within {_RDZV_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        host, _, p = where.rpartition(":")
        store = dist.TCPStore(host, int(p), world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)


def _init_from_torchrun(backend: str) -> None:
    """torch.distributed from torchrun's environment. Under its elastic agent the store is the
    agent's, and every attempt (``TORCHELASTIC_RESTART_COUNT``) gets keys of its own
    (``gradzip/attempt_<n>/``): with ``env://`` alone, the workers of a restart on torch 2.13
    read the gloo addresses of the attempt before and fail to connect (``Gloo connectFullMesh
    failed ... Connection refused``)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        dist.init_process_group(backend, init_method="env://")
        return
    world, rank_ = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    timeout = timedelta(seconds=_RDZV_TIMEOUT_S)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"gradzip/attempt_{attempt}/init_{_state['inits']}", store)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)


def init(comm=None, process_sets=None, *, transport: str | None = None) -> None:
    """Join the job (Horovod's ``init``). ``comm`` (an MPI communicator) is refused: gradzip has
    no MPI. ``process_sets``: a list of :class:`ProcessSet` (or rank lists) to register now, on
    every rank, as Horovod's ``init(process_sets=...)``; the string ``"dynamic"`` is accepted too
    (process sets may be added later either way).

    ``transport``: ``"torch"`` (default; ``GRADZIP_HOROVOD_TRANSPORT`` overrides the default)
    or ``"horovod"`` (the package docstring). Under torchrun, horovodrun, or with torch.distributed
    already initialised, every process learns the real world size; a launcher environment that
    is neither (``mpirun``: ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE`` > 1) raises rather than
    silently making each process a world of one.
    """
    if comm is not None:
        raise ValueError("gradzip.horovod.init() takes no MPI communicator: gradzip runs on torch.distributed")
    transport = transport or os.environ.get("GRADZIP_HOROVOD_TRANSPORT") or "torch"
    args.choice("transport", transport, TRANSPORTS)
    generation = _state["inits"]
    _state["inits"] += 1
    if generation == 0:
        # As Horovod's init does: leave the job at exit, so the process group is destroyed
        # before the interpreter tears its threads down (and a later init()'s group with it).
        atexit.register(_shutdown_at_exit)
    if transport == "horovod":
        hvd = horovod()
        _state.update(
            transport="horovod",
            local_rank=hvd.local_rank(),
            local_size=hvd.local_size(),
            cross_rank=hvd.cross_rank(),
            cross_size=hvd.cross_size(),
        )
    else:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            if _env_int("RANK") is not None and _env_int("WORLD_SIZE") is not None:  # torchrun
                _init_from_torchrun(backend)
            elif _env_int("HOROVOD_RANK") is not None:  # horovodrun --gloo
                _init_from_horovodrun(_env_int("HOROVOD_RANK"), _env_int("HOROVOD_SIZE"), backend, generation)
            elif (_env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") or 1) > 1:
                raise RuntimeError(
                    "launched by mpirun: gradzip.horovod.init() reads torchrun's or horovodrun --gloo's environment; "
                    "use one of them, or initialise torch.distributed yourself before init()"
                )
            else:  # a plain `python train.py`: a world of one, as Horovod gives
                store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
                dist.init_process_group(backend, store=store, rank=0, world_size=1)
        world = dist.get_world_size()
        lsize = _env_int("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE") or (1 if world == 1 else None)
        lrank = _env_int("LOCAL_RANK", "HOROVOD_LOCAL_RANK")
        if lsize is None or lrank is None:  # torch.distributed set up by hand: assume one node
            lsize, lrank = world, dist.get_rank()
        _state.update(
            transport="torch",
            local_rank=lrank,
            local_size=lsize,
            cross_rank=dist.get_rank() // lsize,
            cross_size=max(1, world // lsize),
        )
    global_process_set.ranks = list(range(size()))
    if process_sets is not None and process_sets != "dynamic":
        for ps in process_sets:
            add_process_set(ps)


def _require() -> str:
    if _state["transport"] is None:
        raise ValueError("gradzip.horovod has not been initialized; use gradzip.horovod.init()")
    return _state["transport"]


def transport() -> str:
    """``"torch"`` or ``"horovod"``: what ``init()`` chose."""
    return _require()


def is_initialized() -> bool:
    return _state["transport"] is not None


def shutdown() -> None:
    """Leave the job: destroys the process sets' groups and the process group (transport
    ``torch``) or shuts Horovod down. ``init()`` may follow (a new rendezvous)."""
    t = _state["transport"]
    _state["transport"] = None
    for ps in list(_process_sets.values()):
        ps._invalidate()
    _process_sets.clear()
    _handles.clear()
    if t == "horovod":
        horovod().shutdown()
    elif t == "torch" and dist.is_initialized():
        dist.destroy_process_group()


def _shutdown_at_exit() -> None:
    if _state["transport"] is not None:
        shutdown()


def size() -> int:
    return horovod().size() if _require() == "horovod" else dist.get_world_size()


def rank() -> int:
    return horovod().rank() if _require() == "horovod" else dist.get_rank()


def local_rank() -> int:
    _require()
    return _state["local_rank"]


def local_size() -> int:
    _require()
    return _state["local_size"]


def cross_rank() -> int:
    _require()
    return _state["cross_rank"]


def cross_size() -> int:
    _require()
    return _state["cross_size"]


def is_homogeneous() -> bool:
    """Every node runs the same number of ranks (one ``local_size`` everywhere)."""
    if _require() == "horovod":
        horovod()
        import horovod.torch.mpi_ops as hmo

        return bool(hmo.is_homogeneous())
    sizes = [None] * size()
    dist.all_gather_object(sizes, local_size())
    return len(set(sizes)) == 1


# -- build queries: what this build (gradzip on torch.distributed) has ------------------------
def mpi_built() -> bool:
    """False: gradzip runs on torch.distributed, never on MPI."""
    return False


def mpi_enabled() -> bool:
    """False: no MPI at run time either."""
    return False


def mpi_threads_supported() -> bool:
    """Raises, as Horovod does when MPI is not enabled."""
    raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and enabled.")


def gloo_built() -> bool:
    """torch.distributed's gloo backend is available."""
    return bool(dist.is_gloo_available())


def gloo_enabled() -> bool:
    """The job's collectives run on gloo (CPU tensors on transport ``torch``; Horovod's own answer
    on transport ``horovod``)."""
    if _state["transport"] == "horovod":
        return bool(horovod().gloo_enabled())
    if not dist.is_initialized():
        return False
    return "gloo" in str(dist.get_backend())


def nccl_built() -> int:
    """NCCL's version code (``major * 10000 + minor * 100 + patch``, as Horovod reports it) when
    torch.distributed has NCCL, else 0."""
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    v = torch.cuda.nccl.version()
    return v[0] * 10000 + v[1] * 100 + v[2] if isinstance(v, tuple) else int(v)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """This torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """This torch was built with ROCm."""
    return torch.version.hip is not None


# -- timeline: torch profiler traces ------------------------------------------------------------
_timeline: dict = {}


def start_timeline(file_path, mark_cycles=False) -> None:
    """Start recording a trace of this process (``torch.profiler``, CPU and, where present, CUDA
    activity; every collective appears as a ``gradzip.horovod.<op>`` range); :func:`stop_timeline`
    writes it to ``file_path`` as a Chrome trace (the format of Horovod's timeline, other
    contents). ``mark_cycles`` has no meaning here (no Horovod cycles) and is ignored."""
    _require()
    if _timeline:
        raise ValueError("a timeline is already being recorded; call stop_timeline() first")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    _timeline.update(prof=prof, path=str(file_path))


def stop_timeline() -> None:
    """Stop the trace :func:`start_timeline` began and write it (no-op when none is running)."""
    if not _timeline:
        return
    prof, path = _timeline.pop("prof"), _timeline.pop("path")
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(path)


# -- process sets ----------------------------------------------------------------------------
class ProcessSet:
    """A set of ranks that run collectives together (a torch.distributed group underneath).

    Made from a list of global ranks; registered on every rank by ``init(process_sets=...)`` or
    :func:`add_process_set` (also on ranks outside it, as torch's ``new_group`` needs). Roots of
    broadcasts stay global ranks, as in Horovod."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of process ranks (gradzip has no MPI communicators)") from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = ranks
        self._group = None

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._group = None

    def size(self) -> int | None:
        """The number of ranks, or None before it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (None when not registered); ValueError where this
        process is not in the set, as Horovod's."""
        if self.process_set_id is None:
            return None
        if rank() not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(rank())

    def included(self) -> bool | None:
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """All ranks (id 0); its group is torch.distributed's default group."""

    def __init__(self) -> None:
        self.ranks = []
        self._group = None
        self.process_set_id = 0

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def _invalidate(self) -> None:  # never
        pass


global_process_set = _GlobalProcessSet()
_process_sets: dict[int, ProcessSet] = {}
_ids = itertools.count(1)


def add_process_set(process_set) -> ProcessSet:
    """Register ``process_set`` (a :class:`ProcessSet` or a list of ranks) on every rank and
    return it; a second set with the same ranks raises ``ValueError``, as in Horovod."""
    t = _require()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if any(ps.ranks == process_set.ranks for ps in _process_sets.values()) or process_set.ranks == list(range(size())):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    if any(r < 0 or r >= size() for r in process_set.ranks):
        raise ValueError(f"process set ranks {process_set.ranks} are outside the world of {size()} ranks")
    if t == "horovod":
        raise NotImplementedError(
            "process sets on transport='horovod' are Horovod's own: register them with horovod.torch "
            "(HOROVOD_DYNAMIC_PROCESS_SETS=1); gradzip.horovod's process sets run on torch.distributed"
        )
    process_set._group = dist.new_group(process_set.ranks)
    process_set.process_set_id = next(_ids)
    _process_sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank); False for the global set or an unregistered one."""
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in _process_sets:
        return False
    group = process_set._group
    del _process_sets[pid]
    process_set._invalidate()
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)
    return True


def _group(process_set):
    """The torch group of ``process_set`` (None: the default group); ValueError where this rank
    is not in it or it is not registered."""
    if process_set is None or process_set is global_process_set:
        return None
    if type(process_set).__module__.startswith("horovod.") and getattr(process_set, "process_set_id", None) == 0:
        return None  # horovod.torch.global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a gradzip.horovod.ProcessSet, got {process_set!r}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: use add_process_set() or init(process_sets=...)")
    if not process_set.included():
        raise ValueError(f"rank {rank()} is not part of {process_set}")
    return process_set._group


def _set_size(process_set) -> int:
    g = _group(process_set)
    return dist.get_world_size(g) if g is not None else size()


def _set_rank(process_set) -> int:
    g = _group(process_set)
    return dist.get_rank(g) if g is not None else rank()


def _to_horovod_set(process_set):
    if process_set is None or process_set is global_process_set:
        return horovod().global_process_set
    if type(process_set).__module__.startswith("horovod."):
        return process_set
    raise ValueError("on transport='horovod' pass Horovod's own process sets")


# -- the ranks agree on each collective ------------------------------------------------------
#: What differs between two ranks' descriptions, by field, as Horovod's coordinator words it.
_FIELDS = {
    "kind": "collective operations",
    "count": "numbers of tensors",
    "op": "reduction operation",
    "root": "root ranks",
    "dtypes": "data types",
    "shapes": "tensor shapes",
    "inner": "tensor shapes beyond the first dimension",
    "scales": "prescale and/or postscale factors",
}


def _checking() -> bool:
    """Whether each collective first checks that every rank of the set issues the same one
    (``GRADZIP_HOROVOD_CHECK=0`` turns it off; set it alike on every rank)."""
    return os.environ.get("GRADZIP_HOROVOD_CHECK", "1") != "0"


def _describe(kind: str, tensors, *, inner: bool = False, **fields) -> dict:
    """What every rank of a collective must agree on: its kind, the tensors' dtypes and shapes
    (``inner``: beyond the first dimension, which an all-gather and an all-to-all let differ),
    and ``fields`` (the op, the root rank, the scale factors)."""
    d = {"kind": kind, "count": len(tensors), **{k: v for k, v in fields.items() if v is not None}}
    d["dtypes"] = [str(t.dtype).replace("torch.", "") for t in tensors]
    d["inner" if inner else "shapes"] = [list(t.shape[1:]) if inner else list(t.shape) for t in tensors]
    return d


def _host_group(group) -> bool:
    """Whether ``group`` takes CPU tensors (gloo, MPI, or gloo beside NCCL): the check's numbers
    are a CPU tensor, so it never waits for a GPU stream. A NCCL-only group is not checked."""
    backend = str(dist.get_backend(group))
    return "gloo" in backend or "mpi" in backend


def _agree(desc: dict, process_set) -> None:
    """Raise :class:`HorovodInternalError` on every rank of the set where the ranks describe the
    collective differently (another kind, shape, dtype, op, root, number of tensors), before its
    data moves: a mismatch would otherwise hang, abort gloo, or return a mixed result. One
    allreduce(MAX) of the description's hash and its negation (:func:`gradzip.sync.differ_across_ranks`),
    the same small collective whatever the kind, so that ranks that issue different kinds still meet in it."""
    if not _checking() or _set_size(process_set) == 1:
        return
    group = _group(process_set)
    if not _host_group(group):
        return
    if _internal(differ_across_ranks, [value_hash(desc)], group):
        _mismatch(desc, process_set)


def _mismatch(desc: dict, process_set) -> None:
    group = _group(process_set)
    every: list = [None] * _set_size(process_set)
    _internal(dist.all_gather_object, every, desc, group=group)
    ranks = process_set.ranks if group is not None else list(range(len(every)))
    for field, words in _FIELDS.items():
        values = [d.get(field) for d in every]
        if len({json.dumps(v, sort_keys=True) for v in values}) > 1:
            b = next(i for i, v in enumerate(values) if v != values[0])
            va, vb = values[0], values[b]
            if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb) == 1:
                va, vb = va[0], vb[0]  # one tensor: its shape or dtype
            kinds = sorted({d["kind"].upper() for d in every})
            raise HorovodInternalError(
                f"Mismatched {'/'.join(kinds)} {words}: rank {ranks[0]} sent {va}, but rank {ranks[b]} sent {vb}."
            )
    raise HorovodInternalError(f"Mismatched {desc['kind'].upper()}: the ranks describe it differently: {every}")


# -- handles ---------------------------------------------------------------------------------
class _Pending:
    """An operation in flight: torch works and what turns their buffers into the result."""

    __slots__ = ("works", "finish", "keep")

    def __init__(self, works: list, finish: Callable[[], object], keep: object = None) -> None:
        self.works, self.finish, self.keep = works, finish, keep


_handles: dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


def _handle(works: list, finish: Callable[[], object], keep: object = None) -> int:
    h = next(_handle_ids)
    _handles[h] = _Pending([w for w in works if w is not None], finish, keep)
    return h


#: The torch.distributed collectives :func:`_internal` issues asynchronously and tracks.
_COLLECTIVES = frozenset({dist.all_reduce, dist.all_gather, dist.broadcast, dist.all_to_all_single, dist.barrier})


def _tensors_in(args) -> list:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def _internal(fn: Callable, *a, **kw):
    """Run a torch.distributed call; its RuntimeError (a peer gone, a broken connection) becomes
    HorovodInternalError, as Horovod reports a failed collective. A collective is issued
    asynchronously and tracked with its tensors for gradzip's exit handler
    (:func:`gradzip.comm.track`); a blocking one is then waited for."""
    try:
        if fn not in _COLLECTIVES:
            return fn(*a, **kw)
        work = track(fn(*a, **{**kw, "async_op": True}), *_tensors_in(a))
        if kw.get("async_op", False) or work is None:
            return work
        work.wait()
        return None
    except HorovodInternalError:
        raise
    except RuntimeError as exc:
        if "not initialized" in str(exc) or "Default process group" in str(exc):
            raise
        raise HorovodInternalError(exc) from exc


def poll(handle) -> bool:
    """True when the operation of ``handle`` has completed (``synchronize`` will not block)."""
    if _require() == "horovod":
        return horovod().poll(handle)
    p = _handles.get(handle)
    if p is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return all(w.is_completed() for w in p.works)


def synchronize(handle):
    """Wait for ``handle``'s operation and return its result (a tensor, a tuple or a list); None
    for a handle already synchronized, as Horovod."""
    if _require() == "horovod":
        return horovod().synchronize(handle)
    if callable(handle) and not isinstance(handle, int):  # sparse_allreduce_async's
        return handle()
    p = _handles.pop(handle, None)
    if p is None:
        return None
    for w in p.works:
        _internal(w.wait)
    return p.finish()


# -- reductions ------------------------------------------------------------------------------
_DIST_OPS = {
    Sum: dist.ReduceOp.SUM,
    Average: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}


def _op_of(average, op) -> int:
    """Horovod's handle_average_backwards_compatibility."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return int(op)
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average


def _scale_(t: torch.Tensor, factor: float) -> None:
    """``t *= factor`` in place; integers in double precision, truncated towards zero (Horovod's cast)."""
    if factor == 1.0:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_((t.double() * factor).to(t.dtype))


#: Dtypes torch.distributed's gloo does not reduce ("Invalid scalar type"): refused before any
#: collective, as Horovod refuses them.
_UNSUPPORTED = (torch.int16,)


def _check_reduce_op(op: int, process_set) -> None:
    if op == Adasum:
        if process_set is not None and process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        n = size()
        if n & (n - 1):
            raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
        return
    if op not in _DIST_OPS:
        raise ValueError(f"op must be one of Average, Sum, Adasum, Min, Max, Product; got {OP_NAMES.get(op, op)!r}")


def _start_allreduce(
    tensors: list[torch.Tensor],
    outs: list[torch.Tensor],
    op: int,
    pre: float,
    post: float,
    process_set,
    kind: str = "allreduce",
) -> int:
    """Start the reduction of each ``tensors[i]`` into ``outs[i]`` (which may be the same tensor),
    once every rank of the set has been found to issue the same one (:func:`_agree`)."""
    _check_reduce_op(op, process_set)
    group = _group(process_set)
    n = _set_size(process_set)
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("Tensor is required to be contiguous.")
        if t.dtype in _UNSUPPORTED:
            raise ValueError(f"Tensor type {t.type()} is not supported.")
    _agree(_describe(kind, tensors, op=OP_NAMES.get(op, op), scales=[pre, post]), process_set)
    for t, o in zip(tensors, outs):
        with torch.no_grad():
            if o is not t:
                o.copy_(t)
            _scale_(o, pre)
    if op == Adasum:
        with torch.no_grad():
            for o in outs:
                adasum_(o)
                _scale_(o, post)
        return _handle([], lambda: tuple(outs), keep=tensors)
    works = [_internal(dist.all_reduce, o, op=_DIST_OPS[op], group=group, async_op=True) for o in outs]
    scale = post / n if op == Average else post

    def finish():  # a grouped handle's result is a tuple, as Horovod's
        with torch.no_grad():
            for o in outs:
                _scale_(o, scale)
        return tuple(outs)

    return _handle(works, finish, keep=tensors)


def allreduce_async(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start reducing ``tensor`` over the ranks (not modified); returns a handle whose
    :func:`synchronize` gives the result."""
    op = _op_of(average, op)
    if _require() == "horovod":
        return horovod().allreduce_async(
            tensor,
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=_to_horovod_set(process_set),
        )
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    h = _start_allreduce([tensor], [out], op, float(prescale_factor), float(postscale_factor), process_set)
    return _single(h)


def allreduce_async_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start reducing ``tensor`` in place; returns a handle."""
    op = _op_of(average, op)
    if _require() == "horovod":
        return horovod().allreduce_async_(
            tensor,
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=_to_horovod_set(process_set),
        )
    h = _start_allreduce([tensor], [tensor], op, float(prescale_factor), float(postscale_factor), process_set)
    return _single(h)


def _single(h: int) -> int:
    """A handle whose result is the first of a list's."""
    p = _handles[h]
    fin = p.finish
    p.finish = lambda: fin()[0]
    return h


class _Allreduce(torch.autograd.Function):
    """Allreduce whose backward allreduces the gradient with the same op, as Horovod's."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set):
        ctx.op, ctx.scales, ctx.process_set = op, (prescale, postscale), process_set
        return synchronize(allreduce_async(tensor, None, None, op, prescale, postscale, process_set))

    @staticmethod
    def backward(ctx, grad):
        g = allreduce(
            grad.contiguous(),
            op=ctx.op,
            prescale_factor=ctx.scales[0],
            postscale_factor=ctx.scales[1],
            process_set=ctx.process_set,
        )
        return g, None, None, None, None


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """A new tensor: ``tensor`` reduced over the ranks (autograd-aware; ``compression`` is a
    Horovod-interface class such as ``Compression.fp16``)."""
    op = _op_of(average, op)
    comp = Compression.none if compression is None else compression
    if _require() == "horovod":
        return horovod().allreduce(
            tensor,
            name=name,
            compression=comp,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=_to_horovod_set(process_set),
        )
    compressed, ctx = comp.compress(tensor)
    out = _Allreduce.apply(compressed, op, float(prescale_factor), float(postscale_factor), process_set)
    return comp.decompress(out, ctx)


def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """``allreduce`` in place; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start reducing each tensor of ``tensors`` (not modified); the handle's result is a list."""
    op = _op_of(average, op)
    if _require() == "horovod":
        return horovod().grouped_allreduce_async(
            tensors,
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=_to_horovod_set(process_set),
        )
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _start_allreduce(list(tensors), outs, op, float(prescale_factor), float(postscale_factor), process_set)


def grouped_allreduce_async_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start reducing each tensor of ``tensors`` in place; returns a handle."""
    op = _op_of(average, op)
    if _require() == "horovod":
        return horovod().grouped_allreduce_async_(
            tensors,
            name=name,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=_to_horovod_set(process_set),
        )
    ts = list(tensors)
    return _start_allreduce(ts, ts, op, float(prescale_factor), float(postscale_factor), process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, process_set, *tensors):
        ctx.op, ctx.process_set = op, process_set
        h = grouped_allreduce_async(list(tensors), None, None, op, prescale, postscale, process_set)
        return tuple(synchronize(h))

    @staticmethod
    def backward(ctx, *grads):
        out = grouped_allreduce([g.contiguous() for g in grads], op=ctx.op, process_set=ctx.process_set)
        return (None, None, None, None, *out)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """A list: each tensor of ``tensors`` reduced over the ranks (autograd-aware)."""
    op = _op_of(average, op)
    if _require() == "horovod":
        return horovod().grouped_allreduce(
            tensors,
            name=name,
            compression=compression,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=_to_horovod_set(process_set),
        )
    pairs = [compression.compress(t) for t in tensors]
    out = _GroupedAllreduce.apply(
        op, float(prescale_factor), float(postscale_factor), process_set, *[c for c, _ in pairs]
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs)]


def grouped_allreduce_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Each tensor of ``tensors`` reduced in place; returns them."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """A sparse tensor's indices and values gathered from every rank (values divided by the set's
    size for ``Average``); returns a function that waits and gives the sparse sum, as Horovod's."""
    if _require() == "horovod":
        return horovod().sparse_allreduce_async(tensor, name, op, process_set=_to_horovod_set(process_set))
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    hi = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices", process_set=process_set)
    hv = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)
    n = _set_size(process_set)

    def handle():
        values = synchronize(hv)
        indices = synchronize(hi)
        if op == Average:
            values = values / n
        if indices.dim() == 0 or values.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size())

    return handle


# -- Adasum ----------------------------------------------------------------------------------
def adasum_(t: torch.Tensor) -> torch.Tensor:
    """Adasum (Maleki et al., "Scaling distributed training with adaptive summation", 2021) of
    ``t`` over all ranks, in place, for a power-of-two world: at distance ``d = 1, 2, 4, ...``
    each rank exchanges its vector ``a`` with rank ``r ^ d``'s ``b`` and both keep

        (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

    (a zero vector's coefficient counts as 1). The formula is symmetric, and both partners
    compute it from the same two vectors in the same arithmetic order, so every rank ends with
    the same bits. Dot products and norms are taken in float64. Each level sends the whole
    tensor (log2(size) exchanges; Horovod's MPI kernel halves the vector per level instead)."""
    n, r = size(), rank()
    if n & (n - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    flat = t.view(-1)
    d = 1
    while d < n:
        peer = r ^ d
        other = torch.empty_like(flat)
        ops = [dist.P2POp(dist.isend, flat.contiguous(), peer), dist.P2POp(dist.irecv, other, peer)]
        for w in _internal(dist.batch_isend_irecv, ops):
            _internal(w.wait)
        a, b = (flat, other) if r < peer else (other, flat)  # the same order on both partners
        a64, b64 = a.double(), b.double()
        dot = float(a64 @ b64)
        na, nb = float(a64 @ a64), float(b64 @ b64)
        ca = 1.0 - dot / (2 * na) if na > 0 else 1.0
        cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
        flat.copy_((ca * a64 + cb * b64).to(flat.dtype))
        d *= 2
    return t


# -- gathers, broadcasts, all-to-all, reduce-scatter -------------------------------------------
def _allgather_start(tensors: list[torch.Tensor], process_set) -> int:
    group = _group(process_set)
    n = _set_size(process_set)
    _agree(_describe("allgather", tensors, inner=True), process_set)
    rows_mine = torch.tensor([t.shape[0] if t.dim() else 1 for t in tensors], dtype=torch.int64)
    every = [torch.zeros_like(rows_mine) for _ in range(n)]
    _internal(dist.all_gather, every, rows_mine, group=group)
    works, parts = [], []
    for i, t in enumerate(tensors):
        rows = [int(e[i]) for e in every]
        x = t.detach().reshape(-1, *t.shape[1:]) if t.dim() else t.detach().reshape(1)
        pad = max(rows)
        if x.shape[0] < pad:
            x = torch.cat([x, x.new_zeros(pad - x.shape[0], *x.shape[1:])])
        outs = [torch.empty_like(x) for _ in rows]
        works.append(_internal(dist.all_gather, outs, x.contiguous(), group=group, async_op=True))
        parts.append((outs, rows))

    def finish():
        return tuple(torch.cat([o[:r] for o, r in zip(outs, rows)]) for outs, rows in parts)

    return _handle(works, finish, keep=tensors)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start gathering every rank's ``tensor`` along dimension 0 (first dimensions may differ)."""
    if _require() == "horovod":
        return horovod().allgather_async(tensor, name=name, process_set=_to_horovod_set(process_set))
    return _single(_allgather_start([tensor], process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start gathering each tensor of ``tensors``; the handle's result is a list."""
    if _require() == "horovod":
        return horovod().grouped_allgather_async(tensors, name=name, process_set=_to_horovod_set(process_set))
    return _allgather_start(list(tensors), process_set)


def _offset_rows(rows: int, process_set) -> int:
    every = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    return int(every[: _set_rank(process_set)].sum())


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, process_set=process_set))

    @staticmethod
    def backward(ctx, grad):
        g = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        return g.narrow(0, _offset_rows(ctx.rows, ctx.process_set), ctx.rows), None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dimension 0 (autograd-aware: the gradient is
    averaged and each rank keeps its rows, as Horovod's)."""
    if _require() == "horovod":
        return horovod().allgather(tensor, name=name, process_set=_to_horovod_set(process_set))
    if tensor.dim() == 0:
        return synchronize(allgather_async(tensor, process_set=process_set))
    return _Allgather.apply(tensor, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), process_set=process_set)))

    @staticmethod
    def backward(ctx, *grads):
        gs = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.process_set)
        return (None, *[g.narrow(0, _offset_rows(r, ctx.process_set), r) for g, r in zip(gs, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """A tuple: each tensor of ``tensors`` gathered along dimension 0 (autograd-aware)."""
    if _require() == "horovod":
        return horovod().grouped_allgather(tensors, name=name, process_set=_to_horovod_set(process_set))
    return _GroupedAllgather.apply(process_set, *tensors)  # a tuple, as Horovod's


def _broadcast_start(tensor, out, root_rank: int, process_set, result=None) -> int:
    """Broadcast ``root_rank``'s ``tensor`` into ``out``; the handle gives ``result`` (the tensor
    written in place, a Parameter stays one) or ``out``."""
    group = _group(process_set)
    if not out.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    members = process_set.ranks if group is not None else range(size())
    if int(root_rank) not in members:
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided process set")
    _agree(_describe("broadcast", [tensor], root=int(root_rank)), process_set)
    if out is not tensor:
        with torch.no_grad():
            out.copy_(tensor)
    with torch.no_grad():
        w = _internal(dist.broadcast, out, src=int(root_rank), group=group, async_op=True)
    done = out if result is None else result
    return _handle([w], lambda: done, keep=tensor)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start broadcasting ``root_rank``'s ``tensor`` (a global rank) into a new tensor."""
    if _require() == "horovod":
        return horovod().broadcast_async(tensor, root_rank, name=name, process_set=_to_horovod_set(process_set))
    return _broadcast_start(
        tensor, torch.empty_like(tensor, memory_format=torch.contiguous_format), root_rank, process_set
    )


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` with ``root_rank``'s, in place."""
    if _require() == "horovod":
        return horovod().broadcast_async_(tensor, root_rank, name=name, process_set=_to_horovod_set(process_set))
    return _broadcast_start(
        tensor, tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, root_rank, process_set, tensor
    )


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, process_set=process_set))

    @staticmethod
    def backward(ctx, grad):
        g = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            g = g * 0
        return g, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """A new tensor holding ``root_rank``'s ``tensor`` (autograd-aware)."""
    if _require() == "horovod":
        return horovod().broadcast(tensor, root_rank, name=name, process_set=_to_horovod_set(process_set))
    return _Broadcast.apply(tensor, root_rank, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def _splits(splits, rows: int, n: int) -> list[int]:
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall: the first dimension ({rows}) must divide by the number of ranks ({n})")
        return [rows // n] * n
    s = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if isinstance(splits, torch.Tensor) and splits.dtype != torch.int32:
        raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
    if len(s) != n or sum(s) != rows or min(s) < 0:
        raise ValueError(f"alltoall: splits {s} must give {n} non-negative counts that add up to {rows}")
    return [int(x) for x in s]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[j]`` rows of ``tensor`` (along dimension 0) to rank ``j`` of the set;
    the result is the received rows, in rank order, and the tensor of received counts (int32)."""
    if _require() == "horovod":
        return horovod().alltoall_async(tensor, splits=splits, name=name, process_set=_to_horovod_set(process_set))
    group = _group(process_set)
    n = _set_size(process_set)
    rows = tensor.shape[0]
    send = _splits(splits, rows, n)
    _agree(_describe("alltoall", [tensor], inner=True), process_set)
    recv = torch.empty(n, dtype=torch.int64)
    _internal(dist.all_to_all_single, recv, torch.tensor(send, dtype=torch.int64), group=group)
    got = [int(x) for x in recv]
    inner = tensor.shape[1:]
    out = tensor.new_empty((sum(got), *inner))
    w = _internal(
        dist.all_to_all_single,
        out,
        tensor.contiguous(),
        output_split_sizes=got,
        input_split_sizes=send,
        group=group,
        async_op=True,
    )
    received = torch.tensor(got, dtype=torch.int32)
    return _handle([w], lambda: (out, received), keep=tensor)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set):
        out, received = synchronize(alltoall_async(tensor, splits, process_set=process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        g, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return g, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows of ``tensor`` to every rank (``splits``: how many to each, an int32 tensor or a list;
    equal shares when None). Returns the received rows, and with ``splits`` given also the
    int32 tensor of counts received from each rank (autograd-aware)."""
    if _require() == "horovod":
        return horovod().alltoall(tensor, splits=splits, name=name, process_set=_to_horovod_set(process_set))
    out, received = _Alltoall.apply(tensor, splits, process_set)
    return out if splits is None else (out, received)


def _rs_rows(rows: int, n: int, r: int) -> tuple[int, int]:
    """(offset, count) of rank ``r``'s rows: the first ``rows % n`` ranks get one more."""
    k, m = divmod(rows, n)
    return r * k + min(r, m), k + (1 if r < m else 0)


def _reducescatter_start(tensors, op: int, process_set, pre: float, post: float) -> int:
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"reducescatter supports Average, Sum, Min, Max, Product; got {OP_NAMES.get(op, op)!r}")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("Reducescatter does not support scalar inputs")
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    h = _start_allreduce(list(tensors), outs, op, pre, post, process_set, kind="reducescatter")
    n, r = _set_size(process_set), _set_rank(process_set)
    p = _handles[h]
    fin = p.finish

    def finish():
        res = []
        for o in fin():
            off, cnt = _rs_rows(o.shape[0], n, r)
            res.append(o.narrow(0, off, cnt).clone())
        return tuple(res)

    p.finish = finish
    return h


def reducescatter_async(
    tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    """Start reducing ``tensor`` over the ranks and keeping this rank's rows (the first ``n % size``
    ranks one more). On torch.distributed's gloo this reduces the whole tensor, then slices."""
    if _require() == "horovod":
        return horovod().reducescatter_async(
            tensor,
            name=name,
            op=op,
            process_set=_to_horovod_set(process_set),
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
    return _single(
        _reducescatter_start([tensor], int(op), process_set, float(prescale_factor), float(postscale_factor))
    )


def grouped_reducescatter_async(
    tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    """Start a reduce-scatter of each tensor of ``tensors``; the handle's result is a list."""
    if _require() == "horovod":
        return horovod().grouped_reducescatter_async(
            tensors,
            name=name,
            op=op,
            process_set=_to_horovod_set(process_set),
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
    return _reducescatter_start(list(tensors), int(op), process_set, float(prescale_factor), float(postscale_factor))


def _rs_grad(grads, op, process_set, pre, post):
    n = _set_size(process_set)
    out = []
    for g in grads:
        g = g.contiguous()
        if op == Sum:
            g = g * n
        if pre != 1.0:
            g = g * pre
        if post != 1.0:
            g = g * post
        out.append(g)
    return grouped_allgather(out, process_set=process_set)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, process_set, pre, post, *tensors):
        ctx.args = (op, process_set, pre, post)
        return tuple(synchronize(_reducescatter_start(list(tensors), op, process_set, pre, post)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, *_rs_grad(grads, *ctx.args))


def reducescatter(
    tensor,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """``tensor`` reduced over the ranks; this rank's rows of the result (autograd-aware)."""
    if _require() == "horovod":
        return horovod().reducescatter(
            tensor,
            name=name,
            compression=compression,
            op=op,
            process_set=_to_horovod_set(process_set),
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
    c, ctx = compression.compress(tensor)
    (out,) = _Reducescatter.apply(int(op), process_set, float(prescale_factor), float(postscale_factor), c)
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """A list: each tensor of ``tensors`` reduce-scattered (autograd-aware)."""
    if _require() == "horovod":
        return horovod().grouped_reducescatter(
            tensors,
            name=name,
            compression=compression,
            op=op,
            process_set=_to_horovod_set(process_set),
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
    pairs = [compression.compress(t) for t in tensors]
    outs = _Reducescatter.apply(
        int(op), process_set, float(prescale_factor), float(postscale_factor), *[c for c, _ in pairs]
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# -- join and barrier --------------------------------------------------------------------------
def join(device=-1) -> int:
    """This rank has finished its data: block until every rank has called ``join()``, and return
    the rank that joined last (the highest such rank on a tie), as Horovod's.

    Unlike Horovod, ranks that have not joined yet cannot go on reducing with the joined ranks
    contributing zeros: every collective issued before a rank's ``join()`` must be issued by
    every rank (uneven inputs must be evened out first, e.g. with ``ElasticSampler`` or by
    padding the last batch)."""
    if _require() == "horovod":
        return horovod().join(device)
    t = torch.tensor([time.time()], dtype=torch.float64)
    every = [torch.zeros_like(t) for _ in range(size())]
    _internal(dist.all_gather, every, t)
    stamps = [float(e) for e in every]
    last = max(stamps)
    return max(i for i, s in enumerate(stamps) if s == last)


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of ``process_set`` has reached it."""
    if _require() == "horovod":
        horovod().barrier(process_set=_to_horovod_set(process_set))
        return
    _internal(dist.barrier, group=_group(process_set))


# -- objects (used by functions.py) ---------------------------------------------------------------
def dumps(obj) -> bytes:
    """cloudpickle (as Horovod; lambdas and local classes travel) where installed, else pickle."""
    buf = io.BytesIO()
    try:
        import cloudpickle
    except ImportError:
        pickle.dump(obj, buf)
    else:
        cloudpickle.dump(obj, buf)
    return buf.getvalue()


def loads(data: bytes):
    return pickle.loads(data)
