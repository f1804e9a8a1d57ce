"""A plan in its written form: the ``placement:`` entries, and the experiment file with only
that block replaced.

``group_entry`` is the one place where a planned group becomes a placement entry. ``--write``
writes it, and ``deploy/plan/rules.py`` judges each candidate in this same form, so what is
checked is what is written.

``replace_placement`` splices text instead of dumping the YAML again: every byte outside the
top-level ``placement:`` block stays as the user wrote it (comments, flow style, key order,
quoting). Comment lines inside the old block are kept, above the new entries. The result is read
back and compared with the intended mapping before it is returned; a file the splice cannot
handle raises ``SpliceError`` rather than being written wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from deploy.plan.cost import Strategy

#: group settings of the user's placement that the plan does not choose; kept when every group
#: of the file agrees on them (e.g. ``device: cuda``)
CARRIED = ("device", "fanout")
_HEADER = re.compile(r"""^(?P<key>placement|"placement"|'placement')[ \t]*:(?P<rest>.*)$""")
_STAGES = re.compile(r"""^(stages|"stages"|'stages')[ \t]*:""")


class SpliceError(ValueError):
    """The experiment file's ``placement:`` block cannot be replaced as text."""


def group_entry(
    roles: Sequence[str],
    s: Strategy,
    generator: str,
    carried: Mapping[str, Any],
    per_node: int | None = None,
) -> dict[str, Any]:
    """A planned group as a placement entry: ``nproc`` and only the sizes that differ from the
    defaults (``gen_pp: 1`` where the generator's group is pipelined: it generates on one
    stage; ``nodes`` where it needs more devices than a node of ``per_node`` has)."""
    entry: dict[str, Any] = {"roles": list(roles), "nproc": s.p * s.t * s.d}
    if per_node is not None and entry["nproc"] > per_node:
        entry["nodes"] = nodes_for(entry["nproc"], s.t, per_node)
    if s.t > 1:
        entry["tp"] = s.t
    if s.p > 1:
        entry["pp"] = s.p
    if generator in roles and s.gen_t != s.t:
        entry["gen_tp"] = s.gen_t
    if generator in roles and s.p > 1:
        entry["gen_pp"] = 1
    entry.update(carried)
    return entry


def nodes_for(nproc: int, tp: int, per_node: int) -> int:
    """The fewest nodes of ``per_node`` devices that hold ``nproc`` ranks evenly, tensor-parallel
    peers inside one (what ``GroupSpec`` accepts); ``nproc`` when none does."""
    least = -(-nproc // per_node)
    for nodes in range(least, nproc + 1):
        if nproc % nodes == 0 and (nproc // nodes) % tp == 0 and nproc // nodes <= per_node:
            return nodes
    return nproc


def group_name(roles: Sequence[str]) -> str:
    return "_".join(roles)


def carried_settings(raw_placement: Any) -> dict[str, Any]:
    """The ``CARRIED`` settings every group of the file's own placement shares."""
    if not isinstance(raw_placement, dict) or not raw_placement:
        return {}
    groups = [g if isinstance(g, dict) else {} for g in raw_placement.values()]
    found = {}
    for key in CARRIED:
        values = [g.get(key) for g in groups]
        if values[0] is not None and all(v == values[0] for v in values):
            found[key] = values[0]
    return found


def replace_placement(
    text: str, raw: Mapping[str, Any], block: Mapping[str, Mapping[str, Any]]
) -> str:
    """``text`` (whose parsed form is ``raw``) with its top-level ``placement:`` replaced by
    ``block``, one flow-style line per group; a file without one gets the block before
    ``stages:``."""
    lines = text.splitlines(keepends=True)
    headers = [i for i, line in enumerate(lines) if _HEADER.match(line.rstrip("\r\n"))]
    if len(headers) > 1:
        raise SpliceError("the file has more than one top-level placement: key")
    newline = "\r\n" if "\r\n" in text else "\n"
    if headers:
        start = headers[0]
        end = _block_end(lines, start)
        match = _HEADER.match(lines[start].rstrip("\r\n"))
        assert match is not None
        key, comment = match["key"], _comment(match["rest"])
        inside = [line for line in lines[start + 1 : end] if line.strip().startswith("#")]
        indent = _indent(lines[start + 1 : end])
    else:
        start = end = _insertion_point(lines)
        key, comment, inside, indent = "placement", "", [], "  "
        if start == len(lines) and lines and not lines[-1].endswith("\n"):
            lines[-1] += newline
    header = f"{key}:{' ' + comment if comment else ''}{newline}"
    entries = [f"{indent}{name}: {_flow(entry)}{newline}" for name, entry in block.items()]
    result = "".join([*lines[:start], header, *inside, *entries, *lines[end:]])
    expected = {**raw, "placement": {name: dict(entry) for name, entry in block.items()}}
    try:
        reread = yaml.safe_load(result)
    except yaml.YAMLError as exc:
        raise SpliceError(f"the spliced file is not valid YAML: {exc}") from None
    if reread != expected:
        raise SpliceError("the spliced file does not read back as the planned experiment")
    return result


def _block_end(lines: Sequence[str], start: int) -> int:
    """One past the block's last indented line: blank and comment lines after it belong to
    what follows."""
    end = start + 1
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line[0] not in " \t":
            break
        end = i + 1
    return end


def _insertion_point(lines: Sequence[str]) -> int:
    """Before the top-level ``stages:`` and the comment lines right above it; else the end."""
    for i, line in enumerate(lines):
        if _STAGES.match(line):
            while i > 0 and lines[i - 1].startswith("#"):
                i -= 1
            return i
    return len(lines)


def _indent(lines: Sequence[str]) -> str:
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#") and line[0] in " \t":
            return line[: len(line) - len(line.lstrip(" \t"))]
    return "  "


def _comment(rest: str) -> str:
    """The comment after ``placement:`` on its line (outside any quoted text), or ''."""
    quote = ""
    for i, char in enumerate(rest):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or rest[i - 1] in " \t"):
            return rest[i:].rstrip()
    return ""


def _flow(entry: Mapping[str, Any]) -> str:
    text = yaml.safe_dump(dict(entry), default_flow_style=True, sort_keys=False, width=2**31)
    return text.strip()
