"""The TRL half of ``bench.e2e_vs_trl``: the same GRPO work done by ``trl.GRPOTrainer`` on CPU.

``run_trl(model_dir, prompts, reward, steps=..., prompts_per_step=..., max_new_tokens=..., lr=...)``
trains the model in ``model_dir`` for ``steps`` optimizer steps, each on one fresh generation batch
of ``prompts_per_step`` prompts x ``n`` samples (``per_device_train_batch_size`` counts completions
and equals ``generation_batch_size``, so ``steps_per_generation`` = 1 and ``num_iterations`` = 1:
no completion is trained on twice), and returns per-step wall times, completion tokens and rewards.

Needs the ``bench`` extra (trl, accelerate, datasets). TRL details this relies on (trl 1.16):

- Plain-text prompts are tokenized with ``processing_class(text=prompts)``, i.e. with the
  tokenizer's default ``add_special_tokens=True``. Our byte tokenizer has no post-processor, so that
  adds nothing; hybridflow's own prompts are ``[bos, *bytes]``, so we put the literal ``"<s>"``
  (a registered special token, so it encodes to the single id 257) in front of each prompt. The
  reward sees the prompt without it.
- Completions reach the reward decoded with ``skip_special_tokens=True``: the ``</s>`` is gone.
- Generation stops on ``tokenizer.eos_token_id`` (258) plus the model's generation-config eos ids;
  the completion mask keeps tokens up to and including the first eos, which is what
  ``completions/mean_length`` counts and what ``completion_ids`` given to reward functions hold.
- Defaults kept: ``loss_type="dapo"``, ``scale_rewards="group"``, ``epsilon=0.2``,
  ``max_grad_norm=1.0``, AdamW (fused torch), ``top_p=1``, ``top_k=0`` (off).
  ``activation_checkpointing=False`` is the non-deprecated spelling of ``gradient_checkpointing``
  (GRPOConfig turns it on by default).

``python -m bench.trl_side`` is a smoke run on the tiny model (``--size small``, ``--steps``,
``--prompts``, ``--n``, ``--tokens`` to vary it); its last line is the result as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

RewardFn = Callable[[str, str, dict], float]


def _no_checkpointing(config: type) -> dict[str, Any]:
    """Activation checkpointing off, in the spelling this transformers has: 5.20+ names it
    ``activation_checkpointing``; 5.19 (vLLM's cap) only ``gradient_checkpointing``."""
    names = {f.name for f in dataclasses.fields(config)}
    if "activation_checkpointing" in names:
        return {"activation_checkpointing": False}
    return {"gradient_checkpointing": False}


def run_trl(
    model_dir: str,
    prompts: list[dict],
    reward: RewardFn,
    *,
    steps: int,
    prompts_per_step: int,
    n: int = 8,
    max_new_tokens: int,
    lr: float,
    temperature: float = 1.0,
    seed: int = 0,
    threads: int = 1,
    bf16: bool = False,
    gpu: bool = False,
    lora: Any = None,
) -> dict[str, Any]:
    """Train with trl.GRPOTrainer on CPU for ``steps`` steps; timings, token counts and rewards.

    ``prompts`` are rows with a plain-text "prompt"; the whole row is passed to ``reward`` as its
    third argument. Rows are taken in the order given (``shuffle_dataset=False``), cycling if
    fewer than ``steps * prompts_per_step``. ``bf16`` is the Trainer's own ``bf16=True`` (bf16
    autocast through accelerate, on CPU too), TRL's mixed-precision setting. ``gpu``: on the
    first CUDA device (the Trainer moves the model there; ``use_cpu=False``). ``lora``: a
    ``roles.modeling.lora.LoraSettings``; TRL then trains PEFT adapters of the same rank, alpha,
    dropout and target modules (its ``peft_config``) and the base stays frozen.
    """
    from trl import GRPOConfig, GRPOTrainer

    from roles.modeling.models import load_causal_lm, load_tokenizer

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).train()
    bos = _bos_prefix(tokenizer)
    recorder = _recorder()
    batch = prompts_per_step * n
    with tempfile.TemporaryDirectory(prefix="trl_bench_") as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=not gpu,
            bf16=bf16,
            **_no_checkpointing(GRPOConfig),
            beta=0.0,
            report_to="none",
            save_strategy="no",
            num_generations=n,
            per_device_train_batch_size=batch,
            generation_batch_size=batch,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_completion_length=max_new_tokens,
            temperature=temperature,
            learning_rate=lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=steps,
            logging_steps=1,
            seed=seed,
            data_seed=seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
            shuffle_dataset=False,  # the rows in the order given: the same prompts per step as hybridflow
        )
        assert config.steps_per_generation == 1 and config.generation_batch_size == batch
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=_reward_function(prompts, reward, bos, recorder.tokens),
            args=config,
            train_dataset=_dataset(prompts, bos),
            processing_class=tokenizer,
            callbacks=[recorder],
            peft_config=lora.peft_config() if lora is not None else None,
        )
        t0 = time.perf_counter()
        trainer.train()
        total_s = time.perf_counter() - t0
    return _result(recorder, batch, total_s, prompts_per_step, n, max_new_tokens, threads)


