"""The collective transfer engine on real gloo ranks: after a transfer every rank's generation
shard equals the full parameter's slice bitwise, for every scheme and layout pair; HybridFlow's
training pieces live inside the generation shards until ``release``."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from reshard.layout import GenLayout, Param
from reshard.plan import SCHEMES, make_plan
from reshard.transfer import Transfer, gather_group, release
from tests.fixtures.ranks import run_ranks
from transport.protocol import Layout

PARAMS = [
    Param("embed", (16, 6), "column"),
    Param("l0.q", (8, 6), "column"),
    Param("l0.o", (6, 8), "row"),
    Param("l0.norm", (6,), "replicated"),
    Param("l1.up", (12, 6), "column"),
    Param("l1.down", (6, 12), "row"),
]


def full(param: Param) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(param.name.encode()))
    return torch.randn(param.shape, generator=g)


def piece(param: Param, box: Any) -> torch.Tensor:
    return full(param)[tuple(slice(a, b) for a, b in box)].clone()


def _check(rank: int, world: int, train: Layout, gen_tp: int, bucket: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for scheme in SCHEMES:
        plan = make_plan(PARAMS, train, GenLayout(tp=gen_tp), scheme, bucket_bytes=bucket)
        group = gather_group(plan)
        mine = {
            p.name: piece(p, plan.held_box(i, rank))
            for i, p in enumerate(PARAMS)
            if plan.held_box(i, rank) is not None
        }
        reuse = scheme == "hybridflow"
        gen = Transfer(plan, rank, group).run(mine, reuse=reuse)
        for i, p in enumerate(PARAMS):
            box = plan.gen_box(i, rank)
            assert torch.equal(gen[p.name], piece(p, box)), (scheme, p.name)
        inside = sorted(  # training pieces that live in their generation shard's storage
            n
            for n, t in mine.items()
            if t.untyped_storage().data_ptr() == gen[n].untyped_storage().data_ptr()
        )
        release(mine, gen)
        assert gen == {}
        for i, p in enumerate(PARAMS):  # training pieces intact, with storage of their own
            assert torch.equal(mine[p.name], piece(p, plan.held_box(i, rank)))
            assert mine[p.name].is_contiguous()
        found[scheme] = {"moved_into_gen": inside, "recv": plan.recv_bytes(rank)}
    return found


PAIRS = [(1, 4, 2), (1, 4, 1), (2, 2, 2), (2, 2, 1)]  # (dp, tp) -> gen tp on 4 ranks


def _every_pair(rank: int, world: int, bucket: int) -> list[dict[str, Any]]:
    return [_check(rank, world, Layout(dp=dp, tp=tp), g, bucket) for dp, tp, g in PAIRS]


@pytest.mark.timeout(120)
def test_generation_shards_equal_the_training_weights_bitwise(tmp_path: Path) -> None:
    """tp 4 -> 2, 4 -> 1, 2 -> 2 and 2 -> 1 (dp 2), every scheme, in one 4-rank group."""
    results = run_ranks(_every_pair, 4, tmp_path, 200)  # small buckets: many of them
    for rank, per_pair in enumerate(results):
        for (_, tp, gen_tp), found in zip(PAIRS, per_pair, strict=True):
            # zero redundancy: every training piece is part of its generation shard's storage
            assert found["hybridflow"]["moved_into_gen"] == sorted(p.name for p in PARAMS), rank
            assert all(found[s]["moved_into_gen"] == [] for s in SCHEMES if s != "hybridflow")
            if tp == gen_tp:
                assert found["hybridflow"]["recv"] == 0  # tp 2 -> 2 moves no parameter bytes


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_papers_eight_rank_example(tmp_path: Path) -> None:
    """Training 1-4-2 → generation 1-2-2-2 on 8 ranks, every scheme."""
    results = run_ranks(_check, 8, tmp_path, Layout(dp=2, tp=4), 2, 1 << 20)
    matrices = sum(p.nbytes for p in PARAMS if p.split != "replicated")
    # each rank receives its micro-DP partner's quarter of every split matrix
    assert {r["hybridflow"]["recv"] for r in results} == {matrices // 4}
