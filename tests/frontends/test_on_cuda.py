"""CUDA end to end: every front end on CUDA tensors against the CPU reference path.

Front ends: the DDP comm hook, ``gz.DistributedOptimizer``, ``gz.LocalSGD``, ``gz.DiLoCo`` and
FSDP2 (``gradzip.fsdp.compress``). Each runs a few steps of a probe model whose gradient is a
fixed tensor per step and rank (``loss = sum(p * c)``: ``dloss/dp = c`` exactly on every
device), so every difference between two runs comes from gradzip's own path. Learning rates
and DiLoCo's outer momentum are powers of two (the optimizers' products are exact, fused or
not), so the parameters of LocalSGD and DiLoCo are comparable bit for bit as well.

* ``@pytest.mark.gpu`` (skipped without CUDA, ``tests/conftest.py``): each front end with CUDA
  tensors on NCCL at world size 1 (an NCCL group made beside the default gloo one) and on 2
  ranks with gloo (both ranks on ``cuda:0``; gloo runs allreduce, all-gather and all-to-all on
  CUDA tensors), against the same run on CPU tensors. Every method is bit-identical to the CPU
  path, whose codec math is the kernels' reference (quantizer draws are Philox on every
  device; Threshold, sign and top-k kernels are bit-exact; sums run in rank order), except
  PowerSGD: its products run in cuBLAS and in the CPU BLAS, so it is compared within a stated
  tolerance (``POWERSGD_RTOL``; its orthonormalization is the same bits on every device).
  ``backend_report()`` must show the fused Triton kernels chosen for CUDA tensors.
* On the CPU (always): the same harness (two of the probe's tensors) with the kernels forced
  (``GRADZIP_KERNELS=triton``, the Triton interpreter) against the reference path, on 2 gloo
  ranks: the code path a GPU takes through the codecs, bit for bit; and the CUDA-aware futures
  of the communicator.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from gradzip.comm import future_devices
from tests.support import run_ranks

# Awkward sizes: a 4099-element tensor (ragged kernel programs and FSDP shards), 29 and 33 rows.
SHAPES = {"emb": (33, 40), "w1": (40, 29), "b1": (29,), "w2": (4099,)}
STEPS = 3  # steps of each run on a GPU (DDP, optimizer, FSDP; twice as many for LocalSGD, DiLoCo)
LR = 0.5  # a power of two: p - LR * g rounds once, fused multiply-add or not
POWERSGD_RTOL = 1e-4  # |cuda - cpu| <= POWERSGD_RTOL * max|cpu| per tensor and step

# Method specs (gz.parse) per front end. Sampled and approximate top-k use a sample smaller
# than the 4099-element tensor, so that tensor takes the sampled route (the others are exact).
CODECS = [
    "Identity()",
    "FP16()",
    "Threshold(tau=1.5)",
    "TopK(0.05)",
    "TopK(0.05, mode='sampled', sample=512)",
    "TopK(0.05, mode='approx', sample=512)",
    "RandomK(0.1)",
    "SignSGD(block=1024)",
    "QSGD(7)",
    "TernGrad(block=1024)",
    "Int8()",
]
# Flat(codec): a DDP bucket (an optimizer's bucket) as one tensor.
METHODS = {
    "ddp": CODECS + ["PowerSGD(rank=2, min_compression_rate=1.0)", "Flat(Int8())", "Flat(TopK(0.05))"],
    "optim": CODECS + ["PowerSGD(rank=2, min_compression_rate=1.0)", "Flat(SignSGD(block=1024))"],
    "local_sgd": [
        "Identity()",
        "Threshold(tau=0.75)",
        "TopK(0.05, mode='approx', sample=512)",
        "SignSGD(block=1024)",
        "QSGD(7)",
        "Int8()",
        "Flat(Int8())",
    ],
    "diloco": ["Identity()", "TopK(0.05, mode='sampled', sample=512)", "TernGrad(block=1024)", "Int8()"],
    "fsdp": ["Identity()", "Int8()", "TopK(0.05)", "TopK(0.05, mode='approx', sample=512)", "QSGD(7)"],
}
# The kernels a method must run on CUDA tensors (its encoder; the quantizers' decode and frame
# checks too; PowerSGD's Gram-Schmidt).
KERNELS = {
    "PowerSGD": ["orthonormalize_rows_"],
    "Threshold": ["threshold_ef"],
    "SignSGD": ["sign_ef", "decode_add_quant", "quant_body_stats"],
    "QSGD": ["qsgd_encode", "decode_add_quant", "quant_body_stats"],
    "TernGrad": ["terngrad_encode", "decode_add_quant", "quant_body_stats"],
    "Int8": ["int8_encode", "decode_add_quant", "int8_apply_", "quant_body_stats"],
}
# The CPU interpreter run (slow: 0.03-0.13 s a kernel call on these sizes) covers each kernel
# family once, spread over the front ends, for INTERPRETED_STEPS steps.
INTERPRETED = {
    "ddp": ["Threshold(tau=1.5)", "SignSGD(block=1024)"],
    "optim": ["QSGD(7)", "PowerSGD(rank=2, min_compression_rate=1.0)"],
    "local_sgd": ["TopK(0.05, mode='approx', sample=512)"],
    "diloco": ["TernGrad(block=1024)"],
    "fsdp": ["TopK(0.05, mode='sampled', sample=512)", "Int8()"],
}
INTERPRETED_STEPS = 2
# ... on two of the probe's tensors (the interpreter's cost is per kernel launch): the ragged
# 4099 elements and the 33-row matrix (DDP and the optimizer: two buckets; FSDP: padded shards).
INTERPRETED_SHAPES = {name: SHAPES[name] for name in ("emb", "w2")}


def expected_kernels(spec: str, frontend: str = "ddp") -> list[str]:
    if spec.startswith("Flat("):
        spec = spec[len("Flat(") : -1]
    name = spec.split("(")[0]
    ops = list(KERNELS.get(name, []))
    if name == "Int8" and frontend == "fsdp":
        # FSDP's reduce-scatter encodes a tensor's pieces together, error feedback included
        ops = ["int8_encode_segments", "decode_add_quant", "quant_body_stats"]
    if name == "TopK" and ("sampled" in spec or "approx" in spec):
        ops.append("abs_select")
    return ops


class Probe(nn.Module):
    """Parameters of ``shapes`` (SHAPES); ``forward(coeffs) = sum_i (p_i * c_i).sum()``, so
    ``p_i.grad = c_i``."""

    def __init__(self, shapes: dict = SHAPES) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g)))

    def forward(self, coeffs):
        return sum((p * c).sum() for p, c in zip(self.parameters(), coeffs))


def coeffs(step: int, rank: int, device, shapes: dict = SHAPES) -> list[torch.Tensor]:
    """The gradient of every parameter at ``step`` on ``rank``: drawn on the CPU, then moved."""
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 1)
    return [torch.randn(shape, generator=g).to(device) for shape in shapes.values()]


def _cpu(ts) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True) for t in ts]


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run_ddp(spec, device, group, rank, steps, shapes=SHAPES):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip as gz
    from gradzip.hooks import register_hook

    model = Probe(shapes).to(device)
    ddp = DDP(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group, bucket_cap_mb=0.01
    )
    register_hook(ddp, gz.parse(spec))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        ddp(coeffs(t, rank, device, shapes)).backward()
        grads.append(_cpu(p.grad for p in model.parameters()))
        opt.step()
    return {"grads": grads, "params": _cpu(model.parameters())}


def _run_optim(spec, device, group, rank, steps, shapes=SHAPES):
    import gradzip as gz

    model = Probe(shapes).to(device)
    opt = gz.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model.named_parameters(),
        compression=gz.parse(spec),
        process_group=group,
        bucket_mb=0.01,
    )
    grads = []
    for t in range(steps):
        opt.zero_grad()
        model(coeffs(t, rank, device, shapes)).backward()
        opt.synchronize()
        grads.append(_cpu(p.grad for p in model.parameters()))
        with opt.skip_synchronize():
            opt.step()
    return {"grads": grads, "params": _cpu(model.parameters())}


def _run_periodic(spec, device, group, rank, steps, shapes=SHAPES, *, diloco: bool):
    import gradzip as gz

    model = Probe(shapes).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    if diloco:
        opt = gz.DiLoCo(inner, model, 2, gz.parse(spec), process_group=group, outer_kwargs={"lr": LR, "momentum": 0.5})
    else:
        opt = gz.LocalSGD(inner, model, period=2, compression=gz.parse(spec), process_group=group)
    params = []
    for t in range(2 * steps):
        inner.zero_grad(set_to_none=True)
        model(coeffs(t, rank, device, shapes)).backward()
        opt.step()
        params.append(_cpu(model.parameters()))
    return {"params_per_step": params, "params": params[-1]}


def _run_fsdp(spec, device, group, rank, steps, shapes=SHAPES):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import gradzip as gz

    model = Probe(shapes).to(device)
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)
    fully_shard(model, mesh=mesh)
    gz.fsdp.compress(model, reduce_scatter=gz.parse(spec))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        model(coeffs(t, rank, device, shapes)).backward()
        grads.append(_cpu(_full(p.grad) for p in model.parameters()))
        opt.step()
    return {"grads": grads, "params": _cpu(_full(p) for p in model.parameters())}


RUNS = {
    "ddp": _run_ddp,
    "optim": _run_optim,
    "local_sgd": lambda *a: _run_periodic(*a, diloco=False),
    "diloco": lambda *a: _run_periodic(*a, diloco=True),
    "fsdp": _run_fsdp,
}


def frontend_rank(rank, world, frontend, specs, device_kind, backend, kernels, steps=STEPS, shapes=SHAPES):
    """Run ``frontend`` with each method of ``specs`` on this rank; per method what the optimizer
    saw and the kernels chosen. ``device_kind``: "cpu" or "cuda"; ``backend``: "gloo" (the
    default group) or "nccl" (a group made here); ``kernels``: GRADZIP_KERNELS for the run;
    ``shapes``: the probe's parameters."""
    import gradzip.kernels as K

    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(world)), backend="nccl") if backend == "nccl" else None
    old = os.environ.get(K.ENV_VAR)
    if kernels is None:
        os.environ.pop(K.ENV_VAR, None)
    else:
        os.environ[K.ENV_VAR] = kernels
    out = {}
    try:
        for spec in specs:
            K.reset_dispatch()
            res = RUNS[frontend](spec, device, group, rank, steps, shapes)
            ops = K.backend_report()["ops"]
            res["chosen"] = {
                op: c[device.type]["backend"] for op, c in ((o, ops[o]["chosen"]) for o in ops) if device.type in c
            }
            out[spec] = res
    finally:
        if old is None:
            os.environ.pop(K.ENV_VAR, None)
        else:
            os.environ[K.ENV_VAR] = old
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.int32), b.view(-1).view(torch.int32))
    )


