"""gradzip.kernels: the codec ops that compressors are built from.

Every op has a pure-PyTorch reference in :mod:`gradzip.kernels.reference`; it is
the CPU path and the oracle for GPU kernels. Importing this package never
imports triton or cupy.
"""
from .reference import (
    decode_signed_indices,
    encode_signed_indices,
    pack_2bit,
    threshold_select_reference,
    unpack_2bit,
)

__all__ = [
    "pack_2bit",
    "unpack_2bit",
    "encode_signed_indices",
    "decode_signed_indices",
    "threshold_select_reference",
]
