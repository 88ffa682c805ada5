"""Mixture-of-experts serving: the experts each sampled token was routed to (taken from the
forward pass that produced it, checked against transformers' own router), the same under
expert/tensor and pipeline parallelism, and routing replay on the trainer's transformers model
reproducing the engine's log-probs."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from support.serving import Server
from tandem import LLM, SamplingParams
from tandem.layers.moe import expert_range
from tandem.rl import replay_routing
from tandem.rl.replay import moe_routers

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8, 41, 250, 7, 19]]
N = 12


def test_expert_ranges_cover_every_expert_once():
    for experts in (1, 5, 6, 7, 64):
        for ranks in (1, 2, 3, 4):
            if ranks > experts:
                continue
            ranges = [expert_range(experts, r, ranks) for r in range(ranks)]
            assert [e for r in ranges for e in r] == list(range(experts))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request, model_factory):
    overrides = (
        {"mlp_only_layers": [1], "num_hidden_layers": 3} if request.param == "qwen3_moe" else {}
    )
    path = model_factory(request.param, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(path) as llm:
        params = SamplingParams(
            max_tokens=N,
            temperature=1.0,
            seed=7,
            logprobs=0,
            return_routed_experts=True,
            ignore_eos=True,
        )
        outs = llm.generate(PROMPTS, params)
    return path, hf, outs


def _hf_routing(hf, ids: list[int]) -> list[torch.Tensor]:
    """transformers' own top-k expert ids at every position, one tensor per MoE layer."""
    seen = []
    hooks = [
        r.register_forward_hook(lambda m, i, o: seen.append(o[2].clone())) for r in moe_routers(hf)
    ]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


def _completion_logprobs(hf, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = prompt + tokens
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_routed_experts_are_the_producing_positions_routing(model):
    path, hf, outs = model
    layers = len(moe_routers(hf))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        c = out.outputs[0]
        assert len(c.routed_experts) == N
        assert all(len(t) == layers and all(len(k) == 2 for k in t) for t in c.routed_experts)
        routing = _hf_routing(hf, prompt + c.token_ids)
        for i, token_layers in enumerate(c.routed_experts):
            position = len(prompt) - 1 + i  # whose logits sampled token i
            for layer, ids in enumerate(token_layers):
                assert ids == routing[layer][position].tolist()  # same order: by probability


def test_replay_gives_the_engines_logprobs_and_is_really_applied(model):
    path, hf, outs = model
    for prompt, out in zip(PROMPTS, outs, strict=True):
        c = out.outputs[0]
        with replay_routing(hf, [c.routed_experts], [len(prompt) - 1]):
            replayed = _completion_logprobs(hf, prompt, c.token_ids)
        assert replayed == pytest.approx(c.logprobs, abs=1e-5, rel=0)
        # other experts at those positions: the replay is applied, log-probs move
        num_experts = (
            hf.config.num_experts
            if hasattr(hf.config, "num_experts")
            else (hf.config.num_local_experts)
        )
        wrong = [[[(e + 1) % num_experts for e in ids] for ids in t] for t in c.routed_experts]
        with replay_routing(hf, [wrong], [len(prompt) - 1]):
            moved = _completion_logprobs(hf, prompt, c.token_ids)
        assert max(abs(a - b) for a, b in zip(moved, c.logprobs, strict=True)) > 1e-3
    with pytest.raises(ValueError, match="MoE layers"):
        with replay_routing(hf, [[[[0, 1]]]], [0]):
            pass


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_routed_experts_under_expert_and_pipeline_parallel(model, tp, pp):
    path, hf, outs = model
    if pp > 1 and tp > 1 and "mixtral" in path:
        pytest.skip("one TP2xPP2 family is enough")
    with LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        params = SamplingParams(
            max_tokens=N,
            temperature=1.0,
            seed=7,
            logprobs=0,
            return_routed_experts=True,
            ignore_eos=True,
        )
        got = llm.generate(PROMPTS, params)
    for a, b in zip(outs, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].routed_experts == a.outputs[0].routed_experts


def test_routed_experts_over_http(model):
    path, hf, outs = model
    body = {
        "model": "moe",
        "prompt": PROMPTS[0],
        "max_tokens": N,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "return_routed_experts": True,
    }
    with Server(path, "--served-model-name", "moe") as server:
        whole = server.post("/v1/completions", json=body).json()["choices"][0]
        streamed = []
        with server.client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        streamed += choice["routed_experts"]
        plain = server.post("/v1/completions", json=body | {"return_routed_experts": False})
    assert whole["token_ids"] == outs[0].outputs[0].token_ids
    assert whole["routed_experts"] == outs[0].outputs[0].routed_experts == streamed
    assert "routed_experts" not in plain.json()["choices"][0]


@pytest.mark.parametrize(("transport", "mode"), [("shm", "staged"), ("dist", "in_place")])
def test_fsdp2_moe_trainer_pushes_into_expert_parallel_engine(model_factory, transport, mode):
    """2 FSDP2 ranks of a transformers Qwen3-MoE (grouped 3-D expert tensors, sharded by
    expert) -> LLM(tp=2) holding whole experts per rank: the engine then serves exactly the
    trainer's model."""
    from support.trainers import run_trainer

    overrides = {"num_experts": 7, "num_experts_per_tok": 3, "mlp_only_layers": [0]}
    engine_dir = model_factory("qwen3_moe", **overrides)
    trainer_dir = model_factory("qwen3_moe", seed=1, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        assert run_trainer(trainer_dir, llm.exchange_address, 3, transport, mode) == [0, 0]
        assert llm.weight_version == 3
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
            c = out.outputs[0]
            want = _completion_logprobs(hf.eval(), prompt, c.token_ids)
            assert c.logprobs == pytest.approx(want, abs=1e-4, rel=0)


def test_one_process_transformers_moe_pushes_into_tp2(model_factory):
    from tandem.exchange import WeightSender

    engine_dir, trainer_dir = model_factory("mixtral"), model_factory("mixtral", seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        stats = WeightSender(hf, llm).push(version=1)
        assert stats.bytes_moved == stats.bytes_needed
        out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([PROMPTS[1]])).logits[0], dim=-1)
    want = [lp[p - 1, PROMPTS[1][p]].item() for p in range(1, len(PROMPTS[1]))]
    assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4, rel=0)
