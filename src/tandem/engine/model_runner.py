"""One rank's model runner: applies step messages, builds the flat batch, owns its KV cache.

The runner keeps a mirror of what it needs per sequence (block table, sampling settings, random
stream), updated from each `StepMessage`. It runs its pipeline stage's layers; the last stage's
sampling rank turns logits into a `StepResult`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import get_args

import numpy as np
import torch

from tandem.config import LoRAConfig
from tandem.engine import host_memory
from tandem.engine.kv_cache import budget_bytes, bytes_per_block
from tandem.engine.messages import (
    SCORE_FRAME_BYTES,
    EncodeMessage,
    EncodeResult,
    PromptLogprobs,
    ScoreMessage,
    ScoreResult,
    SeqParams,
    StepMessage,
    StepResult,
)
from tandem.engine.weight_memory import WeightMemory
from tandem.exchange.transports.memory import ParamArena
from tandem.kernels import paged, paged_prefill
from tandem.kernels.paged import PagedDecode
from tandem.kernels.paged_prefill import PagedPrefill
from tandem.layers.attention import (
    Attention,
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    SharedPrefixGroup,
)
from tandem.layers.gemm import disable_packing
from tandem.layers.lora import LoRARows, attach_lora
from tandem.layers.moe import SparseMoE
from tandem.layers.sampler import Sampler, SamplingBatch
from tandem.models.base import Pooling
from tandem.models.loader import ModelSpec, build_model, load_weights
from tandem.models.stages import Stage
from tandem.parallel import SINGLE, TPGroup

_NO_TOP_K = torch.iinfo(torch.long).max
# Cost of one more decode group, in padded key slots: a group's fixed per-layer op overhead is
# worth about this many slots of gather + attention work (measured on CPU).
DECODE_GROUP_OVERHEAD = 256
MAX_DECODE_GROUPS = 4
PROMPT_SCORE_ROWS = 256  # prompt rows scored per logits matrix (rows x vocab floats)


POOLINGS = get_args(Pooling)


def _pool(rows: torch.Tensor, how: str) -> torch.Tensor:
    """One sequence's hidden states [n, H] -> [H]."""
    if how == "cls":
        return rows[0]
    if how == "last":
        return rows[-1]
    if how == "mean":
        return rows.float().mean(dim=0).to(rows.dtype)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {how!r}")


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


# Cost of gathering one cached key/value slot, in (query, key) attention scores: a gather moves
# the slot's keys and values through memory, a score is a few cached multiply-adds (measured on
# CPU, where decode attention is bound by the gather).
GATHER_COST = 12


