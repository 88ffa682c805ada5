"""A one-rank trainer on CUDA that pushes into an engine; run by the gpu tests.

python tests/gpu_trainer.py MODEL_DIR EXCHANGE_ADDRESS VERSION TRANSPORT
"""

import sys

import torch
import transformers

from tandem.exchange import WeightSender


def main() -> int:
    model_dir, address, version, transport = sys.argv[1:5]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to("cuda")
    stats = WeightSender(model, address, transport=transport).push(version=int(version))
    assert stats.bytes_moved == stats.bytes_needed
    print(f"pushed version {stats.version} over {stats.transport}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
