"""The mesh for plain scripts and notebooks: ``hf.mesh`` with every call blocking.

    import hybridflow as hf

    with hf.mesh_sync("examples/quickstart.yaml") as m:
        rows = [{"prompt": "1+2=", "answer": "3"}]  # the reward reads the row's answer
        batch = m.sample(rows, hf.SamplingConfig(n=4, max_new_tokens=8))
        scores, _ = m.score(batch)

``mesh_sync`` starts one thread that runs an event loop of its own (uvloop when installed, as
``hybridflow run`` does) and enters ``hf.mesh`` there; each method of the returned ``SyncMesh``
sends its coroutine to that loop and waits for the result, so an error comes back to the caller
as it was raised (same type, same message). The role clients (``m.reward``, ...) block the same
way. Because the mesh's loop is not the caller's, this works where the caller's thread already
runs a loop (a Jupyter cell), where ``asyncio.run`` would refuse.

Leaving the ``with`` block, an error in it included, or ``close()`` stops the groups and then
the thread. The ranks are started from that thread, and the kernel's parent-death signal
(``roles.runtime.rank.die_with_parent``) follows the thread that started a process: should the
thread ever die, its ranks die with it. A mesh still open when the interpreter exits is closed
then. Keyword arguments go to ``hf.mesh`` as given, so a new one of its options needs nothing here.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch

from controller.clients.base import RoleClient
from deploy.mesh import Loss, Mesh, Rows, mesh
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig
from transport.training import AdamStep, OptimConfig, PolicyLossConfig, Reduction

T = TypeVar("T")

THREAD_NAME = "hybridflow-mesh"


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed (an optional speed-up), else asyncio's."""
    try:
        import uvloop  # optional: not installed on every platform
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    """An event loop running forever on a daemon thread of its own, until ``stop``."""

    def __init__(self) -> None:
        self.loop = _new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # what asyncio.run does on the way out: nothing left pending or unclosed
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block until it is done; an interrupt of the caller
        (Ctrl-C, a notebook's stop button) cancels it there too."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(
                "a blocking mesh call from the mesh's own event loop would wait forever; "
                "await the hf.mesh API there instead"
            )
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()


class SyncClient:
    """A role's client whose endpoints block until the role answers (``m.reward.compute_reward(
    batch)``); everything else about the client is as in ``hf.mesh``."""

    def __init__(self, client: RoleClient, loop: _LoopThread) -> None:
        self._client = client
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._client, name)
        if not inspect.iscoroutinefunction(found):
            return found
        call: Callable[..., Coroutine[Any, Any, Any]] = found

        @functools.wraps(call)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._loop.wait(call(*args, **kwargs))

        return blocking

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._client)) | set(super().__dir__()))

    def __repr__(self) -> str:
        return f"SyncClient({self._client!r})"


