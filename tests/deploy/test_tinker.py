"""``hybridflow serve`` driven by the real ``tinker`` SDK (0.38), never a hand-made HTTP client:
one server process on the tiny model (fp32), its training clients meshes of their own.

- the SDK's calls give what the library API gives on the same experiment: ``forward_backward``'s
  per-token log-probs and summed loss (cross-entropy and PPO), and the weights after
  ``optim_step`` with ``AdamParams`` (the log-probs of a ``forward`` after it), within 1e-6;
- ``save_state`` then ``create_training_client_from_state_with_optimizer`` then one more step
  equals the straight run's step bitwise; two training clients at once are isolated;
- sampling with a seed repeats, its log-probs are the trainer's at temperature 1, and a stop
  token ends a sample;
- refused by name, changing nothing: an unknown base model, an unknown loss, datums whose
  lengths disagree, targets that are not the input shifted, a missing or wrong key, a future id
  the server never gave, a sampler whose training client has stepped since;
- SIGTERM stops a server and every group it started; one started again with ``--resume``
  serves the saved states; with a restart policy, a rank killed under a client leaves its
  weights bitwise where an undisturbed twin's are (each on a server of its own).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

import hybridflow as hf  # noqa: E402
from bench.api_chaos import Chaos  # noqa: E402
from deploy.commands.serve import read_url  # noqa: E402
from roles.modeling.models import init_model  # noqa: E402
from tests.conftest import require_system, run  # noqa: E402

KEY = "tml-hybridflow-test"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A ``hybridflow serve`` process on the tiny model; its base URL and run folder."""
    root = tmp_path_factory.mktemp("tinker")
    model = init_model(root / "tiny", "tiny", seed=0)
    run_dir = root / "serve"
    proc = start_server(model, run_dir, "--max-models", "3")
    try:
        url = read_url(proc, timeout_s=120)
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY=KEY, TINKER_TELEMETRY="0")
        yield {"url": url, "run_dir": run_dir, "proc": proc, "model": model}
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server stops its groups), then SIGKILL if it has not ended in a minute."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def datum(tokens: list[int], weights: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def ppo_datum(tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": logprobs,
            "advantages": [0.0] * 2 + [advantage] * (n - 2),
        },
    )


ROWS = [[1, 50, 51, 52, 53, 54], [1, 60, 61, 62]]
WEIGHTS = [[0.0, 1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def logprobs_of(out: Any) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def close(a: list[list[float]], b: list[list[float]], tol: float = 1e-6) -> bool:
    return all(len(x) == len(y) for x, y in zip(a, b, strict=True)) and all(
        abs(p - q) <= tol for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True)
    )


def test_the_sdk_trains_as_the_library_api(server: dict[str, Any]) -> None:
    with tinker.ServiceClient() as sc:
        trains_as_the_library_api(sc, server)


def trains_as_the_library_api(sc: Any, server: dict[str, Any]) -> None:
    assert [m.model_name for m in sc.get_server_capabilities().supported_models] == ["tiny"]
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()
    info = tc.get_info()
    assert info.model_data.model_name == "tiny" and info.lora_rank == 8
    assert tc.get_tokenizer().encode("1+1") != []  # loaded from the folder get_info names

    ce = tc.forward_backward(
        [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)], "cross_entropy"
    ).result()
    tc.optim_step(ADAM).result()
    old = logprobs_of(
        tc.forward(
            [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)], "cross_entropy"
        ).result()
    )
    ppo = tc.forward_backward(
        [ppo_datum(r, lp, a) for r, lp, a in zip(ROWS, old, (1.0, -0.5), strict=True)],
        "ppo",
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    ).result()
    tc.optim_step(ADAM).result()
    after = logprobs_of(
        tc.forward(
            [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)], "cross_entropy"
        ).result()
    )

    folder = next((server["run_dir"] / "models").iterdir())
    library = run(lambda: library_run(folder / "experiment.yaml", folder.parent / "library"))
    assert close(logprobs_of(ce), library["ce_logprobs"]), (logprobs_of(ce), library)
    assert abs(ce.metrics["loss:sum"] - library["ce_loss"]) <= 1e-5
    assert close(old, library["old"])
    assert abs(ppo.metrics["loss:sum"] - library["ppo_loss"]) <= 1e-6
    assert close(after, library["after"])
    assert not close(after, old, 1e-3)  # the steps moved the weights


