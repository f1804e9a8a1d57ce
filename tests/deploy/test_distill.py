"""On-policy distillation: the reverse KL by hand, the teacher's tokenizer checked against the
student's before any process starts, and the example's quick form end to end (a 17.6M teacher
made by ``examples/distill_teacher.yaml`` teaching the 1.1M student)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from controller.advantages import reverse_kl
from deploy.experiment import ExperimentError, parse, prepare_models
from deploy.groups import build_groups
from tests.deploy.test_run import EXAMPLES, job, quick_argv, records


def test_reverse_kl_on_sampled_tokens_by_hand() -> None:
    log = math.log
    student = torch.tensor([[-1.0, log(0.5), log(0.2)], [-1.0, log(0.9), -5.0]])
    teacher = torch.tensor([[-9.0, log(0.25), log(0.4)], [-9.0, log(0.9), -1.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    got = reverse_kl(student, teacher, mask)
    assert torch.allclose(got, torch.tensor([[0.0, log(2.0), log(0.5)], [0.0, 0.0, 0.0]]))
    # the advantage distill_step trains on is its negative: up where the teacher is likelier
    assert (-got)[0, 2] > 0 > (-got)[0, 1]


def distill_config(teacher: Path) -> dict:
    raw: dict = yaml.safe_load((EXAMPLES / "distill.yaml").read_text())
    raw["models"]["teacher"] = {"path": str(teacher)}
    return raw


def test_a_teacher_with_another_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    from roles.modeling.models import init_model, load_tokenizer

    teacher = init_model(tmp_path / "teacher", "tiny", seed=1)
    tokenizer = load_tokenizer(str(teacher))
    tokenizer.add_tokens(["<tool>"])  # one token more than the student's
    tokenizer.save_pretrained(teacher)
    exp = parse(distill_config(teacher))
    run_dir = tmp_path / "run"
    prepare_models(exp, run_dir)
    with pytest.raises(ExperimentError, match=r"roles\.teacher\.model: the teacher 'teacher'"):
        build_groups(exp, run_dir)
    same = init_model(tmp_path / "same", "small", seed=1)  # another size, the same tokenizer
    exp = parse(distill_config(same))
    prepare_models(exp, tmp_path / "run2")
    assert {g.name for g in build_groups(exp, tmp_path / "run2")} == {"main", "teach"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_distill_example_quick(tmp_path: Path) -> None:
    teacher_run = tmp_path / "teacher"
    assert job(quick_argv("distill_teacher.yaml", teacher_run)) == 0
    export = teacher_run / "export" / "actor"
    run_dir = tmp_path / "run"
    assert job(quick_argv("distill.yaml", run_dir, [f"models.teacher.path={export}"])) == 0
    rows = [r for r in records(run_dir) if r["stage"] == "distill" and "stage_step" in r]
    assert len(rows) == 4
    for r in rows:  # the teacher scored every step's tokens: its call is on the timeline
        assert r["train/distill/reverse_kl"] > 0
        assert any(k.startswith("time/timeline/compute_log_prob@teacher") for k in r)
        assert "train/reward/mean" in r
