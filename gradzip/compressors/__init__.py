from .base import Compressor, TensorContext
from .cast import BF16, FP16, Identity
from .filter import Filter
from .powersgd import PowerSGD
from .quant import QSGD, Int8, SignSGD, TernGrad
from .sparse import RandomK, TopK
from .threshold import Threshold

__all__ = [
    "Compressor",
    "TensorContext",
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
    "Filter",
    "PowerSGD",
]