async def library_run(experiment: Path, run_dir: Path) -> dict[str, Any]:
    """The same calls through ``hf.mesh`` on the experiment the server wrote for its model."""
    rows = [
        hf.Datum(prompt=r[:1], response=r[1:], weights=w)
        for r, w in zip(ROWS, WEIGHTS, strict=True)
    ]
    adam = hf.AdamStep(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    found: dict[str, Any] = {}
    async with hf.mesh(experiment, run_dir=run_dir) as m:
        lp = await m.log_probs(rows)
        found["ce_logprobs"] = [lp[i, 1 : len(r)].tolist() for i, r in enumerate(ROWS)]
        found["ce_loss"] = -sum(
            w * x
            for ws, xs in zip(WEIGHTS, found["ce_logprobs"], strict=True)
            for w, x in zip(ws, xs, strict=True)
        )
        await m.forward_backward(rows, "cross_entropy", reduction="sum")
        await m.optim_step(adam)
        lp = await m.log_probs(rows)
        found["old"] = old = [lp[i, 1 : len(r)].tolist() for i, r in enumerate(ROWS)]
        ppo_rows = [
            hf.Datum(
                prompt=r[:1],
                response=r[1:],
                old_log_probs=o,
                advantages=[0.0] * 2 + [a] * (len(r) - 3),
            )
            for r, o, a in zip(ROWS, old, (1.0, -0.5), strict=True)
        ]
        loss = hf.PolicyLossConfig(
            kind="ppo", clip_ratio_low=0.1, clip_ratio_high=0.1, dual_clip=None
        )
        metrics = await m.forward_backward(ppo_rows, loss, reduction="sum")
        found["ppo_loss"] = metrics["loss"]
        await m.optim_step(adam)
        lp = await m.log_probs(rows)
        found["after"] = [lp[i, 1 : len(r)].tolist() for i, r in enumerate(ROWS)]
    return found


def test_a_saved_state_resumes_bitwise_and_clients_are_isolated(server: dict[str, Any]) -> None:
    """``save_state``, then a new client from it with its optimizer, then one more step: the
    same weights as the first client's own next step, bitwise (the log-probs of a forward are
    equal floats). The two clients train beside each other without touching each other."""
    with tinker.ServiceClient() as sc:
        resumes_bitwise(sc)


def resumes_bitwise(sc: Any) -> None:
    first = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    data = [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)]
    first.forward_backward(data, "cross_entropy").result()
    first.optim_step(ADAM).result()
    path = first.save_state("one").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/one")
    second = sc.create_training_client_from_state_with_optimizer(path).result()
    before = logprobs_of(second.forward(data, "cross_entropy").result())
    assert before == logprobs_of(first.forward(data, "cross_entropy").result())
    for client in (first, second):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(ADAM).result()
    ahead = logprobs_of(first.forward(data, "cross_entropy").result())
    assert logprobs_of(second.forward(data, "cross_entropy").result()) == ahead
    # the first client steps again: the second is where it was
    first.forward_backward(data, "cross_entropy").result()
    first.optim_step(ADAM).result()
    assert logprobs_of(second.forward(data, "cross_entropy").result()) == ahead
    assert logprobs_of(first.forward(data, "cross_entropy").result()) != ahead


def test_sampling_repeats_with_a_seed_and_gives_the_trainers_log_probs(
    server: dict[str, Any],
) -> None:
    with tinker.ServiceClient() as sc:
        samples(sc)


