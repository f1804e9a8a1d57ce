"""hybridflow as a library: start an experiment's groups from your own program and write the RL
loop yourself (docs/api.md). Re-exports only; the logic lives in ``deploy/``, ``controller/`` and
``transport/``.

    import hybridflow as hf

    async def main() -> None:
        async with hf.mesh("examples/quickstart.yaml") as m:
            batch = await m.sample(hf.rows("builtin:arithmetic?n=64&split=train")[:8],
                                   hf.SamplingConfig(n=4, max_new_tokens=8))
            score, _ = await m.score(batch)

    hf.run(main)

``hf.mesh_sync`` is the same mesh with every call blocking, for plain scripts and notebooks.
"""

from controller import advantages
from controller.clients import (
    ActorClient,
    CriticClient,
    EnvClient,
    ReferenceClient,
    RewardClient,
    RolloutClient,
)
from controller.datum import Datum, batch_of, datums
from deploy.experiment import ExperimentError
from deploy.mesh import Mesh, mesh, prompt_batch, rows, run
from deploy.mesh_sync import SyncMesh, mesh_sync
from transport.batch import BatchError, TensorBatch
from transport.errors import (
    CallTimeoutError,
    RemoteBatchError,
    RemoteEngineError,
    RemoteError,
    RemoteGenerationError,
    RemoteRewardError,
)
from transport.sampling import SamplingConfig
from transport.training import AdamStep, OptimConfig, PolicyLossConfig

__all__ = [
    "ActorClient",
    "AdamStep",
    "BatchError",
    "CallTimeoutError",
    "CriticClient",
    "Datum",
    "EnvClient",
    "ExperimentError",
    "Mesh",
    "OptimConfig",
    "PolicyLossConfig",
    "ReferenceClient",
    "RemoteBatchError",
    "RemoteEngineError",
    "RemoteError",
    "RemoteGenerationError",
    "RemoteRewardError",
    "RewardClient",
    "RolloutClient",
    "SamplingConfig",
    "SyncMesh",
    "TensorBatch",
    "advantages",
    "batch_of",
    "datums",
    "mesh",
    "mesh_sync",
    "prompt_batch",
    "rows",
    "run",
]
