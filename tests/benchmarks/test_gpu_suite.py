"""benchmarks/gpu_suite.py, the one script a lent GPU runs, cannot rot: its smoke run goes
through every part on the CPU (the profile of every codec and protocol, the kernels under the
Triton interpreter at both dtypes, gpu_step on tiny models, pytest -m gpu), writes only into
the folder it is given, and summarizes against the goals; a budget skips parts and a part
that outlives its share is killed while the rest still report; the measured profile becomes
the plan's device profile without any figure of this CPU filled in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import gpu_suite, h100_profile
from benchmarks._common import ROOT
from gradzip.costmodel import CodecProfile
from gradzip.protocols.base import as_protocol
from gradzip.registry import names, parse

SLUG = gpu_suite.slug(f"cpu {__import__('platform').machine()} smoke")


def _suite(*argv, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_suite", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    before = {p for d in ("bench_out", "benchmarks/results") for p in (ROOT / d).rglob(f"*{SLUG}*")}
    run = _suite("--smoke", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = {p for d in ("bench_out", "benchmarks/results") for p in (ROOT / d).rglob(f"*{SLUG}*")}
    assert after == before  # nothing written outside --out
    return out, run.stdout


@pytest.mark.long
def test_smoke_runs_every_part_into_the_given_folder(smoke):
    out, text = smoke
    files = gpu_suite.files(SLUG)
    assert sorted(p.name for p in out.iterdir()) == sorted(files.values())
    suite = json.loads((out / files["suite"]).read_text())
    assert {p: s["status"] for p, s in suite["parts"].items()} == dict.fromkeys(gpu_suite.PARTS, "ok")
    assert suite["smoke"] is True and suite["device"] == f"cpu {__import__('platform').machine()} smoke"

    kernels = json.loads((out / files["kernels"]).read_text())
    rows = {(r["kernel"], r["dtype"]) for r in kernels["results"]}
    for name, _, _ in gpu_suite.ENCODERS:
        assert {(name, "float32"), (name, "bfloat16")} <= rows, name
    for name, _ in gpu_suite.DECODERS:
        assert (name, "float32") in rows, name
    assert {("topk_exact", "float32"), ("sampled_topk", "bfloat16")} <= rows
    assert {r["n"] for r in kernels["results"] if r["kernel"] == "sampled_topk_approx"} == {4099, 20011}

    step = json.loads((out / files["gpu_step"]).read_text())
    assert step["errors"] == [] and step["skipped"] == []
    for model in ("tiny_resnet", "tiny_gpt"):
        assert set(step["models"][model]["methods"]) == set(gpu_suite.STEP_GOAL_METHODS)

    profile = json.loads((out / files["profile"]).read_text())
    assert profile["errors"] == [] and len(profile["entries"]) == len(gpu_suite.PROFILE_METHODS)
    assert "whole codec calls" in profile["timing"]

    tests = (out / files["tests"]).read_text()
    assert "pytest -m gpu" in tests and "skipped" in tests  # no GPU here: its tests skip

    # the summary: one row per goal, read at the smoke run's sizes
    summary = {(r["goal"], r["item"]): r for r in suite["summary"]}
    assert len(summary) == len(gpu_suite.ENCODERS) + len(gpu_suite.DECODERS) + 3 + 2 * len(gpu_suite.STEP_METHODS) + 2
    assert summary[("pytest -m gpu", "every CUDA test")]["verdict"] == "missed"  # all skipped
    assert all(r["verdict"] != "not measured" for r in suite["summary"])
    assert "summary against the GPU goals on cpu" in text and "(a smoke run: CPU figures" in text


def test_every_codec_and_protocol_of_the_grammar_is_in_the_profile():
    measured = set()

    def walk(cfg):
        if isinstance(cfg, dict):
            measured.add(cfg.get("name"))
            for v in cfg.values():
                walk(v)

    for spec in gpu_suite.PROFILE_METHODS:
        walk(parse(spec).config())
    grammar = set(names("codec")) | set(names("protocol"))
    assert grammar - set(gpu_suite.COMPOSITE) <= measured, grammar - measured


@pytest.mark.long
def test_the_measured_profile_is_the_plans_device_profile(smoke):
    out, _ = smoke
    doc = json.loads((out / gpu_suite.files(SLUG)["profile"]).read_text())
    doc["source"] = "benchmarks/results/x.json"
    shipped = h100_profile.device_profile(doc)
    assert shipped["machine"]["built_by"] == "benchmarks/h100_profile.py" and shipped["timing"] == doc["timing"]
    prof = CodecProfile.from_dict(shipped, missing="raise")  # nothing measured here
    for spec in gpu_suite.PROFILE_METHODS:
        m = parse(spec)
        for world in (2, 8):
            prof.fit(as_protocol(m, world, feedback=m.biased), m.biased)
    # an unmeasured config takes its class's fit by the arguments that differ among the measured ones
    approx = parse("TopK(ratio=0.001, mode='approx')")
    assert prof.fit(approx) == prof.fit(parse("TopK(0.01, mode='approx')"))
    assert prof.fit(approx) != prof.fit(parse("TopK(0.01)"))
    assert prof.basis(approx).startswith("class: whole calls of TopK(") and "ratio" in prof.basis(approx)
    with pytest.raises(KeyError):  # no rank 8 was measured: the plan marks it rather than guess
        prof.fit(parse("PowerSGD(rank=8)"))
    with pytest.raises(KeyError):  # a nested method counts
        prof.fit(parse("Hierarchical(TopK(0.01), local_size=8)"))
    assert prof.fit(parse("Hierarchical(Int8(), local_size=8)")) == prof.fit(
        parse("Hierarchical(Int8(), local_size=4)")
    )


def test_device_key_names_the_plans_device():
    assert h100_profile.device_key("NVIDIA H100 80GB HBM3") == "h100"
    assert h100_profile.device_key("NVIDIA H200") == "h200"
    assert h100_profile.device_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert h100_profile.device_key("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"


@pytest.mark.long
def test_budget_skips_parts_and_a_part_past_its_share_is_killed(tmp_path):
    run = _suite("--smoke", "--out", str(tmp_path), "--budget", "0", timeout=300)
    assert run.returncode == 0, run.stderr
    suite = json.loads((tmp_path / gpu_suite.files(SLUG)["suite"]).read_text())
    assert {s["status"] for s in suite["parts"].values()} == {"skipped"}
    assert {r["verdict"] for r in suite["summary"]} == {"not measured"}
    assert "not measured" in run.stdout
    # a share too short for the part: killed with its process group, and the suite still reports
    out = tmp_path / "killed"
    run = _suite("--smoke", "--out", str(out), "--parts", "gpu_step", "--part-budget", "gpu_step=1", timeout=300)
    assert run.returncode == 1
    suite = json.loads((out / gpu_suite.files(SLUG)["suite"]).read_text())
    assert suite["parts"]["gpu_step"]["status"] == "killed at its share"
    assert "gpu_step: killed at its share" in run.stdout and "summary against the GPU goals" in run.stdout


def test_summary_reads_the_goals_from_the_files():
    def k(kernel, frac, n=gpu_suite.N64, **extra):
        return {"kernel": kernel, "backend": "triton", "dtype": "float32", "n": n, "fraction_of_copy": frac, **extra}

    kernels = {
        "results": [
            k("threshold_ef", 0.99),
            k("qsgd_encode", 0.44, route="one-pass"),
            k("qsgd_encode", 0.9, route="two-pass"),  # not the goal's route
            k("qsgd_encode", 0.95, dtype="bfloat16", route="one-pass"),  # not the goal's dtype
            k("sampled_topk_approx", 0.3, n=100 << 20, speedup_vs_torch_topk=12.0, count_over_k=1.2),
        ]
    }
    step = {"models": {"resnet50": {"compute_ms_per_step": 100.0, "methods": {"Int8()": {}}}}}
    step["models"]["resnet50"]["methods"]["TopK(0.01)"] = {"fraction_of_compute": 0.04, "codec_ms_per_step": 4.0}
    tests = "..\n70 passed, 832 deselected in 63.56s (0:01:03)\n"
    rows = {
        (r["goal"], r["item"]): r for r in gpu_suite.summarize({"kernels": kernels, "gpu_step": step, "tests": tests})
    }
    assert rows[("pytest -m gpu", "every CUDA test")] | {} == {
        "goal": "pytest -m gpu",
        "item": "every CUDA test",
        "measured": "70 passed",
        "target": "all pass, none skipped",
        "verdict": "met",
    }
    enc = "encoder at 64M fp32"
    assert rows[(enc, "Threshold with error feedback")]["verdict"] == "met"
    assert rows[(enc, "QSGD (s = 7, block 64)")]["measured"] == "44% of copy"
    assert rows[(enc, "QSGD (s = 7, block 64)")]["verdict"] == "missed"
    assert rows[(enc, "TernGrad (block 1024)")] | {} == {
        "goal": enc,
        "item": "TernGrad (block 1024)",
        "measured": "not measured",
        "target": ">= 80% of copy",
        "verdict": "not measured",
    }
    approx = "TopK(mode='approx') at 0.1% of 100M"
    assert rows[(approx, "speed-up over torch.topk")]["verdict"] == "met"
    assert rows[(approx, "elements sent / k")]["verdict"] == "missed"
    share = "codec share of a ResNet-50 step"
    assert rows[(share, "TopK(0.01)")]["measured"] == "4.0% (4.00 of 100.0 ms)"
    assert rows[(share, "TopK(0.01)")]["verdict"] == "met"
    assert rows[(share, "Int8()")]["verdict"] == "not measured"
    assert rows[("codec share of a GPT-2 small step", "PowerSGD(rank=4)")]["verdict"] == "not measured"
    assert rows[("gradzip plan --device profile", "codecs and protocols measured as whole calls")]["verdict"] == (
        "not measured"
    )
    assert "not measured" in gpu_suite.format_summary(list(rows.values()), "NVIDIA H200")


def test_dryrun_profile_counts_and_profiles_a_step_on_the_cpu(tmp_path):
    """benchmarks/dryrun_profile.py on the tiny ResNet: --count writes each method's step time
    and ATen operations; the cProfile report names the method and its step time."""
    import json

    from benchmarks import dryrun_profile

    out = tmp_path / "ops.json"
    argv = ["--device", "cpu", "--model", "tiny", "--world", "2", "--methods", "Int8();SignSGD()"]
    assert dryrun_profile.main([*argv, "--count", "--steps", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and set(doc["methods"]) == {"Int8()", "SignSGD()"}
    assert all(r["aten_ops"] > 0 and r["ms_per_step"] > 0 for r in doc["methods"].values())
    report = tmp_path / "report.txt"
    assert dryrun_profile.main([*argv[:-1], "Int8()", "--out", str(report)]) == 0
    assert "===== Int8():" in report.read_text()


def test_dryrun_profile_takes_the_gpu_branches_on_the_cpu(tmp_path):
    """--gpu-branches runs PowerSGD's stacked path on the CPU (the GPU's side of its device-type
    branch): fewer ATen operations than its matrix-by-matrix CPU path on the tiny ResNet, the
    flag recorded, and the CPU's side taken again once the run is over."""
    import json

    import torch

    import gradzip.kernels as K
    from benchmarks import dryrun_profile

    argv = ["--device", "cpu", "--model", "tiny", "--world", "2", "--count", "--steps", "1"]
    argv += ["--methods", "PowerSGD(rank=2)"]
    docs = {}
    for flag in ([], ["--gpu-branches"]):
        out = tmp_path / f"ops{len(flag)}.json"
        assert dryrun_profile.main([*argv, *flag, "--json", str(out)]) == 0
        docs[bool(flag)] = json.loads(out.read_text())
    assert not K.gpu_side(torch.device("cpu"))
    assert docs[True]["gpu_branches"] and not docs[False]["gpu_branches"]
    ops = {k: d["methods"]["PowerSGD(rank=2)"]["aten_ops"] for k, d in docs.items()}
    assert 0 < ops[True] < ops[False]


