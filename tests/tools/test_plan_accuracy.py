"""`gradzip plan` ranks by the accuracy the bench measured: a method that lost on the task is
shown with its gap and never recommended; every row name a result file holds is one spelling
that `gz.parse` and `gradzip plan --methods` read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gradzip as gz
from gradzip import evidence, plan
from gradzip.hook_row import HOOK_OPTIONS, Hook

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LINK = gz.Link(1e9, 50e-6)


def _row_names() -> dict[str, str]:
    names = {}
    for path in sorted(RESULTS.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        rows = doc.get("rows") if isinstance(doc, dict) else None
        for r in rows if isinstance(rows, list) else ():
            if isinstance(r, dict) and isinstance(r.get("method"), str):
                names.setdefault(r["method"], str(path.relative_to(ROOT)))
    return names


def test_every_committed_row_name_parses_in_gz_parse_and_in_plan():
    names = _row_names()
    assert len(names) > 50
    for name, where in names.items():
        if name.startswith(("peer: ", "control: ")):  # another library's code, or a second copy of DDP
            continue
        try:  # Policy(..., auto=True) takes the link from its context, as the plan gives it
            gz.parse(name, {"link": LINK})
            plan.parse_methods(name, link=LINK)
        except ValueError as e:
            raise AssertionError(f"{where}: row {name!r}: {e}") from None
    assert "Hook(TopK(0.3), momentum_correction='off')" in names  # the LM table's spelling, read by both


def test_hook_reads_back_as_written_and_names_every_option():
    h = gz.parse("Hook(DCT(ChunkTopK(32, chunk=64)), update='sign', error_decay=0.999, momentum=0.0, lr_scale=0.3)")
    assert isinstance(h, Hook) and gz.parse(repr(h)) == h and repr(h).startswith("Hook(DCT(")
    assert set(HOOK_OPTIONS) == {f for f in Hook.__dataclass_fields__} - {"method"}
    assert plan.parse_methods("Hook(PowerSGD(rank=4), start_iter=100)")["Hook(PowerSGD(rank=4), start_iter=100)"] == (
        gz.PowerSGD(rank=4)
    )
    with pytest.raises(TypeError, match="error_feedback must be True or False"):
        gz.parse("Hook(Int8(), error_feedback=1)")
    assert gz.parse("DDP") is None


def test_shipped_evidence_is_what_the_committed_results_give():
    assert evidence.load() == json.loads(evidence.dumps(evidence.build(str(RESULTS))))


def test_verdicts_follow_the_measured_gaps():
    ev = evidence.load()
    int8 = evidence.verdict("Int8()", "lm", ev)
    assert int8["held"] is True and 0 < int8["worst"]["gap"] <= evidence.HOLD["lm"]
    assert int8["worst"]["file"].startswith("benchmarks/results/lm_shakespeare")
    assert evidence.verdict("TopK(ratio=0.01)", "lm", ev)["held"] is False
    assert evidence.verdict("FP16()", "lm", ev)["held"] is None  # never measured: not ranked either
    assert evidence.verdict("DDP", "any", ev)["held"] is True
    lost = evidence.verdict("LocalSGD(period=8, compression=Int8())", "any", ev)
    assert lost["held"] is False and lost["worst"]["task"] == "lm"  # held on MNIST, lost on the LM
    assert "lost on lm: +8.03% val loss" in evidence.describe(lost, "any")
    # the README's CNN recipe as a user writes it finds the bench's rows (momentum correction on)
    cnn = evidence.verdict(evidence.canonical(gz.parse("TopK(0.003, values='sign', scope='call')")), "image", ev)
    assert cnn["held"] is True and cnn["worst"]["seeds"] == 8
    assert evidence.canonical(gz.parse("Hook(Int8())")) == "Int8()"
    # a row of one seed within the bar does not make a method hold; one far beyond it still loses
    toy = {"entries": [dict(ev["entries"][0], key="X()", task="lm", gap=0.5, seeds=1)]}
    assert evidence.verdict("X()", "lm", toy)["held"] is None
    assert "not measured on lm (3+ seeds)" in evidence.describe(evidence.verdict("X()", "lm", toy), "lm")
    toy["entries"][0].update(gap=9.0)
    assert evidence.verdict("X()", "lm", toy)["held"] is False
    names = ["tok.weight", "blocks.0.qkv.weight", "head.weight"]
    assert evidence.task_of_layers(names) == "lm"
    assert evidence.task_of_layers(["conv1.weight", "fc.weight"]) == "image"
    assert evidence.task_of_layers(["layer0.weight"]) is None


def _plan(tmp_path, capsys, argv):
    out = tmp_path / "plan.json"
    assert plan.main(argv + ["--json", str(out), "--plot", ""]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_plan_recommends_only_what_held_on_the_task(tmp_path, capsys):
    # the H200's shipped profile (no CPU timing here); a slow link, so that compression pays
    base = ["--params", "1e6", "--compute", "10ms", "--bandwidth", "100Mbit", "--worlds", "8", "--device", "h200"]
    methods = ["--methods", "DDP, Int8(), TopK(ratio=0.01), PowerSGD(rank=2)"]
    res, text = _plan(tmp_path, capsys, base + methods + ["--task", "lm"])
    rows = {r["label"]: r for r in res["rows"]}
    assert rows["TopK(ratio=0.01)"]["total_s"] < rows["Int8()"]["total_s"]  # faster, but lost on the LM
    assert res["best"] == {"8": "Int8()"} and res["inputs"]["task"] == "lm"
    assert "not recommended although predicted faster: TopK(ratio=0.01), PowerSGD(rank=2)" in res["recommendation"]
    assert "to DDP's quality" in res["recommendation"]  # Int8's DDP-equivalent steps counted
    assert rows["Int8()"]["quality_s"] > rows["Int8()"]["total_s"]
    assert "[3]! TopK(ratio=0.01): lost on lm: +48.45% val loss" in text
    assert "ranking: only the methods that held on a transformer language model (--task)" in text
    # --task none: the step time alone
    res, _ = _plan(tmp_path, capsys, base + methods + ["--task", "none"])
    assert res["best"]["8"] in ("TopK(ratio=0.01)", "PowerSGD(rank=2)")


def test_plan_reads_the_task_from_the_architecture_and_needs_no_latency(tmp_path, capsys):
    argv = ["--arch", "gpt2-small", "--compute", "300ms", "--bandwidth", "1Gbit", "--workers", "8"]
    res, text = _plan(tmp_path, capsys, argv + ["--device", "h200", "--methods", "DDP, Int8(), PowerSGD(rank=2)"])
    assert res["inputs"]["task"] == "lm" and res["inputs"]["link"]["latency_s"] == pytest.approx(50e-6)
    assert "(--arch gpt2-small)" in text and res["best"]["8"] != "PowerSGD(rank=2)"


@pytest.mark.long
@pytest.mark.parametrize("model", [["--params", "100e6"], ["--arch", "gpt2-small"]])
def test_the_issues_commands_never_recommend_a_method_that_lost_on_the_lm(tmp_path, capsys, model):
    res, text = _plan(tmp_path, capsys, model + ["--worlds", "8", "--bandwidth", "1Gbit", "--compute", "300ms"])
    ev = evidence.load()
    for lab in res["best"].values():
        row = next(r for r in res["rows"] if r["label"] == lab)
        assert row["accuracy"]["held"] is True
        key = "DDP" if lab == "DDP" else repr(gz.parse(lab))
        v = evidence.verdict(key, "lm", ev)
        assert v["baseline"] or v["worst"]["gap"] <= 2.0
    for r in res["rows"]:
        assert r["accuracy"]["note"]  # every row shows its measured gap (or that it has none)
