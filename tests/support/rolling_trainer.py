"""A one-rank trainer that pushes into a fleet and dies; run by the fleet tests
(integration/fleet/test_fleet_rolling.py).

    python tests/support/rolling_trainer.py MODEL_DIR EXCHANGE_ADDRESS VERSION MODE [TRANSPORT]

MODE ``before``: stages its boxes, then dies before telling the engine they are ready (no
replica has verified anything). ``receiving`` (dist): dies a few boxes into its send, the
engine ranks receiving. ``after``: a rolling push returns once every replica holds the
version; the trainer exits at once, its staging memory with it, while the waves commit.
``all``: a plain push; prints how each replica came out, or the error.
"""

import os
import sys

import torch
import transformers

import sender_faults  # (this script's directory)
from tandem.exchange import WeightSender, WeightSyncError


def _die_mid_send(after: int = 4) -> None:
    """Exit once ``after`` boxes (or frames) went out: each is checksummed just before it is
    sent, so the engine ranks are receiving when this process dies."""
    from tandem.exchange.transports import p2p

    sent = []

    def counted(honest):
        def crc(*args, **kwargs):
            sent.append(1)
            if len(sent) > after:
                os._exit(17)
            return honest(*args, **kwargs)

        return crc

    p2p.checked_copy = counted(p2p.checked_copy)
    p2p.tensor_crc32 = counted(p2p.tensor_crc32)


def main() -> int:
    model_dir, address, version, when = sys.argv[1:5]
    transport = sys.argv[5] if len(sys.argv) > 5 else "shm"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if when == "before":
        sender_faults.die_before_ready()
    if when == "receiving":
        _die_mid_send()
    policy = "all" if when == "all" else "rolling"
    try:
        sender = WeightSender(model, address, transport=transport)
        stats = sender.push(version=int(version), policy=policy)
    except WeightSyncError as exc:
        print("error", exc, flush=True)
        os._exit(3)
    print("states", ",".join(r.state for r in stats.replicas), flush=True)
    os._exit(0)  # no clean-up: whatever this process held is gone now


if __name__ == "__main__":
    sys.exit(main())
