"""Compression ratio against accuracy: train one small model per method and seed on N ranks.

Used by ``gradzip bench`` (and ``make demo``), ``benchmarks/accuracy.py`` and the
multi-process tests. Every method trains once per seed; for a given seed every method starts
from the same weights, sees the same data and data order, and runs the same steps with the
same optimizer, learning-rate schedule and clipping. The ranks' processes are started once per
:func:`run` and train every method and seed in turn.

The modules, by job:

* :mod:`~gradzip.bench.config`: the rows (:class:`Method`) and settings (:class:`BenchConfig`),
  the optimizer, the schedule and each row's hook options;
* :mod:`~gradzip.bench.tasks` and :mod:`~gradzip.bench.lm`: the data and models (MNIST and
  sklearn's digits; a byte-level transformer language model on bundled text);
* :mod:`~gradzip.bench.train`: :func:`train_one` on every rank, :func:`run` over rows and seeds;
* :mod:`~gradzip.bench.report` and :mod:`~gradzip.bench.plot`: rows over seeds, the table, the
  result files and the Pareto plot.

What is reported per method (:func:`aggregate`):

* ``ratio``: the **link-byte ratio**, bytes plain DDP's ring allreduce would send on each
  rank's link over the same steps (``2(N-1)/N`` x the gradient bytes, every step) over
  the bytes gradzip sent on the link (``stats()["bytes_link"]``: each collective by its
  algorithm, see :mod:`gradzip.stats`). ``ratio_handed``: the same against the bytes handed
  to ``torch.distributed`` (flatters all-gathers).
* image tasks: final test accuracy (mean, sample std, min and max over seeds),
  ``accuracy_last3`` and ``delta_accuracy`` (the mean over seeds of method - Identity on the
  same seed); the language model: final validation loss in nats per byte (``val_loss``, also
  as ``bits_per_byte``) and ``gap_pct``, its gap to Identity's in percent, seed by seed.
"""

from ..machine import machine  # noqa: F401 (re-exported: results name their machine)
from ..options import (  # noqa: F401 (re-exported)
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    DEFAULT_METHODS,
    DEFAULT_SEEDS,
    DEFAULT_STEPS,
    DEFAULT_WEIGHT_DECAY,
    QUICK_EPOCHS,
    QUICK_STEPS,
    parse_seeds,
)
from .config import (
    BenchConfig,
    Method,
    check_methods,
    corrects_momentum,
    default_methods,
    hook_options,
    lr_factor,
    make_optimizer,
    parse_methods,
    steps_per_method,
    takes_over,
)
from .plot import _ratio_label, pareto_figure, pareto_front, place_labels, plot_pareto  # noqa: F401
from .report import (
    CSV_FIELDS,
    FIELDS_DOC,
    LM_CSV_FIELDS,
    METRICS,
    SCHEMA,
    aggregate,
    format_table,
    spread,
    write_outputs,
)
from .tasks import load_dataset, make_cnn, make_mlp, make_model
from .train import free_port, init_worker, process_context, run, train_one

__all__ = [
    "CSV_FIELDS",
    "FIELDS_DOC",
    "LM_CSV_FIELDS",
    "METRICS",
    "SCHEMA",
    "BenchConfig",
    "Method",
    "aggregate",
    "check_methods",
    "corrects_momentum",
    "default_methods",
    "format_table",
    "free_port",
    "hook_options",
    "init_worker",
    "load_dataset",
    "lr_factor",
    "make_cnn",
    "make_mlp",
    "make_model",
    "make_optimizer",
    "pareto_figure",
    "pareto_front",
    "parse_methods",
    "place_labels",
    "plot_pareto",
    "process_context",
    "run",
    "spread",
    "steps_per_method",
    "takes_over",
    "train_one",
    "write_outputs",
]
