"""benchmarks/lm_peers.py: the peers train the bench's language model (its plain-DDP check equals
``gradzip bench``'s Identity row), write the bench's result schema, count their bytes as their
code sends them, and merge with gradzip's rows. 4 ranks, a few steps.

Every test here is ``long`` (``make test-long``: each trains the LM on 4 ranks); the torchft and
DeMo/SparseLoCo ones skip where torchft is not installed or the authors' files were not fetched
(they stay outside the repository:
``LM_PEERS_DEMO_SRC``, ``LM_PEERS_CCLOCO_SRC``, default /tmp/peers/src/{demo,ccloco})."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import asdict

import pytest

from benchmarks import lm_peers, merge_runs
from gradzip.bench import BenchConfig, aggregate, lm, parse_methods
from gradzip.bench import run as bench_run

pytestmark = pytest.mark.slow

STEPS = 8  # the long tests: DiLoCo syncs at step 8, SparseLoCo's outer steps at 4 and 8
QUICK = 4  # the torch peers and the check against gradzip bench
G = 4 * lm.SIZES["tiny"].params()  # plain DDP's gradient bytes a step
RING = 2 * 3 / 4  # ring allreduce, 4 ranks
DEMO_SRC = os.environ.get("LM_PEERS_DEMO_SRC", "/tmp/peers/src/demo")
CCLOCO_SRC = os.environ.get("LM_PEERS_CCLOCO_SRC", "/tmp/peers/src/ccloco")
RUN_KEYS = {
    "seed",
    "val_loss",
    "bits_per_byte",
    "perplexity",
    "curve",
    "train_loss_last",
    "steps",
    "seconds_per_step",
    "ratio",
    "ratio_handed",
    "stats_ratio",
    "bytes_link_per_step",
    "bytes_link_raw_per_step",
    "bytes_sent_per_step",
    "bytes_raw_per_step",
}


def _run(tmp_path, peers: str, *extra: str, steps: int = STEPS) -> dict:
    out = tmp_path / f"{peers.replace(',', '_')}.json"
    assert lm_peers.main(["--peers", peers, "--seeds", "0", "--steps", str(steps), "--out", str(out), *extra]) == 0
    with open(out) as f:
        doc = json.load(f)
    assert doc["schema"] == 2 and doc["config"]["total_steps"] == steps and doc["config"]["workers"] == 4
    assert {"cpu", "torch", "date"} <= set(doc["machine"]) and doc["command"].startswith(
        "python -m benchmarks.lm_peers"
    )
    for row in doc["rows"]:
        assert row["method"].startswith("peer: ") and row["steps"] == steps and row["seeds"] == [0]
        (r,) = row["per_seed"]
        assert RUN_KEYS <= set(r) and r["steps"] == steps and math.isfinite(r["val_loss"])
        assert r["curve"][-1][0] == steps and r["bytes_raw_per_step"] == G
        assert r["bytes_link_raw_per_step"] == pytest.approx(RING * G)
        assert r["ratio"] == pytest.approx(r["bytes_link_raw_per_step"] / r["bytes_link_per_step"])
    return {row["method"]: row for row in doc["rows"]} | {"_doc": doc}


def _psgd_numel(rank: int) -> int:
    """What powerSGD_hook allreduces a step: P and Q of every matrix it compresses, the rest whole."""
    n = 0
    for p in lm.make_gpt("tiny", 0).parameters():
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        r = min(rows, cols, rank)
        n += (rows + cols) * r if p.dim() > 1 and (rows + cols) * r * 2 < rows * cols else p.numel()
    return n


@pytest.mark.long
def test_torch_peers_match_the_bench_and_count_their_bytes(tmp_path):
    rows = _run(tmp_path, "ddp,powersgd1,fp16", "--powersgd-start", "2", steps=QUICK)
    ddp = rows["peer: plain DDP (runner check)"]
    assert ddp["ratio"] == pytest.approx(1.0) and ddp["bytes_sent_per_step"] == G
    fp16 = rows["peer: torch fp16_compress_hook"]
    assert fp16["ratio"] == pytest.approx(2.0) and fp16["bytes_sent_per_step"] == G / 2
    psgd = rows["peer: torch powerSGD_hook(rank=1, start_powerSGD_iter=2)"]
    sent = (2 * G + (QUICK - 2) * 4 * _psgd_numel(1)) / QUICK  # 2 vanilla steps, then P and Q
    assert psgd["bytes_sent_per_step"] == pytest.approx(sent)
    assert psgd["bytes_link_per_step"] == pytest.approx(RING * sent)
    assert psgd["per_seed"][0]["peer_info"]["ddp_buckets"] == [0]

    # the same training as gradzip bench: Identity's loss on the same seed and steps
    cfg = BenchConfig(dataset="shakespeare", workers=4, steps=QUICK, seeds=(0,))
    gz = bench_run(_identity(), cfg)
    assert abs(ddp["val_loss"] - gz[0]["val_loss"]) < 1e-4

    # merge_runs pools the peers' rows with gradzip's (same configuration): gaps against Identity
    config = {**asdict(cfg), "epochs": 1, "steps_per_epoch": QUICK, "total_steps": QUICK, "metric": "val_loss"}
    gz_doc = {"command": "gradzip bench", "config": config, "rows": gz}
    gz_doc = json.loads(json.dumps(gz_doc, default=str))
    runs, config = merge_runs.merge([gz_doc, rows["_doc"]])
    merged = {r["method"]: r for r in aggregate(runs, metric=config["metric"])}
    assert set(merged) == {"Identity", *(k for k in rows if k != "_doc")}
    assert merged["peer: plain DDP (runner check)"]["gap_pct"] == pytest.approx(0.0, abs=1e-2)


def _identity():
    return {"Identity": parse_methods("Identity")["Identity"]}


@pytest.mark.long
@pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="torchft is not installed (pip install torchft==0.2.0)"
)
def test_torchft_diloco_and_streaming(tmp_path):
    # DiLoCo syncs the whole model once at step 8; streaming one fragment every 2 steps: the whole model too
    rows = _run(tmp_path, "torchft_diloco,torchft_streaming", "--diloco-sync-every", "8", "--streaming-delay", "1")
    for row in rows.values():
        if isinstance(row, dict) and "method" in row:
            assert row["bytes_sent_per_step"] == pytest.approx(G / STEPS)
            assert row["ratio"] == pytest.approx(STEPS)
    stream = next(r for k, r in rows.items() if "streaming" in k)
    assert stream["per_seed"][0]["peer_info"]["commits"] == 4
    assert sum(stream["per_seed"][0]["peer_info"]["fragment_params"]) == G // 4


def _have(path, name):
    return os.path.isfile(os.path.join(path, name))


@pytest.mark.long
@pytest.mark.skipif(
    not (_have(DEMO_SRC, "demo.py") and _have(CCLOCO_SRC, "ccloco.py")),
    reason=f"the authors' demo.py and ccloco.py are not in {DEMO_SRC} and {CCLOCO_SRC} (LM_PEERS_DEMO_SRC, "
    "LM_PEERS_CCLOCO_SRC): fetch bloc97/DeMo and tplr-y/CCLoco outside the repository",
)
def test_demo_and_sparseloco(tmp_path):
    rows = _run(tmp_path, "demo,sparseloco", "--demo-src", DEMO_SRC, "--ccloco-src", CCLOCO_SRC, "--sparseloco-h", "4")
    demo = next(r for k, r in rows.items() if k.startswith("peer: DeMo"))
    sparse = next(r for k, r in rows.items() if k.startswith("peer: SparseLoCo"))
    # all-gathers: (N - 1) x what each rank hands over
    for row in (demo, sparse):
        assert row["bytes_link_per_step"] == pytest.approx(3 * row["bytes_sent_per_step"])
    # SparseLoCo, per outer step and tensor: 32 of every 64x64 chunk (1-D tensors: 1 of every 64,
    # CCLoco's chunking of a length it met in a matrix first), int64 index + uint8 code, 20 bytes of
    # quantization parameters; 2 outer steps in 8 steps
    per_sync = 0
    for p in lm.make_gpt("tiny", 0).parameters():
        chunks, k = ((p.shape[0] // 64) * (p.shape[1] // 64), 32) if p.dim() == 2 else (p.numel() // 64, 1)
        per_sync += 20 + chunks * k * 9
    assert sparse["bytes_sent_per_step"] == pytest.approx(2 * per_sync / STEPS)
    assert sparse["per_seed"][0]["peer_info"]["outer_steps"] == 2
    # DeMo, every step: 32 DCT coefficients of every chunk (64x64, or the largest divisor <= 64 of a
    # 1-D length), int64 index + fp32 value
    demo_step = 0
    for p in lm.make_gpt("tiny", 0).parameters():
        chunks = (p.shape[0] // 64) * (p.shape[1] // 64) if p.dim() == 2 else p.numel() // 64
        demo_step += chunks * 32 * 12
    assert demo["bytes_sent_per_step"] == pytest.approx(demo_step)
