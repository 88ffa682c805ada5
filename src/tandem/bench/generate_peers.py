"""The transformers sides of `tandem bench generate`: tuned static batches, continuous batching.

Both run in the bench's own process and torch thread pool (transformers' continuous batching
steps the model in a background Python thread of its own, which uses the same pool while the
calling thread waits). Every call returns the useful tokens it produced and raises when any
request got a number of tokens other than the one asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from math import ceil
from pathlib import Path
from typing import Any

import torch

Request = tuple[list[int], int]  # prompt ids, requested output tokens
STATIC_BATCH_SIZES = (8, 16, 32, 64)  # plain generate: each timed once, the fastest is kept
CB_PAGE_SIZE = 32  # tokens per KV page (transformers' default, 256, is sized for GPU prompts)
CB_BATCH_TOKENS = 2048  # tokens per step, as tandem's default max_num_batched_tokens
CB_REQUESTS_PER_BATCH = (16, 32, 64)  # continuous batching: each timed once, the fastest is kept
CB_SEED = 0


def load(path: Path, attn_implementation: str = "sdpa", **options: Any) -> Any:
    """The model in float32 on CPU, eval mode, EOS off in its generation config (``options``
    go to ``from_pretrained``, e.g. ``experts_implementation``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn_implementation, **options
    ).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as tandem's ignore_eos does
    return model


class StaticBatches:
    """transformers' plain ``generate``, tuned: requests sorted by (output, prompt) length, cut into
    left-padded batches of ``batch_size``, each decoding to the longest output in it.

    `tune` times each of STATIC_BATCH_SIZES once (after the caller's warm-up) and keeps the
    fastest; sizes at or above the request count are one batch and timed once.
    """

    def __init__(self, model: Any, pad: int, batch_size: int = 16):
        self.model, self.pad, self.batch_size = model, pad, batch_size

    def tune(self, reqs: list[Request]) -> dict[int, float]:
        sizes = sorted({min(size, len(reqs)) for size in STATIC_BATCH_SIZES})
        seconds = {}
        for size in sizes:
            start = time.perf_counter()
            self(reqs, size)
            seconds[size] = round(time.perf_counter() - start, 4)
        self.batch_size = min(seconds, key=seconds.__getitem__)
        return seconds

    @torch.inference_mode()
    def __call__(self, reqs: list[Request], batch_size: int | None = None) -> int:
        size = batch_size or self.batch_size
        order = sorted(reqs, key=lambda r: (r[1], len(r[0])))
        useful = 0
        for i in range(0, len(order), size):
            chunk = order[i : i + size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (p, _) in enumerate(chunk):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(n for _, n in chunk)
            out = self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new,
                eos_token_id=None,
                pad_token_id=self.pad,
            )
            if out.shape[1] != width + new:  # EOS must not stop a batch early
                raise RuntimeError(f"transformers generated {out.shape[1] - width}, asked {new}")
            useful += sum(n for _, n in chunk)  # the rest of each row is waste
        return useful


