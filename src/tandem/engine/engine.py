"""The engine core: requests in, one scheduled model step at a time, finished sequences out."""

from __future__ import annotations

import itertools
import time

from tandem.config import EngineConfig
from tandem.engine.kv_cache import blocks_for
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.tokenizer import Tokenizer
from tandem.layers.sampler import SamplerOutput
from tandem.models.loader import read_model_spec


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size/pipeline_parallel_size > 1: the multi-process engine is "
                "not available in this version; use 1"
            )
        self.config = config
        self.spec = read_model_spec(config.model)
        limit = self.spec.max_context_len
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's {limit}")
        self.max_model_len = config.max_model_len or limit
        max_batched = config.max_num_batched_tokens or max(8192, self.max_model_len)
        if max_batched < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_model_len "
                f"({self.max_model_len}) so any prompt fits in one step"
            )
        self.tokenizer = Tokenizer(self.spec.path)
        self.runner = ModelRunner(
            self.spec,
            dtype=config.torch_dtype,
            device=config.torch_device,
            block_size=config.block_size,
            kv_cache_memory=config.kv_cache_memory,
            seed=config.seed,
        )
        self.scheduler = Scheduler(self.runner.blocks, config.max_num_seqs, max_batched)
        self.weight_version = 0
        self._seq_ids = itertools.count()

    def make_sequences(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> list[Sequence]:
        """Check one request and turn it into its ``n`` samples (not queued yet)."""
        if not prompt_ids:
            raise ValueError(f"request {request_id}: prompt is empty")
        vocab = self.spec.vocab_size
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int)]
        bad += [t for t in prompt_ids if isinstance(t, int) and not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id}: token ids outside [0, {vocab}): {bad[:8]}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"request {request_id}: prompt has {len(prompt_ids)} tokens; max_model_len is "
                f"{self.max_model_len} and at least one token must be generated"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        need = blocks_for(len(prompt_ids) + max_tokens, self.runner.block_size)
        if need > self.runner.num_blocks:
            raise ValueError(
                f"request {request_id}: needs {need} KV blocks but the cache has "
                f"{self.runner.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        now = time.monotonic()
        return [
            Sequence(next(self._seq_ids), request_id, i, prompt_ids, params, max_tokens, now)
            for i in range(params.n)
        ]

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Run one iteration; returns the sequences that finished in it."""
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        out = self.runner.execute(batch)
        self._append(batch, out)
        self.scheduler.finish_step(batch)
        return [s for s in batch.seqs if s.finished]

    def _append(self, batch: ScheduledBatch, out: SamplerOutput) -> None:
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for row, seq in enumerate(batch.seqs):
            token = tokens[row]
            seq.token_ids.append(token)
            k = seq.params.logprobs
            if k is not None:
                seq.logprobs.append(logprobs[row])
                if k > 0:
                    seq.top_logprobs.append(
                        dict(zip(top_ids[row][:k], top_lps[row][:k], strict=True))
                    )
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if not params.ignore_eos and token in self.spec.eos_token_ids:
            return seq.finish("stop")
        if token in params.stop_token_ids:
            return seq.finish("stop", token)
        if params.stop:
            text = self.output_text(seq)
            found = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
            if found:
                idx, stop = min(found)
                seq.text = text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
                return seq.finish("stop", stop)
        if seq.num_output_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
            seq.finish("length")

    def output_text(self, seq: Sequence) -> str:
        if seq.text is not None:
            return seq.text
        return self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)
