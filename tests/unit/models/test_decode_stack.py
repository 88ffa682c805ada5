"""A decode step through a Llama stack in one C call (`LlamaForCausalLM.decode_layers`,
`tandem.kernels.decode_stack`) against the same layers called one by one: the hidden states,
keys and values bit for bit, in float32 and bfloat16, 1 to 4 rows of different context
lengths, with a q/k/v bias (Qwen2) and without; and the layers it must leave to Python."""

import pytest
import torch

from tandem.kernels import decode_stack, gemv
from tandem.kernels.paged import PagedDecode
from tandem.layers import gemm_choice
from tandem.layers.attention import AttentionMetadata, PrefillSpan
from tandem.models.loader import build_model, load_weights, read_model_spec

pytestmark = pytest.mark.skipif(
    not decode_stack.available(), reason="the decode stack's kernels do not build here"
)

BLOCK = 4
BLOCKS = 40


@pytest.fixture(autouse=True)
def matmuls_on(monkeypatch):
    """The process's matmul choice (`gemm_choice`, timed at first use) set, not probed: the
    GEMV kernel at one to a few rows, where the stack serves; ``matmuls_on(kernel)`` sets
    another."""

    def choose(few: str) -> None:
        chosen = {(dt, "batch"): "onednn" for dt in decode_stack.DTYPES}
        chosen |= {(dt, r): few for dt in decode_stack.DTYPES for r in ("one", "few")}
        monkeypatch.setattr(gemm_choice, "_chosen", chosen)

    choose("gemv")
    return choose


def _model(path: str, dtype: torch.dtype):
    spec = read_model_spec(path)
    model = build_model(spec, dtype=dtype)
    load_weights(model, spec)
    return model, spec.config


def _step(model, cfg, rows: int, dtype: torch.dtype, seed: int):
    """A decode step of ``rows`` sequences over random cached contexts of different lengths:
    (hidden rows, rotary tables, metadata, the caches to bind per layer)."""
    gen = torch.Generator().manual_seed(seed)
    kv, d = cfg.kv_heads, cfg.dim_per_head
    caches = [
        tuple(torch.randn(BLOCKS * BLOCK, kv, d, generator=gen).to(dtype) for _ in range(2))
        for _ in range(cfg.num_hidden_layers)
    ]
    decodes, slots, positions = [], [], []
    for r in range(rows):
        length = 3 + 5 * r  # the new token included
        table = [r * 10 + b for b in range(-(-length // BLOCK))]
        decodes.append((r, length, table))
        slots.append(table[(length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK)
        positions.append(length - 1)
    meta = AttentionMetadata(torch.tensor(slots), [], paged=PagedDecode.of(decodes, BLOCK))
    hidden = torch.randn(rows, cfg.hidden_size, generator=gen).to(dtype)
    context = model.layer_context(torch.tensor(positions), dtype)
    return hidden, context, meta, caches


def _bind(model, caches):
    for layer, (k, v) in zip(model.layers, caches, strict=True):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_call_equals_the_layers_one_by_one(model_factory, family, dtype):
    model, cfg = _model(model_factory(family), dtype)
    layers = list(model.layers)
    for rows in range(1, gemv.MAX_ROWS + 1):
        hidden, context, meta, caches = _step(model, cfg, rows, dtype, seed=rows)
        with torch.inference_mode():
            ref_caches = [(k.clone(), v.clone()) for k, v in caches]
            _bind(model, ref_caches)
            want = hidden
            for layer in layers:
                want = layer(want, context, meta)
            _bind(model, caches)
            got = model.decode_layers(layers, hidden, context, meta)
        assert got is not None, f"{rows} rows: the stack did not serve"
        assert torch.equal(got, want), f"{rows} rows: {(got - want).abs().max()}"
        for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
            assert torch.equal(k, rk) and torch.equal(v, rv)


def test_strided_input_rows_are_read_in_place(model_factory):
    model, cfg = _model(model_factory("llama"), torch.float32)
    hidden, context, meta, caches = _step(model, cfg, 2, torch.float32, seed=7)
    wide = torch.cat([hidden, torch.zeros_like(hidden)], dim=1)[:, : cfg.hidden_size]
    with torch.inference_mode():
        _bind(model, [(k.clone(), v.clone()) for k, v in caches])
        want = model.decode_layers(list(model.layers), hidden, context, meta)
        _bind(model, caches)
        got = model.decode_layers(list(model.layers), wide, context, meta)
    assert torch.equal(got, want)


def test_what_it_does_not_compute_is_left_to_the_layers(model_factory, matmuls_on):
    """q/k norms (Qwen3), a bias after attention, an odd head size, a prompt in the step, more
    rows than the GEMV kernel takes, autograd, and matmuls the process runs on another kernel:
    None, so the engine calls each layer."""
    cases = []
    for family, overrides in [
        ("qwen3", {}),
        ("llama", {"attention_bias": True}),
        ("llama", {"head_dim": 15}),  # odd: the rotary kernel's pairs
    ]:
        model, cfg = _model(model_factory(family, **overrides), torch.float32)
        cases.append((model, *_step(model, cfg, 1, torch.float32, seed=0)))
    model, cfg = _model(model_factory("llama"), torch.float32)
    hidden, context, meta, caches = _step(model, cfg, 1, torch.float32, seed=0)
    prompt = AttentionMetadata(meta.slot_mapping, [PrefillSpan(0, 1)], paged=meta.paged)
    cases.append((model, hidden, context, prompt, caches))
    rows = gemv.MAX_ROWS + 1
    cases.append((model, *_step(model, cfg, rows, torch.float32, seed=0)))
    for model, hidden, context, meta, caches in cases:
        _bind(model, caches)
        with torch.inference_mode():
            assert model.decode_layers(list(model.layers), hidden, context, meta) is None
    hidden, context, meta, caches = _step(model, cfg, 1, torch.float32, seed=0)
    _bind(model, caches)
    assert torch.is_grad_enabled()
    assert model.decode_layers(list(model.layers), hidden, context, meta) is None
    matmuls_on("torch")
    with torch.inference_mode():
        assert model.decode_layers(list(model.layers), hidden, context, meta) is None


def test_a_cache_slot_outside_the_cache_is_refused(model_factory):
    model, cfg = _model(model_factory("llama"), torch.float32)
    hidden, context, meta, caches = _step(model, cfg, 1, torch.float32, seed=0)
    meta.slot_mapping = torch.tensor([BLOCKS * BLOCK])
    _bind(model, caches)
    with torch.inference_mode(), pytest.raises(ValueError, match="layer 0 refused a cache slot"):
        model.decode_layers(list(model.layers), hidden, context, meta)
