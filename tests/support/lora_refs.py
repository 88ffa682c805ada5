"""PEFT adapters for the LoRA tests, and the numbers a merged PEFT model gives (the reference:
`peft.PeftModel.merge_and_unload` folds B A * scale into each base weight, in transformers)."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_model(
    model_dir: str,
    seed: int,
    *,
    r: int = 4,
    alpha: float = 8,
    targets=ALL,
    rslora: bool = False,
    std: float = 0.2,
):
    """A PEFT LoRA model on ``model_dir`` with random, non-zero A and B (PEFT starts B at 0)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0
    )
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def save_adapter(model, path: Path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def merged(model):
    """The PEFT model's adapter folded into a copy of its base weights (PEFT's own merge)."""
    import copy

    return copy.deepcopy(model).merge_and_unload().eval()


def greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (EOS ignored) and their log-probs (float32)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(torch.log_softmax(logits, -1)[token].item())
            ids.append(token)
    return ids[len(prompt) :], logprobs
