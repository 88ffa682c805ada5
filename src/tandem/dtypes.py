"""The dtypes tandem runs and sends weights in, by the names configs and messages use."""

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# what a box may travel in: the weights' dtypes, and the plain bytes of a delta push's payloads
# (`tandem.exchange.delta`); transports view what they move through this
WIRE_DTYPES = {**DTYPES, "uint8": torch.uint8}
