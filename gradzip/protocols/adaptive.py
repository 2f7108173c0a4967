"""Layer-wise adaptive compression under an error budget (L-GreCo, with optional Accordion).

    Adaptive(TopK(0.01), menu=[0.001, 0.003, 0.03, 0.1, 1.0], period=100)
    Adaptive(PowerSGD(rank=2), menu=[1, 4, 8])
    Adaptive(TopK(0.01), menu=[0.001, 0.003, 0.03], accordion=0.03)

``Adaptive(method, menu)`` runs one codec family (or PowerSGD) with a parameter of its own per
tensor, chosen from ``menu``: TopK's and RandomK's ``ratio``, Threshold's ``density``
(``policy="target"``), QSGD's ``levels``, PowerSGD's ``rank``. ``method`` is both the family
(every other argument of the settings is its own) and the **reference**: the uniform setting
whose error the choice may not exceed (``reference=`` names another value of the parameter).
The reference is always among the settings, so the uniform reference is always a solution.

**Statistics** (every ``period`` steps, at steps ``period - 1, 2 * period - 1, ...``). For each
tensor of each call and each setting ``v``: the compression error ``||x - C_v(x)||^2`` on the
tensor's compensated input ``x`` (gradient plus residual, what the codec is about to compress)
and the bytes of its frame (``wire.frame_nbytes``: the codec's own payload and frame entry).
For PowerSGD the error of setting ``k`` is the error of the best rank-``k`` approximation,
``||M||^2 - sum_{i<k} sigma_i^2`` (singular values from a seeded randomized range finder with
two power iterations, exact ``svdvals`` for small matrices), and the bytes are the factors'
``(n + m) * k`` elements (a matrix PowerSGD sends whole costs its elements). Every rank
measures its own and the call's statistics are averaged by one allreduce of
``T * (2E + 1)`` float64 numbers (``T`` tensors, ``E`` settings), booked as control bytes,
riding beside the call's first round; so every rank holds the same numbers.

**The choice.** At the first call of the next step, every rank solves the same problem
over every tensor measured: minimise the total bytes ``sum_t b[t, c_t]`` subject to
``sum_t e[t, c_t] <= budget * sum_t e[t, ref]``, the reference's error. :func:`solve`
runs an exact multiple-choice knapsack (a Pareto frontier of (error, bytes) pairs, tensor
by tensor) while the frontier stays under ``EXACT_CAP`` points, else L-GreCo's dynamic
program over tensors x errors discretised in ``bins`` steps of ``B / bins`` (errors rounded
up: the chosen error is at most ``max(B, sum_t ceil(e[t, ref] / u) * u)``, within ``T / bins``
of the budget). Ties go to the setting listed first (``sorted`` settings: the smaller
value). The new parameters take effect from that call on, on every rank together; until the
first choice every tensor runs the reference.

**Error feedback** is per tensor, not per setting (residuals are keyed by the tensor's name),
so a change of parameter carries every tensor's residual over: what a tensor did not send at
one density is sent later at another. PowerSGD's warm-started factors survive a rank change:
``PowerSGD`` truncates its stored ``Q`` to a lower rank and extends it with fresh seeded
columns to a higher one.

**Accordion** (Agarwal et al., 2021), with ``accordion=v``: a second, lighter setting of the
parameter (more bytes, less error). Every rank adds each tensor's ``||g||^2`` (the gradient
as the engine hands it, before compensation) up over the ``period`` steps of a window;
the sums ride in the statistics' allreduce, and ``N = sqrt(sum_t mean_w window_t)``. When
``|N - N_prev| >= accordion_eta * N_prev`` (or at the first choice: no ``N_prev``) the
regime is critical and the budget is the error of ``accordion`` instead of the reference's.
Tensors start at ``accordion``, as Accordion starts in a critical regime.

**State** lives in the engine's per-tensor state (checkpointed, rolled back after a
non-finite step, resharded from rank 0: the choices and averaged statistics are the same
on every rank): ``"adaptive.value"`` (the tensor's current parameter) and
``"adaptive.since"`` (the step it took effect), ``"adaptive.err"``
and ``"adaptive.bytes"`` (the last statistics, one entry per setting), ``"adaptive.at"`` (their
step), ``"adaptive.sqmean"`` (the ranks' mean of the last Accordion window), ``"adaptive.sq"`` (this
rank's open Accordion window, local: a reshard takes rank 0's). One key of the protocol's
own, ``adaptive:<hash of the configuration>``, holds the step of the statistics waiting for
a choice and the names measured then, the last choice's budget, error and bytes, and
Accordion's ``N_prev``. ``Engine.routes()`` shows each tensor's current setting, its bytes at
the last statistics and the step of the choice.

Costs: the statistics take ``E`` compressions (or one small SVD) per tensor once per
``period`` steps, one allreduce of a few numbers per call then, and a solve of
``T x E x bins`` operations the step after; ``timing`` (not configuration) sums their
seconds on this rank. ``gradzip plan`` prices the method at its reference, the error it is
held to (the bytes it saves depend on the gradients, which a plan does not have).
"""

