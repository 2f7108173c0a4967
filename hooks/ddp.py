"""DDP communication hook: one line to compress DDP's gradient traffic.

    state = register_hook(ddp_model, gradzip.Threshold(tau=1e-3))      # or "Threshold(tau=1e-3)"
    ddp_model.register_comm_hook(*comm_hook(ddp_model, "TopK(0.01)"))  # torch's own API, same thing

The hook is a thin adapter: it names each gradient in the bucket after its
parameter, hands them to the :class:`gradzip.engine.Engine`, and returns the
engine's future. Residuals are keyed by parameter name, so DDP's bucket rebuild
after the first iteration does not touch them.

:func:`comm_hook` returns the ``(state, hook)`` pair that torch's
``DistributedDataParallel.register_comm_hook(state, hook)`` takes (and that torch's
wrappers such as ``fp16_compress_wrapper(hook)`` wrap); :func:`register_hook` registers that
pair. A DDP model takes one gradzip hook: a second one is refused before it changes anything.

After the last bucket of a step the hook calls ``engine.flush()`` and ``engine.end_step()``.
With ``on_nonfinite="raise"`` the last bucket's call waits for the step's futures and raises
``FloatingPointError`` from the hook itself (an exception set on a future would reach
``backward()`` as a ``RuntimeError``). With ``find_unused_parameters=True`` an all-zero
gradient is a parameter unused on this rank: it is sent as zeros and keeps its residual.
"""

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradzip.codecs.base import Codec
from gradzip.engine import Engine, check_real, layout_of
from gradzip.frontend import NONFINITE_HINT, FrontEnd, skip_nonfinite
from gradzip.momentum import Momentum
from gradzip.protocols.base import Protocol
from gradzip.protocols.flat import check_unused
from gradzip.registry import parse

#: The hook's signature, as DDP calls it.
Hook = Callable[["HookState", dist.GradBucket], torch.futures.Future]

#: The remedy the first non-finite step's warning names (``NONFINITE_HINT``). ``optimizer=`` is
#: no remedy to offer: it turns momentum correction on too (the Lightning and Accelerate front
#: ends name theirs).
DDP_FIX = (
    "call gz.skip_nonfinite(optimizer, state) with the state register_hook (or comm_hook) returned "
    "(register_hook(..., optimizer=opt) also installs it, with momentum correction)"
)


class HookState(FrontEnd):
    """What :func:`register_hook` returns, and the ``state`` of :func:`comm_hook`'s pair: the
    front-end surface of :class:`gradzip.frontend.FrontEnd` (``stats``, ``routes``, ``log_every``,
    ``state_dict``/``load_state_dict``, ``save``/``load``, ``check_owner``); its state is the
    engine's own."""

    #: DDP reduces ``.grad`` as accumulated: a step's verdict covers every micro-batch before it.
    _verdict_covers_grad = True

    def __init__(self, engine: Engine, names: dict[int, str], find_unused: bool = False) -> None:
        self.engine = engine
        self._names = names
        self.find_unused = find_unused
        self.futures: list[torch.futures.Future] = []  # this step's, with on_nonfinite="raise"

    @property
    def method(self) -> Codec | Protocol:
        """The codec or protocol the hook runs."""
        return self.engine.method

    @property
    def step(self) -> int:
        """Steps (backward passes through the hook) so far, as checkpointed."""
        return self.engine.step

    def names_of(self, params: list[torch.Tensor]) -> list[str]:
        """The names of the parameters DDP handed the hook, as the residuals are keyed."""
        try:
            return [self._names[id(p)] for p in params]
        except KeyError:
            raise RuntimeError("DDP handed the hook a parameter that the wrapped module does not own") from None


