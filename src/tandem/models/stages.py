"""Pipeline stages: which decoder layers (and which end modules) a rank holds.

A model class declares its `PipelineLayout` (the ModuleList of layers, the modules only the first
stage runs, those only the last runs); the split itself lives here, outside model code.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    layers: str  # attribute holding the nn.ModuleList of decoder layers
    first: tuple[str, ...]  # modules only the first stage runs (embeddings)
    last: tuple[str, ...]  # modules only the last stage runs (final norm, LM head)


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    count: int
    start: int  # first decoder layer held
    end: int  # one past the last

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @classmethod
    def whole(cls, spec) -> Stage:
        return cls(0, 1, 0, spec.num_layers)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return getattr(model, model.pipeline.layers)[self.start : self.end]


def split_layers(num_layers: int, stages: int, sizes: list[int] | None = None) -> list[Stage]:
    """Consecutive layer ranges per stage: ``sizes`` if given (uneven allowed), else as even as
    possible with the earlier stages taking the remainder."""
    if sizes is None:
        if stages > num_layers:
            raise ValueError(
                f"pipeline_parallel_size ({stages}) exceeds the model's {num_layers} layers"
            )
        base, extra = divmod(num_layers, stages)
        sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    if len(sizes) != stages or sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(
            f"pipeline_layer_split {sizes} must give each of {stages} stages >= 1 layer and "
            f"sum to the model's {num_layers} layers"
        )
    out, start = [], 0
    for i, size in enumerate(sizes):
        out.append(Stage(i, stages, start, start + size))
        start += size
    return out


class _NotOnThisStage(nn.Module):
    """Stands in for a layer another pipeline stage holds."""


def prune_to_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """Drop what this stage does not run, before any storage is allocated."""
    layout: PipelineLayout = model.pipeline
    layers = getattr(model, layout.layers)
    for i in range(len(layers)):
        if not stage.start <= i < stage.end:
            layers[i] = _NotOnThisStage()
    if not stage.is_first:
        for name in layout.first:
            setattr(model, name, None)
    if not stage.is_last:
        for name in layout.last:
            setattr(model, name, None)
    return model
