"""docs/api.md's reference is what ``python -m deploy.apidoc`` generates from the code now, and
every public name has a docstring to generate it from: a name added, renamed or re-described
without rerunning it fails here. The page's whole programs run as written, so a snippet that
drifts from the library fails too."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import deploy.apidoc as apidoc
import hybridflow as hf
import hybridflow.steps as steps

#: public names that have no docstring yet (in files this test's author could not edit); remove
#: a name here when it gets one — the test fails on a name listed here that has one
UNDOCUMENTED: set[str] = set()


def test_the_committed_reference_is_what_the_code_generates() -> None:
    lines: list[str] = []
    assert apidoc.main(["--check"], write=lines.append) == 0, (
        "docs/api.md is stale: run python -m deploy.apidoc"
    )


ROOT = Path(__file__).resolve().parents[2]


def programs() -> list[str]:
    """docs/api.md's code blocks that are whole programs (they start by importing the library;
    the others are fragments of a loop)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    return [b for b in blocks if re.match(r"(import torch\n\n)?import hybridflow as hf\n", b)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_pages_programs_run_as_written(tmp_path: Path) -> None:
    """In a folder of their own with the examples beside them, as a reader copies them: the
    async GRPO step and the blocking one-prompt ``mesh_sync`` (one prompt on the quickstart's 2
    ranks crashed once)."""
    found = programs()
    assert len(found) == 2, found
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for code in found:
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
    assert len(list((tmp_path / "runs").iterdir())) == 2


def test_every_public_name_has_a_docstring() -> None:
    missing = {entry.name for entry in apidoc.public() if not apidoc.own_doc(entry.obj)}
    assert not missing - UNDOCUMENTED, (
        f"public names without a docstring: {sorted(missing - UNDOCUMENTED)}"
    )
    assert not UNDOCUMENTED - missing, (
        f"these have a docstring now; remove them from UNDOCUMENTED: {sorted(UNDOCUMENTED - missing)}"
    )


def test_the_reference_has_every_exported_name_and_every_method_of_the_mesh() -> None:
    text = apidoc.generate()
    names = [f"hf.{n}" for n in hf.__all__] + [f"hybridflow.steps.{n}" for n in steps.__all__]
    assert [n for n in names if f"#### `{n}`" not in text] == []
    for cls in (hf.Mesh, hf.SyncMesh):
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            if isinstance(member, property):
                assert f"\n{name}: " in text, f"{cls.__name__}.{name}"
            elif inspect.isfunction(member):
                assert f"def {name}(" in text, f"{cls.__name__}.{name}"
    assert "| `max_new_tokens` | int, ≥ 1 | `64` |" in text  # SamplingConfig's table


async def _example(
    batch: list[int], /, prompts: str | Path, *rest: str, role: str = "actor", timeout: float = 1.0
) -> dict[str, Any]:
    """Do one thing. Then e.g. another, with ``code`` and <tags> in *stars*.

    More."""
    return {}


def test_signatures_wrap_like_the_code_and_a_summary_is_the_first_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert apidoc.signature("hf._example", _example) == [
        "async def _example(",
        '    batch: list[int], /, prompts: str | Path, *rest: str, role: str = "actor", '
        "timeout: float = 1.0",
        ") -> dict[str, Any]",
    ]
    monkeypatch.setattr(apidoc, "WIDTH", 40)
    wrapped = apidoc.signature("hf._example", _example)
    assert wrapped[1:3] == ["    batch: list[int],", "    /,"] and wrapped[-2:] == [
        "    timeout: float = 1.0,",
        ") -> dict[str, Any]",
    ]
    summary = apidoc.first_sentence(apidoc.own_doc(_example))
    assert summary == "Do one thing."
    assert apidoc.markdown("``a<b>`` and <b> *c*") == "`a<b>` and &lt;b> \\*c\\*"

    @asynccontextmanager
    async def opened(name: str) -> Any:
        yield name

    assert apidoc.signature("hf.opened", opened) == [
        "@asynccontextmanager",
        "async def opened(name: str) -> Any",
    ]
    assert apidoc.signature("hf.Mesh.version", vars(hf.Mesh)["version"]) == ["version: int"]


def test_a_stale_reference_is_caught_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = tmp_path / "api.md"
    stale = apidoc.DOC.read_text(encoding="utf-8").replace("def sample(", "def sampled(")
    doc.write_text(stale, encoding="utf-8")
    monkeypatch.setattr(apidoc, "DOC", doc)
    lines: list[str] = []
    assert apidoc.main(["--check"], write=lines.append) == 1 and "stale" in lines[-1]
    assert doc.read_text(encoding="utf-8") == stale  # --check writes nothing
    assert apidoc.main([], write=lines.append) == 0
    assert apidoc.main(["--check"], write=lines.append) == 0
    assert doc.read_text(encoding="utf-8").startswith("# hybridflow as a library")
    doc.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="needs exactly one"):
        apidoc.main([], write=lines.append)