def test_dryrun_profile_counts_the_gpu_paths_launches_under_the_interpreter(tmp_path, monkeypatch):
    """With Triton forced under the interpreter, --count counts every kernel launch and leaves
    out the ATen operations the interpreter issues inside them: Flat(Int8()) at 4 ranks on the
    tiny ResNet's one bucket launches one encode of its 4 pieces (error feedback included), the
    owner's encode and subtraction, 2 frame checks and 2 decodes; the CPU path (Numba) launches
    none."""
    import json
    import os

    from benchmarks import dryrun_profile

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1 before the kernels are imported)")
    argv = ["--device", "cpu", "--model", "tiny", "--world", "4", "--count", "--steps", "1", "--methods"]
    rows = {}
    for forced in (None, "triton"):
        if forced:
            monkeypatch.setenv("GRADZIP_KERNELS", forced)
        out = tmp_path / f"{forced}.json"
        assert dryrun_profile.main([*argv, "Flat(Int8())", "--json", str(out)]) == 0
        rows[forced] = json.loads(out.read_text())["methods"]["Flat(Int8())"]
    assert rows[None]["triton_launches"] == 0
    assert rows["triton"]["triton_launches"] == 7
    assert 0 < rows["triton"]["aten_ops"] < rows[None]["aten_ops"]  # the Numba glue is the CPU path's own
