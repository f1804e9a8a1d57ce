"""GRPO on the quickstart's task, written as your own program against the library.

    python examples/api/grpo.py                      # SFT then GRPO, as examples/quickstart.yaml
    python examples/api/grpo.py --sft-steps 40 --steps 6 --val 64   # a quick try

    # the same loop, the rollout group in a SLURM job (this machine the login node)
    python examples/api/grpo.py --clusters examples/clusters/here_and_slurm.yaml \
        --set 'roles.rollout={model: base}' --set 'placement.gen={roles: [rollout], nproc: 1}'

The groups (models, roles, placement) come from examples/quickstart.yaml; its stages are not
run: this file is the algorithm. Each GRPO step samples n answers per prompt, scores them with the
reward role, takes each answer's advantage against its group, and takes one policy-gradient step.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import hybridflow as hf

QUICKSTART = Path(__file__).resolve().parents[1] / "quickstart.yaml"


async def accuracy(m: hf.Mesh, prompts: list[dict], max_new_tokens: int) -> float:
    """Greedy answers to held-out prompts, scored by the reward role (1 = right)."""
    answers = await m.sample(
        prompts, hf.SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    score, _ = await m.score(answers)
    return float(score.mean())


async def main(args: argparse.Namespace) -> None:
    async with hf.mesh(QUICKSTART, *args.set, run_dir=args.run_dir, clusters=args.clusters) as m:
        held_out = hf.rows(f"builtin:arithmetic?n={args.val}&split=test")
        print(f"held-out accuracy at the start: {await accuracy(m, held_out, 8):.3f}")

        # SFT on noisy demonstrations (the quickstart's first stage)
        demos = hf.rows("builtin:arithmetic?n=64000&split=sft&noise=0.7", sft=True)
        await m.configure_optim(
            hf.OptimConfig(
                lr=2e-3,
                betas=(0.9, 0.98),
                weight_decay=0.1,
                warmup_steps=min(100, args.sft_steps),
                schedule="cosine",
                total_steps=args.sft_steps,
            )
        )
        order = random.Random(args.seed)
        for step in range(args.sft_steps):
            metrics = await m.sft_step(order.sample(demos, 64))
            m.log({"train/loss": metrics["loss"]}, step=step + 1)
        print(f"after SFT: {await accuracy(m, held_out, 8):.3f}")

        # GRPO (the quickstart's second stage)
        prompts = hf.rows("builtin:arithmetic?n=6960&split=train")
        await m.configure_optim(hf.OptimConfig(lr=1e-4, warmup_steps=5))
        loss = hf.PolicyLossConfig(dual_clip=None, agg="token-mean")
        for step in range(args.steps):
            began = time.perf_counter()
            picked = order.sample(prompts, args.prompts)
            sampling = hf.SamplingConfig(temperature=1.0, n=args.n, max_new_tokens=8, seed=step)
            batch = await m.sample(picked, sampling)
            score, _ = await m.score(batch)
            group = torch.tensor(batch.non_tensors["request"])
            mask = batch.tensors["response_mask"]
            batch.tensors["advantages"] = hf.advantages.grpo(score, group, mask)
            batch.tensors["old_log_probs"] = await m.log_probs(batch)
            metrics = await m.train_step(batch, loss)
            seconds = time.perf_counter() - began
            record = {"train/reward/mean": float(score.mean()), "time/step_s": seconds}
            m.log({**record, "train/weight_version": batch.meta["weight_version"], **metrics})
            print(f"GRPO step {step + 1}: reward {score.mean():.3f}")
        final = await accuracy(m, held_out, 8)
        m.log({"val/score": final})
        print(f"after GRPO: {final:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per GRPO step")
    parser.add_argument("--n", type=int, default=8, help="answers per prompt")
    parser.add_argument("--val", type=int, default=992, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--clusters", type=Path, help="a cluster spec: where each group runs")
    parser.add_argument("--set", action="append", default=[], help="an experiment override")
    arguments = parser.parse_args()
    hf.run(lambda: main(arguments))
