"""Supervision of a whole run (``hybridflow run``): the quickstart's tiny model with its actor on
2 ranks, a rollout group and a reward group, every group under a restart policy, a checkpoint
every 2 steps. Ranks of each kind are killed with SIGKILL from outside (``bench/chaos.py``); the
run completes and its final weights equal the undisturbed run's bitwise, each step is in the
metrics once, each fault and recovery is on record, and nothing outlives the run."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from bench.chaos import SIZES, Kill, command, equal, events, ranks, records, run, settings
from controller import rollouts
from controller.clients.env import EnvClient
from controller.metrics import JsonlSink, read_records, scalars
from controller.sync import WeightSync
from deploy.cli import build_parser
from deploy.reports.live import event_line
from deploy.reports.summary import _fault_lines


def steps_logged(run_dir: Path) -> list[int]:
    return [r["step"] for r in records(run_dir) if "stage_step" in r]


@pytest.fixture(scope="module")
def calm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The undisturbed run: SFT 2 steps, GRPO 8."""
    run_dir = tmp_path_factory.mktemp("calm") / "run"
    done = run(run_dir, settings(8, 2), [], SIZES)
    assert done["rc"] == 0, done["output"][-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_each_group_kind_killed_once_and_the_run_equals_the_undisturbed_one(
    calm: Path, tmp_path: Path
) -> None:
    plan = [Kill(4, "gen", 0), Kill(5, "score", 0), Kill(6, "main", 1), Kill(8, "main", 0)]
    done = run(tmp_path / "run", settings(8, 2), plan, SIZES)
    assert done["rc"] == 0, done["output"][-3000:]
    assert [(k.group, k.rank) for k in done["kills"]] == [(k.group, k.rank) for k in plan]
    assert equal(calm, tmp_path / "run")  # deterministic: bitwise the same weights
    assert steps_logged(tmp_path / "run") == list(range(1, 11))  # each step once
    found = events(tmp_path / "run")
    faults = [(e["group"], e["rank"]) for e in found if e["event"] == "fault"]
    assert faults == [("gen", 0), ("score", 0), ("main", 1), ("main", 0)]
    # in any order: under load a kill can land while the group killed before it still restarts
    recovered = sorted((e["event"], e["group"]) for e in found if e["event"] != "fault")
    assert recovered == [
        ("restart", "gen"),
        ("restart", "score"),
        ("rollback", "main"),
        ("rollback", "main"),
    ]
    rollbacks = [e for e in found if e["event"] == "rollback"]
    assert all(e["steps_replayed"] in (0, 1, 2) for e in rollbacks)
    assert all(e["recover_s"] < 30 for e in found if "recover_s" in e)
    assert not done["orphans"]


@pytest.mark.timeout(300)
def test_a_group_past_its_policy_stops_the_run_naming_the_setting(tmp_path: Path) -> None:
    sets = [*settings(30, 2), "placement.score.restart={max: 1, backoff_s: [0.0]}"]
    plan = [Kill(4, "score", 0), Kill(5, "score", 0)]
    done = run(tmp_path / "run", sets, plan, SIZES)
    assert done["rc"] == 1, done["output"][-3000:]
    assert len(done["kills"]) == 2
    out = done["output"]
    assert "score" in out and "SIGKILL" in out and "placement.score.restart.max=1" in out, out
    assert "--resume" in out  # the checkpoints are there to continue from
    assert not done["orphans"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_kill_during_a_weight_sync_is_survived(
    calm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout rank is killed while the actor's weights stream into it (its inbox is open,
    both sides' calls are out): the sync fails, the group restarts and gets the weights from its
    restore, and the run ends as the undisturbed one did. In this process, so the kill can be
    aimed at the sync itself."""
    pushes: list[str] = []
    original = WeightSync._both

    async def both(self: WeightSync, send: Any, receive: Any, what: str) -> Any:
        pushes.append(what)
        if len(pushes) == 3:  # a step's sync, not the first
            victim = ranks(os.getpid())[("gen", 0)]
            asyncio.get_running_loop().call_soon(os.kill, victim, signal.SIGKILL)
        return await original(self, send, receive, what)

    monkeypatch.setattr(WeightSync, "_both", both)
    run_dir = tmp_path / "run"
    argv = command(run_dir, settings(8, 2))[3:]  # past "python -m deploy.cli"
    args = build_parser().parse_args(argv)
    assert args.fn(args) == 0
    assert equal(calm, run_dir)
    found = events(run_dir)
    assert [(e["event"], e["group"]) for e in found] == [("fault", "gen"), ("restart", "gen")]
    assert len(pushes) >= 4  # the failed one, the restore's, the later steps'
    assert steps_logged(run_dir) == list(range(1, 11))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("example", ["tool_use.yaml", "agents/tool_use.yaml"])
def test_an_env_group_killed_mid_rollout_is_restarted_and_its_trajectories_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example: str
) -> None:
    """Multi-turn GRPO (the tool-use demo, lockstep serving: bitwise runs): the tools group dies
    right after the first actions of the first RL batch went out, its sessions open (with
    agents: right after the first replies to their model calls went back, the agents mid-
    conversation in the dying process); it restarts (a stateless group, by default), the
    batch's trajectories run again from their start with the same seeds, and the run equals the
    undisturbed one. In this process, so the kill can be aimed inside the rollout."""
    sets = [
        "stages.0.steps=10",
        "stages.1.steps=2",  # the kill lands in the first; the second runs on the restarted group
        "trainer.agent.serving=lockstep",
        "trainer.val_data=null",
        "logging.tensorboard=false",
    ]
    path = Path(__file__).resolve().parents[2] / "examples" / example
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    assert run(calm, sets, [], {}, path)["rc"] == 0
    sent: list[int] = []

    def kill_once() -> None:
        if len(sent) == 1:  # the first of the first RL batch: sessions are open
            victim = ranks(os.getpid())[("tools", 0)]
            asyncio.get_running_loop().call_soon(os.kill, victim, signal.SIGKILL)

    submit, exchange = EnvClient.submit, EnvClient.exchange

    async def submitting(self: EnvClient, actions: list[Any], **kwargs: Any) -> int:
        sent.append(len(actions))
        kill_once()
        return await submit(self, actions, **kwargs)

    async def exchanging(self: EnvClient, replies: list[Any], wait_s: float, **kwargs: Any) -> Any:
        if replies:
            sent.append(len(replies))
            kill_once()
        return await exchange(self, replies, wait_s, **kwargs)

    monkeypatch.setattr(EnvClient, "submit", submitting)
    monkeypatch.setattr(EnvClient, "exchange", exchanging)
    rerun: list[str] = []
    monkeypatch.setattr(rollouts.log, "warning", lambda msg, *a: rerun.append(msg % a))
    args = build_parser().parse_args(command(hit, sets, path)[3:])
    assert args.fn(args) == 0
    assert sent, "no action or reply was sent"
    assert [(e["event"], e["group"]) for e in events(hit)] == [
        ("fault", "tools"),
        ("restart", "tools"),
    ]
    assert any("run again from their start" in line for line in rerun), rerun
    assert equal(calm, hit)


def test_a_rollback_cuts_the_records_back_but_keeps_the_faults(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        sink({"step": step, "stage": "grpo", "stage_step": step})
    sink({"step": 3, "event": "fault", "group": "main", "rank": 1, "cause": "was killed"})
    sink.samples([{"step": 3, "stage": "grpo", "kind": "rollout", "prompt": "p"}])
    sink.rewind(2)  # the checkpoint of step 2
    sink({"step": 3, "event": "rollback", "group": "main", "recover_s": 2.5, "steps_replayed": 1})
    sink({"step": 3, "stage": "grpo", "stage_step": 3})
    sink.close()
    rows = [r for _, r in read_records(tmp_path / "metrics.jsonl")]
    assert [r.get("step") for r in rows if "event" not in r] == [1, 2, 3]
    assert [r["event"] for r in rows if "event" in r] == ["fault", "rollback"]
    assert (tmp_path / "samples.jsonl").read_text() == ""  # step 3's sample is replayed
    sink = JsonlSink(tmp_path / "metrics.jsonl", resume_step=0)  # a --resume keeps them too
    sink.close()
    rows = [r for _, r in read_records(tmp_path / "metrics.jsonl")]
    assert [r["event"] for r in rows] == ["fault", "rollback"]
    said = _fault_lines(rows)
    assert said == [
        "  supervision: 1 fault(s), 0 group restart(s), 1 rollback(s) (1 step(s) replayed), "
        "slowest recovery 2.5 s"
    ]
    assert event_line(rows[0]) == "group main rank 1 died at step 3: was killed"
    assert scalars(rows[1]) == {}  # no curve in TensorBoard
