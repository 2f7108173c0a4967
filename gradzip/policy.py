"""Per-tensor choice of method: a protocol that routes each tensor to a codec or protocol.

    policy = Policy(PowerSGD(rank=2), min_numel=4096, skip=["bias", "norm"], fallback=BF16())
    register_hook(ddp_model, policy)

**Rules.** For a tensor named ``name`` with ``numel`` elements, the first rule that
applies picks its method:

1. ``per_layer``: the first pattern (in the dict's order) that is a substring of
   ``name`` gives its method;
2. ``skip``: a pattern that is a substring of ``name`` gives ``fallback``;
3. ``numel < min_numel`` gives ``fallback``;
4. with ``auto=True``: the cost model (:mod:`gradzip.costmodel`) compares
   ``default`` and ``fallback`` for this tensor on ``link`` (codec plus wire;
   the tensors of a call share its collectives, so each is charged the latency
   in proportion to its share of the call's elements) and picks the cheaper one
   (ties go to ``fallback``);
5. otherwise ``default``.

Rules 1-3 and 5 depend only on names and sizes, so every rank routes alike.
Rule 4 depends on measured codec times and on the gradient itself, which differ
across ranks: so the first call that meets an undecided tensor adds one round, an
allreduce(MAX) of one int32 per undecided tensor (1 = "fallback is cheaper
here"). A tensor is compressed only if every rank finds compression cheaper (the
step waits for the slowest rank). The decision is kept in the tensor's state
(``ctx.store["policy.fallback"]``), so it is taken once, is checkpointed with the
front end's ``state_dict()``, and is identical on every rank. Patterns that match
no tensor of the model are refused when the front end knows the model's names.

**Exchange.** The call's tensors are split into one group per method (groups in
the order of :attr:`Policy.candidates`, tensors in call order) and each group runs
its method's protocol on ``call.subset(group)``, so per-tensor state and residuals
are the same as if the group were alone. The protocols run in parallel
composition (:func:`~gradzip.protocols.parallel.parallel`): round ``t`` of every
running protocol is one merged ``Round``; protocols whose round count is fixed
start late enough to end with the longest, so a plain allreduce rides in the
asynchronous last round.

**Error feedback** is one switch per engine (on when any candidate is biased).
With it on, every route keeps its error, unbiased lossy ones (``BF16``) included;
only exact routes (``Identity``: what is sent is the gradient itself) run without
residuals, since theirs would stay zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

import gradzip.args as args

from .codecs.base import Codec
from .codecs.cast import Identity
from .comm import Round
from .costmodel.layer import layer_cost
from .costmodel.link import Link
from .costmodel.profile import CodecProfile, as_profile, sample
from .protocols.allreduce import Allreduce
from .protocols.base import Call, Exchange, Protocol, as_protocol
from .protocols.parallel import aligned_starts, contiguous_run, parallel, scatter_routes
from .wire import accum_dtype

__all__ = ["Policy"]

DECISION = "policy.fallback"
#: Elements: the largest size a profile measured by the policy itself reaches at least, and at
#: most (beyond it a codec's seconds per element no longer change: its tensors are out of cache).
PROFILE_TOP = 1 << 20
PROFILE_TOP_MAX = 1 << 24


def _patterns(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    try:
        pats = tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}") from None
    for p in pats:
        if not isinstance(p, str) or not p:
            raise ValueError(f"{name} must hold non-empty strings, got {p!r}")
    return pats


def _exact(method) -> bool:
    """A route whose payload is the gradient itself: its residual would always be zero."""
    if isinstance(method, Allreduce):
        method = method.codec
    return isinstance(method, Codec) and method.exact


class Policy(Protocol):
    """Route each tensor to a method by name, size, or a cost model.

    Args:
        default: the method (codec or protocol) for tensors no other rule catches.
        min_numel: tensors with fewer elements use ``fallback`` (integer >= 0).
        skip: name substrings (a string or a list) whose tensors use ``fallback``.
        fallback: the method for skipped and small tensors; ``Identity()`` (plain
            allreduce) by default.
        per_layer: ``{name substring: method}``; the first matching pattern wins,
            before every other rule.
        auto: choose between ``default`` and ``fallback`` per tensor with the cost
            model (needs ``link``).
        link: a :class:`gradzip.costmodel.Link` (bandwidth, latency) for ``auto``.
        world_size: the rank count the cost model assumes; default: the process group's.
        profile: codec throughputs for ``auto``: a :class:`gradzip.costmodel.CodecProfile`,
            its dict or a JSON path; default: measured on this machine at first use.
            Not part of the configuration (ranks may measure different times).

    Policies do not nest.
    """

    _not_config = ("profile",)

    def __init__(
        self,
        default,
        *,
        min_numel: int = 0,
        skip: Iterable[str] | str = (),
        fallback=None,
        per_layer: Mapping[str, object] | None = None,
        auto: bool = False,
        link: Link | None = None,
        world_size: int | None = None,
        profile=None,
    ) -> None:
        fallback = Identity() if fallback is None else fallback
        per_layer = {} if per_layer is None else per_layer
        if not isinstance(per_layer, Mapping):
            raise ValueError(f"per_layer must be a dict of name substring -> method, got {type(per_layer).__name__}")
        for arg, m in [("default", default), ("fallback", fallback)] + [
            (f"per_layer[{p!r}]", c) for p, c in per_layer.items()
        ]:
            if not isinstance(m, (Codec, Protocol)):
                raise TypeError(f"{arg} must be a gradzip codec or protocol, got {type(m).__name__}")
            if isinstance(m, Policy):
                raise ValueError(f"{arg} must not be a Policy (policies do not nest)")
        _patterns("per_layer keys", list(per_layer))
        self.auto = args.flag("auto", auto)
        if auto and not isinstance(link, Link):
            raise ValueError(f"auto=True needs link=gradzip.costmodel.Link(bandwidth_bps, latency_s), got {link!r}")
        if not auto and link is not None:
            raise ValueError("link is only used with auto=True")
        if not auto and profile is not None:
            raise ValueError("profile is only used with auto=True")
        self.default = default
        self.fallback = fallback
        self.min_numel = args.integer("min_numel", min_numel, 0)
        self.skip = _patterns("skip", skip)
        self.per_layer = dict(per_layer)
        self.link = link
        self.world_size = args.optional(args.integer, "world_size", world_size, 1)
        self._profile = as_profile(profile) if profile is not None else None
        self._profile_given = profile is not None
        self._shape_cache: dict = {}
        cands: list = []
        for c in [*self.per_layer.values(), default, fallback]:
            if not any(c is d for d in cands):
                cands.append(c)
        self.candidates = cands
        # Where a call splits across routes, the routes' results land in a buffer kept per
        # call (by its tensor names) and reused every step: a fresh allocation of that size
        # costs page faults on its first writes each step on CPU (see _scratch_for).
        self._scratch: dict = {}
        self._scratch_busy: set = set()

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return any(c.biased for c in self.candidates)

    @classmethod
    def spec_defaults(cls, kwargs: dict, context: dict) -> dict:
        """In a method spec, ``auto=True`` takes the tool's link and profile unless given."""
        if not kwargs.get("auto"):
            return {}
        return {k: context[k] for k in ("link", "profile") if context.get(k) is not None}

    def check_names(self, names) -> None:
        """Refuse ``skip`` and ``per_layer`` patterns that match none of ``names``."""
        names = list(names)
        for what, pats in (("skip", self.skip), ("per_layer", list(self.per_layer))):
            for p in pats:
                if not any(p in n for n in names):
                    raise ValueError(f"Policy {what} pattern {p!r} matches no tensor (e.g. {names[:3]})")

    # -- routing ---------------------------------------------------------------------------
    def index_of(self, method) -> int:
        for i, c in enumerate(self.candidates):
            if c is method:
                return i
        raise ValueError(f"{method!r} is not one of this policy's methods")

    def rule(self, name: str, numel: int) -> tuple[object | None, str]:
        """``(method, reason)`` from the name and size rules; ``(None, "auto")`` when the
        cost model decides (``auto=True`` and no other rule applies)."""
        for pat, m in self.per_layer.items():
            if pat in name:
                return m, f"per_layer {pat!r}"
        for pat in self.skip:
            if pat in name:
                return self.fallback, f"skip {pat!r}"
        if numel < self.min_numel:
            return self.fallback, f"numel < min_numel={self.min_numel}"
        if self.auto:
            return None, "auto"
        return self.default, "default"

    def decision(self, name: str, numel: int, store: dict, world_size: int, feedback: bool):
        """``(method, reason, protocol)`` of a tensor as the exchange routes it: the rules,
        else the cost model's decision kept in the tensor's state (``(None, "auto:
        undecided", None)`` before the first call decides it)."""
        m, why = self.rule(name, numel)
        if m is None:
            d = store.get(DECISION)
            if d is None:
                return None, "auto: undecided", None
            m = self.fallback if int(d) else self.default
            why = "auto: " + ("fallback is cheaper" if int(d) else "default is cheaper")
        return m, why, as_protocol(m, world_size, feedback=feedback and not _exact(m))

    def profile(self, numel: int = 0) -> CodecProfile:
        """The codec profile ``auto`` uses: the one given, else one measured on this machine at
        first use, through sizes that reach the largest tensor costed so far (``numel``, rounded
        up to a power of two, from :data:`PROFILE_TOP` to :data:`PROFILE_TOP_MAX` elements). A
        larger tensor gets a new profile, measured through its size. A codec's seconds per element
        grow once its tensors leave the cache, so a line through 1M elements reads a 16M tensor's
        codec short, and ``Policy(auto)`` would choose a compressor where plain allreduce is
        faster (``docs/costmodel.md``, validation)."""
        if self._profile is not None and (self._profile_given or numel <= self._profile.sizes[1]):
            return self._profile
        top = min(max(PROFILE_TOP, 1 << max(int(numel) - 1, 0).bit_length()), PROFILE_TOP_MAX)
        if self._profile is None or top > self._profile.sizes[1]:
            self._profile = CodecProfile(sizes=(4096, top))
        return self._profile

    def costs(self, x: torch.Tensor, world_size: int, *, compensated: bool = False, latency_share: float = 1.0):
        """Modelled seconds for ``x`` with ``(default, fallback)`` on ``world_size`` ranks
        (:func:`gradzip.costmodel.layer_cost`; ``latency_share``: ``x``'s part of its bucket)."""
        if self.link is None:
            raise ValueError("costs() needs a policy with auto=True and a link")
        prof = self.profile(x.numel() if isinstance(x, torch.Tensor) else 0)
        return tuple(
            layer_cost(
                as_protocol(m, world_size, feedback=self.biased and not _exact(m)),
                x,
                world_size,
                self.link,
                prof,
                error_feedback=self.biased and not _exact(m),  # as the route runs
                sample_is_compensated=compensated,
                latency_share=latency_share,
            )
            for m in (self.default, self.fallback)
        )

    def prefers_fallback(
        self, x: torch.Tensor, world_size: int, *, compensated: bool = False, latency_share: float = 1.0
    ) -> bool:
        """This rank's vote: is ``fallback`` at most as costly as ``default`` for ``x``?"""
        c_default, c_fallback = self.costs(x, world_size, compensated=compensated, latency_share=latency_share)
        return c_fallback <= c_default

    def choose(self, name: str, x, world_size: int | None = None, *, latency_share: float = 1.0):
        """This rank's choice for a tensor (no vote). ``x`` is a tensor or a shape; for a
        shape, ``auto`` costs a seeded Gaussian sample and remembers the choice per shape."""
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(int(d) for d in x)
        method, _ = self.rule(name, math.prod(shape))
        if method is not None:
            return method
        world = world_size or self.world_size
        if world is None:
            raise ValueError("auto needs a world size: pass world_size (here or to Policy)")
        if isinstance(x, torch.Tensor):
            return self.fallback if self.prefers_fallback(x, world, latency_share=latency_share) else self.default
        key = (shape, world, latency_share)
        if key not in self._shape_cache:
            prefers = self.prefers_fallback(sample(shape), world, latency_share=latency_share)
            self._shape_cache[key] = self.fallback if prefers else self.default
        return self._shape_cache[key]

    def explain(self, named_shapes, world_size: int | None = None) -> list[dict]:
        """``[{name, numel, method, reason}]`` for ``[(name, shape)]``: what this rank would pick."""
        rows = []
        for name, shape in named_shapes:
            shape = tuple(int(d) for d in shape)
            m, why = self.rule(name, math.prod(shape))
            if m is None:
                m = self.choose(name, shape, world_size)
                why = "auto: " + ("fallback is cheaper" if m is self.fallback else "default is cheaper")
            rows.append({"name": name, "numel": math.prod(shape), "method": repr(m), "reason": why})
        return rows

    def routes(self, layers, world: int) -> list:
        """The cost model's partition of a call over ``layers``: each tensor's choice (with
        its part of the call's latency), grouped in candidate order."""
        total = sum(math.prod(s) for _, s in layers)
        parts: dict[int, list[int]] = {}
        for i, (name, shape) in enumerate(layers):
            share = math.prod(shape) / total if total else 1.0
            parts.setdefault(self.index_of(self.choose(name, shape, world_size=world, latency_share=share)), []).append(
                i
            )
        return [(self.candidates[g], parts[g], self.biased and not _exact(self.candidates[g])) for g in sorted(parts)]

    def _decided(self, call: Call) -> list[int | None]:
        """Each tensor's route index by the rules and stored votes; None where undecided."""
        choice: list[int | None] = []
        for i in range(len(call.tensors)):
            m, _ = self.rule(call.names[i], call.tensors[i].numel())
            if m is None:
                d = call.contexts[i].store.get(DECISION)
                if d is None:
                    choice.append(None)
                    continue
                m = self.fallback if int(d) else self.default
            choice.append(self.index_of(m))
        return choice

    def _groups(self, call: Call, choice: list[int]) -> tuple[list[int], dict[int, list[int]], list[Call]]:
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(choice):
            groups.setdefault(g, []).append(i)
        order = sorted(groups)
        subs = [call.subset(groups[g], feedback=not _exact(self.candidates[g]), flag=True) for g in order]
        return order, groups, subs

    def plain(self, call: Call) -> bool:
        choice = self._decided(call)
        if not choice or None in choice:
            return False
        order, _, subs = self._groups(call, choice)
        return all(
            as_protocol(self.candidates[g], call.world_size, feedback=s.memory is not None).plain(s)
            for g, s in zip(order, subs)
        )

    # -- the exchange ----------------------------------------------------------------------
    def _vote_input(self, call: Call, i: int) -> torch.Tensor:
        """A copy of what tensor ``i`` would compress (the codec trial may work in place).
        Without a residual that is the gradient: no compensation is cached for it, so an
        exact route can still send the gradient itself."""
        if call.memory is None or call.memory.residual(call.names[i]) is None:
            return call.tensors[i].detach().to(accum_dtype(call.tensors[i].dtype), copy=True)
        return call.x(i).detach().clone()

    def exchange(self, call: Call) -> Exchange:
        count = len(call.tensors)
        if count == 0:
            return torch.empty(0, dtype=call.out_dtype, device=call.device)
        world = self.world_size or call.world_size
        with call.codec():
            choice = self._decided(call)
            undecided = [i for i, c in enumerate(choice) if c is None]
            if undecided:
                # the call's tensors share its collectives: each carries its part of their latency
                votes = [
                    int(
                        self.prefers_fallback(
                            self._vote_input(call, i),
                            world,
                            compensated=True,
                            latency_share=call.tensors[i].numel() / call.numel if call.numel else 1.0,
                        )
                    )
                    for i in undecided
                ]
                flags = torch.tensor(votes + [0] if call.wants_flag else votes, dtype=torch.int32, device=call.device)
                call.comm.stats.add(bytes_payload=4 * len(votes))
        if undecided:
            if flags.numel() > len(undecided):  # the engine's non-finite flag rides with the votes
                flags[-1] = call.take_flag(flags[-1:])
            yield Round([call.comm.allreduce(flags, op=dist.ReduceOp.MAX, control=True)])
            for i, f in zip(undecided, flags.tolist()):
                call.contexts[i].store[DECISION] = int(f)
                choice[i] = self.index_of(self.fallback if f else self.default)
        order, groups, subs = self._groups(call, choice)
        whole = len(order) == 1  # one route for the whole call: it may write the call's destination
        # A route whose tensors sit back to back in the call's destination (DDP's bucket: a layer's
        # weight and bias, say) writes its result there; only the others need the scratch buffer,
        # from which scatter_routes copies them.
        dest = None if whole else call.fitting_dest()
        runs = [None if dest is None else contiguous_run(call, groups[g]) for g in order]
        key = None if whole or all(r is not None for r in runs) else (tuple(call.names), call.out_dtype, call.device)
        scratch = None if key is None else self._scratch_for(key, call)
        try:
            return (yield from self._run_routes(call, groups, order, subs, whole, scratch, dest, runs))
        finally:
            if scratch is not None:  # only the call that holds the buffer frees it
                self._scratch_busy.discard(key)

    def _scratch_for(self, key, call: Call) -> torch.Tensor | None:
        """This call's reusable buffer for its routes' results (``call.numel`` elements), or
        None if another call with the same tensors is still using it."""
        if key in self._scratch_busy:
            return None
        buf = self._scratch.get(key)
        if buf is None or buf.numel() != call.numel:
            buf = self._scratch[key] = torch.empty(call.numel, dtype=call.out_dtype, device=call.device)
        self._scratch_busy.add(key)
        return buf

    def _run_routes(self, call: Call, groups, order, subs, whole, scratch, dest=None, runs=None):
        pos = 0
        for k, (g, sub) in enumerate(zip(order, subs)):
            n = sum(call.tensors[i].numel() for i in groups[g])
            if whole:
                sub.dest = call.dest
            elif runs and runs[k] is not None:
                sub.dest = dest[runs[k]]
            else:
                sub.dest = None if scratch is None else scratch[pos : pos + n]
            pos += n
        protocols = [
            as_protocol(self.candidates[g], call.world_size, feedback=s.memory is not None) for g, s in zip(order, subs)
        ]
        results = yield from parallel([p.exchange(s) for p, s in zip(protocols, subs)], aligned_starts(protocols))
        if whole and results[0].dtype == call.out_dtype and results[0].numel() == call.numel:
            return results[0].view(-1)
        return scatter_routes(call, order, groups, subs, results)
