"""Loggable stats: per-interval counts, per-tensor routes, a logging hook,
and a flat dict of numbers (what TensorBoard's ``add_scalars`` and ``wandb.log`` take)."""

from __future__ import annotations

import io
import logging
import time

import pytest
import torch

import gradzip as gz
from gradzip.stats import SCALARS, Stats, scalars
from tests.support import make_model, run_ranks, train_steps


def test_stats_since_a_reset_are_deltas_and_the_totals_stay():
    s = Stats()
    s.add(steps=2, bytes_raw=800, bytes_sent=100, bytes_link=100.0, bytes_link_raw=400.0)
    first = s.as_dict(reset=True)
    assert first["steps"] == 2 and first["ratio"] == 4.0
    s.add(steps=1, bytes_raw=400, bytes_sent=200, bytes_link=200.0, bytes_link_raw=200.0)
    second = s.as_dict(reset=True)
    assert second["steps"] == 1 and second["bytes_sent"] == 200 and second["ratio"] == 1.0
    assert second["bytes_sent_per_step"] == 200.0
    total = s.as_dict()
    assert total["steps"] == 3 and total["bytes_sent"] == 300 and total["ratio"] == 2.0
    assert s.as_dict(reset=True)["steps"] == 0  # nothing since
    assert s.since("other")["steps"] == 3  # another mark keeps its own interval
    s.load_state_dict(s.state_dict())
    # a loaded state starts every interval at the loaded totals: a delta after a resume must
    # not report the whole run
    assert s.as_dict(reset=True)["steps"] == 0 and s.since("other")["steps"] == 0
    s.add(steps=2, bytes_sent=50)
    assert s.as_dict(reset=True)["steps"] == 2 and s.as_dict()["steps"] == 5
    assert s.since("log")["bytes_sent"] == 50  # a mark first used after the resume, too


