"""FSDP2 front end: compress the reduce-scatter and parameter all-gathers of ``fully_shard``, and HSDP's all-reduce.

    from torch.distributed.fsdp import fully_shard
    import gradzip as gz

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = gz.fsdp.compress(model, reduce_scatter=gz.Int8(), all_gather=gz.Int8(block=256))
    ...
    state.stats()          # bytes handed to collectives, link bytes, ratio, times

**ZeRO++ on FSDP2.** ``all_gather=`` (qwZ) replaces FSDP's parameter all-gather
(``set_custom_all_gather``): each rank encodes its shard of every parameter of the group, one
all-gather moves the messages, every rank decodes every shard into FSDP's all-gather buffer
(:class:`~gradzip.protocols.weight_gather.WeightGather`, run by a third engine). Weights are
not error-fed: the full-precision shard stays the source of truth and is quantized afresh by
every all-gather. With ``fully_shard(..., reshard_after_forward=L)`` (hpZ) FSDP all-gathers
the backward's weights over the ``L`` ranks of the post-forward mesh: gradzip gathers the
forward's decoded weights there as they are (booked as intra-node bytes).
``reduce_scatter=gz.Hierarchical(codec, local_size=L)`` (qgZ) runs
:class:`~gradzip.protocols.hierarchical_rs.HierarchicalReduceScatter`: plain inside each node
of ``L`` ranks, ``codec`` across the nodes.

**Reduce-scatter.** FSDP2 (torch >= 2.9) lets a module replace its reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``, one call per ``fully_shard``'d module: it is
not recursive). Per parameter group and backward, FSDP calls the comm with keyword
arguments ``output_tensor`` (``[n]``, the reduce dtype), ``input_tensor`` (``[W * n]``,
row ``r`` of ``view(W, n)`` the chunk destined to shard rank ``r``: every parameter's
dim-0 padded chunk ``r`` back to back, in the group's parameter order), ``group`` (the
shard group, ``W`` ranks) and ``op`` (``AVG`` by default), never ``async_op``, and it
ignores the return value: the comm must have written the reduced shard into
``output_tensor`` when it returns. The output buffer becomes the storage of the
parameters' ``.grad``.

gradzip's comm names the slots after the parameters (read from the module's
``FSDPParamGroup``), hands them to its :class:`~gradzip.engine.Engine` as one tensor per
parameter (``[W, padded]``, row ``j`` for owner ``j``) and runs the
:class:`~gradzip.protocols.reduce_scatter.ReduceScatter` protocol to completion (reduce,
flush, wait): the compressed pairwise all-to-all of TwoPhase's first phase, decoded and
summed in float32 in rank order, with sender error feedback keyed by parameter name (one
residual per parameter, shaped ``[W, padded]``: this rank's error towards every shard).
The engine's configuration check, non-finite handling (``on_nonfinite``) with rollback,
stats and state are those of every other front end. One step of the engine is one
backward that reduced: it ends in an autograd final callback queued by the first
reduce-scatter of the backward (``set_requires_gradient_sync(False)`` microbatches call
no reduce-scatter and count nothing).

**HSDP.** FSDP2's native HSDP all-reduce (``fully_shard(mesh=mesh_2d)``) is hard-wired
(``dist.all_reduce``) and cannot be replaced. To compress the replica all-reduce, shard
over the shard sub-mesh only and let gradzip average over the replica group in FSDP's
all-reduce hook (``set_all_reduce_hook``, which runs after the reduce-scatter)::

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = gz.fsdp.compress(model, reduce_scatter=gz.Int8(), replicate=gz.PowerSGD(rank=4),
                             replicate_group=mesh["replicate"])

The reduce-scatter averages over the shard group; the hook averages each parameter's
shard (in its shard shape, so PowerSGD sees matrices) over the replica group with a
second engine: every replica ends with the same floats (every gradzip protocol decodes
alike on every rank), so the replicas' parameters stay equal.

**Checkpoints.** ``state.state_dict()`` holds, per parameter, the update that error
feedback still owes (the *pending update*, in units of the averaged gradient) as a
``DTensor`` placed like the parameter, plus the step. It is what
``torch.distributed.checkpoint`` saves and reshards: pass the state itself (it is
``Stateful``) in the dict given to ``dcp.save`` / ``dcp.load``. On load every rank puts
its shard of the pending update into its own (self-addressed) residual row, times the
new shard-group size, so the next reduce-scatter adds exactly the update the saved run
still owed, whatever the new number of ranks. The pending update gives each owner's sum
of the senders' rows, not the rows, so the next encode sees other inputs than an unbroken
run's: for a bit-identical resume on the same ranks, give DCP ``state.exact()`` instead,
which adds every rank's whole engine states under a key of the rank's own
(``exact.rank<r>``) and restores them where the ranks, layout and methods are the same.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _FSDPAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _FSDPReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from torch.distributed.tensor import DTensor

from .codecs.base import Codec
from .comm import Communicator, track
from .engine import Engine, check_real, layout_of
from .frontend import NONFINITE_HINT, FrontEnd
from .protocols import Hierarchical, Protocol, ReduceScatter
from .protocols.hierarchical import shard_key
from .protocols.hierarchical_rs import HierarchicalReduceScatter
from .protocols.twophase import piece_bounds
from .protocols.weight_gather import WeightGather

__all__ = ["compress", "FSDPState"]

_OWNER = re.compile(r"^(?P<name>.*)#(?P<j>\d+)/(?P<n>\d+):owner$")


@dataclass(frozen=True)
class _Slot:
    """One parameter's place in a group's reduce-scatter buffers."""

    name: str
    offset: int  # in a rank chunk of the input, and in the output
    padded: int  # elements per rank chunk (dim-0 padded)
    valid: int  # elements of this rank's shard (the rest is padding)
    shape: torch.Size  # this rank's shard shape (FSDPParam.sharded_size)
    param: torch.nn.Parameter  # the sharded parameter (a DTensor)


class _Group:
    """One FSDPParamGroup: its module, its parameters' slots, and gradzip's comm and hook."""

    def __init__(self, state: FSDPState, module: FSDPModule, module_name: str, pg, names: dict) -> None:
        self.state = state
        self.module = module
        self.module_name = module_name or "<root>"
        self.pg = pg
        self.slots: list[_Slot] = []
        #: every parameter's (name, offset, elements) in the group's all-gather input, frozen ones included
        self.gather_slots: list[tuple[str, int, int]] = []
        off = goff = 0
        for fp in pg.fsdp_params:
            p = fp.sharded_param
            info = fp._module_info
            prefix = names[info.module]
            name = f"{prefix}.{info.param_name}" if prefix else info.param_name
            padded = fp.padded_sharded_param_size.numel()
            self.gather_slots.append((name, goff, padded))
            goff += padded
            if not p.requires_grad:
                continue
            self.slots.append(_Slot(name, off, padded, fp.sharded_size.numel(), torch.Size(fp.sharded_size), p))
            off += padded
        self.numel = off
        self.gather_numel = goff

    @property
    def world(self) -> int:
        return self.pg.mesh_info.shard_mesh_size

    def check_numel(self, n: int) -> None:
        if n != self.numel:
            raise ValueError(
                f"gradzip.fsdp: FSDP reduce-scattered {n} elements per rank for module {self.module_name!r}, but its "
                f"trainable parameters take {self.numel}: some parameter got no gradient in this backward (FSDP leaves "
                "it out), so gradzip cannot tell which gradient is which. Call "
                "model.set_reduce_scatter_unused_params(True) (unused parameters then reduce a zero gradient and "
                "keep their residual), or set requires_grad=False on parameters that are not trained"
            )


class _Comm(_FSDPReduceScatter):
    """What ``set_custom_reduce_scatter`` gets: runs the engine's ReduceScatter to completion."""

    def __init__(self, group: _Group) -> None:
        self.group = group

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Fresh memory every call: the output becomes the storage of the parameters' grads.
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        g, st = self.group, self.group.state
        world = group.size()
        n = output_tensor.numel()
        if input_tensor.numel() != world * n:
            raise ValueError(f"gradzip.fsdp: reduce-scatter input of {input_tensor.numel()} elements for {world} x {n}")
        g.check_numel(n)
        st._check_group(group)
        x = input_tensor.view(world, n)
        names = [s.name for s in g.slots]
        tensors = [x[:, s.offset : s.offset + s.padded] for s in g.slots]
        engine = st.engine
        fut = engine.reduce(
            names,
            tensors,
            out_dtype=output_tensor.dtype,
            dest=output_tensor,
            zero_is_unused=bool(getattr(g.pg, "reduce_scatter_unused_params", False)),
        )
        st._run(engine, fut, output_tensor)
        _apply_op(output_tensor, op, world)
        return None


