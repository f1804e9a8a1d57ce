"""Experiment configs: overrides, and every kind of bad config failing before a process starts
with the field named; the trainer's pure helpers (data order, seeds, checkpoint listing)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from controller.trainer import checkpoints, epoch_batches, request_seed
from deploy.cli import build_parser
from deploy.experiment import ExperimentError, check, load, parse, set_path
from deploy.groups import build_groups

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def base() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return raw


def error_of(raw: dict[str, Any], *overrides: str) -> str:
    with pytest.raises(ExperimentError) as info:
        check(parse(raw, list(overrides)))
    return str(info.value)


def test_every_example_parses_and_passes_the_checks() -> None:
    for path in sorted([*EXAMPLES.glob("*.yaml"), *EXAMPLES.glob("agents/*.yaml")]):
        exp = load(path)
        # these name folders made by a command first (`hybridflow rm`, `model import-gguf`,
        # the run of distill_teacher.yaml)
        if path.name not in ("ppo.yaml", "smollm2_grpo.yaml", "distill.yaml"):
            check(exp)
        # every example ends in RL but the one that makes a teacher for distill.yaml
        assert exp.stages[-1].kind == ("sft" if path.name == "distill_teacher.yaml" else "rl")


def test_quick_on_a_file_without_a_quick_section_is_refused() -> None:
    raw = base()
    del raw["quick"]
    with pytest.raises(ExperimentError, match="--quick applies the file's quick: section"):
        parse(raw, quick=True)
    parse(raw)  # without --quick: the full experiment, as written


def test_relative_paths_are_read_from_the_experiments_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """From any working directory: a path beside the file is the file's; one only in the
    working directory still works, with a line saying that fallback will go; one in neither is
    refused naming both folders (``cd /tmp && hybridflow run /path/examples/ppo.yaml``)."""
    folder, elsewhere = tmp_path / "exp", tmp_path / "cwd"
    folder.mkdir(), elsewhere.mkdir()
    row = '{"prompt": "1+1=", "response": "2", "answer": "2"}\n'
    (folder / "rows.jsonl").write_text(row * 64)
    (elsewhere / "old.jsonl").write_text(row * 64)
    raw = base()
    raw["stages"][0]["data"] = "rows.jsonl"
    raw["stages"][1]["data"] = "old.jsonl?prompt_key=prompt"
    (folder / "e.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(elsewhere)
    exp = load(folder / "e.yaml")
    assert exp.stages[0].data == str(folder / "rows.jsonl")
    assert exp.stages[1].data == f"{elsewhere / 'old.jsonl'}?prompt_key=prompt"
    assert "stages.1.data: 'old.jsonl' is read from the working directory" in caplog.text
    monkeypatch.chdir(tmp_path)
    ppo = load(EXAMPLES / "ppo.yaml")
    with pytest.raises(ExperimentError) as info:
        check(ppo)
    assert "roles.reward.model: 'models/tiny-rm'" in str(info.value)
    assert f"experiment's folder {EXAMPLES}" in str(info.value)
    assert f"working directory {tmp_path}" in str(info.value)


def test_quick_and_set_override_in_that_order() -> None:
    exp = parse(base(), ["stages.1.steps=3", "stages.1.algorithm.n=4"], quick=True)
    assert exp.stages[0].steps == 40 and exp.stages[1].steps == 3
    assert exp.stages[1].algorithm.n == 4  # type: ignore[union-attr]
    raw: dict[str, Any] = {"a": [{"b": 1}]}
    set_path(raw, "a.0.c.d", 2)
    assert raw == {"a": [{"b": 1, "c": {"d": 2}}]}
    with pytest.raises(ExperimentError, match=r"a\.3"):
        set_path(raw, "a.3.x", 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stages.1.algorithm.n=1"], "set n >= 2"),
        (["stages.1.algorithm.nn=1"], "stages.1.algorithm.nn: unknown field"),
        (["stages.0.kind=dpo"], "stages.0"),
        (["stages.1.steps=-1"], "stages.1.steps"),
        (["trainer.keep_last=0"], "trainer.keep_last"),
        (["stages.1.algorithm.name=ppo"], "needs role(s) ['critic']"),
        (["stages.1.algorithm.kl={coef: 0.1}"], "kl.coef > 0 needs a 'reference'"),
        (["placement.main.roles=[actor]"], "role 'reward' is in no group"),
        (["placement.other={roles: [reward]}"], "role 'reward' is in both"),
        (["roles.judge={model: base}", "placement.main.roles=[actor, reward, judge]"], "cls:"),
        (["roles.actor.model=nowhere"], "roles.actor.model: 'nowhere'"),
        (["stages.1.algorithm.max_staleness=-1"], "max_staleness=-1 must be >= 0"),
        (
            ["stages.1.algorithm.overlap=true", "stages.1.algorithm.max_staleness=2"],
            "overlap: true means max_staleness: 1, but max_staleness=2",
        ),
        (["stages.1.optim={lr: -1}"], "stages.1.optim"),
        (["stages.1.optim={schedule: cosine, total_steps: 5, warmup_steps: 9}"], "warmup_steps"),
        (["stages.1.algorithm.loss={clip_ratio_low: -1}"], "stages.1.algorithm.loss"),
        (["models.base={init: tiny, path: /x}"], "exactly one of path, init, gguf"),
        (["logging.wandb=true"], "logging.wandb: the wandb package is not installed"),
        (["placement.main.device=tpu"], "placement.main.device: Input should be 'cpu' or 'cuda'"),
    ],
)
def test_a_bad_config_names_the_field(overrides: list[str], message: str) -> None:
    assert message in error_of(base(), *overrides)


def test_epochs_become_steps_once_the_data_is_read() -> None:
    from deploy.experiment import read_data

    exp = parse(
        base(),
        [
            "stages.0.steps=0",
            "stages.0.epochs=2",
            "stages.0.batch_size=30",
            "stages.0.optim.warmup_steps=1",
            "stages.0.data=builtin:arithmetic?n=100&split=sft",
        ],
    )
    read_data(exp)
    assert exp.stages[0].steps == 6  # 2 epochs x 3 full batches of 30 in 100 rows
    check(exp)
    assert "steps or epochs" in error_of(base(), "stages.0.epochs=2")


def test_role_settings_are_checked_with_the_roles_config_classes(tmp_path: Path) -> None:
    from deploy.experiment import prepare_models

    exp = parse(base(), ["roles.actor.dtype=fp16"])
    check(exp)
    prepare_models(exp, tmp_path)
    with pytest.raises(ExperimentError, match=r"roles\.actor\.dtype: "):
        build_groups(exp, tmp_path)
    exp = parse(base(), ["roles.reward.function=roles.rules:nothing"])
    with pytest.raises(ExperimentError, match=r"roles\.reward"):
        build_groups(exp, tmp_path)
    exp = parse(base(), ["placement.main.tp=3", "placement.main.nproc=3"])
    with pytest.raises(ExperimentError, match=r"roles\.actor"):
        build_groups(exp, tmp_path)


def test_a_groups_device_is_placement_and_reaches_its_group_spec(tmp_path: Path) -> None:
    from deploy.experiment import prepare_models

    exp = parse(base(), ["placement.main={roles: [actor, reward], nproc: 2, device: cpu}"])
    check(exp)
    prepare_models(exp, tmp_path)
    assert [(g.name, g.nproc, g.device) for g in build_groups(exp, tmp_path)] == [
        ("main", 2, "cpu")
    ]
    assert [g.device for g in build_groups(parse(base()), tmp_path)] == ["cpu"]  # the default
    # whether a machine has CUDA is checked where the ranks start, not in the config
    on_gpus = build_groups(parse(base(), ["placement.main.device=cuda"]), tmp_path)
    assert [g.device for g in on_gpus] == ["cuda"]


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.fn(args)
    return code


def test_bad_input_exits_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": 2}\n{"answer": 3}\n')
    run_dir = tmp_path / "run"
    argv = ["run", str(EXAMPLES / "quickstart.yaml"), "--run-dir", str(run_dir)]
    assert run_cli([*argv, "--set", f"stages.1.data={bad}"]) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    assert not run_dir.exists()
    assert run_cli([*argv, "--set", "stages.1.algorithm.n=1"]) == 2
    assert run_cli(["run", str(tmp_path / "missing.yaml")]) == 2
    assert run_cli(["run", "--resume", "--run-dir", str(tmp_path / "none")]) == 2
    assert not run_dir.exists()
    assert run_cli(["report", str(tmp_path)]) == 2
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    assert run_cli(argv) == 2  # a finished or interrupted run is not overwritten
    assert "--resume" in capsys.readouterr().err


def test_epoch_batches_cover_each_epoch_once_and_are_pure() -> None:
    picked = epoch_batches(10, 3, seed=1, start=0, count=6)  # 3 batches per epoch, 1 row unused
    first = [i for batch in picked[:3] for i in batch]
    second = [i for batch in picked[3:] for i in batch]
    assert len(set(first)) == 9 and len(set(second)) == 9 and first != second
    assert epoch_batches(10, 3, 1, 4, 2) == picked[4:6]
    with pytest.raises(ValueError, match="cannot fill"):
        epoch_batches(2, 3, 0, 0, 1)


def test_request_seeds_differ_by_step_and_index_and_are_stable() -> None:
    seeds = {request_seed(0, s, i) for s in range(10) for i in range(10)}
    assert len(seeds) == 100 and request_seed(3, 4, 5) == request_seed(3, 4, 5)
    assert all(0 <= s < 2**31 for s in seeds)


def test_checkpoints_ignore_partial_writes(tmp_path: Path) -> None:
    for name in ("step_000004", "step_000002", "step_000006.partial", "other"):
        (tmp_path / name).mkdir()
    assert [p.name for p in checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    assert checkpoints(tmp_path / "absent") == []


def test_prompt_template_formats_each_row(tmp_path: Path) -> None:
    from controller.trainer import Trainer, TrainerConfig

    cfg = TrainerConfig(prompt_template="user: {prompt} ({data_source})\n")
    roles = SimpleNamespace(actor=None, rollout=None)  # a trainer that never calls a role
    trainer = Trainer(cfg, [], roles, {}, {}, tmp_path, [])  # type: ignore[arg-type]
    row = {"prompt": "1+2=", "answer": "3", "data_source": "arithmetic"}
    assert trainer._templated(row) == {**row, "prompt": "user: 1+2= (arithmetic)\n"}
    plain = Trainer(TrainerConfig(), [], roles, {}, {}, tmp_path, [])  # type: ignore[arg-type]
    assert plain._templated(row) is row


def tool_use() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((EXAMPLES / "tool_use.yaml").read_text())
    return raw


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.agent=null"], "roles.env: an env role serves multi-turn rollouts"),
        (
            ["roles.reward.function=roles.rules:env_reward", "trainer.agent=null"],
            "roles.reward.function: roles.rules:env_reward scores the environment's reward",
        ),
        (["stages.1.algorithm.stream_chunks=2"], "stages.1.algorithm.stream_chunks: trajectories"),
        (["stages.1.algorithm.partial_rollout={chunk_tokens: 4}"], "partial_rollout: not supp"),
        (["trainer.agent.max_turns=0"], "trainer.agent.max_turns"),
        (["trainer.agent.serving=iteration"], "serving: 'iteration' runs in a rollout group"),
        (
            ["stages.1.algorithm.overlong={cache: 16}", "trainer.agent.max_total_tokens=16"],
            "stages.1.algorithm.overlong.cache=16: with trainer.agent",
        ),
    ],
)
def test_a_bad_agent_config_names_the_field(overrides: list[str], message: str) -> None:
    assert message in error_of(tool_use(), *overrides)


def test_an_agent_without_an_env_role_and_bad_env_settings_are_refused(tmp_path: Path) -> None:
    from deploy.experiment import prepare_models

    raw = tool_use()
    del raw["roles"]["env"], raw["placement"]["tools"]
    assert "trainer.agent: multi-turn rollouts need a role named 'env'" in error_of(raw)
    exp = parse(tool_use(), ["roles.env.format=yaml"])
    check(exp)
    prepare_models(exp, tmp_path)
    with pytest.raises(ExperimentError, match=r"roles\.env\.format"):
        build_groups(exp, tmp_path)
    exp = parse(tool_use(), ["roles.env.tools=[roles.tools.calculator:nothing]"])
    with pytest.raises(ExperimentError, match=r"roles\.env: .*nothing"):
        build_groups(exp, tmp_path)
    exp = parse(tool_use(), [])
    (groups,) = [g for g in build_groups(exp, tmp_path) if g.name == "tools"]
    assert groups.roles["env"].config["tokenizer"] == str((tmp_path / "models" / "base").resolve())
