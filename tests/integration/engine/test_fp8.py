"""Block-FP8 engines: HF FP8 checkpoints served as transformers serves them (on CPU its FP8
path dequantizes each weight with its block scales), float checkpoints quantized on load,
and pushes from float32 trainers quantized by the trainer so the engine holds exactly what
the reference quantizer makes of the trainer's weights (amax over the block / 448, rounded to
the nearest e4m3), on every transport, under TP with shards that cut blocks, and from an FSDP2
trainer whose shards cut blocks (its ranks agree on the scales first).

Small shapes and 16 x 16 blocks (the checkpoints' 128 x 128 blocks would make each tiny weight
one partial block): every weight spans several blocks, and TP / FSDP shards of the 176-row
MLP cut blocks in two. Everything computes in float32, so none of it needs bfloat16 units.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from support.trainers import run_trainer
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender
from tandem.layers.fp8 import fp8_placement, quantize_blocks
from tandem.layers.placement import cols, rows
from tandem.models.fp8_checkpoint import save_fp8_checkpoint

pytestmark = pytest.mark.timeout(300)
B = 16
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)


def reference_quantize(w: torch.Tensor, block: int = B):
    """The format's rule written out block by block: scale = amax / 448 (1 for an all-zero
    block), value = w / scale rounded to the nearest e4m3."""
    w = w.float()
    grid = (-(-w.shape[0] // block), -(-w.shape[1] // block))
    scales = torch.ones(grid)
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = part.abs().max()
            if amax > 0:
                scales[i, j] = amax / 448
            values[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                part / scales[i, j]
            ).to(torch.float8_e4m3fn)
    return values, scales


def canonical(model) -> dict[str, torch.Tensor]:
    """The engine's parameters put back together as canonical (HF) tensors (one rank)."""
    out: dict[str, torch.Tensor] = {}
    for param in model.parameters():
        for piece in param.pieces:
            full = out.setdefault(piece.name, torch.zeros(piece.full_shape, dtype=param.dtype))
            full[piece.box_slices()] = piece.region().view(param)
    return out


def _outputs(llm):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def fp8_dirs(model_factory, tmp_path_factory):
    """family -> (float checkpoint, the same as block-FP8 with 16 x 16 blocks)."""
    made = {}

    def make(family: str, seed: int = 0):
        if (family, seed) not in made:
            src = model_factory(family, seed=seed)
            dst = tmp_path_factory.mktemp(f"{family}-fp8")
            made[(family, seed)] = (src, str(save_fp8_checkpoint(src, dst, (B, B))))
        return made[(family, seed)]

    return make


def test_the_quantizer_is_amax_over_448_rounded_to_the_nearest_e4m3():
    w = torch.randn(70, 45, generator=torch.Generator().manual_seed(0)) * 3
    w[16:32, 0:16] = 0  # an all-zero block
    w[0, 0] = 1000.0  # a block whose amax dwarfs the rest
    values, scales = quantize_blocks(w, (B, B))
    ref_values, ref_scales = reference_quantize(w)
    assert torch.equal(scales, ref_scales) and scales[1, 0] == 1
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    assert values.float().abs().max() == 448  # each block's amax lands on e4m3's largest


def test_scales_are_placed_with_the_shards_that_hold_their_blocks():
    """Rank 1 of 2 of the fused gate/up projection (176 rows each, 88 per rank): its rows
    88-175 start inside block 5 (rows 80-95), which it holds as rank 0 does."""
    pieces = [rows("g", (176, 64), 88, 176, 0), rows("u", (176, 64), 88, 176, 88)]
    placed = fp8_placement(pieces, (176, 64), (B, B))
    assert [(p.name, p.full_shape, p.box, p.offset) for p in placed.pieces] == [
        ("g_scale_inv", (11, 4), ((5, 11), (0, 4)), (0, 0)),
        ("u_scale_inv", (11, 4), ((5, 11), (0, 4)), (6, 0)),
    ]
    assert placed.shape == (12, 4)
    assert placed.rows[:8] == (0,) * 8 and placed.rows[8] == 1  # row 88 -> block 5, 96 -> 6
    assert placed.rows[88:96] == (6,) * 8 and placed.rows[96] == 7
    down = fp8_placement([cols("d", (64, 176), 88, 176)], (64, 88), (B, B))
    assert down.pieces[0].box == ((0, 4), (5, 11)) and down.cols[7:9] == (0, 1)


