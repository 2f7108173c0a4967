"""What one benchmark runs: its rows (:class:`Method`) and its settings (:class:`BenchConfig`),
the optimizer and learning-rate schedule every row trains with, and the hook options each row
gets (momentum correction, clipping)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codecs.base import Codec
from ..hook_row import HOOK_OPTIONS as _HOOK_OPTIONS
from ..hook_row import Hook
from ..momentum import Momentum
from ..options import (
    CLIP_MODES,
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    DEFAULT_METHODS,
    DEFAULT_STEPS,
    DEFAULT_WARMUP_STEPS,
    DEFAULT_WEIGHT_DECAY,
    LM_DATASETS,
    LR_SCHEDULES,
    MOMENTUM_CORRECTION,
    N_TRAIN,
    OPTIMIZERS,
)
from ..protocols.base import Protocol
from ..registry import Spec, load_methods, parse_list
from . import lm

# Registering is defining: every module that defines a method of the grammar is imported.
load_methods()


@dataclass
class Method:
    """One row of the benchmark: a DDP hook running a codec or protocol, plain DDP
    (``method=None``), or a front end such as local SGD (a :class:`~gradzip.registry.Spec`).
    ``momentum_correction`` and ``precondition``: the row's own hook options (None: the
    bench's)."""

    name: str
    method: Codec | Protocol | Spec | None = None
    error_feedback: bool | None = None  # None: on for biased methods
    momentum_correction: str | None = None
    precondition: bool | None = None
    update: str | None = None
    error_decay: float | None = None
    momentum: float | None = None
    lr_scale: float | None = None
    start_iter: int | None = None
    lr_weighted: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.method, Hook):
            hook = self.method
            self.method = hook.method
            for key in _HOOK_OPTIONS:
                if getattr(hook, key) is not None:
                    setattr(self, key, getattr(hook, key))

    def describe(self) -> str:
        if self.method is None:
            return "plain DDP"
        opts = [f"{k}={getattr(self, k)!r}" for k in _HOOK_OPTIONS if getattr(self, k) is not None]
        return repr(self.method) + (f" ({', '.join(opts)})" if opts else "")

    @property
    def hookless(self) -> bool:
        """Plain DDP or a front end that wraps the optimizer (no DDP hook)."""
        return self.method is None or isinstance(self.method, Spec)


def parse_methods(spec: str) -> dict[str, Method]:
    """``"Identity, TopK(ratio=0.01), LocalSGD(period=8)"`` to ``{label: Method}``, labels as
    written; ``Identity`` (the baseline for the deltas) is put first, added if missing."""
    methods = {label: Method(label, m) for label, m in parse_list(spec).items()}
    if "Identity" not in methods:
        methods = {"Identity": Method("Identity", parse_list("Identity")["Identity"]), **methods}
    base = methods.pop("Identity")
    return {"Identity": base, **methods}


def default_methods() -> dict[str, Method]:
    return parse_methods(DEFAULT_METHODS)


def as_methods(methods) -> dict[str, Method]:
    """``{label: Method | codec | protocol | Spec | None}`` to ``{label: Method}``."""
    return {k: v if isinstance(v, Method) else Method(k, v) for k, v in methods.items()}


