"""The vLLM side of `tandem bench sync --into vllm`: run by vLLM's venv (tandem installed there
without its dependencies, ``make vllm``), it holds a vLLM engine with tandem's worker extension.

    .venv-vllm/bin/python -m tandem.bench.sync_vllm_host

JSON lines, one answer per request, on a private copy of fd 1 (vLLM's logs go to stderr):

- ``{"start": {"model": DIR, "tp": T}}`` -> ``{"address": ..., "load_seconds": s}``: the engine
  is up and tandem's exchange listens (trainers push to ``address``);
- ``{"generate": {"prompt": [...], "max_tokens": k}}`` -> ``{"tokens", "logprobs",
  "version"}``: greedy, for the bench's check after every push;
- ``{"load_weights": {"scalings": n}}`` -> ``{"seconds": s}``: vLLM's own update path as RL
  frameworks drive it: the model's full tensors, scaled ``n`` times by the bench's factors (so
  they equal the trainers' weights), passed to every worker by ``collective_rpc`` into its
  ``reload_weights``; timed around that call only (the tensors are ready, as if gathered);
- ``{"gathered": {"address": "host:port", "pushes": n}}`` -> ``{"listening": true}``: the RL
  frameworks' path from trainer processes (`tandem.bench.sync_pushes`, mode ``gathered``): a
  thread joins a 2-rank gloo group at ``address`` as rank 1 and, ``n`` times, receives every
  full tensor from trainer rank 0 (sorted by name), hands them all to every worker by
  ``collective_rpc`` into ``reload_weights``, and answers one byte.

stdin closed: exit.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> int:
    from tandem.bench.vllm_peer import protocol_channel

    out = protocol_channel()
    import torch
    import vllm

    from tandem.bench.sync_pushes import SCALES
    from tandem.integrations.vllm import WORKER_EXTENSION, vllm_target

    llm = target = model_dir = None
    for line in sys.stdin:
        ((kind, args),) = json.loads(line).items()
        if kind == "start":
            began = time.perf_counter()
            model_dir = args["model"]
            llm = vllm.LLM(
                model_dir,
                dtype="float32",
                tensor_parallel_size=args["tp"],
                max_model_len=256,
                kv_cache_memory_bytes=32 << 20,
                enforce_eager=True,
                worker_extension_cls=WORKER_EXTENSION,
            )
            target = vllm_target(llm)
            answer = {
                "address": target.exchange_address,
                "load_seconds": round(time.perf_counter() - began, 2),
            }
        elif kind == "generate":
            params = vllm.SamplingParams(
                max_tokens=args["max_tokens"], temperature=0.0, logprobs=0, ignore_eos=True
            )
            got = llm.generate(
                [vllm.TokensPrompt(prompt_token_ids=args["prompt"])], params, use_tqdm=False
            )[0].outputs[0]
            answer = {
                "tokens": list(got.token_ids),
                "logprobs": [
                    lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)
                ],
                "version": target.weight_version,
            }
        elif kind == "gathered":
            tensors = _tensors(model_dir)
            receiver = threading.Thread(
                target=_receive_gathered,
                args=(llm, tensors, args["address"], args["pushes"]),
                daemon=True,
            )
            receiver.start()
            answer = {"listening": True}
        elif kind == "load_weights":
            tensors = _tensors(model_dir)
            with torch.no_grad():
                for i in range(args["scalings"]):
                    for t in tensors.values():
                        t.mul_(SCALES[i % len(SCALES)])
            answer = {"seconds": _reload(llm, tensors)}
        else:
            raise ValueError(f"unknown request {kind!r}")
        out.write(json.dumps(answer) + "\n")
    return 0


def _reload(llm, tensors: dict) -> float:
    """vLLM's own update path: every worker's ``reload_weights`` fed ``tensors`` (full, by
    name) through ``collective_rpc``; the seconds that call took. Then the prefix cache goes."""
    weights = list(tensors.items())
    began = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    seconds = time.perf_counter() - began
    llm.reset_prefix_cache()
    return seconds


def _tensors(model_dir: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return dict(sorted(tensors.items()))


def _receive_gathered(llm, buffers: dict, address: str, pushes: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), 2, is_master=False, timeout=timedelta(seconds=600))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=600))
    for _ in range(pushes):
        for tensor in buffers.values():
            group.recv([tensor], 0, 0).wait()
        _reload(llm, buffers)
        group.send([torch.ones(1, dtype=torch.uint8)], 0, 0).wait()


if __name__ == "__main__":
    sys.exit(main())
