"""DeMo as gradzip's DDP hook against a transcription of the authors' optimizer step
(bloc97/DeMo ``demo.py``, ``DeMo.step``): the same parameters after steps under a changing
learning rate, on two ranks."""

import math

import pytest
import torch
import torch.distributed as dist

import gradzip as gz
from gradzip.momentum import Momentum
from tests.support import run_ranks

pytestmark = pytest.mark.slow

LRS = (2e-3, 4e-3, 6e-3, 5e-3, 3e-3, 1e-3, 5e-4, 2e-4)  # a warm-up and a decay
WD, DECAY, TOPK, CHUNK = 0.01, 0.999, 32, 64


class _Net(torch.nn.Module):
    """2-D weights in 64 x 64 tiles, and vectors (biases, a LayerNorm), which DeMo cuts into rows of 64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(64, 128)
        self.ln = torch.nn.LayerNorm(128)
        self.out = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.out(torch.relu(self.ln(self.fc(x))))


def _loss(model, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    return ((model(x) - y) ** 2).mean()


def _dct(n):
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.float()


def _tiles(x):
    """DeMo's TransformDCT.encode layout: [row tiles, col tiles, 64 * 64] (a vector: [rows of 64, 64])."""
    return x.reshape(-1, CHUNK) if x.dim() == 1 else x.reshape(x.shape[0] // CHUNK, CHUNK, x.shape[1] // CHUNK, CHUNK)


def _encode(x):
    d = _dct(CHUNK)
    if x.dim() == 1:
        return _tiles(x) @ d.T
    return torch.einsum("yhxw,bh,dw->yxbd", _tiles(x), d, d).flatten(2)


def _decode(c, shape):
    d = _dct(CHUNK)
    if len(shape) == 1:
        return (c @ d).reshape(shape)
    c = c.reshape(*c.shape[:2], CHUNK, CHUNK)
    return torch.einsum("yxbd,bh,dw->yhxw", c, d, d).reshape(shape)


def _reference(rank, world):
    """``DeMo.step`` per parameter: decoupled decay, ``delta = decay * delta + lr * g``, the top 32
    of every chunk's DCT sent and removed from ``delta``, every rank's coefficients gathered and
    averaged over their senders (``scatter_reduce(mean, include_self=False)``), ``p -= lr * sign``."""
    model = _Net()
    delta = [torch.zeros_like(p) for p in model.parameters()]
    for step, lr in enumerate(LRS):
        model.zero_grad()
        _loss(model, step, rank).backward()
        with torch.no_grad():
            for p, d in zip(model.parameters(), delta):
                p.mul_(1.0 - lr * WD)
                d.mul_(DECAY).add_(p.grad, alpha=lr)
                c = _encode(d)
                idx = c.abs().topk(min(TOPK, c.shape[-1]), dim=-1, sorted=False).indices
                val = c.gather(-1, idx)
                d.sub_(_decode(torch.zeros_like(c).scatter_(-1, idx, val), p.shape))
                idxs = [torch.zeros_like(idx) for _ in range(world)]
                vals = [torch.zeros_like(val) for _ in range(world)]
                dist.all_gather(idxs, idx)
                dist.all_gather(vals, val)
                avg = torch.zeros_like(c).scatter_reduce_(
                    -1, torch.cat(idxs, -1), torch.cat(vals, -1), reduce="mean", include_self=False
                )
                p.sub_(_decode(avg, p.shape).sign(), alpha=lr)
    return [p.detach().clone() for p in model.parameters()]


def _gradzip(rank, world, lr_weighted):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.hooks import register_hook

    def dct(k):
        return gz.DCT(gz.ChunkTopK(k, chunk=CHUNK, average="senders"), chunk=CHUNK)

    ddp = DDP(_Net())
    opt = torch.optim.AdamW(ddp.parameters(), lr=LRS[0], betas=(0.0, 0.999), weight_decay=WD)
    # a vector's 64-element tiles keep 32, as DeMo's rows do: k = 32 * 4096 / 64
    method = gz.Policy(dct(TOPK), per_layer={"ln": dct(2048), "bias": dct(2048)})
    register_hook(ddp, method, optimizer=opt, update="sign", error_decay=DECAY, lr_weighted=lr_weighted)
    for step, lr in enumerate(LRS):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        _loss(ddp, step, rank).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _both(rank, world):
    return _reference(rank, world), _gradzip(rank, world, True), _gradzip(rank, world, False)


def test_demo_hook_steps_as_the_reference_demo_step():
    res = run_ranks(_both, 2, timeout=600)
    ref, ours, unweighted = res[0]
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[1], ours))  # replicas agree
    for a, b in zip(ref, ours):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), float((a - b).abs().max())
    # without lr_weighted the momentum weighs every gradient alike: other steps under the schedule
    assert any(not torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ref, unweighted))


def test_lr_weighted_needs_the_sign_update():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr_weighted"):
        Momentum.adopt(opt, list(model.named_parameters()), lr_weighted=True)
