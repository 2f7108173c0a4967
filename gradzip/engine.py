"""The engine every front end shares: compress with error feedback, communicate, decode.

A front end (DDP hook, DistributedOptimizer, local SGD) hands the engine a list
of named tensors and gets back a future of their average over the ranks, as
one flat tensor. The engine owns the per-tensor state: residuals, compressor
state and the step counter, and its ``state_dict()`` is what survives a restart.

Safety nets, all decided identically on every rank:

* **Config check.** The first call of an engine all-gathers a description of the
  configuration (compressor config, error feedback, start_iter, on_nonfinite,
  and a hash of the parameter layout when the front end gave one). A mismatch
  raises ``ValueError`` naming the differing field, on every rank.
* **Non-finite gradients.** Every call adds a one-element allreduce(MAX) of
  "this rank saw a NaN/Inf" to its first round, except a call that sums every
  tensor as it is (Identity): there a NaN/Inf on any rank shows in the average,
  which every rank checks anyway. If any rank saw one (or the
  average itself overflows the gradient's dtype), the call's
  result is all NaN (``on_nonfinite="skip"``: GradScaler then skips the step, as
  it would without compression) or every rank raises ``FloatingPointError``
  (``"raise"``). Either way, when the step ends, the residuals and compressor
  state of every tensor touched in that step are put back as they were before
  it: a skipped step never poisons the residual.
"""
from __future__ import annotations

import hashlib
import json
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from .comm import Communicator, Round, allgather_bytes
from .compressors.base import Compressor, TensorContext
from .exchange import Call, _all_finite, _back_to_back, codec_time
from .feedback import ErrorFeedback
from .stats import Stats

STATE_VERSION = 1
_NONFINITE_POLICIES = ("skip", "raise")


def layout_of(named_tensors) -> list:
    """``[(name, shape, dtype)]``: what the config check compares across ranks."""
    return [(n, list(t.shape), str(t.dtype).replace("torch.", "")) for n, t in named_tensors]