def _logged(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.hooks import register_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = DDP(model)
    state = register_hook(ddp, gz.Policy(gz.TopK(0.1), min_numel=100))
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("gradzip")
    handler = Keep()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    calls = []
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step():
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    state.log_every(2)  # the default: a logging line every 2 steps
    for _ in range(4):
        step()
    gz.log_every(state, 1, lambda s, d: calls.append((s, d)))  # a callback instead
    mid = state.stats(reset=True)
    step()
    delta = state.stats(reset=True)
    total = state.stats()
    log.removeHandler(handler)
    return {"records": records, "calls": calls, "mid": mid, "delta": delta, "total": total, "routes": state.routes()}


@pytest.mark.slow
def test_hook_logs_routes_and_per_interval_stats():
    for out in run_ranks(_logged, 2):
        routes = {r["name"]: r for r in out["routes"]}
        assert routes["0.weight"]["method"] == "TopK(ratio=0.1)" and routes["0.weight"]["reason"] == "default"
        assert routes["0.bias"]["method"] == "Identity()" and "min_numel" in routes["0.bias"]["reason"]
        assert routes["0.weight"]["bytes_raw"] == 8 * 16 * 4 and routes["0.weight"]["protocol"].startswith("AllGather")
        lines = out["records"]
        assert sum(line.startswith("gradzip routes:") for line in lines) == 2  # once: two routes
        steps = [line for line in lines if line.startswith("gradzip step")]
        assert [line.split(":")[0] for line in steps] == ["gradzip step 2", "gradzip step 4"]
        assert "2 steps" in steps[0]
        ((step, d),) = out["calls"]
        assert step == 5 and d["steps"] == 1
        assert out["mid"]["steps"] == 4 and out["delta"]["steps"] == 1 and out["total"]["steps"] == 5
        assert out["delta"]["bytes_link"] == out["total"]["bytes_link"] - out["mid"]["bytes_link"]
        for flat in (out["delta"], out["total"], d):  # flat: str -> int | float, for add_scalars / wandb.log
            assert all(isinstance(k, str) and type(v) in (int, float) for k, v in flat.items()), flat


def test_routes_of_an_auto_policy_before_its_first_step():
    pol = gz.Policy(gz.TopK(0.01), auto=True, link=gz.Link.parse("1Gbit", "50us"), min_numel=10)
    assert pol.decision("w", 1000, {}, 2, True) == (None, "auto: undecided", None)
    m, why, proto = pol.decision("w", 1000, {"policy.fallback": 1}, 2, True)
    assert m is pol.fallback and why == "auto: fallback is cheaper" and repr(proto) == "Allreduce(Identity())"
    m, why, _ = pol.decision("b", 5, {}, 2, True)
    assert m is pol.fallback and "min_numel" in why


def test_scalars_are_per_step_with_units_in_their_names():
    s = Stats()
    s.add(steps=4, bytes_raw=4000, bytes_sent=800, bytes_link=400.0, bytes_link_raw=4000.0, collectives=12)
    s.add(codec_seconds=0.02, comm_seconds=0.2)
    out = scalars(s.as_dict())
    assert list(out) == [f"gradzip/{k}" for k, _ in SCALARS]  # one scalar a key, one chart each
    assert out["gradzip/link_ratio"] == 10.0 and out["gradzip/link_bytes_per_step"] == 100.0
    assert out["gradzip/ddp_link_bytes_per_step"] == 1000.0 and out["gradzip/sent_bytes_per_step"] == 200.0
    assert out["gradzip/collectives_per_step"] == 3.0 and out["gradzip/codec_ms_per_step"] == pytest.approx(5.0)
    assert out["gradzip/comm_ms_per_step"] == pytest.approx(50.0)
    assert all(type(v) is float for v in out.values())
    assert list(scalars(s.as_dict(), prefix="")) == [k for k, _ in SCALARS]
    assert scalars(Stats().as_dict()) == {}  # an interval without a step has nothing per step


def _unconfigured(rank, world):
    """log_every(2) in a process where nobody configured logging."""
    import contextlib
    import io

    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.hooks import register_hook

    root, log = logging.getLogger(), logging.getLogger("gradzip")
    saved = (root.handlers[:], log.handlers[:], log.level)
    root.handlers[:], log.handlers[:] = [], []
    log.setLevel(logging.NOTSET)
    err = io.StringIO()
    try:
        ddp = DDP(make_model())
        state = register_hook(ddp, gz.TopK(0.1))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with contextlib.redirect_stderr(err):
            state.log_every(2)
            train_steps(ddp, opt, 4, rank)
            # configured later (basicConfig's WARNING level): its handler alone prints the lines
            root.addHandler(logging.StreamHandler(err))
            root.setLevel(logging.WARNING)
            train_steps(ddp, opt, 2, rank, first=4)
    finally:  # the pooled rank's logging as it was
        root.handlers[:], log.handlers[:] = saved[0], saved[1]
        log.setLevel(saved[2])
    return err.getvalue()


@pytest.mark.slow
def test_log_every_reaches_the_user_without_logging_setup():
    # was: nothing at all (INFO on an unconfigured logger)
    for text in run_ranks(_unconfigured, 2):
        lines = text.splitlines()
        assert [line.split(":")[0] for line in lines] == ["gradzip step 2", "gradzip step 4", "gradzip step 6"], text
        assert "2 steps, ratio" in lines[0]


# -- gradzip bench's progress ------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bench_progress_to_a_file_has_no_per_step_updates(capsys):
    from gradzip.cli import Progress

    # was: ~2 updates a step to a redirected stderr (737 for 372 steps)
    log = io.StringIO()
    p = Progress(372, file=log)
    for step in range(372):
        p.tick("TopK(ratio=0.01)" if step < 186 else "Int8()", step)
    p.write("  TopK(ratio=0.01) seed 1   acc 97.00%")
    p.close()
    assert log.getvalue() == ""
    assert capsys.readouterr().out == "  TopK(ratio=0.01) seed 1   acc 97.00%\n"  # the per-run lines stay


def test_bench_progress_on_a_terminal_starts_at_the_first_step():
    pytest.importorskip("tqdm")
    from gradzip.cli import Progress

    term = _Terminal()
    p = Progress(300, file=term)
    time.sleep(1.2)  # the ranks starting up: not training time
    for step in range(200):  # fast steps: the bar redraws at most every 0.1 s, not at every step
        p.tick("TopK(ratio=0.01)", step)
    p.tick("Int8()", 200)
    p.close()
    renders = [r for r in term.getvalue().split("\r") if r.strip()]
    # was [00:01<...] and a rate of 1 step in 1.2 s: the start-up counted as training time
    assert all(" [00:00<" in r for r in renders), renders
    assert len(renders) < 20, len(renders)  # was one (or two) a step: set_description redrew every tick
    assert renders[-1].startswith("Int8(): ") and "201/300" in renders[-1]
