"""The Codec role: a tensor to a Payload and back, with error feedback. No communication.

A codec is pure: it never talks to other ranks. How its payloads travel is a
protocol's business (:mod:`gradzip.protocols`); a codec only says whether its
payload bodies may be added up by an allreduce (``summable``) and, where it needs
one, which protocol carries it (``protocol``, a registered protocol name).

What a codec declares (``summable``, ``biased``, ``exact``, ``rounds_sum``, ``framable``,
``keeps_zeros``, ``fixed_frames``, ``sparse``, ``scope``, ``protocol``, ``formats``) and
does (``compress``/``decompress``, ``accumulate`` and its batched forms, ``encode`` with error
feedback inside the call, and for frames checked on the device ``planned_entry`` and
``planned_status``) is on :class:`Codec`. Per-tensor state lives in ``ctx.store``, owned
and checkpointed by the engine, so one codec object can serve several front ends. An argument
documented as accepting a schedule (``TopK``/``RandomK`` ``ratio``, ``Threshold`` ``density``)
is checked with :func:`gradzip.warmup.check` and read with ``warmup.at(value, ctx.step)``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..registry import Registered
from ..wire import FrameError, Payload, accum_dtype, formats, itemsize

__all__ = ["Codec", "MessageChecks", "TensorContext", "tensor_seed", "check_input", "FrameError"]


@dataclass
class TensorContext:
    """What a codec may know about the tensor it is compressing.

    ``store`` is this tensor's own state (adaptive thresholds, counters). It is
    owned by the front end, saved in its ``state_dict()``, and holds only
    tensors and plain Python values. ``dtype`` is the gradient's dtype (the
    input may have been promoted to float32 by error feedback). ``rank`` and
    ``world_size`` let stochastic codecs draw independent randomness per
    rank (shared-randomness ones must not use ``rank``).

    Args:
        name: the tensor's name (its parameter's, or a protocol's key for a piece).
        step: the engine's step counter.
        dtype: the gradient's dtype.
        store: the tensor's state (a dict of tensors and plain values).
        rank: this rank in the process group.
        world_size: the process group's size.
        k: how many elements the protocol allotted this tensor (``scope="call"`` codecs,
            :meth:`Codec.allot`), or None: the codec's own count.
    """

    name: str = ""
    step: int = 0
    dtype: torch.dtype = torch.float32
    store: dict = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    k: int | None = None


def check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"gradients must be real floating point, got {x.dtype}")


class MessageChecks:
    """:meth:`Codec.check_frame` and :meth:`Codec.check_frames` from one ``_first_bad(payloads)``:
    ``(index, FrameError)`` of the first frame that no encoder of this configuration writes, or
    None, found with one host read for the whole message. Mixed in before :class:`Codec`."""

    def _first_bad(self, payloads) -> tuple[int, FrameError] | None:
        raise NotImplementedError

    def check_frame(self, payload) -> None:
        bad = self._first_bad([payload])
        if bad is not None:
            raise bad[1]

    def check_frames(self, payloads) -> None:
        bad = self._first_bad(list(payloads))
        if bad is not None:
            raise bad[1].at(frame=bad[0])


class Codec(Registered, register=False):
    """Base class of the codecs.

    Subclasses set ``summable`` (payload bodies may be added by allreduce:
    ``decompress(a + b) == decompress(a) + decompress(b)``), ``biased`` (error
    feedback defaults to on for biased codecs), ``exact`` (the payload is the input
    itself: summing payloads sums the inputs bit for bit), ``rounds_sum`` (summing
    payloads in their wire dtype rounds the sum: float16), and ``formats`` (the wire
    format codes they write). ``protocol`` names the protocol that carries
    the payloads when it is not the default one for ``summable``.

    Args: none here; each codec documents its own. Subclasses take their arguments as
    keywords that ``config()`` reads back from attributes of the same names.
    """

    kind = "codec"
    summable: ClassVar[bool] = False
    biased: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    rounds_sum: ClassVar[bool] = False
    framable: ClassVar[bool] = True  # a payload decodes from its frame alone (no local data)
    sparse: ClassVar[bool] = False  # sends some coordinates whole, the rest not at all (momentum masking)
    #: a zero element decodes to zero whatever else the tensor holds: ``Flat`` then sends a
    #: tensor DDP found unused (its range all zeros) as zeros and leaves its residual alone.
    #: Not SignSGD (a zero is sent as ``+S``) nor DCT (coefficients mix neighbouring elements).
    keeps_zeros: ClassVar[bool] = True
    #: every rank's frame of a tensor has the same entry and length, a function of its shape, dtype
    #: and the codec's configuration (not of its values): AllGather then needs no size round
    fixed_frames: ClassVar[bool] = False
    protocol: str | None = None
    #: ``"call"``: the codec chooses what to send over all tensors of a call at once
    #: (:meth:`allot`), and only ``AllGather`` carries it; ``"tensor"``: tensor by tensor.
    scope: str = "tensor"
    #: How receivers average: ``"ranks"``, the sum of the ranks' frames over the world size;
    #: ``"senders"`` (a sparse codec's option, carried by ``AllGather`` alone): each element
    #: over the ranks whose frames sent it (:meth:`sent_mask`).
    average: str = "ranks"

    def allot(self, xs, ctxs) -> list:
        """Per tensor, how many elements to send when the call's flat inputs ``xs`` are
        chosen from together (``scope="call"``); only such codecs implement it."""
        raise NotImplementedError(f"{type(self).__name__} chooses tensor by tensor")

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        raise NotImplementedError

    # -- distrusting received frames ---------------------------------------------------
    def check_frame(self, payload: Payload) -> None:
        """Raise :class:`~gradzip.wire.FrameError` (a ``ValueError`` naming the field) for a
        received frame that this codec, as configured, could not have written for a tensor
        of ``payload.shape``: a format it does not write, a value dtype, a scale or its
        absence, a body length inconsistent with the shape, codes or positions no encoder
        produces. The built-in codecs check every field they read; this default checks
        nothing (a codec of one's own validates in its decoder)."""

    def check_frames(self, payloads) -> None:
        """:meth:`check_frame` on the frames of one message, in order; a refusal names the
        frame's index (``FrameError.frame``). Codecs whose checks need the frames' bytes on
        the host override it to sync once for the message, by :func:`~gradzip.wire.host_values`
        (a round's padding test comes to the host in the same read)."""
        for i, p in enumerate(payloads):
            try:
                self.check_frame(p)
            except FrameError as e:
                raise e.at(frame=i) from None

    def planned_entry(self, n: int, dtype: torch.dtype | None = None) -> tuple[int, torch.dtype, int, float] | None:
        """The entry every encoder of this configuration writes for a tensor of ``n`` elements
        (``dtype``: its gradient's, where the values travel in it; None: not known),
        ``(format, value dtype, body bytes, scale)``, whatever its values; None where it
        depends on them. A codec that gives it also gives :meth:`planned_status`: a receiver
        on the GPU's side then checks a round's frames on the device against a plan
        (:func:`gradzip.wire.unpack_many`'s ``defer``), with no host read."""
        return None

    @property
    def plans_frames(self) -> bool:
        """Whether this configuration's rounds may be planned (:meth:`planned_entry` gives an
        entry for some sizes): ``TwoPhase`` then relays each owner's verdict on its first round."""
        return self.planned_entry(1) is not None

    def planned_parse(self, payloads) -> torch.Tensor | None:
        """For the frames of a planned round (checked by the plan, not parsed): what the decoder
        needs, parsed on the device with no host read (``Payload.parsed``), and a 0-d bool set
        where a body holds what no encoder writes; None where :meth:`planned_status` checked it all."""
        return None

    def planned_status(self, whole: torch.Tensor, frames) -> torch.Tensor:
        """A 0-d bool on ``whole``'s device: whether a body in ``whole`` (uint8) holds what no
        encoder writes (the body checks of :meth:`check_frames`); ``frames`` gives each body's
        ``(offset, elements)``. Only codecs whose :meth:`planned_entry` is not None implement it."""
        raise NotImplementedError(f"{type(self).__name__} plans no frames")

    def validated(self, payload: Payload) -> Payload:
        """``payload``, checked by :meth:`check_frame` unless a protocol has checked it."""
        if not payload.checked:
            self.check_frame(payload)
            payload.checked = True
        return payload

    def decompress(self, payload: Payload) -> torch.Tensor:
        """Dense tensor of ``payload.shape`` and ``payload.dtype`` (the compressed input's)."""
        raise NotImplementedError

    def dense_wire(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of a body that holds a ``dtype`` tensor's elements one for one, in order,
        whatever their values (a cast's), else None. Such a codec implements
        :meth:`compress_into`: a protocol may then encode a call's tensors straight into one
        wire buffer."""
        return None

    def compress_into(self, x: torch.Tensor, body: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        """:meth:`compress` with the body written into ``body`` (flat, of ``x.numel()``
        elements of :meth:`dense_wire`'s dtype): no tensor of its own. Only codecs whose
        :meth:`dense_wire` is not None implement it."""
        raise NotImplementedError(f"{type(self).__name__} writes bodies of its own")

    def decompress_into(self, payload: Payload, out: torch.Tensor) -> None:
        """``out[:] = decompress(payload)`` for a flat ``out`` of the tensor's size (its dtype
        may differ: the copy converts); override to skip the dense tensor in between."""
        out.copy_(self.decompress(payload).reshape(-1))

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decompress(payload)`` for a flat ``out``; override to skip the dense copy."""
        out.add_(self.decompress(payload).reshape(-1))

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """``accumulate`` every peer's payload of one tensor, in order; override to fuse the peers."""
        for p in payloads:
            self.accumulate(p, out)

    def average_senders(self, payloads, out: torch.Tensor) -> None:
        """``out += `` the peers' payloads averaged element by element over the peers that sent
        each element (:meth:`sent_mask`; an element none sent adds zero): ``average="senders"``."""
        payloads = list(payloads)
        acc = torch.zeros(out.numel(), dtype=accum_dtype(out.dtype), device=out.device)
        self.accumulate_many(payloads, acc)
        senders = torch.zeros_like(acc)
        for p in payloads:
            senders.add_(self.sent_mask(p, acc.numel()).reshape(-1).to(acc.dtype))
        out.add_(acc.div_(senders.clamp_(min=1)).view(out.shape).to(out.dtype))

    def accumulate_segments(self, payloads, out: torch.Tensor, starts) -> None:
        """``accumulate`` payload ``i`` into ``out[starts[i] : starts[i] + payloads[i].numel]``
        of a flat ``out``, the ranges disjoint (TwoPhase's owners' pieces of a call); override
        to decode them together."""
        for p, st in zip(payloads, starts):
            self.accumulate(p, out[st : st + p.numel])

    def sent_mask(self, payload: Payload, n: int) -> torch.Tensor:
        """Bool mask of the ``n`` elements the payload sends (for momentum factor masking)."""
        return self.decompress(payload).reshape(-1) != 0

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        """``v -= decompress(payload)`` in place (``v`` is what was compressed); override to
        subtract only what a sparse payload holds."""
        v.sub_(self.decompress(payload).reshape(v.shape))

    def encode(
        self,
        x: torch.Tensor,
        ctx: TensorContext | None = None,
        residual: torch.Tensor | None = None,
        *,
        feedback: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[Payload, torch.Tensor | None]:
        """Compress ``x`` with error feedback: ``(payload, new residual)``.

        With ``feedback`` the codec compresses ``v = x + residual`` (``residual`` None:
        zero) in the accumulation dtype and returns ``v - decompress(payload)`` as the new
        residual, written into ``out`` when given (``out`` may be ``x`` itself, or hold
        anything: it is overwritten). Without ``feedback`` it compresses ``x`` and returns
        ``None``. This default compensates into ``out``, compresses and subtracts in place;
        codecs with a one-pass kernel (Threshold, SignSGD) override it.
        """
        check_input(x)
        if not feedback:
            if residual is not None:
                raise ValueError("a residual without feedback=True would be dropped")
            return self.compress(x, ctx), None
        v = compensate(x, residual, out)
        payload = self.compress(v, ctx)
        payload.checked = True  # this codec wrote it: its subtraction need not distrust it
        if payload.body.numel() and _shares_memory(payload.body, v):
            payload.body = payload.body.clone()  # v becomes the residual below
        self.subtract(payload, v)
        return payload, v

    def encode_pieces(
        self,
        x: torch.Tensor,
        bounds,
        ctxs,
        residual: torch.Tensor | None = None,
        *,
        feedback: bool = False,
        out: torch.Tensor | None = None,
    ) -> list[Payload]:
        """:meth:`encode` of each piece ``x[bounds[j] : bounds[j+1]]`` of a flat ``x`` with
        context ``ctxs[j]`` (``residual`` and ``out`` flat like ``x``, cut the same way; the
        pieces' new residuals are ``out``'s pieces): TwoPhase's owner pieces of one tensor.
        This default encodes piece by piece; a codec that encodes them together (Int8: one
        launch) overrides it with the same payloads and residuals."""
        pieces = zip(bounds, bounds[1:], ctxs)
        if not feedback:
            return [self.encode(x[a:b], c)[0] for a, b, c in pieces]
        return [
            self.encode(x[a:b], c, None if residual is None else residual[a:b], feedback=True, out=out[a:b])[0]
            for a, b, c in pieces
        ]

    def zeros(self, payload: Payload) -> torch.Tensor:
        return torch.zeros(payload.shape, dtype=accum_dtype(payload.dtype), device=payload.body.device)


def frame_label(codec) -> str:
    return type(codec).__name__


def fmt_name(code: int) -> str:
    return formats().get(code, "unregistered").split(".")[-1]


def check_format(codec, payload: Payload, allowed) -> None:
    """``format``: the frame's code must be one of ``allowed``."""
    if payload.fmt not in allowed:
        can = ", ".join(f"{fmt_name(c)} ({c})" for c in sorted(allowed))
        raise FrameError(
            "format",
            f"{codec!r} cannot decode frame format {payload.fmt} ({fmt_name(payload.fmt)}) for a tensor of "
            f"{payload.numel} elements; it writes {can}",
        )


def check_vdtype(codec, payload: Payload, allowed) -> None:
    """``value dtype``: one of ``allowed`` (frames without values carry code 0, float32)."""
    vdtype = torch.float32 if payload.vdtype is None else payload.vdtype  # None: code 0 on the wire
    if vdtype not in allowed:
        can = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise FrameError(
            "value dtype",
            f"{frame_label(codec)} {fmt_name(payload.fmt)} frames of a {str(payload.dtype).replace('torch.', '')} "
            f"tensor hold {can}, not {str(payload.vdtype).replace('torch.', '')}",
        )


def check_no_scale(codec, payload: Payload) -> None:
    if payload.scale != 0.0:
        raise FrameError(
            "scale", f"{frame_label(codec)} {fmt_name(payload.fmt)} frames carry no scale, got {payload.scale!r}"
        )


_F32_MAX = 3.4028234663852886e38


def check_scale(codec, payload: Payload, what: str) -> float:
    """``scale``: present, positive and finite in float32 (Threshold's tau, TopK's mu)."""
    s = payload.scale
    if not (s > 0.0 and s <= _F32_MAX):
        raise FrameError(
            "scale", f"{frame_label(codec)} {fmt_name(payload.fmt)} frames carry {what} > 0 and finite, got {s!r}"
        )
    return s


def check_length(codec, payload: Payload, want: int, why: str = "") -> None:
    got = payload.body.numel() * payload.body.element_size()
    if got != want:
        raise FrameError(
            "length",
            f"corrupt {frame_label(codec)} frame: {got} bytes, where {fmt_name(payload.fmt)} for "
            f"{payload.numel} elements takes {want}{why}",
        )


def check_dense(codec, payload: Payload, vdtypes) -> None:
    """A ``DENSE`` frame: every element in one of ``vdtypes``, no scale."""
    check_vdtype(codec, payload, vdtypes)
    check_no_scale(codec, payload)
    check_length(codec, payload, payload.numel * itemsize(payload.vdtype))


def check_empty(codec, payload: Payload, scale: str | None = None) -> None:
    """An ``EMPTY`` frame: no body, value dtype code 0; a scale only where ``scale`` names it."""
    check_vdtype(codec, payload, (torch.float32,))
    if scale is None:
        check_no_scale(codec, payload)
    else:
        check_scale(codec, payload, scale)
    check_length(codec, payload, 0)


def compensate(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + residual`` (``residual`` None: zero) in the accumulation dtype, in ``out`` when
    given (``out`` may be ``x``). The values of ``x.to(acc) + residual``."""
    acc = accum_dtype(x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=acc, device=x.device)
    elif out.dtype != acc or out.shape != x.shape:
        raise ValueError(f"out must be a {acc} tensor of shape {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    if residual is None:
        return out if out is x else out.copy_(x)
    return torch.add(x.to(acc), residual.reshape(x.shape), out=out)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def tensor_seed(seed: int, step: int, name: str) -> int:
    """A 63-bit seed that every rank derives identically for (seed, step, tensor name)."""
    h = zlib.crc32(name.encode()) & 0xFFFFFFFF
    x = int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + h * 0x94D049BB133111EB
    x &= (1 << 64) - 1
    x ^= x >> 31
    return x & ((1 << 63) - 1)
