"""A megatron-core GPTModel trainer (TP x PP over gloo, on CPU) that pushes into an engine and
then decodes greedily with Megatron's own forward; run by the tests, one process per rank.

    python tests/support/megatron_trainer.py RANK WORLD PORT TP PP MODEL_DIR ADDRESS VERSION \
        OUT PROMPT [delta]

ADDRESS is the engine's exchange address (tandem's `WeightSender`), or the URL of a
``vllm serve`` made with the ``tandem`` weight-transfer backend: the push then goes through
vLLM's own trainer API and HTTP client (`WeightTransferTrainerFactory`, a `ModuleSource` of
the GPTModel), in vLLM's venv. MODEL_DIR is the engine's Hugging Face model (llama, qwen2,
qwen3 or gpt2): the GPTModel is built with its sizes and features (QKV bias, QK-norm, tied
output, learned positions with LayerNorm and GELU; random init of its own, vocab padded to a
multiple of 64 x TP). With PP = 1 the trainer first takes one SGD step on a
language-modelling loss. After the push, the last pipeline stage's TP rank 0 writes OUT:
JSON {"tokens": [...], "logprobs": [...]} of 6 greedy tokens after PROMPT (comma-separated
ids), from log_softmax of Megatron's TP-gathered logits. With ``delta`` (PP = 1, tandem's
`WeightSender`), a second SGD step follows the push (the embedding's rows of tokens not in
its batch stay as they were) and VERSION + 1 is pushed as a delta (`delta=True`) before
decoding.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import megatron_shims  # noqa: E402

NEW_TOKENS = 6


def build(model_dir: str, tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    # llama; qwen2 (QKV bias, tied); qwen3 (QK-norm, head_dim, tied); gpt2 (learned positions,
    # LayerNorm, GELU, biases, tied)
    family = hf["model_type"]
    common = dict(
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )
    if family == "gpt2":
        cfg = TransformerConfig(
            num_layers=hf["n_layer"],
            hidden_size=hf["n_embd"],
            num_attention_heads=hf["n_head"],
            ffn_hidden_size=4 * hf["n_embd"],
            normalization="LayerNorm",
            layernorm_epsilon=hf["layer_norm_epsilon"],
            gated_linear_unit=False,
            activation_func=lambda x: F.gelu(x, approximate="tanh"),
            add_bias_linear=True,
            **common,
        )
        positions = dict(position_embedding_type="learned_absolute")
        max_len = hf["n_positions"]
    else:
        cfg = TransformerConfig(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_query_groups=hf["num_key_value_heads"],
            ffn_hidden_size=hf["intermediate_size"],
            kv_channels=hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]),
            add_qkv_bias=family == "qwen2",
            qk_layernorm=family == "qwen3",
            normalization="RMSNorm",
            layernorm_epsilon=hf["rms_norm_eps"],
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            **common,
        )
        positions = dict(position_embedding_type="rope", rotary_base=int(hf["rope_theta"]))
        max_len = hf["max_position_embeddings"]
    multiple = 64 * tp
    padded = -(-hf["vocab_size"] // multiple) * multiple
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(qk_layernorm=family == "qwen3"),
        vocab_size=padded,
        max_sequence_length=max_len,
        **positions,
        share_embeddings_and_output_weights=hf.get("tie_word_embeddings", False),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    return model, hf["vocab_size"]


def forward(model, ids: torch.Tensor, labels=None):
    """Megatron's forward through every pipeline stage (hidden states sent stage to stage);
    the last stage returns the logits (or the loss with ``labels``), other stages None."""
    from megatron.core import parallel_state as ps

    n = ids.shape[1]
    pos, mask = torch.arange(n)[None], megatron_shims.causal_mask(n)
    hidden_shape = (n, 1, model.config.hidden_size)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(hidden_shape, requires_grad=labels is not None)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(ids, pos, mask, labels=labels)
    if not ps.is_pipeline_last_stage():
        dist.send(out.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def gathered_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits [seq, vocab] on the last stage (all-gathered over TP), else None."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        local = forward(model, ids)
    if local is None:
        return None
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[0]


class _Wrapper(torch.nn.Module):
    """Holds the model as ``.module``, like Megatron's DDP and Float16Module."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def push_through_vllms_api(model, url: str, rank: int, world: int, vocab: int, version: int):
    """Every rank's push through vLLM's trainer API into the ``vllm serve`` at ``url``."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from tandem.integrations.vllm import TandemTrainerInitInfo

    info = TandemTrainerInitInfo(rank=rank, world_size=world, vocab_size=vocab)
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    try:
        stats = engine.send_weights(version=version)
    finally:
        engine.shutdown()
    assert stats.bytes_moved == stats.bytes_needed, stats


def sgd_step(model, optimizer, ids: torch.Tensor) -> None:
    loss = forward(model, ids, labels=torch.roll(ids, -1, 1)).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def main() -> int:
    rank, world, tp, pp = (int(a) for a in (*sys.argv[1:3], *sys.argv[4:6]))
    rendezvous = sys.argv[3]
    assert world == tp * pp, "one model replica: WORLD = TP x PP"
    model_dir, address, version, out_path, prompt = sys.argv[6:11]
    megatron_shims.install()
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    from tandem.exchange import WeightSender

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234 + ps.get_pipeline_model_parallel_rank())
    model, vocab = build(model_dir, tp, pp)
    delta = len(sys.argv) > 11 and sys.argv[11] == "delta"
    if pp == 1:  # one optimizer step: the pushed weights are a trained model's
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(7)
        before = [p.detach().clone() for p in model.parameters()]
        sgd_step(model, optimizer, torch.randint(0, vocab, (1, 16), generator=g))
        changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
        assert all(changed), "the optimizer step left a parameter unchanged"
    # with PP, push through a wrapper as Megatron's DDP / Float16Module hold the model
    pushed = _Wrapper(model) if pp > 1 else model
    if address.startswith("http://"):
        push_through_vllms_api(pushed, address, rank, world, vocab, int(version))
    else:
        sender = WeightSender(pushed, address, vocab_size=vocab)
        sender.push(version=int(version), delta=True if delta else "auto")  # True: keep a shadow
        if delta:
            sgd_step(model, optimizer, torch.randint(0, vocab, (1, 16), generator=g))
            stats = sender.push(version=int(version) + 1, delta=True)
            assert stats.delta and stats.bytes_moved < stats.bytes_needed, stats
    tokens = [int(t) for t in prompt.split(",")]
    last = (pp - 1) * tp  # the last stage's TP rank 0 (Megatron orders ranks TP fastest, PP last)
    generated, logprobs = [], []
    for _ in range(NEW_TOKENS):
        logits = gathered_logits(model, torch.tensor([tokens + generated]))
        nxt = torch.zeros(1, dtype=torch.long)
        if logits is not None:
            logp = torch.log_softmax(logits[-1, :vocab].float(), dim=-1)
            nxt[0] = int(logp.argmax())
            logprobs.append(float(logp[nxt[0]]))
        dist.broadcast(nxt, last)
        generated.append(int(nxt[0]))
    if rank == last:
        Path(out_path).write_text(json.dumps({"tokens": generated, "logprobs": logprobs}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
