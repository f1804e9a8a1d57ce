"""Issue 21, 2d: a missing model path is reported by its config key and writes nothing; a run dir
left by an earlier failed try (dangling link) does not stop a corrected rerun; a check that fails
after the run dir was made removes it again."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.experiment import load
from deploy.run_cli import _prepare
from roles.modeling.models import init_model

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def run(run_dir: Path, *overrides: str) -> int:
    sets = [a for o in overrides for a in ("--set", o)]
    args = build_parser().parse_args(["run", str(QUICKSTART), "--run-dir", str(run_dir), *sets])
    code: int = args.fn(args)
    return code


def test_a_missing_model_path_names_the_config_key_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert run(run_dir, f"models.base={{path: {tmp_path / 'nowhere'}}}") == 2
    err = capsys.readouterr().err
    assert "models.base.path" in err and "nowhere" in err
    assert "models/base" not in err
    assert not run_dir.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(run_dir, f"models.base={{path: {empty}}}") == 2
    assert "models.base.path" in capsys.readouterr().err
    assert not run_dir.exists()


def test_a_rerun_with_the_path_fixed_replaces_a_dangling_link(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    link = run_dir / "models" / "base"
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "nowhere", target_is_directory=True)  # what a failed try left
    model = init_model(tmp_path / "model", "tiny", seed=0)
    exp = load(QUICKSTART, [f"models.base={{path: {model}}}"])
    _, groups = _prepare(exp, run_dir)
    assert link.is_symlink() and link.resolve() == model.resolve()
    assert groups[0].roles["actor"].config["model"] == str(model.resolve())
    _prepare(exp, run_dir)  # and again: the link is kept
    assert link.resolve() == model.resolve()


def test_a_check_after_the_models_are_made_leaves_no_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    model = init_model(tmp_path / "model", "tiny", seed=0)
    # tp is checked against the model, so only once the run dir's models exist
    sets = [f"models.base={{path: {model}}}", "placement.main.tp=3", "placement.main.nproc=3"]
    assert run(run_dir, *sets) == 2
    assert "roles.actor" in capsys.readouterr().err
    assert not run_dir.exists()
    assert model.is_dir()  # the linked model itself is untouched
