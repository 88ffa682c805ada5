"""A one-process trainer that pushes its weights into a `tandem serve` over HTTP discovery.

    python tests/http_trainer.py MODEL_DIR SERVER_URL TRANSPORT [ADMIN_KEY]

The admin key comes from the argument or $TANDEM_ADMIN_KEY.
"""

import sys

import torch
import transformers

from tandem.exchange import WeightSender


def main() -> int:
    model_dir, url, transport = sys.argv[1:4]
    key = sys.argv[4] if len(sys.argv) > 4 else None
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stats = WeightSender(model, url, transport=transport, admin_key=key).push()
    print(f"pushed version {stats.version}: {stats.bytes_sent} bytes by {stats.transport}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
