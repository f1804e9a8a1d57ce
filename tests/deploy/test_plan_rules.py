"""``hybridflow plan`` proposes only what the experiment's engines run: every ranked plan, written
into the experiment, passes the checks ``hybridflow run`` makes before any process starts
(``parse``, ``check``, ``build_groups`` on the models made), and the ranks' own layout rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.commands.plan import PlanOptions, run_plan
from deploy.experiment import Experiment, check, parse, prepare_models
from deploy.groups import build_groups
from deploy.plan.cost import Strategy
from deploy.plan.rules import RunRules
from reshard.shapes import PRESETS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def plan(
    capsys: pytest.CaptureFixture[str],
    experiment: Path,
    gpus: int,
    per_node: int = 8,
    model_size: str | None = None,
    write: Path | None = None,
    profile: str = "a100",
) -> dict[str, Any]:
    """``hybridflow plan ... --json`` in this process: its parsed output."""
    opts = PlanOptions(
        experiment, gpus, per_node, None, profile, model_size, None, 64, None, 10, True, write
    )
    assert run_plan(opts) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ppo.yaml's reward model (``models/tiny-rm``, relative to the working
    directory) and a run directory with the examples' ``base`` model made."""
    from roles.modeling.models import init_model

    root = tmp_path_factory.mktemp("plan-rules")
    init_model(root / "models" / "tiny-rm", "tiny", seed=1)
    prepare_models(parse(yaml.safe_load((EXAMPLES / "ppo.yaml").read_text())), root / "run")
    return root


def runs(experiment: Path, block: dict[str, Any], run_dir: Path) -> Experiment:
    """The experiment with ``block`` as its placement, through every check of ``hybridflow
    run`` that does not start a process."""
    raw = yaml.safe_load(experiment.read_text())
    raw["placement"] = block
    exp = parse(raw, where=f"{experiment.name} planned")
    check(exp)
    build_groups(exp, run_dir)
    return exp


CASES = [
    ("ppo.yaml", 4, 8, None),
    ("ppo.yaml", 8, 4, None),
    ("ppo.yaml", 16, 8, "llama2-7b"),
    ("ppo.yaml", 32, 8, "llama2-13b"),
    ("quickstart.yaml", 2, 2, None),
    ("quickstart.yaml", 8, 8, None),
    ("quickstart.yaml", 16, 8, "llama2-7b"),
    ("megatron_grpo.yaml", 16, 8, "llama2-7b"),
]


@pytest.mark.parametrize("name, gpus, per_node, size", CASES)
def test_every_ranked_plan_passes_the_experiments_checks(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    workdir: Path,
    name: str,
    gpus: int,
    per_node: int,
    size: str | None,
) -> None:
    monkeypatch.chdir(workdir)
    result = plan(capsys, EXAMPLES / name, gpus, per_node, size)
    assert result["plans"]
    checked: set[str] = set()
    for ranked in result["plans"]:
        block = ranked["placement"]
        assert sum(g["nproc"] for g in block.values()) == gpus
        key = json.dumps(block, sort_keys=True)
        if key not in checked:  # equal blocks at another cost need no second check
            runs(EXAMPLES / name, block, workdir / "run")
            checked.add(key)


def test_pipeline_parallel_stays_where_the_megatron_engine_runs_it(
    capsys: pytest.CaptureFixture[str], workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(workdir)
    fsdp = plan(capsys, EXAMPLES / "ppo.yaml", 16, model_size="llama2-7b")
    megatron = plan(capsys, EXAMPLES / "megatron_grpo.yaml", 16, model_size="llama2-7b")
    assert all(g["p_t_d"][0] == 1 for p in fsdp["plans"] for g in p["groups"])
    assert any("needs pipeline parallel" in reason for reason in fsdp["ruled_out"])
    pipelined = [g for p in megatron["plans"] for g in p["placement"].values() if g.get("pp")]
    assert pipelined and all(g["gen_pp"] == 1 for g in pipelined)


def test_the_16_gpu_7b_ppo_plan_is_written_runnable(
    capsys: pytest.CaptureFixture[str], workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The case that failed: every group was written with pp 8 on the fsdp engine."""
    monkeypatch.chdir(workdir)
    planned = workdir / "planned.yaml"
    result = plan(capsys, EXAMPLES / "ppo.yaml", 16, model_size="llama2-7b", write=planned)
    assert result["written"] == str(planned)
    exp = runs(planned, yaml.safe_load(planned.read_text())["placement"], workdir / "run")
    assert sum(g.nproc for g in exp.placement.values()) == 16
    assert all(g.pp == 1 for g in exp.placement.values())


def rules_for(raw: dict[str, Any]) -> RunRules:
    exp = parse(raw)
    dims = {r: PRESETS["llama2-7b"] for r, cfg in exp.roles.items() if cfg.model is not None}
    return RunRules(exp, dims, list(dims))


def quickstart(**actor: Any) -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    raw["roles"]["actor"].update(actor)
    return raw


def test_resharding_fsdp_sharded_weights_over_dp_is_left_out() -> None:
    """The hybrid engine reshards to another generation tp only from weights whole over dp."""
    sharded = rules_for(quickstart(dp_mode="fsdp"))
    whole = rules_for(quickstart())
    for s, ok in [
        (Strategy(p=1, t=2, d=2, gen_t=1), False),  # resharded, dp 2: refused by the ranks
        (Strategy(p=1, t=2, d=2, gen_t=2), True),  # generates at its training tp
        (Strategy(p=1, t=2, d=1, gen_t=1), True),  # dp 1: nothing sharded over dp
    ]:
        assert sharded.allows(("actor",), s) is ok
        assert whole.allows(("actor",), s)
    assert "dp_mode: replicate" in sharded.reasons()[0]


@pytest.mark.parametrize(
    "generator, s, ok",
    [
        ("vllm", Strategy(p=1, t=4, d=1, gen_t=2), False),  # vllm: gen_tp = tp or 1
        ("vllm", Strategy(p=1, t=4, d=1, gen_t=1), True),
        ("hf", Strategy(p=1, t=2, d=1, gen_t=1), False),  # resharded: the native generator
        ("hf", Strategy(p=1, t=2, d=1, gen_t=2), True),
    ],
)
def test_the_actors_generator_limits_its_generation_tp(
    generator: str, s: Strategy, ok: bool
) -> None:
    assert rules_for(quickstart(generator=generator)).allows(("actor",), s) is ok


def test_tp_must_divide_the_experiments_own_model_whatever_size_is_priced() -> None:
    """The tiny model has 2 kv heads: tp 4 is left out though llama2-7b's 32 would take it."""
    exp = parse(quickstart())
    from roles.modeling.models import SIZES

    tiny = SIZES["tiny"]
    assert tiny["num_key_value_heads"] == 2
    from deploy.commands.plan import model_dims

    rules = RunRules(exp, {"actor": model_dims(exp, "actor")}, ["actor"])
    assert rules.allows(("actor",), Strategy(p=1, t=2, d=2, gen_t=2))
    assert not rules.allows(("actor",), Strategy(p=1, t=4, d=1, gen_t=4))
    assert "num_key_value_heads=2" in rules.reasons()[0]
