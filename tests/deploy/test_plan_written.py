"""``hybridflow plan --write`` keeps the user's file: only the ``placement:`` block changes,
every comment survives, every other byte is as it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.commands.plan import PlanOptions, run_plan
from deploy.experiment import load, placement
from deploy.launchers.sbatch import overfull
from deploy.plan.written import SpliceError, carried_settings, replace_placement

ROOT = Path(__file__).resolve().parents[2]

BEFORE = """\
# a PPO run, with notes
name: ppo   # the run's name
models:
  base: {init: tiny, seed: 0}
roles:
  actor: {model: base, dp_mode: replicate}   # trains
  reference: {model: base}
"""
PLACEMENT = """\
placement:    # hand-placed for 2 cards
  # the actor and its reference share a card
  main:
    roles: [actor, reference]   # colocated
    nproc: 1
    device: cuda

# (indented notes below are still the block's)
  value: {roles: [reward], nproc: 1, device: cuda}
"""
AFTER = """\

# the stages: SFT first
stages:
  - {kind: rl, steps: 1, data: "builtin:arithmetic?n=64&split=train",
     algorithm: {name: grpo, n: 2}}   # one step
reward_note: "placement: is not a key here # nor a comment"
"""
BLOCK = {
    "actor_reference": {"roles": ["actor", "reference"], "nproc": 4, "tp": 2},
    "reward": {"roles": ["reward"], "nproc": 2},
}


def comments(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("#")]


def test_only_the_placement_block_changes_and_every_comment_survives() -> None:
    text = BEFORE + PLACEMENT + AFTER
    written = replace_placement(text, yaml.safe_load(text), BLOCK)
    assert written.startswith(BEFORE) and written.endswith(AFTER)
    middle = written[len(BEFORE) : len(written) - len(AFTER)]
    assert middle == (
        "placement: # hand-placed for 2 cards\n"
        "  # the actor and its reference share a card\n"
        "# (indented notes below are still the block's)\n"
        "  actor_reference: {roles: [actor, reference], nproc: 4, tp: 2}\n"
        "  reward: {roles: [reward], nproc: 2}\n"
    )
    assert comments(written) == comments(text)
    assert yaml.safe_load(written) == {**yaml.safe_load(text), "placement": BLOCK}


def test_a_file_without_placement_gets_one_before_its_stages() -> None:
    text = BEFORE + AFTER
    written = replace_placement(text, yaml.safe_load(text), BLOCK)
    added = (
        "placement:\n"
        "  actor_reference: {roles: [actor, reference], nproc: 4, tp: 2}\n"
        "  reward: {roles: [reward], nproc: 2}\n"
    )
    assert written == BEFORE + "\n" + added + AFTER.removeprefix("\n")


def test_windows_line_ends_stay() -> None:
    text = (BEFORE + PLACEMENT + AFTER).replace("\n", "\r\n")
    written = replace_placement(text, yaml.safe_load(text), BLOCK)
    assert "\r\n" in written and "\n" not in written.replace("\r\n", "")
    assert written.endswith(AFTER.replace("\n", "\r\n"))


def test_a_file_it_cannot_splice_is_refused_not_written_wrong() -> None:
    text = '{name: x, roles: {actor: {model: m}}, stages: [{kind: rl, data: "d"}]}\n'
    with pytest.raises(SpliceError):
        replace_placement(text, yaml.safe_load(text), BLOCK)


def test_settings_every_group_shares_are_carried() -> None:
    assert carried_settings(yaml.safe_load(PLACEMENT)["placement"]) == {"device": "cuda"}
    mixed = {"a": {"roles": ["x"], "device": "cuda"}, "b": {"roles": ["y"]}}
    assert carried_settings(mixed) == {}
    assert carried_settings(None) == {}


def example_lines(written: str, source: str) -> tuple[list[str], list[str], list[str]]:
    """(source's lines before its placement block, the block as written, after the block)."""
    lines, out = source.splitlines(), written.splitlines()
    start = lines.index("placement:")
    end = start + 1
    while lines[end].startswith(" "):
        end += 1
    tail = len(lines) - end
    return out[:start], out[start : len(out) - tail], out[len(out) - tail :]


@pytest.mark.parametrize("name", ["ppo.yaml", "quickstart.yaml"])
def test_write_keeps_the_examples_as_written(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = (ROOT / "examples" / name).read_text()
    dims_from = "llama2-7b" if name == "ppo.yaml" else None  # ppo's reward model is not made here
    out = tmp_path / "planned.yaml"
    opts = PlanOptions(
        ROOT / "examples" / name, 8, 8, None, "a100", dims_from, None, 64, None, 3, True, out
    )
    assert run_plan(opts) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    written = out.read_text()
    assert comments(written) == comments(source)
    head, block, tail = example_lines(written, source)
    lines = source.splitlines()
    assert head == lines[: len(head)] and tail == lines[len(lines) - len(tail) :]
    assert block[0] == "placement:" and len(block) == 1 + len(result["placement"])
    assert yaml.safe_load(written)["placement"] == result["placement"]


def test_a_group_bigger_than_a_node_is_written_over_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--gpus-per-node 2`` on 8 devices: a group of more than 2 ranks is written with the
    nodes it spans, and what is written is a placement ``hybridflow slurm`` lays out."""
    out = tmp_path / "planned.yaml"
    source = ROOT / "examples" / "quickstart.yaml"
    opts = PlanOptions(source, 8, 2, None, "a100", "llama2-7b", None, 64, None, 3, True, out)
    assert run_plan(opts) == 0
    capsys.readouterr()
    exp = load(out)
    groups = placement(exp)
    big = [g for g in groups.values() if g.nproc > 2]
    assert big, groups  # the best plan uses more than one node for a group
    for group in groups.values():
        assert group.nodes == (1 if group.nproc <= 2 else group.nproc // 2)
        assert group.nproc // group.nodes <= 2 and (group.nproc // group.nodes) % group.tp == 0
    assert overfull(groups, sum(g.nodes for g in groups.values()) + 1, 2, controller=False) is None


def test_a_gpu_plan_is_written_for_gpus_under_the_files_own_group_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan for A100s writes ``device: cuda`` (a file without it would run on CPU) and keeps
    the file's group name (``main``: its keys and ``--set placement.main...`` still hold); a
    device the file's groups say is kept; a CPU profile writes none."""
    source = ROOT / "examples" / "quickstart.yaml"
    out = tmp_path / "planned.yaml"
    opts = PlanOptions(source, 8, 2, None, "a100", "llama2-7b", None, 64, None, 3, True, out)
    assert run_plan(opts) == 0
    capsys.readouterr()
    written = yaml.safe_load(out.read_text())["placement"]
    assert list(written) == ["main"] and written["main"]["device"] == "cuda", written
    assert placement(load(out))["main"].device == "cuda"
    on_cpu = tmp_path / "cpu.yaml"
    group = "main: {roles: [actor, reward], nproc: 2}"
    on_cpu.write_text(source.read_text().replace(group, group[:-1] + ", device: cpu}"))
    opts = PlanOptions(on_cpu, 8, 2, None, "a100", "llama2-7b", None, 64, None, 3, True, out)
    assert run_plan(opts) == 0
    capsys.readouterr()
    assert yaml.safe_load(out.read_text())["placement"]["main"]["device"] == "cpu"
    opts = PlanOptions(source, 2, 2, None, "vm-2core", None, None, 64, None, 3, True, out)
    assert run_plan(opts) == 0
    capsys.readouterr()
    assert all("device" not in g for g in yaml.safe_load(out.read_text())["placement"].values())
