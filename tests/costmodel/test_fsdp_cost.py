"""The cost of an FSDP2 step (gradzip/costmodel/fsdp.py) and ``FSDP2(...)`` in ``gradzip plan``:
three collectives per ``fully_shard`` unit, plain or through gradzip.fsdp."""

from __future__ import annotations

import pytest

import gradzip as gz
from gradzip import plan
from gradzip.costmodel import CodecFit, CodecProfile, FSDPMethod, Link, fsdp_groups, fsdp_step_cost
from gradzip.costmodel.link import Collective, reducescatter_time, wire_time

LAYERS = [
    ("wte.weight", (256, 64)),
    ("h.0.fc.weight", (64, 64)),
    ("h.0.fc.bias", (64,)),
    ("h.1.fc.weight", (64, 64)),
    ("h.1.fc.bias", (64,)),
    ("ln_f.weight", (64,)),
]
LINK = Link(1e9, 0.0)
NONE = CodecProfile(missing="omit")  # no codec seconds: the wire alone


def test_groups_are_the_blocks_and_the_root():
    assert fsdp_groups(LAYERS) == [[1, 2], [3, 4], [0, 5]]
    assert fsdp_groups([("layer0.weight", (4, 4)), ("layer1.weight", (4, 4)), ("rest.bias", (3,))]) == [[0], [1], [2]]
    gpt2 = plan.layers_from_arch("gpt2-small")
    assert len(fsdp_groups(gpt2)) == 13  # 12 blocks and the root (embeddings, final norm)


def test_plain_fsdp2_is_three_ring_collectives_per_group():
    world = 4
    sc = fsdp_step_cost(FSDPMethod(), LAYERS, world, LINK, 0.1, NONE)
    by = sc.detail["bytes_per_rank_by_collective"]
    shard = 4 * (64 * 64 + 64) // world * 2 + 4 * (256 * 64 + 64) // world  # every group's shard, fp32
    assert by["forward_all_gather"] == by["backward_all_gather"] == shard
    assert by["reduce_scatter"] == world * shard
    assert sc.collectives == 3 * 3
    want = 2 * 3 * 8 * shard / 1e9 + 3 / 4 * 8 * world * shard / 1e9  # two all-gathers, one reduce-scatter
    assert sc.wire_s == pytest.approx(want)
    assert reducescatter_time(1000, 4, Link(8e3, 0.5)) == pytest.approx(0.75 + 1.5)
    # reshard_after_forward=False: no backward all-gather; =2 on nodes of 2: inside the node
    assert fsdp_step_cost(FSDPMethod(reshard_after_forward=False), LAYERS, world, LINK, 0.1, NONE).collectives == 6
    node = Link(100e9, 0.0)
    hp = fsdp_step_cost(FSDPMethod(reshard_after_forward=2), LAYERS, world, LINK, 0.1, NONE, local_size=2, intra=node)
    assert hp.detail["bytes_per_rank_by_collective"]["backward_all_gather"] == 2 * shard
    assert hp.wire_s < sc.wire_s
    # plain FSDP2 overlaps its wire with compute; gradzip's compressed collectives wait on the host
    assert fsdp_step_cost(FSDPMethod(), LAYERS, world, LINK, 1.0, NONE, overlap=True).total_s == pytest.approx(1.0)
    q = FSDPMethod(all_gather=gz.Int8(), reduce_scatter=gz.Int8())
    assert not fsdp_step_cost(q, LAYERS, world, LINK, 1.0, NONE, overlap=True).overlap


def test_zeropp_moves_a_fraction_of_plain_fsdp2_and_its_codec_is_counted():
    world, L = 4, 2
    plain = fsdp_step_cost(FSDPMethod(), LAYERS, world, LINK, 0.1, NONE, local_size=L)
    zpp = FSDPMethod(
        all_gather=gz.Int8(block=64), reduce_scatter=gz.Hierarchical(gz.Int8(), local_size=L), reshard_after_forward=L
    )
    sc = fsdp_step_cost(zpp, LAYERS, world, LINK, 0.1, NONE, local_size=L, intra=Link(100e9, 0.0))
    by, pby = sc.detail["bytes_per_rank_by_collective"], plain.detail["bytes_per_rank_by_collective"]
    assert by["forward_all_gather"] < 0.3 * pby["forward_all_gather"]  # int8 codes and a scale per 64
    assert sc.wire_s < 0.25 * plain.wire_s
    # the reduce-scatter: the node's plain all-to-all, then Int8 across the nodes, then the engine's flag
    logs = [
        fsdp_step_cost(
            FSDPMethod(reduce_scatter=gz.Hierarchical(gz.Int8(), local_size=L)), LAYERS[1:3], world, LINK, 0.0, NONE
        )
    ]
    assert (
        logs[0].collectives == 2 + 3
    )  # 2 all-gathers, and the reduce-scatter's 2 collectives (Int8 sends no lengths) and flag
    fit = CodecProfile(missing="raise")
    fit.add(gz.Int8(block=64), CodecFit(0.001, 1e-9), error_feedback=False)
    fit.add(gz.Int8(), CodecFit(0.002, 0.0), error_feedback=True)
    one = fsdp_step_cost(
        FSDPMethod(all_gather=gz.Int8(block=64), reduce_scatter=gz.Int8()), LAYERS, world, LINK, 0.0, fit
    )
    n_params = sum(-(-s[0] // world) * (s[1] if len(s) > 1 else 1) for _, s in LAYERS)
    assert one.codec_s == pytest.approx(2 * (6 * 0.001 + 1e-9 * n_params) + 6 * 0.002)  # two gathers, one RS


def test_fsdp2_in_gradzip_plan():
    label = "FSDP2(all_gather=Int8(block=256), reduce_scatter=Hierarchical(Int8()), reshard_after_forward=2)"
    methods = plan.parse_methods(f"DDP, FSDP2, {label}", local_size=2)
    assert methods["FSDP2"] == FSDPMethod()
    zpp = methods[label]
    assert zpp.reduce_scatter.local_size == 2 and zpp.reshard_after_forward == 2
    rows = plan.project(LAYERS, 0.05, Link(1e9, 1e-5), [1, 4], methods, NONE, local_size=2)
    at = {(r["label"], r["world"]): r for r in rows}
    assert at[("FSDP2", 1)]["total_s"] == 0.05
    assert at[(label, 4)]["wire_s"] < at[("FSDP2", 4)]["wire_s"]
    line = plan.advice(rows, methods)
    assert "gz.fsdp.compress" in line or "plain" in line
    with pytest.raises(ValueError, match="codec or Hierarchical"):
        plan.parse_methods("FSDP2(reduce_scatter=PowerSGD())")
    with pytest.raises(ValueError, match="Int8"):
        plan.parse_methods("FSDP2(all_gather=TopK(0.1))")


def test_wire_time_of_an_intra_node_gather_uses_the_node_link():
    c = Collective("allgather", 1000, scope="intra", group=2)
    assert wire_time([c], 4, Link(8e3), local_size=2, intra=Link(8e6)) == pytest.approx(1e-3)
