"""verl drives tandem: ``actor_rollout_ref.rollout.name=tandem``.

Installed with tandem (``pip install tandem-rl[verl]``), the ``verl.plugins`` entry point
imports this module whenever a process imports verl (driver, task runner, every Ray worker),
and it fills verl's two rollout registries under the name ``tandem``:

- `tandem.integrations.verl.replica.TandemReplica` (``RolloutReplicaRegistry``): launches one
  `tandem serve` per replica, with TP / PP / DP from verl's rollout config, in a named Ray
  actor (`tandem.integrations.verl.server.TandemServer`) on the node of the replica's first
  worker; verl's client generates through that actor;
- `tandem.integrations.verl.adapter.TandemServerAdapter` (the ServerAdapter of
  ``("tandem", "async")``), in each trainer rank: ``update_weights`` streams verl's (name,
  tensor) pairs into the engine through vLLM's weight-transfer protocol on tandem serve
  (`tandem.exchange.broadcast_client`), a bucket at a time, checked, versioned by
  ``global_steps``; ``resume`` / ``release`` are tandem's wake-up / sleep.

``VERL_USE_EXTERNAL_MODULES=tandem.integrations.verl`` does the same where entry points are off.
"""

from __future__ import annotations

NAME = "tandem"  # actor_rollout_ref.rollout.name
ADAPTER = "tandem.integrations.verl.adapter.TandemServerAdapter"


def _replica_class():
    from tandem.integrations.verl.replica import TandemReplica

    return TandemReplica


def register() -> None:
    """Fill verl's registries (idempotent)."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, _replica_class)
    _ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER


register()
