"""One trainer rank of the demo: the policy as FSDP2 shards over gloo, AdamW, the clipped
policy-gradient loss; after each update it pushes its shards into the engine in place.

    python -m tandem.rl.trainer        (settings as JSON in $TANDEM_TRAINER)

This is what an RL user's own training loop looks like with tandem: a plain transformers model,
`fully_shard`, an optimizer, and one `WeightSender.push` per step.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tandem.rl.config import DELTAS
from tandem.rl.grpo import correct_mismatch, policy_loss
from tandem.rl.messages import (
    TRAINERS,
    ScoreBatch,
    ScoreReport,
    Stop,
    TrainBatch,
    TrainerHello,
    TrainReport,
    WarmupBatch,
)
from tandem.wire import recv_frame, send_frame, send_token

ENV = "TANDEM_TRAINER"


@dataclass
class TrainerArgs:
    rank: int
    world_size: int
    dist_port: int
    model_dir: str
    controller: list  # [host, port]
    token: str
    exchange_address: str
    transport: str
    seed: int
    threads: int = 1
    delta: str = "auto"  # `tandem.rl.config.DELTAS`

    def to_env(self) -> str:
        return json.dumps(asdict(self))


def continuation_logprobs(
    model, pairs: list[tuple[list[int], list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For (prefix, continuation) pairs: the model's log-prob of every next token [B, L-1]
    (with grad; the logits at position t predict token t + 1) and the mask of the positions
    that predict a continuation token."""
    ids, attention = _padded([prefix + cont for prefix, cont in pairs])
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, (prefix, cont) in enumerate(pairs):
        mask[i, len(prefix) - 1 : len(prefix) - 1 + len(cont)] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    logp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp, mask


def completion_logprobs(
    model, batch: TrainBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's log-probs of every completion token [B, L-1] (with grad), the engine's
    recorded ones aligned the same way, and the mask of completion positions."""
    logp, mask = continuation_logprobs(
        model, [(s.prompt_ids, s.completion_ids) for s in batch.samples]
    )
    behaviour = torch.zeros_like(mask)
    for i, s in enumerate(batch.samples):
        start = len(s.prompt_ids) - 1
        behaviour[i, start : start + len(s.completion_ids)] = torch.tensor(s.behaviour_logprobs)
    return logp, behaviour, mask


def _padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
    return ids, attention


def _push(sender, version: int, delta: str) -> tuple[float, int]:
    """Push the updated weights into the engine: the seconds it took, the bytes it moved."""
    start = time.perf_counter()
    stats = sender.push(version=version, delta=DELTAS[delta])
    return time.perf_counter() - start, stats.bytes_moved


def _update(model, optimizer, loss: torch.Tensor, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def warmup_step(model, optimizer, push, batch: WarmupBatch, rank: int) -> TrainReport:
    """Supervised: mean cross-entropy of the target tokens given the prompt."""
    start = time.perf_counter()
    logp, mask = continuation_logprobs(model, [(p, t) for p, t in batch.examples])
    loss = -(logp * mask).sum() / mask.sum()
    grad_norm = _update(model, optimizer, loss, batch.lr)
    push_seconds, push_bytes = push(batch.version) if batch.push else (0.0, 0)
    train_seconds = time.perf_counter() - start - push_seconds
    return TrainReport(
        rank,
        batch.step,
        loss.item(),
        None,
        push_seconds,
        train_seconds,
        grad_norm,
        0.0,
        0.0,
        push_bytes=push_bytes,
    )


@torch.no_grad()
def score(model, batch: ScoreBatch, rank: int) -> ScoreReport:
    """The full next-token log-softmax at the asked positions (every rank runs the forward:
    FSDP2 gathers the shards collectively)."""
    ids, attention = _padded(batch.sequences)
    logp = F.log_softmax(model(input_ids=ids, attention_mask=attention).logits.float(), dim=-1)
    rows = [logp[i, t].tolist() for i, positions in enumerate(batch.positions) for t in positions]
    return ScoreReport(rank, batch.step, rows)


def train_step(model, optimizer, push, batch: TrainBatch, rank: int) -> TrainReport:
    """One policy-gradient update on the share (scoring only with ``update=False``), with the
    batch's mismatch correction (`correct_mismatch`); reports how far the trainer's log-probs
    are from the engine's and what the correction did."""
    if not batch.samples:  # the controller skips a step on every rank at once
        return TrainReport(rank, batch.step, 0.0, None, 0.0, 0.0, 0.0, 0.0, 0.0)
    start = time.perf_counter()
    logp, behaviour, mask = completion_logprobs(model, batch)
    fresh = torch.tensor([s.fresh for s in batch.samples], dtype=torch.bool)
    gap = (logp.detach() - behaviour).abs() * mask
    mismatch = float(gap[fresh].max()) if fresh.any() else None
    corr = correct_mismatch(logp, behaviour, mask, batch.is_correction, batch.is_cap)
    weight = corr.ratio if corr.weight is None else corr.weight  # what each token's term gets
    advantages = torch.tensor([s.advantage for s in batch.samples], dtype=torch.float32)
    loss, stats = policy_loss(logp, corr.old_logp, advantages, corr.mask, is_weight=corr.weight)
    grad_norm, push_seconds, push_bytes = 0.0, 0.0, 0
    if batch.update:
        grad_norm = _update(model, optimizer, loss, batch.lr)
        push_seconds, push_bytes = push(batch.version)
    return TrainReport(
        rank,
        batch.step,
        loss.item(),
        mismatch,
        push_seconds,
        time.perf_counter() - start - push_seconds,
        grad_norm,
        stats["ratio_max"],
        stats["clip_fraction"],
        tokens=int(mask.sum()),
        fresh_tokens=int(mask[fresh].sum()),
        logprob_gap_sum=float(gap[fresh].sum()),
        is_weight_sum=float((weight * mask).sum()),
        is_over_cap=int(corr.over_cap.sum()),
        push_bytes=push_bytes,
    )


def main() -> int:
    args = TrainerArgs(**json.loads(os.environ[ENV]))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tandem.exchange import WeightSender

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.dist_port}",
        rank=args.rank,
        world_size=args.world_size,
    )
    mesh = init_device_mesh("cpu", (args.world_size,))
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.0)  # lr: each batch's
    sender = WeightSender(model, args.exchange_address, transport=args.transport)
    push = functools.partial(_push, sender, delta=args.delta)  # version -> (seconds, bytes)
    sock = socket.create_connection(tuple(args.controller), timeout=60)
    sock.settimeout(None)
    send_token(sock, args.token)
    send_frame(sock, TRAINERS.encode(TrainerHello(args.rank, os.getpid())))
    while True:
        msg = TRAINERS.decode(recv_frame(sock))
        if isinstance(msg, Stop):
            break
        try:
            if isinstance(msg, WarmupBatch):
                report = warmup_step(model, optimizer, push, msg, args.rank)
            elif isinstance(msg, ScoreBatch):
                report = score(model, msg, args.rank)
            else:
                report = train_step(model, optimizer, push, msg, args.rank)
        except Exception as exc:
            traceback.print_exc()
            report = TrainReport(args.rank, msg.step, 0, None, 0, 0, 0, 0, 0, error=f"{exc}")
            send_frame(sock, TRAINERS.encode(report))
            return 1
        send_frame(sock, TRAINERS.encode(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
