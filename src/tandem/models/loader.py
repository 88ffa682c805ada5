"""Read a local Hugging Face model directory: config, generation config, safetensors weights.

Weights reach parameters only through their placement pieces, each reading just its box of the
canonical tensor from disk (a tensor-parallel rank reads only its shard).
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError
from safetensors import safe_open
from torch import nn

import tandem.models  # noqa: F401  (registers the built-in architectures)
from tandem.errors import ModelLoadError, UnsupportedModelError
from tandem.layers.fp8 import scale_name
from tandem.layers.linear import fp8_blocks
from tandem.layers.placement import canonical_shapes, unique_parameters
from tandem.layers.rotary import RopeParameters
from tandem.models.base import TandemModel
from tandem.models.fp8 import QUANTIZATIONS, Fp8Config, QuantizedOnLoad, quantize_layers
from tandem.models.registry import model_class, registered_architectures
from tandem.models.stages import Stage, prune_to_stage
from tandem.parallel import SINGLE, TPGroup

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelSpec:
    """What a model directory says, checked: which class runs it and with which config."""

    path: Path
    architecture: str
    cls: type[TandemModel]
    config: BaseModel
    eos_token_ids: tuple[int, ...]
    fp8: Fp8Config | None = None  # block-FP8 weights (stored so, or quantized on load)

    @property
    def max_context_len(self) -> int:
        return self.cls.max_context_len(self.config)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _hub_hint(path: Path) -> str:
    """For a missing ``org/name``: what to do with a Hugging Face hub id."""
    name = path.as_posix()
    if not _HUB_ID.fullmatch(name) or path.parent.is_dir():
        return ""
    return (
        f"; {name!r} looks like a Hugging Face hub id, and tandem loads only local "
        f"directories (it downloads nothing): download it first, e.g. `huggingface-cli "
        f"download {name} --local-dir DIR`, then pass DIR"
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError("file not found", file=str(path))
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"not valid JSON ({exc})", file=str(path)) from None
    if not isinstance(data, dict):
        raise ModelLoadError("expected a JSON object", file=str(path))
    return data


def read_model_spec(path: str | Path, quantization: str | None = None) -> ModelSpec:
    """The checked spec of model directory ``path``. ``quantization="fp8"``: serve block-FP8
    weights (a checkpoint that is not FP8 is quantized as it is loaded, 128 x 128 blocks)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError("model directory not found" + _hub_hint(path), file=str(path))
    config_file = path / "config.json"
    raw = _read_json(config_file)
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ModelLoadError(
            "missing or not a list of names", file=str(config_file), field="architectures"
        )
    arch = archs[0]
    cls = model_class(arch)
    if cls is None:
        raise UnsupportedModelError(
            f"{arch!r} is not supported; supported: {registered_architectures()}",
            file=str(config_file),
            field="architectures",
        )
    try:
        config = cls.config_class(**raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "config"
        raise UnsupportedModelError(err["msg"], file=str(config_file), field=field) from None
    rope = getattr(config, "rope", None)
    if isinstance(rope, RopeParameters) and rope.rope_type not in RopeParameters.SUPPORTED:
        raise UnsupportedModelError(
            f"rope type {rope.rope_type!r} not supported; supported: {RopeParameters.SUPPORTED}",
            file=str(config_file),
            field="rope_scaling.rope_type",
        )
    fp8 = None
    if raw.get("quantization_config") is not None:
        fp8 = Fp8Config.from_hf(raw["quantization_config"], str(config_file))
    elif quantization == "fp8":
        fp8 = Fp8Config()
    return ModelSpec(path, arch, cls, config, _eos_token_ids(path, raw), fp8)


def _eos_token_ids(path: Path, config: dict) -> tuple[int, ...]:
    gen_file = path / "generation_config.json"
    source = _read_json(gen_file) if gen_file.is_file() else config
    eos = source.get("eos_token_id")
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        file = gen_file if gen_file.is_file() else path / "config.json"
        raise ModelLoadError(
            "must be an int or a list of ints", file=str(file), field="eos_token_id"
        )
    return tuple(ids)


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Canonical tensor name -> safetensors file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError("missing or not an object", file=str(index), field="weight_map")
        files = {name: path / fname for name, fname in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise ModelLoadError(f"shards listed but not found: {absent}", file=str(index))
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(
            f"no weights: neither {SINGLE_FILE} nor {INDEX_FILE}", file=str(single)
        )
    with _open(single) as f:
        return {name: single for name in f.keys()}


def build_model(
    spec: ModelSpec,
    tp: TPGroup = SINGLE,
    dtype=torch.float32,
    device="cpu",
    stage: Stage | None = None,
):
    """The model for this rank: its TP shard of its pipeline stage, storage on ``device``
    (uninitialised: `load_weights` fills it). Other stages' layers never get storage."""
    with torch.device("meta"):
        model = spec.cls(spec.config, tp)
        if spec.fp8 is not None:
            quantize_layers(model, spec.fp8)
    prune_to_stage(model, stage or Stage.whole(spec))
    _materialize(model, torch.device(device), dtype)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give meta parameters real (uninitialised) storage, keeping their placement pieces and
    keeping tied parameters tied (``Module.to_empty`` would replace both)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in made:
                keeps = getattr(param, "keeps_dtype", False)  # block-FP8 values and scales
                kind = param.dtype if keeps else dtype
                new = nn.Parameter(torch.empty(param.shape, device=device, dtype=kind), False)
                new.pieces, new.keeps_dtype = param.pieces, keeps
                made[id(param)] = new
            module._parameters[name] = made[id(param)]
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = torch.empty(buf.shape, device=device, dtype=buf.dtype)


def load_weights(model: nn.Module, spec: ModelSpec) -> None:
    """Fill every parameter from the checkpoint; all problems are reported at once, first."""
    params = unique_parameters(model)
    needed = {p.name: p.full_shape for param in params for p in param.pieces}
    with torch.device("meta"):  # the whole model's names: other stages read the rest
        whole = spec.cls(spec.config, SINGLE)
        if spec.fp8 is not None:
            quantize_layers(whole, spec.fp8)
        known = canonical_shapes(whole)
    stored = _canonical_names(checkpoint_files(spec.path), spec.cls, known)
    ignorable = spec.cls.unused_checkpoint_tensors(spec.config)
    # a float checkpoint served as block-FP8: the scales are made as the weights are read
    on_load = fp8_blocks(whole) if spec.fp8 is not None and not spec.fp8.stored else {}
    made = {scale_name(n) for n in on_load if n in stored}
    problems = [f"missing tensor {n}" for n in sorted(needed) if n not in stored and n not in made]
    problems += [
        f"unexpected tensor {stored[n][0]}"
        for n in sorted(stored)
        if n not in known and stored[n][0] not in ignorable
    ]
    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in {f for _, f in stored.values()}}

        def tensor_slice(canonical: str):
            disk_name, fname = stored[canonical]
            return handles[fname].get_slice(disk_name)

        for name, shape in sorted(needed.items()):
            if name in stored and tuple(tensor_slice(name).get_shape()) != shape:
                disk = tuple(tensor_slice(name).get_shape())
                problems.append(f"tensor {name} has shape {disk}, model expects {shape}")
        if on_load:
            tensor_slice = QuantizedOnLoad(tensor_slice, on_load).get
        if problems:
            raise ModelLoadError("; ".join(problems), file=str(spec.path))
        with torch.no_grad():
            for param in params:
                param.zero_()  # padding rows of a vocab shard stay zero
                for piece in param.pieces:
                    piece.write(param, tensor_slice(piece.name)[piece.box_slices()])


def _canonical_names(
    files: dict[str, Path], cls: type[TandemModel], known: dict
) -> dict[str, tuple[str, Path]]:
    """Canonical name -> (name on disk, file). A model may declare ``optional_prefix``: a
    checkpoint that omits it (GPT-2 hub files lack ``transformer.``) still maps exactly."""
    prefix = cls.optional_prefix
    out = {}
    for disk_name, fname in files.items():
        canonical = disk_name
        if prefix and disk_name not in known and prefix + disk_name in known:
            canonical = prefix + disk_name
        out[canonical] = (disk_name, fname)
    return out


def _open(fname: Path):
    try:
        return safe_open(fname, framework="pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"unreadable safetensors file ({exc})", file=str(fname)) from None
