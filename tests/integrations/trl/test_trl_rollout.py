"""TRL's GRPOTrainer trains with tandem generating (`TandemRollout`): pushes happen as the
trainer steps, versions advance, and after the last push the engine's log-probs equal the
trainer model's own forward."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.timeout(300)


def _reward(completions, **kwargs):
    """Longer distinct completions score higher (a real, cheap reward)."""
    return [len(set(c.split())) / 8.0 for c in completions]


def test_grpo_trainer_trains_with_tandem_rollouts(model_factory, tmp_path):
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tandem import LLM, SamplingParams
    from tandem.integrations.trl import TandemRollout

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model_dir = model_factory("llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    probe = torch.tensor([[5, 9, 33, 2, 17]])
    with torch.no_grad():
        before = model(probe).logits.clone()
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
    with LLM(model_dir) as llm:
        rollout = TandemRollout(llm, max_tokens=8, seed=0)
        seen: list[dict] = []

        def recording(prompts, trainer):
            out = rollout(prompts, trainer)
            assert len(out["completion_ids"]) == len(prompts)  # one completion per entry
            seen.append({"step": trainer.state.global_step, "versions": out["weight_version"]})
            return out

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=_reward,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            rollout_func=recording,
        )
        trainer.train()
        assert trainer.state.global_step == 3
        with torch.no_grad():  # training moved the weights (so the pushes carried news)
            assert (trainer.model(probe).logits - before).abs().max() > 1e-3
        # every rollout came from the weights of the step it was made at
        assert seen and all(set(s["versions"]) == {s["step"]} for s in seen)
        assert [s["step"] for s in seen] == sorted(s["step"] for s in seen)
        assert rollout.pushes == len({s["step"] for s in seen}) >= 2, seen
        rollout.sync(trainer.model, trainer.state.global_step)  # the trained weights
        assert llm.weight_version == 3
        prompt = tokenizer("the cat", add_special_tokens=False)["input_ids"]
        out = llm.generate(
            [prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        )[0].outputs[0]
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + out.token_ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
        expected = logp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert out.token_ids == logp.argmax(-1).tolist()
        assert (torch.tensor(out.logprobs) - expected).abs().max() <= 1e-4


def test_rollout_against_a_tandem_serve_pushes_over_http_and_samples_the_pushed_policy(
    model_factory,
):
    """The URL form: weights go through the server's exchange (HTTP discovery, admin key),
    samples come back over /v1/completions with token ids and log-probs, one per entry."""
    from types import SimpleNamespace

    import transformers

    from support.serving import ADMIN_KEY, Server
    from tandem.integrations.trl import TandemRollout

    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(trainer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    # what TRL hands a rollout_func: its trainer (state, args, tokenizer, model)
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=2),
        model=model,
        args=SimpleNamespace(temperature=1.0),
        processing_class=tokenizer,
        accelerator=None,
    )
    server = Server(engine_dir, "--admin-key", ADMIN_KEY, "--kv-cache-memory", str(16 << 20))
    try:
        rollout = TandemRollout(server.url, admin_key=ADMIN_KEY, max_tokens=5, seed=3)
        prompts = ["the cat"] * 3 + ["a dog runs"] * 3  # TRL repeats each prompt in a row
        out = rollout(prompts, trainer)
        assert rollout.pushes == 1 and rollout.version == 2
        assert len(out["completion_ids"]) == len(prompts) and set(out["weight_version"]) == {2}
        for ids, completion, logprobs in zip(
            out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True
        ):
            assert len(completion) == len(logprobs) >= 1
            with torch.no_grad():
                logits = model(torch.tensor([ids + completion])).logits[0].float()
            logp = torch.log_softmax(logits, -1)[len(ids) - 1 : -1]
            expected = logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
            assert (torch.tensor(logprobs) - expected).abs().max() <= 1e-4
        rollout(prompts, trainer)
        assert rollout.pushes == 1  # the step did not move: no second push
    finally:
        server.stop()