class Engine:
    def __init__(
        self,
        compressor: Compressor,
        *,
        process_group=None,
        start_iter: int = 0,
        error_feedback: bool | None = None,
        on_nonfinite: str = "skip",
        layout: list | None = None,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a gradzip Compressor, got {type(compressor).__name__}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an integer in [0, inf), got {start_iter!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        if on_nonfinite not in _NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {list(_NONFINITE_POLICIES)}, got {on_nonfinite!r}")
        self.compressor = compressor
        self.start_iter = start_iter
        self.on_nonfinite = on_nonfinite
        self.error_feedback = compressor.biased if error_feedback is None else error_feedback
        self.memory = ErrorFeedback() if self.error_feedback else None
        self.stats_ = Stats()
        self.comm = Communicator(process_group, self.stats_)
        self.tensor_state: dict[str, dict] = {}
        self.step = 0
        self.layout = layout
        self._verified = False
        # Bookkeeping of the open step (touched from callback threads too).
        self._lock = threading.Lock()
        self._inflight = 0
        self._step_ended = False
        self._nonfinite = False
        self._undo_residual: dict = {}
        self._undo_store: dict = {}

    # -- the step ----------------------------------------------------------------------
    def reduce(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        out_dtype: torch.dtype | None = None,
        *,
        dest: torch.Tensor | None = None,
    ) -> torch.futures.Future:
        """Start averaging ``tensors`` over the ranks; a future of one flat tensor.

        The flat result holds the tensors' averages back to back, in ``out_dtype``
        (default: the first tensor's dtype).

        ``dest``: a contiguous tensor of as many ``out_dtype`` elements that the result
        may be written into (and returned as), such as DDP's bucket buffer. ``tensors``
        may be views of it; they are then overwritten, as DDP's own allreduce does.
        """
        names, tensors = list(names), list(tensors)
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        for name, t in zip(names, tensors):
            if not t.is_floating_point():
                raise TypeError(f"gradient {name!r} must be floating point, got {t.dtype}")
        out_dtype = out_dtype or (tensors[0].dtype if tensors else torch.float32)
        with self._lock:
            self._inflight += 1
        return self.comm.submit(self._protocol(names, tensors, out_dtype, dest))

    def flush(self) -> None:
        """Issue all outstanding collectives (call after the last bucket of a step)."""
        self.comm.flush()

    def end_step(self) -> None:
        """Close the step. Its rollback (if any rank saw a NaN/Inf) happens once its calls are done."""
        self.step += 1
        self.stats_.add(steps=1)
        with self._lock:
            self._step_ended = True
            self._finish_step_locked()

    # -- protocols ---------------------------------------------------------------------
    def _protocol(self, names, tensors, out_dtype, dest=None):
        step = self.step  # end_step() may run before this call's last round completes
        try:
            if not self._verified:
                device = tensors[0].device if tensors else torch.device("cpu")
                yield from self._verify(device)
                self._verified = True
            self._snapshot(names)
            seen: list = []  # before start_iter: names of this rank's non-finite inputs
            if self.step < self.start_iter:
                call = None
                inner = self._plain(names, tensors, out_dtype, dest, seen)
            else:
                self.stats_.add(bytes_raw=sum(t.numel() * t.element_size() for t in tensors))
                call = Call(
                    comm=self.comm,
                    names=names,
                    tensors=tensors,
                    contexts=[self._context(n, t.dtype) for n, t in zip(names, tensors)],
                    memory=self.memory,
                    out_dtype=out_dtype,
                    dest=dest,
                    name_nonfinite=self.on_nonfinite == "raise",
                )
                inner = self.compressor.exchange(call)
            out, bad, local = yield from self._with_nonfinite_flag(inner, call, tensors, seen)
            # Finite inputs can still average to more than the output dtype holds (an
            # overflowing float16 gradient). Every rank holds the same ``out``, so every
            # rank decides alike without talking.
            with codec_time(self.stats_):
                bad = bad or not _all_finite([out])
            if bad:
                with self._lock:
                    self._nonfinite = True
                if self.on_nonfinite == "raise":
                    where = f"in {local} on rank {self.comm.rank}" if local else "on another rank"
                    raise FloatingPointError(f"non-finite gradient {where} at step {step}")
                out = torch.full_like(out, float("nan"))
            return out
        finally:
            if self.memory is not None:
                self.memory.release(names)
            with self._lock:
                self._inflight -= 1
                self._finish_step_locked()

    def _with_nonfinite_flag(self, inner, call, tensors, seen):
        """Run ``inner``, adding the one-element non-finite allreduce to its first round.
        Returns ``(out, any rank saw a non-finite input, this rank's non-finite names)``."""
        flag = torch.zeros(1, dtype=torch.int32, device=tensors[0].device if tensors else torch.device("cpu"))
        try:
            rnd = next(inner)  # the exchange has compressed (and compensated) by now
        except StopIteration as stop:
            rnd, out = None, stop.value
        # Tensors summed as they are were checked by their exchange before it reduced
        # them (the collective may be reducing them in place now).
        local = list(call.nonfinite) if call is not None else seen
        if call is not None:
            idx = [i for i in range(len(tensors)) if call.names[i] not in call.plain]
            with codec_time(self.stats_):
                if not _all_finite([call.peek(i) for i in idx]):
                    local += [call.names[i] for i in idx if not _all_finite([call.peek(i)])]
        # A call whose tensors are all summed as they are (Identity, a policy's plain route)
        # needs no flag: a non-finite input on any rank makes the average non-finite on every
        # rank, which the output check sees. (Which tensors are plain follows from the
        # configuration, so every rank decides alike.)
        work = None
        if call is None or not call.all_plain:
            if local:
                flag.fill_(1)
            work = self.comm.allreduce(flag, op=dist.ReduceOp.MAX, control=True)
        if rnd is None:  # the exchange sent nothing: the flag goes alone
            if work is not None:
                yield Round([work], last=True)
            return out, bool(flag.item()), local
        if work is not None:
            rnd = Round(rnd.works + [work], rnd.last)
        while True:
            yield rnd
            try:
                rnd = next(inner)
            except StopIteration as stop:
                return stop.value, bool(flag.item()), local

    def _plain(self, names, tensors, out_dtype, dest, seen):
        """Before start_iter: what plain DDP does (divide, then allreduce-sum). Names of
        non-finite inputs go to ``seen``, read before the in-place division."""
        flat = _back_to_back([t.reshape(-1) for t in tensors], dest)
        if flat is None:
            flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        if self.on_nonfinite == "raise" and not _all_finite([flat]):  # else the output shows it
            seen += [n for n, t in zip(names, tensors) if not _all_finite([t])]
        flat.div_(self.comm.world_size)
        nbytes = flat.numel() * flat.element_size()
        self.stats_.add(bytes_raw=nbytes, bytes_payload=nbytes)
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

    # -- config check ------------------------------------------------------------------
    def describe(self) -> dict:
        """What every rank must agree on (flat keys, plain values)."""
        d = {f"compressor.{k}": v for k, v in self.compressor.config().items()}
        d.update(error_feedback=self.error_feedback, start_iter=self.start_iter, on_nonfinite=self.on_nonfinite)
        if self.layout is not None:
            blob = json.dumps(self.layout, sort_keys=True).encode()
            d["layout"] = f"{len(self.layout)} tensors, sha256 {hashlib.sha256(blob).hexdigest()[:16]}"
        return d

    def _verify(self, device):
        mine = self.describe()
        blob = json.dumps(mine, sort_keys=True, default=str).encode()
        msg = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        gathered = yield from allgather_bytes(self.comm, msg, last=False, control=True)
        descs = [json.loads(bytes(row.cpu().numpy()).rstrip(b"\0")) for row in gathered]
        keys = sorted(set().union(*descs), key=lambda k: (k != "compressor.name", k))  # the class first
        for key in keys:
            values = [d.get(key, "<missing>") for d in descs]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                raise ValueError(f"gradzip configuration differs across ranks in {key!r} ({shown})")

    # -- non-finite rollback -----------------------------------------------------------
    def _snapshot(self, names) -> None:
        with self._lock:
            for n in names:
                if n not in self._undo_store:
                    self._undo_store[n] = dict(self.tensor_state.get(n, {}))
                    self._undo_residual[n] = self.memory.residual(n) if self.memory is not None else None

    def _finish_step_locked(self) -> None:
        if not self._step_ended or self._inflight:
            return
        if self._nonfinite:
            for n, store in self._undo_store.items():
                self.tensor_state[n] = store
                if self.memory is not None:
                    r = self._undo_residual[n]
                    if r is None:
                        self.memory.residuals.pop(n, None)
                    else:
                        self.memory.residuals[n] = r
        self._nonfinite = False
        self._step_ended = False
        self._undo_store = {}
        self._undo_residual = {}

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
