"""Runs the model on one scheduled batch: builds the flat tensors, owns the KV cache, samples."""

from __future__ import annotations

import torch

from tandem.engine.kv_cache import BlockManager, budget_bytes, bytes_per_block
from tandem.engine.scheduler import ScheduledBatch
from tandem.layers.attention import Attention, AttentionMetadata, PrefillSpan
from tandem.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from tandem.models.loader import ModelSpec, build_model, load_weights
from tandem.parallel import SINGLE, TPGroup

_NO_TOP_K = torch.iinfo(torch.long).max


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        kv_cache_memory: int | float,
        seed: int,
        tp: TPGroup = SINGLE,
    ):
        self.device = device
        self.block_size = block_size
        self.model = build_model(spec, tp, dtype, device)
        load_weights(self.model, spec)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        a = self.attention_layers[0]
        per_block = bytes_per_block(
            len(self.attention_layers), block_size, a.num_kv_heads, a.head_dim, dtype
        )
        self.num_blocks = budget_bytes(kv_cache_memory, device) // per_block
        self.blocks = BlockManager(self.num_blocks, block_size)
        slots = self.num_blocks * block_size
        self.kv_cache = torch.zeros(
            2, len(self.attention_layers), slots, a.num_kv_heads, a.head_dim, dtype=dtype,
            device=device,
        )  # fmt: skip
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.sampler = Sampler(torch.Generator(device).manual_seed(seed))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Compute the batch's new tokens and sample one next token per sequence."""
        input_ids, positions, slot_mapping, last_rows = [], [], [], []
        prefills, decode_rows, decode_lens = [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, stop = seq.num_cached_tokens, seq.num_cached_tokens + n
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:stop])
            positions.extend(range(start, stop))
            slot_mapping.extend(self.blocks.slots(seq, start, stop))
            last_rows.append(row + n - 1)
            if n == 1:
                decode_rows.append(row)
                decode_lens.append(stop)
            else:
                context = None
                if start > 0:
                    context = self._tensor(self.blocks.slots(seq, 0, stop))
                prefills.append(PrefillSpan(row, row + n, context))
        meta = AttentionMetadata(self._tensor(slot_mapping), prefills)
        if decode_rows:
            meta.decode_rows = self._tensor(decode_rows)
            seqs = [s for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n == 1]
            meta.decode_slots, meta.decode_mask = self._decode_gather(seqs, decode_lens)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), meta)
        logits = self.model.compute_logits(hidden[self._tensor(last_rows)])
        return self.sampler(logits, self._sampling_batch(batch))

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every position of each prompt (float32), leaving the KV cache untouched."""
        input_ids, positions, spans = [], [], []
        for ids in prompts:
            spans.append(PrefillSpan(len(input_ids), len(input_ids) + len(ids)))
            input_ids.extend(ids)
            positions.extend(range(len(ids)))
        meta = AttentionMetadata(None, spans)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), meta)
        logits = self.model.compute_logits(hidden).float()
        return [logits[s.start : s.end] for s in spans]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _generator(self, seq) -> torch.Generator | None:
        """The sample's own random stream: same seed, same tokens, whatever else is batched."""
        if seq.params.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed + seq.index)
        return seq.generator

    def _decode_gather(self, seqs, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s.block_table) for s in seqs)
        tables = self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs])
        longest = max(lens)
        pos = torch.arange(longest, device=self.device)
        slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
        mask = pos[None, :] < self._tensor(lens)[:, None]
        return slots, mask[:, None, None, :]

    def _sampling_batch(self, batch: ScheduledBatch) -> SamplingBatch:
        params = [s.params for s in batch.seqs]
        return SamplingBatch(
            temperatures=torch.tensor([p.temperature for p in params], device=self.device),
            top_k=self._tensor([p.top_k if p.top_k_enabled else _NO_TOP_K for p in params]),
            top_p=torch.tensor([p.top_p for p in params], device=self.device),
            generators=[self._generator(s) for s in batch.seqs],
            processed_logprobs=torch.tensor(
                [p.logprobs_mode == "processed" for p in params], device=self.device
            ),
            num_top_logprobs=max(p.logprobs or 0 for p in params),
        )
