"""Routing replay ("R3") for a trainer's Hugging Face MoE model: recompute log-probs with the
experts the engine routed each sampled token to.

The engine reports, with ``SamplingParams(return_routed_experts=True)``, per generated token and
per MoE layer the top-k expert ids of the forward pass whose logits sampled that token. In the
trainer's forward over ``prompt + completion``, completion token ``i`` is predicted at position
``len(prompt) - 1 + i``: `replay_routing` makes every MoE router choose those experts there
(their weights still come from the trainer's router, so gradients flow through it), and leaves
every other position to the router's own choice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of a transformers MoE model, in layer order: the ``gate`` of every block
    that has ``gate`` and ``experts`` (Qwen3-MoE, Mixtral, Qwen2-MoE layouts)."""
    return [
        module.gate
        for module in model.modules()
        if isinstance(getattr(module, "gate", None), nn.Module)
        and isinstance(getattr(module, "experts", None), nn.Module)
    ]


@contextmanager
def replay_routing(
    model: nn.Module,
    routed_experts: Sequence[Sequence[Sequence[Sequence[int]]]],
    starts: Sequence[int],
) -> Iterator[None]:
    """Within the block, forwards of ``model`` over a batch of B rows route position
    ``starts[b] + i`` of row ``b`` to ``routed_experts[b][i][layer]`` (the engine's
    ``CompletionOutput.routed_experts`` of that row; ``starts[b]`` is the prompt length - 1
    without left padding). Expert weights are the router's softmax at those experts,
    renormalised as the model does."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError("replay_routing: the model has no MoE blocks (gate + experts)")
    if len(routed_experts) != len(starts):
        raise ValueError(
            f"replay_routing: {len(routed_experts)} rows of routed_experts, {len(starts)} starts"
        )
    for b, rows in enumerate(routed_experts):
        for i, layers in enumerate(rows):
            if len(layers) != len(routers):
                raise ValueError(
                    f"routed_experts[{b}][{i}] has {len(layers)} MoE layers; the model has "
                    f"{len(routers)}"
                )
    handles = [
        router.register_forward_hook(_replay_hook(layer, routed_experts, starts))
        for layer, router in enumerate(routers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(layer: int, routed_experts, starts):
    def hook(router: nn.Module, inputs, output):
        logits, scores, indices = output
        batch = len(routed_experts)
        if len(logits) % batch:
            raise ValueError(f"replay_routing: {len(logits)} tokens do not split into {batch} rows")
        length = len(logits) // batch
        rows, wanted = [], []
        for b, (tokens, start) in enumerate(zip(routed_experts, starts, strict=True)):
            if start < 0 or start + len(tokens) > length:
                raise ValueError(
                    f"replay_routing: row {b} replays positions {start}..{start + len(tokens)} "
                    f"of a {length}-token sequence"
                )
            rows.extend(b * length + start + i for i in range(len(tokens)))
            wanted.extend(t[layer] for t in tokens)
        if not rows:
            return output
        ids = torch.tensor(wanted, dtype=indices.dtype, device=indices.device)
        if ids.shape[1] != indices.shape[1]:
            raise ValueError(
                f"replay_routing: top-{ids.shape[1]} given, router picks top-{indices.shape[1]}"
            )
        indices = indices.clone()
        indices[rows] = ids
        probs = torch.softmax(logits.float(), dim=-1)
        weights = probs.gather(1, indices)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(scores.dtype), indices

    return hook
