"""Score rollouts with a reward model served by tandem.

A policy engine samples a group of completions per prompt; a reward model (a
``LlamaForSequenceClassification``: one ``score`` logit on the last token) runs in its own
tandem engine, two tensor-parallel worker processes, and scores every prompt + completion in
one unpadded batch; group-relative advantages (GRPO) follow. Both models are tiny random-init
ones built here, so the scores mean nothing; the plumbing is what a real run uses.

    python examples/reward_model.py

Over HTTP the reward model is ``tandem serve --model DIR --task classify`` and the scores come
from ``POST /v1/classify {"model": ..., "input": [texts]}`` (``data[i].logits[0]``).
"""

from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.models.tiny import make_tiny_model

PROMPTS = ["Q: 12 + 7 = ?\nA:", "Q: 3 + 30 = ?\nA:"]
GROUP = 4


def main() -> None:
    policy_dir, reward_dir = Path(".tandem/tiny-llama"), Path(".tandem/tiny-reward")
    if not (policy_dir / "config.json").is_file():
        make_tiny_model(policy_dir, "llama")
    if not (reward_dir / "config.json").is_file():
        make_tiny_model(reward_dir, "llama_reward", seed=1)
    params = SamplingParams(n=GROUP, max_tokens=12, temperature=1.0, seed=0)
    with LLM(policy_dir) as policy, LLM(reward_dir, task="classify", tensor_parallel_size=2) as rm:
        outs = policy.generate(PROMPTS, params)
        texts = [o.prompt + c.text for o in outs for c in o.outputs]
        rewards = [row[0] for row in rm.classify(texts)]
    for g, out in enumerate(outs):
        group = rewards[g * GROUP : (g + 1) * GROUP]
        mean = sum(group) / GROUP
        std = (sum((r - mean) ** 2 for r in group) / GROUP) ** 0.5
        print(f"prompt {g}: {out.prompt!r}")
        for c, r in zip(out.outputs, group, strict=True):
            print(f"  reward {r:+.3f}  advantage {(r - mean) / (std + 1e-6):+.2f}  {c.text!r}")


if __name__ == "__main__":
    main()
