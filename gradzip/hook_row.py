"""Two names of the method grammar that are not methods of their own: ``DDP`` (plain DDP, no
hook: ``None``) and ``Hook(method, **options)``, a DDP hook's method with the options a
``gradzip bench`` row gives it. Both are registered values, so that ``gz.parse``, ``gradzip
plan --methods`` and ``gradzip bench --methods`` read every row name the bench writes.

``Hook(TopK(0.3), momentum_correction='off')`` is what ``register_hook(ddp, TopK(0.3), ...)``
runs, with options of two kinds:

* the hook's own (:func:`gradzip.hooks.register_hook`'s keywords): ``error_feedback``,
  ``update``, ``error_decay``, ``start_iter``, ``precondition``, ``lr_weighted``;
* the bench's, for that row's training: ``momentum_correction`` (``'on'``: the bench passes
  ``optimizer=`` to the hook; ``'off'``: it does not; ``'auto'``: for sparse codecs),
  ``momentum`` (SGD's momentum or AdamW's beta1) and ``lr_scale`` (a multiple of the bench's
  learning rate).

``gradzip plan`` costs a ``Hook`` as its ``method``: the options change no byte of a step
after ``start_iter``.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradzip.args as args

from .codecs.base import Codec
from .momentum import UPDATES
from .options import MOMENTUM_CORRECTION
from .protocols.base import Protocol
from .registry import register_value

__all__ = ["Hook", "HOOK_OPTIONS"]


@dataclass
class Hook:
    """A DDP hook's method with a bench row's options (module docstring). An option left at
    None takes the bench's (``--momentum-correction``, ``--precondition``) or
    :func:`~gradzip.hooks.register_hook`'s default."""

    method: Codec | Protocol
    momentum_correction: str | None = None
    precondition: bool | None = None
    error_feedback: bool | None = None
    update: str | None = None  # "sign": register_hook(update="sign") (the optimizer's momentum taken over)
    error_decay: float | None = None  # register_hook(error_decay=...)
    momentum: float | None = None  # the row's optimizer momentum (SGD) or beta1 (AdamW), else the bench's
    lr_scale: float | None = None  # the row's learning rate, a multiple of the bench's (DeMo's sign steps)
    start_iter: int | None = None  # register_hook(start_iter=...): plain allreduce before this step
    lr_weighted: bool | None = None  # register_hook(lr_weighted=...): DeMo's momentum of lr * g

    def __post_init__(self) -> None:
        if not isinstance(self.method, (Codec, Protocol)):
            raise TypeError(f"Hook() takes a codec or a protocol, got {self.method!r}")
        if self.momentum_correction is not None and self.momentum_correction not in MOMENTUM_CORRECTION:
            raise ValueError(
                f"momentum_correction must be one of {list(MOMENTUM_CORRECTION)}, got {self.momentum_correction!r}"
            )
        if self.precondition is not None and not isinstance(self.precondition, bool):
            raise TypeError(f"precondition must be True or False, got {self.precondition!r}")
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if self.update is not None and self.update not in UPDATES:
            raise ValueError(f"update must be one of {list(UPDATES)}, got {self.update!r}")
        if self.error_decay is not None:
            self.error_decay = args.number("error_decay", self.error_decay, 0.0, 1.0, lo_open=True)
        if self.momentum is not None:
            self.momentum = args.number("momentum", self.momentum, 0.0, 1.0, hi_open=True)
        if self.lr_scale is not None:
            self.lr_scale = args.number("lr_scale", self.lr_scale, 0.0, lo_open=True)
        if self.start_iter is not None:
            self.start_iter = args.integer("start_iter", self.start_iter, 0)
        if self.lr_weighted is not None and not isinstance(self.lr_weighted, bool):
            raise TypeError(f"lr_weighted must be True or False, got {self.lr_weighted!r}")

    def options(self) -> dict:
        """The options given (not None), in :data:`HOOK_OPTIONS` order."""
        return {k: getattr(self, k) for k in HOOK_OPTIONS if getattr(self, k) is not None}

    def __repr__(self) -> str:
        """The spelling the grammar reads back: ``Hook(TopK(ratio=0.3), momentum_correction='off')``."""
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"Hook({self.method!r}{', ' + opts if opts else ''})"


#: The options of a :class:`Hook` (every field but ``method``).
HOOK_OPTIONS = (
    "error_feedback",
    "momentum_correction",
    "precondition",
    "update",
    "error_decay",
    "momentum",
    "lr_scale",
    "start_iter",
    "lr_weighted",
)

register_value("Hook", Hook)
register_value("DDP", None)  # plain DDP: no hook
