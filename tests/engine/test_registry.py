"""The registry: one grammar for every method, wire codes claimed once, a new codec is one file."""

import json
import sys
import textwrap

import pytest
import torch

import gradzip as gz
from gradzip import cli, registry, wire
from gradzip.hooks import register_hook
from tests.support import fresh, run_ranks

SPECS = [
    "Identity()",
    "TopK(ratio=0.001)",
    "Threshold(tau=0.01, policy='adaptive', band=(0.001, 0.05))",
    "SignSGD(block=64)",
    "QSGD(levels=3, block=32)",
    "Int8(allreduce=True)",
    "PowerSGD(rank=4, accordion_rank=8)",
    "Filter(TopK(0.01), min_change=0.2)",
    "Policy(PowerSGD(rank=1), min_numel=10000, fallback=TopK(0.01))",
    "Policy(PowerSGD(), skip=['bias'], per_layer={'emb': Int8()})",
]


@pytest.mark.parametrize("spec", SPECS)
def test_every_method_round_trips_through_its_repr(spec):
    m = gz.parse(spec)
    again = gz.parse(repr(m))
    assert again == m and again.config() == m.config()
    assert json.loads(json.dumps(m.config())) == m.config()


def test_every_registered_method_builds_from_its_bare_name():
    import inspect

    for name in registry.names():
        cls = registry.lookup(name)
        if (
            isinstance(cls, type)
            and issubclass(cls, registry.Registered)
            and any(p.default is inspect.Parameter.empty for p in cls._params())
        ):
            continue  # wrappers such as AllGather(codec) need their argument
        m = gz.parse(name)
        if isinstance(m, registry.Spec):  # a front end: built by the tool with an optimizer and model
            continue
        assert m.config()["name"] == name


def test_grammar_reads_literals_only():
    with pytest.raises(ValueError, match="unknown method 'Nope'"):
        gz.parse("Nope(1)")
    with pytest.raises(ValueError, match="literals and method calls only"):
        gz.parse("TopK(ratio=0.01 * x)")
    with pytest.raises(ValueError, match="unknown method 'open'"):
        gz.parse("TopK(ratio=open('/etc/passwd'))")
    with pytest.raises(ValueError, match=r"ratio must be a finite number in \(0, 1\]"):
        gz.parse("TopK(2)")
    with pytest.raises(ValueError, match="TopK: .*unexpected keyword"):
        gz.parse("TopK(rato=0.1)")
    assert gz.parse("PowerSGD(rank=-(-2))").rank == 2


def test_repr_keeps_the_arguments_the_caller_wrote():
    """``TopK(0.01)`` read ``TopK()`` (0.01 is the default) in routes, CSVs and errors."""
    assert repr(gz.parse("TopK(0.01)")) == "TopK(ratio=0.01)" == repr(gz.TopK(ratio=0.01))
    assert repr(gz.TopK()) == "TopK()" and repr(gz.TopK(0.05)) == "TopK(ratio=0.05)"
    pol = gz.parse("Policy(PowerSGD(rank=1), min_numel=10000, fallback=TopK(0.01))")
    assert repr(pol) == "Policy(PowerSGD(rank=1), min_numel=10000, fallback=TopK(ratio=0.01))"
    assert repr(gz.Threshold(tau=1e-3)) == "Threshold(tau=0.001)"
    # what is written is what equality and hashing ignore: the configuration decides
    assert gz.TopK(0.01) == gz.TopK() and hash(gz.TopK(0.01)) == hash(gz.TopK())
    assert len({gz.TopK(0.01), gz.TopK()}) == 1
    import copy
    import pickle

    assert repr(copy.deepcopy(pol)) == repr(pickle.loads(pickle.dumps(pol))) == repr(pol)
    assert gz.parse(repr(pol)) == pol and repr(gz.parse(repr(pol))) == repr(pol)


def test_a_repeated_keyword_is_refused_as_python_refuses_it():
    with pytest.raises(SyntaxError, match="keyword argument repeated"):
        compile("TopK(ratio=0.01, ratio=0.02)", "<spec>", "eval")
    with pytest.raises(ValueError, match="TopK: keyword argument repeated: ratio"):
        gz.parse("TopK(ratio=0.01, ratio=0.02)")  # was TopK(ratio=0.02): the last one won
    with pytest.raises(ValueError, match="keyword argument repeated: min_numel"):
        gz.parse("Policy(TopK(0.01), min_numel=10, min_numel=20)")


def test_a_bad_method_in_a_list_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match=r"method 2 of 3, 'Int9\(\)': unknown method 'Int9' \(did you mean 'Int8'\?\)"):
        registry.parse_list("TopK(0.01), Int9(), PowerSGD(rank=2)")
    with pytest.raises(ValueError, match=r"method 'topk\(0.1\)': unknown method 'topk' \(did you mean 'TopK'\?\)"):
        registry.parse_list("topk(0.1)")
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'rnak' \(did you mean 'rank'\?\)"):
        gz.parse("PowerSGD(rnak=2)")
    with pytest.raises(ValueError, match=r"unknown method 'Zzz'; choose from"):  # nothing close: no guess
        gz.parse("Zzz()")


