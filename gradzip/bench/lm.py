"""The language-model task of ``gradzip bench`` (``--dataset shakespeare``).

A decoder-only transformer (GPT-2's block: pre-LayerNorm, causal self-attention, a GELU MLP
of 4x width, learned positions) trained byte by byte on the bundled text
(``gradzip/bench/data/tinyshakespeare.txt.gz``, checksummed; see that folder's README for its
source and licence): the first 90% trains, the last 10% is the held-out validation text.

* Every rank draws its own random windows of ``context + 1`` bytes from the training text, from
  a generator seeded by (seed, rank): for a given seed every method sees the same batches.
* The metric is the validation loss in nats per byte (cross-entropy, natural log); bits per
  byte are ``loss / ln 2`` and perplexity ``exp(loss)``. During training a fixed subset of the
  validation windows is scored every ``eval_every`` steps (the curve); the final loss scores
  every non-overlapping window of the validation text, shared out between the ranks and summed
  by a plain allreduce outside gradzip (not counted).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: The bundled corpus and the SHA-256 of its uncompressed bytes.
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt.gz")
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
#: The fraction of the text that trains; the rest is the validation text.
TRAIN_FRACTION = 0.9
VOCAB = 256  # bytes


@dataclass(frozen=True)
class GPTSize:
    """A model size of the language-model task."""

    layers: int
    width: int
    heads: int
    context: int

    def params(self) -> int:
        """Parameters of :class:`GPT` at this size (embeddings, blocks, final norm and head)."""
        d = self.width
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return VOCAB * d + self.context * d + self.layers * block + 2 * d + d * VOCAB


#: ``--lm-size``: ``tiny`` (the CPU default: 0.88M parameters, 1,000 steps on 4 CPU ranks in a
#: few minutes), ``micro`` (0.19M) and ``mini`` (3.3M) beside it for the size table, ``small``
#: and ``gpt2-small`` (GPT-2 small's shape, 85M parameters with a byte vocabulary, for
#: ``--device cuda``).
SIZES = {
    "micro": GPTSize(layers=3, width=64, heads=4, context=128),
    "tiny": GPTSize(layers=4, width=128, heads=4, context=128),
    "mini": GPTSize(layers=4, width=256, heads=8, context=128),
    "small": GPTSize(layers=6, width=256, heads=8, context=256),
    "gpt2-small": GPTSize(layers=12, width=768, heads=12, context=1024),
}


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """A byte-level decoder-only transformer of ``size`` (GPT-2's initialisation: normal(0, 0.02),
    the residual projections scaled by ``1 / sqrt(2 * layers)``)."""

    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        if size.width % size.heads:
            raise ValueError(f"width {size.width} is not a multiple of heads {size.heads}")
        self.size = size
        self.tok = torch.nn.Embedding(VOCAB, size.width)
        self.pos = torch.nn.Embedding(size.context, size.width)
        self.blocks = torch.nn.ModuleList([Block(size.width, size.heads) for _ in range(size.layers)])
        self.ln = torch.nn.LayerNorm(size.width)
        self.head = torch.nn.Linear(size.width, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * size.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_gpt(size: str | GPTSize, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(SIZES[size] if isinstance(size, str) else size)


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors (uint8) of the bundled text, checked against its SHA-256."""
    with gzip.open(CORPUS, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CORPUS_SHA256:
        raise RuntimeError(f"{CORPUS}: SHA-256 {digest} is not the bundled text's {CORPUS_SHA256}")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n = int(TRAIN_FRACTION * len(data))
    return data[:n].clone(), data[n:].clone()


class Batches:
    """This rank's training windows: ``batch`` random windows of ``context + 1`` bytes a step,
    from a generator seeded by (seed, rank), as int64 (inputs, targets)."""

    def __init__(self, train: torch.Tensor, context: int, batch: int, seed: int, rank: int) -> None:
        self.train, self.context, self.batch = train, context, batch
        self.gen = torch.Generator().manual_seed(1_000_003 * seed + rank)
        self.span = torch.arange(context + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, len(self.train) - self.context - 1, (self.batch,), generator=self.gen)
        w = self.train[start[:, None] + self.span].long()
        return w[:, :-1], w[:, 1:]


def windows(val: torch.Tensor, context: int, limit: int | None = None) -> torch.Tensor:
    """The non-overlapping validation windows of ``context + 1`` bytes (``limit``: that many,
    evenly spaced over the text), as a [n, context + 1] int64 tensor."""
    n = (len(val) - 1) // context
    idx = torch.arange(n) if limit is None or limit >= n else torch.linspace(0, n - 1, limit).round().long()
    return torch.stack([val[i * context : i * context + context + 1] for i in idx.tolist()]).long()


@torch.no_grad()
def val_loss(model: torch.nn.Module, wins: torch.Tensor, world: int = 1, rank: int = 0, batch: int = 32) -> float:
    """Mean cross-entropy (nats per byte) of ``model`` on ``wins``, shared out between ``world``
    ranks (rank r scores windows r, r + world, ...) and summed by an allreduce outside gradzip;
    every rank gets the same value."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    mine = wins[rank::world].to(dev)
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    for i in range(0, len(mine), batch):
        w = mine[i : i + batch]
        logits = model(w[:, :-1])
        total[0] += F.cross_entropy(logits.reshape(-1, VOCAB).float(), w[:, 1:].reshape(-1), reduction="sum").double()
        total[1] += w[:, 1:].numel()
    if world > 1:
        dist.all_reduce(total)
    model.train(was)
    return float(total[0] / total[1])