def assert_runs_match(got: dict, want: dict, frontend: str, shapes: dict = SHAPES) -> None:
    """Bit for bit (PowerSGD: within POWERSGD_RTOL) for every method, step and tensor."""
    assert got.keys() == want.keys()
    key = "params_per_step" if frontend in ("local_sgd", "diloco") else "grads"
    for spec in want:
        g_steps, w_steps = got[spec][key], want[spec][key]
        assert len(g_steps) == len(w_steps)
        for t, (gs, ws) in enumerate(zip(g_steps, w_steps)):
            assert len(gs) == len(ws) == len(shapes), (frontend, spec, t)
            for name, a, b in zip(shapes, gs, ws):
                if spec.startswith("PowerSGD"):
                    scale = float(b.abs().max())
                    assert float((a - b).abs().max()) <= POWERSGD_RTOL * max(scale, 1e-30), (frontend, spec, t, name)
                else:
                    assert _same(a, b), f"{frontend} {spec}: step {t}, {name} differs from the CPU reference path"


# -- on a GPU -----------------------------------------------------------------------------------


def _gpu_case(frontend, world, backend):
    want = run_ranks(frontend_rank, world, frontend, METHODS[frontend], "cpu", "gloo", None)
    got = run_ranks(frontend_rank, world, frontend, METHODS[frontend], "cuda", backend, None, fresh=True)
    for r in range(world):
        assert_runs_match(got[r], want[r], frontend)
        for spec, res in got[r].items():
            if frontend == "fsdp" and world == 1:
                # FSDP2 reduce-scatters nothing on one rank (foreach_reduce copies the input to
                # the output; the custom reduce-scatter is not called): no codec runs.
                assert res["chosen"] == {}, (frontend, spec, res["chosen"])
                continue
            for op in expected_kernels(spec, frontend):
                assert res["chosen"].get(op) == "triton", (frontend, spec, op, res["chosen"])