def samples(sc: Any) -> None:
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 50, 51])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    one = sampler.sample(prompt, 3, params).result()
    again = sampler.sample(prompt, 3, params).result()
    assert [s.tokens for s in one.sequences] == [s.tokens for s in again.sequences]
    assert len(one.sequences) == 3 and all(s.logprobs for s in one.sequences)
    other = sampler.sample(prompt, 3, params.model_copy(update={"seed": 8})).result()
    assert [s.tokens for s in other.sequences] != [s.tokens for s in one.sequences]
    # the base model alone (no saved weights; a mesh of its own): a fresh adapter is the base
    # model, so it draws what the untrained client's sampler drew
    alone = sc.create_sampling_client(base_model="tiny").sample(prompt, 3, params).result()
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in one.sequences]
    # the sampler's log-probs are what the trainer computes for the same tokens
    seq = one.sequences[0]
    full = [1, 50, 51, *seq.tokens]
    trained = tc.forward([datum(full, [1.0] * (len(full) - 1))], "cross_entropy").result()
    tail = logprobs_of(trained)[0][2:]
    assert max(abs(a - b) for a, b in zip(tail, seq.logprobs, strict=True)) < 1e-4
    # a stop token ends a sample, and is its last token
    stop = seq.tokens[1]
    stopped = sampler.sample(prompt, 1, params.model_copy(update={"stop": [stop]})).result()
    assert stopped.sequences[0].tokens == seq.tokens[:2]
    assert stopped.sequences[0].stop_reason == "stop"
    # prompt log-probs (compute_logprobs): the trainer's, none for the first token
    prompt_lps = sampler.compute_logprobs(prompt).result()
    plain = logprobs_of(tc.forward([datum([1, 50, 51], [1.0, 1.0])], "cross_entropy").result())
    assert prompt_lps[0] is None
    assert max(abs(a - b) for a, b in zip(prompt_lps[1:], plain[0], strict=True)) < 1e-5
    # once its training client has stepped, the sampler refuses: its weights are gone
    tc.forward_backward([datum([1, 50, 51], [1.0, 1.0])], "cross_entropy").result()
    tc.optim_step(ADAM).result()
    with pytest.raises(tinker.RequestFailedError, match="has stepped"):
        sampler.sample(prompt, 1, params).result()


def test_bad_requests_are_refused_by_name_and_change_nothing(server: dict[str, Any]) -> None:
    with tinker.ServiceClient() as sc:
        refuses(sc, server)
    wrong = tinker.ServiceClient(api_key="tml-not-the-key")
    with pytest.raises(tinker.AuthenticationError, match="API key"):
        wrong.get_server_capabilities()
    with pytest.raises(tinker.NotFoundError, match="no such future"):
        run(lambda: retrieve(server["url"], "no-such-request"))


def refuses(sc: Any, server: dict[str, Any]) -> None:
    with pytest.raises(tinker.BadRequestError, match="base model 'nope' is not served here"):
        sc.create_lora_training_client(base_model="nope", rank=4).result()
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    data = [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)]
    before = logprobs_of(tc.forward(data, "cross_entropy").result())
    bad = {
        "loss_fn 'stable_reinforce' is not served here": (data, "stable_reinforce", None),
        "sequence_ratio_mask'\\]: marks no position": (
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(ROWS[0][:-1]),
                    loss_fn_inputs={
                        **ppo_datum(ROWS[0], [-1.0] * 5, 1.0).loss_fn_inputs,
                        "sequence_ratio_mask": [0.0] * 5,
                    },
                )
            ],
            "gspo",
            None,
        ),
        "loss_fn_config for dro: beta is required": (
            [ppo_datum(ROWS[0], [-1.0] * 5, 1.0)],
            "dro",
            None,
        ),
        "datum 1.loss_fn_inputs\\['weights'\\]: 2 values for 3 input tokens": (
            [data[0], datum(ROWS[1], [1.0, 1.0])],
            "cross_entropy",
            None,
        ),
        "datum 0: target_tokens\\[1\\] is 9": (
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 9, 4], "weights": [1.0] * 3},
                )
            ],
            "cross_entropy",
            None,
        ),
        "loss_fn_config for ppo: clip_ratio is not read here": (
            [ppo_datum(ROWS[0], [-1.0] * 5, 1.0)],
            "ppo",
            {"clip_ratio": 0.2},
        ),
        "ppo needs advantages": (
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(ROWS[0][:-1]),
                    loss_fn_inputs={"target_tokens": ROWS[0][1:], "logprobs": [-1.0] * 5},
                )
            ],
            "ppo",
            None,
        ),
    }
    for message, (rows, loss, config) in bad.items():
        with pytest.raises(tinker.RequestFailedError, match=message):
            tc.forward_backward(rows, loss, config).result()
    with pytest.raises(tinker.RequestFailedError, match="no gradients since the last step"):
        tc.optim_step(ADAM).result()  # none of the refused calls left gradients behind
    assert logprobs_of(tc.forward(data, "cross_entropy").result()) == before
    # and the client's calls still run in their order after the refusals
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    assert logprobs_of(tc.forward(data, "cross_entropy").result()) != before