def gradzip_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The communication hook itself, with the :class:`HookState` of :func:`comm_hook` as its
    state: ``ddp.register_comm_hook(state, gradzip_hook)``."""
    grads = bucket.gradients()
    params = bucket.parameters()
    names = state.names_of(params)
    buf = bucket.buffer()  # flat, as the engine's result: the future is returned as it is, so
    # an error (FloatingPointError with on_nonfinite="raise") reaches backward() unwrapped
    fut = state.engine.reduce(
        names,
        grads,
        out_dtype=buf.dtype,
        dest=buf,
        zero_is_unused=state.find_unused,
        params=params if state.engine.momentum is not None else None,
    )
    if state.engine.on_nonfinite == "raise":
        state.futures.append(fut)
    if bucket.is_last():
        state.engine.flush()
        state.engine.end_step()
        if state.engine.on_nonfinite == "raise":
            # An exception set on the future would reach backward() as a RuntimeError (DDP
            # reads the future in C++); raised here, by the hook itself, it stays a
            # FloatingPointError. Backward has no gradient left to compute by now.
            futures, state.futures = state.futures, []
            for f in futures:
                f.wait()
    return fut


def as_method(method, what: str = "method") -> Codec | Protocol:
    """``method`` as a codec or protocol: one of them as it is, or a method spec read by
    :func:`gradzip.parse` (``"TopK(0.01)"``). ``TypeError`` naming what was given otherwise."""
    if isinstance(method, str):
        method = parse(method)
        if not isinstance(method, (Codec, Protocol)):
            raise TypeError(f"{what} must name a codec or protocol; {method!r} is not one (an optimizer wrapper?)")
        return method
    if isinstance(method, (Codec, Protocol)):
        return method
    if method is None:
        raise TypeError(
            f"{what} is None: pass a gradzip codec or protocol (gz.TopK(0.01)) or its spec ('TopK(0.01)'); "
            "for DDP's own allreduce register no hook (gz.Identity() runs it through gradzip, with its stats)"
        )
    raise TypeError(
        f"{what} must be a gradzip codec or protocol (gz.TopK(0.01)) or its spec ('TopK(0.01)'), "
        f"got {type(method).__name__}"
    )


def _claim(ddp_model: DistributedDataParallel, method: Codec | Protocol) -> None:
    """Refuse a model that has a communication hook already, or a gradzip state waiting to be
    registered: DDP takes one hook. Runs before anything changes (the optimizer's momentum)."""
    ref = ddp_model.__dict__.get("_gradzip_state")
    held = ref() if ref is not None else None
    if held is not None:
        raise RuntimeError(
            f"this DistributedDataParallel model has a gradzip hook already ({held.method!r}); DDP takes one "
            "communication hook per model: wrap the module in a new DistributedDataParallel for another method"
        )
    try:
        other = ddp_model._get_ddp_logging_data().get("comm_hook")
    except Exception:  # noqa: BLE001 - a torch without DDP's logging data: torch refuses on registration
        other = None
    if other:
        raise RuntimeError(
            f"this DistributedDataParallel model has the communication hook {other!r} already; DDP takes one "
            f"communication hook per model, so gradzip's ({method!r}) cannot be added"
        )


def comm_hook(
    ddp_model: DistributedDataParallel,
    method: Codec | Protocol | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    start_iter: int = 0,
    error_feedback: bool | None = None,
    on_nonfinite: str = "skip",
    optimizer: torch.optim.Optimizer | None = None,
    clip: float | None = None,
    precondition: bool = False,
    update: str = "optimizer",
    error_decay: float = 1.0,
    lr_weighted: bool = False,
) -> tuple[HookState, Hook]:
    """The ``(state, hook)`` pair of torch's ``DistributedDataParallel.register_comm_hook``::

        ddp.register_comm_hook(*comm_hook(ddp, "TopK(0.01)"))

        state, hook = comm_hook(ddp, gz.PowerSGD(rank=2))
        ddp.register_comm_hook(state, fp16_compress_wrapper(hook))  # torch's wrapper around it

    The same engine, checks, stats and checkpoints as :func:`register_hook` (which registers
    this pair): ``state`` is the :class:`HookState`. The arguments are :func:`register_hook`'s.
    ``ddp_model`` is claimed at once: a second gradzip hook (or pair) for it, or a model with a
    hook already, is a ``RuntimeError`` before the optimizer is touched. Torch's wrappers that
    cast the bucket (``fp16_compress_wrapper``) hand gradzip the cast gradients: the method then
    compresses float16 values, and its error feedback keeps float32 residuals.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_hook needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    method = as_method(method)
    find_unused = bool(getattr(ddp_model, "find_unused_parameters", False))
    if find_unused:
        check_unused(method)
    _claim(ddp_model, method)
    if precondition and optimizer is None:
        raise ValueError("precondition=True needs the Adam or AdamW optimizer= whose moments it takes over")
    if update != "optimizer" and optimizer is None:
        raise ValueError(f"update={update!r} replaces the optimizer's step: give the optimizer=")
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    trained = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
    check_real(trained)
    momentum, buffers = (
        Momentum.adopt(optimizer, trained, precondition=precondition, update=update, lr_weighted=lr_weighted)
        if optimizer is not None
        else (None, {})
    )
    engine = Engine(
        method,
        process_group=process_group,
        start_iter=start_iter,
        error_feedback=error_feedback,
        error_decay=error_decay,
        on_nonfinite=on_nonfinite,
        layout=layout_of(trained),
        momentum=momentum,
        clip=clip,
    )
    engine.adopt_momentum(buffers)
    engine.nonfinite_hint = NONFINITE_HINT.format(fix=DDP_FIX)
    names = {id(p): n for n, p in trained}
    state = HookState(engine, names, find_unused=find_unused)
    if optimizer is not None and engine.on_nonfinite == "skip":
        skip_nonfinite(optimizer, state)
    ddp_model.__dict__["_gradzip_state"] = weakref.ref(state)
    return state, gradzip_hook


def register_hook(
    ddp_model: DistributedDataParallel,
    method: Codec | Protocol | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    start_iter: int = 0,
    error_feedback: bool | None = None,
    on_nonfinite: str = "skip",
    optimizer: torch.optim.Optimizer | None = None,
    clip: float | None = None,
    precondition: bool = False,
    update: str = "optimizer",
    error_decay: float = 1.0,
    lr_weighted: bool = False,
) -> HookState:
    """Register gradzip as ``ddp_model``'s communication hook.

    Args:
        ddp_model: a ``DistributedDataParallel`` model, before its first backward, without a
            communication hook (a second one is a ``RuntimeError``, before anything changes).
        method: any gradzip codec (``gz.TopK(0.01)``) or protocol (``gz.PowerSGD(rank=2)``,
            ``gz.Policy(...)``), or its spec in the method grammar (``"TopK(0.01)"``,
            :func:`gradzip.parse`).
        process_group: defaults to DDP's own process group.
        start_iter: steps before this one use a plain allreduce (no compression).
        error_feedback: keep unsent mass in per-parameter residuals. ``None``
            turns it on for biased methods (``method.biased``).
        on_nonfinite: ``"skip"`` (a step where any rank's gradient holds a NaN/Inf
            yields an all-NaN average on every rank and leaves residuals and codec state
            untouched; call :func:`gradzip.skip_nonfinite` ``(optimizer, state)`` and
            ``optimizer.step()`` then skips that step, on every rank, or use a ``GradScaler``,
            which skips it too; with neither, the first such step warns) or ``"raise"``
            (``FloatingPointError`` on every rank).

        optimizer: a ``torch.optim.SGD`` whose momentum and weight decay the hook takes
            over (momentum correction, :mod:`gradzip.momentum`): momentum is applied on
            every rank before compression, sparse codecs zero it where they send, and the
            optimizer is left a plain SGD. A ``torch.optim.Adam`` or ``AdamW``: its first
            moment (beta1) is taken over alike and the optimizer keeps the rest. Other
            optimizers raise ``ValueError``. With ``on_nonfinite="skip"`` it also installs
            :func:`gradzip.skip_nonfinite` on the optimizer (finite steps are stepped as
            without it); to skip non-finite steps without momentum correction, call that
            instead of passing ``optimizer``.
        precondition: with an ``Adam``/``AdamW`` ``optimizer``, take its second moment over
            too, per rank, and compress Adam's step instead of its first moment; the
            optimizer then applies the averaged step as it is (:mod:`gradzip.momentum`). For
            codecs that send one magnitude per block, such as ``SignSGD``.
        clip: local gradient clipping: each gradient's norm is limited to
            ``clip / sqrt(world_size)`` before compression (DGC's rule).
        update: ``"optimizer"`` (the optimizer steps on the average) or ``"sign"``: with an
            ``optimizer``, the hook keeps its first moment as momentum correction does and
            replaces its step by ``p -= lr * sign(average)`` after the decoupled weight decay
            (signum, as DeMo applies it to a DCT-domain top-k: ``gz.DCT(gz.TopK(...))``).
        error_decay: ``beta`` in ``(0, 1]``: each residual is compensated as ``beta * r``
            (:mod:`gradzip.feedback`). DeMo is ``update="sign"`` with an SGD ``optimizer``
            without momentum, ``error_decay=0.999`` and a chunked top-k of the DCT:
            its residual is then DeMo's momentum (``docs/lm.md``).
        lr_weighted: with ``update="sign"``, each step's gradient enters the momentum times
            that step's learning rate (DeMo's reference code: ``delta = beta * delta + lr * g``),
            so that under a schedule the momentum weighs each gradient by its step's rate.

    With ``find_unused_parameters=True``, a parameter unused on a rank is sent as zeros
    and keeps its residual (``Engine.reduce(zero_is_unused=True)``).

    On the first step the ranks compare their configuration (method config,
    options, parameter names/shapes/dtypes) and raise ``ValueError`` naming the
    field that differs.

    Returns the :class:`HookState`: ``stats()``, ``routes()``, ``log_every()``, ``state_dict()``,
    ``load_state_dict()``, ``save()``, ``load()`` (:class:`gradzip.frontend.FrontEnd`).
    Torch's own API takes the same pair: :func:`comm_hook`.
    """
    state, hook = comm_hook(
        ddp_model,
        method,
        process_group=process_group,
        start_iter=start_iter,
        error_feedback=error_feedback,
        on_nonfinite=on_nonfinite,
        optimizer=optimizer,
        clip=clip,
        precondition=precondition,
        update=update,
        error_decay=error_decay,
        lr_weighted=lr_weighted,
    )
    ddp_model.register_comm_hook(state, hook)
    return state