@pytest.mark.gpu
@pytest.mark.parametrize("frontend", list(METHODS))
def test_frontend_on_cuda_nccl_world1_matches_cpu(frontend):
    _gpu_case(frontend, 1, "nccl")


@pytest.mark.gpu
@pytest.mark.timeout(90)  # 5 to 7 s each on an H200; FSDP2's has hung: its ranks' stacks come at 45 s
@pytest.mark.parametrize("frontend", list(METHODS))
def test_frontend_on_cuda_gloo_2ranks_matches_cpu(frontend):
    _gpu_case(frontend, 2, "gloo")


def test_fsdp_on_one_rank_runs_no_codec():
    """Why the world-1 FSDP case expects no kernel: FSDP2 does not call the custom reduce-scatter
    on one rank (``foreach_reduce`` copies), so a compressed run is plain FSDP2, bit for bit."""
    got = run_ranks(frontend_rank, 1, "fsdp", ["Identity()", "Int8()"], "cpu", "gloo", None)[0]
    assert got["Int8()"]["chosen"] == {}
    for a, b in zip(got["Int8()"]["params"], got["Identity()"]["params"]):
        assert _same(a, b)


@pytest.mark.gpu
def test_backend_report_names_the_fused_kernels_on_cuda():
    import gradzip as gz
    import gradzip.kernels as K
    from gradzip.codecs.base import TensorContext

    K.reset_dispatch()
    x = torch.randn(100_003, device="cuda")
    for spec in (
        "Threshold(tau=1.0)",
        "SignSGD(block=1024)",
        "QSGD(7)",
        "TernGrad(block=1024)",
        "TopK(0.01, mode='approx')",
    ):
        m = gz.parse(spec)
        p = m.compress(x, TensorContext(name="x", dtype=x.dtype))
        m.decompress(p)
    chosen = {op: c["chosen"].get("cuda", {}).get("backend") for op, c in K.backend_report()["ops"].items()}
    for op in ("threshold_ef", "sign_ef", "qsgd_encode", "terngrad_encode", "abs_select", "decode_add_quant"):
        assert chosen[op] == "triton", (op, chosen)
    assert K.backend_report()["cuda_available"] is True


