"""Token sampling for a batch of rows, each with its own settings and random stream.

Logprobs come in two modes, per request:
- ``raw``: log_softmax of the model's logits — before temperature, top-k and top-p. This is
  what a trainer recomputes from the same weights, so it is the default for RL.
- ``processed``: log-prob under the distribution actually sampled from (after temperature,
  top-k and top-p renormalisation). Greedy rows (temperature 0) report raw values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import pointwise


@dataclass(slots=True)
class SamplingBatch:
    temperatures: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] long; >= vocab size disables
    top_p: torch.Tensor  # [B] float in (0, 1]
    generators: list[torch.Generator | None]  # per row; None = the engine's shared stream
    processed_logprobs: torch.Tensor  # [B] bool: report processed instead of raw logprobs
    num_top_logprobs: int = 0  # alternatives to report per row (max over rows)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperatures == 0).all())

    @property
    def needs_filter(self) -> bool:
        vocab_cap = self.top_k.new_tensor(torch.iinfo(torch.long).max)
        return bool((self.top_k < vocab_cap).any() or (self.top_p < 1.0).any())


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B] log-prob of each sampled token (mode per row)
    top_ids: torch.Tensor | None  # [B, k] most likely tokens, same mode as ``logprobs``
    top_logprobs: torch.Tensor | None


class Sampler:
    def __init__(self, shared: torch.Generator):
        self.shared = shared

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        fused = batch.num_top_logprobs == 0 and logits.dim() == 2 and pointwise.serves(logits)
        if fused and batch.all_greedy:
            tokens, logprobs = pointwise.greedy(logits)  # one kernel call, no [B, V] output
            return SamplerOutput(tokens, logprobs, None, None)
        if fused and not batch.needs_filter:  # two passes a row, no [B, V] output
            greedy = batch.temperatures == 0
            uniform = self._uniforms(batch.generators, greedy.tolist(), logits.device)
            tokens, logprobs = pointwise.sample(
                logits, batch.temperatures, uniform, batch.processed_logprobs & ~greedy
            )
            return SamplerOutput(tokens, logprobs, None, None)
        raw = torch.log_softmax(logits, dim=-1)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens, chosen = greedy_tokens, raw
        else:
            greedy = batch.temperatures == 0
            temps = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
            filtered = batch.needs_filter
            if filtered or bool((temps != 1.0).any()):
                scaled = logits / temps[:, None]
                if filtered:
                    scaled = _filter_top_k_top_p(scaled, batch.top_k, batch.top_p)
                processed = torch.log_softmax(scaled, dim=-1)
            else:  # temperature 1, no filter: the sampled distribution is the raw one
                processed = raw
            sampled = self._draw(processed.exp(), batch.generators, greedy.tolist())
            tokens = torch.where(greedy, greedy_tokens, sampled)
            use_processed = batch.processed_logprobs & ~greedy
            chosen = torch.where(use_processed[:, None], processed, raw)
        logprobs = chosen.gather(1, tokens[:, None]).squeeze(1)
        top_ids = top_lp = None
        if batch.num_top_logprobs > 0:
            top_lp, top_ids = chosen.topk(batch.num_top_logprobs, dim=-1)
        return SamplerOutput(tokens, logprobs, top_ids, top_lp)

    def _uniforms(self, generators, greedy: list[bool], device: torch.device) -> torch.Tensor:
        """One float32 uniform in [0, 1) per row [B] on ``device`` (the generators'): a seeded
        row's from its own stream, the unseeded rows' from the shared one in one draw; greedy
        rows draw nothing (0, unused)."""
        uniform = torch.zeros(len(generators), dtype=torch.float32, device=device)
        shared = []
        for row, gen in enumerate(generators):
            if greedy[row]:
                continue
            if gen is None:
                shared.append(row)
            else:
                uniform[row : row + 1].uniform_(generator=gen)
        if shared:
            draw = torch.rand(
                len(shared), generator=self.shared, dtype=torch.float32, device=device
            )
            uniform.index_copy_(0, torch.tensor(shared, device=device), draw)
        return uniform

    def _draw(self, probs, generators, greedy: list[bool]) -> torch.Tensor:
        """One token per row from ``probs`` [B, V] by inverting the row's CDF at one uniform
        (`_uniforms`): the first token whose cumulative mass exceeds U times the row's total.
        One random number per row instead of one per token (Gumbel-max's noise was a [B, V]
        draw, two passes over it and most of a sampled decode step's sampling time)."""
        uniform = self._uniforms(generators, greedy, probs.device).to(probs.dtype)[:, None]
        cdf = probs.cumsum(dim=-1)
        # kept strictly below the total (U * total can round up to it), so the first
        # cumulative value above the target is a token's with mass: a filtered-out token
        # (zero mass) never is
        total = cdf[:, -1:]
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _filter_top_k_top_p(scaled, top_k, top_p) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p[:, None]  # the most likely token always has mass_before 0
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
