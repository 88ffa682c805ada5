"""TRL's GRPOTrainer with tandem generating the rollouts, on CPU with a tiny random model.

    .venv/bin/python examples/trl_grpo.py

The reward is real and cheap: completions that use more distinct words score higher. Before each
generation `TandemRollout` pushes the trainer's new weights into the engine (version = the
trainer's global step), so every rollout comes from the policy being trained.
"""

import os
import tempfile

import torch
import transformers
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from tandem import LLM
from tandem.integrations.trl import TandemRollout
from tandem.models.tiny import make_tiny_model

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def distinct_words(completions, **kwargs):
    return [len(set(c.split())) / 8.0 for c in completions]


def main() -> None:
    workdir = tempfile.mkdtemp(prefix="tandem-trl-")
    model_dir = str(make_tiny_model(os.path.join(workdir, "model"), "llama"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": ["the cat", "a dog runs", "red fish", "one bird"] * 8})
    config = GRPOConfig(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=4,
        num_generations=4, max_completion_length=12, max_steps=6, learning_rate=0.05, beta=0.0,
        bf16=False,  # GRPOConfig defaults to bf16 autocast even on CPU: log-probs then drift ~1e-2
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
    )  # fmt: skip
    with LLM(model_dir) as llm:
        rollout = TandemRollout(llm, max_tokens=12)
        trainer = GRPOTrainer(model=model, reward_funcs=distinct_words, args=config,
                              train_dataset=data, processing_class=tokenizer,
                              rollout_func=rollout)  # fmt: skip
        trainer.train()
        print(f"{rollout.pushes} pushes; the engine serves version {llm.weight_version}")


if __name__ == "__main__":
    main()
