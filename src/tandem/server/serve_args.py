"""`tandem serve`'s command line: its flags (vLLM's spellings among them: `vllm_flags`) and
the settings they make (`serve_config`: the TOML file, if any, under the flags given)."""

from __future__ import annotations

import argparse

from tandem.server import vllm_flags
from tandem.server.config import ConfigError, ServeConfig, load_config

_SERVE_FLAGS = ("model", "tp", "pp", "host", "port", "api_key", "admin_key",
                "served_model_name", "max_waiting_requests", "log_level",
                "shutdown_timeout_s")  # fmt: skip
_ENGINE_FLAGS = ("task", "data_parallel_size", "distributed_executor_backend", "ray_address",
                 "placement_strategy", "dtype", "quantization", "device", "nnodes",
                 "master_addr", "master_port", "max_num_seqs",
                 "kv_cache_memory", "block_size", "batching", "max_model_len", "seed",
                 "max_num_batched_tokens", "scheduling_policy", "enable_prefix_caching",
                 "collective_timeout_s", "max_staleness", "push_phase_timeout_s",
                 "enable_lora", "max_loras", "max_lora_rank")  # fmt: skip


def add_arguments(s: argparse.ArgumentParser) -> None:
    """`tandem serve`'s flags, under tandem's and vLLM's spellings, on subparser ``s``."""
    s.add_argument("--config", help="TOML file of these settings (flags override it)")
    s.add_argument("model_tag", nargs="?", metavar="MODEL", help="as vLLM: same as --model")
    s.add_argument("--model", help="model directory (Hugging Face format)")
    s.add_argument(
        "--tensor-parallel-size", "-tp", "--tp", dest="tp", type=int, help="tensor parallel size"
    )
    s.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        "--pp",
        dest="pp",
        type=int,
        help="pipeline parallel size",
    )
    s.add_argument(
        "--data-parallel-size",
        "-dp",
        "--dp",
        dest="data_parallel_size",
        type=int,
        help="replicas (each tp x pp ranks) behind this one server: requests are "
        "routed over them, one push updates them all",
    )
    s.add_argument("--host", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="default 8000; 0 picks a free port")
    s.add_argument("--api-key", help="required as a Bearer token on /v1 routes")
    s.add_argument("--admin-key", help="enables admin routes (weight sync, pause, abort, sleep)")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model id clients send (default: dir name); one name",
    )
    s.add_argument("--max-waiting-requests", type=int, help="more waiting: 429 (default 256)")
    levels = ["debug", "info", "warning", "error", *vllm_flags.LOG_LEVELS]
    s.add_argument(
        "--log-level", "--uvicorn-log-level", dest="log_level", choices=levels, type=str.lower
    )
    s.add_argument(
        "--shutdown-timeout",
        dest="shutdown_timeout_s",
        type=float,
        help="grace for in-flight requests on SIGTERM (default 10 s)",
    )
    s.add_argument(
        "--task",
        choices=["generate", "embed", "classify"],
        help="generate (default): /v1/completions and chat; embed: /v1/embeddings; "
        "classify: /v1/classify",
    )
    s.add_argument(
        "--runner",
        choices=["generate", "pooling"],
        help="as vLLM: generate = --task generate; pooling needs --convert",
    )
    s.add_argument("--convert", choices=["embed", "classify"], help="as vLLM: --task embed|...")
    s.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        help="mp (default): worker processes; ray: each rank a Ray actor",
    )
    s.add_argument("--ray-address", help="ray: the cluster to join (default: 'auto')")
    s.add_argument(
        "--placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
    )
    s.add_argument(
        "--dtype",
        help="auto (default: bfloat16 where a start-up probe finds it "
        "faster, else float32), float32, bfloat16, float16 (vLLM's float, "
        "half)",
    )
    s.add_argument(
        "--quantization",
        "-q",
        choices=["fp8"],
        help="fp8: block-FP8 weights (FP8 checkpoints are, without it)",
    )
    s.add_argument("--device")
    s.add_argument("--max-num-seqs", type=int)
    s.add_argument("--max-model-len", type=int)
    s.add_argument(
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        dest="kv_cache_memory",
        type=_bytes_or_fraction,
        metavar="BYTES|FRACTION",
        help="KV cache per rank: bytes (an integer), or a fraction in (0, 1] of the "
        "free device memory (default 1 GiB)",
    )
    s.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    s.add_argument("--batching", choices=["continuous", "static"])
    s.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default 2048)")
    s.add_argument("--scheduling-policy", choices=["fcfs", "priority", "lof"])
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="share prompts among samples, cache prefixes (default on)",
    )
    s.add_argument(
        "--disable-prefix-caching",
        dest="enable_prefix_caching",
        default=None,
        action="store_false",
        help="as vLLM: --no-enable-prefix-caching",
    )
    s.add_argument("--seed", type=int)
    s.add_argument("--nnodes", "-n", type=int)
    s.add_argument("--node-rank", "-r", type=int, default=0)
    s.add_argument("--master-addr", help="the engine's (node 0) address")
    s.add_argument("--master-port", type=int, help="the engine's c10d port")
    s.add_argument(
        "--distributed-timeout-seconds",
        dest="collective_timeout_s",
        type=float,
        help="timeout of the ranks' collectives (default 120)",
    )
    s.add_argument(
        "--max-staleness",
        type=int,
        help="fleet: versions behind the newest a replica may be and still take new "
        "requests during a rolling push (0: only the newest)",
    )
    s.add_argument(
        "--push-phase-timeout",
        dest="push_phase_timeout_s",
        type=float,
        help="seconds a weight push's transport waits before failing the push "
        "(default 300); ranks silent past it are declared hung",
    )
    s.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        help="serve LoRA adapters: a request's `model` names one",
    )
    s.add_argument("--max-loras", type=int, help="adapters in slots at once (default 1)")
    s.add_argument("--max-lora-rank", type=int, help="the highest adapter rank (default 16)")
    s.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="NAME=PATH",
        help="LoRA adapters to load at start-up: name=path, or vLLM's JSON "
        '\'{"name": ..., "path": ...}\'',
    )
    s.add_argument(
        "--model-module",
        action="append",
        default=[],
        help="module that registers a custom architecture (repeatable)",
    )
    vllm_flags.add_vllm_flags(s)


