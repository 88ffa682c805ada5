"""vLLM's `vllm serve` flags on `tandem serve`: what tandem takes under vLLM's spelling, what
it ignores with a warning (flags that tune vLLM's GPU runtime or logging and change no output),
and how it refuses the rest. docs/serving.md lists all three (read off vLLM 0.33.0).

The spellings tandem takes are the option strings of `tandem serve`'s own arguments
(`tandem.cli`); this module adds the ignored flags and turns any other unknown option into one
clear error.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Ignored:
    spellings: tuple[str, ...]
    takes_value: bool
    why: str


IGNORED = (
    Ignored(("--gpu-memory-utilization", "--device-memory-utilization"), True,
            "tandem sizes its KV cache with --kv-cache-memory-bytes (bytes or a fraction)"),
    Ignored(("--enforce-eager", "--no-enforce-eager"), False, "tandem runs eagerly always"),
    Ignored(("--compilation-config", "-cc"), True, "tandem does not compile or capture graphs"),
    Ignored(("--optimization-level",), True, "tandem does not compile or capture graphs"),
    Ignored(("--max-cudagraph-capture-size",), True, "tandem captures no CUDA graphs"),
    Ignored(("--trust-remote-code", "--no-trust-remote-code"), False,
            "tandem never runs code from a model directory (its own classes run the model)"),
    Ignored(("--enable-sleep-mode", "--disable-sleep-mode", "--no-enable-sleep-mode"), False,
            "sleep / wake_up are always available (admin key)"),
    Ignored(("--enable-chunked-prefill", "--disable-chunked-prefill",
             "--no-enable-chunked-prefill"), False,
            "tandem always prefills in chunks within --max-num-batched-tokens"),
    Ignored(("--async-scheduling", "--no-async-scheduling"), False,
            "tandem overlaps steps across pipeline stages on its own"),
    Ignored(("--disable-custom-all-reduce", "--enable-custom-all-reduce",
             "--no-disable-custom-all-reduce"), False, "tandem uses torch.distributed's"),
    Ignored(("--disable-log-stats",), False, "tandem logs no periodic stats (see /metrics)"),
    Ignored(("--enable-log-requests", "--disable-log-requests", "--no-enable-log-requests"),
            False, "tandem does not log requests"),
    Ignored(("--disable-uvicorn-access-log", "--enable-uvicorn-access-log",
             "--no-disable-uvicorn-access-log"), False, "tandem keeps uvicorn's access log off"),
)  # fmt: skip

# flags tandem takes with only the values that mean what tandem does
ONLY_VALUES = {"--load-format": ("auto", "safetensors"), "--kv-cache-dtype": ("auto",)}
DTYPE_SPELLINGS = {"float": "float32", "half": "float16"}  # vLLM's other names
LOG_LEVELS = {"critical": "error", "trace": "debug", "notset": "debug"}  # folded into tandem's


class _Warn(argparse.Action):
    def __init__(self, option_strings, dest, why: str, **kwargs):
        self.why = why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"tandem serve: ignoring vLLM's {option_string}: {self.why}", file=sys.stderr)


class _OnlyValues(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        allowed = ONLY_VALUES[option_string]
        if values not in allowed:
            parser.error(f"{option_string} {values}: tandem supports only {', '.join(allowed)}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Register the ignored and value-checked vLLM flags on ``parser`` (`tandem serve`)."""
    group = parser.add_argument_group("vLLM flags tandem ignores (a warning names each)")
    for flag in IGNORED:
        value = {"nargs": None, "metavar": "VALUE"} if flag.takes_value else {"nargs": 0}
        group.add_argument(
            *flag.spellings,
            action=_Warn,
            why=flag.why,
            **value,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            help=flag.why,
        )
    for option, allowed in ONLY_VALUES.items():
        group.add_argument(
            option,
            action=_OnlyValues,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(allowed) + "}",
            help=f"accepted with {' or '.join(allowed)} only",
        )


def lora_modules(items: list[str]) -> tuple[dict[str, str], set[str]]:
    """vLLM's ``--lora-modules`` values (``name=path``, or JSON ``{"name", "path",
    "base_model_name"}``) -> ({name: path} in the order given, the base model names given).
    ConfigError names a bad one."""
    from tandem.server.config import ConfigError

    modules: dict[str, str] = {}
    bases: set[str] = set()
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--lora-modules: {item!r} is not JSON ({exc})") from None
            fields = {"name", "path", "base_model_name"}
            if (
                not isinstance(spec, dict)
                or set(spec) - fields
                or not {"name", "path"} <= set(spec)
                or not all(isinstance(v, str) for v in spec.values())
            ):
                raise ConfigError(
                    f"--lora-modules: {item!r}: give a JSON object with strings "
                    '"name", "path" and optionally "base_model_name"'
                )
            name, path = spec["name"], spec["path"]
            if "base_model_name" in spec:
                bases.add(spec["base_model_name"])
        elif "=" in item:
            name, _, path = item.partition("=")
        else:
            raise ConfigError(
                f'--lora-modules: {item!r}: give name=path or JSON {{"name": ..., "path": ...}}'
            )
        if not name or not path:
            raise ConfigError(f"--lora-modules: {item!r}: the name and the path must be given")
        if name in modules:
            raise ConfigError(f"--lora-modules: adapter {name!r} is given twice")
        modules[name] = path
    return modules, bases


def dashed(argv: list[str]) -> list[str]:
    """vLLM's parser also takes underscores in long option names (``--max_model_len``)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and not arg.startswith("---"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def refuse_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit with one message naming the options tandem serve does not have."""
    options = [a.partition("=")[0] for a in unknown if a.startswith("-")]
    if not options:
        parser.error(f"unexpected arguments: {' '.join(unknown)}")
    parser.error(
        f"unsupported option{'s' if len(options) > 1 else ''} {', '.join(options)}: tandem serve "
        "has no such setting (docs/serving.md lists the vLLM flags tandem takes, ignores and "
        "refuses)"
    )
