"""docs/deploy.md's command and YAML blocks, checked as a reader would run them.

The runs themselves need clusters (SLURM jobs, Ray, ssh hosts), which the system tests drive with
the same commands; here every block is held to what it can be checked against without one:

- every ``hybridflow`` line that is not a synopsis (no placeholders) parses with the CLI;
- a line that names ``examples/quickstart.yaml`` loads it with the line's ``--set`` overrides and
  passes the checks ``hybridflow run`` makes;
- ``hybridflow keys ... --clients`` in a block about the quickstart names the quickstart's groups
  (the keys the other lines of the block then use);
- every cluster spec parses, and one that says it is for the quickstart places its groups.

The blocks that can run on this machine run here or in the system test named: the plan block
here as far as a one-node cluster goes (the plan written as its comment says, the keys, the
``--submit`` refused because the job could never start) and on two SLURM nodes in
``test_slurm_nodes.py``, whose commands are this block's; the Ray block's run line in
``launchers/test_ray.py``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.cli import build_parser
from deploy.clusters import ClusterSpec, assign
from deploy.experiment import check, load, placement
from tests.conftest import require_system

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"
QUICKSTART = "examples/quickstart.yaml"
#: a synopsis's placeholders (EXP.yaml, N, HOST, NODE_RANK, ...), ellipses and optional parts
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_]*(\.yaml)?|.*(…|\.\.\.|\[|\]).*)$")


def blocks(kind: str) -> list[tuple[int, str]]:
    """(line number, text) of each fenced block of ``kind`` (bash, yaml) in the doc."""
    found, lines = [], DOC.read_text().splitlines()
    start = None
    for i, line in enumerate(lines, start=1):
        if start is None and line.strip() == f"```{kind}":
            start = i
        elif start is not None and line.strip() == "```":
            found.append((start, "\n".join(lines[start : i - 1])))
            start = None
    return found


def commands(text: str) -> list[list[str]]:
    """The block's ``hybridflow`` commands (continuations joined, comments dropped), as argv."""
    joined = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]  # VAR=value before the command
        if words and words[0] == "hybridflow":
            found.append(words)
    return found


def synopsis(argv: list[str]) -> bool:
    return any(PLACEHOLDER.match(word) for word in argv)


def block_with(marker: str) -> tuple[str, list[list[str]]]:
    """The text and ``hybridflow`` commands (as argv) of the doc's one bash block that contains
    ``marker``: what a test runs, so the doc and the run cannot part."""
    (text,) = [t for _, t in blocks("bash") if marker in t]
    return text, commands(text)


def substituted(argv: list[str], **paths: Path) -> list[str]:
    """``argv`` with the doc's relative paths (``examples/quickstart.yaml``, ``planned.yaml``,
    ``keys``, not the command's name) replaced by a test's: ``{"planned.yaml": tmp / "planned.yaml"}`` as keywords
    with dots and slashes spelled ``_`` (one the line lacks is ignored); the doc's ``hybridflow`` by this python's CLI."""
    where = {word.replace(".", "_").replace("/", "_"): word for word in argv[2:]}
    swapped = {where[k]: str(v) for k, v in paths.items() if k in where}
    return [sys.executable, "-m", "deploy.cli", argv[1]] + [swapped.get(w, w) for w in argv[2:]]


PLAN_BLOCK = "hybridflow plan examples/quickstart.yaml --gpus 4"


BASH = blocks("bash")
SPECS = [(n, t) for n, t in blocks("yaml") if re.search(r"^clusters:", t, re.M)]


def test_the_doc_has_the_blocks_this_checks() -> None:
    runnable = [argv for _, text in BASH for argv in commands(text) if not synopsis(argv)]
    assert len(runnable) >= 6, runnable
    assert len(SPECS) >= 3, SPECS


@pytest.mark.parametrize(("line", "text"), BASH, ids=[f"line{n}" for n, _ in BASH])
def test_each_command_block_parses_and_fits_the_quickstart(line: int, text: str) -> None:
    parser = build_parser()
    groups: set[str] = set()
    clients: list[str] = []
    for argv in commands(text):
        if synopsis(argv):
            continue
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"docs/deploy.md:{line}: {shlex.join(argv)} does not parse")
        if QUICKSTART in argv:
            sets = [argv[i + 1] for i, word in enumerate(argv) if word == "--set"]
            exp = load(ROOT / QUICKSTART, sets, quick="--quick" in argv)
            check(exp, run=False)
            groups |= set(placement(exp))
        if argv[1] == "keys" and "--clients" in argv:
            clients += argv[argv.index("--clients") + 1].split(",")
    if groups and clients:  # the block's keys are for the quickstart's groups
        assert set(clients) <= groups, (f"docs/deploy.md:{line}", clients, groups)


@pytest.mark.parametrize(("line", "text"), SPECS, ids=[f"line{n}" for n, _ in SPECS])
def test_each_cluster_spec_parses_and_one_for_the_quickstart_places_it(
    line: int, text: str
) -> None:
    raw = yaml.safe_load(text)
    raw.setdefault("controller", {"bind": "tcp://127.0.0.1:0"})  # a fragment of a spec
    spec = ClusterSpec.model_validate(raw)
    if "quickstart" in text:
        exp = load(ROOT / QUICKSTART, [], quick=True)
        where = assign(spec, exp)
        assert set(where) == set(placement(exp)), (f"docs/deploy.md:{line}", where)


def test_the_plan_block_runs_here_as_far_as_one_node_goes(tmp_path: Path) -> None:
    """The block run as written (with the quickstart's absolute path) in a fresh folder: the
    plan writes the group its comment shows, the keys are made, and on this machine's one-node
    SLURM cluster the two-node ``--submit`` is refused before ``sbatch`` (the job could never
    start). On two nodes the same commands train (test_slurm_nodes.py)."""
    from tests.deploy.test_slurm import cluster_up

    require_system("SLURM", cluster_up(), "start a one-node cluster with .ci/slurm-up")
    text, (plan, keys, slurm) = block_with(PLAN_BLOCK)
    quickstart = ROOT / QUICKSTART
    for argv in (plan, keys):
        done = subprocess.run(
            substituted(argv, examples_quickstart_yaml=quickstart),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (shlex.join(argv), done.stderr[-2000:])
    (shown,) = [line.lstrip("# ").strip() for line in text.splitlines() if "placement:" in line]
    written = (tmp_path / "planned.yaml").read_text().splitlines()
    at = written.index("placement:")
    assert f"placement: {written[at + 1].strip()}" == shown, written[at : at + 3]
    assert (tmp_path / "keys" / "main.key_secret").exists()
    done = subprocess.run(
        substituted(slurm), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--nodes=2: the default partition has 1 node(s); the job would never start" in (
        " ".join(done.stderr.split())
    )
