"""An experiment's placement as the role groups a launcher starts: ``build_groups`` turns each
placement entry into a ``GroupSpec`` (its roles' classes and settings, model folders resolved),
after the checks of each role at its group's layout that would otherwise fail on the ranks, after
the processes started: tp against the model's heads and widths, pipeline stages against the
backend and the layers, and the actor's generation layout against its generator
(``check_role_in_group``, which the planner's ``deploy/plan/rules.py`` calls on its candidates).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from controller.placement import GroupSpec, RestartPolicy, RoleSpec, check_placement
from deploy.experiment import (
    JUDGE_CLASS,
    ROLE_CLASSES,
    RULE_CLASS,
    STATELESS,
    Experiment,
    ExperimentError,
    GroupConfig,
    _short,
    explain,
    model_path,
    placement,
    role_class,
)
from transport.protocol import Layout

if TYPE_CHECKING:
    from roles.engines.training.config import EngineConfig


def build_groups(exp: Experiment, run_dir: Path) -> list[GroupSpec]:
    """Placement → the GroupSpecs the launcher starts; role settings checked with the roles'
    own config classes, so a typo fails here, not in a rank."""
    _check_teacher(exp, run_dir)
    groups = []
    for gname, group in placement(exp).items():
        specs = {role: _role_spec(exp, role, gname, group, run_dir) for role in group.roles}
        groups.append(group_spec(gname, group, specs))
    check_placement(groups)
    return groups


def group_spec(gname: str, group: GroupConfig, roles: dict[str, RoleSpec]) -> GroupSpec:
    """The ``GroupSpec`` of placement entry ``gname`` hosting ``roles``; sizes that do not fit
    (tp x pp against nproc, gen_tp against tp) raise ExperimentError naming the entry."""
    try:
        return GroupSpec(
            name=gname,
            roles=roles,
            nproc=group.nproc,
            threads=group.threads,
            tp=group.tp,
            pp=group.pp,
            gen_tp=group.gen_tp,
            gen_pp=group.gen_pp,
            nodes=group.nodes,
            fanout=group.fanout,
            device=group.device,
            **restart_policy(roles, group.restart),
        )
    except ValidationError as exc:
        raise ExperimentError(f"placement.{gname}: {_short(exc)}") from None


def restart_policy(roles: dict[str, RoleSpec], given: RestartPolicy | None) -> dict[str, Any]:
    """The group's ``stateful`` and ``restart`` fields: a group of only stateless roles (reward,
    rollout, env) restarts by default, since nothing is lost; one holding trained state does
    only when its placement entry says so, since its restart rolls the run back to the last
    checkpoint and a training rank that died once (out of memory, a bad batch) often dies
    again the same way."""
    stateful = any(spec.cls not in STATELESS for spec in roles.values())
    if given is None:
        given = None if stateful else RestartPolicy()
    elif given.max == 0:
        given = None
    return {"stateful": stateful, "restart": given}


def _check_teacher(exp: Experiment, run_dir: Path) -> None:
    """A teacher scores the student's tokens by id: both models must read ids the same way
    (the same vocabulary, the same special tokens); sizes may differ."""
    teacher, actor = exp.roles.get("teacher"), exp.roles.get("actor")
    if teacher is None or actor is None or teacher.model is None or actor.model is None:
        return
    # roles code (transformers): loaded only when a run's groups are built
    from roles.modeling.models import load_tokenizer

    paths = {
        r: model_path(exp, m, run_dir)
        for r, m in (("actor", actor.model), ("teacher", teacher.model))
    }
    found = {r: load_tokenizer(str(p)) for r, p in paths.items()}
    vocab = {r: t.get_vocab() for r, t in found.items()}
    special = {r: (t.bos_token_id, t.eos_token_id, t.pad_token_id) for r, t in found.items()}
    if vocab["actor"] != vocab["teacher"] or special["actor"] != special["teacher"]:
        differ = sorted(set(vocab["actor"].items()) ^ set(vocab["teacher"].items()))[:3]
        raise ExperimentError(
            f"roles.teacher.model: the teacher {teacher.model!r} ({paths['teacher']}) and the "
            f"actor {actor.model!r} ({paths['actor']}) have different tokenizers (vocabularies "
            f"of {len(vocab['teacher'])} and {len(vocab['actor'])} tokens, special ids "
            f"{special['teacher']} and {special['actor']}; e.g. {differ}): a teacher scores "
            "the student's token ids, so both must share one tokenizer"
        )


def _role_spec(
    exp: Experiment, role: str, gname: str, group: GroupConfig, run_dir: Path
) -> RoleSpec:
    """The role's class and settings; its model folder checked (and against the group's layout)
    and resolved to an absolute path."""
    # roles code (transformers): loaded only when a run's groups are built
    from roles.modeling.models import check_model_dir

    cfg = exp.roles[role]
    cls = role_class(role, cfg)
    settings = cfg.settings()
    model_config = None
    try:
        if cfg.model is not None:
            path = model_path(exp, cfg.model, run_dir)
            model_config, _ = check_model_dir(path)
            settings["model"] = str(path.resolve())
        if cls == ROLE_CLASSES["env"] and "tokenizer" not in settings:
            # the env tokenizes observations as the generator does: with the actor's tokenizer
            actor = exp.roles["actor"].model
            if actor is not None:
                settings["tokenizer"] = str(model_path(exp, actor, run_dir).resolve())
    except (ValueError, ValidationError) as exc:
        raise ExperimentError(f"roles.{role}: {_short(exc)}") from None
    if cls == ROLE_CLASSES["rollout"]:
        _rollout_lora(exp, role, settings)
    engine = check_role_settings(role, cls, settings)
    check_role_in_group(exp, role, cls, gname, group, engine, model_config)
    return RoleSpec(cls=cls, config=settings)


def _rollout_lora(exp: Experiment, role: str, settings: dict[str, Any]) -> None:
    """A rollout group of a LoRA actor holds the same adapters (over the base from its model
    folder) and takes only them at each weight sync: the actor's ``lora`` goes into its
    settings. The serving engines hold their own weights and run no adapters here."""
    lora = exp.roles["actor"].settings().get("lora") if "actor" in exp.roles else None
    if lora is None:
        return
    engine = settings.get("engine", "native")
    if engine not in ("native", "hf"):
        raise ExperimentError(
            f"roles.{role}.engine: {engine!r} with a LoRA actor is not built (a rollout group "
            "would have to keep a pristine base beside the engine's weights to merge into); "
            "use engine: native, or generate in the actor's group with roles.actor.generator: "
            "vllm, which loads merged weights"
        )
    settings["lora"] = lora


def check_role_in_group(
    exp: Experiment,
    role: str,
    cls: str,
    gname: str,
    group: GroupConfig,
    engine: EngineConfig | None,
    model_config: Any,
) -> None:
    """What ``hybridflow run`` (and the planner, ``deploy/plan/rules.py``) checks of a role at its
    group's layout: tp divides the model's heads and widths, pp needs the megatron backend and
    layers that split evenly, an actor generating in its group does so on one pipeline stage and
    with a generator that runs at the group's generation layout. ``model_config``: the role's
    model's config (None: not known, not checked)."""
    from roles.engines.training.common import check_tp  # roles code (transformers)

    if model_config is not None:
        try:
            check_tp(model_config, group.tp)
        except ValueError as exc:
            raise ExperimentError(f"roles.{role}: {exc}") from None
    if engine is None:
        return
    _check_pipeline(role, gname, group, engine, model_config)
    if engine.lora is not None:
        _check_lora(role, cls, gname, group, engine, model_config)
    if cls == ROLE_CLASSES["actor"]:
        if "rollout" not in exp.roles and engine.generator != "vllm":
            _check_generation_stage(gname, group)
        _check_generator(role, gname, group, engine)


