"""Issue 21, 2d: a missing model path is reported by its config key and writes nothing; a run dir
left by an earlier failed try (dangling link) does not stop a corrected rerun; a check that fails
after the run dir was made removes it again."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.commands.run import _prepare
from deploy.experiment import load
from roles.modeling.models import init_model
from tests.deploy.test_run import EXAMPLES

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


def test_a_gguf_model_is_converted_once_per_machine_and_linked_into_each_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA run on SmolLM2 no longer copies the 517 MB base into its run folder: the first
    run converts it into the machine's cache, every run links to it, and the run folder's size
    (what ``summary.json`` reports) does not count it."""
    import roles.modeling.models as models
    from deploy.commands.run import folder_bytes
    from deploy.experiment import CACHE_ENV, prepare_models

    converted: list[Path] = []

    def fake_import(out: Path) -> Path:  # stands in for the 20 s conversion; what is tested is
        out.mkdir(parents=True)  # where it goes and how often it runs
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 4096)
        converted.append(out)
        return out

    monkeypatch.setattr(models, "import_gguf", fake_import)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    exp = load(EXAMPLES / "smollm2_lora_grpo.yaml")
    for run in ("a", "b"):
        prepare_models(exp, tmp_path / run)
        linked = tmp_path / run / "models" / "smollm2"
        assert linked.is_symlink()
        assert linked.resolve() == (tmp_path / "cache" / "models" / "gguf-smollm2").resolve()
        assert folder_bytes(tmp_path / run) < 1024  # the model is not the run's
    assert len(converted) == 1