from __future__ import annotations

import hashlib
import json
import math
import time

import torch

import gradzip.args as args
import gradzip.warmup as warmup

from ..codecs.base import Codec, TensorContext, tensor_seed
from ..comm import Round
from ..registry import Registered, config_of
from ..wire import accum_dtype, frame_nbytes, itemsize
from .base import Call, Exchange, Protocol, as_protocol
from .parallel import aligned_starts, parallel, scatter_routes

__all__ = ["Adaptive", "solve", "solve_dp", "solve_exact", "default_menu", "EXACT_CAP", "PARAMETERS"]

#: The parameter each family's setting varies.
PARAMETERS = {"TopK": "ratio", "RandomK": "ratio", "Threshold": "density", "QSGD": "levels", "PowerSGD": "rank"}
_INTEGER = {"levels", "rank"}

VALUE = "adaptive.value"
ERR = "adaptive.err"
BYTES = "adaptive.bytes"
AT = "adaptive.at"
SQ = "adaptive.sq"
SQMEAN = "adaptive.sqmean"
SINCE = "adaptive.since"

#: The exact solver gives up (and the dynamic program runs) beyond this many frontier points.
EXACT_CAP = 50_000
_SOLVERS = ("auto", "dp", "exact")


# -- the solvers ------------------------------------------------------------------------------
def _check_problem(err, nbytes) -> tuple[torch.Tensor, torch.Tensor]:
    e = torch.as_tensor(err, dtype=torch.float64)
    b = torch.as_tensor(nbytes, dtype=torch.float64)
    if e.dim() != 2 or e.shape != b.shape or e.shape[1] < 1:
        raise ValueError(f"err and nbytes must be T x E tables of one shape, got {tuple(e.shape)} and {tuple(b.shape)}")
    if not bool(torch.isfinite(e).all() and torch.isfinite(b).all()) or bool((e < 0).any() or (b < 0).any()):
        raise ValueError("err and nbytes must be finite and not negative")
    return e, b