class ContinuousBatching:
    """transformers' continuous batching (paged KV cache, ``sdpa`` attention over a flat batch).

    One instance per workload, greedy (``n=None``) or sampling ``n`` per prompt: its manager is
    sized for that workload (`config`), built and started by the first call and kept running
    until `close` (`running` brackets a timed run that way); each call adds its requests to it
    and waits for every result. ``generate_batch`` is this plus building, starting and stopping a
    manager on every call (`generate_batch` runs it that way once, for the record).
    """

    def __init__(self, model: Any, seqs: list[tuple[int, int]], n: int | None = None):
        """``seqs``: (prompt length, output length) of every sequence the workload runs at once."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        try:
            import psutil  # noqa: F401  (transformers checks its CPU cache size with it)
        except ImportError:
            raise RuntimeError(
                "transformers' continuous batching needs psutil on CPU; "
                "install the bench extra: pip install -e '.[bench]'"
            ) from None
        if not hasattr(model, "init_continuous_batching"):
            raise RuntimeError("this transformers has no continuous batching (generate_batch)")
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        self.model, self.n, self.manager, self.sequences = model, n or 1, None, len(seqs)
        pages = sum(ceil((p + k) / CB_PAGE_SIZE) for p, k in seqs)
        self.config = ContinuousBatchingConfig(
            page_size=CB_PAGE_SIZE,
            num_blocks=pages + len(seqs),  # every sequence resident at once: no offloading
            max_batch_tokens=CB_BATCH_TOKENS,
            max_requests_per_batch=len(seqs),
            seed=CB_SEED,
        )
        self.generation = GenerationConfig(
            do_sample=n is not None,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=self.n,
            max_new_tokens=max(k for _, k in seqs),
            eos_token_id=-1,  # no EOS: -1 is never sampled
        )

    def tune(self, warm: Callable[[], int], run: Callable[[], int]) -> dict[int, float]:
        """Times ``run`` once for each of CB_REQUESTS_PER_BATCH as ``max_requests_per_batch``
        (capped at the workload's sequences), each on a new manager warmed by ``warm``, and
        keeps the fastest. On CPU a step attends over all of its sequences at once, so fewer
        sequences per step can be faster, not only more."""
        seconds = {}
        for size in sorted({min(size, self.sequences) for size in CB_REQUESTS_PER_BATCH}):
            self.close()  # the manager is sized when built
            self.config.max_requests_per_batch = size
            warm()
            start = time.perf_counter()
            run()
            seconds[size] = round(time.perf_counter() - start, 4)
        self.close()
        self.config.max_requests_per_batch = min(seconds, key=seconds.__getitem__)
        return seconds

    @contextmanager
    def running(self, warm: Callable[[], int]) -> Iterator[None]:
        """A started manager warmed by ``warm``, stopped on leaving: an idle manager's loop
        keeps torch's OpenMP threads spinning and would slow whatever runs beside it."""
        warm()
        try:
            yield
        finally:
            self.close()

    def describe(self) -> dict[str, Any]:
        keys = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch")
        return {key: getattr(self.config, key) for key in keys}

    @torch.inference_mode()
    def greedy(self, reqs: list[Request]) -> int:
        """Each request with its own output length (``generate_batch`` takes one for all)."""
        manager = self._running()
        ids = [manager.add_request(p, max_new_tokens=k, eos_token_id=-1) for p, k in reqs]
        return _check(self._collect(ids), [k for _, k in reqs])

    @torch.inference_mode()
    def sample(self, prompts: list[list[int]], new: int) -> int:
        """``n`` samples of ``new`` tokens per prompt (``num_return_sequences=n``: the manager
        forks each request after its prefill, the children sharing its KV pages)."""
        ids = self._running().add_requests(prompts, max_new_tokens=new)
        ids = [f"{i}__child#{c}" for i in ids for c in range(self.n - 1)] + ids
        return _check(self._collect(ids), [new] * len(prompts) * self.n)

    def generate_batch(self, prompts: list[list[int]], new: int) -> int:
        """The same sampling through one plain ``model.generate_batch`` call."""
        out = self.model.generate_batch(
            prompts,
            generation_config=self.generation,
            continuous_batching_config=self.config,
            max_new_tokens=new,
        )
        return _check(list(out.values()), [new] * len(prompts) * self.n)

    def __enter__(self) -> ContinuousBatching:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop and drop the manager (its loop thread would keep the process alive)."""
        if self.manager is not None:
            self.manager.stop(block=True)
            self.manager.destroy()
            self.manager = None

    def _running(self) -> Any:
        if self.manager is None:
            self.manager = self.model.init_continuous_batching(
                generation_config=self.generation, continuous_batching_config=self.config
            )
            self.manager.start()
        return self.manager

    def _collect(self, ids: list[str | None]) -> list[Any]:
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not self.manager.is_running():
                break  # the loop died: the missing results fail the check
        return [results.get(i) for i in ids]


def _check(results: list[Any], asked: list[int]) -> int:
    """Useful tokens of finished, error-free results; raises unless each has what was asked."""
    got = [-1 if r is None or r.error is not None else len(r.generated_tokens) for r in results]
    if len(got) != len(asked) or got != asked:
        raise RuntimeError(f"transformers continuous batching produced {got} tokens, asked {asked}")
    return sum(got)
