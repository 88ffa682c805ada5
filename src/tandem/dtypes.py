"""The dtypes tandem runs and sends weights in, by the names configs and messages use."""

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
