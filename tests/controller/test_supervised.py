"""The supervised loop's own logic, with a fake role client that records its calls."""

from __future__ import annotations

from typing import Any

import torch

from controller.supervised import LoopConfig, batches, reward_model, sft, text_batch
from tests.conftest import run
from transport.batch import TensorBatch


class FakeRole:
    """Answers like the actor / reward-model clients and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, dict[str, Any]]] = []

    def _metrics(self, method: str, batch: TensorBatch, kwargs: dict[str, Any]) -> dict[str, float]:
        self.calls.append((method, len(batch), kwargs))
        return {"loss": 1.0 / len(self.calls)}

    async def sft_step(self, batch: TensorBatch, **kwargs: Any) -> dict[str, float]:
        return self._metrics("sft_step", batch, kwargs)

    async def sft_eval(self, batch: TensorBatch, **kwargs: Any) -> dict[str, float]:
        return self._metrics("sft_eval", batch, kwargs)

    async def train_pairs(self, batch: TensorBatch, **kwargs: Any) -> dict[str, float]:
        return self._metrics("train_pairs", batch, kwargs)

    async def score_pairs(self, batch: TensorBatch, **kwargs: Any) -> TensorBatch:
        self.calls.append(("score_pairs", len(batch), kwargs))
        chosen = torch.tensor([1.0, 0.0, 2.0, 3.0])[: len(batch)]
        return TensorBatch.from_dict({"chosen": chosen, "rejected": torch.ones(len(batch))})


ROWS = [
    {"prompt": f"{i}+1=", "response": str(i + 1), "chosen": "a", "rejected": "b"} for i in range(5)
]


def test_batches_reshuffle_per_epoch_and_never_span_two() -> None:
    drawn = list(batches(ROWS, LoopConfig(steps=4, batch_size=2, seed=1)))
    assert [len(b) for b in drawn] == [2, 2, 2, 2]
    first_epoch = [r["prompt"] for b in drawn[:2] for r in b]
    assert len(set(first_epoch)) == 4  # no repeats inside an epoch


def test_sft_forwards_its_options_and_evaluates_before_every_n_and_after() -> None:
    role, records = FakeRole(), []
    cfg = LoopConfig(steps=3, batch_size=2, eval_every=2)
    result = run(lambda: sft(role, ROWS, ROWS[:2], cfg, records.append, False, True))  # type: ignore[arg-type]
    steps = [c for c in role.calls if c[0] == "sft_step"]
    assert [c[2] for c in steps] == [{"response_only": False, "pack": True}] * 3
    assert [c[0] for c in role.calls].count("sft_eval") == 3  # before, step 2, step 3
    assert [r["step"] for r in records] == [0, 1, 2, 3] and "val/loss" in records[2]
    assert result["steps"] == 3 and result["before"]["loss"] == 1.0


def test_reward_model_reports_accuracy_and_margin_per_kind() -> None:
    rows = [{**r, "kind": k} for r, k in zip(ROWS[:4], ["a", "a", "b", "b"], strict=True)]
    result = run(lambda: reward_model(FakeRole(), ROWS, rows, LoopConfig(steps=1), lambda r: None))  # type: ignore[arg-type]
    after = result["after"]
    assert after["accuracy"] == 0.5 and after["accuracy/a"] == 0.0 and after["accuracy/b"] == 1.0
    assert after["margin"] == (0.0 - 1.0 + 1.0 + 2.0) / 4


def test_text_batch_sends_conversations_beside_pairs() -> None:
    chat = [
        {"role": "user", "content": "12*34=", "name": "u"},  # keys beyond role, content stay home
        {"role": "assistant", "content": "408", "tool_calls": None},
    ]
    rows: list[dict[str, Any]] = [
        {"prompt": "1+1=", "response": "2"},
        {"messages": chat, "answer": "408"},
    ]
    batch = text_batch(rows, ("prompt", "response"))
    assert batch.non_tensors == {
        "prompt": ["1+1=", None],
        "response": ["2", None],
        "messages": [
            None,
            [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "408"}],
        ],
    }
    plain = text_batch(rows[:1], ("prompt", "response"))
    assert plain.non_tensors == {"prompt": ["1+1="], "response": ["2"]}  # no messages column


def test_sft_sends_conversation_rows_to_the_actor() -> None:
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rows = [{"messages": chat}] * 4
    sent: list[TensorBatch] = []

    class Recording(FakeRole):
        async def sft_step(self, batch: TensorBatch, **kwargs: Any) -> dict[str, float]:
            sent.append(batch)
            return await super().sft_step(batch, **kwargs)

    cfg = LoopConfig(steps=2, batch_size=2, eval_every=0)
    run(lambda: sft(Recording(), rows, rows[:1], cfg, lambda _: None))  # type: ignore[arg-type]
    assert [b.non_tensors["messages"] for b in sent] == [[chat, chat]] * 2
