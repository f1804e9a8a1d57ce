"""The first hour of a new user: what goes wrong first, and that each says what to do.

A ``--resume`` that cannot start changes nothing in the run folder and says how to go on; a
misspelt field, a missing data file or a misspelt rule-reward key is named as the user wrote it,
before any process starts; a model folder left by another source does not beat the config; Ctrl-C
prints the command that continues the run (or says no checkpoint exists yet); every option of
every command has a help line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.data import DatasetError
from deploy.cli import build_parser
from deploy.commands.run import _prepare
from deploy.experiment import ExperimentError, check, parse, read_data
from roles.modeling.models import init_model
from tests.deploy.test_multicluster import rank_processes
from tests.waiting import wait_for

CLI = [sys.executable, "-m", "deploy.cli"]
RULE = "roles.rules:arithmetic_reward"


def tiny(**trainer: Any) -> dict[str, Any]:
    """A tiny SFT + GRPO experiment (one rank, fp32, no TensorBoard, no live view)."""
    return {
        "name": "first-hour",
        "models": {"base": {"init": "tiny", "seed": 0}},
        "roles": {"actor": {"model": "base", "dtype": "fp32"}, "reward": {"function": RULE}},
        "stages": [
            {
                "kind": "sft",
                "steps": 4,
                "batch_size": 4,
                "data": "builtin:arithmetic?n=64&split=sft",
            },
            {
                "kind": "rl",
                "steps": 2,
                "data": "builtin:arithmetic?n=64&split=train",
                "algorithm": {"name": "grpo", "prompts_per_step": 2, "n": 2, "max_new_tokens": 4},
            },
        ],
        "trainer": {"export": False, **trainer},
        "logging": {"tensorboard": False, "live": False},
    }


def write(raw: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def hybridflow(*argv: str, limit: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=limit)


def printed_command(text: str, after: str) -> list[str]:
    """The ``hybridflow ...`` command printed after ``after`` (the rest of that line), as argv."""
    line = next(line for line in text.splitlines() if after in line)
    words = shlex.split(line.split(after, 1)[1])
    assert words[0] == "hybridflow", line
    return words[1:]


def listing(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its content's hash: a snapshot to compare."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else ""
        for p in sorted(folder.rglob("*"))
    }


# -- 1. a --resume that cannot start changes nothing --------------------------------------------


def left_before_a_checkpoint(run_dir: Path) -> Path:
    """What a run interrupted before its first checkpoint leaves: its config, two metric
    records, a checkpoint whose write was cut short."""
    (run_dir / "checkpoints" / "step_000002.partial").mkdir(parents=True)
    write(tiny(), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    return run_dir


@pytest.mark.timeout(60)
def test_a_resume_without_a_checkpoint_changes_nothing_and_says_how_to_start_over(
    tmp_path: Path,
) -> None:
    run_dir = left_before_a_checkpoint(tmp_path / "run")
    before = listing(run_dir)
    done = hybridflow("run", "--resume", "--run-dir", str(run_dir))
    assert done.returncode == 2, done.stderr
    assert listing(run_dir) == before  # metrics.jsonl still holds its two records
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no checkpoint yet" in done.stderr and "Error" not in done.stderr
    start_over = printed_command(done.stderr, "start the run over with: ")
    assert start_over == ["run", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_damaged_metrics_line_is_found_before_anything_is_written_and_the_advice_works(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    experiment = write(tiny(), tmp_path / "tiny.yaml")
    stopped = hybridflow("run", str(experiment), "--run-dir", str(run_dir), "--stop-after", "2")
    assert stopped.returncode == 0, stopped.stderr
    metrics = run_dir / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text("not json\n" + good)  # damaged some other way than a torn last write
    before = listing(run_dir)
    done = hybridflow("run", "--resume", "--run-dir", str(run_dir))
    assert done.returncode == 2, done.stderr
    assert listing(run_dir) == before
    assert f"{metrics}:1: not a JSON record" in done.stderr and "Error" not in done.stderr
    assert "fix or delete that line" in done.stderr
    again = printed_command(done.stderr, "then resume again with: ")
    assert again == ["run", "--resume", "--run-dir", str(run_dir)]
    metrics.write_text(good)  # the line deleted, as advised: the advised command now runs
    resumed = hybridflow(*again, limit=200)
    assert resumed.returncode == 0, resumed.stderr
    assert metrics.read_text().startswith(good)  # cut back to the checkpoint, then continued
    assert max(json_steps(metrics.read_text())) == 6  # 4 SFT steps and 2 RL steps


def json_steps(text: str) -> list[int]:
    return [json.loads(line)["step"] for line in text.splitlines()]


# -- 2. errors name the YAML the user wrote -----------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "stages.1.algorithm.prompts_per_stp=4",
            "stages.1.algorithm.prompts_per_stp: unknown field (did you mean 'prompts_per_step'?)",
        ),
        ("stages.1.algorithm.kl.coeff=0", "stages.1.algorithm.kl.coeff: unknown field (did you"),
        ("models.base.sed=1", "models.base.sed: unknown field (did you mean 'seed'?)"),
        ("trainer.save_evry=1", "trainer.save_evry: unknown field (did you mean 'save_every'?)"),
        ("stages.0.optim={lrr: 0.1}", "stages.0.optim.lrr: unknown field (did you mean 'lr'?)"),
    ],
)
def test_a_misspelt_field_is_named_as_written_with_the_nearest_field(
    override: str, message: str
) -> None:
    with pytest.raises(ExperimentError) as info:
        check(parse(tiny(), [override]))
    assert message in str(info.value)
    assert ".rl." not in str(info.value)  # the stage's kind tag is no part of the file


@pytest.mark.timeout(60)
def test_a_misspelt_role_setting_is_named_under_the_role(tmp_path: Path) -> None:
    experiment = write(tiny(), tmp_path / "tiny.yaml")
    run_dir = tmp_path / "run"
    sets = ["--set", "roles.actor.micro_batch_sze=2"]
    done = hybridflow("run", str(experiment), "--run-dir", str(run_dir), *sets)
    assert done.returncode == 2
    assert "roles.actor.micro_batch_sze: unknown field (did you mean 'micro_batch_size'?)" in (
        done.stderr
    )
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "field", ["stages.0.data", "stages.0.val_data", "stages.1.data", "stages.1.ptx_data"]
)
def test_a_missing_data_file_is_named_by_its_field(field: str) -> None:
    with pytest.raises(DatasetError) as info:
        read_data(parse(tiny(), [f"{field}=nowhere/rows.jsonl"]))
    assert str(info.value).startswith(f"{field}: no such file 'nowhere/rows.jsonl'")


def test_a_missing_validation_file_is_named_by_its_field(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as info:
        read_data(parse(tiny(val_data=str(tmp_path / "val.jsonl"))))
    assert str(info.value) == f"trainer.val_data: no such file '{tmp_path / 'val.jsonl'}'"


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"functon": RULE}, "roles.reward.functon: unknown setting (did you mean 'function'?)"),
        (
            {"function": RULE, "functon": RULE},
            "roles.reward.functon: not a setting of a rule reward (did you mean 'function'?)",
        ),
        (
            {"function": RULE, "tokenzier": "models/tiny"},
            "roles.reward.tokenzier: not a setting of a rule reward (did you mean 'tokenizer'?)",
        ),
        ({"function": RULE, "model": "base"}, "roles.reward.model: not a setting of a rule"),
    ],
)
def test_a_rule_rewards_keys_are_checked_before_anything_starts(
    reward: dict[str, str], message: str
) -> None:
    raw = tiny()
    raw["roles"]["reward"] = reward
    with pytest.raises(ExperimentError) as info:
        check(parse(raw))
    assert message in str(info.value)


@pytest.mark.timeout(60)
def test_a_misspelt_rule_reward_key_fails_at_once_with_nothing_started(tmp_path: Path) -> None:
    raw = tiny()
    raw["roles"]["reward"]["functon"] = RULE
    run_dir = tmp_path / "run"
    start = time.monotonic()
    done = hybridflow("run", str(write(raw, tmp_path / "tiny.yaml")), "--run-dir", str(run_dir))
    assert done.returncode == 2, done.stderr
    assert "roles.reward.functon" in done.stderr and "did you mean 'function'?" in done.stderr
    assert "TypeError" not in done.stderr
    assert not run_dir.exists()  # no model made, no rank started
    assert time.monotonic() - start < 30


def actor_model(raw: dict[str, Any], run_dir: Path, *overrides: str) -> Path:
    """The model folder the actor's ranks would load, once the run dir is prepared."""
    _, groups = _prepare(parse(raw, list(overrides)), run_dir)
    return Path(groups[0].roles["actor"].config["model"])


