"""Rejection sampling (RAFT / expert iteration) on the quickstart's task, in your own program: an
algorithm the YAML stages cannot express.

    python examples/api/rejection_sampling.py                  # SFT, then 10 rounds
    python examples/api/rejection_sampling.py --sft-steps 40 --rounds 2 --val 64   # a quick try

Each round samples n answers per prompt, keeps the best-scored answer of each prompt when it
scored (the reward role's rule: right or wrong), and fine-tunes on the kept answers.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import hybridflow as hf

QUICKSTART = Path(__file__).resolve().parents[1] / "quickstart.yaml"


async def accuracy(m: hf.Mesh, prompts: list[dict]) -> float:
    answers = await m.sample(prompts, hf.SamplingConfig(temperature=0.0, max_new_tokens=8))
    score, _ = await m.score(answers)
    return float(score.mean())


async def main(args: argparse.Namespace) -> None:
    async with hf.mesh(QUICKSTART, run_dir=args.run_dir) as m:
        held_out = hf.rows(f"builtin:arithmetic?n={args.val}&split=test")
        order = random.Random(args.seed)
        demos = hf.rows("builtin:arithmetic?n=64000&split=sft&noise=0.7", sft=True)
        await m.configure_optim(hf.OptimConfig(lr=2e-3, betas=(0.9, 0.98), weight_decay=0.1))
        for _ in range(args.sft_steps):
            await m.sft_step(order.sample(demos, 64))
        print(f"after SFT: {await accuracy(m, held_out):.3f}")

        prompts = hf.rows("builtin:arithmetic?n=6960&split=train")
        await m.configure_optim(hf.OptimConfig(lr=args.lr))
        for r in range(args.rounds):
            picked = order.sample(prompts, args.prompts)
            sampling = hf.SamplingConfig(temperature=1.0, n=args.n, max_new_tokens=8, seed=r)
            batch = await m.sample(picked, sampling)
            score, _ = await m.score(batch)
            best: dict[int, tuple[float, str]] = {}
            for request, response, value in zip(
                batch.non_tensors["request"],
                batch.non_tensors["response"],
                score.tolist(),
                strict=True,
            ):
                if value > 0 and value > best.get(request, (0.0, ""))[0]:
                    best[request] = (value, response)
            kept = [
                {"prompt": picked[i]["prompt"], "response": text} for i, (_, text) in best.items()
            ]
            for start in range(0, len(kept), 64):
                await m.sft_step(kept[start : start + 64])
            m.log({"raft/kept_share": len(kept) / len(picked), "raft/reward": float(score.mean())})
            print(
                f"round {r + 1}: kept {len(kept)} of {len(picked)} prompts, reward {score.mean():.3f}"
            )
        print(f"after rejection sampling: {await accuracy(m, held_out):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=256, help="prompts per round")
    parser.add_argument("--n", type=int, default=8, help="answers per prompt")
    parser.add_argument("--lr", type=float, default=2e-4, help="the rounds' fine-tuning rate")
    parser.add_argument("--val", type=int, default=992, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None)
    arguments = parser.parse_args()
    hf.run(lambda: main(arguments))
