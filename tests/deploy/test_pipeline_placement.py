"""A group's pipeline size (``placement.<group>.pp``, and ``gen_pp``) from the experiment YAML to
the ``Layout`` every rank builds, through each launcher; bad sizes fail before any process starts,
naming the field.

Paths followed: YAML → ``GroupSpec`` (``build_groups``) → the local launcher's rank environment →
``GroupEnv.from_env`` → ``Layout``; → ``hybridflow role`` arguments (other hosts) → the spec that
command sizes; → the SLURM script's srun line. The tiny model has 4 layers, 4 heads, 2 kv heads.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from deploy.cli import build_parser
from deploy.commands.role import RoleOptions, _group_spec
from deploy.experiment import ExperimentError, check, parse, prepare_models
from deploy.groups import build_groups
from deploy.launchers.base import role_argv
from deploy.launchers.local import LocalLauncher
from deploy.launchers.sbatch import group_steps
from roles.runtime.env import GroupEnv
from transport.protocol import Layout
from transport.settings import Timeouts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PIPELINE = [
    "placement.main={roles: [actor, reward], nproc: 8, tp: 2, pp: 2, gen_tp: 1, gen_pp: 1}",
    "roles.actor.backend=megatron",
]
MEGATRON = PIPELINE[1]
GEN_PP1 = "placement.main.gen_pp=1"  # a colocated actor generates on one stage


def base() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    return raw


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding the quickstart's tiny model (made once)."""
    path = tmp_path_factory.mktemp("run")
    prepare_models(parse(base()), path)
    return path


def groups_of(run_dir: Path, *overrides: str) -> list[Any]:
    exp = parse(base(), list(overrides))
    check(exp)
    return build_groups(exp, run_dir)


def error_of(run_dir: Path, *overrides: str) -> str:
    with pytest.raises(ExperimentError) as info:
        groups_of(run_dir, *overrides)
    return str(info.value)


def test_pp_reaches_the_layout_of_every_rank(run_dir: Path) -> None:
    [spec] = groups_of(run_dir, *PIPELINE)
    assert (spec.nproc, spec.tp, spec.pp, spec.gen_tp, spec.gen_pp, spec.dp) == (8, 2, 2, 1, 1, 2)
    launcher = LocalLauncher("ipc:///x", "t", run_dir, run_dir, Timeouts(), lambda *a: None)
    layouts = [
        GroupEnv.from_env(launcher.rank_env(spec, rank, port=1234)).layout for rank in range(8)
    ]
    assert set(layouts) == {Layout(dp=2, tp=2, pp=2, gen_tp=1, gen_pp=1)}
    # rank = dp * pp * tp + pp_rank * tp + tp_rank: rank 6 is dp 1, stage 1, tp 0
    assert layouts[6].coords(6) == (1, 1, 0)


def test_pp_reaches_a_group_started_by_hand_and_by_slurm(run_dir: Path) -> None:
    [spec] = groups_of(run_dir, *PIPELINE)
    argv = role_argv(spec, "tcp://127.0.0.1:5555", run_dir=None, keys=None)
    by_hand = _group_spec(RoleOptions.from_args(build_parser().parse_args(argv)))
    assert (by_hand.nproc, by_hand.tp, by_hand.pp, by_hand.gen_tp, by_hand.gen_pp) == (
        8,
        2,
        2,
        1,
        1,
    )
    lines = group_steps({"main": spec}, 1, "tcp://h:1", run_dir, "python", "", controller=False)
    srun = " ".join(lines)
    assert "--tp 2 --pp 2 --gen-tp 1 --gen-pp 1" in srun
    words = shlex.split(srun.replace("\\", ""))
    assert words[words.index("--pp") + 1] == "2"


