"""The model's chat template behind ``/v1/chat/completions``: the engine's rendering
(`tandem.engine.chat_template`), its refusals as 400s."""

from __future__ import annotations

from tandem.engine.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate
from tandem.server.errors import APIError


class ServedChat:
    def __init__(self, template: ChatTemplate | None):
        self.template = template  # None: the model has no tokenizer (an image model)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> str:
        try:
            if self.template is None:
                raise NoChatTemplate("this model has no tokenizer, so no chat template")
            return self.template.render(messages, add_generation_prompt, **template_kwargs)
        except NoChatTemplate as exc:
            raise APIError(400, str(exc), param="messages", code="no_chat_template") from None
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