def _check_generator(role: str, gname: str, group: GroupConfig, engine: EngineConfig) -> None:
    """What an actor's ranks check of its generation layout when they build it: the generator
    (``roles/actor.py``) and the hybrid engine's reshard (``roles/engines/hybrid.py``)."""
    try:
        layout = Layout.for_world(group.nproc, group.tp, group.pp, group.gen_tp, group.gen_pp)
    except ValueError:
        return  # sizes that do not fit: the group's own check names them (GroupSpec)
    where = f"roles.{role}.generator"
    if engine.generator == "vllm":
        from roles.actor import _check_vllm_layout  # roles code: only for a vllm generator

        if engine.backend != "fsdp":
            raise ExperimentError(
                f"{where}: 'vllm' takes the weights of a Hugging Face module; backend "
                f"{engine.backend!r} generates through reshard with 'native'"
            )
        try:
            _check_vllm_layout(layout.resharded, layout.generation_tp, layout.pp)
        except ValueError as exc:
            raise ExperimentError(f"{where} in placement.{gname}: {exc}") from None
    elif (layout.resharded or engine.backend != "fsdp") and engine.generator != "native":
        raise ExperimentError(
            f"{where}: placement.{gname} generates through reshard (gen_tp="
            f"{layout.generation_tp}, backend {engine.backend}), which runs the native generator"
        )
    if layout.resharded and layout.dp > 1 and engine.backend == "fsdp" and engine.dp_mode == "fsdp":
        raise ExperimentError(
            f"roles.{role}.dp_mode: placement.{gname}.gen_tp={layout.generation_tp} with dp="
            f"{layout.dp} needs the weights whole over dp; set roles.{role}.dp_mode: replicate "
            f"or gen_tp equal to tp={layout.tp}"
        )


