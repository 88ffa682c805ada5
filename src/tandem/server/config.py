"""`tandem serve` settings: command-line flags over a TOML file, typed and validated.

The TOML file takes every flag by its long name with underscores (``model``, ``tp``, ``port``,
``api_key``, ...) plus an ``[engine]`` table for any other `EngineConfig` option::

    model = "./my-model"
    tp = 2
    port = 8000
    admin_key = "..."

    [engine]
    dtype = "float32"
    max_num_seqs = 64

An unknown key or a value of the wrong type is a `ConfigError` that names it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.config import EngineConfig, flat_location


class ConfigError(ValueError):
    """A bad server setting; the message names the key (and the file)."""


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str
    tp: int = Field(1, ge=1, description="tensor parallel size")
    pp: int = Field(1, ge=1, description="pipeline parallel size")
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 exposes the server")
    port: int = Field(8000, ge=0, le=65535, description="0: any free port (logged)")
    api_key: str | None = Field(None, min_length=1, description="required on /v1 routes")
    admin_key: str | None = Field(
        None, min_length=16, description="enables /admin routes; absent: they are disabled"
    )
    served_model_name: str | None = Field(None, min_length=1, description="default: dir name")
    max_waiting_requests: int = Field(256, ge=1, description="more waiting: 429")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="larger bodies: 413")
    shutdown_timeout_s: float = Field(10.0, ge=0, description="grace for in-flight requests")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    lora_modules: dict[str, Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict,
        description="LoRA adapters loaded at start-up: name -> PEFT directory (engine enable_lora)",
    )
    engine: dict[str, Any] = Field(default_factory=dict, description="other EngineConfig options")

    def engine_config(self) -> EngineConfig:
        return EngineConfig.model_validate(
            {
                "model": self.model,
                "tensor_parallel_size": self.tp,
                "pipeline_parallel_size": self.pp,
                **self.engine,
            },
            strict=True,
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> ServeConfig:
    """The file's settings (if any) with ``overrides`` (flags given on the command line) on top;
    ``overrides["engine"]`` merges into the file's ``[engine]`` table."""
    values: dict[str, Any] = {}
    where = "command line"
    if path is not None:
        where = str(path)
        try:
            values = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    engine = {**values.get("engine", {}), **overrides.pop("engine", {})}
    values.update(overrides)
    if engine:
        values["engine"] = engine
    try:
        config = ServeConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"{where}: " + _describe(exc.errors())) from None
    clash = {"model", "tensor_parallel_size", "pipeline_parallel_size"} & set(config.engine)
    if clash:
        raise ConfigError(f"{where}: set engine.{sorted(clash)[0]} at the top level (model/tp/pp)")
    try:
        engine_config = config.engine_config()
    except ValidationError as exc:
        raise ConfigError(f"{where}: " + _describe(exc.errors(), prefix="engine.")) from None
    if config.lora_modules and not engine_config.lora.enable_lora:
        raise ConfigError(
            f"{where}: `lora_modules` needs LoRA enabled (--enable-lora, engine enable_lora = true)"
        )
    for name in config.lora_modules:
        if not name or name == config.model_name:
            why = " (the served model's name)" if name else ""
            raise ConfigError(f"{where}: `lora_modules`: an adapter may not be named {name!r}{why}")
    return config


def _describe(errors: list[dict], prefix: str = "") -> str:
    out = []
    for error in errors:
        field = ".".join(str(p) for p in flat_location(error["loc"]))
        loc = prefix + field
        msg = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            out.append(f"unknown key `{loc}`")
        elif error["type"] == "missing":
            out.append(f"`{loc}` is required")
        elif not field:  # a check across settings: its message names them
            out.append(msg)
        else:
            out.append(f"`{loc}`: {msg} (got {error.get('input')!r})")
    return "; ".join(out)
