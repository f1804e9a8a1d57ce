"""What the experiment's engines can run: the planner's filter on each candidate group.

A candidate is a group of roles at one ``Strategy``. It is judged in the form ``--write`` gives
it (``written.group_entry``, with the roles the planner does not place, such as a rule reward,
joining the actor's group) by the checks ``hybridflow run`` makes on that form, called here
rather than restated:

- ``controller.placement.GroupSpec``: tp x pp divides nproc, gen_tp divides tp and gen_pp pp;
- ``roles.engines.training.common.check_tp``: tp divides each model's heads, kv heads and MLP
  width;
- ``deploy.groups``' role settings and layout checks: pp > 1 only when every engine
  role of the group has ``backend: megatron``; pp x vpp divides the layers; an actor that
  generates in its group does so on one pipeline stage (``gen_pp: 1``);
- what the actor's ranks check when they build it (``roles/actor.py``,
  ``roles/engines/hybrid.py``): generator ``vllm`` generates at gen_tp = tp or 1 with pp 1 on
  the fsdp backend; a resharded or megatron actor generates with ``native``; generating at
  another tp with dp > 1 needs weights whole over dp (not the fsdp engine's ``dp_mode: fsdp``).

The model dimensions are those of the experiment's own models, which are what runs, whatever
size ``--model-size`` gives the cost model. A model whose dimensions cannot be read here (a
folder made later) is not checked for tp and pp.

What ``hybridflow run`` checks only from the model folders (the tokenizer, the vocabulary) does
not depend on the placement, so the planner has no need of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from controller.placement import RoleSpec
from deploy.experiment import (
    Experiment,
    ExperimentError,
    GroupConfig,
    explain,
    placement,
    role_class,
)
from deploy.groups import check_role_in_group, check_role_settings, group_spec
from deploy.plan.cost import Strategy
from deploy.plan.written import group_entry, group_name
from reshard.shapes import LlamaDims

if TYPE_CHECKING:
    from roles.engines.training.config import EngineConfig


def hf_fields(dims: LlamaDims) -> SimpleNamespace:
    """The fields of a transformers config that the layout checks read."""
    return SimpleNamespace(
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers,
    )


class RunRules:
    """The checks of ``hybridflow run`` on one experiment's groups, without its model folders.

    ``dims``: each role's own model (None: not known here); ``planned``: the roles the planner
    places (the others join the generator's group); ``carried``: settings every written group
    gets (``written.carried_settings``); ``per_node``: devices a node has (a bigger group is
    written with ``nodes``)."""

    def __init__(
        self,
        exp: Experiment,
        dims: Mapping[str, LlamaDims | None],
        planned: Sequence[str],
        generator: str = "actor",
        carried: Mapping[str, Any] | None = None,
        per_node: int | None = None,
    ) -> None:
        self.exp, self.generator, self.per_node = exp, generator, per_node
        self.configs = {r: hf_fields(d) for r, d in dims.items() if d is not None}
        self.extra = [r for r in exp.roles if r not in planned]
        self.carried = dict(carried or {})
        self.classes = {role: role_class(role, cfg) for role, cfg in exp.roles.items()}
        self.engines: dict[str, EngineConfig] = {}
        for role, cfg in exp.roles.items():
            settings = cfg.settings()
            if cfg.model is not None:
                settings["model"] = cfg.model  # _role_spec sets the resolved folder
            engine = check_role_settings(role, self.classes[role], settings)
            if engine is not None:
                self.engines[role] = engine
        self.rejected: Counter[str] = Counter()  # candidates left out, by the field to change
        self.example: dict[str, str] = {}  # the first message for each such field
        self._judged: dict[tuple[Any, ...], bool] = {}

    def entry(self, group: Sequence[str], s: Strategy) -> dict[str, Any]:
        """The placement entry ``--write`` writes for ``group`` at ``s``."""
        roles = [*group, *self.extra] if self.generator in group else list(group)
        return group_entry(roles, s, self.generator, self.carried, self.per_node)

    def allows(self, group: tuple[str, ...], s: Strategy) -> bool:
        """Whether ``hybridflow run`` accepts the group at ``s`` (cached: only whether dp > 1
        matters of d)."""
        key = (group, s.p, s.t, s.gen_t, s.d > 1)
        found = self._judged.get(key)
        if found is None:
            try:
                self.check(group_name(group), GroupConfig.model_validate(self.entry(group, s)))
                found = True
            except ExperimentError as exc:
                field = str(exc).partition(":")[0]
                self.rejected[field] += 1
                self.example.setdefault(field, str(exc))
                found = False
            self._judged[key] = found
        return found

    def check(self, gname: str, group: GroupConfig) -> None:
        """Raise the ``ExperimentError`` that ``hybridflow run`` (or a rank) would raise for this
        group, the model folders aside."""
        for role in group.roles:
            check_role_in_group(
                self.exp,
                role,
                self.classes[role],
                gname,
                group,
                self.engines.get(role),
                self.configs.get(role),
            )
        group_spec(gname, group, {role: RoleSpec(cls=self.classes[role]) for role in group.roles})

    def check_placement(self, exp: Experiment) -> None:
        """``check`` on every group of ``exp`` (the written experiment)."""
        for gname, group in placement(exp).items():
            self.check(gname, group)

    def reasons(self, most: int = 3) -> list[str]:
        """Why candidates were left out: one message for each of the ``most`` fields that
        ruled out the most."""
        fields = sorted(self.rejected, key=lambda f: (-self.rejected[f], f))
        return [self.example[f] for f in fields[:most]]


def _short(exc: Exception) -> str:
    return explain(exc) if isinstance(exc, ValidationError) else str(exc)