def _check_lora(
    role: str, cls: str, gname: str, group: GroupConfig, engine: EngineConfig, model_config: Any
) -> None:
    """What a role with ``lora:`` needs: a role that trains, the fsdp backend at tp 1, the
    actor generating at its training layout, and target modules the model has."""
    from roles.modeling.lora import check_targets  # roles code (transformers)

    lora, where = engine.lora, f"roles.{role}.lora"
    if lora is None:
        return
    if engine.optim is None:
        raise ExperimentError(
            f"{where}: a {role} does not train, so adapters would stay zero; drop lora (a "
            "LoRA actor with no reference role defined is its own reference, adapters off)"
        )
    if engine.backend != "fsdp":
        raise ExperimentError(
            f"{where}: the {engine.backend} engine has no LoRA (megatron-core 0.16 has no "
            "adapter layers of its own; its LoRA lives in Megatron-Bridge/NeMo, not a "
            f"dependency here); set roles.{role}.backend: fsdp"
        )
    if group.tp > 1:
        raise ExperimentError(
            f"{where}: adapters train at tp=1 (placement.{gname}.tp={group.tp}); the "
            "tensor-parallel plan does not split LoRA layers yet - use dp ranks (nproc) instead"
        )
    if cls == ROLE_CLASSES["actor"] and (group.gen_tp not in (0, 1) or group.gen_pp > 1):
        raise ExperimentError(
            f"{where}: the actor generates with its adapters at its training layout; "
            f"placement.{gname}.gen_tp/gen_pp reshard, which does not carry LoRA layers yet"
        )
    if model_config is not None:
        try:
            check_targets(lora, model_config)
        except ValueError as exc:
            raise ExperimentError(f"{where}.{exc}") from None


def _check_generation_stage(gname: str, group: GroupConfig) -> None:
    """A colocated actor generates on one pipeline stage (``roles/engines/hybrid.py``): with
    ``pp`` > 1 the placement must say so, or the first generate fails after the SFT stages."""
    if group.pp > 1 and group.gen_pp != 1:
        raise ExperimentError(
            f"placement.{gname}.gen_pp: the actor generates on one pipeline stage, its weights "
            f"resharded from pp={group.pp}; set placement.{gname}.gen_pp: 1"
        )


def _check_pipeline(
    role: str, gname: str, group: GroupConfig, engine: EngineConfig, model_config: Any
) -> None:
    """An engine role in a group with ``pp`` stages: the megatron backend, and layers that
    split evenly over the stages (``vpp`` model chunks per stage with the interleaved
    schedule)."""
    stages = group.pp * engine.vpp
    if group.pp > 1 and engine.backend != "megatron":
        raise ExperimentError(
            f"roles.{role}.backend: placement.{gname}.pp={group.pp} needs pipeline parallel, "
            f"which the {engine.backend} engine does not have; set roles.{role}.backend: megatron "
            f"or placement.{gname}.pp: 1"
        )
    if engine.vpp > 1 and group.pp == 1:
        raise ExperimentError(
            f"roles.{role}.vpp={engine.vpp}: virtual pipeline stages need placement.{gname}.pp "
            "> 1; set vpp: 1 or a pp of 2 or more"
        )
    layers = getattr(model_config, "num_hidden_layers", None)
    if layers is not None and stages > 1 and layers % stages:
        what = f"placement.{gname}.pp={group.pp}"
        if engine.vpp > 1:
            what += f" x roles.{role}.vpp={engine.vpp} = {stages} model chunks"
        raise ExperimentError(
            f"roles.{role}: {what} does not divide the model's num_hidden_layers={layers}; "
            f"pick sizes whose product divides {layers}"
        )


def check_role_settings(role: str, cls: str, settings: dict[str, Any]) -> EngineConfig | None:
    """Validate ``settings`` with the config class of the role's class (a scoring-only role
    gets ``optim: None``); raises ExperimentError naming ``roles.ROLE`` (and the field). Returns
    the engine settings of an engine role (None for other roles)."""
    # roles code (transformers): loaded only when a run's groups are built
    from roles.engines.training.config import EngineConfig
    from roles.env import EnvConfig, load_agent, load_environment, load_tools
    from roles.rollout import RolloutConfig
    from roles.rule_reward import load_function

    if cls == RULE_CLASS:
        try:
            load_function(str(settings.get("function")))
        except ValueError as exc:
            raise ExperimentError(f"roles.{role}: {exc}") from None
        return None
    if cls == JUDGE_CLASS:
        from roles.judge import JudgeConfig

        try:
            JudgeConfig.model_validate(settings)
        except ValidationError as exc:
            raise ExperimentError(explain(exc, JudgeConfig, f"roles.{role}")) from None
        return None
    if cls == ROLE_CLASSES["env"]:
        try:
            env = EnvConfig.model_validate(settings)
        except ValidationError as exc:
            raise ExperimentError(explain(exc, EnvConfig, f"roles.{role}")) from None
        try:  # the tools' schemas, the environment class or the agent, before any process starts
            if env.agents:
                load_agent(env, build=False)
            else:
                load_tools(env) if env.tools else load_environment(str(env.environment))
        except (ValueError, TypeError) as exc:
            raise ExperimentError(f"roles.{role}: {exc}") from None
        return None
    try:
        if cls == ROLE_CLASSES["rollout"]:
            RolloutConfig.model_validate(settings)
        elif cls in ROLE_CLASSES.values():
            if role in ("reference", "teacher", "reward", "cost"):
                settings.setdefault("optim", None)  # scoring only
            return EngineConfig.model_validate(settings)
    except ValidationError as exc:
        config = RolloutConfig if cls == ROLE_CLASSES["rollout"] else EngineConfig
        raise ExperimentError(explain(exc, config, f"roles.{role}")) from None
    return None
