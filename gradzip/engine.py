"""The engine every front end shares: compress with error feedback, communicate, decode.

A front end (DDP hook, DistributedOptimizer, local SGD) hands the engine a list
of named tensors and gets back a future of their average over the ranks, as
one flat tensor. The engine owns the per-tensor state: residuals, compressor
state and the step counter, and its ``state_dict()`` is what survives a restart.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .comm import Communicator, Round
from .compressors.base import Compressor, TensorContext
from .exchange import Call
from .feedback import ErrorFeedback
from .stats import Stats

STATE_VERSION = 1


class Engine:
    def __init__(
        self,
        compressor: Compressor,
        *,
        process_group=None,
        start_iter: int = 0,
        error_feedback: bool | None = None,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a gradzip Compressor, got {type(compressor).__name__}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an integer in [0, inf), got {start_iter!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        self.compressor = compressor
        self.start_iter = start_iter
        self.error_feedback = compressor.biased if error_feedback is None else error_feedback
        self.memory = ErrorFeedback() if self.error_feedback else None
        self.stats_ = Stats()
        self.comm = Communicator(process_group, self.stats_)
        self.tensor_state: dict[str, dict] = {}
        self.step = 0

    # -- the step ----------------------------------------------------------------------
    def reduce(
        self, names: Sequence[str], tensors: Sequence[torch.Tensor], out_dtype: torch.dtype | None = None
    ) -> torch.futures.Future:
        """Start averaging ``tensors`` over the ranks; a future of one flat tensor.

        The flat result holds the tensors' averages back to back, in ``out_dtype``
        (default: the first tensor's dtype).
        """
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        for name, t in zip(names, tensors):
            if not t.is_floating_point():
                raise TypeError(f"gradient {name!r} must be floating point, got {t.dtype}")
        out_dtype = out_dtype or (tensors[0].dtype if tensors else torch.float32)
        if self.step < self.start_iter:
            return self.comm.submit(self._plain(tensors, out_dtype))
        return self.comm.submit(self._compressed(list(names), list(tensors), out_dtype))

    def flush(self) -> None:
        """Issue all outstanding collectives (call after the last bucket of a step)."""
        self.comm.flush()

    def end_step(self) -> None:
        self.step += 1
        self.stats_.add(steps=1)

    # -- protocols ---------------------------------------------------------------------
    def _plain(self, tensors, out_dtype):
        """Before start_iter: what plain DDP does (divide, then allreduce-sum)."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        flat.div_(self.comm.world_size)
        self.stats_.add(bytes_raw=flat.numel() * flat.element_size(), bytes_payload=flat.numel() * flat.element_size())
        yield Round([self.comm.allreduce(flat)], last=True)
        return flat.to(out_dtype)

    def _context(self, name: str, dtype: torch.dtype) -> TensorContext:
        return TensorContext(
            name=name,
            step=self.step,
            dtype=dtype,
            store=self.tensor_state.setdefault(name, {}),
            rank=self.comm.rank,
            world_size=self.comm.world_size,
        )

    def _compressed(self, names, tensors, out_dtype):
        self.stats_.add(bytes_raw=sum(t.numel() * t.element_size() for t in tensors))
        call = Call(
            comm=self.comm,
            names=names,
            tensors=tensors,
            contexts=[self._context(n, t.dtype) for n, t in zip(names, tensors)],
            memory=self.memory,
            out_dtype=out_dtype,
        )
        return (yield from self.compressor.exchange(call))

    # -- state -------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.stats_.as_dict()

    def state_dict(self) -> dict:
        """Tensors and plain Python values only: ``torch.load(weights_only=True)`` reads it."""
        return {
            "version": STATE_VERSION,
            "compressor": self.compressor.config(),
            "error_feedback": self.error_feedback,
            "step": self.step,
            "residuals": self.memory.state_dict() if self.memory is not None else {},
            "tensor_state": {k: dict(v) for k, v in self.tensor_state.items()},
            "stats": self.stats_.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"state version {sd.get('version')!r} is not supported (expected {STATE_VERSION})")
        saved, mine = sd["compressor"], self.compressor.config()
        for key in sorted(set(saved) | set(mine)):
            if saved.get(key) != mine.get(key):
                raise ValueError(
                    f"compressor config differs from the checkpoint in {key!r}: "
                    f"saved {saved.get(key)!r}, now {mine.get(key)!r}"
                )
        if bool(sd["error_feedback"]) != self.error_feedback:
            raise ValueError(
                f"error_feedback differs from the checkpoint: saved {sd['error_feedback']}, now {self.error_feedback}"
            )
        self.step = int(sd["step"])
        if self.memory is not None:
            self.memory.load_state_dict(sd["residuals"])
        self.tensor_state = {k: dict(v) for k, v in sd["tensor_state"].items()}
        self.stats_.load_state_dict(sd["stats"])

