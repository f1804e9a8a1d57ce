"""The engine factory: ``backend`` picks the engine; megatron without megatron-core names the extra.

The missing install is made real in a child interpreter: ``sys.modules["megatron"] = None`` is
what Python itself does for a package it must not import, so ``megatron.core`` cannot be found
there, exactly as on a machine without the extra.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from roles.engines.training.factory import MEGATRON_EXTRA, require_megatron_core


def test_megatron_core_is_found_where_installed() -> None:
    require_megatron_core()  # the test install carries the [megatron] extra (Makefile)


@pytest.mark.timeout(300)  # a fresh interpreter importing torch: ~8 s idle, 70 s seen under load
def test_megatron_without_megatron_core_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["megatron"] = None
        from roles.engines.training.config import EngineConfig
        from roles.engines.training.factory import EngineUnavailable, build_engine
        try:
            build_engine(EngineConfig(model="unused", backend="megatron"), ctx=None)
        except EngineUnavailable as err:
            print("ERROR", err)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=True
    )
    assert "ERROR backend: megatron needs megatron-core" in out.stdout
    assert MEGATRON_EXTRA in out.stdout
