"""gradzip.horovod against real Horovod 0.28.1 (``make test`` installs ../shared/wheels' wheel).

* One ``horovodrun -np 2 --gloo`` launch runs tests/frontends/horovod_job.py, which initialises both
  ``horovod.torch`` and ``gradzip.horovod`` and compares them check by check (the README's
  compatibility table names these checks); each check is reported by its own test below.
* The Horovod transport (gradzip's protocols on Horovod's collectives) is checked in the same
  job: same parameters as torch.distributed bit for bit, same bytes counted.
* Signatures and constants are compared with ``horovod.torch`` in this process; the adapters'
  refusals need no collective. Where Horovod is not importable, the tests that need it skip.
* One 2-rank torch.distributed test (tests/support/ranks.py) runs the drop-in without Horovod.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradzip as gz
import gradzip.horovod as gh
from gradzip.horovod import Compression, HorovodCompressor, adapt
from tests.support import run_ranks

ROOT = Path(__file__).resolve().parents[2]

try:
    import horovod.torch as hv
except ImportError as exc:  # pragma: no cover - CI installs the wheel
    hv = None
    WHY = f"Horovod is not importable ({exc}); make test installs ../shared/wheels/horovod-*.whl"
needs_horovod = pytest.mark.skipif(hv is None, reason=WHY if hv is None else "")

JOB_CHECKS = [
    "init",
    "identity_bit_exact",
    "op_sum",
    "op_average_int",
    "predivide_2",
    "groups_int",
    "num_groups",
    "groups_list",
    "backward_passes_2",
    "set_backward_passes",
    "process_set_global",
    "sparse_grads",
    "sparse_as_dense",
    "hvd_fp16",
    "gz_fp16",
    "hvd_none",
    "load_plain_state",
    "zero_grad_mid_step_raises",
    "broadcasts",
    "broadcast_gradzip_optimizer_state",
    "allreduce",
    "adapters_in_horovod",
    "example_identity_bit_exact",
    "integer_reductions",
    "async_handles",
    "grouped_collectives",
    "mismatched_ranks",
    "results_and_refusals_as_horovods",
    "alltoall_reducescatter",
    "objects_join_barrier",
    "process_sets",
    "build_queries",
    "timeline",
    "sync_batch_norm",
    "adasum",
    "broadcast_state_adam_after_wrap",
    "broadcast_state_sgd_weight_decay",
    "wrap_drops_state",
    "reinit",
    "compression_from_environment",
    "transport TopK(0.01)",
    "transport SignSGD()",
    "transport PowerSGD(rank=1)",
    "transport TwoPhase(TopK(0.01))",
    "transport Identity()",
    "transport_bf16_refused",
    "init_transport_horovod",
    "transport_horovod_broadcast_state",
    "transport_horovod_collectives",
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    horovodrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or shutil.which("horovodrun")
    if horovodrun is None:
        pytest.skip("horovodrun not found")
    prefix = tmp_path_factory.mktemp("hvd") / "out"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        # The codecs' torch reference path: the job compares gradzip.horovod with horovod.torch
        # (and its two transports), not kernels, and so its ranks need not import numba (~1 s each).
        GRADZIP_KERNELS="reference",
        # Horovod's gloo rendezvous waits 30 s by default; a loaded 2-core machine has missed it.
        HOROVOD_GLOO_TIMEOUT_SECONDS="120",
    )
    cmd = [
        horovodrun,
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        str(ROOT / "tests" / "frontends" / "horovod_job.py"),
        str(prefix),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    outs = [Path(f"{prefix}.{r}.json") for r in range(2)]
    if p.returncode != 0 or not all(o.exists() for o in outs):
        pytest.fail(f"horovodrun job failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return [json.loads(o.read_text()) for o in outs]


@needs_horovod
@pytest.mark.parametrize("name", JOB_CHECKS)
def test_horovodrun_job(job, name):
    for rank, results in enumerate(job):
        assert name in results, f"rank {rank} did not run {name!r}"
        r = results[name]
        assert r["ok"], f"rank {rank}, {name}:\n{r.get('error')}"


@needs_horovod
def test_job_covers_every_check_it_runs(job):
    assert sorted(job[0]) == sorted(JOB_CHECKS)


@needs_horovod
def test_sparse_gradients_stay_sparse_and_fp16_keeps_error_feedback(job):
    assert job[0]["sparse_grads"]["grad_is_sparse"] and job[0]["sparse_as_dense"]["grad_is_sparse"]
    assert job[0]["hvd_fp16"]["error_feedback"] and not job[0]["hvd_none"]["error_feedback"]
    assert job[0]["adapters_in_horovod"]["fp16_overflow"][:2] == ["inf", "-inf"]


# -- in this process ---------------------------------------------------------------------
@needs_horovod
def test_distributed_optimizer_signature_is_horovods():
    ours = list(inspect.signature(gh.DistributedOptimizer).parameters.values())
    theirs = list(inspect.signature(hv.DistributedOptimizer).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    for a, b in zip(ours, theirs):
        if b.name not in ("compression", "process_set"):
            assert a.default == b.default, b.name
    assert all(p.kind is p.KEYWORD_ONLY for p in ours[len(theirs) :])


@needs_horovod
@pytest.mark.parametrize(
    "fn",
    [
        "allreduce",
        "allreduce_",
        "allgather",
        "broadcast",
        "broadcast_",
        "broadcast_object",
        "broadcast_parameters",
        "broadcast_optimizer_state",
    ],
)
def test_function_parameters_are_horovods(fn):
    ours = [p.name for p in inspect.signature(getattr(gh, fn)).parameters.values()]
    theirs = [p.name for p in inspect.signature(getattr(hv, fn)).parameters.values()]
    assert ours == theirs


@needs_horovod
def test_constants_are_horovods():
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        assert getattr(gh, name) == getattr(hv, name), name
    for name in (
        "init",
        "shutdown",
        "is_initialized",
        "size",
        "rank",
        "local_rank",
        "local_size",
        "cross_rank",
        "cross_size",
        "barrier",
        "Compression",
        "DistributedOptimizer",
    ):
        assert callable(getattr(gh, name)) or isinstance(getattr(gh, name), type), name


def test_bf16_is_refused_at_construction():
    with pytest.raises(ValueError, match="no bfloat16 allreduce"):
        adapt(gz.BF16())
    with pytest.raises(AttributeError, match="no bfloat16 allreduce"):
        Compression.bf16  # noqa: B018


@pytest.mark.parametrize(
    "comp, why",
    [
        (gz.TopK(ratio=0.1), "not summable"),
        (gz.Threshold(tau=1e-3), "not summable"),
        (gz.RandomK(ratio=0.1), "error feedback"),
        (gz.Int8(allreduce=True), "not summable|error feedback|protocol"),
    ],
    ids=["topk", "threshold", "randomk", "int8"],
)
def test_adapters_refuse_what_an_allreduce_cannot_sum(comp, why):
    with pytest.raises(ValueError, match=why):
        adapt(comp)
    with pytest.raises(TypeError, match="gradzip codec"):
        adapt("fp16")


def test_fp16_adapter_keeps_horovods_overflow():
    t = torch.tensor([1e5, -7e4, 65504.0, 65520.0, 1.5], dtype=torch.float32)
    c, ctx = Compression.fp16.compress(t)
    assert c.dtype == torch.float16
    out = Compression.fp16.decompress(c, ctx)
    assert out.dtype == torch.float32
    assert out.tolist()[:2] == [float("inf"), float("-inf")] and out[2] == 65504.0 and out[4] == 1.5
    if hv is not None:
        hc, hctx = hv.Compression.fp16.compress(t)
        assert torch.equal(c, hc) and torch.equal(out, hv.Compression.fp16.decompress(hc, hctx))
    i = torch.arange(4)
    assert Compression.fp16.compress(i) == (i, None) and issubclass(Compression.fp16, HorovodCompressor)


def _torch_transport(rank, world):
    """The drop-in on torch.distributed alone (no Horovod): init reuses the process group, and the
    optimizer is gradzip.optim.DistributedOptimizer's pipeline, bit for bit."""
    gh.init()
    out = {"size": gh.size(), "rank": gh.rank(), "transport": gh.transport()}
    res = {}
    for kind in ("hvd", "gz"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.ReLU(), torch.nn.Linear(40, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if kind == "hvd":
            opt = gh.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression="TopK(0.05)")
        else:
            opt = gz.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=gz.TopK(0.05))
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 30, generator=g)).square().mean().backward()
            opt.step()
        res[kind] = [p.detach().clone() for p in model.parameters()]
        if kind == "hvd":
            out["isinstance_sgd"] = isinstance(opt, torch.optim.SGD)
            out["stats_bytes"] = opt.stats()["bytes_link"]
            sd = opt.state_dict()
            out["state_has_gradzip"] = "gradzip" in sd
            out["residuals"] = len(sd["gradzip"]["residuals"])
    out["same_as_gz_optim"] = all(torch.equal(a, b) for a, b in zip(res["hvd"], res["gz"]))
    errors = {}
    m = torch.nn.Linear(2, 2)
    for name, kw in {
        "adasum_sgd_ok": dict(op=gh.Adasum),
        "max": dict(op=gh.Max),
        "predivide_sum": dict(op=gh.Sum, gradient_predivide_factor=2.0),
        "passes0": dict(backward_passes_per_step=0),
        "process_set": dict(process_set=object()),
        "compression": dict(compression=object()),
    }.items():
        try:
            gh.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(), **kw
            )
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = type(exc).__name__
    out["errors"] = errors
    return out