def test_numpy_and_torch_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    assert gz.TopK(np.float32(0.25)).ratio == 0.25
    assert gz.PowerSGD(rank=np.int64(3)).rank == 3
    assert gz.TopK(torch.tensor(0.5)).ratio == 0.5
    with pytest.raises(ValueError, match="rank must be an integer"):
        gz.PowerSGD(rank=True)


def test_wire_codes_are_claimed_once():
    codes = wire.formats()
    assert codes[3] == "Threshold.BITMAP2" and codes[19] == "Int8.INT8"
    with pytest.raises(ValueError, match="format code 3 of Mine.X is already taken by Threshold.BITMAP2"):
        wire.register_format(3, "Mine.X")
    with pytest.raises(TypeError, match="already registered"):
        type("TopK", (gz.Codec,), {})


TOY = '''
"""Stochastic rounding to a power of two: a codec in one file, as a user would write it."""
import torch

import gradzip as gz
from gradzip.wire import Payload

FMT_POW2 = 200


class Toy(gz.Codec):
    """Each element becomes +-2**e (int8 e, e=-128 for zero), rounded up or down at random so that
    the expectation is the element itself. Unbiased; 1 byte of exponent + 1 of sign per element."""

    biased = False
    formats = {"POW2": FMT_POW2}

    def __init__(self, seed: int = 0):
        self.seed = seed

    def compress(self, x, ctx=None):
        v = x.reshape(-1).float()
        a = v.abs()
        lo = torch.floor(torch.log2(a.clamp_min(2.0**-120)))
        p = a / torch.exp2(lo) - 1.0  # in [0, 1): the chance of rounding up to 2**(lo + 1)
        g = torch.Generator().manual_seed(self.seed + (ctx.step if ctx else 0) * 7919 + (ctx.rank if ctx else 0))
        e = lo + (torch.rand(v.shape, generator=g) < p).float()
        e = torch.where(a > 0, e, torch.full_like(e, -128.0)).clamp(-128, 127).to(torch.int8)
        body = torch.cat([e.view(torch.uint8), (v < 0).to(torch.uint8)])
        return Payload(body=body, shape=x.shape, dtype=x.dtype, fmt=FMT_POW2)

    def decompress(self, payload):
        n = payload.body.numel() // 2
        e = payload.body[:n].view(torch.int8).float()
        sign = 1.0 - 2.0 * payload.body[n:].float()
        val = torch.where(e > -128, torch.exp2(e), torch.zeros_like(e)) * sign
        return val.to(payload.dtype).reshape(payload.shape)
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_codec.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    import toy_codec  # noqa: F401 - defining the class registers it

    yield tmp_path
    # The class leaves the registry with the module, so that no later test of this process sees it.
    registry._CLASSES.pop("Toy", None)
    wire._FORMATS.pop(200, None)
    sys.modules.pop("toy_codec", None)


def _toy_ddp(rank, world):
    import toy_codec  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    outs = {}
    for label, method in (("toy", gz.parse("Toy()")), ("policy", gz.parse("Policy(Toy(), min_numel=20)"))):
        state = register_hook(ddp, method)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(4, 8, generator=g)
        model.zero_grad()
        ddp(x).sum().backward()
        outs[label] = ([p.grad.clone() for p in model.parameters()], state.stats(), state.state_dict()["method"])
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # a fresh hook for the next method
    return outs


def test_a_new_codec_in_its_own_file_works_everywhere(toy, capsys):
    assert "Toy" in registry.names("codec") and wire.formats()[200] == "Toy.POW2"
    # the DDP hook and a Policy, on two ranks: both ranks average to the same values
    res = run_ranks(_toy_ddp, 2, fresh=True)  # the toy module is on the parent's sys.path only
    for label in ("toy", "policy"):
        g0, g1 = res[0][label][0], res[1][label][0]
        assert all(torch.equal(a, b) and bool(torch.isfinite(a).all()) for a, b in zip(g0, g1))
        assert res[0][label][1]["bytes_allgather"] > 0
    assert res[0]["toy"][2] == {"name": "Toy", "seed": 0}
    # gradzip plan (in this process: it starts no rank) and gradzip bench read it in the grammar
    assert cli.main(
        "plan --import toy_codec --params 3e5 --compute 10ms --bandwidth 1Gbit --latency 50us --worlds 2,8"
        " --plot= --profile-sizes 4096,65536 --repeats 1".split()
        + ["--methods", "DDP, Toy()"]
    ) in (0, None)
    assert "Toy()" in capsys.readouterr().out
    # gradzip bench in this process too: its ranks (forkserver) import the module given to --import
    argv = "bench --import toy_codec --dataset digits --epochs 1 --seeds 0 --methods Toy() --no-progress".split()
    assert cli.main([*argv, "--out", str(toy / "out")]) in (0, None)
    rows = json.loads((toy / "out" / "results.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["Identity", "Toy()"]
    assert rows[1]["ratio"] > 1.5 and rows[1]["accuracy"] > 0.5


def test_parse_works_after_importing_only_the_registry():
    """``import gradzip`` loads its modules lazily; a process that imports only
    ``gradzip.registry`` still parses gradzip's own methods."""
    assert fresh.facts()["parsed"] == ["TopK", True]  # tests/support/fresh.py
