"""Codec profiles: codec seconds per method, measured on this machine or read from JSON.

A :class:`CodecProfile` holds, per (method config, error feedback), an affine fit
``a + b*n`` of the codec seconds for one tensor of ``n`` elements, plus
``(N-1)*(c + d*n)`` for protocols that all-gather (every rank decodes every
peer). :func:`measure_codec` fits it from dry runs (``docs/costmodel.md``).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

import gradzip.args as args

from ..feedback import ErrorFeedback
from ..machine import machine
from .dryrun import dry_run

__all__ = ["CodecFit", "CodecProfile", "measure_codec", "as_profile", "sample", "sample_shape"]


@dataclass
class CodecFit:
    """Codec seconds for one tensor of ``n`` elements on ``N`` ranks:
    ``encode_s + encode_s_per_elem * n + (N - 1) * (peer_s + peer_s_per_elem * n)
    + (owner_s + owner_s_per_elem * n) / N``.

    The peer terms are the work per peer decoded (an all-gather's); the owner terms are work
    on this rank's ``1/N`` share of the tensor (TwoPhase's owner re-encodes its piece)."""

    encode_s: float
    encode_s_per_elem: float
    peer_s: float = 0.0
    peer_s_per_elem: float = 0.0
    owner_s: float = 0.0
    owner_s_per_elem: float = 0.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            setattr(self, k, args.number(k, v, 0.0))

    @classmethod
    def of(cls, e: dict, elem_scale: float = 1.0) -> CodecFit:
        """The fit in a profile's entry (terms absent from older files are 0), per-element
        terms times ``elem_scale``."""
        return cls(
            e["encode_s"],
            elem_scale * e["encode_s_per_elem"],
            e.get("peer_s", 0.0),
            elem_scale * e.get("peer_s_per_elem", 0.0),
            e.get("owner_s", 0.0),
            elem_scale * e.get("owner_s_per_elem", 0.0),
        )

    def seconds(self, numel: int, world: int) -> float:
        return (
            self.encode_s
            + self.encode_s_per_elem * numel
            + max(world - 1, 0) * (self.peer_s + self.peer_s_per_elem * numel)
            + (self.owner_s + self.owner_s_per_elem * numel) / max(world, 1)
        )


def sample(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)


def sample_shape(numel: int) -> tuple[int, int]:
    """The 2-D shape a profile measures ``numel`` elements in: ``(numel // m, m)`` with
    ``m`` the largest power of two not above ``sqrt(numel)`` (square for powers of 4)."""
    numel = args.integer("profile size", numel, 4)
    m = 1 << (int(math.isqrt(numel)).bit_length() - 1)
    return (numel // m, m)


def _fit_line(x0: float, y0: float, x1: float, y1: float) -> tuple[float, float]:
    slope = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 - slope * x0, 0.0), slope


def _fit_worlds(worlds: tuple, times: list, peers: bool) -> tuple[float, float, float]:
    """``(A, B, C) >= 0`` with ``times[i] ~ A + B (W_i - 1) + C / W_i`` in least squares over the
    world sizes ``W_i`` (``B`` only if ``peers``; ``C`` only with three or more worlds): the
    first of the term subsets, largest first, whose fit has no negative term; else ``A`` alone,
    the mean (clipped to 0)."""
    w = np.asarray(worlds, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    cols = {"B": w - 1, "C": 1 / w}
    allowed = {*(("B",) if peers else ()), *(("C",) if len(worlds) >= 3 else ())}
    for sub in (("B", "C"), ("B",), ("C",)):
        if set(sub) <= allowed:
            coef = np.linalg.lstsq(np.stack([np.ones_like(w)] + [cols[c] for c in sub], axis=1), t, rcond=None)[0]
            if (coef >= 0).all():
                got = dict(zip(("A", *sub), coef.tolist()))
                return got["A"], got.get("B", 0.0), got.get("C", 0.0)
    return max(float(t.mean()), 0.0), 0.0, 0.0


#: Steps of a stateful codec (adaptive tau, warm-started factors) run on the small sample before
#: it is timed, so that it is timed in its settled state: adaptive Threshold's default growth
#: (1.035 a step) takes about 230 steps from tau = 1e-3 to the band on unit-scale samples.
SETTLE_STEPS = 300


def settled_stores(comp, xs, *, names, world: int, error_feedback, **kw) -> tuple[dict | None, int]:
    """``(stores, step)`` for a dry run of ``comp`` to start from: for a codec that keeps
    per-tensor state under ``names``, that state after :data:`SETTLE_STEPS` dry runs on ``xs``
    among ``world`` ranks, and the step after them; ``(None, 0)`` for a codec that keeps none
    (one dry run). ``kw``: more :func:`dry_run` arguments (``flag``, ``decode``, ``sync``)."""
    stores: dict = {}
    kw = dict(world_size=world, names=names, error_feedback=error_feedback, stores=stores, **kw)
    dry_run(comp, xs, **kw)
    if not any(stores.values()):
        return None, 0
    for step in range(1, SETTLE_STEPS):
        dry_run(comp, xs, step=step, **kw)
    return stores, SETTLE_STEPS


def measure_codec(
    comp,
    *,
    error_feedback: bool | None = None,
    sizes: tuple[int, int] = (4096, 1 << 20),
    worlds: tuple[int, ...] = (2, 4, 8),
    repeats: int = 5,
    threads: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    whole_call: bool = False,
) -> tuple[CodecFit, dict]:
    """Time ``comp``'s codec on this machine; returns the fit and the raw timings.

    For each size ``n`` in ``sizes`` (a ``sample_shape(n)`` Gaussian tensor) and each
    world size ``W`` in ``worlds``, runs :func:`dry_run` once to warm up, then
    ``repeats`` times, and keeps the fastest codec seconds (the least disturbed by
    other processes; a shared machine inflates the mean, not the minimum). A codec that
    keeps per-tensor state (adaptive Threshold's tau, PowerSGD's warm-start Q) is first run
    :data:`SETTLE_STEPS` steps on the small sample at each ``W`` (its state is keyed by name,
    and TwoPhase's pieces by ``W``), and every timed run starts from a copy of that settled
    state: timed at step 0, adaptive Threshold would send nearly everything. With error
    feedback, the warm-up and the timed runs share one memory, rolled back after each
    (``ErrorFeedback.restore``): every run starts with no residual, as the settling did, and
    writes its residuals into the buffers the run before freed, as a steady-state step does.
    With a fresh memory per run, every run paged in new residual buffers, which no step after
    the first does. A plain protocol (Identity: the tensors summed as they are; the warm-up's
    :attr:`DryRun.plain`) is timed on the sample laid out as DDP's bucket (``dry_run(bucket=True)``):
    in a step it sends the bucket as it is, and timed on a loose tensor it would be charged a
    copy into a new buffer that no step makes. Other protocols keep the loose tensor and write
    into a new output: in the plan check (``docs/costmodel.md``) the bucket layout for them read
    every compressed method's step short, the new output standing in for what ranks sharing the
    cores and memory pay and a one-process profile does not see.

    The terms in ``N``: at each size, the seconds at the worlds are fitted as
    ``A + B (N - 1) + C / N`` (least squares, every term ``>= 0``, :func:`_fit_worlds`): ``A``
    this rank's own work, ``B`` per peer decoded (only for an exchange that all-gathers; one
    that only allreduces decodes once), ``C`` the work on the ``1/N`` share this rank owns
    (only with three or more worlds). The lines through the two sizes give ``encode_*``,
    ``peer_*`` and ``owner_*``. ``worlds`` default to ``(2, 4, 8)``: TwoPhase's owner
    re-encodes ``1/N`` of every tensor, so its seconds fall with ``N``, which a line in
    ``N - 1`` alone cannot follow; on one rank (``N = 1``) a protocol that splits tensors among the ranks does what
    it never does in use. Negative intercepts or
    slopes (timing noise) are clipped to 0. ``threads`` sets torch's intra-op
    threads while timing (``None``: leave them as they are); CPU codecs run one
    rank per core or so, and more threads than free cores makes timings erratic.

    ``device``: where the sample tensors live (default the CPU). ``whole_call``: time the
    whole dry run instead of its ``call.codec()`` blocks, less the loopback's stand-ins
    for the collectives (:attr:`DryRun.loopback_seconds`), with the device synchronized
    around each (kernels run asynchronously on a GPU, so a block's wall clock would time
    their launches only). It includes the protocol's Python between the blocks, as a
    real step pays it. A CUDA ``device`` implies ``whole_call``.
    """
    n0, n1 = sizes
    worlds = tuple(worlds)
    if not (4 <= n0 < n1):
        raise ValueError(f"sizes must be two integers 4 <= n0 < n1, got {sizes!r}")
    if len(worlds) < 2 or worlds[0] < 1 or any(a >= b for a, b in zip(worlds, worlds[1:])):
        raise ValueError(f"worlds must be two or more increasing integers >= 1, got {worlds!r}")
    repeats = args.integer("repeats", repeats, 1)
    threads = args.optional(args.integer, "threads", threads, 1)
    device = torch.device(device) if device is not None else torch.device("cpu")
    whole_call = bool(whole_call) or device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    raw: dict[str, float] = {}
    gathers = False
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        small = sample(sample_shape(n0), dtype, seed=n0).to(device)
        settled = {
            w: settled_stores(comp, [small], names=["sample"], world=w, error_feedback=error_feedback, sync=sync)
            for w in worlds
        }
        for n in (n0, n1):
            x = sample(sample_shape(n), dtype, seed=n).to(device)
            for w in worlds:
                times = []
                stores, step = settled[w]
                memory = ErrorFeedback()  # one for every run, rolled back after each (docstring)
                plain = False
                for r in range(repeats + 1):
                    d = dry_run(
                        comp,
                        [x],
                        world_size=w,
                        names=["sample"],
                        error_feedback=error_feedback,
                        sync=sync,
                        stores=copy.deepcopy(stores) if stores is not None else None,
                        step=step,
                        memory=memory,
                        bucket=plain,
                    )
                    memory.restore()
                    plain = plain or d.plain  # the warm-up says: the timed runs get a bucket
                    gathers = gathers or any(c.kind == "allgather" for c in d.collectives)
                    if r:
                        times.append(max(d.wall_seconds - d.loopback_seconds, 0.0) if whole_call else d.codec_seconds)
                raw[f"n={n},W={w}"] = min(times)
    finally:
        torch.set_num_threads(saved)
    # Per size, the terms in N (all >= 0): A (this rank's own encode), B per peer decoded (an
    # exchange that all-gathers; one that only allreduces decodes once), C for the 1/N share it
    # owns (TwoPhase's owner re-encodes its piece: at 4 ranks half its cost at 2).
    terms = {n: _fit_worlds(worlds, [raw[f"n={n},W={w}"] for w in worlds], gathers) for n in (n0, n1)}
    a, b = _fit_line(n0, terms[n0][0], n1, terms[n1][0])
    c, d_ = _fit_line(n0, terms[n0][1], n1, terms[n1][1])
    e, f = _fit_line(n0, terms[n0][2], n1, terms[n1][2])
    return CodecFit(a, b, c, d_, e, f), raw


PROFILE_KIND = "gradzip-codec-profile"
PROFILE_VERSION = 1


class CodecProfile:
    """Codec fits per (compressor config, error feedback), measured or loaded.

    ``fit(comp)`` returns the stored fit; for a compressor it has no fit for, ``missing``
    says what happens: ``"measure"`` (the default; ``measure_missing=True``) measures it on
    this machine and stores it, ``"raise"`` (``measure_missing=False``) raises ``KeyError``
    naming the compressor, ``"omit"`` returns a zero fit and stores nothing (a profile of
    another device: its codec time is not known here, and this machine's is no stand-in).
    Every lookup answered by this machine or by the zero fit is logged in ``fallbacks``.
    ``save(path)``/``load(path)`` use the JSON schema in ``docs/costmodel.md``; a file
    records the machine it was measured on.
    """

    MISSING = ("measure", "raise", "omit")

    def __init__(
        self,
        entries: dict | None = None,
        *,
        machine: dict | None = None,
        measure_missing: bool = True,
        sizes: tuple[int, int] = (4096, 1 << 20),
        worlds: tuple[int, ...] = (2, 4, 8),
        repeats: int = 5,
        threads: int | None = None,
        classes: list | None = None,
        dtype: str = "float32",
        elem_scale: float = 1.0,
        missing: str | None = None,
    ) -> None:
        self.entries: dict[str, dict] = dict(entries or {})
        self.machine = machine
        #: What ``fit`` does without a fit: ``"measure"``, ``"raise"`` or ``"omit"`` (above).
        self.missing = args.choice(
            "missing", missing if missing is not None else ("measure" if measure_missing else "raise"), self.MISSING
        )
        self.sizes = tuple(sizes)
        self.worlds = tuple(worlds)
        self.repeats = repeats
        self.threads = threads
        #: Fits for every config of a class (a shipped profile built from kernel timings):
        #: ``{"class", "error_feedback", "when": {config item: value}, fit terms, "basis"}``,
        #: used where ``entries`` has no fit for the exact config.
        self.classes: list[dict] = list(classes or [])
        #: The gradients' dtype the fits were measured at (``measure_codec(dtype=)``).
        self.dtype = str(dtype)
        #: Factor on the per-element terms of every fit (``gradzip plan --dtype`` on a profile
        #: measured at another dtype: the ratio of element sizes, an assumption it prints).
        self.elem_scale = args.number("elem_scale", elem_scale, 0.0, lo_open=True)
        #: Compressors this profile measured on this machine because it had no fit for them.
        self.measured_here: list[str] = []
        #: Compressors ``"omit"`` gave a zero fit because the profile had none (once each).
        self.not_measured: list[str] = []
        #: One item (the compressor's repr) per ``fit`` answered by a fit measured on this
        #: machine or by the zero fit of ``"omit"``: a caller slices it to see which of its
        #: lookups the profile's own figures did not answer (``gradzip plan`` marks those rows).
        self.fallbacks: list[str] = []
        self._here: set[int] = set()  # ids of the entries measured here

    @property
    def measure_missing(self) -> bool:
        return self.missing == "measure"

    @measure_missing.setter
    def measure_missing(self, value: bool) -> None:
        self.missing = "measure" if value else "raise"

    @staticmethod
    def key(comp, error_feedback: bool | None = None) -> str:
        ef = comp.biased if error_feedback is None else bool(error_feedback)
        return json.dumps({"config": comp.config(), "error_feedback": ef}, sort_keys=True, default=str)

    def add(self, comp, fit: CodecFit, *, error_feedback: bool | None = None, raw: dict | None = None) -> None:
        ef = comp.biased if error_feedback is None else bool(error_feedback)
        self.entries[self.key(comp, ef)] = {
            "method": repr(comp),
            "config": comp.config(),
            "error_feedback": ef,
            **asdict(fit),
            "best_s": dict(raw or {}),
        }

    def _class_entry(self, comp, error_feedback) -> dict | None:
        ef = comp.biased if error_feedback is None else bool(error_feedback)
        config = comp.config() if hasattr(comp, "config") else {}
        for e in self.classes:
            if (
                e["class"] == type(comp).__name__
                and bool(e["error_feedback"]) == ef
                and all(config.get(k) == v for k, v in e.get("when", {}).items())
            ):
                return e
        return None

    def basis(self, comp, error_feedback: bool | None = None) -> str:
        """Where ``comp``'s fit comes from: ``"entry"``, ``"class: <basis>"`` or ``"missing"``."""
        if self.key(comp, error_feedback) in self.entries:
            return "entry"
        inner = getattr(comp, "codec", None)
        for c in (comp, inner) if inner is not None else (comp,):
            if self.key(c, error_feedback) in self.entries:
                return "entry"
            e = self._class_entry(c, error_feedback)
            if e is not None:
                return "class: " + e.get("basis", "")
        return "missing"

    def fit(self, comp, error_feedback: bool | None = None) -> CodecFit:
        """The fit of ``comp`` (a codec or protocol); for a protocol that carries one codec
        and has no entry of its own, the codec's entry; then a class fit (``classes``).
        Per-element terms are multiplied by ``elem_scale``."""
        e = self.entries.get(self.key(comp, error_feedback))
        inner = getattr(comp, "codec", None)
        if e is None and inner is not None:
            e = self.entries.get(self.key(inner, error_feedback))
        if e is None:
            e = self._class_entry(comp, error_feedback)
        if e is None and inner is not None:
            e = self._class_entry(inner, error_feedback)
        if e is None and self.missing == "omit":
            self.fallbacks.append(repr(comp))
            if repr(comp) not in self.not_measured:
                self.not_measured.append(repr(comp))
            return CodecFit(0.0, 0.0)
        if e is None:
            if self.missing == "raise":
                raise KeyError(f"the codec profile has no entry for {comp!r} (error_feedback={error_feedback})")
            fit, raw = measure_codec(
                comp,
                error_feedback=error_feedback,
                sizes=self.sizes,
                worlds=self.worlds,
                repeats=self.repeats,
                threads=self.threads,
                dtype=getattr(torch, self.dtype),
            )
            self.add(comp, fit, error_feedback=error_feedback, raw=raw)
            self.measured_here.append(repr(comp))
            e = self.entries[self.key(comp, error_feedback)]
            self._here.add(id(e))
        if id(e) in self._here:
            self.fallbacks.append(repr(comp))
        return CodecFit.of(e, self.elem_scale)

    def to_dict(self) -> dict:
        return {
            "kind": PROFILE_KIND,
            "version": PROFILE_VERSION,
            "machine": self.machine if self.machine is not None else machine(),
            "sizes": list(self.sizes),
            "worlds": list(self.worlds),
            "repeats": self.repeats,
            "statistic": "min",
            "threads": self.threads if self.threads is not None else torch.get_num_threads(),
            "dtype": self.dtype,
            "entries": self.entries,
            **({"classes": self.classes} if self.classes else {}),
        }

    def save(self, path: str) -> None:
        d = self.to_dict()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, *, measure_missing: bool = False, missing: str | None = None) -> CodecProfile:
        if not isinstance(d, dict) or d.get("kind") != PROFILE_KIND:
            raise ValueError(f"not a gradzip codec profile (expected kind {PROFILE_KIND!r})")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"codec profile version {d.get('version')!r} is not supported (expected {PROFILE_VERSION})"
            )
        prof = cls(
            d.get("entries", {}),
            machine=d.get("machine"),
            measure_missing=measure_missing,
            sizes=tuple(d.get("sizes", (4096, 1 << 20))),
            worlds=tuple(d.get("worlds", (1, 8))),
            repeats=int(d.get("repeats", 5)),
            threads=d.get("threads"),
            classes=d.get("classes"),
            dtype=d.get("dtype", "float32"),
            missing=missing,
        )
        if not isinstance(getattr(torch, prof.dtype, None), torch.dtype):
            raise ValueError(f"codec profile dtype {prof.dtype!r} is not a torch dtype")
        for e in prof.classes:
            try:
                CodecFit.of(e)
                e["class"], e["error_feedback"]
            except (KeyError, TypeError) as exc:
                raise ValueError(f"codec profile class fit {e.get('class')!r} is incomplete: {exc}") from None
        for k, e in prof.entries.items():  # validate every fit now, not deep inside a step
            try:
                CodecFit.of(e)
            except (KeyError, TypeError) as exc:
                raise ValueError(f"codec profile entry {e.get('method', k)!r} is incomplete: {exc}") from None
        return prof

    @classmethod
    def load(cls, path: str, *, measure_missing: bool = False, missing: str | None = None) -> CodecProfile:
        with open(path) as f:
            return cls.from_dict(json.load(f), measure_missing=measure_missing, missing=missing)


def as_profile(profile) -> CodecProfile:
    """``None`` (measure on demand), a :class:`CodecProfile`, a dict or a JSON path."""
    if profile is None:
        return CodecProfile()
    if isinstance(profile, CodecProfile):
        return profile
    if isinstance(profile, dict):
        return CodecProfile.from_dict(profile)
    if isinstance(profile, (str, os.PathLike)):
        return CodecProfile.load(os.fspath(profile))
    raise ValueError(f"profile must be None, a CodecProfile, a dict or a JSON path, got {type(profile).__name__}")
