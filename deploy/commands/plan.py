"""``hybridflow plan``: which roles share devices, and each group's parallel sizes (docs/plan.md).

    hybridflow plan EXP.yaml --gpus N [--gpus-per-node U] [--gpu-mem Q] [--device-profile a100]
        [--model-size llama2-7b] [--prompts 1024 --prompt-len 1024 --response-len 1024]
        [--top 10] [--json] [--write PLANNED.yaml]
    hybridflow plan [EXP.yaml --gpus N ...] --calibrate [--quick] [--out PROFILE.json]

The experiment gives the models (roles with a model; rule rewards have none), the algorithm's
workload (the first RL stage: prompts x samples, max new tokens as the response length, PPO
epochs and mini-batches, whether pi_old is recomputed) and the engines' micro-batch size; flags
override any of it (``--model-size`` gives every model a preset's dimensions for the cost
model, as in the paper's evaluation). Only layouts the experiment's engines can run are
proposed (``deploy/plan/rules.py``: e.g. pipeline parallel only for groups whose engine roles
all have ``backend: megatron``). The plans are ranked by predicted step time
(``deploy/plan/cost.py``); ``--write`` saves the experiment with the best plan's ``placement:``
block in place of its own, every other line as it was (``deploy/plan/written.py``), ready for
``hybridflow run``. ``--calibrate`` measures this machine's profile first
(``deploy/plan/calibrate.py``), prints it (``--out``: saves it, a file ``--device-profile``
takes later) and, given an experiment, plans with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich import box
from rich.console import Console
from rich.table import Table

from deploy.experiment import Experiment, ExperimentError, load, parse, placement, read_yaml
from deploy.plan.cost import STAGES, ModelShape, Strategy, Workload, group_cost, step_cost
from deploy.plan.profiles import PROFILES, DeviceProfile, ProfileError, load_profile
from deploy.plan.rules import RunRules
from deploy.plan.search import Plan, PlanError, Planner
from deploy.plan.written import SpliceError, carried_settings, group_name, replace_placement
from reshard.shapes import PRESETS, LlamaDims, from_hf_config
from transport.device import DeviceKind

EXIT_BAD_INPUT = 2
BYTE_VOCAB = 320  # init models: 256 bytes + pad, bos, eos, rounded up to a multiple of 64
SMOLLM2 = LlamaDims(576, 1536, 30, 9, 3, 49152, tied=True, head_dim=64)


@dataclass(frozen=True)
class PlanOptions:
    experiment: Path
    gpus: int
    per_node: int
    gpu_mem: float | None
    profile: str | DeviceProfile
    model_size: str | None
    prompts: int | None
    prompt_len: int
    response_len: int | None
    top: int
    json: bool
    write: Path | None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> PlanOptions:
        return cls(
            a.experiment, a.gpus, a.gpus_per_node, a.gpu_mem, a.device_profile, a.model_size,
            a.prompts, a.prompt_len, a.response_len, a.top, a.json, a.write,
        )  # fmt: skip


def add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="propose a placement (auto-mapping, docs/plan.md)")
    p.add_argument("experiment", type=Path, nargs="?", help="(optional with --calibrate)")
    p.add_argument("--gpus", type=int, help="devices in all (N); needed with an experiment")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per machine (U)")
    p.add_argument("--gpu-mem", type=float, help="usable GB per device (Q; default: profile's)")
    p.add_argument("--device-profile", help=f"{', '.join(PROFILES)} or a JSON file (default: a100)")
    p.add_argument(
        "--calibrate", action="store_true", help="measure this machine's profile and use it"
    )
    p.add_argument("--quick", action="store_true", help="--calibrate in a few seconds")
    p.add_argument("--out", type=Path, help="--calibrate: save the profile JSON here")
    p.add_argument("--model-size", choices=sorted(PRESETS), help="every model at this size")
    p.add_argument("--prompts", type=int, help="prompts per step (default: the experiment's)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--response-len", type=int, help="tokens per response (default: max_new)")
    p.add_argument("--top", type=int, default=10, help="plans shown (default 10)")
    p.add_argument("--json", action="store_true", help="print the plans as one JSON line")
    p.add_argument("--write", type=Path, help="save the experiment with the best placement")
    p.set_defaults(fn=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    try:
        if args.calibrate and args.device_profile:
            raise ProfileError("--calibrate measures the profile: drop --device-profile")
        if (args.quick or args.out) and not args.calibrate:
            raise ProfileError("--quick and --out go with --calibrate")
        if args.experiment is None and not args.calibrate:
            raise PlanError("give an experiment to plan (or --calibrate alone)")
        if args.experiment is not None and args.gpus is None:
            raise PlanError("--gpus N is needed to plan an experiment")
        if args.calibrate:
            args.device_profile = run_calibrate(args.quick, args.out, quiet=args.json)
        if args.device_profile is None:
            args.device_profile = "a100"
        return 0 if args.experiment is None else run_plan(PlanOptions.from_args(args))
    except (ExperimentError, ProfileError, PlanError, ValueError) as exc:
        print(f"hybridflow plan: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run_calibrate(quick: bool, out: Path | None, quiet: bool) -> DeviceProfile:
    """Measure this machine's profile, print it (to stderr under ``--json``), save it."""
    from deploy.plan.calibrate import calibrate

    found = calibrate(quick=quick, name=out.stem if out else "calibrated")
    text = json.dumps(found.to_json_dict(), indent=2)
    if out is not None:
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text + "\n")
        tmp.replace(out)
    print(text, file=sys.stderr if quiet else sys.stdout)
    return found.profile