def _zero_budget(e: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Budget 0: per tensor the cheapest setting without error, else the one with least error."""
    out = []
    for t in range(e.shape[0]):
        ok = [j for j in range(e.shape[1]) if float(e[t, j]) <= 0.0]
        if ok:
            out.append(min(ok, key=lambda j: (float(b[t, j]), j)))
        else:
            out.append(min(range(e.shape[1]), key=lambda j: (float(e[t, j]), j)))
    return out


def solve_exact(err, nbytes, budget: float, *, cap: int = EXACT_CAP) -> list[int] | None:
    """The setting per tensor (an index into each row) that minimises ``sum_t nbytes[t, c_t]``
    subject to ``sum_t err[t, c_t] <= budget``: exact, by a Pareto frontier of (error,
    bytes) over the tensors taken in order. ``None`` when no choice meets the budget or when
    the frontier grows past ``cap`` points. Ties: the fewest bytes, then the least error, then
    the earlier settings."""
    e, b = _check_problem(err, nbytes)
    if budget <= 0:
        return _zero_budget(e, b) if all(float(e[t, c]) <= 0 for t, c in enumerate(_zero_budget(e, b))) else None
    T, E = e.shape
    fe = torch.zeros(1, dtype=torch.float64)
    fb = torch.zeros(1, dtype=torch.float64)
    back = []  # per tensor: (parent index, setting) of each frontier point
    for t in range(T):
        ce = (fe.unsqueeze(1) + e[t].unsqueeze(0)).reshape(-1)  # parent-major: parent p, setting j at p*E + j
        cb = (fb.unsqueeze(1) + b[t].unsqueeze(0)).reshape(-1)
        keep = (ce <= budget).nonzero().reshape(-1)
        if keep.numel() == 0:
            return None
        ce, cb = ce[keep], cb[keep]
        # sort by error, then bytes, then candidate index (stable sorts, last key first)
        order = torch.argsort(cb, stable=True)
        order = order[torch.argsort(ce[order], stable=True)]
        ce, cb, keep = ce[order], cb[order], keep[order]
        # keep a point only if it has fewer bytes than every point with less (or equal) error
        best = torch.cummin(cb, 0).values
        front = torch.ones_like(cb, dtype=torch.bool)
        front[1:] = cb[1:] < best[:-1]
        ce, cb, keep = ce[front], cb[front], keep[front]
        if ce.numel() > cap:
            return None
        back.append(keep)
        fe, fb = ce, cb
    # fewest bytes (the frontier's bytes fall as the error grows: the last point)
    i = int(torch.argsort(fb, stable=True)[0])
    choice = [0] * T
    for t in range(T - 1, -1, -1):
        cand = int(back[t][i])
        choice[t] = cand % E
        i = cand // E
    return choice


def solve_dp(err, nbytes, budget: float, *, bins: int = 1000, ref: list[int] | None = None) -> list[int] | None:
    """L-GreCo's dynamic program: errors in units of ``u = budget / bins``, rounded up, and
    ``dp[c]`` the fewest bytes of the tensors so far at total units ``c``, up to a capacity of
    ``bins`` units (or of the reference's rounded units ``sum_t ceil(err[t, ref_t] / u)`` where
    that is more, so that the reference stays a solution). The answer's error is at most the
    capacity times ``u``: within ``T / bins`` of the budget. ``None`` when nothing fits."""
    e, b = _check_problem(err, nbytes)
    bins = args.integer("bins", bins, 1)
    if budget <= 0:
        return _zero_budget(e, b) if all(float(e[t, c]) <= 0 for t, c in enumerate(_zero_budget(e, b))) else None
    T, E = e.shape
    u = budget / bins
    w = torch.ceil(e / u)
    cap = bins
    if ref is not None:
        cap = max(cap, int(sum(float(w[t, j]) for t, j in enumerate(ref))))
    inf = float("inf")
    dp = torch.full((cap + 1,), inf, dtype=torch.float64)
    dp[0] = 0.0
    arg = torch.zeros(T, cap + 1, dtype=torch.int64)
    for t in range(T):
        cand = torch.full((E, cap + 1), inf, dtype=torch.float64)
        for j in range(E):
            wj = float(w[t, j])
            if wj > cap:
                continue
            k = int(wj)
            cand[j, k:] = dp[: cap + 1 - k] + float(b[t, j])
        dp, arg[t] = torch.min(cand, 0)  # ties: the earlier setting
    if not bool(torch.isfinite(dp).any()):
        return None
    c = int(torch.argmin(dp))  # the first of the fewest bytes: the least error among them
    choice = [0] * T
    for t in range(T - 1, -1, -1):
        j = int(arg[t, c])
        choice[t] = j
        c -= int(w[t, j])
    return choice


def solve(err, nbytes, budget: float, *, solver: str = "auto", bins: int = 1000, ref: list[int] | None = None):
    """``(choice, how)``: the setting per tensor (``solve_exact``, or ``solve_dp`` where the
    exact frontier grows too large or ``solver="dp"``), and ``"exact"`` or ``"dp"``. ``ref``:
    the reference's settings (a solution by construction); where no solver finds one (rounding
    of a budget the reference meets only at its edge), the reference is returned."""
    args.choice("solver", solver, _SOLVERS)
    if solver in ("auto", "exact"):
        got = solve_exact(err, nbytes, budget, cap=EXACT_CAP if solver == "auto" else 1 << 62)
        if got is not None:
            return got, "exact"
        if solver == "exact":
            return (list(ref), "reference") if ref is not None else (None, "exact")
    got = solve_dp(err, nbytes, budget, bins=bins, ref=ref)
    if got is None and ref is not None:
        return list(ref), "reference"
    return got, "dp"


# -- the protocol -------------------------------------------------------------------------------
def default_menu(param: str, ref) -> list:
    """The menu when none is given: around the reference ``ref``. A fraction: ``ref`` times
    0.1, 0.3, 3 and 10 (at most 1); a rank: half, twice and four times it; QSGD's levels: 1, 3,
    7, 15, 31 and 127."""
    if param == "rank":
        return sorted({max(1, ref // 2), ref, 2 * ref, 4 * ref})
    if param == "levels":
        return [1, 3, 7, 15, 31, 127]
    return sorted({min(1.0, float(f"{ref * f:.3g}")) for f in (0.1, 0.3, 1.0, 3.0, 10.0)})


def _setting_value(name: str, value, integer: bool):
    return args.integer(name, value, 1) if integer else args.number(name, value, 0.0, lo_open=True)


class Adaptive(Protocol):
    """One codec family (or PowerSGD) with a parameter per tensor, chosen every ``period``
    steps to minimise bytes at the error of a uniform reference (module docstring).

    Args:
        method: the family and the reference: ``TopK(0.01)``, ``RandomK(0.01)``,
            ``Threshold(policy="target", density=0.01)``, ``QSGD(7)``, ``PowerSGD(rank=2)``;
            every setting has its other arguments.
        menu: the values of the family's parameter (``ratio``, ``density``, ``levels``,
            ``rank``) to choose from; the reference (and ``accordion``) are added. None: around
            the reference (:func:`default_menu`).
        reference: the reference setting's value (or a method of the same family whose
            parameter gives it); default: ``method``'s own.
        period: steps between two choices (statistics at steps ``period - 1``,
            ``2 * period - 1``, ...; the choice from the next step on).
        budget: the error allowed, as a multiple of the reference's, a number > 0.
        solver: ``"auto"`` (exact, or the dynamic program where the exact frontier grows
            past ``EXACT_CAP`` points), ``"exact"`` or ``"dp"``.
        bins: the dynamic program's error steps.
        accordion: a lighter value of the parameter (less error, more bytes) whose error is
            the budget in critical regimes (Accordion); None: off.
        accordion_eta: the relative change of the gradient norm between two windows that
            marks a critical regime.
        seed: seeds PowerSGD's randomized range finder.
    """

    def __init__(
        self,
        method,
        menu=None,
        *,
        reference=None,
        period: int = 100,
        budget: float = 1.0,
        solver: str = "auto",
        bins: int = 1000,
        accordion=None,
        accordion_eta: float = 0.5,
        seed: int = 0,
    ) -> None:
        family = type(method).__name__
        if not isinstance(method, (Codec, Protocol)) or family not in PARAMETERS:
            raise ValueError(
                f"method must be one of the families {', '.join(PARAMETERS)} (a codec, or PowerSGD), got {method!r}"
            )
        param = PARAMETERS[family]
        integer = param in _INTEGER
        if isinstance(getattr(method, param), warmup.Ramp):
            raise ValueError(f"Adaptive chooses {family}'s {param} itself: give {family} a number, not a schedule")
        if getattr(method, "scope", "tensor") == "call":
            raise ValueError(f"Adaptive chooses a setting per tensor, so {method!r} cannot choose over the call")
        if family == "Threshold" and method.policy != "target":
            raise ValueError(f"Adaptive varies Threshold's density, which only policy='target' uses; got {method!r}")
        if family == "PowerSGD" and method.accordion_rank is not None:
            raise ValueError(
                "Adaptive(PowerSGD) has an Accordion of its own (accordion=): give PowerSGD no accordion_rank"
            )
        if menu is not None and (isinstance(menu, (str, bytes)) or not hasattr(menu, "__iter__")):
            raise ValueError(f"menu must be a list of {param} values, got {menu!r}")
        self.method = method
        self.menu = None if menu is None else [_setting_value("menu", v, integer) for v in menu]
        if self.menu is not None and not self.menu:
            raise ValueError(f"menu must hold at least one {param} value")
        self.reference = reference
        self.period = args.integer("period", period, 1)
        self.budget = args.number("budget", budget, 0.0, lo_open=True)
        self.solver = args.choice("solver", solver, _SOLVERS)
        self.bins = args.integer("bins", bins, 1)
        self.accordion = accordion
        self.accordion_eta = args.number("accordion_eta", accordion_eta, 0.0, lo_open=True)
        self.seed = args.integer("seed", seed)
        self.param = param
        self.family = family
        own = getattr(method, param)
        self.reference_value = self._value_of("reference", reference, own, integer)
        self.accordion_value = None if accordion is None else self._value_of("accordion", accordion, own, integer)
        menu = self.menu if self.menu is not None else default_menu(param, self.reference_value)
        values = set(menu) | {self.reference_value}
        if self.accordion_value is not None:
            values.add(self.accordion_value)
        #: Every setting's value, ascending; the statistics' columns follow this order.
        self.values = sorted(values)
        self.settings = {v: self._make(v) for v in self.values}  # validates each value
        #: Seconds and counts of this rank's statistics and solves (not configuration).
        self.timing = {"stats_s": 0.0, "solve_s": 0.0, "stats_calls": 0, "solves": 0}
        #: This process's choices, in order: step, the statistics' step, the tensors, their error
        #: and bytes tables (rows: tensors; columns: :attr:`values`), the budget and each
        #: tensor's new value (a log for benchmarks, not state: a resumed run starts it empty).
        self.history: list[dict] = []
        blob = json.dumps(self._config_blob(), sort_keys=True, default=str).encode()
        self.key = f"adaptive:{hashlib.sha256(blob).hexdigest()[:12]}"

    def _config_blob(self) -> dict:
        return {
            "method": config_of(self.method),
            "values": self.values,
            "reference": self.reference_value,
            "accordion": self.accordion_value,
        }

    def _value_of(self, what: str, given, own, integer: bool):
        if given is None:
            return own
        if isinstance(given, Registered):
            if type(given) is not type(self.method):
                raise ValueError(f"{what} must be a value of {self.param} or a {self.family}, got {given!r}")
            mine = {k: v for k, v in self.method.config().items() if k != self.param}
            theirs = {k: v for k, v in given.config().items() if k != self.param}
            if mine != theirs:
                raise ValueError(f"{what}={given!r} differs from {self.method!r} in more than its {self.param}")
            return getattr(given, self.param)
        return _setting_value(what, given, integer)

    def _make(self, value):
        """The family's method with ``param=value`` and ``method``'s other arguments (those
        that differ from their defaults, so that its spelling stays short)."""
        cls = type(self.method)
        kw = {}
        for p in cls._params():
            if p.name == self.param:
                continue
            v = getattr(self.method, p.name)
            if p.default is p.empty or config_of(v) != config_of(p.default):
                kw[p.name] = v
        return cls(**{self.param: value}, **kw)

    # -- what the other layers ask ----------------------------------------------------------
    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.method.biased

    @property
    def codec(self):
        """The family's codec (None for PowerSGD): what momentum correction asks whether it is sparse."""
        return self.method if isinstance(self.method, Codec) else None

    def setting(self, value) -> Codec | Protocol:
        """The method of one setting (a value of the parameter)."""
        return self.settings[value]

    def initial(self):
        """The value every tensor runs until the first choice (Accordion starts critical)."""
        return self.accordion_value if self.accordion_value is not None else self.reference_value

    def current(self, store: dict):
        v = store.get(VALUE)
        return v if v in self.settings else self.initial()

    def stats_step(self, step: int) -> bool:
        return (step + 1) % self.period == 0

    def decision(self, name: str, numel: int, store: dict, world_size: int, feedback: bool):
        """``(method, reason, protocol)`` of a tensor now (``Engine.routes``): its setting, with
        the bytes its last statistics measured and the step they were measured at."""
        v = self.current(store)
        m = self.settings[v]
        if VALUE not in store:
            why = f"adaptive: {self.param}={v} from the start (first statistics at step {self.period - 1})"
        else:
            why = f"adaptive: {self.param}={v} since step {store.get(SINCE)}"
        nb = store.get(BYTES)
        if isinstance(nb, list) and len(nb) == len(self.values):
            ref = self.reference_value
            why += f"; {nb[self.values.index(v)]:,.0f} B a step at the statistics of step {store.get(AT)}"
            if v != ref:
                why += f" (reference {self.param}={ref}: {nb[self.values.index(ref)]:,.0f} B)"
        return m, why, as_protocol(m, world_size, feedback=feedback)

    def routes(self, layers, world: int) -> list:
        """For the cost model: every tensor at the reference (the error the choice is held to;
        the bytes it saves depend on gradients a plan does not have)."""
        return [(self.settings[self.reference_value], list(range(len(layers))), self.biased)]

    def check_names(self, names) -> None:
        as_protocol(self.method).check_names(names)

    # -- statistics -------------------------------------------------------------------------
    def measure(self, x: torch.Tensor, ctx: TensorContext) -> tuple[list[float], list[float]]:
        """``(errors, bytes)`` of every setting (in :attr:`values` order) on ``x``, this
        rank's compensated input of the tensor of ``ctx``."""
        if self.family == "PowerSGD":
            return self._measure_lowrank(x, ctx)
        errs, nbytes = [], []
        x = x.detach()
        acc = accum_dtype(x.dtype)
        for v in self.values:
            codec = self.settings[v]
            c = TensorContext(
                name=ctx.name, step=ctx.step, dtype=ctx.dtype, rank=ctx.rank, world_size=ctx.world_size
            )  # a store of its own: the statistics leave the tensor's state alone
            p = codec.compress(x, c)
            r = x.to(acc, copy=True)
            codec.subtract(p, r)
            errs.append(torch.linalg.vector_norm(r, dtype=torch.float64).square())
            nbytes.append(frame_nbytes(p.body.numel() * p.body.element_size(), p.scale != 0.0))
        return torch.stack(errs).tolist(), [float(n) for n in nbytes]

    def _measure_lowrank(self, x: torch.Tensor, ctx: TensorContext) -> tuple[list[float], list[float]]:
        shape = tuple(x.shape)
        wd = torch.float64 if x.dtype == torch.float64 else torch.float32
        wsize = itemsize(wd)
        fsize = 2 if self.method.factors == "bf16" else wsize
        ks = [self.settings[v].compressed_rank(shape, v) for v in self.values]
        numel = x.numel()
        kmax = max(ks)
        if kmax == 0:
            return [0.0] * len(ks), [float(numel * wsize)] * len(ks)
        n = shape[0]
        m = numel // n
        mat = x.detach().reshape(n, m).to(torch.float64)
        total = float(torch.linalg.vector_norm(mat).square())
        if not math.isfinite(total):
            # A non-finite input (the engine skips the step on every rank): no SVD, which would
            # raise on this rank alone while the others wait in the statistics' allreduce.
            return [total] * len(ks), [float((n + m) * k * fsize) if k else float(numel * wsize) for k in ks]
        small = min(n, m)
        if small <= 2 * (kmax + 8) or n * m <= 1 << 16:
            sig = torch.linalg.svdvals(mat)
        else:  # a seeded randomized range finder, two power iterations
            q = kmax + 8
            g = torch.Generator(device="cpu").manual_seed(tensor_seed(self.seed, ctx.step, ctx.name))
            basis = torch.randn(m, q, generator=g, dtype=torch.float64).to(mat.device)
            y = torch.linalg.qr(mat @ basis).Q
            for _ in range(2):
                y = torch.linalg.qr(mat @ (mat.t() @ y)).Q
            sig = torch.linalg.svdvals(y.t() @ mat)
        cum = torch.cumsum(sig.square(), 0).tolist()
        errs, nbytes = [], []
        for k in ks:
            if k == 0:
                errs.append(0.0)
                nbytes.append(float(numel * wsize))
            else:
                errs.append(max(total - cum[min(k, len(cum)) - 1], 0.0))
                nbytes.append(float((n + m) * k * fsize))
        return errs, nbytes

    def _global(self, call: Call) -> dict:
        """The protocol's own state (its key in the engine's per-tensor state)."""
        return call.context(self.key, torch.float32).store

    def _store_of(self, call: Call, name: str) -> dict:
        return call.context(name, torch.float32).store

    def _choose(self, call: Call, g: dict, step: int) -> None:
        """At the first call after a statistics step: solve over every tensor measured then and
        set each one's value. The same numbers on every rank: the same choice."""
        at, names = g.get("pending"), g.get("names")
        if at is None or at >= step or not names:
            return
        t0 = time.perf_counter()
        E = len(self.values)
        stores = [self._store_of(call, n) for n in names]
        rows = [(s.get(ERR), s.get(BYTES)) for s in stores]
        g["pending"] = None  # replaced, never changed in place (the engine's rollback copies shallowly)
        if any(not (isinstance(e, list) and isinstance(b, list) and len(e) == len(b) == E) for e, b in rows):
            return
        err = [e for e, _ in rows]
        nb = [b for _, b in rows]
        if not all(math.isfinite(v) for r in err + nb for v in r):
            return  # a non-finite step (its rollback takes these statistics back anyway)
        critical = False
        if self.accordion_value is not None:
            norm = math.sqrt(max(sum(float(s.get(SQMEAN, 0.0)) for s in stores), 0.0))
            prev = g.get("norm")
            critical = prev is None or prev <= 0.0 or abs(norm - prev) >= self.accordion_eta * prev
            g["norm"] = norm
        ref_value = self.accordion_value if critical else self.reference_value
        j_ref = self.values.index(ref_value)
        budget = self.budget * sum(r[j_ref] for r in err)
        ref = [j_ref] * len(names)
        choice, how = solve(err, nb, budget, solver=self.solver, bins=self.bins, ref=ref)
        if choice is None:
            choice = ref
        for s, j in zip(stores, choice):
            s[VALUE] = self.values[j]
            s[SINCE] = step
        g["choice"] = {
            "step": step,
            "from": at,
            "how": how,
            "critical": critical,
            "budget": budget,
            "error": sum(err[t][j] for t, j in enumerate(choice)),
            "bytes": sum(nb[t][j] for t, j in enumerate(choice)),
            "reference_bytes": sum(r[j_ref] for r in nb),
        }
        g["choices"] = int(g.get("choices", 0)) + 1
        self.history.append(
            {**g["choice"], "names": list(names), "err": err, "nbytes": nb, "values": [self.values[j] for j in choice]}
        )
        self.timing["solve_s"] += time.perf_counter() - t0
        self.timing["solves"] += 1

    def _statistics(self, call: Call, g: dict, step: int, vec: torch.Tensor):
        """The statistics' allreduce (a round that is never the last), then each tensor's
        averaged numbers into its state and its name into the list the next step solves over."""
        yield Round([call.comm.allreduce(vec, control=True)])
        with call.codec():
            t0 = time.perf_counter()
            vec.div_(call.world_size)
            E = len(self.values)
            rows = vec.view(len(call.names), 2 * E + 1).tolist()
            for ctx, row in zip(call.contexts, rows):
                ctx.store[ERR] = row[:E]
                ctx.store[BYTES] = row[E : 2 * E]
                ctx.store[SQMEAN] = row[2 * E]
                ctx.store[AT] = step
            names = list(g.get("names") or []) if g.get("pending") == step else []
            g["names"] = names + [n for n in call.names if n not in names]
            g["pending"] = step
            self.timing["stats_s"] += time.perf_counter() - t0
        return None

    # -- the exchange -----------------------------------------------------------------------
    def exchange(self, call: Call) -> Exchange:
        count = len(call.tensors)
        if count == 0:
            return torch.empty(0, dtype=call.out_dtype, device=call.device)
        step = call.contexts[0].step
        with call.codec():
            g = self._global(call)
            self._choose(call, g, step)
            values = [self.current(ctx.store) for ctx in call.contexts]
            vec = None
            if self.accordion_value is not None:
                sq = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float64) for t in call.tensors])
                for ctx, v in zip(call.contexts, sq.square().tolist()):
                    ctx.store[SQ] = float(ctx.store.get(SQ, 0.0)) + v
            if self.stats_step(step):
                t0 = time.perf_counter()
                rows = []
                for i, ctx in enumerate(call.contexts):
                    errs, nb = self.measure(call.x(i), ctx)
                    rows.append(errs + nb + [float(ctx.store.get(SQ, 0.0))])
                    if SQ in ctx.store:
                        ctx.store[SQ] = 0.0
                vec = torch.tensor(rows, dtype=torch.float64, device=call.device).reshape(-1)
                call.comm.stats.add(bytes_payload=vec.numel() * vec.element_size())
                self.timing["stats_s"] += time.perf_counter() - t0
                self.timing["stats_calls"] += 1
        groups: dict = {}
        for i, v in enumerate(values):
            groups.setdefault(v, []).append(i)
        order = sorted(groups)
        subs = [call.subset(groups[v], flag=True) for v in order]  # a route that starts first may carry the flag
        protocols = [
            as_protocol(self.settings[v], call.world_size, feedback=s.memory is not None) for v, s in zip(order, subs)
        ]
        if len(order) == 1:  # one route for the whole call: it may write the call's destination
            subs[0].dest = call.dest
        gens = [p.exchange(s) for p, s in zip(protocols, subs)]
        starts = aligned_starts(protocols)
        if vec is not None:  # never the last round: its numbers are stored on the hook's thread
            gens.append(self._statistics(call, g, step, vec))
            starts.append(0)
        results = yield from parallel(gens, starts)
        if len(order) == 1 and results[0].dtype == call.out_dtype and results[0].numel() == call.numel:
            return results[0].view(-1)
        return scatter_routes(call, order, groups, subs, results)
