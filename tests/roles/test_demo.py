"""The demo role is real data parallelism: 2 ranks on split batches == 1 rank on whole batches."""

from __future__ import annotations

import pytest
import torch

from controller.clients import LinearRegressorClient
from deploy.session import local_session
from tests.conftest import TEST_TIMEOUTS, group, run
from transport.batch import TensorBatch
from transport.errors import RemoteError


def train(nproc: int, steps: int = 15) -> tuple[dict[str, torch.Tensor], list[float]]:
    async def main() -> tuple[dict[str, torch.Tensor], list[float]]:
        placement = [group("g", nproc, linear=("roles.demo:LinearRegressor", {"dim": 4}))]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            model = LinearRegressorClient(c, "linear")
            gen = torch.Generator().manual_seed(3)
            losses = []
            for _ in range(steps):
                x = torch.randn(10, 4, generator=gen)  # 5 rows per rank at dp=2
                y = x.sum(dim=1, keepdim=True)
                metrics = await model.train_step(TensorBatch.from_dict({"x": x, "y": y}))
                assert len(metrics) == nproc  # one dict per dp rank
                assert len({m["loss"] for m in metrics}) == 1  # all ranks saw the global loss
                losses.append(metrics[0]["loss"])
            assert await model.replicas_agree() is True
            return await model.weights(), losses

    result: tuple[dict[str, torch.Tensor], list[float]] = run(main)
    return result


def test_two_rank_data_parallel_step_equals_one_rank() -> None:
    w1, losses1 = train(1)
    w2, losses2 = train(2)
    assert losses1[-1] < losses1[0]
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], atol=1e-6, rtol=0)
    assert abs(losses1[0] - losses2[0]) < 1e-6


def test_a_batch_without_a_needed_column_is_an_error_naming_it_and_the_group_carries_on() -> None:
    async def main() -> None:
        placement = [group("g", 2, linear=("roles.demo:LinearRegressor", {"dim": 2}))]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            model = LinearRegressorClient(c, "linear")
            x = torch.zeros(4, 2)
            with pytest.raises(RemoteError) as info:
                await model.train_step(TensorBatch.from_dict({"x": x}))
            assert info.value.exc_type == "BatchError"
            assert "the batch has no column 'y'; it has tensor columns ['x']" in str(info.value)
            as_list = TensorBatch.from_dict({"x": x}, {"y": [0.0] * 4})
            with pytest.raises(RemoteError, match="column 'y' must be a tensor column"):
                await model.train_step(as_list)
            y = torch.zeros(4, 1)
            metrics = await model.train_step(TensorBatch.from_dict({"x": x, "y": y}))
            assert metrics[0]["loss"] >= 0.0

    run(main)
