"""Weight exchange: trainer layouts -> plan -> transports -> the engine's live parameters."""

from tandem.errors import StaleVersionError
from tandem.exchange.address import ExchangeAddress
from tandem.exchange.layout import LayoutMismatch, RankLayout, Region
from tandem.exchange.plan import Plan, PlanCache, Transfer, plan_transfers
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.rollout import RolloutResult
from tandem.exchange.sender import PushStats, WeightSender
from tandem.exchange.settings import PushSettings
from tandem.exchange.target import AdapterTarget, UpdateWindow, WeightTarget

__all__ = [
    "ExchangeAddress",
    "LayoutMismatch",
    "Plan",
    "PlanCache",
    "PushSettings",
    "PushStats",
    "RankLayout",
    "Region",
    "RolloutResult",
    "StaleVersionError",
    "Transfer",
    "UpdateWindow",
    "WeightSender",
    "WeightSyncError",
    "WeightTarget",
    "AdapterTarget",
    "plan_transfers",
]
