"""Issue 21, 2c: a data row without a column the reward reads fails before the run starts, with
the file and the row named — not scored 0 silently because the trainer filled it with None."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from controller.data import DatasetError
from deploy.cli import build_parser
from deploy.experiment import ExperimentError, parse, read_data, scored_columns
from roles.base import RoleContext
from roles.reward import RewardError, RuleReward
from roles.rules import arithmetic_reward, needed_columns, needs
from transport.batch import TensorBatch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROWS = '{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n{"prompt": "3+3=", "answer": 6}\n'


def quickstart(*overrides: str) -> Any:
    raw = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return parse(raw, list(overrides))


def test_rule_rewards_declare_the_columns_they_read() -> None:
    assert needed_columns(arithmetic_reward) == ("answer",)

    @needs("label", "weight")
    def custom(prompt: str, response: str, metadata: dict[str, Any]) -> float:
        return 0.0

    assert needed_columns(custom) == ("label", "weight")
    assert needed_columns(lambda p, r, m: 0.0) == ()


def test_rl_data_without_the_rewards_column_fails_at_load_naming_file_and_row(
    tmp_path: Path,
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(ROWS)
    exp = quickstart(f"stages.1.data={data}", "stages.1.algorithm.prompts_per_step=1")
    with pytest.raises(DatasetError) as info:
        read_data(exp)
    message = str(info.value)
    assert f"{data}:2" in message
    assert "'answer' is missing" in message and "roles.rules:arithmetic_reward" in message
    # a null answer is no better than a missing one
    data.write_text(ROWS.replace('{"prompt": "2+2="}', '{"prompt": "2+2=", "answer": null}'))
    with pytest.raises(DatasetError, match=f"{data}:2: column 'answer' is null"):
        read_data(exp)
    # held-out prompts are scored by the same reward: checked the same way
    exp = quickstart(f"trainer.val_data={data}")
    with pytest.raises(DatasetError, match=f"{data}:2"):
        read_data(exp)


def test_a_reward_that_declares_nothing_does_not_require_columns(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(ROWS)
    exp = quickstart(
        f"stages.1.data={data}",
        "stages.1.algorithm.prompts_per_step=1",
        "roles.reward.function=roles.rules:length_cost",
    )
    assert [c.name for c in scored_columns(exp) if c.required] == ["prompt"]
    assert len(read_data(exp)[str(data)]) == 3
    bad = quickstart("roles.reward.function=roles.rules:nothing")
    with pytest.raises(ExperimentError, match=r"roles\.reward\.function"):
        scored_columns(bad)


def test_run_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(ROWS)
    run_dir = tmp_path / "run"
    overrides = ["--set", f"stages.1.data={data}", "--set", "stages.1.algorithm.prompts_per_step=1"]
    argv = ["run", str(EXAMPLES / "quickstart.yaml"), "--run-dir", str(run_dir), *overrides]
    args = build_parser().parse_args(argv)
    assert args.fn(args) == 2
    assert f"{data}:2: column 'answer' is missing" in capsys.readouterr().err
    assert not run_dir.exists()


def test_the_reward_role_refuses_a_row_without_a_declared_column() -> None:
    # the second line of defence, for controllers that read their data without the loader
    role = RuleReward(cast(RoleContext, None), "roles.rules:arithmetic_reward")
    batch = TensorBatch.from_dict(
        non_tensors={"prompt": ["1+1=", "2+2="], "response": ["2", "4"], "answer": [2, None]}
    )
    with pytest.raises(RewardError, match=r"needs column\(s\) \['answer'\] and row 1"):
        role.compute_reward(batch)
