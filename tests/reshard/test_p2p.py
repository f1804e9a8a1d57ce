"""Point-to-point plans (``reshard/p2p.py``) against hand-computed moves.

The model in every case: ``q`` [8, 4] column-split, ``o`` [4, 8] row-split, ``norm`` [4]
replicated, fp32. Boxes are ((start, stop), ...) per dim, relative to what the source holds and
to what the destination needs.
"""

from __future__ import annotations

from typing import Any

import pytest

from reshard.layout import LayoutError, Param, Split
from reshard.p2p import Move, make_p2p_plan, pair_buckets, params_from_wire
from transport.protocol import Layout

Q, OUT, NORM = 0, 1, 2
PARAMS = [
    Param("q", (8, 4), "column"),
    Param("o", (4, 8), "row"),
    Param("norm", (4,), "replicated"),
]
FULL_Q = ((0, 8), (0, 4))
HALF_ROWS = ((0, 4), (0, 4))
ROWS_4_8 = ((4, 8), (0, 4))
COLS_4_8 = ((0, 4), (4, 8))
NORM_BOX = ((0, 4),)


def test_tp2_to_tp2_sends_each_rank_its_own_shard_and_nothing_across() -> None:
    plan = make_p2p_plan(PARAMS, Layout(tp=2), Layout(tp=2))
    assert set(plan.pairs()) == {(0, 0), (1, 1)}
    assert plan.receives(0) == [
        Move(0, 0, Q, HALF_ROWS, HALF_ROWS),
        Move(0, 0, OUT, HALF_ROWS, HALF_ROWS),
        Move(0, 0, NORM, NORM_BOX, NORM_BOX),  # replicated: holder (0 + 2) % 2 = rank 0
    ]
    assert plan.receives(1) == [
        Move(1, 1, Q, HALF_ROWS, HALF_ROWS),
        Move(1, 1, OUT, HALF_ROWS, HALF_ROWS),
        Move(1, 1, NORM, NORM_BOX, NORM_BOX),  # holder (1 + 2) % 2 = rank 1
    ]
    assert plan.send_bytes(0) == plan.send_bytes(1) == (16 + 16 + 4) * 4


def test_tp2_to_tp1_gathers_halves_from_both_ranks() -> None:
    plan = make_p2p_plan(PARAMS, Layout(tp=2), Layout(tp=1))
    assert plan.receives(0) == [
        Move(0, 0, Q, HALF_ROWS, HALF_ROWS),
        Move(1, 0, Q, HALF_ROWS, ROWS_4_8),
        Move(0, 0, OUT, HALF_ROWS, HALF_ROWS),
        Move(1, 0, OUT, HALF_ROWS, COLS_4_8),
        Move(0, 0, NORM, NORM_BOX, NORM_BOX),
    ]
    assert plan.bytes_between(0, 0) == (16 + 16 + 4) * 4
    assert plan.bytes_between(1, 0) == (16 + 16) * 4
    assert plan.recv_bytes(0) == (32 + 32 + 4) * 4  # the whole model, once


def test_tp1_to_tp2_cuts_each_destinations_half_out_of_the_whole() -> None:
    plan = make_p2p_plan(PARAMS, Layout(tp=1), Layout(tp=2))
    assert plan.receives(1) == [
        Move(0, 1, Q, ROWS_4_8, HALF_ROWS),
        Move(0, 1, OUT, COLS_4_8, HALF_ROWS),
        Move(0, 1, NORM, NORM_BOX, NORM_BOX),
    ]
    assert plan.sends(0) == plan.receives(0) + plan.receives(1)


def test_dp2_tp1_to_tp2_spreads_destination_ranks_over_the_replicas() -> None:
    plan = make_p2p_plan(PARAMS, Layout(dp=2), Layout(tp=2))
    assert plan.receives(0) == [
        Move(0, 0, Q, HALF_ROWS, HALF_ROWS),
        Move(0, 0, OUT, HALF_ROWS, HALF_ROWS),
        Move(0, 0, NORM, NORM_BOX, NORM_BOX),
    ]
    assert plan.receives(1) == [  # from replica 1 = source rank 1, which holds everything
        Move(1, 1, Q, ROWS_4_8, HALF_ROWS),
        Move(1, 1, OUT, COLS_4_8, HALF_ROWS),
        Move(1, 1, NORM, NORM_BOX, NORM_BOX),
    ]


