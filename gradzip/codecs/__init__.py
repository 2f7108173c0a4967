"""Codecs: pure tensor <-> payload transforms with error feedback; one file per family."""

from .base import Codec, TensorContext, tensor_seed
from .cast import BF16, FP16, Identity
from .quant import QSGD, Int8, SignSGD, TernGrad
from .randomk import RandomK
from .threshold import Threshold
from .topk import TopK
from .transform import DCT

__all__ = [
    "Codec",
    "TensorContext",
    "tensor_seed",
    "Identity",
    "FP16",
    "BF16",
    "Threshold",
    "TopK",
    "RandomK",
    "SignSGD",
    "QSGD",
    "TernGrad",
    "Int8",
    "DCT",
]
