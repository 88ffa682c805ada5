"""The scenarios `tandem bench` runs, registered in one table (`SCENARIOS`, at the end).

A scenario is what one `tandem bench COMMAND [FLAGS]` line measures: a `Scenario` names its
command (``sync``), the flags that select it among that command's scenarios (``--into vllm``),
the options it takes besides ``--json`` and ``--quick`` (``--tp``), its run function (-> the
JSON-able result, with its ``ratios``) and the text it prints without ``--json``. The CLI builds
`tandem bench` from this registry (`commands`, `arguments`) and runs what `select` picks: no
bench has a branch of its own there.

Selecting flags: a switch (``--rolling``) selects a scenario when given; a flag with a value
(``--into vllm``) selects by its value. A command's first scenario is its default, what runs
with no selecting flag: the values it names are those flags' defaults (``--into tandem``).

Run and summary functions are named ``"module:function"`` (`Ref`) and imported when their
scenario runs: importing this module imports no bench module (nor torch).
"""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Result = dict[str, Any]


@dataclass(frozen=True)
class Option:
    """One option of `tandem bench`: its spellings and ``argparse.add_argument``'s keywords."""

    names: tuple[str, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.settings.get("dest") or self.names[0].lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        if "default" in self.settings:
            return self.settings["default"]
        return {"store_true": False, "store_false": True}.get(self.settings.get("action"))


def option(*names: str, **settings: Any) -> Option:
    return Option(names, settings)


@dataclass(frozen=True)
class Ref:
    """A function named ``"module:function"``, imported when it is first called."""

    path: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


def ratios(result: Result) -> str:
    """The default text without ``--json``: each of ``result["ratios"]``, one a line."""
    return "\n".join(f"{k}: {v:.2f}x" for k, v in result["ratios"].items())


@dataclass(frozen=True, eq=False)  # one record per scenario: equal only to itself
class Scenario:
    name: str  # unique: `tandem bench list` and `get` use it
    command: str  # `tandem bench COMMAND`
    flags: Mapping[str, str | bool]  # what selects it: {"--into": "vllm"}, {"--rolling": True}
    description: str  # one line
    run: Callable[..., Result]  # run(quick=..., **{option.dest: value}) -> the JSON result
    options: tuple[Option, ...] = ()  # what it takes besides --json and --quick
    summary: Callable[[Result], str] = ratios  # what it prints without --json


COMMON = (
    option("--json", action="store_true", help="print the full JSON result"),
    option("--quick", action="store_true", help="smaller workload (smoke test)"),
)
_registered: list[Scenario] = []


def register(scenario: Scenario) -> Scenario:
    """Add ``scenario``; ValueError if its name, its command line or an option's spelling
    clashes with what is registered."""
    if scenario.command == "list":
        raise ValueError("`tandem bench list` lists the scenarios: no scenario is called list")
    if any(s.name == scenario.name for s in _registered):
        raise ValueError(f"a bench scenario is already called {scenario.name!r}")
    if not scenarios(scenario.command) and True in scenario.flags.values():
        raise ValueError(
            f"{scenario.name}: a command's first scenario is its default, run with no "
            "selecting flag: no switch can select it"
        )
    switches = {flag for s in (*_registered, scenario) for flag, v in s.flags.items() if v is True}
    valued = {
        flag for s in (*_registered, scenario) for flag, v in s.flags.items() if v is not True
    }
    if both := switches & valued:
        raise ValueError(f"{', '.join(sorted(both))}: a switch in one scenario, valued in another")
    spelled = {name: o for o in COMMON for name in o.names}
    spelled.update({name: option(name) for name in switches | valued})
    for s in _registered:
        spelled.update({name: o for o in s.options for name in o.names})
    for o in scenario.options:
        for name in o.names:
            if spelled.get(name, o) != o:
                raise ValueError(f"{scenario.name}: {name} is spelled for another option already")
            spelled[name] = o
    _registered.append(scenario)
    line = _vector(scenario)
    if any(s is not scenario and _vector(s) == line for s in scenarios(scenario.command)):
        _registered.pop()
        raise ValueError(f"`{command_line(scenario)}` is registered already")
    return scenario


def scenarios(command: str | None = None) -> tuple[Scenario, ...]:
    """Every scenario in the order registered, or those of ``command``."""
    return tuple(s for s in _registered if command is None or s.command == command)


def get(name: str) -> Scenario:
    for s in _registered:
        if s.name == name:
            return s
    raise KeyError(f"no bench scenario {name!r}; the scenarios: {', '.join(_names())}")


def commands() -> tuple[str, ...]:
    """The commands of `tandem bench`, in the order their first scenarios were registered."""
    return tuple(dict.fromkeys(s.command for s in _registered))


def argv(scenario: Scenario) -> list[str]:
    """What follows `tandem bench` to select ``scenario``: ``["sync", "--into", "vllm"]``."""
    out = [scenario.command]
    defaults = _defaults(scenario.command)
    for flag, value in scenario.flags.items():
        if value is True:
            out.append(flag)
        elif value != defaults.get(flag):
            out += [flag, value]
    return out


def command_line(scenario: Scenario) -> str:
    return " ".join(["tandem bench", *argv(scenario)])


def arguments() -> list[Option]:
    """Every option of `tandem bench`, for ``argparse``: ``--json`` and ``--quick``, the
    selecting flags, then the scenarios' options, each help naming who takes it."""
    out = list(COMMON)
    flags = dict.fromkeys(flag for s in _registered for flag in s.flags)
    for flag in flags:
        named = [s for s in _registered if flag in s.flags]
        if all(s.flags[flag] is True for s in named):
            out.append(
                option(flag, action="store_true", help=f"selects: {_lines(named, short=True)}")
            )
            continue
        choices: dict[str, list[str]] = {}
        for s in named:
            default = _defaults(s.command)[flag]
            shown = f"{s.flags[flag]} (default)" if s.flags[flag] == default else s.flags[flag]
            choices.setdefault(s.command, []).append(shown)
        help_ = "; ".join(f"{cmd}: {', '.join(values)}" for cmd, values in choices.items())
        values = dict.fromkeys(s.flags[flag] for s in named)
        out.append(option(flag, choices=list(values), default=None, help=help_))
    seen: set[str] = set()
    for s in _registered:
        for o in s.options:
            if o.names[0] in seen:
                continue
            seen.add(o.names[0])
            users = [u for u in _registered if o in u.options]
            help_ = f"{o.settings.get('help', '')} ({_lines(users, short=True)})".lstrip()
            out.append(Option(o.names, {**o.settings, "help": help_}))
    return out


def select(command: str, values: Mapping[str, Any]) -> Scenario:
    """The scenario of ``command`` that the parsed ``values`` (``vars(namespace)``) select.
    ValueError, naming the choices, for a combination no scenario has or an option the
    selected scenario does not take."""
    own = scenarios(command)
    if not own:
        raise ValueError(f"no bench command {command!r}; the commands: {', '.join(commands())}")
    given = _given(values)
    defaults = _defaults(command)
    foreign = [flag for flag in given if flag not in defaults and _is_flag(flag)]
    wanted = {flag: given.get(flag, default) for flag, default in defaults.items()}
    match = [s for s in own if _vector(s) == wanted] if not foreign else []
    if not match:
        shown = " ".join(_spelled(flag, given[flag]) for flag in given if _is_flag(flag))
        line = f"tandem bench {command} {shown}".rstrip()
        hint = "".join(f"; {flag} goes with {_lines(_takers(flag))}" for flag in foreign)
        raise ValueError(
            f"no bench scenario is `{line}`{hint}; the {command} "
            f"scenarios: {_lines(own)} (`tandem bench list` describes them)"
        )
    (scenario,) = match
    takes = {name for o in scenario.options for name in o.names}
    for name in given:
        if not _is_flag(name) and name not in takes:
            raise ValueError(
                f"`{command_line(scenario)}` takes no {name} (only --json, --quick"
                f"{''.join(', ' + o.names[0] for o in scenario.options)}); {name} goes with "
                f"{_lines(_takers(name))}"
            )
    return scenario


def run_arguments(scenario: Scenario, values: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords ``scenario.run`` takes, from the parsed ``values``: ``quick`` and its
    options' values."""
    options = {o.dest: values[o.dest] for o in scenario.options}
    return {"quick": bool(values.get("quick")), **options}


def run(scenario: Scenario, values: Mapping[str, Any]) -> Result:
    """``scenario``'s result, its options taken from the parsed ``values``."""
    return scenario.run(**run_arguments(scenario, values))


def listing() -> str:
    """What `tandem bench list` prints: each scenario's command line and description."""
    rows = []
    for s in _registered:
        rows.append(f"  {command_line(s)}")
        rows += textwrap.wrap(s.description, 88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(rows)


def listing_json() -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "command": command_line(s),
            "description": s.description,
            "options": [o.names[0] for o in (*COMMON, *s.options)],
        }
        for s in _registered
    ]


# -- the rules above, in small pieces


def _names() -> list[str]:
    return [s.name for s in _registered]


def _defaults(command: str) -> dict[str, str | bool]:
    """Every selecting flag of ``command`` -> its value when not given."""
    own = scenarios(command)
    out: dict[str, str | bool] = {}
    for s in own:
        for flag, value in s.flags.items():
            out.setdefault(flag, False if value is True else own[0].flags.get(flag))
    return out


def _vector(scenario: Scenario) -> dict[str, str | bool]:
    return {**_defaults(scenario.command), **scenario.flags}


def _is_flag(name: str) -> bool:
    return any(name in s.flags for s in _registered)


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    """Selecting flags and options set away from their defaults, by spelling (``--into``)."""
    out: dict[str, Any] = {}
    for flag in dict.fromkeys(flag for s in _registered for flag in s.flags):
        value = values.get(_dest(flag))
        if value not in (None, False):
            out[flag] = value
    for s in _registered:
        for o in s.options:
            if o.dest in values and values[o.dest] != o.default:
                out[o.names[0]] = values[o.dest]
    return out


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _spelled(flag: str, value: Any) -> str:
    return flag if value is True else f"{flag} {value}"


def _takers(name: str) -> list[Scenario]:
    return [s for s in _registered if name in s.flags or any(name in o.names for o in s.options)]


def _lines(chosen: Iterable[Scenario], short: bool = False) -> str:
    lines = [" ".join(argv(s)) if short else f"`{command_line(s)}`" for s in chosen]
    return ", ".join(lines)


# -- tandem's scenarios

TP = option("--tp", type=int, default=1, metavar="N", help="tensor parallel ranks for tandem")
PP = option("--pp", type=int, default=1, metavar="N", help="pipeline parallel stages for tandem")
NO_VLLM = option(
    "--no-vllm",
    dest="vllm",
    action="store_false",
    help="leave out the vLLM peer (made by `make vllm`)",
)


SCENARIOS = (
    Scenario(
        name="generate",
        command="generate",
        flags={"--model-family": "llama"},
        description=(
            "generation throughput of a dense Llama (batch 1, mixed, GRPO rollouts): "
            "tandem against transformers and vLLM's CPU build"
        ),
        run=Ref("tandem.bench.generate:run"),
        options=(TP, PP, NO_VLLM),
    ),
    Scenario(
        name="generate-moe",
        command="generate",
        flags={"--model-family": "qwen3_moe"},
        description="generation throughput of a Qwen3-MoE model: tandem against transformers",
        run=Ref("tandem.bench.generate_moe:run"),
        options=(TP, PP),
    ),
    Scenario(
        name="generate-dtypes",
        command="generate",
        flags={"--engine-dtypes": True},
        description=(
            "engines of each weight format (float32, bfloat16, block-FP8) on the "
            "workloads of `tandem bench generate`"
        ),
        run=Ref("tandem.bench.generate_dtypes:run"),
        summary=Ref("tandem.bench.generate_dtypes:summary"),
    ),
    Scenario(
        name="generate-lora",
        command="generate",
        flags={"--lora": True},
        description=(
            "a batch mixing 4 LoRA adapters, one adapter, and the base model; an "
            "adapter push against a full push"
        ),
        run=Ref("tandem.bench.generate_lora:run"),
        summary=Ref("tandem.bench.generate_lora:summary"),
    ),
    Scenario(
        name="generate-profile",
        command="generate",
        flags={"--profile": True},
        description=(
            "where tandem's engine spends a step (matmuls, LM head, attention, pointwise, "
            "sampling, Python), on the bench model and a 30-layer, 49k-vocabulary shape"
        ),
        run=Ref("tandem.bench.generate_profile:run"),
        summary=Ref("tandem.bench.generate_profile:summary"),
    ),
    Scenario(
        name="serve",
        command="serve",
        flags={},
        description="a real `tandem serve` under Poisson load, continuous against static batching",
        run=Ref("tandem.bench.serve:run"),
        options=(TP, PP),
        summary=Ref("tandem.bench.serve:summary"),
    ),
    Scenario(
        name="sync",
        command="sync",
        flags={"--into": "tandem"},
        description=(
            "2 FSDP2 trainer processes pushing into LLM(tp=2) over shm, gloo and "
            "Mooncake, staged and in place, against memcpy, raw gloo and raw Mooncake"
        ),
        run=Ref("tandem.bench.sync:run"),
        summary=Ref("tandem.bench.sync:summary"),
    ),
    Scenario(
        name="sync-vllm",
        command="sync",
        flags={"--into": "vllm"},
        description=(
            "the same trainers into vLLM's CPU build, tandem's push against vLLM's own "
            "reload_weights, and tandem as vLLM's weight-transfer backend against vLLM's nccl "
            "engine over gloo, both through vLLM's trainer API (needs `make vllm`)"
        ),
        run=Ref("tandem.bench.sync_vllm:run"),
    ),
    Scenario(
        name="sync-serve",
        command="sync",
        flags={"--into": "serve"},
        description=(
            "into a `tandem serve` through vLLM's RL weight-transfer protocol, against "
            "tandem's WeightSender"
        ),
        run=Ref("tandem.bench.sync_serve:run"),
        summary=Ref("tandem.bench.sync_serve:summary"),
    ),
    Scenario(
        name="sync-dtypes",
        command="sync",
        flags={"--engine-dtypes": True},
        description=(
            "the same float32 trainer into float32, bfloat16 and block-FP8 engines "
            "(bytes and seconds)"
        ),
        run=Ref("tandem.bench.sync_dtypes:run"),
        summary=Ref("tandem.bench.sync_dtypes:summary"),
    ),
    Scenario(
        name="sync-delta",
        command="sync",
        flags={"--delta": True},
        description=(
            "a real RL run (GRPO, AdamW at lr 1e-6 and 1e-5) into a bfloat16 LLM(tp=2): each "
            "step's delta push against the dense push of the same weights, over shm, gloo and "
            "Mooncake"
        ),
        run=Ref("tandem.bench.sync_delta:run"),
        summary=Ref("tandem.bench.sync_delta:summary"),
    ),
    Scenario(
        name="encode",
        command="encode",
        flags={},
        description=(
            "a BERT classifier on mixed-length inputs: tandem's unpadded batches "
            "against transformers' padded ones"
        ),
        run=Ref("tandem.bench.encode:run"),
        options=(TP,),
    ),
    Scenario(
        name="fleet",
        command="fleet",
        flags={"--into": "tandem"},
        description=(
            "pushes into 1-3 replicas against the naive fleet push; routing over "
            "replicas against one engine"
        ),
        run=Ref("tandem.bench.fleet:run"),
        summary=Ref("tandem.bench.fleet:summary"),
    ),
    Scenario(
        name="fleet-rolling",
        command="fleet",
        flags={"--rolling": True},
        description=(
            "3 replicas under load while pushes run, stop-the-world against rolling, "
            "and a replica killed mid-push"
        ),
        run=Ref("tandem.bench.fleet_rolling:run"),
        summary=Ref("tandem.bench.fleet_rolling:summary"),
    ),
    Scenario(
        name="fleet-vllm",
        command="fleet",
        flags={"--into": "vllm"},
        description=(
            "3 vllm serve behind tandem router under load while pushes run through it: "
            "steady, stop-the-world (vLLM's /pause), all and rolling; a server killed, "
            "restarted and healed from a peer (needs `make vllm`)"
        ),
        run=Ref("tandem.bench.fleet_vllm:run"),
        summary=Ref("tandem.bench.fleet_vllm:summary"),
    ),
)
for _scenario in SCENARIOS:
    register(_scenario)
