"""The name of Horovod's compiled library (``horovod.torch.mpi_lib_v2``).

gradzip.horovod has no compiled library: its collectives are torch.distributed's (or, on
transport ``"horovod"``, Horovod's own, through ``horovod.torch``). This module exists so that
code which names the extension (``check_extension(..., "mpi_lib_v2")``, ``hvd.mpi_lib_v2``)
finds it; it offers nothing to call.
"""

__all__: list[str] = []