def model_dims(exp: Experiment, role: str) -> LlamaDims | None:
    name = exp.roles[role].model
    if name is None:
        return None
    source = exp.models.get(name)
    if source is None:
        return from_hf_config(name)
    if source.init is not None:
        from roles.modeling.models import SIZES

        c = SIZES[source.init]
        return LlamaDims(
            c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
            c["num_attention_heads"], c["num_key_value_heads"], BYTE_VOCAB,
        )  # fmt: skip
    if source.gguf is not None:
        return SMOLLM2
    assert source.path is not None  # ModelSource has exactly one source
    return from_hf_config(source.path)


def workload(exp: Experiment, opts: PlanOptions) -> Workload:
    """The first RL stage's step, the experiment's models (or the preset size for all)."""
    rl = next((s for s in exp.stages if getattr(s, "kind", "") == "rl"), None)
    if rl is None:
        raise ExperimentError(f"{opts.experiment}: no rl stage to plan for")
    algo = rl.algorithm  # type: ignore[union-attr]
    models: dict[str, ModelShape] = {}
    for role in exp.roles:
        if role == "rollout":
            continue  # the planner places the actor's generation itself (the hybrid engine)
        dims = PRESETS[opts.model_size] if opts.model_size else model_dims(exp, role)
        if dims is not None:
            models[role] = ModelShape(dims)
    if "actor" not in models:
        raise ExperimentError(f"{opts.experiment}: the planner needs an actor with a model")
    micro = int(exp.roles["actor"].settings().get("micro_batch_size", 8))
    fsdp = frozenset(
        r
        for r in models
        if not opts.model_size
        and exp.roles[r].settings().get("backend", "fsdp") == "fsdp"
        and exp.roles[r].settings().get("dp_mode", "fsdp") == "fsdp"
    )
    return Workload(
        models=models,
        rows=(opts.prompts or algo.prompts_per_step) * algo.n,
        prompt_len=opts.prompt_len,
        response_len=opts.response_len or algo.max_new_tokens,
        epochs=algo.ppo_epochs,
        optimizer_steps=algo.ppo_epochs * algo.mini_batches,
        recompute_old=algo.old_log_probs != "rollout",
        micro_batch=1 if opts.model_size else micro,
        fsdp=fsdp,
    )


def own_dims(exp: Experiment, opts: PlanOptions) -> dict[str, LlamaDims | None]:
    """Each role's own model (what runs, whatever ``--model-size`` prices). Under
    ``--model-size`` a model not readable here (a folder made later) is None: not checked."""
    found: dict[str, LlamaDims | None] = {}
    for role, cfg in exp.roles.items():
        if cfg.model is None:
            continue
        try:
            found[role] = model_dims(exp, role)
        except ValueError as exc:
            if not opts.model_size:
                raise
            found[role] = None
            print(
                f"hybridflow plan: roles.{role}.model: {exc}; the plans are not checked against "
                "its heads and layers",
                file=sys.stderr,
            )
    return found


def placement_block(
    rules: RunRules, plan: Plan, own: dict[str, list[str]]
) -> dict[str, dict[str, Any]]:
    """The plan as an experiment's ``placement:`` (roles without a model join the actor). A
    planned group keeps the name of the experiment's group that held its first role (``own``:
    name -> roles), so keys and ``--set placement.NAME...`` still name it; a name already given
    goes to the roles' own (``actor_critic``)."""
    block: dict[str, dict[str, Any]] = {}
    for group, cost in zip(plan.groups, plan.costs, strict=True):
        entry = rules.entry(group, cost.strategy)
        held = [name for role in entry["roles"] for name, roles in own.items() if role in roles]
        name = next((n for n in held if n not in block), group_name(group))
        block[name] = entry
    return block


def predict(
    exp: Experiment, wl: Workload, profile: DeviceProfile, per_node: int
) -> dict[str, float]:
    """The cost model's step time for the experiment's own placement (per stage and total)."""
    costs = []
    for group in placement(exp).values():
        d = group.nproc // (group.tp * group.pp)
        s = Strategy(p=group.pp, t=group.tp, d=d, gen_t=group.gen_tp or group.tp)
        costs.append(group_cost(group.roles, wl, s, per_node, profile))
    return step_cost(costs)


