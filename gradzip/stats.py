"""Byte and time accounting.

Bytes are counted by :mod:`gradzip.comm` from the tensors it hands to
``torch.distributed``, never from formulas:

* ``bytes_sent``: bytes of the input tensors this rank handed to collectives,
  padding and size exchanges included.
* ``bytes_raw``: bytes of the gradients those collectives replaced, i.e. what a
  plain allreduce of the same tensors would have been handed.
* ``bytes_link``: bytes this rank sends on its network link, by each collective's
  algorithm (``gradzip.comm``: ring allreduce ``2(N-1)/N * S``, ring all-gather
  ``(N-1) * S``, pairwise all-to-all the bytes addressed to other ranks);
  ``bytes_link_intra``: the part of it inside a node (hierarchical protocols).
* ``bytes_link_raw``: what plain DDP's ring allreduce of the same gradients sends,
  ``2(N-1)/N * bytes_raw``.
* ``ratio = bytes_link_raw / bytes_link``: the compression on the link, against
  plain DDP; ``ratio_handed = bytes_raw / bytes_sent``, against the bytes handed to
  collectives (which flatters all-gathers: they hand over ``S`` and send ``(N-1) * S``).
* ``bytes_control``: the part of ``bytes_sent`` that is protocol, not payload:
  size exchanges, non-finite flags, the first step's configuration check.
* ``bytes_allgather``: the part of ``bytes_sent`` handed to all-gathers (the rest
  went to allreduces); a cost model needs both, since they scale differently.
* ``bytes_payload``: message bytes before padding.

Times are wall-clock seconds: ``codec_seconds`` in gradzip's own work outside the
collectives (error feedback, compress, framing, decode, the engine's checks),
``comm_seconds`` summed over collectives from launch to completion (collectives
run asynchronously, so this can overlap compute and each other).
``codec_cpu_seconds`` is the CPU time of the threads in those codec blocks: below
``codec_seconds`` when a codec thread waits for a core (more busy threads than cores).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

__all__ = ["Stats"]


@dataclass
class Stats:
    steps: int = 0
    bytes_raw: int = 0
    bytes_sent: int = 0
    bytes_control: int = 0
    bytes_allgather: int = 0
    bytes_payload: int = 0
    bytes_link: float = 0.0
    bytes_link_intra: float = 0.0
    bytes_link_raw: float = 0.0
    collectives: int = 0
    codec_seconds: float = 0.0
    codec_cpu_seconds: float = 0.0
    comm_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_")]

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def reset(self) -> None:
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_"):
                    setattr(self, f.name, f.default)

    def state_dict(self) -> dict:
        with self._lock:
            return {k: getattr(self, k) for k in self.names()}

    def as_dict(self) -> dict:
        d = self.state_dict()
        d["ratio"] = d["bytes_link_raw"] / d["bytes_link"] if d["bytes_link"] else 1.0
        d["ratio_handed"] = d["bytes_raw"] / d["bytes_sent"] if d["bytes_sent"] else 1.0
        d["bytes_sent_per_step"] = d["bytes_sent"] / d["steps"] if d["steps"] else 0.0
        return d

    def load_state_dict(self, sd: dict) -> None:
        """Fields missing from ``sd`` (a state saved before they existed) keep their values."""
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_") and f.name in sd:
                    setattr(self, f.name, type(f.default)(sd[f.name]))
