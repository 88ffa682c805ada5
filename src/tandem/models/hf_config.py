"""The base of every model's ``config.json`` schema: the fields a model reads, under every
spelling Hugging Face transformers writes or reads.

transformers keeps aliases for renamed config attributes (a config class's ``attribute_map``,
alias -> stored name): its 5.x Qwen3-MoE and Mixtral store ``num_local_experts`` and read
``num_experts``; GPT-2 stores ``n_embd`` and reads ``hidden_size``. A model's schema declares
those spellings in ``spellings`` (other spelling -> our field), so a checkpoint saved by any
transformers version loads; a file giving two spellings of one field with different values is
an error naming both.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class HFConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    spellings: ClassVar[dict[str, str]] = {}  # another spelling in config.json -> our field

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, values):
        if not isinstance(values, dict) or not cls.spellings:
            return values
        values = dict(values)
        for other, field in cls.spellings.items():
            if other not in values:
                continue
            value = values.pop(other)
            if field in values and values[field] != value:
                raise ValueError(
                    f"{other} ({value!r}) and {field} ({values[field]!r}) are two spellings of "
                    "one setting and disagree"
                )
            values[field] = value
        return values
