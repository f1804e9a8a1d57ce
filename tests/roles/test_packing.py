"""Packed SFT rows give the same loss and the same update as unpacked ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.clients import ActorClient
from controller.tasks import arithmetic
from deploy.session import local_session
from roles.modeling.models import init_model
from roles.modeling.text import block_causal_mask, pack_rows, segment_positions
from tests.conftest import TEST_TIMEOUTS, group, run
from transport.batch import TensorBatch


def test_pack_rows_first_fit_by_hand() -> None:
    rows = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    targets = [[0, 1, 1], [0, 1], [0, 0, 1, 1], [1]]
    batch = pack_rows(rows, targets, max_len=6, pad=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 10], [6, 7, 8, 9, 0, 0]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert segment_positions(batch["segment_ids"]).tolist() == [
        [0, 1, 2, 0, 1, 0],
        [0, 1, 2, 3, 0, 1],
    ]
    mask = block_causal_mask(batch["segment_ids"])[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]  # 2nd segment, 2nd token
    assert mask[5].tolist() == [False] * 5 + [True]


def test_packed_sft_equals_unpacked_on_two_ranks(tmp_path: Path) -> None:
    model = init_model(tmp_path / "tiny", "tiny")
    rows = arithmetic(24, "sft", seed=1)
    batch = TensorBatch.from_dict(
        non_tensors={
            "prompt": [r["prompt"] for r in rows],
            "response": [r["response"] for r in rows],
        }
    )
    config = {"model": str(model), "micro_batch_size": 4, "optim": {"lr": 1e-3}}

    async def main() -> None:
        placement = [
            group("g", 2, plain=("roles.actor:Actor", config), packed=("roles.actor:Actor", config))
        ]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            plain, packed = ActorClient(c, "plain"), ActorClient(c, "packed")
            before = await plain.sft_eval(batch)
            assert await packed.sft_eval(batch, pack=True) == pytest.approx(before, abs=1e-5)
            step = await plain.sft_step(batch)
            step_packed = await packed.sft_step(batch, pack=True)
            for key in ("loss", "grad_norm", "tokens"):
                assert step_packed[key] == pytest.approx(step[key], abs=1e-5), key
            assert step["seqs"] == 24 and step_packed["seqs"] < 24  # rows, not sequences, count
            after = await plain.sft_eval(batch)
            assert await packed.sft_eval(batch) == pytest.approx(after, abs=1e-5)
            assert after["loss"] < before["loss"]

    run(main)
