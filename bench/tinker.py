"""The Tinker SDK through ``hybridflow serve`` against the library API on the same work, one after
the other on this machine: a GRPO-shaped step (``forward_backward`` with the importance-sampling
loss on sampled-shaped rows, then ``optim_step``), and the cost of one small call (the HTTP layer,
the futures and the server's translation, over the mesh's own call).

    python -m bench.tinker                       # SmolLM2-135M (imported from the wheel), 6 steps
    python -m bench.tinker --model tiny --steps 10   # the 1.1M test model

The last line is a JSON object: ``sdk_step_s`` and ``api_step_s`` (median step time),
``step_ratio`` (target <= 1.15), ``sdk_call_ms`` and ``api_call_ms`` (median of a one-row
``forward`` / ``log_probs``), ``sdk_calls_per_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import hybridflow as hf
from deploy.commands.serve import read_url

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-bench"


def rows(batch: int, prompt: int, response: int, seed: int) -> list[dict[str, Any]]:
    """Sampled-shaped rows: a prompt, a response, the sampler's log-probs and an advantage."""
    rng = random.Random(seed)
    found = []
    for _ in range(batch):
        tokens = [1] + [rng.randrange(3, 250) for _ in range(prompt + response - 1)]
        found.append(
            {
                "tokens": tokens,
                "logprobs": [-rng.uniform(0.5, 3.0) for _ in range(response)],
                "advantage": rng.uniform(-1, 1),
                "prompt": prompt,
            }
        )
    return found


def sdk_side(url: str, base: str, work: list[list[dict]], calls: int) -> dict[str, float]:
    import tinker
    from tinker import types

    def datum(r: dict) -> types.Datum:
        n, p = len(r["tokens"]) - 1, r["prompt"]
        return types.Datum(
            model_input=types.ModelInput.from_ints(r["tokens"][:-1]),
            loss_fn_inputs=cast(  # lists: the SDK makes them TensorData
                Any,
                {
                    "target_tokens": r["tokens"][1:],
                    "logprobs": [0.0] * (p - 1) + r["logprobs"],
                    "advantages": [0.0] * (p - 1) + [r["advantage"]] * (n - p + 1),
                },
            ),
        )

    adam = types.AdamParams(learning_rate=1e-4)
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=16, seed=0).result()
        times = []
        for batch in work:
            start = time.perf_counter()
            tc.forward_backward([datum(r) for r in batch], "importance_sampling").result()
            tc.optim_step(adam).result()
            times.append(time.perf_counter() - start)
        one = [datum(work[0][0])]
        call = []
        for _ in range(calls):
            start = time.perf_counter()
            tc.forward(one, "importance_sampling").result()
            call.append(time.perf_counter() - start)
    return {"step": statistics.median(times[1:]), "call": statistics.median(call)}


async def api_side(experiment: Path, run_dir: Path, work: list[list[dict]], calls: int) -> dict:
    def datum(r: dict) -> hf.Datum:
        p = r["prompt"]
        return hf.Datum(
            prompt=r["tokens"][:1],
            response=r["tokens"][1:],
            old_log_probs=[0.0] * (p - 1) + r["logprobs"],
            advantages=[0.0] * (p - 1) + [r["advantage"]] * (len(r["tokens"]) - p),
        )

    loss = hf.PolicyLossConfig(kind="importance_sampling", dual_clip=None)
    adam = hf.AdamStep(lr=1e-4)
    async with hf.mesh(experiment, run_dir=run_dir) as m:
        times = []
        for batch in work:
            start = time.perf_counter()
            await m.forward_backward([datum(r) for r in batch], loss, reduction="sum")
            await m.optim_step(adam)
            times.append(time.perf_counter() - start)
        one = [datum(work[0][0])]
        call = []
        for _ in range(calls):
            start = time.perf_counter()
            await m.log_probs(one)
            call.append(time.perf_counter() - start)
    return {"step": statistics.median(times[1:]), "call": statistics.median(call)}


def model_folder(name: str, folder: Path) -> Path:
    target = folder / name
    if name == "tiny":
        from roles.modeling.models import init_model

        return Path(init_model(target, "tiny", seed=0))
    subprocess.run(
        [sys.executable, "-m", "deploy.cli", "model", "import-gguf", str(target)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="rows per step")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    model = model_folder("tiny" if args.model == "tiny" else "SmolLM2-135M-Instruct", folder)
    work = [rows(args.batch, 24, 12, seed) for seed in range(args.steps)]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "serve",
            "--base-model",
            str(model),
            "--port",
            "0",
            "--api-key",
            KEY,
            "--run-dir",
            str(folder / "serve"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = read_url(server, timeout_s=120)
        os.environ["TINKER_TELEMETRY"] = "0"
        sdk = sdk_side(url, model.name, work, args.calls)
    finally:
        server.terminate()
        server.wait(timeout=120)
    experiment = next((folder / "serve" / "models").iterdir()) / "experiment.yaml"
    api = hf.run(lambda: api_side(experiment, folder / "library", work, args.calls))
    result = {
        "bench": "tinker",
        "model": args.model,
        "sdk_step_s": round(sdk["step"], 3),
        "api_step_s": round(api["step"], 3),
        "step_ratio": round(sdk["step"] / api["step"], 3),
        "sdk_call_ms": round(1000 * sdk["call"], 1),
        "api_call_ms": round(1000 * api["call"], 1),
        "sdk_calls_per_s": round(1 / sdk["call"], 1),
    }
    print(
        f"step: SDK {sdk['step']:.3f} s, library {api['step']:.3f} s "
        f"({result['step_ratio']}x); one call: SDK {result['sdk_call_ms']} ms, library "
        f"{result['api_call_ms']} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
