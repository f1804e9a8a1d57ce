"""``lora:`` in an experiment: what is refused before any process starts, naming the field, and
what a LoRA actor changes in the placement (no reference needed for KL; a rollout group gets
the actor's adapters). The quickstart's config on its tiny model, with overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.experiment import ExperimentError, check, parse, reference_in_actor
from tests.deploy.test_pipeline_placement import base, error_of, groups_of, run_dir

__all__ = ["run_dir"]  # the module fixture: the quickstart's tiny model, made once

LORA = "roles.actor.lora={rank: 8, alpha: 16}"
KL = "stages.1.algorithm.kl={coef: 0.01, mode: loss}"


def test_a_lora_actor_is_its_own_reference(run_dir: Path) -> None:
    [main] = groups_of(run_dir, LORA, KL)
    assert main.roles["actor"].config["lora"] == {"rank": 8, "alpha": 16}
    assert reference_in_actor(parse(base(), [LORA, KL]))
    # without lora, the same KL needs a reference role, and says so
    with pytest.raises(ExperimentError, match=r"needs role\(s\) \['reference'\].*kl.coef"):
        check(parse(base(), [KL]))
    # a reference role that is defined is used as it is
    with_ref = parse(base(), [LORA, KL, "roles.reference={model: base}"])
    assert not reference_in_actor(with_ref)


def test_a_rollout_group_of_a_lora_actor_gets_its_adapters(run_dir: Path) -> None:
    found = groups_of(
        run_dir,
        LORA,
        "roles.rollout={model: base}",
        "placement.gen={roles: [rollout]}",
    )
    rollout = next(g for g in found if g.name == "gen").roles["rollout"]
    assert rollout.config["lora"] == {"rank": 8, "alpha": 16}
    msg = error_of(
        run_dir,
        LORA,
        "roles.rollout={model: base, engine: vllm}",
        "placement.gen={roles: [rollout]}",
    )
    assert msg.startswith("roles.rollout.engine: 'vllm' with a LoRA actor is not built")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["roles.actor.lora={rank: 0}"], "roles.actor.lora.rank"),
        (["roles.actor.lora={rank: 8, dropout: 1.5}"], "roles.actor.lora.dropout"),
        (["roles.actor.lora={rank: 8, bias: all}"], "roles.actor.lora.bias"),
        (
            ["roles.actor.lora={target_modules: [q_proj, qproj]}"],
            "roles.actor.lora.target_modules: ['qproj'] not a linear layer of a llama decoder",
        ),
        (["roles.actor.lora={target_modules: [lm_head]}"], "roles.actor.lora.target_modules"),
        (
            [LORA, "placement.main={roles: [actor, reward], nproc: 2, tp: 2}"],
            "roles.actor.lora: adapters train at tp=1",
        ),
        (
            [LORA, "placement.main={roles: [actor, reward], nproc: 2, tp: 2, gen_tp: 1}"],
            "roles.actor.lora: adapters train at tp=1",
        ),
        (
            [LORA, "roles.actor.backend=megatron"],
            "roles.actor.lora: the megatron engine has no LoRA",
        ),
        (
            [
                KL,
                "roles.reference={model: base, lora: {rank: 4}}",
                "placement.main={roles: [actor, reward, reference], nproc: 2}",
            ],
            "roles.reference.lora: a reference does not train",
        ),
    ],
)
def test_bad_lora_settings_are_refused_by_field(
    run_dir: Path, overrides: list[str], expected: str
) -> None:
    assert expected in error_of(run_dir, *overrides)