def test_torch_transport_on_two_ranks():
    outs = run_ranks(_torch_transport, 2)
    for r, o in enumerate(outs):
        assert (o["size"], o["rank"], o["transport"]) == (2, r, "torch")
        assert o["same_as_gz_optim"] and o["isinstance_sgd"] and o["state_has_gradzip"] and o["residuals"] == 4
        assert o["stats_bytes"] > 0
        assert o["errors"] == {
            "adasum_sgd_ok": None,
            "max": "ValueError",
            "predivide_sum": "ValueError",
            "passes0": "ValueError",
            "process_set": "ValueError",
            "compression": "TypeError",
        }


def _mismatched_kinds(rank, world):
    """Ranks that issue different kinds of collective, or groups of different sizes, are refused
    on both ranks, which then go on (Horovod pairs tensors by name and stalls on these)."""
    gh.init()
    cases = {
        "kind": lambda: gh.allreduce(torch.ones(2)) if rank == 0 else gh.allgather(torch.ones(2)),
        "count": lambda: gh.grouped_allgather([torch.ones(2)] * (1 + rank)),
        "root": lambda: gh.broadcast(torch.ones(2), rank),
        "scales": lambda: gh.allreduce(torch.ones(2), prescale_factor=1.0 + rank),
        "alltoall": lambda: gh.alltoall(torch.ones(2, 1 + rank)),
    }
    out = {}
    for label, fn in cases.items():
        try:
            fn()
            out[label] = None
        except gh.HorovodInternalError as exc:
            out[label] = str(exc)
    ps = gh.add_process_set([1])
    try:
        out["set rank"] = ps.rank()
    except ValueError as exc:
        out["set rank"] = f"ValueError: {exc}"
    out["after"] = gh.allreduce(torch.ones(2), op=gh.Sum).tolist()
    torch.manual_seed(rank)  # replicas that start apart: the optimizer's first step says how to fix it
    model = torch.nn.Linear(3, 2)
    opt = gh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    try:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        out["apart"] = None
    except ValueError as exc:
        out["apart"] = str(exc)
    return out


