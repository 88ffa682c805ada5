"""Chat messages -> prompt text, through the model directory's own chat template(s).

Where the templates are read from, in transformers' order (``AutoTokenizer.from_pretrained``,
then the processor's legacy file):

1. ``chat_template.jinja`` (the template named ``default``) and every
   ``additional_chat_templates/<name>.jinja`` (the template ``<name>``): what transformers
   (4.4x and later) writes. If any of these files exists, they are the model's templates and
   the ``tokenizer_config.json`` key is not read at all.
2. Otherwise ``chat_template`` in ``tokenizer_config.json``: one template string, or a list of
   ``{"name", "template"}`` entries (older transformers).
3. Otherwise ``chat_template`` in ``chat_template.json``: the file a multimodal processor
   saved before transformers moved to ``chat_template.jinja`` (``AutoTokenizer`` skips it; a
   processor reads it; here it is the last resort).

Templates are named when transformers holds a dict of them: several files, a lone
``additional_chat_templates`` file not named ``default``, or a list under the key. Which one a
chat uses is transformers' ``get_chat_template`` rule: with named templates, the one that
``chat_template`` names, else ``tool_use`` when tools are given and there is one, else
``default`` (none: an error listing the names); a ``chat_template`` argument that names no
template (with a single template: any) is template text itself.

Rendering is ``apply_chat_template(..., tokenize=False)``'s: a sandboxed Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, the ``{%
generation %}`` block, ``raise_exception``, ``strftime_now`` and a non-escaping ``tojson``;
messages lose their ``None``-valued keys; the template sees ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...) and any extra keyword arguments (which win over them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2.ext
from jinja2 import TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
LEGACY_PROCESSOR_FILE = "chat_template.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``, or a Jinja error)."""


class NoChatTemplate(ChatTemplateError):
    """The model has no chat template, or none of its named templates is the one asked for."""


class ChatTemplate:
    """The chat templates of one model directory (read once) and the rendering of a chat.

    ``templates`` maps each template's name to its source (a lone unnamed template is
    ``default``); ``named`` says whether they are named templates (transformers holds a dict)
    rather than one template; ``origin`` is the file or directory they came from (None: the
    model has none)."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.templates: dict[str, str] = {}
        self.named, self.origin, self.special_tokens = False, None, {}
        self.problem: str | None = None  # why templates that are there cannot be used
        try:
            config = _read_json(model_dir / TOKENIZER_CONFIG)
            self.templates, self.named, self.origin = _read_templates(model_dir, config)
            self.special_tokens = _special_tokens(model_dir, config)
        except (OSError, ValueError) as exc:  # chats fail (400 when served); the model loads
            self.templates, self.named, self.origin, self.problem = {}, False, None, str(exc)

    def select(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The source of the template a chat uses (the rule is in the module docstring)."""
        if not self.named:
            if chat_template is not None:
                return chat_template
            if self.problem is not None:
                raise NoChatTemplate(self.problem)
            if not self.templates:
                raise NoChatTemplate(
                    f"this model has no chat template (no {TEMPLATE_FILE}, no `chat_template` in "
                    f"its {TOKENIZER_CONFIG}, no {LEGACY_PROCESSOR_FILE}); use a prompt instead"
                )
            return self.templates["default"]
        if chat_template is not None:
            return self.templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" not in self.templates:
            raise NoChatTemplate(
                "this model has several chat templates and none named `default`; name one of "
                f"{sorted(self.templates)}"
            )
        return self.templates["default"]

    def render(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list | None = None,
        **template_kwargs,
    ) -> str:
        """One conversation (a list of ``{"role", "content", ...}`` dicts) as prompt text.
        ``chat_template``: a template's name, or template text. Raises `NoChatTemplate` or
        `ChatTemplateError` (both ``ValueError``)."""
        source = self.select(chat_template, tools)
        if not messages:
            raise ChatTemplateError("the conversation is empty")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict")
            chat.append({k: v for k, v in message.items() if v is not None})
        variables = {"documents": None, **self.special_tokens, **template_kwargs}
        try:
            return _compile(source).render(
                messages=chat,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None


def _read_templates(model_dir: Path, config: dict) -> tuple[dict[str, str], bool, str | None]:
    """(templates by name, named, origin): transformers' order (module docstring)."""
    templates: dict[str, str] = {}
    named_dir = model_dir / NAMED_TEMPLATES_DIR
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    default = model_dir / TEMPLATE_FILE
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    if templates:
        origin = TEMPLATE_FILE if default.is_file() else NAMED_TEMPLATES_DIR
        return templates, set(templates) != {"default"}, origin
    for origin in (TOKENIZER_CONFIG, LEGACY_PROCESSOR_FILE):
        source = config if origin == TOKENIZER_CONFIG else _read_json(model_dir / origin)
        value = source.get("chat_template")
        if value is not None:
            return _from_key(value, origin), not isinstance(value, str), origin
    return {}, False, None


def _from_key(value, path: str) -> dict[str, str]:
    """A ``chat_template`` key's templates: a string, or a list of ``{"name", "template"}``."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(map(_is_named_template, value)):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(
        f"`chat_template` in {path} is neither a string nor a list of {{name, template}} objects"
    )


def _is_named_template(entry) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
    )


def _special_tokens(model_dir: Path, config: dict) -> dict[str, str]:
    """The named special tokens the template sees: every ``*_token`` of the tokenizer config
    (overridden by the legacy ``special_tokens_map.json`` when the config predates
    ``added_tokens_decoder``, as transformers does)."""
    entries = dict(config)
    if "added_tokens_decoder" not in config:
        entries.update(_read_json(model_dir / SPECIAL_TOKENS_MAP))
    tokens = {}
    for key, value in entries.items():
        if isinstance(value, dict):  # AddedToken form
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            tokens[key] = value
    return tokens


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path.name} is not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): its
    body, unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own escapes HTML characters; transformers' does not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None