class _GatherComm(_FSDPAllGather):
    """What ``set_custom_all_gather`` gets: the group's parameter all-gather through the
    all-gather engine (``WeightGather``) over the shard group; the backward all-gather of a
    node-local secondary shard (``reshard_after_forward=L``) plainly inside the node."""

    def __init__(self, group: _Group) -> None:
        self.group = group

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        g, st = self.group, self.group.state
        world = group.size()
        n = input_tensor.numel()
        if output_tensor.numel() != world * n:
            raise ValueError(f"gradzip.fsdp: all-gather output of {output_tensor.numel()} elements for {world} x {n}")
        if st._ranks(group) == st._shard_ranks:
            st._gather(g, output_tensor, input_tensor)
        else:  # the post-forward mesh of reshard_after_forward=L: the decoded weights, inside the node
            st._gather_inside_node(group, output_tensor, input_tensor)
        if st._gather_only:
            st._end_with_backward(only_in_backward=True)
        return None


class _Hook:
    """What ``set_all_reduce_hook`` gets: averages the group's shards over the replica group."""

    def __init__(self, group: _Group) -> None:
        self.group = group

    def __call__(self, output: torch.Tensor) -> None:
        g, st = self.group, self.group.state
        g.check_numel(output.numel())
        slots = [s for s in g.slots if s.valid]
        views = [output[s.offset : s.offset + s.valid].view(s.shape) for s in slots]
        engine = st.replicate_engine
        fut = engine.reduce([s.name for s in slots], views, out_dtype=output.dtype)
        res = st._run(engine, fut, None)
        pos = 0
        for v in views:
            v.copy_(res[pos : pos + v.numel()].view(v.shape))
            pos += v.numel()


def _apply_op(out: torch.Tensor, op, world: int) -> None:
    """The engine returns the average; FSDP asks for AVG, or SUM / PREMUL_SUM(f) (fp16
    reduce, ``set_force_sum_reduction_for_comms``, ``set_gradient_divide_factor``)."""
    if op == dist.ReduceOp.AVG:
        return
    if op == dist.ReduceOp.SUM:
        out.mul_(world)
    elif op == dist.ReduceOp.PREMUL_SUM:
        out.mul_(float(op.factor) * world)
    else:
        raise ValueError(
            f"gradzip.fsdp: FSDP asked for a reduce-scatter with {op}; gradzip averages (AVG, SUM, PREMUL_SUM)"
        )


def _group_of(g) -> dist.ProcessGroup:
    """A process group from a ProcessGroup or a 1-D DeviceMesh."""
    if isinstance(g, dist.ProcessGroup):
        return g
    if hasattr(g, "get_group") and hasattr(g, "ndim"):
        if g.ndim != 1:
            raise ValueError(f"replicate_group must be a 1-D DeviceMesh (mesh['replicate']), got {g.ndim} dimensions")
        return g.get_group()
    raise TypeError(f"replicate_group must be a ProcessGroup or a 1-D DeviceMesh, got {type(g).__name__}")