def test_default_is_one_stage_and_vpp_needs_only_a_divisor(run_dir: Path) -> None:
    [spec] = groups_of(run_dir)
    assert (spec.pp, spec.gen_pp) == (1, 0)
    # 2 stages x 2 virtual stages = 4 chunks of the 4 layers: accepted
    [spec] = groups_of(
        run_dir,
        "placement.main.nproc=2",
        "placement.main.pp=2",
        MEGATRON,
        GEN_PP1,
        "roles.actor.vpp=2",
    )
    assert (spec.pp, spec.roles["actor"].config["vpp"]) == (2, 2)
    # an actor that leaves generation to a rollout group needs no generation stage count
    main, gen = groups_of(
        run_dir,
        "placement.main={roles: [actor, reward], nproc: 2, pp: 2}",
        MEGATRON,
        "roles.rollout={model: base}",
        "placement.gen={roles: [rollout], nproc: 1}",
    )
    assert (main.pp, main.gen_pp, gen.pp) == (2, 0, 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["placement.main.pp=2"],
            "roles.actor.backend: placement.main.pp=2 needs pipeline parallel, which the fsdp "
            "engine does not have; set roles.actor.backend: megatron or placement.main.pp: 1",
        ),
        (
            [
                "placement.main.nproc=6",
                "placement.main.tp=2",
                "placement.main.pp=2",
                MEGATRON,
                GEN_PP1,
            ],
            "placement.main: group 'main': tp=2 x pp=2 does not divide nproc=6",
        ),
        (
            ["placement.main.nproc=3", "placement.main.pp=3", MEGATRON, GEN_PP1],
            "roles.actor: placement.main.pp=3 does not divide the model's num_hidden_layers=4",
        ),
        (
            [
                "placement.main.nproc=2",
                "placement.main.pp=2",
                MEGATRON,
                GEN_PP1,
                "roles.actor.vpp=3",
            ],
            "placement.main.pp=2 x roles.actor.vpp=3 = 6 model chunks does not divide the "
            "model's num_hidden_layers=4",
        ),
        (
            ["roles.actor.backend=megatron", "roles.actor.vpp=2"],
            "roles.actor.vpp=2: virtual pipeline stages need placement.main.pp > 1",
        ),
        (
            ["placement.main.nproc=4", "placement.main.tp=4", "roles.actor.backend=megatron"],
            "roles.actor: tp=4 does not divide the model's num_key_value_heads=2",
        ),
        (
            ["placement.main.nproc=2", "placement.main.pp=2", MEGATRON],
            "placement.main.gen_pp: the actor generates on one pipeline stage, its weights "
            "resharded from pp=2; set placement.main.gen_pp: 1",
        ),
        (
            ["placement.main.gen_pp=2"],
            "placement.main: group 'main': gen_pp=2 must divide pp=1",
        ),
        (["placement.main.pp=0"], "placement.main.pp: Input should be greater than or equal to 1"),
    ],
)
def test_bad_pipeline_sizes_name_the_field(
    run_dir: Path, overrides: list[str], message: str
) -> None:
    assert message in error_of(run_dir, *overrides)


def test_the_test_helper_places_pipeline_groups() -> None:
    from tests.conftest import group

    spec = group("g", 8, tp=2, pp=2, actor="roles.actor:Actor")
    assert (spec.tp, spec.pp, spec.dp) == (2, 2, 2)
    with pytest.raises(ValueError, match="tp=2 x pp=2 does not divide nproc=6"):
        group("g", 6, tp=2, pp=2, actor="roles.actor:Actor")


def test_a_pipeline_group_registers_and_answers_from_its_last_stage() -> None:
    """Four real ranks at dp 2 x pp 2 (generation at pp 1): the controller accepts the layout the
    ranks report, and a dp-split call is collected from tp rank 0 of the last stage."""
    from controller.placement import GroupSpec, RoleSpec
    from deploy.session import local_session
    from tests.conftest import TEST_TIMEOUTS, run
    from tests.fixtures.clients import EchoClient
    from transport.batch import TensorBatch

    spec = GroupSpec(
        name="g", roles={"echo": RoleSpec(cls="tests.fixtures.roles:Echo")}, nproc=4, pp=2, gen_pp=1
    )

    async def main() -> None:
        async with local_session([spec], TEST_TIMEOUTS) as c:
            out = await EchoClient(c, "echo").shard_info(
                TensorBatch.from_dict({"x": torch.arange(4)})
            )
            assert out["dp_rank"].tolist() == [0, 0, 1, 1]
            assert out["seen_by"].tolist() == [1, 1, 3, 3]  # rank_of(dp, pp=1, tp=0)

    run(main)


def test_the_megatron_example_places_tp2_pp2_on_4_ranks(run_dir: Path) -> None:
    from deploy.experiment import load

    [spec] = build_groups(load(EXAMPLES / "megatron_grpo.yaml"), run_dir)
    assert (spec.nproc, spec.dp, spec.tp, spec.pp, spec.gen_tp, spec.gen_pp) == (4, 1, 2, 2, 0, 1)
    assert {r: s.config.get("backend") for r, s in spec.roles.items()} == {
        "actor": "megatron",
        "reference": "megatron",
        "reward": None,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # FSDP-sharded weights cannot be resharded to another tp over dp > 1
            [
                "placement.main={roles: [actor, reward], nproc: 4, tp: 2, gen_tp: 1}",
                "roles.actor.dp_mode=fsdp",
            ],
            "roles.actor.dp_mode: placement.main.gen_tp=1 with dp=2 needs the weights whole",
        ),
        (  # resharded generation runs the native generator only
            [
                "placement.main={roles: [actor, reward], nproc: 2, tp: 2, gen_tp: 1}",
                "roles.actor.generator=hf",
            ],
            "roles.actor.generator: placement.main generates through reshard",
        ),
    ],
)
def test_a_generation_layout_the_actor_cannot_run_fails_before_any_rank_starts(
    run_dir: Path, overrides: list[str], message: str
) -> None:
    """What the actor's ranks would refuse when they build it is refused when the groups are
    built, naming the field to change."""
    assert message in error_of(run_dir, *overrides)
