"""A one-rank trainer on CUDA that pushes into an engine; run by the gpu tests.

python tests/support/gpu_trainer.py MODEL_DIR EXCHANGE_ADDRESS VERSION TRANSPORT [shifted]

With ``shifted`` its writer puts every box's rows one place down (its CRC32s stay honest):
the engine must reject the push. Exit codes: 0 pushed, 3 the engine refused the push.
"""

import sys

import torch
import transformers

from tandem.exchange import WeightSender, WeightSyncError
from tandem.exchange.checksum import source_crc32
from tandem.exchange.transports.base import SenderHalf


def _shifted_writer(self, src, dst):
    crc = source_crc32(src, dst.dtype)
    dst.copy_(src.roll(1, 0) if src.dim() and src.shape[0] > 1 else src)
    return crc


def main() -> int:
    model_dir, address, version, transport = sys.argv[1:5]
    if sys.argv[5:] == ["shifted"]:
        SenderHalf.write_box = _shifted_writer
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to("cuda")
    try:
        stats = WeightSender(model, address, transport=transport).push(version=int(version))
    except WeightSyncError as exc:
        print(f"push refused: {exc}", flush=True)
        return 3
    assert stats.bytes_moved == stats.bytes_needed
    print(f"pushed version {stats.version} over {stats.transport}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