def weights(model: Path) -> str:
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.timeout(60)
def test_a_model_folder_made_from_another_source_is_rebuilt(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"  # as a run killed before its first checkpoint leaves it
    made = weights(actor_model(tiny(), run_dir))
    other = init_model(tmp_path / "other", "tiny", seed=7)
    assert actor_model(tiny(), run_dir, f"models.base={{path: {other}}}") == other.resolve()
    assert weights(actor_model(tiny(), run_dir, "models.base.seed=1")) != made
    model = actor_model(tiny(), run_dir)  # seed 0 again: the same model, made again
    assert weights(model) == made and model == (run_dir / "models" / "base").resolve()
    made_at = (model / "model.safetensors").stat().st_ino
    assert actor_model(tiny(), run_dir) == model  # the same source: kept, not made again
    assert (model / "model.safetensors").stat().st_ino == made_at


@pytest.mark.timeout(60)
def test_a_model_folder_the_checkpoints_were_trained_from_is_not_replaced(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    made = weights(actor_model(tiny(), run_dir))
    (run_dir / "checkpoints" / "step_000004").mkdir(parents=True)
    with pytest.raises(ExperimentError) as info:
        actor_model(tiny(), run_dir, "models.base.seed=1")
    assert str(info.value).startswith("models.base: ")
    assert "resume with the run's saved config, or start a new --run-dir" in str(info.value)
    assert weights(actor_model(tiny(), run_dir)) == made


# -- 3. Ctrl-C says how to go on ----------------------------------------------------------------


def endless(**trainer: Any) -> dict[str, Any]:
    """An SFT stage too long to end within a test, so only Ctrl-C stops it."""
    raw = tiny(**trainer)
    raw["stages"] = [{**raw["stages"][0], "steps": 1_000_000}]
    return raw


def seen(run_dir: Path, event: str) -> bool:
    """Whether the run has written a checkpoint (``event`` "checkpoint") or a metrics record."""
    if event == "checkpoint":
        return any((run_dir / "checkpoints").glob("step_??????"))
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and bool(metrics.read_text().strip())


def interrupted(
    raw: dict[str, Any],
    tmp_path: Path,
    event: str,
    sig: signal.Signals = signal.SIGINT,
    while_running: Callable[[Path], None] | None = None,
) -> tuple[Path, str]:
    """Start ``hybridflow run``, wait for ``event`` (a checkpoint, or a metrics record), press
    Ctrl-C (``sig`` to the command's process group, as a terminal does); its exit code must be
    130 and every rank gone. Returns the run dir and what it printed."""
    run_dir = tmp_path / "run"
    experiment = write(raw, tmp_path / "endless.yaml")
    argv = [*CLI, "run", str(experiment), "--run-dir", str(run_dir)]
    log = tmp_path / "output.txt"
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=sink, start_new_session=True)
    try:
        wait_for(lambda: seen(run_dir, event), 120, f"a {event}", proc=proc, detail=log.read_text)
        if while_running is not None:
            while_running(run_dir)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert proc.returncode == 130, out
    wait_for(lambda: not rank_processes(run_dir), 20, "every rank gone")
    return run_dir, out


def which_is_which(run_dir: Path) -> None:
    """While the run trains: ``processes.json`` lists the controller and every rank, each rank's
    title in ``ps`` names its group, rank and roles and its log's first line its pid, and
    ``hybridflow status`` sees them all running."""
    found = json.loads((run_dir / "processes.json").read_text())
    ranks = found["ranks"]
    assert ranks and {r["group"] for r in ranks} == {"main"}
    assert "actor" in ranks[0]["roles"]
    for r in ranks:
        title = f"hybridflow main:{r['rank']} ({','.join(r['roles'])})"
        shown = Path(f"/proc/{r['pid']}/cmdline").read_bytes()
        assert shown.startswith(f"{title} python -m roles.runtime".encode()), shown
        # the short name stays one word: SLURM's process tracking reads /proc/PID/stat with
        # "%d %s %*s %d", and a space there hid a rank from scancel
        assert Path(f"/proc/{r['pid']}/stat").read_text().split()[1] == f"(hf-main:{r['rank']})"
        first = Path(r["log"]).read_text().split("\n", 2)
        assert any(line.startswith(f"{title}: pid {r['pid']}") for line in first), first
    stat = Path(f"/proc/{found['controller']['pid']}/stat").read_text()
    assert stat.split()[1] == "(hf-controller)"
    controller = Path(f"/proc/{found['controller']['pid']}/cmdline").read_bytes()
    assert controller.startswith(f"hybridflow controller {run_dir}".encode())
    status = json.loads(hybridflow("status", str(run_dir), "--json", limit=60).stdout)
    assert [s["alive"] for s in status] == [True] * (1 + len(ranks))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_first_ctrl_c_finishes_the_step_writes_a_checkpoint_and_the_resume_works(
    tmp_path: Path,
) -> None:
    """No save_every: before, Ctrl-C here lost everything. Now the step in flight finishes, a
    checkpoint of it is written, and the printed command resumes from it."""
    run_dir, out = interrupted(endless(), tmp_path, "record", while_running=which_is_which)
    assert "Ctrl-C: finishing step" in out and "checkpoint written" in out, out
    gone = json.loads(hybridflow("status", str(run_dir), "--json", limit=60).stdout)
    assert [p["alive"] for p in gone] == [False] * len(gone)
    step = int(out.split("continue from step ", 1)[1].split()[0])
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in metrics if line.strip()]
    assert step >= 1 and step == max(logged)  # the checkpoint holds every step it logged
    assert (run_dir / "checkpoints" / f"step_{step:06d}").is_dir()
    resume = printed_command(out, f"continue from step {step} with: ")
    assert resume == ["run", "--resume", "--run-dir", str(run_dir)]
    done = hybridflow(*resume, "--stop-after", str(step + 1), limit=200)
    assert done.returncode == 0, done.stderr
    assert f"stopped after step {step + 1}" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_at_once_before_any_checkpoint_says_how_to_start_over(tmp_path: Path) -> None:
    """SIGTERM (as a second Ctrl-C: ``tests/deploy/test_terminal.py``) stops at once: with no
    checkpoint yet, the run says so and how to start over, and that command works."""
    run_dir, out = interrupted(endless(), tmp_path, "record", sig=signal.SIGTERM)
    assert "interrupted; every process was stopped" in out
    assert "no checkpoint exists yet" in out and "--resume" not in out
    start_over = printed_command(out, "start over with: ")
    assert start_over == ["run", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]
    done = hybridflow(*start_over, "--set", "stages.0.steps=2", limit=200)
    assert done.returncode == 0, done.stderr
    assert json_steps((run_dir / "metrics.jsonl").read_text()) == [1, 2]


# -- 4. every option has a help line ------------------------------------------------------------


def parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, Any]]:
    """``(command, parser)`` for ``parser`` and every subcommand under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from parsers(child, f"{name} {sub}")


COMMANDS = sorted(
    {name.split()[1] for name, _ in parsers(build_parser(), "hybridflow") if " " in name}
)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_every_command_has_a_plain_help_line(command: str) -> None:
    top = build_parser()
    found = [(n, p) for n, p in parsers(top, "hybridflow") if n.split()[1:2] == [command]]
    assert found
    for name, parser in found:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
        assert "``" not in parser.format_help(), name


def test_the_top_level_help_is_plain_and_the_demo_says_what_it_is() -> None:
    top = build_parser()
    assert "``" not in top.format_help()
    demo = dict(parsers(top, "hybridflow"))["hybridflow demo"]
    for text in (top.format_help(), demo.format_help()):
        assert "linear-regression demo" in " ".join(text.split())
    assert "not the main job" in " ".join(demo.format_help().split())
