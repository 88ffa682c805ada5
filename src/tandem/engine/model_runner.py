"""Runs the model on one scheduled batch: builds the flat tensors, owns the KV cache, samples."""

from __future__ import annotations

import numpy as np
import torch

from tandem.engine.kv_cache import BlockManager, budget_bytes, bytes_per_block
from tandem.engine.scheduler import ScheduledBatch
from tandem.layers.attention import Attention, AttentionMetadata, DecodeGroup, PrefillSpan
from tandem.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from tandem.models.loader import ModelSpec, build_model, load_weights
from tandem.parallel import SINGLE, TPGroup

_NO_TOP_K = torch.iinfo(torch.long).max
# Cost of one more decode group, in padded key slots: a group's fixed per-layer op overhead is
# worth about this many slots of gather + attention work (measured on CPU).
DECODE_GROUP_OVERHEAD = 256
MAX_DECODE_GROUPS = 4


def group_by_length(lengths: list[int], overhead: int) -> list[list[int]]:
    """Split decode sequences into at most MAX_DECODE_GROUPS groups of consecutive lengths
    (sorted), minimising padded slots (members x longest) + overhead per group. Returns indices."""
    if len(lengths) <= 1:
        return [list(range(len(lengths)))] if lengths else []
    order = np.argsort(lengths, kind="stable")
    longest = np.asarray(lengths)[order]
    n = len(order)
    first = np.arange(n + 1)[:, None]  # a group covers sorted members [first, end)
    end = np.arange(n + 1)[None, :]
    width = np.concatenate(([0], longest))[None, :]  # the group's longest: member end - 1
    span_cost = np.where(first < end, (end - first) * width + overhead, np.inf)
    # best[g, j]: cost of the first j sorted members in g groups; cut[g, j]: last group's start
    best = np.full((MAX_DECODE_GROUPS + 1, n + 1), np.inf)
    cut = np.zeros((MAX_DECODE_GROUPS + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0
    for g in range(1, MAX_DECODE_GROUPS + 1):
        total = best[g - 1][:, None] + span_cost
        cut[g] = total.argmin(axis=0)
        best[g] = total[cut[g], np.arange(n + 1)]
    g = int(best[1:, n].argmin()) + 1
    groups, j = [], n
    while g > 0:
        i = int(cut[g, j])
        groups.append(order[i:j].tolist())
        g, j = g - 1, i
    return groups[::-1]


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
        prefills, decodes = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, stop = seq.num_cached_tokens, seq.num_cached_tokens + n
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:stop])
            positions.extend(range(start, stop))
            slot_mapping.extend(self.blocks.slots(seq, start, stop))
            last_rows.append(row + n - 1)
            if n == 1:
                decodes.append((row, stop, seq.block_table))
            else:
                context = None
                if start > 0:
                    context = self._tensor(self.blocks.slots(seq, 0, stop))
                prefills.append(PrefillSpan(row, row + n, context))
        groups = group_by_length([length for _, length, _ in decodes], DECODE_GROUP_OVERHEAD)
        meta = AttentionMetadata(
            self._tensor(slot_mapping),
            prefills,
            [self._decode_group([decodes[i] for i in members]) for members in groups],
        )
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

    def _decode_group(self, members: list[tuple[int, int, list[int]]]) -> DecodeGroup:
        """(flat row, context length, block table) of each member -> padded gather indices."""
        width = max(len(table) for _, _, table in members)
        tables = self._tensor([table + [0] * (width - len(table)) for _, _, table in members])
        lens = [length for _, length, _ in members]
        pos = torch.arange(max(lens), device=self.device)
        slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
        mask = None
        if min(lens) != max(lens):
            mask = (pos[None, :] < self._tensor(lens)[:, None])[:, None, None, :]
        return DecodeGroup(self._tensor([row for row, _, _ in members]), slots, mask)

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
