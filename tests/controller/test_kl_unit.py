"""The adaptive KL controller's target has an explicit unit: ``sequence`` (the KL summed over each
response, this project's measure) or ``token`` (its mean per response token, verl's
``kl_ctrl.target_kl``). Hand-computed values for both, and a target with no unit refused."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from controller.advantages import kl_measure
from controller.algorithm_config import KLConfig

# two rows: 2 response tokens (0.2 + 0.4), 4 response tokens (4 x 0.3); 9.0 sits outside the mask
KL = torch.tensor([[0.2, 0.4, 9.0, 9.0], [0.3, 0.3, 0.3, 0.3]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])


def test_the_two_units_by_hand() -> None:
    # sequence: (0.6 + 1.2) / 2 rows; token: (0.6 / 2 + 1.2 / 4) / 2 rows
    assert kl_measure(KL, MASK, "sequence") == pytest.approx(0.9)
    assert kl_measure(KL, MASK, "token") == pytest.approx(0.3)
    empty = torch.zeros(1, 4, dtype=torch.long)
    assert kl_measure(KL[:1], empty, "token") == 0.0  # no response token: nothing measured
    with pytest.raises(ValueError, match="'sequence' or 'token'"):
        kl_measure(KL, MASK, "batch")


def test_the_controller_steers_towards_the_target_in_its_unit() -> None:
    # a verl target of 0.3 per token is met exactly: the coefficient stays
    token = KLConfig(coef=0.1, target=0.3, target_unit="token", horizon=10)
    ctl = token.controller()
    ctl.update(token.measure(KL, MASK), n_steps=2)
    assert ctl.value == pytest.approx(0.1)
    # the same number read per sequence is 3x over: error clipped to +0.2, coef x (1 + 0.2 * 2/10)
    sequence = KLConfig(coef=0.1, target=0.3, target_unit="sequence", horizon=10)
    ctl = sequence.controller()
    ctl.update(sequence.measure(KL, MASK), n_steps=2)
    assert ctl.value == pytest.approx(0.104)


def test_a_target_without_a_unit_is_refused_with_both_meanings() -> None:
    with pytest.raises(ValidationError, match=r"kl\.target=0\.1 needs kl\.target_unit.*verl"):
        KLConfig.model_validate({"coef": 0.1, "target": 0.1})
    assert KLConfig(coef=0.1).target_unit is None  # a fixed coefficient needs no unit
