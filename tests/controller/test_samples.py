"""What the model said: the trainer logs a few generated answers (prompt, response, reward) at
each validation and every ``trainer.log_samples.every`` RL steps, to the sinks that take samples.

The roles are hand-written fakes: a generator that answers each prompt with a fixed text and a
rule-like reward that scores by the answer, counting the rows it is asked about.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from controller.metrics import JsonlSink, TensorBoardSink, markdown_table, read_samples
from controller.scoring import stash
from controller.trainer import LogSamples, Trainer, TrainerConfig
from tests.fixtures.clients import ONE_RANK
from transport.batch import TensorBatch

PROMPTS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]


def answered(prompts: list[str], responses: list[str], **columns: list[Any]) -> TensorBatch:
    """A generated batch: token columns (one token each) and its text."""
    n = len(prompts)
    ones = torch.ones(n, 2, dtype=torch.long)
    return TensorBatch.from_dict(
        {"input_ids": ones, "attention_mask": ones, "response_mask": ones},
        non_tensors={"prompt": prompts, "response": responses, **columns},
    )


class Generator:
    """Answers ``i+1=`` with ``i+1`` for even ``i``, with an empty string otherwise."""

    role = "actor"
    controller = ONE_RANK

    async def generate(self, prompts: TensorBatch, sampling: Any, min_version: int) -> TensorBatch:
        text = prompts.non_tensors
        responses = [str(int(p[:-3]) + 1) if int(p[:-3]) % 2 == 0 else "" for p in text["prompt"]]
        return answered(text["prompt"], responses, answer=text["answer"])


class Reward:
    """1.0 when the response equals the answer; remembers how many rows each call scored."""

    role = "reward"

    def __init__(self) -> None:
        self.asked: list[int] = []

    async def compute_reward(self, batch: TensorBatch) -> TensorBatch:
        text = batch.non_tensors
        self.asked.append(len(batch))
        right = [float(r == a) for r, a in zip(text["response"], text["answer"], strict=True)]
        return TensorBatch.from_dict({"scores": torch.tensor(right)})


class Collect:
    """A sink that takes records and samples."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def samples(self, rows: Any) -> None:
        self.rows.extend(rows)


def trainer(tmp_path: Path, sink: Any, count: int = 4) -> tuple[Trainer, Reward]:
    reward = Reward()
    roles = SimpleNamespace(actor=Generator(), reward=reward, rollout=None, generator=Generator())
    cfg = TrainerConfig(val_data="val", log_samples=LogSamples(count=count, every=3))
    found = Trainer(cfg, [], roles, {}, {"val": PROMPTS}, tmp_path, [], [sink])  # type: ignore[arg-type]
    return found, reward


def test_a_validation_logs_its_first_answers_with_their_scores(tmp_path: Path) -> None:
    sink = Collect()
    found, _ = trainer(tmp_path, sink)
    record = asyncio.run(found._validate("init"))
    assert record["val/score"] == 0.5
    assert [(s["prompt"], s["response"], s["reward"]) for s in sink.rows] == [
        ("0+1=", "1", 1.0),
        ("1+1=", "", 0.0),
        ("2+1=", "3", 1.0),
        ("3+1=", "", 0.0),
    ]
    assert {(s["kind"], s["stage"], s["step"]) for s in sink.rows} == {("validation", "init", 0)}
    assert sink.rows[1]["answer"] == "2"
    assert all("prompt" not in r for r in sink.records)  # text stays out of the metric records
    # the same weights again (nothing trained since): no second copy of the same answers
    asyncio.run(found._validate("before:rl"))
    assert len(sink.rows) == 4


def test_count_zero_logs_nothing(tmp_path: Path) -> None:
    sink = Collect()
    found, _ = trainer(tmp_path, sink, count=0)
    asyncio.run(found._validate("init"))
    assert sink.rows == [] and sink.records


def rollout_batch() -> TensorBatch:
    """Two prompts, three samples each (uid 0, 0, 0, 1, 1, 1); only the last sample is right."""
    prompts = ["0+1="] * 3 + ["4+1="] * 3
    responses = ["7", "8", "1", "2", "3", "5"]
    return answered(prompts, responses, answer=["1"] * 3 + ["5"] * 3, uid=[0, 0, 0, 1, 1, 1])


def test_rollout_samples_take_one_row_per_prompt_and_ask_only_for_those(tmp_path: Path) -> None:
    sink = Collect()
    found, reward = trainer(tmp_path, sink, count=3)
    asyncio.run(found._rollout_samples("grpo", rollout_batch()))
    assert [(s["prompt"], s["response"], s["reward"]) for s in sink.rows] == [
        ("0+1=", "7", 0.0),  # the first sample of each prompt,
        ("4+1=", "2", 0.0),
        ("0+1=", "8", 0.0),  # then the others in order
    ]
    assert {s["kind"] for s in sink.rows} == {"rollout"}
    assert reward.asked == [3]  # scored: the three rows shown, not the batch


def test_rollout_samples_reuse_scores_the_batch_kept_while_streaming(tmp_path: Path) -> None:
    sink = Collect()
    found, reward = trainer(tmp_path, sink, count=2)
    batch = rollout_batch()
    stash(batch, "reward", {"scores": torch.tensor([0.5, 0.25, 0.75, 0.125, 1.0, 2.0])})
    asyncio.run(found._rollout_samples("grpo", batch))
    assert [s["reward"] for s in sink.rows] == [0.5, 0.125]
    assert reward.asked == []  # no reward call


def test_jsonl_sink_writes_samples_beside_metrics_and_cuts_them_back_on_resume(
    tmp_path: Path,
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    sink = JsonlSink(metrics)
    sink({"step": 1, "train/loss": 1.0})
    sink.samples([{"step": 1, "prompt": "p", "response": "ünï"}, {"step": 3, "prompt": "q"}])
    sink.close()
    assert [s["prompt"] for s in read_samples(tmp_path / "samples.jsonl")] == ["p", "q"]
    assert "ünï" in (tmp_path / "samples.jsonl").read_text(encoding="utf-8")
    JsonlSink(metrics, resume_step=2).close()  # resumed from the checkpoint of step 2
    assert [s["prompt"] for s in read_samples(tmp_path / "samples.jsonl")] == ["p"]
    JsonlSink(metrics).close()  # a fresh run in the same folder starts with none
    assert not (tmp_path / "samples.jsonl").exists()


def test_tensorboard_sink_writes_a_samples_table_to_the_text_tab(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    rows = [
        {"step": 5, "stage": "final", "kind": "validation", "prompt": "1|2", "response": ""},
        {"step": 5, "stage": "final", "kind": "validation", "prompt": "3", "response": "4"},
    ]
    sink.samples(rows)
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    (tag,) = events.Tags()["tensors"]
    assert tag.startswith("samples/validation/final")
    (event,) = events.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 5 and text == markdown_table(rows)
    assert "| 1\\|2 | (empty) |" in text
    json.dumps(rows)  # samples are plain JSON values
