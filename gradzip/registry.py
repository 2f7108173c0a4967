"""One registry of the methods a user can name, and the grammar that names them.

Every codec, protocol and front-end method is a subclass of :class:`Registered`.
Defining the class registers it under its name (``__init_subclass__``), and with
it the wire format codes it declares (``formats = {"NAME": code}``; a code taken
by another class raises). So a new method is its own file: the config check,
``state_dict()``, ``gradzip plan --methods`` and ``gradzip bench --methods`` know
it as soon as its module is imported. gradzip's own methods are imported when first
looked up (:func:`load_methods`), from the table of ``gradzip/_names.py``: an in-tree
method is its file and one entry there.

**Configuration.** A registered object's configuration is its constructor's
arguments, read back from attributes of the same names: :meth:`Registered.config`
is ``{"name": ClassName, arg: value, ...}`` with nested methods as their own
configs, and ``repr`` spells the object in the method grammar with the arguments
the caller passed and those that differ from their defaults (``TopK(0.01)`` is
``TopK(ratio=0.01)``, though 0.01 is the default; ``TopK()`` is ``TopK()``). Equality
and hashing go by the configuration alone. Parameters listed in ``_not_config`` (a
local measurement, say) are left out of both.

**Grammar** (:func:`parse`): a Python expression of registered names, calls with
positional and keyword arguments, and literals (numbers, strings, booleans,
None, lists, tuples, dicts). Nothing else is evaluated::

    TopK(ratio=0.001)
    Policy(PowerSGD(rank=1), min_numel=10000, fallback=TopK(0.01))

A bare name is a call without arguments. Front-end methods (``kind="frontend"``,
such as local SGD, which need an optimizer and a model to exist) parse to a
:class:`Spec` that the tool instantiates later.
"""

from __future__ import annotations

import ast
import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import _names
from .wire import register_format

__all__ = [
    "Registered",
    "Spec",
    "register_value",
    "register_frontend",
    "load_methods",
    "lookup",
    "names",
    "parse",
    "parse_list",
    "config_of",
]

_CLASSES: dict[str, type] = {}
_SIGNATURES: dict[type, inspect.Signature] = {}  # a class's __init__, read once
_VALUES: dict[str, Any] = {}  # other names the grammar accepts (e.g. Link)
_FRONTENDS: set = set()  # front ends that are not Registered subclasses
KINDS = ("codec", "protocol", "frontend", "schedule")