async def retrieve(url: str, request_id: str) -> Any:
    """A future id polled with the SDK's own low-level client."""
    from tinker._client import AsyncTinker

    async with AsyncTinker(base_url=url, api_key=KEY) as client:
        return await client.futures.retrieve(
            request=types.FutureRetrieveRequest(request_id=request_id)
        )


def test_a_custom_loss_runs_through_the_served_cross_entropy(server: dict[str, Any]) -> None:
    """``forward_backward_custom`` (the loss in the client, on the server's log-probs): with
    -sum(w log p) it is cross-entropy, so a client stepping on it lands where a twin stepping
    on ``cross_entropy`` does."""
    import torch

    def loss(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        total = sum(
            -(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum()
            for d, lp in zip(data, logprobs, strict=True)
        )
        return total, {"mine": float(total.detach())}

    data = [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)]
    with tinker.ServiceClient() as sc:
        custom = sc.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
        plain = sc.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
        out = custom.forward_backward_custom(data, loss).result()
        reference = plain.forward_backward(data, "cross_entropy").result()
        assert abs(out.metrics["mine"] - reference.metrics["loss:sum"]) < 1e-4, out.metrics
        for client in (custom, plain):
            client.optim_step(ADAM).result()
        after = logprobs_of(custom.forward(data, "cross_entropy").result())
        assert close(after, logprobs_of(plain.forward(data, "cross_entropy").result()))


COOKBOOK = Path(sys.prefix) / "cookbook"  # make installs tinker-cookbook there (Makefile)


def run_recipe(argv: list[str], cwd: Path, env: dict[str, str], last_line: str) -> str:
    """``python -m ARGV`` (a cookbook recipe), its output in a file; what it printed. It must
    exit 0, or be aborted (SIGABRT) by the interpreter's shutdown after printing ``last_line``:
    the SDK's daemon threads may hold stderr's lock as the interpreter ends ("Fatal Python
    error: ... at interpreter shutdown, possibly due to daemon threads"), which is the client's
    exit, not the served work (seen once in CI under load)."""
    log = cwd / "recipe.out"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", *argv], cwd=cwd, env=env, stdout=out, stderr=out, timeout=600
        )
    said = log.read_text(errors="replace")
    aborted_after = done.returncode == -signal.SIGABRT and last_line in said
    assert done.returncode == 0 or aborted_after, (done.returncode, said[-3000:])
    return said


def test_the_cookbooks_math_rl_recipe_runs_unmodified(
    server: dict[str, Any], tmp_path: Path
) -> None:
    """``python -m tinker_cookbook.recipes.math_rl.train``, as its README runs it, with
    command-line settings only (the model's folder as its name, the server as base_url): it
    samples groups, trains two steps with its importance-sampling loss, saves its final state
    and sampler weights, and ends without an error."""
    require_system(
        "tinker-cookbook 0.5.8 (make installs it in .venv/cookbook)",
        (COOKBOOK / "tinker_cookbook").is_dir(),
        str(COOKBOOK),
    )
    log_path = tmp_path / "recipe"
    env = {**os.environ, "PYTHONPATH": str(COOKBOOK)}
    said = run_recipe(
        [
            "tinker_cookbook.recipes.math_rl.train",
            "env=arithmetic",
            f"model_name={server['model']}",
            "renderer_name=role_colon",
            f"base_url={server['url']}",
            "max_steps=2",
            "group_size=4",
            "groups_per_batch=4",
            "lora_rank=8",
            "learning_rate=1e-3",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
        ],
        tmp_path,
        env,
        "Training completed successfully",
    )
    assert "Training completed successfully" in said
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["progress/batch"] for r in rows] == [0, 1]
    for row in rows:  # it sampled, scored, trained and read the server's log-probs back
        assert {"env/all/reward/total", "optim/lr", "time/train_step"} <= set(row), sorted(row)
    saved = [p for p in (server["run_dir"] / "models").glob("*/run/state/*-final")]
    assert sorted(p.name for p in saved) == ["sampler-final", "weights-final"], saved


