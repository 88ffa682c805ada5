"""The vLLM side of `tandem bench generate`: a standalone driver run by vLLM's own venv.

``.venv-vllm/bin/python src/tandem/bench/vllm_peer.py`` imports only vLLM and the standard
library (tandem is not installed in that venv; the bench imports this file for its message types,
and vLLM is imported only in `main`). It speaks JSON lines: one `Start` on stdin, answered by one
`Ready`; then one `Generate` per call, answered by one `Generated` with the call's seconds timed
here around ``llm.generate`` (so the JSON transfer is not vLLM's cost); stdin closed: exit. The
protocol runs on a private copy of fd 1, and fd 1 is pointed at stderr, so vLLM's logs (and its
worker processes') never reach the channel. Any failure is a traceback on stderr and a non-zero
exit. vLLM spawns its engine core and worker processes, hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import IO, Any

BLOCK_SIZE = 128  # vLLM's CPU default KV block, used to size its cache room


@dataclass(frozen=True)
class Start:
    """How to build the ``vllm.LLM``; None leaves vLLM's default in place."""

    model: str
    dtype: str
    seed: int
    max_model_len: int
    kv_cache_memory_bytes: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kind: str = field(default="start", init=False)


@dataclass(frozen=True)
class Ready:
    vllm_version: str
    torch_version: str
    load_seconds: float
    settings: dict[str, Any]  # what the engine runs with, read back from its config
    kind: str = field(default="ready", init=False)


@dataclass(frozen=True)
class Generate:
    """One ``llm.generate`` call: greedy when temperature is 0; ``n`` samples per prompt."""

    prompts: list[list[int]]
    max_tokens: list[int]
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    kind: str = field(default="generate", init=False)


@dataclass(frozen=True)
class Generated:
    seconds: float  # around llm.generate, in this process
    token_counts: list[list[int]]  # per prompt, per sample
    kind: str = field(default="generated", init=False)


MESSAGES = {
    cls.__dataclass_fields__["kind"].default: cls for cls in (Start, Ready, Generate, Generated)
}


def encode(message: Start | Ready | Generate | Generated) -> str:
    return json.dumps(asdict(message)) + "\n"


def decode(line: str, expected: type) -> Any:
    """One JSON line as the message type ``expected``; ValueError naming what does not fit."""
    if not line:
        raise ValueError(f"the peer closed its channel, expected a {expected.__name__}")
    data = json.loads(line)
    kind = data.pop("kind", None)
    if MESSAGES.get(kind) is not expected:
        raise ValueError(f"message kind {kind!r}, expected {expected.__name__}")
    names = {f.name for f in fields(expected) if f.init}
    if set(data) != names:
        raise ValueError(f"{expected.__name__} fields {sorted(data)}, expected {sorted(names)}")
    return expected(**data)


def protocol_channel() -> IO[str]:
    """The protocol's stdout: a private copy of fd 1, which then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main() -> int:
    out = protocol_channel()
    start = decode(sys.stdin.readline(), Start)
    began = time.perf_counter()
    import torch
    import vllm

    options = {
        name: value
        for name in ("max_num_seqs", "max_num_batched_tokens")
        if (value := getattr(start, name)) is not None
    }
    llm = vllm.LLM(
        model=start.model,
        dtype=start.dtype,
        seed=start.seed,
        max_model_len=start.max_model_len,
        kv_cache_memory_bytes=start.kv_cache_memory_bytes,
        block_size=BLOCK_SIZE,
        **options,
    )
    config = llm.llm_engine.vllm_config
    settings = {
        "max_model_len": config.model_config.max_model_len,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "block_size": config.cache_config.block_size,
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "compilation_mode": str(config.compilation_config.mode),
        "compilation_backend": config.compilation_config.backend,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    ready = Ready(
        vllm.__version__, torch.__version__, round(time.perf_counter() - began, 3), settings
    )
    out.write(encode(ready))
    for line in sys.stdin:
        call = decode(line, Generate)
        params = [
            vllm.SamplingParams(
                n=call.n,
                temperature=call.temperature,
                top_p=call.top_p,
                top_k=0,
                max_tokens=k,
                ignore_eos=True,
                detokenize=False,
            )
            for k in call.max_tokens
        ]
        prompts = [vllm.TokensPrompt(prompt_token_ids=ids) for ids in call.prompts]
        began = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        counts = [[len(c.token_ids) for c in o.outputs] for o in outs]
        out.write(encode(Generated(seconds, counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
