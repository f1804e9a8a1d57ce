"""``hybridflow model check ORG/NAME``: a Hub id is not a folder here, and hybridflow downloads
nothing; the message says how to bring the folder instead of offering a random tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.commands.model import is_hub_id


def model_check(target: str) -> int:
    args = build_parser().parse_args(["model", "check", target])
    code: int = args.fn(args)
    return code


def test_a_hub_id_gets_how_to_bring_a_local_folder(capsys: pytest.CaptureFixture[str]) -> None:
    assert model_check("Qwen/Qwen2.5-0.5B") == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face Hub id" in err and "downloads nothing" in err
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir models/Qwen2.5-0.5B" in err
    assert "docs/models.md" in err
    assert "model init" not in err and "--size tiny" not in err


def test_paths_are_not_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_hub_id(Path("HuggingFaceTB/SmolLM2-135M"))
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert not is_hub_id(Path("models/mine"))  # a folder that exists is a folder
    for path in ("/abs/name", "a/b/c", "name", "../x"):
        assert not is_hub_id(Path(path)), path
