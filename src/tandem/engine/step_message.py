"""What one scheduled batch sends every rank (rule 8: only what changed since the last step)."""

from __future__ import annotations

from tandem.engine.messages import SeqParams, SeqStep, StepMessage
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence


def step_message(step_id: int, batch: ScheduledBatch, released: list[int]) -> StepMessage:
    """The batch as a `StepMessage`: each sequence's new tokens, the KV blocks it took since
    its last step (its whole table when it changed otherwise), its sampling settings the
    first time; ``released``: finished sequences the ranks may forget. Marks on each sequence
    what was sent."""
    steps = []
    for i, seq in enumerate(batch.seqs):
        start, n = seq.num_cached_tokens, batch.num_new_tokens[i]
        replace, seq.table_changed = seq.table_changed, False
        blocks = seq.block_table if replace else seq.block_table[seq.num_blocks_sent :]
        seq.num_blocks_sent = len(seq.block_table)
        params = None
        if not seq.params_sent:
            params, seq.params_sent = _seq_params(seq), True
        logits_from = batch.logits_from[i]
        steps.append(
            SeqStep(
                seq_id=seq.seq_id,
                start=start,
                token_ids=seq.token_ids[start : start + n],
                blocks=list(blocks),
                params=params,
                replace_table=replace,
                sample=batch.samples[i],
                logits_from=-1 if logits_from is None else logits_from,
            )
        )
    copies = [[src, dst] for src, dst in batch.copies]
    return StepMessage(step_id=step_id, seqs=steps, released=released, copies=copies)


def _seq_params(seq: Sequence) -> SeqParams:
    p = seq.params
    return SeqParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=None if p.seed is None else p.seed + seq.index,
        logprobs=p.logprobs,
        processed_logprobs=p.logprobs_mode == "processed",
        prompt_logprobs=p.prompt_logprobs,
        num_prompt_tokens=seq.num_prompt_tokens,
        return_routed_experts=p.return_routed_experts,
        lora_slot=seq.lora_slot,
    )