def describe(plan: Plan) -> dict[str, Any]:
    return {
        "step_s": plan.total,
        "stages_s": {s: plan.stages[s] for s in STAGES},
        "groups": [
            {
                "roles": list(g),
                "devices": c.strategy.p * c.strategy.t * c.strategy.d,
                "p_t_d": [c.strategy.p, c.strategy.t, c.strategy.d],
                "gen_tp": c.strategy.gen_t,
                "memory_gb": round(c.memory / 1e9, 2),
                "waves": c.waves,
            }
            for g, c in zip(plan.groups, plan.costs, strict=True)
        ],
    }


def run_plan(opts: PlanOptions) -> int:
    if opts.gpus < 1 or opts.per_node < 1:
        raise PlanError("--gpus and --gpus-per-node must be at least 1")
    exp = load(opts.experiment)
    profile = (
        opts.profile if isinstance(opts.profile, DeviceProfile) else load_profile(opts.profile)
    )
    if opts.gpu_mem is not None:
        from dataclasses import replace

        profile = replace(profile, mem_bytes=opts.gpu_mem * 1e9)
    wl = workload(exp, opts)
    raw = read_yaml(opts.experiment, "experiment file")
    # the device the plan is for, unless the file's groups say theirs (a GPU plan run on CPU)
    wants = {"device": profile.device.value} if profile.device != DeviceKind.CPU else {}
    carried = {**wants, **carried_settings(raw.get("placement"))}
    own = {name: list(group.roles) for name, group in placement(exp).items()}
    rules = RunRules(
        exp, own_dims(exp, opts), list(wl.models), wl.generator, carried, opts.per_node
    )
    start = time.perf_counter()
    planner = Planner(wl, opts.gpus, opts.per_node, profile, allow_pp=True, allows=rules.allows)
    try:
        plans = planner.plans(opts.top)
    except PlanError as exc:
        if not rules.rejected:
            raise
        raise PlanError(
            f"{exc}; the experiment's engines ruled out, e.g.: {'; '.join(rules.reasons())}"
        ) from None
    seconds = time.perf_counter() - start
    best = placement_block(rules, plans[0], own)
    result = {
        "experiment": str(opts.experiment),
        "gpus": opts.gpus,
        "gpus_per_node": opts.per_node,
        "profile": profile.name,
        "models": {r: m.params for r, m in wl.models.items()},
        "plan_s": round(seconds, 3),
        "plans": [{**describe(p), "placement": placement_block(rules, p, own)} for p in plans],
        "placement": best,
        "ruled_out": rules.reasons(),
    }
    if opts.write is not None:
        write_plan(opts.experiment, opts.write, raw, best, rules)
        result["written"] = str(opts.write)
    if opts.json:
        print(json.dumps(result))
    else:
        print_plans(result, wl)
    return 0


def write_plan(
    source: Path, out: Path, raw: dict[str, Any], block: dict[str, Any], rules: RunRules
) -> None:
    """``source`` with its placement replaced by ``block``, validated as ``hybridflow run``
    reads it, then written atomically."""
    try:
        text = replace_placement(source.read_text(), raw, block)
    except SpliceError as exc:
        print(f"hybridflow plan: --write: {exc}; writing it re-dumped instead", file=sys.stderr)
        text = yaml.safe_dump({**raw, "placement": block}, sort_keys=False)
    rules.check_placement(parse(yaml.safe_load(text), where=str(out)))
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    tmp.replace(out)


def print_plans(result: dict[str, Any], wl: Workload) -> None:
    console = Console()
    title = (
        f"{result['experiment']}: {result['gpus']} devices ({result['gpus_per_node']} per node, "
        f"{result['profile']}), {wl.rows} sequences of {wl.prompt_len}+{wl.response_len} tokens"
    )
    table = Table(title=title, box=box.SIMPLE_HEAVY)
    for column in ("#", "groups (devices, p-t-d, gen tp)", "step s", *STAGES):
        table.add_column(column, justify="left" if column.startswith("groups") else "right")
    for i, plan in enumerate(result["plans"], 1):
        groups = "  ".join(
            f"{{{'+'.join(g['roles'])}}} {g['devices']}, {'-'.join(map(str, g['p_t_d']))}, g{g['gen_tp']}"
            for g in plan["groups"]
        )
        stages = [f"{plan['stages_s'][s]:.3g}" for s in STAGES]
        table.add_row(str(i), groups, f"{plan['step_s']:.3g}", *stages)
    console.print(table)
    if result["ruled_out"]:
        console.print("left out, as the experiment's engines cannot run them, e.g.:")
        for reason in result["ruled_out"]:
            console.print(f"  {reason}", markup=False)
    console.print(f"planned in {result['plan_s']:.2f} s; best placement:")
    console.print(yaml.safe_dump({"placement": result["placement"]}, sort_keys=False))
    if "written" in result:
        console.print(f"written: {result['written']}")