def test_the_cookbooks_sl_loop_runs_unmodified_and_its_loss_falls(tmp_path: Path) -> None:
    """``python -m tinker_cookbook.recipes.sl_loop`` with command-line settings only. It looks
    its renderer up by a Hugging Face name and loads ``HuggingFaceH4/no_robots``; offline,
    folders of those names in its working directory stand in (the tiny model, served under that
    name with ``--base-model NAME=DIR``; the cookbook's own example conversations as the
    dataset). Four steps of 32 conversations: the mean NLL falls, the final state and sampler
    weights are saved, and nothing else is left running."""
    require_system(
        "tinker-cookbook 0.5.8 (make installs it in .venv/cookbook)",
        (COOKBOOK / "tinker_cookbook").is_dir(),
        str(COOKBOOK),
    )
    name = "meta-llama/Llama-3.2-1B"  # a name the cookbook knows (renderer role_colon)
    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    work = tmp_path / "work"
    (work / name).parent.mkdir(parents=True)
    (work / name).symlink_to(model)  # the tokenizer the recipe loads by that name
    data = work / "HuggingFaceH4" / "no_robots"
    data.mkdir(parents=True)
    conversations = COOKBOOK / "tinker_cookbook" / "example_data" / "conversations.jsonl"
    (data / "train.jsonl").write_text(conversations.read_text())
    run_dir = tmp_path / "serve"
    proc = start_server(model, run_dir, "--base-model", f"{name}={model}")
    try:
        url = read_url(proc, timeout_s=120)
        env = {**os.environ, "PYTHONPATH": str(COOKBOOK), "TINKER_API_KEY": KEY}
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0")
        run_recipe(
            [
                "tinker_cookbook.recipes.sl_loop",
                f"model_name={name}",
                f"base_url={url}",
                f"log_path={work / 'log'}",
                "batch_size=32",
                "max_length=256",
                "lora_rank=8",
                "learning_rate=1e-3",
            ],
            work,
            env,
            "Training completed",
        )
        rows = [
            json.loads(line) for line in (work / "log" / "metrics.jsonl").read_text().splitlines()
        ]
        nll = [r["train_mean_nll"] for r in rows]
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
        assert nll[-1] < nll[0] - 0.1, nll
        saved = sorted(p.name for p in run_dir.glob("models/*/run/state/*-final"))
        assert saved == ["sampler-final", "weights-final"], saved
    finally:
        stop(proc)
    assert group_processes(run_dir) == []


def test_sigterm_stops_every_group_and_a_resumed_server_serves_the_saved_state(
    tmp_path: Path,
) -> None:
    """A server of its own: SIGTERM with a client's group running ends it with every group;
    then ``hybridflow serve --resume --run-dir D`` serves the state the first one saved: a new
    client made from it holds its weights (the same log-probs, bitwise)."""
    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    run_dir = tmp_path / "serve"
    data = [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)]
    first = start_server(model, run_dir)
    try:
        sc = tinker.ServiceClient(base_url=read_url(first, 120), api_key=KEY)  # not closed
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        path = tc.save_state("kept").result().path
        expected = logprobs_of(tc.forward(data, "cross_entropy").result())
        assert group_processes(run_dir) != []
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
        assert group_processes(run_dir) == []
    finally:
        stop(first)
    second = start_server(model, run_dir, "--resume")
    try:
        url = read_url(second, 120)
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            tc = sc.create_training_client_from_state(path).result()
            assert logprobs_of(tc.forward(data, "cross_entropy").result()) == expected
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
    finally:
        stop(second)


