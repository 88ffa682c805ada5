"""TRL's GRPOTrainer on a PEFT (LoRA) policy with tandem generating (`TandemRollout`): every
sync pushes only the adapter into the engine's adapter slot, the rollouts run with it, and after
each sync the engine's sampled-token log-probs equal the PEFT model's own forward."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _reward(completions, **kwargs):
    """Longer distinct completions score higher (a real, cheap reward)."""
    return [len(set(c.split())) / 8.0 for c in completions]


def _lora_config(r: int = 4):
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )


def _adapter_bytes(model, adapter: str = "default") -> int:
    """The bytes of one adapter's lora_A/lora_B tensors in a PEFT model."""
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if ".lora_" in name and f".{adapter}." in name
    )


def _completion_logprobs(model, prompt_ids, completion_ids) -> torch.Tensor:
    """The model's own log-probs (temperature 1) of ``completion_ids`` after ``prompt_ids``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    return logp.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1)


@pytest.mark.timeout(300)
def test_grpo_trainer_on_a_peft_model_syncs_the_adapter_and_logprobs_match(model_factory, tmp_path):
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tandem import LLM
    from tandem.integrations.trl import TandemRollout

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model_dir = model_factory("llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    data = Dataset.from_dict({"prompt": ["the cat", "a dog runs", "red fish", "one bird"] * 4})
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=0.05,
        beta=0.0,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        temperature=1.0,
        seed=0,
        dataloader_num_workers=0,
    )
    with LLM(model_dir, enable_lora=True, max_lora_rank=8) as llm:
        rollout = TandemRollout(llm, max_tokens=8, seed=0)
        seen: list[dict] = []

        def recording(prompts, trainer):
            pushes = rollout.pushes
            out = rollout(prompts, trainer)
            step = trainer.state.global_step
            assert len(out["completion_ids"]) == len(prompts)  # one completion per entry
            peft_model = trainer.accelerator.unwrap_model(trainer.model)
            adapter_bytes = _adapter_bytes(peft_model)
            if rollout.pushes != pushes:  # synced: only the adapter's tensors travelled
                stats = rollout.last_push
                assert stats.version == step
                assert stats.bytes_needed == stats.bytes_sent == adapter_bytes
                assert adapter_bytes * 10 < full_bytes
            # the engine's log-probs are the trainer's PEFT model's, at the synced adapter
            worst, moved = 0.0, 0.0
            for ids, completion, logprobs in zip(
                out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True
            ):
                assert len(completion) == len(logprobs) >= 1
                expected = _completion_logprobs(peft_model, ids, completion)
                worst = max(worst, (torch.tensor(logprobs) - expected).abs().max().item())
                with peft_model.disable_adapter():  # the base model alone
                    base = _completion_logprobs(peft_model, ids, completion)
                moved = max(moved, (expected - base).abs().max().item())
            seen.append(
                {
                    "step": step,
                    "versions": set(out["weight_version"]),
                    "worst": worst,
                    "moved": moved,
                }
            )
            return out

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=_reward,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=_lora_config(),
            rollout_func=recording,
        )
        trainer.train()
        assert trainer.state.global_step == 3
        assert [s["step"] for s in seen] == [0, 1, 2], seen
        assert rollout.pushes == 3
        # every rollout ran with the adapter version pushed at its step
        assert all(s["versions"] == {s["step"]} for s in seen), seen
        assert all(s["worst"] <= 1e-4 for s in seen), seen
        # the first push is PEFT's initial adapter (B = 0: the base model); training moved it
        assert seen[0]["moved"] == 0.0 and seen[-1]["moved"] > 1e-3, seen
        assert llm.weight_version == 0  # the base weights were never pushed
        assert [(a.name, a.version) for a in llm.engine.adapters.loaded()] == [("policy", 2)]


@pytest.mark.timeout(120)
def test_peft_model_needs_an_engine_serving_its_adapter(model_factory):
    """A clear error, before anything is pushed, where the engine cannot serve the adapter;
    a PEFT model with a second adapter (TRL's "ref") pushes only the active one."""
    import transformers
    from peft import get_peft_model

    from tandem import LLM, LoRAError
    from tandem.integrations.trl import TandemRollout

    model_dir = model_factory("llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def trainer_of(model):  # what TRL hands a rollout_func
        return SimpleNamespace(
            state=SimpleNamespace(global_step=0),
            model=model,
            args=SimpleNamespace(temperature=1.0),
            processing_class=tokenizer,
            accelerator=None,
        )

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="lora_name='policy' needs a PEFT model"):
        TandemRollout("http://127.0.0.1:1", lora_name="policy")(["the cat"], trainer_of(base))
    peft_model = get_peft_model(base, _lora_config(r=4))
    with pytest.raises(NotImplementedError, match="tandem serve URL"):
        TandemRollout("http://127.0.0.1:1")(["the cat"], trainer_of(peft_model))

    with LLM(model_dir) as llm:
        rollout = TandemRollout(llm, max_tokens=4)
        with pytest.raises(LoRAError, match="enable_lora=True"):
            rollout(["the cat"], trainer_of(peft_model))
        assert rollout.pushes == 0 and llm.weight_version == 0

    with LLM(model_dir, enable_lora=True, max_lora_rank=2) as llm:
        rollout = TandemRollout(llm, max_tokens=4)
        with pytest.raises(LoRAError, match="r=4, above the engine's max_lora_rank=2"):
            rollout(["the cat"], trainer_of(peft_model))
        assert rollout.pushes == 0 and llm.engine.adapters.loaded() == []

        # a second adapter (as TRL adds "ref" for a wrapped model with beta != 0) stays home
        small = get_peft_model(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            _lora_config(r=2),
        )
        small.add_adapter("ref", _lora_config(r=2))
        torch.manual_seed(0)
        with torch.no_grad():  # a non-trivial adapter, so the log-probs check means something
            for name, p in small.named_parameters():
                if ".lora_B.default." in name:
                    p.normal_(0.0, 0.2)
        rollout = TandemRollout(llm, max_tokens=4, seed=1, lora_name="mine")
        out = rollout(["the cat"] * 2, trainer_of(small))
        assert rollout.last_push.bytes_needed == _adapter_bytes(small, "default")
        assert [(a.name, a.version) for a in llm.engine.adapters.loaded()] == [("mine", 0)]
        for ids, completion, logprobs in zip(
            out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True
        ):
            expected = _completion_logprobs(small, ids, completion)
            assert (torch.tensor(logprobs) - expected).abs().max() <= 1e-4
            with small.disable_adapter():
                assert (_completion_logprobs(small, ids, completion) - expected).abs().max() > 1e-3
