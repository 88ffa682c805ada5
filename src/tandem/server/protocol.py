"""Request schemas of the OpenAI-compatible routes (OpenAI field names, strict types).

Unknown fields and values of the wrong type are rejected (400, naming the field) rather than
silently ignored or coerced: a typo in ``temprature`` must not sample at temperature 1. ``null``
means the field's default wherever OpenAI's API or vLLM accept it (the official client sends
``"temperature": null`` for ``temperature=None``); elsewhere it is a wrong type.
Extensions beyond OpenAI's fields follow vLLM's names (``top_k``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``request_id``, ``return_token_ids``, ``detokenize``, ``return_routed_experts``) plus
``logprobs_mode`` and ``priority``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tandem.engine.sampling_params import SamplingParams
from tandem.server.errors import APIError

MAX_INT = 2**63 - 1
REQUEST_ID_PATTERN = r"^[\w.:-]+$"  # no `#`: the engine's per-prompt ids are `<id>#<index>`
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
StopString = Annotated[str, Field(min_length=1, max_length=256)]
# what a chat's own fields set; `chat_template` (template text from a request) is not taken
RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "add_generation_prompt", "chat_template"}


def _null_is_default(cls: type[BaseModel], value, info: ValidationInfo):
    """A ``mode="before"`` field validator: ``null`` becomes the field's default."""
    if value is None:
        return cls.model_fields[info.field_name].get_default(call_default_factory=True)
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(max_length=1024)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_INT)
    n: int = Field(1, ge=1, le=64)
    stop: StopString | list[StopString] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, le=MAX_INT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=1024)
    # extensions
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs_mode: Literal["raw", "processed"] = "raw"
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=REQUEST_ID_PATTERN)
    return_token_ids: bool = False  # also return the prompt's token ids on every choice
    detokenize: bool = True  # False: no text, token ids and log-probs only
    return_routed_experts: bool = False  # MoE: each token's experts (routing replay)

    _nullable = field_validator(
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stream",
        "presence_penalty",
        "frequency_penalty",
        "stop_token_ids",
        "return_token_ids",
        mode="before",
    )(_null_is_default)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"`{name}` is not supported (must be 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "`logit_bias` is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "`stream_options` needs `stream: true`", param="stream_options")
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            logprobs_mode=self.logprobs_mode,
            skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=prompt_logprobs,
            detokenize=self.detokenize,
            return_routed_experts=self.return_routed_experts,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=64)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=64)
    suffix: None = None

    _nullable_echo = field_validator("echo", mode="before")(_null_is_default)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "`best_of` other than `n` is not supported", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "`max_tokens: 0` needs `echo: true` (score the prompt)", param="max_tokens"
            )
        scored = self.echo and (self.logprobs is not None or self.max_tokens == 0)
        prompt_logprobs = (self.logprobs or 0) if scored else None
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys are ignored: clients send back assistant messages with refusal, tool_calls...
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    # vLLM's: extra variables for the chat template (Qwen3's ``enable_thinking``, ...), and
    # whether the tokenizer adds its special tokens on top of what the template wrote
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    add_special_tokens: bool = False

    _nullable_logprobs = field_validator("logprobs", "add_special_tokens", mode="before")(
        _null_is_default
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_variables(cls, kwargs: dict[str, Any] | None):
        reserved = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise ValueError(f"{reserved} are set by the request itself, not by kwargs")
        return kwargs

    def params(self) -> SamplingParams:
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError(400, "tool calling is not supported", param="tools")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(
                400, "only `response_format: {type: text}` is supported", param="response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.max_completion_tokens or self.max_tokens, logprobs)


EncodeInput = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=2048)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=2048)
    ]
)


class _EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(max_length=1024)
    input: EncodeInput
    user: str | None = Field(None, max_length=1024)

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class EmbeddingRequest(_EncodeRequest):
    """OpenAI's ``/v1/embeddings`` body, plus ``pooling`` and ``normalize`` (vLLM's names)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    pooling: Literal["cls", "last", "mean"] | None = None
    normalize: bool = False


class ClassifyRequest(_EncodeRequest):
    """vLLM's ``/v1/classify`` body."""


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=1024)
    lora_path: str = Field(min_length=1, max_length=4096)  # a PEFT directory on the server
    load_inplace: bool = False  # vLLM's; tandem loads a new version of a loaded name either way


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``/v1/unload_lora_adapter`` body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=1024)
    lora_int_id: int | None = None  # vLLM's; the name identifies
