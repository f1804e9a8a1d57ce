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


def test_roles_started_from_a_lora_actor_must_hold_its_adapters(run_dir: Path) -> None:
    """The quickstart's GRPO stage follows SFT and starts the reference and critics from the
    actor: a LoRA actor hands on adapters only, so a reference role (frozen: no adapters) or a
    critic without the actor's lora block is refused before any process starts."""
    reference = ["roles.reference={model: base}", "placement.main.roles=[actor, reward, reference]"]
    msg = error_of(run_dir, LORA, KL, *reference)
    assert msg.startswith("roles.reference: stages.1 starts it from the LoRA actor")
    assert "drop the role" in msg and "stages.1.init_from_actor: false" in msg
    check(parse(base(), [LORA, KL, *reference, "stages.1.init_from_actor=false"]))
    critic = ["stages.1.algorithm.name=ppo", "placement.main.roles=[actor, reward, critic]"]
    plain = error_of(run_dir, LORA, "roles.critic={model: base}", *critic)
    assert plain.startswith("roles.critic: stages.1 starts it from the LoRA actor")
    other = "roles.critic={model: base, lora: {rank: 4, alpha: 16}}"
    assert error_of(run_dir, LORA, other, *critic).startswith("roles.critic: stages.1")
    same = "roles.critic={model: base, lora: {rank: 8, alpha: 16, dropout: 0.1}}"
    [main] = groups_of(run_dir, LORA, same, *critic)
    assert main.roles["critic"].config["lora"]["rank"] == 8
