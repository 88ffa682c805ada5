"""The labels of a classification head, as ``config.json`` names them (``id2label``)."""

from __future__ import annotations

from pydantic import Field

from tandem.models.hf_config import HFConfig


class Labels(HFConfig):
    id2label: dict[str, str] = Field(default_factory=lambda: {"0": "LABEL_0", "1": "LABEL_1"})

    @property
    def num_labels(self) -> int:
        return len(self.id2label)
