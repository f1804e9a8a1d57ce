"""Typed role clients: one class per kind of role, one ``async`` method per endpoint.

``base.py`` holds the generic path (``RoleClient._call``, which checks the endpoint's transfer
protocol before sending); each other file mirrors the role file it speaks to under ``roles/``.
``tests/controller/test_contract.py`` pairs every client with its role class(es).
"""

from controller.clients.actor import ActorClient, ReferenceClient
from controller.clients.base import ProtocolMismatchError, RoleClient
from controller.clients.critic import CriticClient
from controller.clients.demo import LinearRegressorClient
from controller.clients.engine import EngineClient
from controller.clients.env import EnvClient
from controller.clients.reward import RewardClient, RewardModelClient
from controller.clients.rollout import RolloutClient
from controller.clients.weights import WeightSinkClient, WeightSourceClient

__all__ = [
    "ActorClient",
    "CriticClient",
    "EngineClient",
    "EnvClient",
    "LinearRegressorClient",
    "ProtocolMismatchError",
    "ReferenceClient",
    "RewardClient",
    "RewardModelClient",
    "RoleClient",
    "RolloutClient",
    "WeightSinkClient",
    "WeightSourceClient",
]