@dataclass
class BenchConfig:
    """One benchmark's settings. ``lr`` and ``weight_decay`` default by dataset and optimizer
    (:data:`~gradzip.options.DEFAULT_LR`, :data:`~gradzip.options.DEFAULT_WEIGHT_DECAY`);
    ``seeds`` defaults to ``(seed,)``. ``momentum`` is SGD's momentum, or AdamW's beta1.

    The image tasks (``mnist``, ``digits``) train ``epochs`` over their training set and score
    test accuracy at each epoch's end; the language-model task (``shakespeare``,
    :mod:`gradzip.bench.lm`) trains ``steps`` steps of ``batch_size`` windows a rank and scores
    the validation loss every ``eval_every`` steps."""

    dataset: str = "mnist"
    workers: int = 2
    epochs: int | None = None  # image tasks; None: the dataset's default (DEFAULT_EPOCHS)
    steps: int | None = None  # the language model; None: DEFAULT_STEPS
    batch_size: int | None = None  # per rank; None: 32 images, 8 windows of text
    optimizer: str | None = None  # None: sgd for the image tasks, adamw for the language model
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float | None = None
    lr_schedule: str = "cosine"  # over the whole run, after the warm-up
    warmup_epochs: float = 0.0  # linear warm-up from lr / warm-up steps to lr (image tasks)
    warmup_steps: int | None = None  # the same in steps; wins over warmup_epochs
    hidden: tuple = (256, 256)  # MLP (digits)
    lm_size: str = "tiny"  # the language model's size (gradzip.bench.lm.SIZES)
    eval_every: int | None = None  # the language model: validation loss every this many steps (None: 100)
    seed: int = 0  # the seed train_one uses; run() trains once per seed in ``seeds``
    seeds: tuple | None = None
    bucket_cap_mb: float = 25.0
    threads: int = 1  # torch threads per rank
    timeout_s: float = 600.0
    device: str = "cpu"
    train_limit: int | None = None  # use only the first n training samples (--quick)
    #: SGD's momentum (AdamW's beta1) taken over by the hook (momentum correction,
    #: ``register_hook(optimizer=)``): "auto" for sparse codecs (TopK, RandomK,
    #: ``Threshold(mask=True)``), "on" for every compressing method with error feedback, "off" never.
    momentum_correction: str = "auto"
    #: Gradient clipping for every row, the baseline too; None: off. ``clip_mode`` says where:
    #: "local" in the DDP hook (``register_hook(clip=)``: each tensor's norm on each rank to
    #: ``clip / sqrt(workers)``, before momentum correction and compression; rows without a hook
    #: are refused); "global": ``clip_grad_norm_(clip)`` over the gradients the optimizer steps
    #: on (DDP's average; a local SGD rank's own gradients), as a DDP training script does.
    clip: float | None = None
    clip_mode: str = "local"
    #: With AdamW and momentum correction, the hook keeps Adam's second moment per rank too and
    #: compresses Adam's step (``register_hook(precondition=True)``, :mod:`gradzip.momentum`).
    precondition: bool = False

    def __post_init__(self) -> None:
        if self.dataset not in N_TRAIN and self.dataset not in LM_DATASETS:
            raise ValueError(f"dataset must be one of {sorted([*N_TRAIN, *LM_DATASETS])}, got {self.dataset!r}")
        if self.optimizer is None:
            self.optimizer = "adamw" if self.is_lm else "sgd"
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {list(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.momentum_correction not in MOMENTUM_CORRECTION:
            raise ValueError(
                f"momentum_correction must be one of {list(MOMENTUM_CORRECTION)}, got {self.momentum_correction!r}"
            )
        if self.warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be a finite number > 0 (or None), got {self.clip}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {list(CLIP_MODES)}, got {self.clip_mode!r}")
        if self.precondition and self.optimizer != "adamw":
            raise ValueError(f"precondition takes over AdamW's second moment; optimizer {self.optimizer!r} has none")
        if self.precondition and self.momentum_correction != "on":
            # "auto" corrects sparse codecs only: SignSGD, the codec precondition is for, would be left out
            raise ValueError(
                f"precondition is part of momentum correction: it needs momentum_correction='on', "
                f"got {self.momentum_correction!r}"
            )
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.is_lm:
            if self.lm_size not in lm.SIZES:
                raise ValueError(f"lm_size must be one of {list(lm.SIZES)}, got {self.lm_size!r}")
            if self.eval_every is not None and self.eval_every < 1:
                raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.batch_size is None:
            self.batch_size = 8 if self.is_lm else 32
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.lr is None:
            self.lr = DEFAULT_LR.get((self.dataset, self.optimizer), DEFAULT_LR[self.optimizer])
        if self.weight_decay is None:
            self.weight_decay = DEFAULT_WEIGHT_DECAY[self.optimizer]
        if self.steps_per_epoch() < 1:
            raise ValueError(
                f"{self.workers} ranks of batch {self.batch_size} get no full batch from the {self.dataset} "
                f"training set ({N_TRAIN[self.dataset]} samples): use fewer --workers or a smaller --batch-size"
            )
        self.seeds = (self.seed,) if self.seeds is None else tuple(int(s) for s in self.seeds)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        self.hidden = tuple(self.hidden)

    @property
    def is_lm(self) -> bool:
        return self.dataset in LM_DATASETS

    @property
    def metric(self) -> str:
        """The row's figure of merit: ``accuracy`` (higher is better) or ``val_loss`` (lower)."""
        return "val_loss" if self.is_lm else "accuracy"

    def hook_extras(self) -> str:
        """The hook options in force, for titles and console lines: "" or ", local clipping 2, ..."."""
        return (
            f"{f', {self.clip_mode} clipping {self.clip:g}' if self.clip is not None else ''}"
            f"{', Adam moments per rank before compression' if self.precondition else ''}"
        )

    def resolved_epochs(self) -> int:
        if self.is_lm:
            return 1
        return self.epochs if self.epochs is not None else DEFAULT_EPOCHS[self.dataset]

    def resolved_eval_every(self) -> int:
        """Steps between two scores: an epoch (image tasks), ``eval_every`` (the language model)."""
        if self.is_lm:
            return min(self.eval_every or 100, self.total_steps())
        return self.steps_per_epoch()

    def steps_per_epoch(self, n_train: int | None = None) -> int:
        if self.is_lm:
            return self.total_steps()
        n = N_TRAIN[self.dataset] if n_train is None else n_train
        n = min(n, self.train_limit or n)
        return (n // self.workers) // self.batch_size

    def total_steps(self) -> int:
        """Optimizer steps of one run."""
        if self.is_lm:
            return self.steps if self.steps is not None else DEFAULT_STEPS[self.dataset]
        return self.steps_per_epoch() * self.resolved_epochs()

    def resolved_warmup(self) -> int:
        """Learning-rate warm-up in steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.is_lm and self.warmup_epochs == 0:
            return DEFAULT_WARMUP_STEPS[self.dataset]
        return round(self.warmup_epochs * self.steps_per_epoch())

    def length(self) -> str:
        """The run's length for console lines and titles: "16 epochs" or "1000 steps"."""
        return f"{self.total_steps()} steps" if self.is_lm else f"{self.resolved_epochs()} epochs"


def steps_per_method(cfg: BenchConfig, n_train: int | None = None) -> int:
    """Steps of one method over all of ``cfg.seeds``."""
    if cfg.is_lm:
        return cfg.total_steps() * len(cfg.seeds)
    return cfg.steps_per_epoch(n_train) * cfg.resolved_epochs() * len(cfg.seeds)


def lr_factor(step: int, total: int, warmup: int = 0, schedule: str = "cosine") -> float:
    """The learning rate of step ``step`` (0-based) of ``total``, as a fraction of the base rate:
    a linear warm-up over the first ``warmup`` steps ((step + 1) / warmup), then constant or a
    cosine from 1 down to 0 at the end of the run (the last step trains at a small, non-zero rate)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / span))


def make_optimizer(
    cfg: BenchConfig, params, momentum: float | None = None, lr_scale: float | None = None
) -> torch.optim.Optimizer:
    """The optimizer that every method trains with (``cfg.optimizer``); a row's own
    ``momentum`` (SGD's momentum or AdamW's beta1, else ``cfg.momentum``) and ``lr_scale``
    (its learning rate over ``cfg.lr``)."""
    m = cfg.momentum if momentum is None else momentum
    lr = cfg.lr * (1.0 if lr_scale is None else lr_scale)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=m, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=(m, 0.999), weight_decay=cfg.weight_decay)


def _codec_of(method):
    """The codec a hook method runs (itself, or a protocol's ``codec``), or None."""
    return method if isinstance(method, Codec) else getattr(method, "codec", None)


def corrects_momentum(method: Method, opt: torch.optim.Optimizer, cfg: BenchConfig | None = None) -> bool:
    """Whether the hook takes over ``opt``'s momentum for ``method`` (the row's
    ``momentum_correction``, else ``cfg.momentum_correction``)."""
    if method.update == "sign" and method.method is not None and not method.hookless:
        return True  # the hook takes the optimizer's momentum and step over
    mode = method.momentum_correction or ("auto" if cfg is None else cfg.momentum_correction)
    if mode == "off" or method.method is None or not Momentum.adoptable(opt):
        return False
    biased = bool(getattr(method.method, "biased", False))
    if not biased or method.error_feedback is False:
        return False
    if mode == "on":
        return True
    return bool(getattr(_codec_of(method.method), "sparse", False))


def hook_options(method: Method, opt: torch.optim.Optimizer, cfg: BenchConfig | None = None) -> dict:
    """Keyword arguments of :func:`register_hook` besides the method: error feedback as the
    row asks, and ``optimizer=opt`` where the hook corrects SGD's momentum (DGC: momentum
    accumulated per rank before compression and masked where a sparse codec sent), and
    ``clip=cfg.clip`` where the bench clips locally."""
    kw = {"error_feedback": method.error_feedback}
    if method.error_decay is not None:
        kw["error_decay"] = method.error_decay
    if method.start_iter is not None:
        kw["start_iter"] = method.start_iter
    if corrects_momentum(method, opt, cfg):
        kw["optimizer"] = opt
        if preconditions(method, cfg):
            kw["precondition"] = True
        if method.update is not None:
            kw["update"] = method.update
        if method.lr_weighted is not None:
            kw["lr_weighted"] = method.lr_weighted
    if cfg is not None and cfg.clip is not None and cfg.clip_mode == "local":
        kw["clip"] = cfg.clip
    return kw


def preconditions(method: Method, cfg: BenchConfig | None) -> bool:
    """Whether the row's hook keeps Adam's second moment too (the row's ``precondition``, else
    ``cfg.precondition``)."""
    if method.precondition is not None:
        return method.precondition
    return cfg is not None and cfg.precondition


def takes_over(method: Method, cfg: BenchConfig) -> bool:
    """Whether ``method``'s hook takes the optimizer's momentum over under ``cfg`` (then the
    gradients the optimizer steps on are momentum, or Adam's steps, not gradients)."""
    if method.hookless:
        return False
    probe = torch.nn.Parameter(torch.zeros(1))
    return corrects_momentum(method, make_optimizer(cfg, [probe]), cfg)


def check_methods(methods: dict[str, Method], cfg: BenchConfig) -> None:
    """Options that some rows cannot honour, and front ends' arguments their constructor would
    refuse (``plan_terms`` runs its checks), refused before any rank starts (ValueError)."""
    for label, m in methods.items():
        terms = getattr(m.method.cls, "plan_terms", None) if isinstance(m.method, Spec) else None
        if terms is not None:
            try:
                terms(*m.method.args, **m.method.kwargs)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{label}: {exc}") from None
        if isinstance(m.method, Spec) and getattr(m.method.cls, "builds_optimizer", False) and cfg.optimizer != "adamw":
            raise ValueError(f"{label}: {m.method.cls.__name__} is an Adam; bench it with --optimizer adamw")
        if m.precondition and (m.hookless or cfg.optimizer != "adamw"):
            raise ValueError(f"{label}: precondition takes over AdamW's second moment in a DDP hook")
        if m.precondition and not takes_over(m, cfg):
            raise ValueError(f"{label}: precondition is part of momentum correction: give it momentum_correction='on'")
    if cfg.clip is None:
        return
    if cfg.clip_mode == "local":
        hookless = [label for label, m in methods.items() if m.hookless]
        if hookless:
            raise ValueError(
                f"--clip clips in the DDP hook, which these rows do not use: {', '.join(hookless)}; "
                "bench them without --clip, or with --clip-mode global"
            )
    else:
        over = [label for label, m in methods.items() if takes_over(m, cfg)]
        if over:
            raise ValueError(
                f"--clip-mode global clips the gradients the optimizer steps on, but the hooks of these rows "
                f"hand it momentum (momentum correction): {', '.join(over)}; use --clip-mode local, or "
                "--momentum-correction off"
            )