def test_replicated_parameters_rotate_over_the_holding_tp_ranks() -> None:
    norms = [Param(f"n{i}", (4,)) for i in range(4)]
    plan = make_p2p_plan(norms, Layout(tp=2), Layout(dp=2))
    assert [m.src for m in plan.receives(0)] == [0, 1, 0, 1]  # (0 + i) % 2
    assert [m.src for m in plan.receives(1)] == [1, 0, 1, 0]  # (1 + i) % 2


def test_a_source_pipeline_of_two_stages_into_one_destination_stage() -> None:
    staged = [Param("a", (4,), stage=0), Param("b", (4,), stage=1)]
    plan = make_p2p_plan(staged, Layout(pp=2), Layout())
    assert plan.receives(0) == [
        Move(0, 0, 0, NORM_BOX, NORM_BOX),
        Move(1, 0, 1, NORM_BOX, NORM_BOX),
    ]
    with pytest.raises(LayoutError, match="must divide source pp"):
        make_p2p_plan(staged, Layout(pp=1), Layout(pp=2))


def test_a_split_that_does_not_divide_is_refused() -> None:
    with pytest.raises(LayoutError, match="divisible by 3"):
        make_p2p_plan([Param("q", (8, 4), "column")], Layout(tp=1), Layout(tp=3))


def test_buckets_keep_order_and_size_and_let_a_big_move_travel_alone() -> None:
    plan = make_p2p_plan(PARAMS, Layout(tp=2), Layout(tp=1))
    moves = plan.pairs()[(0, 0)]  # 64, 64 and 16 bytes
    assert [len(b) for b in pair_buckets(moves, plan.params, 128)] == [2, 1]
    assert [len(b) for b in pair_buckets(moves, plan.params, 32)] == [1, 1, 1]
    assert [m for b in pair_buckets(moves, plan.params, 80) for m in b] == moves


def test_params_from_a_training_engines_layout() -> None:
    specs: list[dict[str, Any]] = [
        {"name": "q", "shape": [8, 4], "tp_dim": 0},
        {"name": "o", "shape": [4, 8], "tp_dim": 1},
        {"name": "norm", "shape": [4], "tp_dim": None},
    ]
    assert params_from_wire(specs, 4) == PARAMS
    with pytest.raises(LayoutError, match="tp_dim 2"):
        params_from_wire([{"name": "x", "shape": [2, 2, 2], "tp_dim": 2}], 4)


def test_a_whole_source_feeds_a_destination_that_splits_by_its_own_plan() -> None:
    whole = [Param(p.name, p.shape) for p in PARAMS]  # a tp = 1 source reports no splits
    splits: dict[str, Split] = {"q": "column", "o": "row"}
    plan = make_p2p_plan(whole, Layout(dp=2), Layout(tp=2), splits)
    assert plan.receives(1) == [
        Move(1, 1, Q, ROWS_4_8, HALF_ROWS),
        Move(1, 1, OUT, COLS_4_8, HALF_ROWS),
        Move(1, 1, NORM, NORM_BOX, NORM_BOX),  # absent from the splits: whole
    ]


def test_an_fsdp_sharded_source_sends_each_dp_shard_to_every_destination_needing_it() -> None:
    params = [Param("q", (8, 4), "column"), Param("odd", (5,))]
    plan = make_p2p_plan(params, Layout(dp=2), Layout(dp=2), src_dp_dims=[0, 0])
    assert plan.held_box(0, 1) == ROWS_4_8  # torch.chunk of the whole over dp
    assert plan.held_box(1, 0) == ((0, 3),) and plan.held_box(1, 1) == ((3, 5),)
    assert plan.receives(1) == [
        Move(0, 1, 0, HALF_ROWS, HALF_ROWS),
        Move(1, 1, 0, HALF_ROWS, ROWS_4_8),
        Move(0, 1, 1, ((0, 3),), ((0, 3),)),
        Move(1, 1, 1, ((0, 2),), ((3, 5),)),
    ]
    assert (plan.send_bytes(0), plan.send_bytes(1)) == (152, 144)  # (16+3), (16+2) floats x 2