class Registered:
    """Base of everything a method spec can name. Subclasses set ``kind`` once per family."""

    kind: ClassVar[str] = ""
    formats: ClassVar[dict] = {}
    _not_config: ClassVar[tuple] = ()

    def __init_subclass__(cls, register: bool = True, **kw) -> None:
        super().__init_subclass__(**kw)
        if cls.kind not in KINDS:
            raise TypeError(f"{cls.__name__}.kind must be one of {list(KINDS)}, got {cls.kind!r}")
        for label, code in cls.__dict__.get("formats", {}).items():
            register_format(code, f"{cls.__name__}.{label}")
        if not register or cls.__name__.startswith("_"):
            return
        old = _CLASSES.get(cls.__name__)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"a method named {cls.__name__!r} is already registered by {old.__module__}")
        _CLASSES[cls.__name__] = cls

    def __new__(cls, *args, **kwargs):
        # Records which arguments the caller passed, so that repr keeps them (TopK(0.01) is not
        # TopK()). A call that does not bind leaves the error to __init__.
        if (args or kwargs) and cls.__init__ is object.__init__:
            raise TypeError(f"{cls.__name__}() takes no arguments")
        self = super().__new__(cls)
        try:
            bound = cls._signature().bind(None, *args, **kwargs)
        except TypeError:
            given: frozenset = frozenset()
        else:
            given = frozenset(list(bound.arguments)[1:])
        self.__dict__["_given"] = given
        return self

    # -- configuration -----------------------------------------------------------------------
    @classmethod
    def _signature(cls) -> inspect.Signature:
        sig = _SIGNATURES.get(cls)
        if sig is None:
            sig = _SIGNATURES[cls] = inspect.signature(cls.__init__)
        return sig

    @classmethod
    def _params(cls) -> list[inspect.Parameter]:
        return [
            p
            for p in list(cls._signature().parameters.values())[1:]
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in cls._not_config
        ]

    def config(self) -> dict[str, Any]:
        """``{"name": ClassName, arg: value, ...}`` in plain values (compared across ranks, saved with state)."""
        return {"name": type(self).__name__, **{p.name: config_of(getattr(self, p.name)) for p in self._params()}}

    def _spell(self, given: frozenset) -> str:
        parts = []
        for p in self._params():
            v = getattr(self, p.name)
            if p.default is not inspect.Parameter.empty and p.name not in given:
                d = config_of(p.default)
                if config_of(v) == d or (d is None and isinstance(v, (dict, list, tuple)) and not v):
                    continue
            text = repr(v)
            parts.append(text if p.default is inspect.Parameter.empty else f"{p.name}={text}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __repr__(self) -> str:
        """The method in the grammar of :func:`parse`: arguments without a default first, as
        positional ones, then, as keywords, those the caller passed and those that differ from
        their defaults (``TopK(0.01)`` reads ``TopK(ratio=0.01)``)."""
        return self._spell(self.__dict__.get("_given", frozenset()))

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.config() == self.config()

    def __hash__(self) -> int:
        return hash(self._spell(frozenset()))  # the configuration's spelling: equal objects hash alike


def config_of(value: Any) -> Any:
    """A value as plain data: registered objects as their config, tuples as lists, dicts by item."""
    if isinstance(value, Registered):
        return value.config()
    if hasattr(value, "to_dict") and not isinstance(value, type):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [config_of(v) for v in value]
    if isinstance(value, dict):
        return [[config_of(k), config_of(v)] for k, v in value.items()]
    return value


def register_frontend(cls: type) -> type:
    """Let the grammar name a front end that is not a :class:`Registered` subclass (an
    optimizer wrapper such as ``LocalSGD``): it parses to a :class:`Spec`."""
    old = _CLASSES.setdefault(cls.__name__, cls)
    if old is not cls:
        raise TypeError(f"a method named {cls.__name__!r} is already registered by {old.__module__}")
    _FRONTENDS.add(cls)
    return cls


def _kind(cls: type) -> str:
    return "frontend" if cls in _FRONTENDS else cls.kind


def register_value(name: str, value: Any) -> None:
    """Let the grammar name ``value`` (a class or a constant that is not a method, e.g. ``Link``)."""
    old = _VALUES.setdefault(name, value)
    if old is not value:
        raise TypeError(f"{name!r} is already a registered value")


def load_methods() -> None:
    """Register every method gradzip ships: import the modules that define them, as the
    table lists them (:func:`gradzip._names.method_modules`). ``import gradzip`` loads its
    modules lazily, so a process that imported only ``gradzip.registry`` (or another
    submodule) has not yet. The package imports them (the loader ``gradzip/__init__.py``
    installs in the table), not this module, which sits below them."""
    _names.load(_names.method_modules())


def lookup(name: str) -> type:
    """The class (or front end) registered as ``name``; ``ValueError`` naming the choices."""
    if name not in _CLASSES:
        load_methods()
    try:
        return _CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}{_did_you_mean(name, names())}; choose from {names()}") from None