def _bytes_or_fraction(text: str) -> int | float:
    """``--kv-cache-memory``: ``1073741824`` (bytes), ``0.05`` (a fraction), ``1e9`` (bytes)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give bytes (an integer) or a fraction in (0, 1]"
        ) from None
    return int(value) if value > 1 and value.is_integer() else value


def serve_config(args) -> ServeConfig:
    """`tandem serve`'s settings: the TOML file (if any) overridden by the flags given."""
    _vllm_spellings(args)
    flags = {k: getattr(args, k) for k in _SERVE_FLAGS if getattr(args, k) is not None}
    engine = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    if args.model_module:
        engine["model_modules"] = args.model_module
    bases: set[str] = set()
    if args.lora_modules is not None:
        flags["lora_modules"], bases = vllm_flags.lora_modules(args.lora_modules)
    config = load_config(args.config, {**flags, "engine": engine})
    if bases - {config.model_name}:
        raise ConfigError(
            f"--lora-modules: base_model_name {sorted(bases)[0]!r} is not the "
            f"served model ({config.model_name!r})"
        )
    return config


def _vllm_spellings(args) -> None:
    """Fold vLLM's spellings into tandem's settings (ConfigError names a clash)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.served_model_name is not None:
        if len(args.served_model_name) > 1:
            raise ConfigError("--served-model-name: tandem serves one name")
        args.served_model_name = args.served_model_name[0]
    if args.dtype is not None:
        args.dtype = vllm_flags.DTYPE_SPELLINGS.get(args.dtype, args.dtype)
    if args.log_level is not None:
        args.log_level = vllm_flags.LOG_LEVELS.get(args.log_level, args.log_level)
    if args.runner == "pooling" and args.convert is None:
        raise ConfigError("--runner pooling: give --convert embed or --convert classify")
    task = args.convert or args.runner
    if task is not None:
        if args.task is not None and args.task != task:
            raise ConfigError(f"--task {args.task} and vLLM's --runner/--convert ({task}) differ")
        args.task = task