@pytest.mark.parametrize(
    ("family", "parallel"),
    [
        ("llama", {}),
        ("llama", {"tensor_parallel_size": 2}),
        ("llama", {"pipeline_parallel_size": 2}),
        ("qwen3_moe", {"tensor_parallel_size": 2}),
    ],
)
def test_an_fp8_checkpoint_serves_as_transformers_fp8_path(fp8_dirs, family, parallel):
    src, fp8 = fp8_dirs(family)
    # transformers' FP8 path on a machine without a GPU: each weight x its block's scale
    reference = transformers.AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32)
    with LLM(fp8, dtype="float32", **parallel) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
    for out in outputs:
        c = out.outputs[0]
        ids = torch.tensor([out.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
        n = len(out.prompt_token_ids)
        expected = logp[n - 1 : -1].gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        assert c.token_ids == logp[n - 1 : -1].argmax(-1).tolist()
        assert (torch.tensor(c.logprobs) - expected).abs().max() <= 1e-4
    if not parallel:  # and it is not the float model served by mistake
        with LLM(src, dtype="float32") as plain:
            first = plain.generate(PROMPTS, GREEDY)[0].outputs[0]
        assert abs(first.logprobs[0] - outputs[0].outputs[0].logprobs[0]) > 1e-3


def test_a_float_checkpoint_quantized_on_load_holds_the_reference_quantization(llama_dir):
    trained = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with LLM(llama_dir, dtype="float32", quantization="fp8") as llm:
        [held] = llm.apply_model(canonical)
    quantized = 0
    for name, w in trained.state_dict().items():
        if name + "_scale_inv" in held:
            values, scales = reference_quantize(w, 128)
            assert torch.equal(held[name].view(torch.uint8), values.view(torch.uint8)), name
            assert torch.equal(held[name + "_scale_inv"], scales), name
            quantized += 1
        elif name in held:
            assert torch.equal(held[name], w), name
    assert quantized == 2 * 7  # q, k, v, o, gate, up, down in both layers


def _expected_bytes(held: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in held.values())


@pytest.mark.parametrize(
    ("transport", "mode", "trainer_dtype"),
    [
        ("shm", "staged", torch.float32),
        ("shm", "in_place", torch.float32),
        ("dist", "staged", torch.float32),
        ("dist", "in_place", torch.float32),
        ("mooncake", "staged", torch.float32),
        ("shm", "staged", torch.bfloat16),
    ],
)
def test_a_float_push_lands_as_the_reference_quantization_of_the_trainers_weights(
    fp8_dirs, model_factory, transport, mode, trainer_dtype
):
    """A bfloat16 trainer's weights are quantized from their bfloat16 values (no bfloat16
    matmul runs: no native bf16 needed)."""
    _, fp8 = fp8_dirs("llama")
    trainer = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory("llama", seed=1), dtype=trainer_dtype
    )
    with LLM(fp8, dtype="float32") as llm:
        stats = WeightSender(trainer, llm, transport=transport, mode=mode).push(version=1)
        assert llm.weight_version == 1
        [held] = llm.apply_model(canonical)
    quantized = 0
    for name, w in trainer.state_dict().items():
        if name + "_scale_inv" in held:
            values, scales = reference_quantize(w)
            assert torch.equal(held[name].view(torch.uint8), values.view(torch.uint8)), name
            assert torch.equal(held[name + "_scale_inv"], scales), name
            quantized += 1
        elif name in held:
            assert torch.equal(held[name], w.float()), name
    assert quantized == 14
    # one byte per FP8 weight and 4 per scale and per float32 parameter, counted
    assert stats.bytes_needed == stats.bytes_moved == _expected_bytes(held)
    fp8_weights = sum(t.numel() for t in held.values() if t.dtype == torch.float8_e4m3fn)
    float32 = sum(t.numel() for t in held.values() if t.dtype == torch.float32)
    assert stats.bytes_needed == fp8_weights + 4 * float32


def test_a_push_into_a_tp2_fp8_engine_serves_the_trainers_weights_quantized(
    fp8_dirs, model_factory
):
    """TP shards of the MLP cut 16-row blocks in two: each rank gets its values and the
    scales of every block it touches. The pushed engine serves exactly what an engine loading
    the trainer's checkpoint quantized by the reference rule serves."""
    _, engine_dir = fp8_dirs("llama")
    trainer_dir, trainer_fp8 = fp8_dirs("llama", seed=1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    with LLM(trainer_fp8, dtype="float32", tensor_parallel_size=2) as llm:
        expected = _outputs(llm)
    with LLM(engine_dir, dtype="float32", tensor_parallel_size=2) as llm:
        before = _outputs(llm)
        WeightSender(trainer, llm, transport="dist").push(version=1)
        after = _outputs(llm)
    # the same weights: the same tokens, log-probs within float32 noise between two engines'
    # runs (a scale placed one block off moves them by more than 1e-3)
    for (tokens, logprobs), (want, want_logprobs) in zip(after, expected, strict=True):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-5
    assert after != before


def test_an_fsdp2_trainer_whose_shards_cut_blocks_agrees_on_their_scales(fp8_dirs, model_factory):
    """Two FSDP2 ranks hold rows 0-87 and 88-175 of the MLP's weights: block rows 80-95 lie on
    both. Each rank's amax of that block is partial; they agree on the whole block's before
    quantizing (without it the scales of those blocks differ from the reference)."""
    _, engine_dir = fp8_dirs("llama")
    trainer_dir = model_factory("llama", seed=1)
    with LLM(engine_dir, dtype="float32") as llm:
        codes = run_trainer(trainer_dir, llm.exchange_address, 1, "shm")
        assert codes == [0, 0]
        [held] = llm.apply_model(canonical)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    for name, w in trainer.state_dict().items():
        if name + "_scale_inv" in held:
            values, scales = reference_quantize(w)
            assert torch.equal(held[name + "_scale_inv"], scales), name
            assert torch.equal(held[name].view(torch.uint8), values.view(torch.uint8)), name


def test_an_fp8_fleet_takes_a_push_and_heals_a_new_replica_from_a_peer(fp8_dirs, model_factory):
    """Every replica of a fleet (relayed bytes) and one that joins later by a push from a
    live peer (whose e4m3 values and scales travel as they are) serve the pushed weights."""
    _, engine_dir = fp8_dirs("llama")
    trainer_dir, trainer_fp8 = fp8_dirs("llama", seed=1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    with LLM(trainer_fp8, dtype="float32") as llm:
        expected = _outputs(llm)[0]
    with LLM(engine_dir, dtype="float32", data_parallel_size=2) as llm:
        stats = WeightSender(trainer, llm, transport="dist").push(version=1)
        assert [r.state for r in stats.replicas] == ["committed", "committed"]
        llm.add_replica()
        assert [r["version"] for r in llm.fleet_state()] == [1, 1, 1]
        for out in llm.generate([PROMPTS[0]] * 6, GREEDY):  # spread over the three replicas
            c = out.outputs[0]
            assert c.token_ids == expected[0]
            assert max(abs(a - b) for a, b in zip(c.logprobs, expected[1], strict=True)) < 1e-5


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"quant_method": "awq"}, "quant_method"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
            "scale_fmt",
        ),
    ],
)
def test_an_fp8_config_tandem_cannot_serve_is_refused_naming_the_field(config, field):
    from tandem.errors import UnsupportedModelError
    from tandem.models.fp8 import Fp8Config

    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}"):
        Fp8Config.from_hf(config, "config.json")


def test_a_delta_into_a_block_fp8_engine_lands_the_reference_quantization(fp8_dirs, model_factory):
    """After an AdamW step at lr 1e-5 a delta push carries the FP8 values and scales that
    changed (and the float32 weights, which all moved); the engine then holds exactly the
    reference quantization of the trainer's new weights."""
    _, fp8 = fp8_dirs("llama")
    trainer = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory("llama", seed=1), dtype=torch.float32
    )
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    with LLM(fp8, dtype="float32") as llm:
        sender = WeightSender(trainer, llm, transport="dist")
        sender.push(version=1, delta=True)
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
        trainer(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        stats = sender.push(version=2, delta=True)
        [held] = llm.apply_model(canonical)
    assert stats.delta and stats.bytes_moved < stats.bytes_needed
    for name, w in trainer.state_dict().items():
        if name + "_scale_inv" in held:
            values, scales = reference_quantize(w)
            assert torch.equal(held[name].view(torch.uint8), values.view(torch.uint8)), name
            assert torch.equal(held[name + "_scale_inv"], scales), name
        elif name in held:
            assert torch.equal(held[name], w), name
