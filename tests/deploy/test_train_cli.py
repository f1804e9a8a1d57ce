"""``hybridflow sft`` and ``hybridflow rm`` end to end on the tiny model, and their bad inputs.

SFT must lower the held-out loss; the reward model must rank chosen over rejected on >= 80% of the
held-out pairs of the built-in preference task. Bad inputs fail before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.cli import build_parser
from roles.modeling.models import init_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def job(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.fn(args)
    return code


def summary(run_dir: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sft_on_two_ranks_lowers_held_out_loss_and_exports(tiny: Path, tmp_path: Path) -> None:
    out, run_dir = tmp_path / "sft", tmp_path / "run"
    argv = ["sft", "--model", str(tiny), "--out", str(out), "--run-dir", str(run_dir)]
    assert job([*argv, "--steps", "60", "--eval-every", "30", "--nproc", "2"]) == 0
    result = summary(run_dir)
    assert result["after"]["loss"] < 0.5 * result["before"]["loss"]
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(61))
    assert records[30]["val/loss"] < records[0]["val/loss"]
    # the exported folder is a model the next job starts from
    assert (
        job(
            [
                "sft",
                "--model",
                str(out),
                "--out",
                str(tmp_path / "again"),
                "--steps",
                "1",
                "--run-dir",
                str(tmp_path / "run2"),
                "--val",
                "builtin:arithmetic?n=8&split=test",
            ]
        )
        == 0
    )
    assert summary(tmp_path / "run2")["before"]["loss"] == pytest.approx(
        result["after"]["loss"], abs=0.05
    )


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reward_model_on_two_ranks_ranks_chosen_over_rejected_on_80_percent_of_held_out_pairs(
    tiny: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = ["rm", "--model", str(tiny), "--out", str(tmp_path / "rm"), "--run-dir", str(run_dir)]
    assert job([*argv, "--steps", "150", "--eval-every", "150", "--nproc", "2"]) == 0
    result = summary(run_dir)
    assert result["before"]["accuracy"] < 0.65
    assert result["after"]["accuracy"] >= 0.80, result["after"]
    assert {"accuracy/operand", "accuracy/format"} <= set(result["after"])


def bad(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    run_dir = tmp_path / "never"
    assert job([*argv, "--out", str(tmp_path / "out"), "--run-dir", str(run_dir)]) == 2
    assert not run_dir.exists()  # nothing started
    return capsys.readouterr().err


def test_a_bad_row_is_reported_by_file_and_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": "1+1=", "response": "2"}] * 2 + [{"prompt": "2+2="}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = bad(tmp_path, capsys, "sft", "--model", str(tiny), "--data", str(data))
    assert f"{data}:3: column 'response' is missing" in err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--model", "/nonexistent/model"], "no model directory at /nonexistent/model"),
        (["--tp", "3", "--nproc", "3"], "tp=3 does not divide the model's num_attention_heads=4"),
        (["--tp", "2", "--nproc", "3"], "tp=2 x pp=1 does not divide nproc=3"),
        (["--micro-batch-size", "0"], "micro_batch_size"),
        (["--data", "data.csv"], "data.csv"),
    ],
)
def test_bad_settings_fail_before_any_process_starts(
    tiny: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    expected: str,
) -> None:
    err = bad(tmp_path, capsys, "rm", "--model", str(tiny), *extra)
    assert expected in err


def test_model_commands_are_wired_into_hybridflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert job(["model", "init", str(tmp_path / "m"), "--size", "tiny"]) == 0
    assert "1,066,112 parameters" in capsys.readouterr().out
    assert job(["model", "check", str(tmp_path / "missing")]) == 2
