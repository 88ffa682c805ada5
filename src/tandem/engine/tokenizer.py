"""Text <-> token ids through the model directory's ``tokenizer.json`` (`tokenizers` library),
and chats -> text through its chat template (`tandem.engine.chat_template`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from tandem.engine.chat_template import ChatTemplate
from tandem.errors import ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError("file not found", file=str(path))
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"cannot be parsed ({exc})", file=str(path)) from None
        self.chat_template = ChatTemplate(model_dir)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_types(self, text: str) -> tuple[list[int], list[int]]:
        """Ids and token type ids (the post-processor's: BERT adds [CLS] ... [SEP])."""
        enc = self._tok.encode(text)
        return enc.ids, enc.type_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder_config(self) -> dict | None:
        """The decoder's ``tokenizer.json`` entry (None when the tokenizer has no decoder)."""
        decoder = self._tok.decoder
        return None if decoder is None else json.loads(decoder.__getstate__())

    def apply_chat_template(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        **template_kwargs,
    ) -> str | list[int]:
        """transformers' ``apply_chat_template`` for one conversation: the rendered text
        (``tokenize=False``) or its token ids (encoded without adding special tokens)."""
        text = self.chat_template.render(
            conversation, add_generation_prompt, chat_template, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