def test_ranks_that_issue_different_collectives_are_refused_on_every_rank():
    outs = run_ranks(_mismatched_kinds, 2)
    for rank, o in enumerate(outs):
        assert o["kind"].startswith("Mismatched ALLGATHER/ALLREDUCE collective operations"), o
        assert o["count"].startswith("Mismatched ALLGATHER numbers of tensors: rank 0 sent 1, but rank 1 sent 2"), o
        assert o["root"].startswith("Mismatched BROADCAST root ranks: rank 0 sent 0, but rank 1 sent 1"), o
        assert o["scales"].startswith("Mismatched ALLREDUCE prescale and/or postscale factors"), o
        assert o["alltoall"].startswith("Mismatched ALLTOALL tensor shapes beyond the first dimension"), o
        assert o["set rank"] == (0 if rank == 1 else "ValueError: Process is not part of provided process set.")
        assert o["after"] == [2.0, 2.0]
        assert o["apart"] is not None and "hvd.broadcast_parameters(model.state_dict(), root_rank=0)" in o["apart"]


def test_uninitialized_is_an_error():
    if gh.is_initialized():
        pytest.skip("initialized in this process")
    with pytest.raises(ValueError, match="not been initialized"):
        gh.size()


# -- every public name -----------------------------------------------------------------------
def _public(module) -> set[str]:
    return {n for n in dir(module) if not n.startswith("_")}


@needs_horovod
def test_every_public_name_of_horovod_torch_is_here():
    """dir() of horovod.torch 0.28.1 and of its elastic module, against gradzip.horovod's: no
    name missing (docs/horovod.md lists each, with what differs)."""
    import horovod.torch.elastic as hv_elastic

    assert sorted(_public(hv) - _public(gh)) == []
    assert sorted(_public(hv_elastic) - _public(gh.elastic)) == []
    for sub in ("compression", "elastic", "functions", "mpi_ops", "optimizer", "sync_batch_norm", "mpi_lib_v2"):
        assert getattr(gh, sub).__name__ == f"gradzip.horovod.{sub}"
    assert issubclass(gh.HorovodInternalError, RuntimeError)
    assert isinstance(gh.SyncBatchNorm(4), torch.nn.modules.batchnorm._BatchNorm)
    for name in ("State", "ObjectState", "TorchState", "ElasticSampler", "run"):
        assert hasattr(gh.elastic, name), name


def test_docs_table_names_every_public_name():
    """docs/horovod.md's compatibility table has a row for every public name of gradzip.horovod."""
    import re

    text = (ROOT / "docs" / "horovod.md").read_text()
    named = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            named.update(re.findall(r"`([A-Za-z_0-9]+)`", line.split("|")[1]))
    assert sorted(set(gh.__all__) - named) == []
