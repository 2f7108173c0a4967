"""Byte and time accounting.

Bytes are counted by :mod:`gradzip.comm` from the tensors it hands to
``torch.distributed``, never from formulas:

* ``bytes_sent``: bytes of the input tensors this rank handed to collectives,
  padding and size exchanges included.
* ``bytes_raw``: bytes of the gradients those collectives replaced, i.e. what a
  plain allreduce of the same tensors would have been handed.
* ``ratio = bytes_raw / bytes_sent``.
* ``bytes_control``: the part of ``bytes_sent`` that is protocol, not payload:
  size exchanges, non-finite flags, the first step's configuration check.
* ``bytes_allgather``: the part of ``bytes_sent`` handed to all-gathers (the rest
  went to allreduces); a cost model needs both, since they scale differently.
* ``bytes_payload``: message bytes before padding.

Times are wall-clock seconds: ``codec_seconds`` in compress/decompress and error
feedback, ``comm_seconds`` summed over collectives from launch to completion
(collectives run asynchronously, so this can overlap compute and each other).
``codec_cpu_seconds`` is the CPU time of the threads in those codec blocks: below
``codec_seconds`` when a codec thread waits for a core (more busy threads than cores).
"""
from __future__ import annotations

import threading

_FIELDS = (
    "steps",
    "bytes_raw",
    "bytes_sent",
    "bytes_control",
    "bytes_allgather",
    "bytes_payload",
    "collectives",
    "codec_seconds",
    "codec_cpu_seconds",
    "comm_seconds",
)


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.bytes_raw = 0
        self.bytes_sent = 0
        self.bytes_control = 0
        self.bytes_allgather = 0
        self.bytes_payload = 0
        self.collectives = 0
        self.codec_seconds = 0.0
        self.codec_cpu_seconds = 0.0
        self.comm_seconds = 0.0

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        with self._lock:
            d = {k: getattr(self, k) for k in _FIELDS}
        d["ratio"] = d["bytes_raw"] / d["bytes_sent"] if d["bytes_sent"] else 1.0
        d["bytes_sent_per_step"] = d["bytes_sent"] / d["steps"] if d["steps"] else 0.0
        return d

    def state_dict(self) -> dict:
        with self._lock:
            return {k: getattr(self, k) for k in _FIELDS}

    def load_state_dict(self, sd: dict) -> None:
        with self._lock:
            for k in _FIELDS:
                if k in sd:
                    setattr(self, k, type(getattr(self, k))(sd[k]))
