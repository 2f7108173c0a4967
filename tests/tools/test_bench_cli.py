import csv
import json
import statistics
from pathlib import Path

import pytest
import torch

from gradzip import bench, cli

ROOT = Path(__file__).resolve().parents[2]


def _bench(capsys, *args):
    """``gradzip bench`` on the digits with 2 ranks, in this process (its ranks are processes)."""
    code = cli.main(["bench", "--dataset", "digits", "--workers", "2", "--no-progress", *args])
    return code, capsys.readouterr()


# -- the command, end to end (multi-process) ---------------------------------------------------
@pytest.mark.slow
def test_bench_quick_digits_two_seeds_writes_table_json_csv_and_plot(tmp_path, capsys):
    """One run of the command (the aggregation of one seed is tested in-process below)."""
    code, out = _bench(
        capsys, "--quick", "--epochs", "1", "--seeds", "0,1", "--methods", "TopK", "--out", str(tmp_path)
    )
    assert code in (0, None), out.err
    lines = out.out.splitlines()
    assert any(
        line.startswith("method") and "link ratio" in line and "Δ acc" in line and "ms/step" in line for line in lines
    )
    assert "seeds 0,1" in out.out and "(2 seeds)" in out.out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert {"schema", "machine", "config", "fields", "rows"} <= set(doc) and doc["schema"] == bench.SCHEMA
    cfg = doc["config"]
    assert cfg["dataset"] == "digits" and cfg["workers"] == 2 and cfg["epochs"] == 1 and cfg["seeds"] == [0, 1]
    assert cfg["optimizer"] == "sgd" and cfg["momentum"] == 0.9 and cfg["lr_schedule"] == "cosine"
    rows = doc["rows"]
    assert [r["method"] for r in rows] == ["Identity", "TopK"]
    for r in rows:
        assert set(bench.CSV_FIELDS) <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["steps"] == 22 and r["bytes_link_per_step"] > 0
        accs = [s["accuracy"] for s in r["per_seed"]]
        assert [s["seed"] for s in r["per_seed"]] == [0, 1] and r["seeds"] == [0, 1] and r["n_seeds"] == 2
        assert r["accuracy"] == pytest.approx(statistics.fmean(accs))
        assert r["accuracy_std"] == pytest.approx(statistics.stdev(accs))
        assert (r["accuracy_min"], r["accuracy_max"]) == (min(accs), max(accs))
        # 2 seeds give 2 different splits and inits
        assert r["per_seed"][0]["curve"] != r["per_seed"][1]["curve"] or accs[0] != accs[1]
        for run in r["per_seed"]:
            assert len(run["curve"]) == 1 and run["curve"][-1] == run["accuracy"]
        assert r["method"] in out.out
    assert rows[0]["ratio"] == pytest.approx(1.0, rel=1e-3)  # control bytes (config check, flags) only
    assert rows[0]["delta_accuracy"] == 0.0 and rows[1]["ratio"] > 20
    base, topk = rows[0], rows[1]
    diffs = [t["accuracy"] - b["accuracy"] for t, b in zip(topk["per_seed"], base["per_seed"])]
    assert topk["delta_accuracy"] == pytest.approx(statistics.fmean(diffs))
    assert topk["delta_std"] == pytest.approx(statistics.stdev(diffs))
    line = next(line for line in lines if line.startswith("TopK"))
    assert "±" in line and "[" in line and ".." in line
    # The hook's link-byte ratio is stats()["ratio"]; at 2 ranks an all-gather hands what it sends.
    # Over the seeds the ratio is one of totals, so it lies between the seeds' own.
    for r in rows[1:]:
        own = [run["stats_ratio"] for run in r["per_seed"]]
        assert min(own) * (1 - 1e-9) <= r["ratio"] <= max(own) * (1 + 1e-9)
        assert r["ratio"] == pytest.approx(r["ratio_handed"], rel=1e-9)
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["method"] for t in table] == ["Identity", "TopK"] and list(table[0]) == bench.CSV_FIELDS
    assert float(table[1]["accuracy_std"]) == pytest.approx(topk["accuracy_std"])
    png = (tmp_path / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow
@pytest.mark.slow
def test_mnist_loader_reads_the_bundled_digits():
    xtr, ytr, xte, yte = bench.load_dataset("mnist", seed=0)
    assert xtr.shape == (4000, 1, 28, 28) and xte.shape == (1000, 1, 28, 28)
    assert sorted(ytr.unique().tolist()) == list(range(10)) and sorted(yte.unique().tolist()) == list(range(10))
    # Shuffled (the file is sorted by label) and standardised on the training set.
    assert len(set(ytr[:50].tolist())) > 5
    assert abs(float(xtr.mean())) < 1e-3 and abs(float(xtr.std()) - 1) < 1e-3
    # The seed picks the split.
    assert not bool((bench.load_dataset("mnist", seed=1)[3] == yte).all())


# -- flags --------------------------------------------------------------------------------------
def _args(*argv):
    p = cli.argparse.ArgumentParser()
    cli.add_bench_arguments(p)
    return cli.config_from_args(p.parse_args(list(argv)))


def test_bench_flags_parse_into_the_config():
    cfg = _args()
    assert (cfg.dataset, cfg.workers, cfg.optimizer, cfg.momentum, cfg.lr_schedule) == (
        "mnist",
        2,
        "sgd",
        0.9,
        "cosine",
    )
    assert cfg.seeds == bench.DEFAULT_SEEDS and cfg.lr == bench.DEFAULT_LR["sgd"] and cfg.weight_decay == 0.0
    assert cfg.resolved_epochs() == bench.DEFAULT_EPOCHS["mnist"] and cfg.warmup_epochs == 0.0
    cfg = _args("--optimizer", "adamw", "--seeds", "3,1", "--workers", "4", "--epochs", "7", "--dataset", "digits")
    assert cfg.optimizer == "adamw" and cfg.lr == bench.DEFAULT_LR["adamw"]
    assert cfg.weight_decay == bench.DEFAULT_WEIGHT_DECAY["adamw"] and cfg.seeds == (3, 1) and cfg.seed == 3
    assert (cfg.workers, cfg.resolved_epochs(), cfg.dataset) == (4, 7, "digits")
    cfg = _args(
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--weight-decay",
        "0",
        "--momentum",
        "0.5",
        "--lr-schedule",
        "constant",
        "--warmup-epochs",
        "0.5",
        "--seeds",
        "0-3",
        "--batch-size",
        "16",
    )
    assert (cfg.lr, cfg.weight_decay, cfg.momentum, cfg.lr_schedule) == (0.01, 0.0, 0.5, "constant")
    assert cfg.warmup_epochs == 0.5 and cfg.seeds == (0, 1, 2, 3) and cfg.batch_size == 16
    cfg = _args("--quick", "--dataset", "digits")
    assert cfg.seeds == (0,) and cfg.resolved_epochs() == bench.QUICK_EPOCHS["digits"]
    assert _args("--quick", "--seeds", "1,2").seeds == (1, 2)
    assert _args("--seed", "5").seeds == (5,)  # the old flag
    # refused while parsing (before torch loads or a rank starts): one error line naming the option
    for bad in (
        ["--seeds", "a"],
        ["--seeds", "1,1"],
        ["--seeds", ","],
        ["--workers", "1"],
        ["--workers", "0"],
        ["--momentum", "1"],
        ["--epochs", "0"],
        ["--epochs", "-1"],
        ["--batch-size", "0"],
        ["--lr", "0"],
        ["--weight-decay", "-1"],
        ["--warmup-epochs", "nan"],
        ["--clip", "0"],
        ["--clip", "inf"],
    ):
        with pytest.raises(SystemExit):
            _args(*bad)
    p = cli.argparse.ArgumentParser()
    cli.add_bench_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--optimizer", "adam"])


def test_bench_cli_bad_seeds_exit_2_before_training(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--seeds", "x", "--out", ""])
    assert e.value.code == 2 and "seeds" in capsys.readouterr().err


def test_lr_schedule():
    total = 100
    f = [bench.lr_factor(s, total) for s in range(total)]
    assert f[0] == 1.0 and f[50] == pytest.approx(0.5) and 0 < f[-1] < 1e-3
    assert all(a >= b for a, b in zip(f, f[1:]))
    w = [bench.lr_factor(s, total, warmup=10) for s in range(total)]
    assert w[:10] == pytest.approx([(s + 1) / 10 for s in range(10)]) and w[10] == 1.0
    assert w[55] == pytest.approx(0.5) and all(a >= b for a, b in zip(w[10:], w[11:]))
    assert [bench.lr_factor(s, total, 4, "constant") for s in (0, 3, 4, 99)] == [0.25, 1.0, 1.0, 1.0]


# -- aggregation over seeds ---------------------------------------------------------------------
def _run(method, seed, acc, curve=None, steps=10, link=100.0, sent=200.0, sps=0.01):
    return {
        "method": method,
        "config": method,
        "seed": seed,
        "accuracy": acc,
        "accuracy_last3": sum(curve[-3:]) / len(curve[-3:]) if curve else acc,
        "curve": curve or [acc],
        "steps": steps,
        "seconds_per_step": sps,
        "bytes_link_per_step": link,
        "bytes_link_raw_per_step": 1000.0,
        "bytes_sent_per_step": sent,
        "bytes_raw_per_step": 2000.0,
    }


def test_aggregate_over_seeds():
    runs = [
        _run("Identity", 0, 0.96, [0.90, 0.95, 0.955, 0.96]),
        _run("Identity", 1, 0.97, [0.91, 0.96, 0.965, 0.97]),
        _run("Identity", 2, 0.95, [0.92, 0.94, 0.945, 0.95]),
        # out of order, and with other byte counts on one seed (an adaptive method)
        _run("X", 2, 0.93, [0.90, 0.91, 0.92, 0.93], link=10.0, sent=4.0, sps=0.03),
        _run("X", 0, 0.95, [0.90, 0.94, 0.95, 0.95], link=20.0, sent=4.0, sps=0.01),
        _run("X", 1, 0.95, [0.80, 0.93, 0.94, 0.95], link=30.0, sent=12.0, sps=0.02),
    ]
    base, x = bench.aggregate(runs)
    assert base["method"] == "Identity" and x["method"] == "X" and x["seeds"] == [0, 1, 2] and x["n_seeds"] == 3
    assert x["accuracy"] == pytest.approx((0.93 + 0.95 + 0.95) / 3)
    assert x["accuracy_std"] == pytest.approx(statistics.stdev([0.93, 0.95, 0.95]))
    assert (x["accuracy_min"], x["accuracy_max"]) == (0.93, 0.95)
    assert base["accuracy"] == pytest.approx(0.96) and base["accuracy_std"] == pytest.approx(0.01)
    # mean of the last 3 epochs, then over seeds
    last3 = [(0.91 + 0.92 + 0.93) / 3, (0.94 + 0.95 + 0.95) / 3, (0.93 + 0.94 + 0.95) / 3]
    assert x["accuracy_last3"] == pytest.approx(sum(last3) / 3)
    # Δ per seed against the baseline on the same seed: -0.01, -0.02, -0.02
    assert x["delta_accuracy"] == pytest.approx(-0.05 / 3)
    assert x["delta_std"] == pytest.approx(statistics.stdev([-0.01, -0.02, -0.02]))
    assert (x["delta_min"], x["delta_max"]) == (pytest.approx(-0.02), pytest.approx(-0.01))
    assert base["delta_accuracy"] == 0.0 and base["delta_std"] == 0.0
    # bytes: totals over the runs (equal steps here), ratios of totals
    assert x["bytes_link_per_step"] == pytest.approx(20.0) and x["ratio"] == pytest.approx(1000 / 20)
    assert x["ratio_handed"] == pytest.approx(2000 / (20 / 3)) and base["ratio"] == pytest.approx(10.0)
    assert x["seconds_per_step"] == pytest.approx(0.02)
    assert [r["seed"] for r in x["per_seed"]] == [0, 1, 2] and "method" not in x["per_seed"][0]


def test_aggregate_single_seed_and_mismatched_seeds():
    (row,) = bench.aggregate([_run("Identity", 4, 0.9)])
    assert (
        row["accuracy_std"] is None and row["delta_std"] is None and row["accuracy_min"] == row["accuracy_max"] == 0.9
    )
    with pytest.raises(ValueError, match="seeds"):
        bench.aggregate([_run("Identity", 0, 0.9), _run("Identity", 1, 0.9), _run("X", 0, 0.9)])
    with pytest.raises(ValueError, match="twice"):
        bench.aggregate([_run("Identity", 0, 0.9), _run("Identity", 0, 0.8)])
    # without an Identity row the deltas are left out
    (row,) = bench.aggregate([_run("X", 0, 0.9)])
    assert "delta_accuracy" not in row


def test_spread():
    s = bench.spread([1, 2, 3, 6])
    assert s == {"mean": 3.0, "std": pytest.approx(statistics.stdev([1, 2, 3, 6])), "min": 1.0, "max": 6.0, "n": 4}
    with pytest.raises(ValueError):
        bench.spread([])


# -- the Pareto plot ----------------------------------------------------------------------------
def test_pareto_front():
    pts = [
        (1.0, 96.0),  # 0 the baseline: best accuracy
        (2.0, 96.0),  # 1 same accuracy, more compression: dominates 0
        (10.0, 95.0),  # 2
        (10.0, 94.0),  # 3 dominated by 2
        (5.0, 94.5),  # 4 dominated by 2
        (300.0, 90.0),  # 5 the most compression
        (300.0, 90.0),  # 6 equal to 5: both kept
        (50.0, 80.0),  # 7 dominated by 5
    ]
    assert bench.pareto_front(pts) == [1, 2, 5, 6]
    assert bench.pareto_front([(3.0, 1.0)]) == [0]
    front = bench.pareto_front([(1, 1), (2, 2), (3, 3)])
    assert front == [2]


def _crowded_rows(n=16):
    rows = []
    for i in range(n):
        ratio = 20 * 1.15**i  # within about one decade
        acc = 0.95 - 0.002 * (i % 5) - 0.001 * (i // 5)  # within 1 pp
        rows.append(
            {
                "method": f"Method{i}(ratio={ratio:.3g})",
                "ratio": ratio,
                "accuracy": acc,
                "n_seeds": 3,
                "accuracy_min": acc - 0.002,
                "accuracy_max": acc + 0.002,
            }
        )
    rows.insert(
        0,
        {
            "method": "Identity",
            "ratio": 1.0,
            "accuracy": 0.952,
            "n_seeds": 3,
            "accuracy_min": 0.949,
            "accuracy_max": 0.955,
        },
    )
    return rows


def test_pareto_labels_do_not_overlap_on_a_crowded_plot():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    rows = _crowded_rows()
    fig, ax, anns = bench.pareto_figure(rows, bench.BenchConfig(dataset="digits", workers=4))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [Text.get_window_extent(a, renderer) for a in anns]  # the text alone, no leader line
        assert [a.get_text() for a in anns] == [r["method"] for r in rows]
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                assert not boxes[i].overlaps(boxes[j]), (anns[i].get_text(), anns[j].get_text())
        frame = ax.get_window_extent(renderer)
        for a, b in zip(anns, boxes):
            assert frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1 and frame.y0 - 1 <= b.y0 and b.y1 <= frame.y1 + 1, a
        # readable ticks: decades as 1×, 10×, 100×
        labels = {t.get_text() for t in ax.get_xticklabels() if t.get_visible()}
        assert {"1×", "10×", "100×"} <= labels
    finally:
        plt.close(fig)


def test_place_labels_separates_coincident_points():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        ax.set_xscale("log")
        ax.set_xlim(1, 1000)
        ax.set_ylim(90, 100)
        xs, ys = [30.0] * 8, [95.0] * 8  # eight methods on one spot
        anns = bench.place_labels(ax, xs, ys, [f"label number {i}" for i in range(8)])
        renderer = fig.canvas.get_renderer()
        boxes = [Text.get_window_extent(a, renderer) for a in anns]
        assert not any(boxes[i].overlaps(boxes[j]) for i in range(8) for j in range(i + 1, 8))
    finally:
        plt.close(fig)


def test_ratio_tick_labels():
    assert [bench._ratio_label(x) for x in (1, 10, 100, 1000, 10000, 0.5)] == [
        "1×",
        "10×",
        "100×",
        "1,000×",
        "10,000×",
        "0.5×",
    ]


def test_bench_corrects_momentum_for_sparse_codecs():
    """The bench hands SGD or AdamW to the hook (momentum correction) for sparse codecs
    (TopK/RandomK, Threshold(mask=True)) by default; other optimizers, exact methods and rows
    without error feedback keep the optimizer's own momentum."""
    from gradzip.bench import BenchConfig, Method, hook_options, parse_methods

    w = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    plain_sgd = torch.optim.SGD([w], lr=0.1)
    adamw = torch.optim.AdamW([w], lr=0.1)
    m = parse_methods(
        "TopK(0.01), Threshold(policy='adaptive'), SignSGD, PowerSGD(rank=2), Threshold(policy='target', mask=True)"
    )
    assert hook_options(m["TopK(0.01)"], sgd)["optimizer"] is sgd
    assert hook_options(m["Threshold(policy='target', mask=True)"], sgd)["optimizer"] is sgd
    # Threshold sends +-tau, not whole coordinates: it keeps the optimizer's momentum
    for label in ("Identity", "Threshold(policy='adaptive')", "SignSGD", "PowerSGD(rank=2)"):
        assert "optimizer" not in hook_options(m[label], sgd), label
    assert hook_options(m["TopK(0.01)"], adamw)["optimizer"] is adamw  # its beta1 is taken over
    assert "optimizer" not in hook_options(m["TopK(0.01)"], torch.optim.RMSprop([w], momentum=0.9))
    assert "optimizer" not in hook_options(m["TopK(0.01)"], plain_sgd)
    assert "optimizer" not in hook_options(Method("no EF", m["TopK(0.01)"].method, error_feedback=False), sgd)
    on, off = BenchConfig(momentum_correction="on"), BenchConfig(momentum_correction="off")
    assert hook_options(m["SignSGD"], sgd, on)["optimizer"] is sgd
    assert "optimizer" not in hook_options(m["TopK(0.01)"], sgd, off)
    with pytest.raises(ValueError, match="momentum_correction"):
        BenchConfig(momentum_correction="always")


def test_bench_clip_reaches_every_hook_row_and_refuses_rows_without_a_hook():
    """``--clip`` hands ``clip=`` to the hook of every DDP-hook row, Identity included (the
    baseline clips alike); plain DDP and local SGD rows have no hook, and are refused up front."""
    from gradzip.bench import BenchConfig, check_methods, hook_options, parse_methods

    assert _args().clip is None and _args("--clip", "4").clip == 4.0
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    m = parse_methods("TopK(0.01), SignSGD")
    cfg = BenchConfig(clip=4.0)
    for label in ("Identity", "TopK(0.01)", "SignSGD"):
        assert hook_options(m[label], sgd, cfg)["clip"] == 4.0, label
    assert "clip" not in hook_options(m["TopK(0.01)"], sgd, BenchConfig())
    check_methods(m, cfg)
    for spec in ("DDP", "LocalSGD(period=4)"):
        with pytest.raises(ValueError, match=r"--clip clips in the DDP hook"):
            check_methods(parse_methods(spec), cfg)
    check_methods(parse_methods("DDP, LocalSGD(period=4)"), BenchConfig())
    with pytest.raises(ValueError, match="clip"):
        BenchConfig(clip=-1.0)


def test_bench_precondition_reaches_the_corrected_adamw_rows_only():
    """``--precondition`` hands ``precondition=True`` to the rows whose AdamW momentum the hook
    corrects; Identity stays plain AdamW; SGD and momentum correction off are refused."""
    from gradzip.bench import BenchConfig, hook_options, parse_methods

    assert _args().precondition is False
    assert _args("--optimizer", "adamw", "--momentum-correction", "on", "--precondition").precondition is True
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    m = parse_methods("SignSGD")
    cfg = BenchConfig(optimizer="adamw", momentum_correction="on", precondition=True)
    assert hook_options(m["SignSGD"], adamw, cfg)["precondition"] is True
    assert cfg.hook_extras() == ", Adam moments per rank before compression" and BenchConfig().hook_extras() == ""
    assert "optimizer" not in hook_options(m["Identity"], adamw, cfg)
    assert "precondition" not in hook_options(
        m["SignSGD"], adamw, BenchConfig(optimizer="adamw", momentum_correction="on")
    )
    with pytest.raises(ValueError, match="second moment"):
        BenchConfig(optimizer="sgd", precondition=True)
    for mode in ("off", "auto"):  # auto would leave SignSGD uncorrected, and so not preconditioned
        with pytest.raises(ValueError, match="needs momentum_correction='on'"):
            BenchConfig(optimizer="adamw", momentum_correction=mode, precondition=True)


def test_report_lists_each_seeds_delta_from_five_seeds_on():
    """``benchmarks/report.py`` follows a table of 5 or more seeds with every seed's Δ against
    Identity, their median and how many seeds fall below it; 3-seed tables stay as they were."""
    import pathlib

    from benchmarks import report

    path = pathlib.Path(report.__file__)

    def row(method, accs):
        return {"method": method, "per_seed": [{"seed": s, "accuracy": a} for s, a in enumerate(accs)]}

    doc = {
        "rows": [row("Identity", [0.970, 0.960, 0.980, 0.950, 0.975]), row("TopK", [0.965, 0.962, 0.970, 0.950, 0.960])]
    }
    lines = report._per_seed_deltas(doc)
    assert lines[0].startswith("| method | Δ seed 0 |") and "median Δ" in lines[0]
    assert lines[2] == "| TopK | -0.5 | +0.2 | -1.0 | +0.0 | -1.5 | -0.50 | 3 of 5 |"
    assert report._per_seed_deltas({"rows": [row("TopK", [0.9] * 5)]}) == []  # no baseline: nothing
    results = path.parent / "results"
    eight = report.accuracy(json.loads((results / "accuracy_mnist_4ranks_sgd_clip2_8seeds_cpu.json").read_text()))
    assert "| Δ seed 7 | median Δ |" in eight and "local clipping 2" in eight
    three = report.accuracy(json.loads((results / "accuracy_mnist_4ranks_sgd_flat_cpu.json").read_text()))
    assert "median Δ" not in three and "local clipping" not in three


def test_adam_steps_reads_adamws_normalized_step():
    """``benchmarks/adam_steps.py`` reads ``|m_hat| / (sqrt(v_hat) + eps)`` from AdamW's state:
    after one step on a gradient g it is |g| / (|g| + eps), about 1 on every coordinate."""
    from benchmarks import adam_steps as mod

    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([w], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    w.grad = torch.tensor([1.0, -2.0, 1e-3, 0.5])
    opt.step()
    got = mod._normalized_steps(opt)
    torch.testing.assert_close(got, w.grad.abs() / (w.grad.abs() + 1e-8))
    w.grad = torch.zeros(4)
    opt.step()  # m decays by beta1, v by beta2: the normalized step shrinks
    assert (mod._normalized_steps(opt) < got).all()
    # precondition=True: the optimizer holds no moments; the averaged step in p.grad is what it applies
    u = torch.nn.Parameter(torch.zeros(3))
    taken = torch.optim.AdamW([u], lr=0.1)
    from gradzip.momentum import Momentum

    Momentum.adopt(taken, [("u", u)], precondition=True)
    u.grad = torch.tensor([0.5, -0.25, 0.0])
    taken.step()
    torch.testing.assert_close(mod._normalized_steps(taken), torch.tensor([0.5, 0.25, 0.0]))


def test_preset_lm_sets_the_tables_options_and_the_command_line_wins():
    from gradzip import options
    from gradzip.registry import parse_list

    def parsed(*argv):
        p = cli.argparse.ArgumentParser()
        cli.add_bench_arguments(p)
        options.apply_preset(p, list(argv))
        a = p.parse_args(list(argv))
        return cli.config_from_args(a), a.methods

    cfg, methods = parsed("--preset", "lm")
    assert (cfg.dataset, cfg.workers, cfg.seeds, cfg.optimizer) == ("shakespeare", 4, (0, 1, 2), "adamw")
    assert cfg.lr == bench.DEFAULT_LR[("shakespeare", "adamw")] and cfg.resolved_warmup() == 50
    assert cfg.total_steps() == bench.DEFAULT_STEPS["shakespeare"]
    demo, demo_methods = parsed("--preset", "demo")  # make demo: the LM, DDP and the README's transformer rows
    assert (demo.dataset, demo.workers, demo.seeds, demo.total_steps()) == ("shakespeare", 2, (0,), 200)
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{m}`" in readme for m in list(parse_list(demo_methods))[1:])
    other, _ = parsed("--workers", "2", "--preset", "lm", "--seeds", "1")
    assert (other.workers, other.seeds, other.dataset) == (2, (1,), "shakespeare")
    with pytest.raises(SystemExit):
        parsed("--preset", "nope")
    # the committed table: the preset's methods are its rows in order, and its options the preset's
    table = ROOT / "benchmarks/results/lm_shakespeare_4ranks_adamw_cpu.json"
    doc = json.loads(table.read_text())
    assert [r["method"] for r in doc["rows"]] == list(parse_list(methods))
    assert doc["command"] == "gradzip bench --preset lm" and doc["config"]["seeds"] == [0, 1, 2]
    c = doc["config"]
    assert (c["total_steps"], c["warmup_steps"]) == (cfg.total_steps(), cfg.resolved_warmup())
    for key in ("dataset", "workers", "lr", "optimizer", "momentum", "weight_decay", "batch_size", "clip"):
        assert c[key] == getattr(cfg, key), key


def test_a_rows_own_hook_and_optimizer_options_reach_register_hook_and_the_optimizer():
    from gradzip.bench.config import hook_options, make_optimizer

    spec = (
        "Hook(DCT(ChunkTopK(32, chunk=64)), update='sign', error_decay=0.999, momentum=0.0, lr_scale=0.3, "
        "lr_weighted=True)"
    )
    cfg = bench.BenchConfig(dataset="shakespeare", optimizer="adamw", lr=6e-3)
    demo = bench.parse_methods(f"{spec}, Hook(PowerSGD(rank=4), start_iter=100)")
    m = demo[spec]
    opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))], m.momentum, m.lr_scale)
    assert opt.param_groups[0]["betas"][0] == 0.0 and opt.param_groups[0]["lr"] == pytest.approx(1.8e-3)
    kw = hook_options(m, opt, cfg)
    assert kw["error_decay"] == 0.999 and kw["update"] == "sign" and kw["optimizer"] is opt
    assert kw["lr_weighted"] is True and "lr_weighted=True" in m.describe()
    p4 = demo["Hook(PowerSGD(rank=4), start_iter=100)"]
    assert hook_options(p4, opt, cfg)["start_iter"] == 100 and "start_iter=100" in p4.describe()
    for bad in ("Hook(Int8(), start_iter=-1)", "Hook(Int8(), error_decay=0)", "Hook(Int8(), lr_scale=0)"):
        with pytest.raises(ValueError):
            bench.parse_methods(bad)
    with pytest.raises(TypeError, match="lr_weighted"):
        bench.parse_methods("Hook(Int8(), lr_weighted=1)")