# -- on the CPU: the kernel path through every front end (Triton interpreter) ----------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@pytest.mark.skipif(not _interpreting(), reason="TRITON_INTERPRET is not set (a GPU is present: see the gpu tests)")
def test_frontends_on_cpu_with_forced_kernels_match_reference_path():
    """Every front end on 2 gloo ranks, its kernel-backed methods run once with the Triton
    kernels forced (interpreted on CPU tensors, as compiled ones run on CUDA tensors) and once
    on the reference path: bit for bit, the kernels chosen."""
    pytest.importorskip("triton")
    for frontend, specs in INTERPRETED.items():
        args = (frontend, specs, "cpu", "gloo")
        want = run_ranks(frontend_rank, 2, *args, "reference", INTERPRETED_STEPS, INTERPRETED_SHAPES)
        got = run_ranks(frontend_rank, 2, *args, "triton", INTERPRETED_STEPS, INTERPRETED_SHAPES)
        for r in range(2):
            assert_runs_match(got[r], want[r], frontend, INTERPRETED_SHAPES)
            for spec, res in got[r].items():
                for op in expected_kernels(spec, frontend):
                    assert res["chosen"].get(op) == "triton", (frontend, spec, op, res["chosen"])
                    assert want[r][spec]["chosen"].get(op) == "reference", (frontend, spec, op)


