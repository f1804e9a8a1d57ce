"""Engine settings: the learning-rate schedule by hand, and settings refused with their field."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from roles.engines.training.config import EngineConfig, OptimConfig


def test_warmup_then_cosine_by_hand() -> None:
    optim = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6)
    expected = [
        0.5,
        1.0,
        1.0,
        0.5 * (1 + math.cos(math.pi / 4)),
        0.5,
        0.5 * (1 + math.cos(0.75 * math.pi)),
        0.0,
        0.0,
    ]
    assert [optim.lr_factor(s) for s in range(8)] == pytest.approx(expected)


def test_linear_decay_to_a_floor_and_constant() -> None:
    optim = OptimConfig(schedule="linear", total_steps=4, min_lr_ratio=0.2)
    assert [optim.lr_factor(s) for s in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert OptimConfig().lr_factor(1000) == 1.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"optim": {"schedule": "cosine"}}, "needs optim.total_steps"),
        ({"optim": {"warmup_steps": 5, "total_steps": 3}}, "warmup_steps=5 exceeds"),
        ({"optim": {"lr": 0}}, "lr"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"dtype": "fp16"}, "dtype"),
        ({"learning_rate": 1e-3}, "learning_rate"),
    ],
)
def test_bad_settings_name_their_field(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig.model_validate({"model": "m", **settings})