def start_server(model: Path, run_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A ``hybridflow serve`` of its own on the tiny model (fp32), its output on a pipe."""
    return subprocess.Popen(
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
            str(run_dir),
            "--set",
            "roles.actor.dtype=fp32",
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def test_a_rank_killed_under_a_client_makes_its_calls_slower_not_wrong(tmp_path: Path) -> None:
    """With a restart policy (``--set placement.main.restart=...``) a training client's rank
    killed between its ``forward_backward`` calls and before its ``optim_step`` is restarted
    below the client: the group rolls back to the snapshot of its last step and replays the
    calls since, so the client's weights end bitwise where an undisturbed twin's do."""
    model = init_model(tmp_path / "tiny", "tiny", seed=0)
    run_dir = tmp_path / "serve"
    proc = start_server(
        model, run_dir, "--set", "placement.main.restart={max: 10, backoff_s: [0.0]}"
    )
    data = [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)]
    try:
        url = read_url(proc, timeout_s=120)
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            calm = sc.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
            hit = sc.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
            folder = run_dir / "models" / hit.get_info().model_id.replace(":", "-") / "run"
            for step in range(3):
                for client in (calm, hit):
                    client.forward_backward(data[:1], "cross_entropy").result()
                    if client is hit and step == 1:
                        kill_rank(folder)  # between two forward_backward calls
                    client.forward_backward(data[1:], "cross_entropy").result()
                    if client is hit and step == 2:
                        kill_rank(folder)  # before the step
                    client.optim_step(ADAM).result()
            expected = logprobs_of(calm.forward(data, "cross_entropy").result())
            assert logprobs_of(hit.forward(data, "cross_entropy").result()) == expected
        events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [e["event"] for e in events if e.get("event") == "rollback"] == ["rollback"] * 2
    finally:
        stop(proc)


def kill_rank(run_dir: Path, rank: int = 0) -> None:
    """SIGKILL a rank of the mesh whose run folder is ``run_dir``; return once it is dead."""
    ranks = json.loads((run_dir / "processes.json").read_text())["ranks"]
    (pid,) = [r["pid"] for r in ranks if (r["group"], r["rank"]) == ("main", rank)]
    os.kill(pid, signal.SIGKILL)
    Chaos._gone(pid)  # dead, or a zombie its launcher reaps


def group_processes(run_dir: Path) -> list[int]:
    """Processes whose command line or working folder names the server's run folder."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + os.readlink(entry / "cwd").encode()
        except OSError:
            continue
        if str(run_dir).encode() in text:
            found.append(int(entry.name))
    return found


def test_dro_and_gspo_step_where_the_same_losses_written_as_custom_ones_do(
    server: dict[str, Any],
) -> None:
    """``loss_fn="dro"`` with ``beta``: its ``loss:sum`` is -sum(A log p - beta/2 (log p -
    log q)^2) of the log-probs it returns (from ``forward`` too), and a step on it lands where a
    twin stepping on that formula through ``forward_backward_custom`` does. Then ``gspo``
    (GSPO-token, as Tinker's documentation writes it): every token's ratio is the sequence's,
    the geometric mean of p / q over the positions ``sequence_ratio_mask`` marks, with the
    token's own gradient; the loss -sum min(s A, clip(s) A). One datum's ratio is past the
    clip (its tokens get no gradient), the other's inside."""
    import torch

    beta = 0.5
    base = [datum(r, w) for r, w in zip(ROWS, WEIGHTS, strict=True)]
    with tinker.ServiceClient() as sc:
        served = sc.create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
        twin = sc.create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
        # sampler log-probs a little off the policy's, so the penalty is not zero
        before = logprobs_of(served.forward(base, "cross_entropy").result())
        q = [[x - 0.1 * (i % 3) for i, x in enumerate(lp)] for lp in before]
        data = [ppo_datum(r, lp, a) for r, lp, a in zip(ROWS, q, (1.0, -0.5), strict=True)]

        def dro(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
            total = sum(
                -(
                    lp * torch.tensor(d.loss_fn_inputs["advantages"].tolist())
                    - 0.5 * beta * (lp - torch.tensor(d.loss_fn_inputs["logprobs"].tolist())) ** 2
                ).sum()
                for d, lp in zip(data, logprobs, strict=True)
            )
            return total, {"mine": float(total.detach())}

        out = served.forward_backward(data, "dro", {"beta": beta}).result()
        lp = logprobs_of(out)
        by_hand = -sum(
            a * x - 0.5 * beta * (x - y) ** 2
            for d, xs, ys in zip(data, lp, q, strict=True)
            for a, x, y in zip(d.loss_fn_inputs["advantages"].tolist(), xs, ys, strict=True)
        )
        assert abs(out.metrics["loss:sum"] - by_hand) < 1e-4, (out.metrics, by_hand)
        forward = served.forward(data, "dro", {"beta": beta}).result()
        assert abs(forward.metrics["loss:sum"] - by_hand) < 1e-4
        mine = twin.forward_backward_custom(data, dro).result()
        assert abs(mine.metrics["mine"] - by_hand) < 1e-4
        for client in (served, twin):
            client.optim_step(ADAM).result()
        after = logprobs_of(served.forward(base, "cross_entropy").result())
        assert close(after, logprobs_of(twin.forward(base, "cross_entropy").result()), 1e-5)
        assert not close(after, before, 1e-3)  # the step moved the weights

        # GSPO: datum 0 (A = 1) sampled 0.3 nats a token below the policy: s = e^0.3 > 1.2,
        # clipped; datum 1 (A = -0.5) a little below: s inside [0.8, 1.2]
        q = [[x - 0.3 for x in after[0]], [x - 0.05 * (i % 3) for i, x in enumerate(after[1])]]
        data = [
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    **d.loss_fn_inputs,
                    "sequence_ratio_mask": [
                        0.0 if a == 0 else 1.0 for a in d.loss_fn_inputs["advantages"].tolist()
                    ],
                },
            )
            for d in (ppo_datum(r, lp, a) for r, lp, a in zip(ROWS, q, (1.0, -0.5), strict=True))
        ]

        def gspo(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
            total = torch.zeros(())
            for d, lp in zip(data, logprobs, strict=True):
                q = torch.tensor(d.loss_fn_inputs["logprobs"].tolist())
                a = torch.tensor(d.loss_fn_inputs["advantages"].tolist())
                marked = torch.tensor(d.loss_fn_inputs["sequence_ratio_mask"].tolist()) != 0
                s = (lp.detach() - q)[marked].mean()
                ratio = torch.exp(s + lp - lp.detach())
                total = total - torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).sum()
            return total, {"mine": float(total.detach())}

        out = served.forward_backward(data, "gspo").result()
        lp = logprobs_of(out)
        by_hand = 0.0
        for d, xs, ys in zip(data, lp, q, strict=True):
            marked = [m != 0 for m in d.loss_fn_inputs["sequence_ratio_mask"].tolist()]
            logs = [x - y for x, y, m in zip(xs, ys, marked, strict=True) if m]
            s = math.exp(sum(logs) / len(logs))
            for a in d.loss_fn_inputs["advantages"].tolist():
                by_hand -= min(s * a, min(max(s, 0.8), 1.2) * a)
        assert abs(out.metrics["loss:sum"] - by_hand) < 1e-4, (out.metrics, by_hand)
        forward = served.forward(data, "gspo").result()
        assert abs(forward.metrics["loss:sum"] - by_hand) < 1e-4
        # without a mask (the cookbook's rl/train.py sends none): the positions with an
        # advantage, here the same
        unmasked = [ppo_datum(r, lp, a) for r, lp, a in zip(ROWS, q, (1.0, -0.5), strict=True)]
        forward = served.forward(unmasked, "gspo").result()
        assert abs(forward.metrics["loss:sum"] - by_hand) < 1e-4
        mine = twin.forward_backward_custom(data, gspo).result()
        assert abs(mine.metrics["mine"] - by_hand) < 1e-4
        for client in (served, twin):
            client.optim_step(ADAM).result()
        moved = logprobs_of(served.forward(base, "cross_entropy").result())
        assert close(moved, logprobs_of(twin.forward(base, "cross_entropy").result()), 1e-5)
        assert not close(moved, after, 1e-3)