def shared_prefix_groups(
    decodes: list[tuple[int, int, list[int]]], block_size: int
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Split decode members (flat row, context length, block table) into groups whose tables
    start with the same blocks, worth attending together (see `SharedPrefixGroup`), and the
    rest. Returns ([(member indices, shared blocks)], other indices)."""
    by_first: dict[int, list[int]] = {}
    for i, (_, _, table) in enumerate(decodes):
        by_first.setdefault(table[0], []).append(i)
    groups, rest = [], []
    for members in by_first.values():
        shared = _common_blocks([decodes[i] for i in members], block_size)
        lengths = [decodes[i][1] for i in members]
        keys = shared * block_size + sum(n - shared * block_size for n in lengths)
        together = (GATHER_COST + len(members)) * keys
        apart = (GATHER_COST + 1) * sum(lengths)
        if len(members) > 1 and shared and together < apart:
            groups.append((members, shared))
        else:
            rest.extend(members)
    return groups, rest


def _common_blocks(members: list[tuple[int, int, list[int]]], block_size: int) -> int:
    """Leading blocks every member's table has in common, full in every member's context."""
    limit = min(length for _, length, _ in members) // block_size
    first = members[0][2]
    shared = 0
    while shared < limit and all(table[shared] == first[shared] for _, _, table in members):
        shared += 1
    return shared


class _SeqState:
    __slots__ = ("block_table", "params", "generator", "pending")

    def __init__(self, params: SeqParams):
        self.block_table: list[int] = []
        self.params = params
        self.generator: torch.Generator | None = None
        # a scored prompt's chunk boundary: (position, log-probs predicting its token), kept
        # until the chunk holding that position arrives
        self.pending: tuple[int, torch.Tensor] | None = None


@dataclass(slots=True)
class _PromptScore:
    """Rows of one step whose logits score a sequence's prompt tokens."""

    seq_id: int
    state: _SeqState
    first: int  # position of the first token scored
    rows: list[int]  # flat rows predicting positions first+1.. (in-chunk targets)
    targets: list[int]  # the prompt token at each of those positions
    from_pending: tuple[int, torch.Tensor] | None  # (token at `first`, the kept log-probs)
    boundary: tuple[int, int] | None  # (last row, next position): predicts the next chunk's


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        seed: int,
        tp: TPGroup = SINGLE,
        stage: Stage | None = None,
        pipe=None,
        samples: bool = True,
        packed_weights: bool = True,
        paged_kernels: bool = True,
        host_memory_reuse: bool = True,
        load: bool = True,
        lora: LoRAConfig | None = None,
    ):
        if host_memory_reuse and device.type == "cpu":
            host_memory.keep_freed()
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.stage = stage or Stage.whole(spec)
        self.pipe = pipe  # PipeChannel to the neighbouring stages; None without pipelining
        self.samples = samples and self.stage.is_last
        self.model = build_model(spec, tp, dtype, device, self.stage)
        if not packed_weights:
            disable_packing(self.model)
        self.lora_rows: LoRARows | None = None  # with ``lora``: the adapter slot of each row
        if lora is not None:
            self.lora_rows, _ = attach_lora(
                self.model, lora.max_loras, lora.max_lora_rank, dtype, device
            )
        if load:
            load_weights(self.model, spec)
        else:  # load_format="dummy": zeros until a push writes every canonical box
            with torch.no_grad():
                for param in self.model.parameters():
                    param.zero_()
        # on CPU the parameters live in shared memory: a trainer on this host writes into them
        self.arena = ParamArena(self.model) if device.type == "cpu" else None
        self.weights = WeightMemory(self.model, spec, self.arena)
        self.layers = list(self.stage.layers(self.model))
        # mixture-of-experts layers (routing replay): this stage's, and how many come before it
        self.moe = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
        moe_layers = spec.cls.moe_layers(spec.config)
        self.moe_before = sum(1 for i in moe_layers if i < self.stage.start)
        self.has_moe = bool(moe_layers)
        self.moe_top_k = spec.config.num_experts_per_tok if self.has_moe else 0
        self.hidden_size = spec.hidden_size
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        a = self.attention_layers[0] if self.attention_layers else None
        # decode attention in place from the paged cache (tandem.kernels.paged) where it serves
        self.paged = (
            paged_kernels
            and a is not None
            and paged.supports(dtype, device, a.num_heads, a.num_kv_heads, a.head_dim)
        )
        # causal prompt chunks likewise (tandem.kernels.paged_prefill: AMX, or the vector kernel)
        self.paged_prefill = (
            paged_kernels
            and a is not None
            and all(layer.causal for layer in self.attention_layers)
            and paged_prefill.supports(dtype, device, a.num_heads, a.num_kv_heads, a.head_dim)
        )
        self.kv_cache: torch.Tensor | None = None
        self.sampler = Sampler(torch.Generator(device).manual_seed(seed))
        self.seqs: dict[int, _SeqState] = {}

    def kv_capacity(self, kv_cache_memory: int | float) -> int:
        """Blocks this rank can hold within the budget (the engine takes the minimum)."""
        a = self.attention_layers[0]
        per_block = bytes_per_block(
            len(self.attention_layers), self.block_size, a.num_kv_heads, a.head_dim, self.dtype
        )
        return budget_bytes(kv_cache_memory, self.device) // per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        a = self.attention_layers[0]
        slots = num_blocks * self.block_size
        self.kv_cache = torch.zeros(
            2,
            len(self.attention_layers),
            slots,
            a.num_kv_heads,
            a.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def release_kv_cache(self) -> None:
        self.kv_cache = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
        host_memory.release_freed()

    @torch.inference_mode()
    def execute(self, msg: StepMessage) -> StepResult | None:
        """Run this rank's part of one step; the sampling rank returns the sampled tokens."""
        for seq_id in msg.released:
            self.seqs.pop(seq_id, None)
        if msg.copies and self.kv_cache is not None:
            self._copy_blocks(msg.copies)
        input_ids, positions, slot_mapping, step_rows, sample_rows = [], [], [], [], []
        prefills, chunks, decodes, states, scores = [], [], [], [], []
        for step in msg.seqs:
            state = self._state(step)
            start, stop = step.start, step.start + len(step.token_ids)
            row = len(input_ids)
            step_rows.append(row + len(step.token_ids) - 1)  # its last row
            if step.sample:
                sample_rows.append(step_rows[step.logits_from if step.logits_from >= 0 else -1])
                states.append(state)
            if stop == start:  # a forked sample: its prompt was computed by another step
                continue
            if state.params.prompt_logprobs is not None:
                score = self._prompt_score(step, state, row)
                if score is not None:
                    scores.append(score)
            input_ids.extend(step.token_ids)
            positions.extend(range(start, stop))
            slot_mapping.extend(self._slots(state.block_table, start, stop))
            if stop - start == 1:
                decodes.append((row, stop, state.block_table))
            elif self.paged_prefill:
                chunks.append((row, stop - start, stop, state.block_table))
            else:
                context = None
                if start > 0:
                    context = self._tensor(self._slots(state.block_table, 0, stop))
                prefills.append(PrefillSpan(row, row + stop - start, context))
        meta = self._decode_metadata(
            AttentionMetadata(self._tensor(slot_mapping), prefills), decodes
        )
        if chunks:
            meta.paged_prefill = PagedPrefill.of(chunks, self.block_size)
        routing = None
        if self.has_moe and any(s.params.return_routed_experts for s in states):
            routing = []  # this step's expert ids, layer by layer
        for moe in self.moe:
            moe.routing = routing
        # forked samples share their row's logits (a Python dedupe: torch.unique's sort cost a
        # decode step 0.5 ms); with nothing else read from the hidden states, the last layer
        # computes past attention only the rows sampled from (AttentionMetadata.keep; one
        # row, unread, in a step of prompt chunks that samples nothing)
        distinct = list(dict.fromkeys(sample_rows))
        kept = distinct or [0]
        trim = (
            self.model.keeps_rows and not scores and routing is None and len(kept) < len(input_ids)
        )
        keep = self._tensor(kept) if trim else None
        if self.lora_rows is not None:
            self._lora_rows(msg, kept if trim else None)
        out = self._run_stage(
            self._tensor(input_ids), self._tensor(positions), meta, routing, keep=keep
        )
        if out is None:
            return None
        hidden, routed = out
        prompt_logprobs = [self._score_prompt(hidden, score) for score in scores]
        # every rank of the last stage takes part (vocab-parallel head)
        rows = hidden[: len(distinct)] if trim else hidden[self._tensor(distinct)]
        logits = self.model.compute_logits(rows)
        if len(distinct) < len(sample_rows):
            where = {row: i for i, row in enumerate(distinct)}
            logits = logits[self._tensor([where[row] for row in sample_rows])]
        if not self.samples:
            return None
        if not sample_rows:  # only prompt chunks this step
            return StepResult(msg.step_id, [], [], prompt_logprobs=prompt_logprobs)
        out = self.sampler(logits, self._sampling_batch(states))
        routed_experts = None
        if routed is not None:  # [rows, moe layers, top_k]: the row whose logits sampled
            per_row = routed.view(len(routed), -1, self.moe_top_k)[self._tensor(sample_rows)]
            routed_experts = [
                ids if s.params.return_routed_experts else None
                for ids, s in zip(per_row.tolist(), states, strict=True)
            ]
        return StepResult(
            msg.step_id,
            out.token_ids.tolist(),
            out.logprobs.tolist(),
            None if out.top_ids is None else out.top_ids.tolist(),
            None if out.top_logprobs is None else out.top_logprobs.tolist(),
            prompt_logprobs,
            routed_experts,
        )

    def _lora_rows(self, msg: StepMessage, kept: list[int] | None) -> None:
        """Tell the adapter stacks which slot each row of this step applies."""
        slots = []
        for step in msg.seqs:
            if step.token_ids:
                slots += [self.seqs[step.seq_id].params.lora_slot] * len(step.token_ids)
        if any(s >= 0 for s in slots):
            self.lora_rows.set(slots, kept, self.device, self.dtype)
        else:
            self.lora_rows.clear()

    def _decode_metadata(
        self, meta: AttentionMetadata, decodes: list[tuple[int, int, list[int]]]
    ) -> AttentionMetadata:
        """The step's decode sequences (flat row, context length, block table): all of them for
        the in-place kernel where it serves, else in gather groups for the torch path."""
        if not decodes:
            return meta
        if self.paged:
            meta.paged = PagedDecode.of(decodes, self.block_size)
            return meta
        shared, rest = shared_prefix_groups(decodes, self.block_size)
        rest_decodes = [decodes[i] for i in rest]
        groups = group_by_length([n for _, n, _ in rest_decodes], DECODE_GROUP_OVERHEAD)
        meta.decodes = [self._decode_group([rest_decodes[i] for i in m]) for m in groups]
        meta.shared_decodes = [
            self._shared_group([decodes[i] for i in m], blocks) for m, blocks in shared
        ]
        return meta

    def _prompt_score(self, step, state: _SeqState, row: int) -> _PromptScore | None:
        """Which rows of this step score which prompt tokens (positions start..stop-1 are the
        step's tokens; the logits at position p predict the token at p + 1)."""
        start, stop = step.start, step.start + len(step.token_ids)
        num_prompt = state.params.num_prompt_tokens
        pending, state.pending = state.pending, None
        from_pending = None
        if pending is not None and pending[0] == start:
            from_pending = (step.token_ids[0], pending[1])
        inside = range(start + 1, min(stop, num_prompt))  # targets within this chunk
        boundary = (row + stop - 1 - start, stop) if stop < num_prompt else None
        if from_pending is None and not inside and boundary is None:
            return None
        return _PromptScore(
            step.seq_id,
            state,
            start if from_pending is not None else start + 1,
            [row + p - 1 - start for p in inside],
            [step.token_ids[p - start] for p in inside],
            from_pending,
            boundary,
        )

    def _score_prompt(self, hidden: torch.Tensor, score: _PromptScore) -> PromptLogprobs:
        """Log-probs (and top-k) of one sequence's prompt tokens from this step's rows. Every
        rank of the last stage computes the logits (vocab-parallel head)."""
        k = score.state.params.prompt_logprobs
        lps, top_ids, top_lps = [], [], []

        def add(logprobs: torch.Tensor, targets: torch.Tensor) -> None:
            lps.extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
            if k:
                values, ids = logprobs.topk(k, dim=-1)
                top_ids.extend(ids.tolist())
                top_lps.extend(values.tolist())
            else:
                top_ids.extend([] for _ in range(len(targets)))
                top_lps.extend([] for _ in range(len(targets)))

        if score.from_pending is not None:
            token, logprobs = score.from_pending
            add(logprobs[None], self._tensor([token]))
        for i in range(0, len(score.rows), PROMPT_SCORE_ROWS):
            rows = self._tensor(score.rows[i : i + PROMPT_SCORE_ROWS])
            logits = self.model.compute_logits(hidden[rows]).float()
            add(
                torch.log_softmax(logits, dim=-1),
                self._tensor(score.targets[i : i + PROMPT_SCORE_ROWS]),
            )
        if score.boundary is not None:
            row, position = score.boundary
            logits = self.model.compute_logits(hidden[[row]]).float()
            score.state.pending = (position, torch.log_softmax(logits, dim=-1)[0])
        return PromptLogprobs(score.seq_id, score.first, lps, top_ids, top_lps)

    def _run_stage(
        self,
        input_ids,
        positions,
        meta,
        routing: list | None = None,
        embed_inputs: dict | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """This stage's layers; hidden states come from / go to the neighbouring stages, and
        with ``routing`` the expert ids of every MoE layer so far ([rows, layers * top_k], in
        layer order); ``embed_inputs`` go to the first stage's embedding (token types,
        pixels). The last stage returns (final hidden states, expert ids or None): of the
        ``keep`` rows only, in that order, where given (the model's last layer computes those
        past attention)."""
        context = self.model.layer_context(positions, self.dtype)
        rows = len(input_ids)
        before = None
        if self.stage.is_first:
            x = self.model.embed(input_ids, positions, **(embed_inputs or {}))
        else:
            x = self.pipe.recv((rows, self.hidden_size), self.dtype)
            if routing is not None:
                before = self.pipe.recv((rows, self.moe_before * self.moe_top_k), torch.long)
        stacked = None  # a few decode rows: the whole stage in one call where the model can
        if keep is None and routing is None:
            stacked = self.model.decode_layers(self.layers, x, context, meta)
        if stacked is None:
            for i, layer in enumerate(self.layers):
                if keep is not None and self.stage.is_last and i == len(self.layers) - 1:
                    meta.keep = keep
                x = layer(x, context, meta)
        else:
            x = stacked
        routed = None
        if routing is not None:
            parts = [] if before is None else [before]
            parts += [ids for _, ids in sorted(routing, key=lambda entry: entry[0])]
            empty = torch.empty((rows, 0), dtype=torch.long, device=self.device)
            routed = torch.cat(parts, dim=1) if parts else empty
        if not self.stage.is_last:
            self.pipe.send(x)
            if routing is not None:
                self.pipe.send(routed)
            return None
        return self.model.final_norm(x), routed

    def _run_whole(
        self, seqs: list[list[int]], embed_inputs: dict | None = None
    ) -> tuple[tuple[torch.Tensor, torch.Tensor | None] | None, list[PrefillSpan]]:
        """Whole sequences through this stage's layers, packed unpadded, without the KV cache
        (nothing in it is read or written): `_run_stage`'s result and each sequence's rows."""
        input_ids, positions, spans = [], [], []
        for ids in seqs:
            spans.append(PrefillSpan(len(input_ids), len(input_ids) + len(ids)))
            input_ids.extend(ids)
            positions.extend(range(len(ids)))
        if self.lora_rows is not None:
            self.lora_rows.clear()
        for moe in self.moe:
            moe.routing = None
        out = self._run_stage(
            self._tensor(input_ids),
            self._tensor(positions),
            AttentionMetadata(None, spans),
            embed_inputs=embed_inputs,
        )
        return out, spans

    @torch.inference_mode()
    def encode(self, msg: EncodeMessage) -> EncodeResult | None:
        """Whole sequences through this stage's layers (no KV cache); the last stage pools each
        one (``cls``: its first row, ``last``: its last, ``mean``) and for ``classify`` runs
        the model's head. Every rank of the last stage computes; the sampling rank answers."""
        extra = {}
        if msg.token_types is not None:
            extra["token_type_ids"] = self._tensor([t for seq in msg.token_types for t in seq])
        if msg.pixels is not None:
            extra["pixel_values"] = torch.tensor(msg.pixels, dtype=self.dtype, device=self.device)
        out, spans = self._run_whole(msg.seqs, extra)
        if out is None:
            return None
        hidden, _ = out
        pooled = torch.stack([_pool(hidden[s.start : s.end], msg.pooling) for s in spans])
        if msg.task == "classify":
            pooled = self.model.classify(pooled)
        if not self.samples:
            return None
        return EncodeResult(msg.step_id, pooled.float().tolist())

    @torch.inference_mode()
    def score_rows(self, msg: ScoreMessage) -> Iterator[torch.Tensor]:
        """The next-token logits at every position of ``msg.seqs`` (their ``log_softmax`` with
        ``msg.logprobs``), computed in float32 without the KV cache: the positions of all
        sequences end to end, as float32 CPU tensors [rows, vocab] of at most
        `SCORE_FRAME_BYTES` each. Only the sampling rank yields; every rank of the last stage
        must run the whole iteration (the vocab-parallel head gathers across them)."""
        out, _ = self._run_whole(msg.seqs)
        if out is None:
            return
        hidden, _ = out
        for i in range(0, len(hidden), PROMPT_SCORE_ROWS):
            logits = self.model.compute_logits(hidden[i : i + PROMPT_SCORE_ROWS]).float()
            if not self.samples:
                continue
            if msg.logprobs:
                logits = torch.log_softmax(logits, dim=-1)
            step = max(1, SCORE_FRAME_BYTES // (4 * logits.shape[-1]))
            for j in range(0, len(logits), step):
                yield logits[j : j + step].cpu()

    def score(self, msg: ScoreMessage) -> Iterator[ScoreResult]:
        """`score_rows` as the results a worker sends: the rows' bytes, piece by piece."""
        first = 0
        for rows in self.score_rows(msg):
            data = rows.numpy().astype("<f4", copy=False).tobytes()
            yield ScoreResult(msg.step_id, first, len(rows), rows.shape[1], data)
            first += len(rows)

    def _state(self, step) -> _SeqState:
        state = self.seqs.get(step.seq_id)
        if state is None:
            if step.params is None:
                raise RuntimeError(f"sequence {step.seq_id} arrived without sampling params")
            state = self.seqs[step.seq_id] = _SeqState(step.params)
        if step.replace_table:
            state.block_table = list(step.blocks)
        else:
            state.block_table.extend(step.blocks)
        return state

    def _copy_blocks(self, copies: list[list[int]]) -> None:
        """Copy whole KV blocks (every layer of this rank) before a step writes into them."""
        bs = self.block_size
        offsets = torch.arange(bs, device=self.device)
        src = (self._tensor([c[0] for c in copies])[:, None] * bs + offsets).view(-1)
        dst = (self._tensor([c[1] for c in copies])[:, None] * bs + offsets).view(-1)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _slots(self, table: list[int], start: int, stop: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

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

    def _shared_group(
        self, members: list[tuple[int, int, list[int]]], shared_blocks: int
    ) -> SharedPrefixGroup:
        """The shared prefix's slots once, then each member's own; a mask per member."""
        start = shared_blocks * self.block_size
        slots = self._slots(members[0][2], 0, start)
        spans = []
        for _, length, table in members:
            spans.append((len(slots), len(slots) + length - start))
            slots.extend(self._slots(table, start, length))
        mask = torch.zeros(len(members), len(slots), dtype=torch.bool, device=self.device)
        mask[:, :start] = True
        for i, (lo, hi) in enumerate(spans):
            mask[i, lo:hi] = True
        rows = self._tensor([row for row, _, _ in members])
        return SharedPrefixGroup(rows, self._tensor(slots), mask[None, None])

    def _generator(self, state: _SeqState) -> torch.Generator | None:
        """The sample's own random stream: same seed, same tokens, whatever else is batched."""
        if state.params.seed is not None and state.generator is None:
            state.generator = torch.Generator(self.device).manual_seed(state.params.seed)
        return state.generator

    def _sampling_batch(self, states: list[_SeqState]) -> SamplingBatch:
        params = [s.params for s in states]
        return SamplingBatch(
            temperatures=torch.tensor([p.temperature for p in params], device=self.device),
            top_k=self._tensor([p.top_k if p.top_k > 0 else _NO_TOP_K for p in params]),
            top_p=torch.tensor([p.top_p for p in params], device=self.device),
            generators=[self._generator(s) for s in states],
            processed_logprobs=torch.tensor(
                [p.processed_logprobs for p in params], device=self.device
            ),
            num_top_logprobs=max(p.logprobs or 0 for p in params),
        )
