"""A one-process trainer that pushes its weights into a `tandem serve` over HTTP discovery.

    python tests/support/http_trainer.py MODEL_DIR SERVER TRANSPORT [ADMIN_KEY]
                                 [--mode staged|in_place] [--fault die|corrupt]

SERVER is ``http://host:port`` or ``host:port``.

The admin key comes from the argument or $TANDEM_ADMIN_KEY. Faults, for the fault-injection
tests: ``die`` exits (code 17) mid-push — with shm after staging and before telling the engine,
with dist after sending the first engine rank its boxes; ``corrupt`` flips one staged byte
after its checksum was taken (shm). Exit codes: 0 pushed, 3 the engine refused the push.
"""

import argparse
import sys

import torch
import transformers

import sender_faults  # (this script's directory)
from tandem.exchange import WeightSender, WeightSyncError


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
    sender = WeightSender(
        model, args.url, transport=args.transport, mode=args.mode, admin_key=args.key
    )
    # faults strike once the boxes are delivered, before the engine is told they are ready
    if args.fault == "die":
        if sender.transport == "dist":  # only the first engine rank gets its boxes
            sender_faults.deliver_to_first_engine_rank()
        sender_faults.die_before_ready()
    if args.fault == "corrupt" and sender.transport == "shm":
        sender_faults.corrupt_staging()
    try:
        stats = sender.push()
    except WeightSyncError as exc:
        print(f"push refused: {exc}", flush=True)
        return 3
    print(f"pushed version {stats.version}: {stats.bytes_sent} bytes by {stats.transport}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