class SyncMesh:
    """A started mesh whose methods block: ``hf.mesh``'s ``Mesh`` for code without ``await``."""

    def __init__(self, enter: Callable[[], AbstractAsyncContextManager[Mesh]]) -> None:
        """Start a mesh by entering ``enter()`` on a thread of its own; blocks until it is up."""
        self._loop = _LoopThread()
        self._closing: asyncio.Event | None = None
        started: concurrent.futures.Future[Mesh] = concurrent.futures.Future()
        self._held = self._loop.submit(self._hold(enter, started))
        try:
            either: list[concurrent.futures.Future[Any]] = [started, self._held]
            concurrent.futures.wait(either, return_when=concurrent.futures.FIRST_COMPLETED)
            if not started.done():
                self._held.result()  # the start failed: its error, as raised
            self._mesh = started.result()
        except BaseException:
            self._held.cancel()  # an interrupted start still stops what it started
            concurrent.futures.wait([self._held])
            self._loop.stop()
            raise
        atexit.register(self.close)

    async def _hold(
        self,
        enter: Callable[[], AbstractAsyncContextManager[Mesh]],
        started: concurrent.futures.Future[Mesh],
    ) -> None:
        """Enter and leave the mesh in one task, as ``async with`` would, waiting in between."""
        self._closing = asyncio.Event()
        async with enter() as found:
            started.set_result(found)
            await self._closing.wait()

    # -- the with-block ----------------------------------------------------------------------

    def __enter__(self) -> SyncMesh:
        """The mesh itself (it is started already)."""
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop the groups and the thread; an error of the block goes on as it was."""
        self.close()

    def close(self) -> None:
        """Stop the groups, then the mesh's thread; a second call does nothing."""
        if not self._loop.thread.is_alive():
            return
        atexit.unregister(self.close)
        try:
            if self._closing is not None:
                self._loop.loop.call_soon_threadsafe(self._closing.set)
            self._held.result()  # an error while stopping the groups reaches the caller
        finally:
            self._loop.stop()

    @property
    def closed(self) -> bool:
        """True once the mesh is stopped."""
        return not self._loop.thread.is_alive()

    # -- the clients and what the mesh knows --------------------------------------------------

    def _client(self, client: RoleClient | None) -> SyncClient | None:
        return None if client is None else SyncClient(client, self._loop)

    @property
    def actor(self) -> SyncClient:
        """The actor's client, its endpoints blocking."""
        return SyncClient(self._mesh.actor, self._loop)

    @property
    def reward(self) -> SyncClient:
        """The reward role's client, its endpoints blocking."""
        return SyncClient(self._mesh.reward, self._loop)

    @property
    def reference(self) -> SyncClient | None:
        """The reference role's client, its endpoints blocking (None when not placed)."""
        return self._client(self._mesh.reference)

    @property
    def critic(self) -> SyncClient | None:
        """The critic's client, its endpoints blocking (None when not placed)."""
        return self._client(self._mesh.critic)

    @property
    def rollout(self) -> SyncClient | None:
        """The rollout group's client, its endpoints blocking (None when the actor generates)."""
        return self._client(self._mesh.rollout)

    @property
    def env(self) -> SyncClient | None:
        """The env group's client, its endpoints blocking (None when not placed)."""
        return self._client(self._mesh.env)

    @property
    def teacher(self) -> SyncClient | None:
        """The teacher's client, its endpoints blocking (None when not placed)."""
        return self._client(self._mesh.teacher)

    @property
    def tokenizer(self) -> Any:
        """The actor model's tokenizer (Hugging Face's)."""
        return self._mesh.tokenizer

    @property
    def version(self) -> int:
        """The actor's policy version: training steps taken through this mesh."""
        return self._mesh.version

    @property
    def run_dir(self) -> Path:
        """The run folder: models, metrics.jsonl, saved states, rank logs."""
        return self._mesh.run_dir

    def __getattr__(self, name: str) -> Any:
        """What ``Mesh`` has and this class does not spell out: coroutines block, the rest
        passes through (e.g. ``exp``, ``roles_placed``)."""
        if name.startswith("_"):  # not set yet (a failed start): no recursion through _mesh
            raise AttributeError(name)
        found = getattr(self._mesh, name)
        if not inspect.iscoroutinefunction(found):
            return found
        call: Callable[..., Coroutine[Any, Any, Any]] = found

        @functools.wraps(call)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._loop.wait(call(*args, **kwargs))

        return blocking

    # -- the primitives (Mesh's, blocking) ----------------------------------------------------

    def sample(
        self,
        prompts: Sequence[str] | Sequence[dict[str, Any]] | TensorBatch,
        sampling: SamplingConfig,
    ) -> TensorBatch:
        """``sampling.n`` responses per prompt on the newest weights, as ``Mesh.sample``."""
        return self._loop.wait(self._mesh.sample(prompts, sampling))

    def log_probs(
        self, batch: Rows, role: str = "actor", temperature: float | None = None
    ) -> torch.Tensor:
        """Per-token log-probs ``[B, T]`` of ``batch``'s tokens under a model role (at the
        sampling temperature a sampled batch records, unless ``temperature`` is given)."""
        return self._loop.wait(self._mesh.log_probs(batch, role, temperature))

    def score(self, batch: TensorBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """One score per row from the reward role, and the batch means of its extras."""
        return self._loop.wait(self._mesh.score(batch))

    def train_step(
        self, batch: Rows, loss: PolicyLossConfig, temperature: float | None = None
    ) -> dict[str, float]:
        """One optimizer step of the actor with the policy loss ``loss``; its metrics."""
        return self._loop.wait(self._mesh.train_step(batch, loss, temperature))

    def forward_backward(
        self,
        batch: Rows,
        loss: Loss,
        temperature: float | None = None,
        reduction: Reduction = "mean",
    ) -> dict[str, float]:
        """A loss's forward and backward on ``batch`` (a policy loss or ``"cross_entropy"``);
        gradients add up until ``optim_step``."""
        return self._loop.wait(self._mesh.forward_backward(batch, loss, temperature, reduction))

    def forward_backward_log_probs(
        self,
        batch: Rows,
        loss: Loss,
        temperature: float | None = None,
        reduction: Reduction = "mean",
    ) -> tuple[dict[str, float], torch.Tensor]:
        """``forward_backward``, and the per-token log-probs its loss saw."""
        return self._loop.wait(
            self._mesh.forward_backward_log_probs(batch, loss, temperature, reduction)
        )

    def optim_step(self, adam: AdamStep | None = None) -> dict[str, float]:
        """One optimizer step of the actor on the gradients accumulated by
        ``forward_backward`` (``adam``: this step's own AdamW settings)."""
        return self._loop.wait(self._mesh.optim_step(adam))

    def sft_step(self, rows: Sequence[dict[str, str]]) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on ``(prompt, response)`` rows."""
        return self._loop.wait(self._mesh.sft_step(rows))

    def configure_optim(self, optim: OptimConfig, role: str = "actor") -> None:
        """A fresh optimizer and schedule for a training role."""
        return self._loop.wait(self._mesh.configure_optim(optim, role))

    def rebase(self, role: str = "reference") -> None:
        """``role`` (the reference, a critic) takes the actor's weights as they are now."""
        return self._loop.wait(self._mesh.rebase(role))

    def sync_weights(self) -> int:
        """Bring a separate rollout group up to the actor's weights; the version it serves."""
        return self._loop.wait(self._mesh.sync_weights())

    def save_state(self, name: str) -> Path:
        """Every training role's state under ``RUN_DIR/state/NAME/<role>``; the folder."""
        return self._loop.wait(self._mesh.save_state(name))

    def load_state(self, name: str) -> int:
        """What ``save_state(name)`` wrote, back into the training roles; the policy version."""
        return self._loop.wait(self._mesh.load_state(name))

    def export(self, path: str | Path) -> Path:
        """The actor as a plain Hugging Face folder (and a PEFT adapter folder for LoRA)."""
        return self._loop.wait(self._mesh.export(path))

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        """One record (``step``: default the policy version) into the run's sinks."""
        self._loop.wait(_called(self._mesh.log, metrics, step))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"SyncMesh({self._mesh.exp.name!r}, run_dir={str(self._mesh.run_dir)!r}, {state})"


async def _called(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` as a coroutine: run on the mesh's loop, beside its other work."""
    return function(*args)


def mesh_sync(experiment: str | Path, *overrides: str, **kwargs: Any) -> SyncMesh:
    """Start the groups of ``experiment`` as ``hf.mesh`` does (same overrides and keyword
    arguments, e.g. ``run_dir=``) and return a ``SyncMesh`` whose calls block."""
    return SyncMesh(lambda: mesh(experiment, *overrides, **kwargs))


__all__ = ["SyncClient", "SyncMesh", "mesh_sync"]
