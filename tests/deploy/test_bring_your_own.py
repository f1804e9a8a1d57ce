"""Bring your own data, reward and prompt format, without reading the source: a reward module
beside the experiment file is importable (by the controller and by the ranks), a verl-style
Parquet file is read through its own column names, and a file shared by an SFT and an RL stage is
checked for what each needs before anything runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from controller.data import DatasetError
from deploy.cli import build_parser
from deploy.experiment import load, parse, read_data, scored_columns

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

REWARD = '''
from roles.rules import needs


@needs("answer")
def exact(prompt, response, metadata):
    """1 when the response's first word is the answer."""
    words = response.split()
    return float(bool(words) and words[0] == str(metadata["answer"]))
'''


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's import path and PYTHONPATH as they were, after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))


def experiment(folder: Path, module: str, **trainer: Any) -> Path:
    """An RL experiment in ``folder``: a tiny model, ``module:exact`` as the reward, verl-style
    Parquet prompts (``question``, ``reward_model.ground_truth``)."""
    (folder / f"{module}.py").write_text(REWARD)
    rows = [
        {"question": f"{a}+{b}=", "reward_model": {"ground_truth": str(a + b)}}
        for a in range(4)
        for b in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    data = f"{folder / 'train.parquet'}?prompt_key=question&answer_key=reward_model.ground_truth"
    config = {
        "name": "byo",
        "models": {"base": {"init": "tiny"}},
        "roles": {"actor": {"model": "base", "dtype": "fp32"}, "reward": {"function": f"{module}:exact"}},
        "stages": [
            {
                "kind": "rl",
                "name": "grpo",
                "steps": 2,
                "data": data,
                "algorithm": {"name": "grpo", "prompts_per_step": 4, "n": 2, "max_new_tokens": 4},
            }
        ],
        "trainer": {"val_data": data, "val_max_new_tokens": 4, **trainer},
        "logging": {"live": False, "tensorboard": False},
    }  # fmt: skip
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.usefixtures("clean_imports")
def test_a_reward_module_beside_the_experiment_file_is_importable(tmp_path: Path) -> None:
    module = f"myreward_{tmp_path.name.replace('-', '_')}"  # unique: imports are cached
    exp = load(experiment(tmp_path, module))
    assert exp.import_root == str(tmp_path.resolve())
    (answer,) = [c for c in scored_columns(exp) if c.name == "answer"]
    assert answer.required and module in answer.why  # imported, what it reads declared
    # the ranks this process starts inherit its environment (deploy/launchers/local.py)
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path.resolve())
    # a resumed run reads the saved config, which keeps the folder
    saved = yaml.safe_load(yaml.safe_dump(exp.model_dump(mode="json")))
    assert parse(saved).import_root == str(tmp_path.resolve())


def test_a_file_shared_by_sft_and_rl_is_checked_for_the_reward_column(tmp_path: Path) -> None:
    data = tmp_path / "shared.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "response": "x"}) + "\n" for i in range(64))
    )
    raw = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    exp = parse(raw, [f"stages.0.data={data}", f"stages.1.data={data}"])
    with pytest.raises(DatasetError) as info:
        read_data(exp)  # before: SFT's columns only, and a RewardError at the first RL step
    message = str(info.value)
    assert (
        message.startswith("stages.0.data: ") and f"{data}:1: column 'answer' is missing" in message
    )
    assert "roles.rules:arithmetic_reward" in message


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("clean_imports")
def test_a_run_with_its_own_reward_and_verl_style_data_logs_what_the_model_said(
    tmp_path: Path,
) -> None:
    module = f"myreward_{tmp_path.name.replace('-', '_')}"
    config = experiment(tmp_path, module, log_samples={"count": 3, "every": 1})
    run_dir = tmp_path / "run"
    args = build_parser().parse_args(["run", str(config), "--run-dir", str(run_dir)])
    assert args.fn(args) == 0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    kinds = [(s["kind"], s["stage"], s["step"]) for s in samples]
    assert (
        kinds.count(("validation", "init", 0)) == 3 and kinds.count(("validation", "final", 2)) == 3
    )
    assert kinds.count(("rollout", "grpo", 1)) == 3 and kinds.count(("rollout", "grpo", 2)) == 3
    questions = {f"{a}+{b}=" for a in range(4) for b in range(4)}
    for s in samples:
        assert s["prompt"] in questions and s["answer"] == str(eval(s["prompt"][:-1]))
        words = s["response"].split()
        assert s["reward"] == float(bool(words) and words[0] == s["answer"])  # myreward's score
