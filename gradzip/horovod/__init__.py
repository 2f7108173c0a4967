"""``import gradzip.horovod as hvd``: a drop-in for ``horovod.torch`` (0.28.1) in a training script.

    import gradzip.horovod as hvd                 # was: import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.none)   # or gz.TopK(0.01), "PowerSGD(rank=2)"
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

Every public name of ``horovod.torch`` is here, with its submodules (``mpi_ops``, ``functions``,
``compression``, ``optimizer``, ``sync_batch_norm``, ``elastic``, ``mpi_lib_v2``);
docs/horovod.md is the table of names and of what differs from Horovod.

**Transports.** ``init()`` sets up ``torch.distributed`` (gloo; NCCL for CUDA tensors) from the
environment of ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) or of
``horovodrun --gloo`` (``HOROVOD_RANK``, ``HOROVOD_SIZE``, and the rendezvous server it runs:
rank 0 publishes the address of a ``TCPStore`` there under a key of each ``init()``'s own, the
others read it), or uses a process group that is already initialised; without a launcher it
is a world of one process. That is ``transport="torch"``, the default. ``init(transport=
"horovod")`` (or ``GRADZIP_HOROVOD_TRANSPORT=horovod``) instead initialises Horovod itself
under ``horovodrun`` and runs everything on Horovod's collectives: the optimizer's protocols
through :class:`gradzip.comm_horovod.HorovodCommunicator`, the other calls through
``horovod.torch``. ``DistributedOptimizer(..., transport=...)`` picks per optimizer.

**A codec without editing the script**: ``GRADZIP_COMPRESSION="TopK(0.01)"`` makes
``DistributedOptimizer`` run that method where the script asks for ``Compression.none`` or
``fp16`` (:mod:`gradzip.horovod.compression`).
"""

from __future__ import annotations

from . import compression, elastic, functions, mpi_lib_v2, mpi_ops, optimizer, sync_batch_norm
from .compression import Compression, HorovodCompressor, adapt
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
    transport,
)
from .optimizer import DistributedOptimizer, _HorovodOptimizer  # noqa: F401 - the front-end mixin (test_contract)
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    # the process layout
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "transport",
    # constants, errors, process sets
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
    # collectives
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
    "allgather_object",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "barrier",
    "poll",
    "synchronize",
    # the build and the timeline
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
    "start_timeline",
    "stop_timeline",
    "check_extension",
    # the optimizer, compression, batch norm
    "DistributedOptimizer",
    "Compression",
    "HorovodCompressor",
    "adapt",
    "SyncBatchNorm",
    # submodules
    "compression",
    "elastic",
    "functions",
    "mpi_lib_v2",
    "mpi_ops",
    "optimizer",
    "sync_batch_norm",
]


def check_extension(ext_name, ext_env_var, pkg_path, *args) -> None:
    """Horovod's check that a framework extension was built. gradzip.horovod needs none (its
    collectives are torch.distributed's): this returns for ``horovod.torch``/``gradzip.horovod``
    and raises ImportError, in Horovod's words, for another framework's extension."""
    if ext_name in ("horovod.torch", "gradzip.horovod"):
        return
    raise ImportError(
        f"Extension {ext_name} has not been built: gradzip.horovod provides horovod.torch only\n"
        f"If this is not expected, reinstall Horovod with {ext_env_var}=1 to debug the build error."
    )
