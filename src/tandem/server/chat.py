"""Chat messages -> prompt text, through the model's own chat template.

The template is ``chat_template`` in the model directory's ``tokenizer_config.json`` (a string,
or a list of named templates of which ``default`` is used), rendered the way Hugging Face's
``apply_chat_template`` does: a sandboxed Jinja environment, ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception`` available, and ``bos_token`` / ``eos_token`` set.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.server.errors import APIError


class ChatTemplate:
    def __init__(self, model_dir: str | Path):
        self.source: str | None = None
        self._specials: dict[str, str] = {}
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return
        config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            self.source = template
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(key)
            if isinstance(value, dict):  # AddedToken form
                value = value.get("content")
            if isinstance(value, str):
                self._specials[key] = value
        if self.source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.source is None:
            raise APIError(
                400,
                "this model has no chat template (no `chat_template` in its "
                "tokenizer_config.json); use /v1/completions with a prompt",
                param="messages",
                code="no_chat_template",
            )
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._specials
            )
        except TemplateError as exc:
            message = f"the chat template rejected the messages: {exc}"
            raise APIError(400, message, param="messages") from None


def _raise(message: str):
    raise TemplateError(message)