class FSDPState(FrontEnd):
    """What :func:`compress` returns: the front-end surface (:class:`gradzip.frontend.FrontEnd`)
    over one or two engines, and a DCP-ready state.

    With HSDP both collectives are compressed, each by its engine (``engine``: the
    reduce-scatter's, ``replicate_engine``: the replica all-reduce's); the surface reports them
    together. ``stats()`` sums their counts (bytes, collectives, seconds; ``steps`` is the
    number of backward passes that reduced, which both count) and derives the ratios from the
    sums: ``ratio`` is then the link bytes FSDP's own reduce-scatter and all-reduce would send
    over what gradzip sent for both. ``stats(which="reduce_scatter")`` or ``"replicate"`` is one
    engine's alone. ``routes()`` lists both engines' rows, each with ``"collective"``
    (``"reduce_scatter"`` or ``"replicate"``). ``log_every`` calls ``fn`` once per step with
    the summed interval.

    ``state_dict()`` / ``load_state_dict()`` make it ``Stateful``: put the object itself in
    the dict handed to ``torch.distributed.checkpoint.save`` / ``load``; ``save(dir)`` /
    ``load(dir)`` do that with the state alone. Both are collectives (every rank calls them, in
    the same order). The state is not per rank: DCP reshards the pending updates to any number
    of ranks, so no owner is checked.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        engine: Engine | None,
        replicate_engine: Engine | None,
        groups: list[_Group],
        rs_group: dist.ProcessGroup,
        rep_group: dist.ProcessGroup | None,
        all_gather_engine: Engine | None = None,
        shard_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.engine = engine  # type: ignore[assignment]  # None: FSDP's own reduce-scatter
        self.replicate_engine = replicate_engine
        self.all_gather_engine = all_gather_engine  # None: FSDP's own all-gather
        self.groups: list[_Group] = groups
        self.rs_group = rs_group
        self.replicate_group = rep_group
        self.shard_group = shard_group if shard_group is not None else rs_group
        self._rs_ranks: dict[int, list[int]] = {}
        self._shard_ranks = dist.get_process_group_ranks(self.shard_group)
        self._node_comms: dict[int, Communicator] = {}  # post-forward groups (hpZ): plain all-gathers
        # Only the all-gather is compressed: no reduce-scatter or hook ends the step, the
        # backward does (a hook on the root's output, or the first backward all-gather).
        self._gather_only = all_gather_engine is not None and engine is None and replicate_engine is None
        self._hooks: list = []
        self._closing = False

    @property
    def step(self) -> int:
        """Backward passes that reduced, as checkpointed (with only the all-gather compressed:
        backward passes, and forwards without autograd)."""
        return (self.engine or self.replicate_engine or self.all_gather_engine).step

    def _engines(self) -> dict[str, Engine]:
        engines = {
            "all_gather": self.all_gather_engine,
            "reduce_scatter": self.engine,
            "replicate": self.replicate_engine,
        }
        return {k: e for k, e in engines.items() if e is not None}

    def stats(self, reset: bool = False, *, which: str | None = None) -> dict:
        """Bytes and times counted at the collectives (:mod:`gradzip.stats`), of every compressed
        collective together (see the class docstring), or of one: ``which="all_gather"``,
        ``"reduce_scatter"`` or ``"replicate"``. ``bytes_link_raw`` is what FSDP's own
        collectives would send: ``(N-1)`` times the shard for an all-gather, ``(N-1)/N`` of the
        input for the reduce-scatter, ``2(N-1)/N`` for the all-reduce. ``reset=True``: those
        since the previous ``stats(reset=True)`` of the same engines. (``stats("replicate")``,
        the former spelling, is ``stats(which="replicate")``.)"""
        if isinstance(reset, str):
            which, reset = reset, False
        engines = self._engines()
        if which is not None:
            if which not in ("all_gather", "reduce_scatter", "replicate"):
                raise ValueError(f"which must be 'all_gather', 'reduce_scatter' or 'replicate', got {which!r}")
            if which not in engines:
                raise ValueError(f"gradzip.fsdp.compress was called without {which}=")
            engines = {which: engines[which]}
        return self._stats_of(list(engines.values()), reset)

    def check_owner(self, state_dict: dict) -> None:
        """Nothing to refuse: the state holds no rank (DCP reshards it to any number of ranks)."""

    def save(self, directory: str | os.PathLike) -> Path:
        """``torch.distributed.checkpoint.save`` of this state alone into ``directory`` (a
        collective: every rank calls it); returns the directory."""
        import torch.distributed.checkpoint as dcp

        dcp.save({"gradzip": self}, checkpoint_id=directory)
        return Path(directory)

    def load(self, directory: str | os.PathLike) -> None:
        """Load what :meth:`save` wrote, resharded to this run's ranks (a collective)."""
        import torch.distributed.checkpoint as dcp

        dcp.load({"gradzip": self}, checkpoint_id=directory)

    # -- the step -------------------------------------------------------------------------
    def _check_group(self, group) -> None:
        key = id(group)
        if key not in self._rs_ranks:
            self._rs_ranks[key] = dist.get_process_group_ranks(group)
        if self._rs_ranks[key] != dist.get_process_group_ranks(self.rs_group):
            raise ValueError(
                "gradzip.fsdp: FSDP reduce-scattered over ranks "
                f"{self._rs_ranks[key]}, not over the shard group gradzip.fsdp.compress found "
                f"({dist.get_process_group_ranks(self.rs_group)}); call compress after every fully_shard "
                "and set_separate_reduce_scatter_group call"
            )

    def _run(self, engine: Engine, fut, output: torch.Tensor | None) -> torch.Tensor:
        """Drive one engine call to completion; the step ends with the backward."""
        self._end_with_backward()
        try:
            engine.flush()
            res = fut.wait()
        except BaseException:
            self._end_step()  # the backward will not reach its final callbacks
            raise
        if output is not None and res.data_ptr() != output.data_ptr():
            output.copy_(res.view_as(output))
        return res

    def _ranks(self, group) -> list[int]:
        key = id(group)
        if key not in self._rs_ranks:
            self._rs_ranks[key] = dist.get_process_group_ranks(group)
        return self._rs_ranks[key]

    def _gather(self, g: _Group, output: torch.Tensor, inp: torch.Tensor) -> None:
        """The group's all-gather over the shard group through the all-gather engine, to
        completion, decoded into FSDP's ``output``. The step is not ended here (a forward
        is no backward): it ends with the backward's reduce-scatter, or as ``_gather_only`` says."""
        if inp.numel() != g.gather_numel:
            raise ValueError(
                f"gradzip.fsdp: FSDP all-gathers {inp.numel()} elements per rank for module {g.module_name!r}, but its "
                f"parameters' shards take {g.gather_numel}: a tensor subclass with its own all-gather inputs "
                "(fsdp_pre_all_gather, e.g. float8 training) cannot take a compressed all-gather; leave all_gather= out"
            )
        if not inp.is_floating_point():
            raise ValueError(
                f"gradzip.fsdp: module {g.module_name!r} all-gathers {inp.dtype} (its parameters carry all-gather "
                "extensions, fsdp_pre_all_gather, as float8 training's do): gradzip's all-gather takes floating-point "
                "shards; leave all_gather= out"
            )
        engine = self.all_gather_engine
        names = [name for name, _, _ in g.gather_slots]
        tensors = [inp[off : off + k] for _, off, k in g.gather_slots]
        fut = engine.reduce(names, tensors, out_dtype=output.dtype, dest=output)
        try:
            engine.flush()
            res = fut.wait()
        except FloatingPointError as e:  # on_nonfinite="raise": every rank sees the gathered weights
            raise FloatingPointError(
                f"gradzip.fsdp: non-finite weights in the parameter all-gather of module {g.module_name!r} "
                f"({str(e).replace('non-finite gradient', 'non-finite shard')})"
            ) from None
        if res.data_ptr() != output.data_ptr():
            output.copy_(res.view_as(output))

    def _gather_inside_node(self, group, output: torch.Tensor, inp: torch.Tensor) -> None:
        """The backward all-gather of a node-local secondary shard (``reshard_after_forward=L``):
        the weights the forward decoded, gathered as they are inside the node (so the backward
        computes with the forward's weights), counted in the all-gather's stats (intra-node)."""
        comm = self._node_comms.get(id(group))
        if comm is None:
            comm = self._node_comms[id(group)] = Communicator(group, self.all_gather_engine.stats_, intra=True)
        nbytes = inp.numel() * inp.element_size()
        comm.stats.add(bytes_raw=nbytes, bytes_link_raw=(comm.world_size - 1) * nbytes, bytes_payload=nbytes)
        src = inp.clone()  # the input is a view of the output
        comm.allgather(output, src).wait()

    def _end_with_backward(self, only_in_backward: bool = False) -> None:
        if self._closing:
            return
        if only_in_backward and torch._C._current_graph_task_id() == -1:
            return  # a forward's all-gather: the step goes on
        self._closing = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
        except RuntimeError:  # not inside a backward (FSDP's post_backward called by hand)
            self._end_step()

    def _after_forward(self, module, args, output) -> None:
        """Only the all-gather compressed: a forward with autograd ends its step in its backward
        (a hook on the first output that requires grad); one without ends it now."""
        if torch.is_grad_enabled():
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._on_backward)
                    return
            return
        if not self._closing:
            self._closing = True
            self._end_step()

    def _on_backward(self, grad):
        self._end_with_backward()
        return None

    def _end_step(self) -> None:
        if not self._closing:
            return
        self._closing = False
        for e in self._engines().values():  # in this order: the last one logs for both (log_every)
            e.end_step()

    # -- checkpoints ---------------------------------------------------------------------
    def _slots(self) -> list[_Slot]:
        return [s for g in self.groups for s in g.slots]

    def _shard_world(self) -> int:
        return self.groups[0].world if self.groups else 1

    def _replica_group_for_mass(self):
        """The ranks that hold copies of the same shard: the custom replica group, FSDP's
        native HSDP all-reduce group, or none."""
        if self.replicate_group is not None:
            return self.replicate_group
        mi = self.groups[0].pg.mesh_info if self.groups else None
        return mi.replicate_process_group if isinstance(mi, HSDPMeshInfo) else None

    def _rs_rows(self):
        """Where the reduce-scatter's residuals lie: ``(key of a parameter's residual, rows,
        this rank's row, the process group of the rows' owners)``. ``ReduceScatter``: one row
        per shard rank, the shard group; ``HierarchicalReduceScatter``: one row per node, the
        ranks of this local rank on every node (``name@l/L``)."""
        world = self._shard_world()
        me = dist.get_rank(self.rs_group)
        proto = self.engine.protocol if self.engine is not None else None
        if isinstance(proto, HierarchicalReduceScatter):
            L = proto.nodes(world)
            _, across = self.engine.comm.split(L) if L > 1 else (None, self.engine.comm)
            return (lambda name: shard_key(name, me % L, L)), world // L, me // L, across.group
        return (lambda name: name), world, me, self.rs_group

    def _pending_rs(self, slots: list[_Slot]) -> torch.Tensor:
        """This rank's shard of the update the reduce-scatter residuals still owe, in units of
        the averaged gradient, all slots back to back (``sum padded`` elements)."""
        key, rows, _, group = self._rs_rows()
        total = sum(s.padded for s in slots)
        dev = slots[0].param.device if slots else torch.device("cpu")
        send = torch.zeros(rows, total, dtype=torch.float32, device=dev)
        if self.engine is not None and self.engine.memory is not None:
            for s, off in zip(slots, _offsets(slots)):
                r = self.engine.memory.residual(key(s.name))
                if r is not None:
                    if r.numel() != rows * s.padded:
                        raise RuntimeError(f"residual of {s.name!r} is {tuple(r.shape)}, expected {(rows, s.padded)}")
                    send[:, off : off + s.padded] = r.reshape(rows, s.padded).to(torch.float32)
        if rows > 1:
            recv = torch.empty_like(send)
            recv_flat, send_flat = recv.view(-1), send.view(-1)
            track(dist.all_to_all_single(recv_flat, send_flat, group=group, async_op=True), recv_flat, send_flat).wait()
        else:
            recv = send
        pending = torch.zeros(total, dtype=torch.float32, device=dev)
        for s in range(rows):  # senders in rank order
            pending += recv[s]
        return pending.div_(rows)

    def _pending_replicate(self, slots: list[_Slot]) -> list:
        """Per slot, this replica's part of the update the replica engine still owes (its
        residual plus, for TwoPhase, its owner memories times the replica count)."""
        out = []
        eng = self.replicate_engine
        owners: dict = {}
        if eng is not None and eng.memory is not None:
            for key, t in eng.memory.residuals.items():
                m = _OWNER.match(key)
                if m:
                    owners.setdefault(m["name"], []).append((int(m["j"]), int(m["n"]), t))
        for s in slots:
            v = torch.zeros(s.valid, dtype=torch.float32, device=s.param.device)
            if eng is not None and eng.memory is not None:
                r = eng.memory.residual(s.name)
                if r is not None:
                    v += r.reshape(-1).to(torch.float32)
                for j, n, t in owners.get(s.name, []):
                    b = piece_bounds(s.valid, n)
                    v[b[j] : b[j + 1]] += n * t.reshape(-1).to(torch.float32)
            out.append(v)
        return out

    def state_dict(self) -> dict:
        """``{"step": int, "reduce_scatter.<name>": DTensor, "replicate.<name>": DTensor}``: the
        pending update of every trainable parameter (float32, placed like the parameter) for
        each of the two collectives (zeros for one that is not compressed, so that any run
        can load any other's checkpoint). A collective over the shard and replica groups."""
        slots = self._slots()
        sd: dict = {"step": self.step}
        rep = self._replica_group_for_mass()
        if self.engine is not None:
            pending = self._pending_rs(slots)
            if rep is not None:  # the replicas' residuals owe their average
                track(dist.all_reduce(pending, group=rep, async_op=True), pending).wait()  # gradzip.comm
                pending.div_(dist.get_world_size(rep))
        else:
            pending = torch.zeros(
                sum(s.padded for s in slots), dtype=torch.float32, device=slots[0].param.device if slots else None
            )
        for s, off in zip(slots, _offsets(slots)):
            sd[f"reduce_scatter.{s.name}"] = _as_dtensor(pending[off : off + s.valid].view(s.shape).clone(), s.param)
        parts = self._pending_replicate(slots)
        if self.replicate_engine is not None:
            flat = torch.cat(parts) if parts else torch.zeros(0)
            track(dist.all_reduce(flat, group=self.replicate_group, async_op=True), flat).wait()
            flat.div_(dist.get_world_size(self.replicate_group))
            pos = 0
            for i, s in enumerate(slots):
                parts[i] = flat[pos : pos + s.valid]
                pos += s.valid
        for s, v in zip(slots, parts):
            sd[f"replicate.{s.name}"] = _as_dtensor(v.view(s.shape).clone(), s.param)
        return sd

    def exact(self) -> _Exact:
        """A ``Stateful`` to give DCP in place of this state for a bit-identical resume on the
        same ranks: ``{"gradzip": state.exact()}``. Its ``state_dict()`` is :meth:`state_dict`
        plus every rank's whole engine states (residual rows towards every owner, codec state,
        step, the last step's calls) under a key of the rank's own (``exact.rank<r>``); loading
        it on the same ranks, layout and methods restores them as they were, and anywhere else
        loads the pending update as :meth:`load_state_dict` does. A run on more ranks than the
        checkpoint's finds no key for its last ranks: load the plain state there (``"gradzip":
        state``; DCP reads the keys the loading state names, so it reads either checkpoint)."""
        return _Exact(self)

    def _exact_state(self, slots: list[_Slot]) -> bytes:
        """This rank's engines' states, whole (the residual rows towards every owner, codec
        state, the step, the last step's calls), as bytes: a DCP entry of this rank's own,
        read back by a run on the same ranks and layout (:meth:`_load_exact`)."""
        buf = io.BytesIO()
        blob = {
            "world": dist.get_world_size(),
            "rank": dist.get_rank(),
            "layout": [(s.name, s.padded, s.valid) for s in slots],
            "engine": self.engine.state_dict() if self.engine is not None else None,
            "replicate": self.replicate_engine.state_dict() if self.replicate_engine is not None else None,
            "all_gather": self.all_gather_engine.state_dict() if self.all_gather_engine is not None else None,
        }
        torch.save(blob, buf)
        return buf.getvalue()

    def _load_exact(self, state_dict: dict, slots: list[_Slot], template) -> bool:
        """Load this rank's whole engine states where the checkpoint holds them for this run's
        ranks, layout and methods; False (nothing changed) otherwise."""
        value = state_dict.get(f"exact.rank{dist.get_rank()}")
        if not isinstance(value, (bytes, bytearray)) or value is template:
            return False  # no such entry, or DCP left it as it was (a partial load)
        dev = slots[0].param.device if slots else torch.device("cpu")
        blob = torch.load(io.BytesIO(value), weights_only=True, map_location=dev)
        same = (blob.get("world"), blob.get("rank")) == (dist.get_world_size(), dist.get_rank()) and [
            tuple(x) for x in blob.get("layout", [])
        ] == [(s.name, s.padded, s.valid) for s in slots]
        pairs = [
            (self.engine, blob.get("engine")),
            (self.replicate_engine, blob.get("replicate")),
            (self.all_gather_engine, blob.get("all_gather")),
        ]
        if not same or any((eng is None) != (part is None) for eng, part in pairs):
            return False
        try:
            for eng, part in pairs:
                if eng is not None:
                    eng.check_state(part)
        except ValueError:
            return False  # another method or error feedback: the pending update carries over
        for eng, part in pairs:
            if eng is not None:
                eng.load_state_dict(part, checked=True)
        return True

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` saved, resharded by DCP to this run's placements. The
        pending update goes into this rank's self-addressed residual row (times the shard
        group size) and, with a replica engine, into its residual; a pending update of a
        collective this run does not compress is carried by the other one. Codec state
        (PowerSGD's warm start, adaptive thresholds) starts afresh: for a bit-identical resume
        on the same ranks, save and load :meth:`exact` instead."""
        slots = self._slots()
        key_of, rows, row, _ = self._rs_rows()

        def local(key, s):
            t = state_dict.get(key)
            if t is None:
                return None
            t = t.to_local() if isinstance(t, DTensor) else t
            if t.numel() != s.valid:
                raise ValueError(f"{key}: {t.numel()} elements for a shard of {s.valid}")
            return t.reshape(-1).to(device=s.param.device, dtype=torch.float32)

        rs_res, rep_res = {}, {}
        for s in slots:
            u_rs = local(f"reduce_scatter.{s.name}", s)
            u_rep = local(f"replicate.{s.name}", s)
            if self.engine is None and u_rs is not None:  # carried by the replica engine
                u_rep = u_rs if u_rep is None else u_rep + u_rs
                u_rs = None
            if self.replicate_engine is None and u_rep is not None:  # carried by the reduce-scatter
                u_rs = u_rep if u_rs is None else u_rs + u_rep
                u_rep = None
            if u_rs is not None and bool(u_rs.any()):
                r = torch.zeros(rows, s.padded, dtype=torch.float32, device=s.param.device)
                r[row, : s.valid] = u_rs * rows
                hier = key_of(s.name) != s.name  # HierarchicalReduceScatter's residuals are flat
                rs_res[key_of(s.name)] = r.view(-1) if hier else r
            if u_rep is not None and bool(u_rep.any()):
                rep_res[s.name] = u_rep.view(s.shape).clone()
        for eng, res in ((self.engine, rs_res), (self.replicate_engine, rep_res)):
            if eng is None:
                continue
            if eng.memory is not None:
                eng.memory.load_state_dict(res)
            elif res:
                raise ValueError("the checkpoint holds error-feedback residuals, but this run has error_feedback=False")
            eng.tensor_state = {}
            eng.step = int(state_dict.get("step", eng.step))
        if self.all_gather_engine is not None:  # weights are not error-fed: only the step
            self.all_gather_engine.tensor_state = {}
            self.all_gather_engine.step = int(state_dict.get("step", self.all_gather_engine.step))

    # -- undo ----------------------------------------------------------------------------
    def remove(self) -> None:
        """Give FSDP back its own reduce-scatter and all-gather and drop gradzip's hooks."""
        for g in self.groups:
            if self.engine is not None:
                g.module.set_custom_reduce_scatter(DefaultReduceScatter())
            if self.all_gather_engine is not None:
                g.module.set_custom_all_gather(DefaultAllGather())
            if self.replicate_engine is not None:
                g.module.set_all_reduce_hook(None)
            g.module.__dict__.pop("set_allocate_memory_from_process_group_for_comm", None)
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Exact:
    """:meth:`FSDPState.exact`: the state for DCP, plus every rank's whole engine states."""

    def __init__(self, state: FSDPState) -> None:
        self.state = state
        self._template = None

    def state_dict(self) -> dict:
        sd = self.state.state_dict()
        self._template = sd[f"exact.rank{dist.get_rank()}"] = self.state._exact_state(self.state._slots())
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        st = self.state
        if not st._load_exact(state_dict, st._slots(), self._template):
            st.load_state_dict({k: v for k, v in state_dict.items() if not k.startswith("exact.")})


def _offsets(slots: list[_Slot]) -> list[int]:
    out, off = [], 0
    for s in slots:
        out.append(off)
        off += s.padded
    return out


def _as_dtensor(local: torch.Tensor, param) -> DTensor:
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _param_groups(state) -> list:
    """An FSDP module's parameter groups: torch 2.13 keeps a list (``_fsdp_param_groups``),
    torch 2.11 (the GPU image's) one group or None (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def compress(
    model: torch.nn.Module,
    reduce_scatter: Codec | Hierarchical | None = None,
    *,
    all_gather: Codec | None = None,
    replicate: Codec | Protocol | None = None,
    replicate_group: dist.ProcessGroup | DeviceMesh | None = None,
    error_feedback: bool | None = None,
    replicate_error_feedback: bool | None = None,
    on_nonfinite: str = "skip",
) -> FSDPState:
    """Compress the communication of a model wrapped with FSDP2's ``fully_shard``.

    Call it once, after every ``fully_shard`` call and before the first forward. It installs
    gradzip's comms on every FSDP module of ``model`` (``model`` itself included).

    Args:
        model: the root module; ``fully_shard`` applied to it and/or its submodules.
        reduce_scatter: a gradzip codec (``gz.Int8()``, ``gz.TopK(0.01)``, ``gz.Identity()``...)
            for the gradient reduce-scatter over the shard group, or
            ``gz.Hierarchical(codec, local_size=L)``: plain inside each node of ``L`` ranks,
            ``codec`` across the nodes (ZeRO++'s qgZ); None leaves FSDP's own.
        all_gather: ``gz.Int8(block=...)``, ``gz.FP16()``, ``gz.BF16()`` or ``gz.Identity()`` for
            the parameter all-gathers over the shard group (ZeRO++'s qwZ): every rank encodes its
            shard, every rank decodes all of them into FSDP's unsharded parameters. Weights are
            not error-fed (the full-precision shard stays the source of truth). With
            ``fully_shard(..., reshard_after_forward=L)`` (the node size; ZeRO++'s hpZ) the
            backward all-gather gathers the forward's decoded weights inside the node, as they
            are. None leaves FSDP's own all-gather.
        replicate: HSDP only: any gradzip codec or protocol (``gz.PowerSGD(rank=4)``) for the
            average over the replica group, run in FSDP's all-reduce hook. Needs FSDP on the
            shard sub-mesh (``fully_shard(m, mesh=mesh["shard"])``) and ``replicate_group``.
        replicate_group: the replica dimension: ``mesh["replicate"]`` (a 1-D DeviceMesh) or a
            ProcessGroup.
        error_feedback, replicate_error_feedback: keep what each gradient compression drops in
            residuals (None: on for biased methods such as Int8, TopK, PowerSGD).
        on_nonfinite: ``"skip"`` (a step where a rank's gradient holds a NaN/Inf gives all-NaN
            gradients and its residuals are rolled back; ``gz.skip_nonfinite(optimizer, state)``
            or a GradScaler then skips the optimizer's step, and without either the first such
            step warns; a non-finite weight shard makes its group's gathered weights NaN on
            every rank) or ``"raise"``
            (``FloatingPointError`` from ``backward()``, or from the forward for weights).

    Raises ``ValueError`` where FSDP2 cannot take a custom comm or hook: a module with
    several parameter groups (a per-parameter mesh from ``shard_placement_fn``), a module set
    to ``set_allocate_memory_from_process_group_for_comm(True)`` or with another custom comm,
    native HSDP (a 2-D mesh) with ``replicate``.
    """
    checked = _check_compress(model, reduce_scatter, all_gather, replicate, replicate_group)
    return _install(
        model,
        checked,
        reduce_scatter,
        replicate,
        error_feedback=error_feedback,
        replicate_error_feedback=replicate_error_feedback,
        on_nonfinite=on_nonfinite,
    )


@dataclass
class _Checked:
    """What ``_check_compress`` found: the FSDP modules' parameter groups and the three groups."""

    pgs: list  # (name, module, FSDPParamGroup)
    module_names: dict
    ranks: list[int]
    rs_group: dist.ProcessGroup
    shard_group: dist.ProcessGroup
    rep_group: dist.ProcessGroup | None
    gather_method: WeightGather | None


def _check_compress(model, reduce_scatter, all_gather, replicate, replicate_group) -> _Checked:
    """Every refusal of ``compress``, before anything is installed: the arguments, each FSDP
    module's parameter group and comms, and the meshes."""
    if reduce_scatter is None and replicate is None and all_gather is None:
        raise ValueError(
            "gradzip.fsdp.compress: give reduce_scatter= (a codec, or Hierarchical(codec)), all_gather= (Int8(), "
            "FP16(), BF16(), Identity()) and/or replicate= (a codec or protocol)"
        )
    if isinstance(reduce_scatter, Hierarchical):
        if not isinstance(reduce_scatter.inner, Codec):
            raise ValueError(
                f"reduce_scatter=Hierarchical(...) takes a codec across the nodes (Int8(), TopK(0.01), ...), got "
                f"{reduce_scatter.inner!r}"
            )
    elif reduce_scatter is not None and not isinstance(reduce_scatter, Codec):
        raise ValueError(
            f"reduce_scatter must be a gradzip codec (Int8(), TopK(0.01), Identity(), ...) or Hierarchical(codec, "
            f"local_size=L), got {reduce_scatter!r}; protocols that need the whole gradient (PowerSGD, Policy) can "
            "compress the HSDP replica all-reduce (replicate=)"
        )
    gather_method = WeightGather(all_gather) if all_gather is not None else None  # refuses other codecs
    if replicate is not None and replicate_group is None:
        raise ValueError(
            "replicate= needs replicate_group= (mesh['replicate'] of the 2-D mesh whose mesh['shard'] FSDP shards over)"
        )
    if replicate is None and replicate_group is not None:
        raise ValueError(
            "replicate_group= is given without replicate= (the codec or protocol for the replica all-reduce)"
        )
    fsdp_modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise TypeError(
            "gradzip.fsdp.compress needs a model wrapped with torch.distributed.fsdp.fully_shard; "
            "call it after fully_shard"
        )
    module_names = {m: n for n, m in model.named_modules()}

    pgs = []
    for name, m in fsdp_modules:
        groups = _param_groups(m._get_fsdp_state())
        label = name or "<root>"
        if len(groups) > 1:
            raise ValueError(
                f"gradzip.fsdp: module {label!r} has {len(groups)} FSDP parameter groups (shard_placement_fn returned "
                "a ShardPlacementResult with another mesh for some parameters); FSDP2 takes a custom reduce-scatter "
                "or all-reduce hook only with one group per fully_shard call. Return a plain placement (or None) "
                "from shard_placement_fn, or fully_shard those parameters' modules separately"
            )
        if not groups:
            continue
        pg = groups[0]
        if not isinstance(pg.mesh_info, FSDPMeshInfo):
            raise ValueError(
                f"gradzip.fsdp: module {label!r} is replicated, not sharded (FSDP2's replicate); "
                "use gradzip.hooks for DDP"
            )
        if reduce_scatter is not None:
            comm = pg._reduce_scatter_comm
            if type(comm).__name__ == "ProcessGroupAllocReduceScatter":
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} was set to set_allocate_memory_from_process_group_for_comm(True); "
                    "FSDP2 cannot combine it with a custom reduce-scatter. Call "
                    "set_allocate_memory_from_process_group_for_comm(False) (or not at all) "
                    "before gradzip.fsdp.compress"
                )
            if type(comm).__name__ == "SymmMemReduceScatter":
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} was set to set_symm_mem_for_comm(); FSDP2 cannot combine "
                    "symmetric memory with a custom reduce-scatter. Drop the set_symm_mem_for_comm call"
                )
            if isinstance(comm, _Comm):
                raise ValueError(f"gradzip.fsdp.compress was called on this model already (module {label!r})")
            if not isinstance(comm, DefaultReduceScatter):
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} has a custom reduce-scatter already ({type(comm).__name__}); "
                    "FSDP2 takes one per module"
                )
        if all_gather is not None:
            comm = pg._all_gather_comm
            if isinstance(comm, _GatherComm):
                raise ValueError(f"gradzip.fsdp.compress was called on this model already (module {label!r})")
            if type(comm).__name__ == "ProcessGroupAllocAllGather":
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} was set to set_allocate_memory_from_process_group_for_comm(True); "
                    "FSDP2 cannot combine it with a custom all-gather. Call "
                    "set_allocate_memory_from_process_group_for_comm(False) (or not at all) "
                    "before gradzip.fsdp.compress"
                )
            if type(comm).__name__ == "SymmMemAllGather":
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} was set to set_symm_mem_for_comm(); FSDP2 cannot combine "
                    "symmetric memory with a custom all-gather. Drop the set_symm_mem_for_comm call"
                )
            if not isinstance(comm, DefaultAllGather):
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} has a custom all-gather already ({type(comm).__name__}); "
                    "FSDP2 takes one per module"
                )
        if replicate is not None:
            if isinstance(pg.mesh_info, HSDPMeshInfo):
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} uses FSDP2's native HSDP (fully_shard on a 2-D mesh), whose "
                    "replica all-reduce cannot be replaced. Shard over the shard sub-mesh only, "
                    "fully_shard(module, mesh=mesh['shard']), and pass replicate_group=mesh['replicate']"
                )
            if pg._all_reduce_hook is not None:
                raise ValueError(
                    f"gradzip.fsdp: module {label!r} has an all-reduce hook already; FSDP2 takes one per module"
                )
        pgs.append((name, m, pg))
    if not pgs:
        raise ValueError("gradzip.fsdp.compress: the FSDP modules of this model manage no parameters")

    rs_group = pgs[0][2]._reduce_scatter_process_group
    ranks = dist.get_process_group_ranks(rs_group)
    for name, _, pg in pgs[1:]:
        if dist.get_process_group_ranks(pg._reduce_scatter_process_group) != ranks:
            raise ValueError(
                f"gradzip.fsdp: module {name or '<root>'!r} shards over other ranks than module "
                f"{pgs[0][0] or '<root>'!r}; gradzip.fsdp needs every FSDP module of the model on the same mesh"
            )
    rep_group = _group_of(replicate_group) if replicate_group is not None else None
    if rep_group is not None:
        common = set(dist.get_process_group_ranks(rep_group)) & set(ranks)
        if common != {dist.get_rank()}:
            raise ValueError(
                "gradzip.fsdp: replicate_group must be the other dimension of the mesh FSDP shards over "
                f"(it shares ranks {sorted(common)} with the shard group {ranks}); use mesh['replicate'] of the mesh "
                "whose mesh['shard'] was given to fully_shard"
            )

    shard_group = pgs[0][2].mesh_info.shard_process_group
    if dist.get_process_group_ranks(shard_group) != ranks:
        raise ValueError(
            "gradzip.fsdp: FSDP reduce-scatters over other ranks than it all-gathers over "
            f"({ranks} and {dist.get_process_group_ranks(shard_group)})"
        )
    return _Checked(pgs, module_names, ranks, rs_group, shard_group, rep_group, gather_method)


def _install(
    model, checked: _Checked, reduce_scatter, replicate, *, error_feedback, replicate_error_feedback, on_nonfinite
) -> FSDPState:
    """Build the engines and put gradzip's comms and hooks on every checked FSDP module."""
    pgs, ranks = checked.pgs, checked.ranks
    rs_group, shard_group, rep_group = checked.rs_group, checked.shard_group, checked.rep_group
    gather_method, module_names = checked.gather_method, checked.module_names
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    check_real(trained)
    layout = layout_of(trained)
    engine = None
    if reduce_scatter is not None:
        if isinstance(reduce_scatter, Hierarchical):
            method = HierarchicalReduceScatter(reduce_scatter.inner, local_size=reduce_scatter.local_size)
            method.nodes(len(ranks))  # whole nodes, or a ValueError now
        else:
            method = ReduceScatter(reduce_scatter)
        engine = Engine(
            method,
            process_group=rs_group,
            error_feedback=error_feedback,
            on_nonfinite=on_nonfinite,
            layout=layout,
        )
    ag_engine = None
    if gather_method is not None:
        everything = list(model.named_parameters())
        check_real(everything)
        ag_engine = Engine(
            gather_method,
            process_group=shard_group,
            error_feedback=False,
            on_nonfinite=on_nonfinite,
            layout=layout_of(everything),
        )
    rep_engine = None
    if replicate is not None:
        rep_engine = Engine(
            replicate,
            process_group=rep_group,
            error_feedback=replicate_error_feedback,
            on_nonfinite=on_nonfinite,
            layout=layout,
        )
    for e in (engine, rep_engine):  # the gradients' engines: their first non-finite step warns
        if e is not None:
            e.nonfinite_hint = NONFINITE_HINT.format(fix="call gz.skip_nonfinite(optimizer, state)")
    state = FSDPState(model, engine, rep_engine, [], rs_group, rep_group, ag_engine, shard_group)
    for name, m, pg in pgs:
        g = _Group(state, m, name, pg, module_names)
        state.groups.append(g)
        if engine is not None:
            m.set_custom_reduce_scatter(_Comm(g))
        if ag_engine is not None:
            m.set_custom_all_gather(_GatherComm(g))
        if engine is not None or ag_engine is not None:
            _guard_allocator(m)
        if rep_engine is not None:
            m.set_all_reduce_hook(_Hook(g))
    if state._gather_only:
        state._hooks.append(model.register_forward_hook(state._after_forward))
    return state


def _guard_allocator(module: FSDPModule) -> None:
    """FSDP2 raises a bare AssertionError (after switching the all-gather comm) when
    ``set_allocate_memory_from_process_group_for_comm(True)`` follows a custom reduce-scatter;
    refuse it first, saying what to do."""

    def guarded(enable: bool) -> None:
        if enable:
            raise ValueError(
                "set_allocate_memory_from_process_group_for_comm(True) cannot be combined with gradzip's compressed "
                "reduce-scatter or all-gather (FSDP2 allows no custom comm with the process-group allocator); leave it "
                "off, or call state.remove() first to give FSDP its own comms back"
            )
        # False: the allocator is off already (compress refuses a module that has it on), and
        # FSDP's own method would assert on the custom reduce-scatter.

    module.__dict__["set_allocate_memory_from_process_group_for_comm"] = guarded