def test_protocol_futures_are_cuda_aware_on_the_call_device():
    """The communicator's futures are CUDA-aware on a CUDA call's device (so ``wait()`` orders
    the caller's stream after the decode) and plain for CPU calls; the engine passes the
    gradients' device."""
    assert future_devices(None) == [] and future_devices(torch.device("cpu")) == [] and future_devices("cpu") == []
    assert future_devices(torch.device("cuda", 1)) == [torch.device("cuda", 1)]
    assert future_devices("cuda:3") == [torch.device("cuda", 3)]
    assert run_ranks(_engine_passes_device, 2) == [True, True]


def _engine_passes_device(rank, world):
    import gradzip as gz
    from gradzip.engine import Engine

    engine = Engine(gz.Identity())
    seen = []
    submit = engine.comm.submit

    def spy(protocol, device=None):
        seen.append(device)
        return submit(protocol, device=device)

    engine.comm.submit = spy
    x = torch.arange(6, dtype=torch.float32)
    fut = engine.reduce(["x"], [x])
    engine.flush()
    engine.end_step()
    assert torch.equal(fut.wait(), torch.arange(6, dtype=torch.float32))
    assert seen == [x.device]
    return True


# -- benchmarks/gpu_step.py ---------------------------------------------------------------------


def _gpu_step_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_step.py"
    spec = importlib.util.spec_from_file_location("gz_bench_gpu_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_gpu_step(doc, mod, device_word):
    assert device_word in doc["device"].lower() and doc["errors"] == []
    assert set(doc["models"]) == {"tiny_resnet", "tiny_gpt"}
    for m in doc["models"].values():
        assert m["compute_ms_per_step"] > 0 and set(m["methods"]) == set(mod.DEFAULT_METHODS)
        rows = m["methods"]
        ident = rows["Identity()"]
        assert ident["wire_ratio_vs_allreduce"] == 1.0 and ident["breakeven_gbps"] is None
        for spec, row in rows.items():
            assert row["codec_ms_per_step"] > 0 and row["fraction_of_compute"] > 0, spec
        # the break-even link: codec time spent = wire time saved
        top = rows["TopK(0.01, mode='approx')"]
        assert top["wire_ratio_vs_allreduce"] > 10
        saved = m["allreduce_wire_bits_per_step"] - top["wire_bits_per_step"]
        extra = (top["codec_ms_per_step"] - ident["codec_ms_per_step"]) / 1e3
        if extra > 0:
            assert top["breakeven_gbps"] == pytest.approx(saved / extra / 1e9)


def test_gpu_step_benchmark_smoke_on_cpu(tmp_path):
    """benchmarks/gpu_step.py end to end on the CPU (tiny models, 2 steps, 2 ranks in the model)."""
    import json

    mod = _gpu_step_module()
    out = tmp_path / "gs.json"
    threads = torch.get_num_threads()
    try:
        rc = mod.main(
            [
                "--device",
                "cpu",
                "--models",
                "tiny",
                "--steps",
                "2",
                "--warmup",
                "0",
                "--world",
                "2",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    _check_gpu_step(json.loads(out.read_text()), mod, "cpu")


@pytest.mark.gpu
def test_gpu_step_benchmark_runs_on_cuda(tmp_path):
    import json

    mod = _gpu_step_module()
    out = tmp_path / "gs.json"
    assert mod.main(["--device", "cuda", "--models", "tiny", "--steps", "2", "--world", "8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    _check_gpu_step(doc, mod, "")
    assert any(v.get("cuda") == "triton" for v in doc["kernels_chosen"].values()), doc["kernels_chosen"]
