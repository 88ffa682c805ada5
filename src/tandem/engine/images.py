"""Image files -> normalised pixel tensors, as the model directory's ``preprocessor_config.json``
says (Hugging Face ``ViTImageProcessor`` fields: resize, rescale, normalise)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tandem.errors import ModelLoadError

_DEFAULTS = {
    "do_resize": True,
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def load_image(path: str | Path, model_dir: str | Path, size: int) -> torch.Tensor:
    """The image at ``path`` as a float tensor [3, size, size] (RGB)."""
    from PIL import Image

    settings = dict(_DEFAULTS)
    config = Path(model_dir) / "preprocessor_config.json"
    if config.is_file():
        try:
            settings.update(json.loads(config.read_text()))
        except ValueError as exc:
            raise ModelLoadError(f"cannot be parsed ({exc})", file=str(config)) from None
    target = settings.get("size") or {"height": size, "width": size}
    try:
        image = Image.open(path).convert("RGB")
    except OSError as exc:
        raise ValueError(f"{path}: not an image ({exc})") from None
    if settings["do_resize"]:
        image = image.resize(
            (target["width"], target["height"]), resample=Image.Resampling(settings["resample"])
        )
    pixels = np.asarray(image, dtype=np.float32)
    if settings["do_rescale"]:
        pixels = pixels * settings["rescale_factor"]
    if settings["do_normalize"]:
        pixels = (pixels - np.asarray(settings["image_mean"], dtype=np.float32)) / np.asarray(
            settings["image_std"], dtype=np.float32
        )
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())
