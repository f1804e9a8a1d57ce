"""The one place where megatron-core is told that a CPU rank's "CUDA" is the CPU.

megatron-core (0.16) assumes CUDA in a handful of spots that a CPU build of torch cannot serve:
it asks ``torch.cuda`` for the current device and for RNG states, and spells ``device="cuda"``
out in a few allocations. On a rank whose device is the CPU (gloo), ``apply()`` makes those
spots work, and nothing else: every patch below is needed by a code path the megatron engine
runs, which ``tests/roles/test_megatron_shim.py`` checks by removing each one in a child
interpreter and watching the run fail (and passing with all of them).

Process-wide patches (``apply``, idempotent):

* ``current_device`` — ``torch.cuda.current_device`` returns the CPU device. Rotary embeddings
  (``inv_freq.to(current_device())``), the vocab-parallel embedding's and linear layers'
  allocations, the pipeline's shape exchange and DDP's grad buffers all allocate there.
* ``get_rng_state`` / ``random.get_rng_state`` — ``torch.cuda.get_rng_state`` (the RNG tracker's
  ``add``) and ``torch.cuda.random.get_rng_state`` (its ``fork``, entered by every attention
  layer) read a stand-in generator instead of raising.
* ``set_rng_state`` — megatron's ``tensor_parallel.random._set_cuda_rng_state`` sets the
  stand-in's state. Unpatched it does not fail on CPU: it queues a lazy CUDA call that never runs,
  so every ``fork`` leaked a queued call and never restored a state.
* ``synchronize`` — ``torch.cuda.synchronize`` waits for nothing: the pipeline's exchange of
  micro-batch shapes (stages send each other ``[s, b, h]`` first, since our rows vary in length)
  ends in it unconditionally, and a CPU rank has no device queue to drain.
* ``manual_seed`` — ``torch.cuda.manual_seed`` seeds the stand-in. Unpatched it is silently
  ignored on CPU, so ``model_parallel_cuda_manual_seed`` gave the tracker's data-parallel and
  model-parallel states the same value.

The stand-in is a CPU ``torch.Generator`` of its own, not the CPU default generator: megatron's
seeding must not reseed the CPU stream the engine's roles draw from. Nothing on a CPU rank draws
from it (dropout is 0 and CPU kernels draw from the CPU generator); it keeps megatron's RNG
bookkeeping exact, and the engine saves and restores it with the tracker's states.

Scoped rewrites (``redirected()``, entered by the engine around every megatron-core call;
``REWRITES``): megatron writes ``device="cuda"`` literally (the schedules' token counter, the fp32 optimizer's
loss scale), calls ``Tensor.cuda()`` (the first/last-stage copy of tied embeddings under pp) and
accepts only parameters whose ``Tensor.type()`` is a ``torch.cuda.*Tensor`` (the distributed
optimizer). A ``TorchFunctionMode`` maps such a device argument to the CPU
(``device_argument``), ``Tensor.cuda`` to the tensor itself (``tensor_cuda``) and a CPU tensor's
type name to its CUDA twin (``tensor_type``) while the block runs; outside it torch is untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from transport.device import HOST, DeviceKind

#: the generator a CPU rank's megatron-core takes for "the CUDA generator"
STAND_IN = torch.Generator(device=HOST)


@dataclass(frozen=True)
class Patch:
    """``owner.attr`` replaced by ``value`` (the owner found by a dotted module path)."""

    owner: str
    attr: str
    value: Callable[..., Any]


def _current_device() -> str:
    return str(DeviceKind.CPU)


def _get_rng_state(device: Any = None) -> torch.Tensor:
    return STAND_IN.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    STAND_IN.set_state(new_state)


def _synchronize(device: Any = None) -> None:
    return None


def _manual_seed(seed: int) -> None:
    STAND_IN.manual_seed(int(seed))


PATCHES: dict[str, Patch] = {
    "current_device": Patch("torch.cuda", "current_device", _current_device),
    "get_rng_state": Patch("torch.cuda", "get_rng_state", _get_rng_state),
    "random.get_rng_state": Patch("torch.cuda.random", "get_rng_state", _get_rng_state),
    "set_rng_state": Patch(
        "megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _set_rng_state
    ),
    "synchronize": Patch("torch.cuda", "synchronize", _synchronize),
    "manual_seed": Patch("torch.cuda", "manual_seed", _manual_seed),
}

_lock = threading.Lock()
_applied: set[str] = set()


def apply() -> None:
    """Install every patch of ``PATCHES``; calling it again changes nothing."""
    import importlib

    with _lock:
        for name, patch in PATCHES.items():
            if name not in _applied:
                setattr(importlib.import_module(patch.owner), patch.attr, patch.value)
                _applied.add(name)


# -- the scoped redirect ---------------------------------------------------------------------------

#: a rewrite answers a call itself (``(True, result)``) or passes it on, maybe changed
Rewrite = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], tuple[bool, Any]]


def _device_argument(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    device = kwargs.get("device")
    if isinstance(device, torch.device):
        cuda = device.type == DeviceKind.CUDA
    else:
        cuda = isinstance(device, str) and device.split(":")[0] == DeviceKind.CUDA
    if cuda:
        kwargs["device"] = HOST
    return False, None


def _tensor_cuda(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    return (True, args[0]) if func is torch.Tensor.cuda else (False, None)


def _tensor_type(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    if func is not torch.Tensor.type or len(args) != 1 or kwargs:
        return False, None
    name = str(func(*args))
    if args[0].device.type == DeviceKind.CPU:
        name = name.replace("torch.", f"torch.{DeviceKind.CUDA}.", 1)
    return True, name


REWRITES: dict[str, Rewrite] = {
    "device_argument": _device_argument,
    "tensor_cuda": _tensor_cuda,
    "tensor_type": _tensor_type,
}


class _CudaToHost(TorchFunctionMode):
    """Every torch call of the block passes ``REWRITES`` first."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        for rewrite in REWRITES.values():
            done, result = rewrite(func, args, kwargs)
            if done:
                return result
        return func(*args, **kwargs)


@contextmanager
def redirected() -> Iterator[None]:
    """The block with megatron-core's CUDA device arguments, ``Tensor.cuda`` calls and type
    checks served by the CPU (``REWRITES``)."""
    with _CudaToHost():
        yield