def _did_you_mean(word: str, choices) -> str:
    """``" (did you mean 'TopK'?)"`` for the closest of ``choices`` (case aside), or ``""``."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def names(kind: str | None = None) -> list[str]:
    """Registered method names (of one kind, or all), sorted."""
    load_methods()
    return sorted(n for n, c in _CLASSES.items() if kind is None or _kind(c) == kind)


@dataclass
class Spec:
    """A front-end method named in a spec, not built yet: ``cls(..., *args, **kwargs)``."""

    cls: type
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.cls.__name__}({', '.join(parts)})"


def _build(node, context: dict):
    if isinstance(node, ast.Name):
        if node.id in _VALUES:
            return _VALUES[node.id]
        return _make(lookup(node.id), [], {}, context)
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            raise ValueError(f"cannot read {ast.unparse(node.func)!r} in a method spec (names of methods only)")
        args = [_build(a, context) for a in node.args]
        if any(k.arg is None for k in node.keywords):
            raise ValueError("a method spec cannot use **kwargs")
        seen: set = set()
        for k in node.keywords:  # Python refuses f(x=1, x=2) when it compiles; ast.parse does not
            if k.arg in seen:
                raise ValueError(f"{node.func.id}: keyword argument repeated: {k.arg}")
            seen.add(k.arg)
        kwargs = {k.arg: _build(k.value, context) for k in node.keywords}
        if node.func.id in _VALUES:
            return _VALUES[node.func.id](*args, **kwargs)
        return _make(lookup(node.func.id), args, kwargs, context)
    if isinstance(node, ast.Dict):
        return {_build(k, context): _build(v, context) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.List):
        return [_build(e, context) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_build(e, context) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_build(node.operand, context)
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(
            f"cannot read {ast.unparse(node)!r} in a method spec (literals and method calls only)"
        ) from None


def _make(cls: type, args: list, kwargs: dict, context: dict):
    if _kind(cls) == "frontend":
        return Spec(cls, args, kwargs)
    extra = getattr(cls, "spec_defaults", None)
    if extra is not None:
        for k, v in extra(kwargs, context).items():
            kwargs.setdefault(k, v)
    try:
        return cls(*args, **kwargs)
    except TypeError as e:
        hint = ""
        params = [p.name for p in cls._params()] if issubclass(cls, Registered) else []
        unknown = [k for k in kwargs if k not in params]
        if params and unknown and "unexpected keyword" in str(e):
            hint = _did_you_mean(unknown[0], params)
        raise ValueError(f"{cls.__name__}: {e}{hint}") from None


def parse(spec: str, context: dict[str, Any] | None = None) -> Any:
    """One method from its spec: a codec or protocol object, a :class:`Spec` for a front end, or a
    value registered with :func:`register_value` (typed ``Any``, so that the result passes where
    a codec or protocol is expected).

    ``context`` offers defaults to classes that ask for them (``spec_defaults``: e.g.
    ``Policy(auto=True)`` takes the ``link`` of ``gradzip plan``)."""
    try:
        tree = ast.parse(spec.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse method {spec!r}: {exc.msg}") from None
    return _build(tree.body, context or {})


def parse_list(spec: str, context: dict[str, Any] | None = None) -> dict[str, Any]:
    """``"A, B(x=1)"`` to ``{label: method}`` in order; labels are the items as written."""
    try:
        tree = ast.parse(f"[{spec}]", mode="eval")
    except SyntaxError as exc:
        msg = exc.msg
        try:  # the error as the user's own text reads (not the brackets wrapped around it)
            ast.parse(spec.strip(), mode="eval")
        except SyntaxError as own:
            msg = own.msg
        raise ValueError(f"cannot parse methods {spec!r}: {msg}") from None
    out: dict = {}
    items = tree.body.elts
    for i, node in enumerate(items, 1):
        label = ast.unparse(node)
        if label in out:
            raise ValueError(f"method {label!r} is listed twice")
        if not isinstance(node, (ast.Name, ast.Call)):
            raise ValueError(f"{label!r} is a value, not a method: name one, such as TopK(0.01) (plain DDP: DDP)")
        try:
            out[label] = _build(node, context or {})
            if isinstance(out[label], Registered) and _kind(type(out[label])) == "schedule":
                raise ValueError("a schedule is an argument of a method (TopK(ratio=Linear(...))), not a method")
        except ValueError as exc:
            where = f"method {i} of {len(items)}, {label!r}" if len(items) > 1 else f"method {label!r}"
            raise ValueError(f"{where}: {exc}") from None
    if not out:
        raise ValueError("methods must name at least one method")
    return out