def _bos_prefix(tokenizer: Any) -> str:
    """TRL tokenizes plain-text prompts with add_special_tokens=True. A tokenizer made or exported
    by hybridflow adds BOS by itself (nothing to prefix); an older one adds nothing, and a literal
    bos token in front gives the same ``[bos, *text]`` as hybridflow (checked here, either way)."""
    bos = tokenizer.bos_token or ""
    probe = "1+2="
    expected = [tokenizer.bos_token_id, *tokenizer.encode(probe, add_special_tokens=False)]
    for prefix in ("", bos):
        if tokenizer(prefix + probe)["input_ids"] == expected:
            return prefix
    raise RuntimeError("the tokenizer encodes a prompt as neither [bos, *prompt] nor with '<bos>'")


def _dataset(prompts: list[dict], bos: str) -> Any:
    """Only the row index travels through TRL; the reward gets the original row back."""
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt": [bos + row["prompt"] for row in prompts], "row_idx": list(range(len(prompts)))}
    )


def _reward_function(
    rows: list[dict], reward: RewardFn, bos: str, tokens_seen: list[int]
) -> Callable[..., list[float | None]]:
    def reward_func(prompts, completions, completion_ids, row_idx, **kwargs) -> list[float | None]:
        tokens_seen.append(sum(len(ids) for ids in completion_ids))
        return [
            float(reward(p[len(bos) :] if p.startswith(bos) else p, c, rows[i]))
            for p, c, i in zip(prompts, completions, row_idx, strict=True)
        ]

    reward_func.__name__ = "reward"
    return reward_func


def _recorder() -> Any:
    """A TrainerCallback that times each step and keeps the logged reward and lengths."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.step_times: list[float] = []
            self.tokens: list[int] = []  # from completion_ids seen by the reward, per step
            self.logged: list[dict[str, float]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logged.append(dict(logs))

    return Recorder()


def _result(
    recorder: Any,
    batch: int,
    total_s: float,
    prompts_per_step: int,
    n: int,
    max_new_tokens: int,
    threads: int,
) -> dict[str, Any]:
    step_times, logged = recorder.step_times, recorder.logged
    completion_tokens = [round(log["completions/mean_length"] * batch) for log in logged]
    if completion_tokens != recorder.tokens:
        raise RuntimeError(
            f"token counts disagree: logs {completion_tokens}, seen {recorder.tokens}"
        )
    rewards = [float(log["reward"]) for log in logged]
    later = range(1, len(step_times)) if len(step_times) > 1 else range(len(step_times))
    return {
        "steps": len(step_times),
        "prompts_per_step": prompts_per_step,
        "n": n,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "step_s": [round(t, 4) for t in step_times],
        "step_s_median": statistics.median(step_times[i] for i in later),
        "completion_tokens": completion_tokens,
        "tok_s": statistics.median(completion_tokens[i] / step_times[i] for i in later),
        "reward_per_step": rewards,
        "reward_first": rewards[0],
        "reward_last": statistics.fmean(rewards[-3:]),
        "clipped_ratio": [log.get("completions/clipped_ratio") for log in logged],
        "train_s": round(total_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    from controller.tasks import arithmetic
    from roles.modeling.models import init_model
    from roles.rules import arithmetic_reward

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=8, help="max new tokens")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="trl_model_") as d:
        init_model(d, args.size, seed=0, overwrite=True)
        result = run_trl(
            d,
            arithmetic(args.steps * args.prompts, split="train", seed=0),
            arithmetic_reward,
            steps=args.steps,
            prompts_per_step=args.prompts,
            n=args.n,
            max_new_tokens=args.tokens,
            lr=args.lr,
            threads=args.threads,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
