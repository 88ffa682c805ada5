"""A one-process trainer that pushes its weights into a `tandem serve` over HTTP discovery.

    python tests/http_trainer.py MODEL_DIR SERVER TRANSPORT [ADMIN_KEY]
                                 [--mode staged|in_place] [--fault die|corrupt]

SERVER is ``http://host:port`` or ``host:port``.

The admin key comes from the argument or $TANDEM_ADMIN_KEY. Faults, for the fault-injection
tests: ``die`` exits (code 17) mid-push — with shm after staging and before telling the engine,
with dist after sending the first engine rank its boxes; ``corrupt`` flips one staged byte
after its checksum was taken (shm). Exit codes: 0 pushed, 3 the engine refused the push.
"""

import argparse
import os
import sys

import torch
import transformers

from tandem.exchange import WeightSender, WeightSyncError
from tandem.exchange.transports.memory import MappedMemory


class _Faulty(WeightSender):
    """Delivers, then fails before telling the engine the push is ready."""

    fault: str | None = None

    def _deliver(self, plan, tensors):
        if self.fault == "die" and self.transport == "dist":  # only the first engine rank
            first = min(item.dst for item in plan.items)
            plan.items = [item for item in plan.items if item.dst == first]
        delivery = super()._deliver(plan, tensors)
        if self.fault == "die":
            os._exit(17)
        if self.fault == "corrupt" and self.transport == "shm" and delivery.staging is not None:
            MappedMemory(delivery.staging).data[:1] ^= 0xFF  # as the engine will map it
        return delivery


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("url")
    p.add_argument("transport")
    p.add_argument("key", nargs="?")
    p.add_argument("--mode", default="staged")
    p.add_argument("--fault", choices=["die", "corrupt"])
    args = p.parse_args()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    sender = _Faulty(model, args.url, transport=args.transport, mode=args.mode,
                     admin_key=args.key)  # fmt: skip
    sender.fault = args.fault
    try:
        stats = sender.push()
    except WeightSyncError as exc:
        print(f"push refused: {exc}", flush=True)
        return 3
    print(f"pushed version {stats.version}: {stats.bytes_sent} bytes by {stats.transport}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
