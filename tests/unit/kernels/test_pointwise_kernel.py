"""tandem's pointwise C kernels (tandem.kernels.pointwise) against transformers' own Llama
modules (LlamaRMSNorm, the rotate-half rotary of apply_rotary_pos_emb, LlamaMLP's activation),
on contiguous and strided rows and at the sizes that split over threads, and the layers taking
torch's ops where the kernels do not serve."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from tandem.kernels import pointwise
from tandem.layers.activation import silu_and_mul
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import apply_rotary, rotate_, rotate_pair_

pytestmark = pytest.mark.skipif(not pointwise.available(), reason="no C compiler here")

ROWS = [1, 7, 300]  # 300 x 512 elements are enough for the kernels to use every thread
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(got, ref):
    """float32 within 1e-5; bfloat16 rounded where torch rounds: at least 99% of the values
    equal, the rest within two bfloat16 steps (float32 sums in another order, or another exp,
    can round an intermediate the other way, which the next rounding can carry). A kernel
    that skipped one of torch's rounding steps would miss far more."""
    assert got.dtype == ref.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got, ref, rtol=2**-6, atol=1e-6)
    exact = (got == ref).float().mean().item()
    assert exact >= 0.99, f"only {exact:.2%} equal"


def _norms(gen, dtype):
    """transformers' LlamaRMSNorm over 512 with random weights, and tandem's RMSNorm holding
    the same weights, both in ``dtype``."""
    ref = LlamaRMSNorm(512, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(512, generator=gen))
    ref.to(dtype)
    ours = RMSNorm(512, 1e-6, "w").to(dtype)
    ours.weight.data.copy_(ref.weight)
    return ref, ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_transformers(rows, strided, dtype):
    gen = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 1024, generator=gen) * 3).to(dtype)
    x = wide[:, 256:768] if strided else wide[:, :512].contiguous()  # rows 1024 apart
    ref, ours = _norms(gen, dtype)
    with torch.inference_mode():
        got = ours(x)
        assert pointwise.serves(x)
        assert_matches(got, ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
def test_residual_add_and_rms_norm_match_the_llama_decoder_layer(rows, strided, dtype):
    """HF's decoder layer: ``hidden = residual + hidden`` (rounded in the model's dtype), then
    the post-attention norm of that sum; both are returned."""
    gen = torch.Generator().manual_seed(rows + 1)
    wide = (torch.randn(rows, 1024, generator=gen) * 3).to(dtype)
    x = wide[:, 256:768] if strided else wide[:, :512].contiguous()
    residual = (torch.randn(rows, 512, generator=gen) * 2).to(dtype)
    ref, ours = _norms(gen, dtype)
    with torch.inference_mode():
        h, normed = ours.add(x, residual)
        assert pointwise.serves(x)
        expected_h = residual + x
        assert torch.equal(h, expected_h)  # one rounding, as torch's add
        assert_matches(normed, ref(expected_h))
    assert torch.is_grad_enabled()  # autograd on: torch's ops, the same values
    h_torch, normed_torch = ours.add(x, residual)
    assert torch.equal(h_torch, expected_h)
    assert_matches(normed_torch, normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_llama_mlp_activation(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 640, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        got = silu_and_mul(gate_up)
    assert_matches(got, F.silu(gate) * up)
    assert got.shape == (rows, 640)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", ROWS)
def test_rotary_in_place_matches_transformers(tokens, dtype):
    """q and k as the model has them: views of one fused qkv projection's output; tables in
    the activations' dtype, as both the engine and transformers cast them."""
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 8, 4, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    cos, sin = cos.to(dtype), sin.to(dtype)
    # transformers: [batch, heads, tokens, dim] with cos/sin [batch, tokens, dim]
    q_ref, k_ref = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    half = dim // 2
    tables = (cos[:, None], torch.cat((-sin[:, :half], sin[:, half:]), -1)[:, None])
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    with torch.inference_mode():
        q_got, k_got = rotate_(q, tables), rotate_(k, tables)
    assert q_got.data_ptr() == q.data_ptr(), "rotated in place"
    assert_matches(q_got, q_ref[0].transpose(0, 1))
    assert_matches(k_got, k_ref[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before), "v untouched"


def test_layers_take_torch_where_the_kernels_do_not_serve():
    """Autograd on, or float16: torch's ops, the input left as it was."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 8, generator=gen)
    tables = (torch.randn(4, 1, 8, generator=gen), torch.randn(4, 1, 8, generator=gen))
    before = x.clone()
    out = rotate_(x, tables)  # grad mode on
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, apply_rotary(before, tables))
    with torch.inference_mode():
        xh = x.half()
        assert not pointwise.serves(xh)
        torch.testing.assert_close(rotate_(xh, tables), apply_rotary(xh, tables))


def test_rotary_refuses_an_odd_head_size():
    x = torch.randn(2, 1, 7)
    with torch.inference_mode(), pytest.raises(ValueError, match="even head size"):
        pointwise.rotary_(x, torch.ones(2, 1, 7), torch.zeros(2, 1, 7))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adjacent", [True, False])
def test_rotate_pair_equals_rotating_q_and_k_alone(dtype, adjacent):
    """q and k from one fused qkv row take one kernel call over both; apart (q normed into
    new tensors, as Qwen3 does) they take one each: the same values either way, v untouched."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 5, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    if not adjacent:
        q, k = q.clone(), k.clone()
    angles = torch.rand(tokens, dim // 2, generator=gen) * 50
    tables = (
        torch.cat([angles.cos()] * 2, -1)[:, None].to(dtype),
        torch.cat([-angles.sin(), angles.sin()], -1)[:, None].to(dtype),
    )
    q_ref, k_ref = apply_rotary(q.clone(), tables), apply_rotary(k.clone(), tables)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    with torch.inference_mode():
        q_got, k_got = rotate_pair_(q, k, tables)
    assert q_got.data_ptr() == q.data_ptr() and k_got.data_ptr() == k.data_ptr()
    assert_matches(q_got, q_ref)
    assert_matches(k_got, k_ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rows_writes_what_index_copy_writes(dtype):
    """Keys of a step (a strided view of the fused qkv output) into their cache slots, out of
    order: the same cache as torch's index_copy_; an index outside the cache copies nothing."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, 8 * 16 + 2 * 2 * 16, generator=gen).to(dtype)
    k = qkv[:, 8 * 16 : 8 * 16 + 2 * 16].view(7, 2, 16)
    assert not k.is_contiguous()
    slots = torch.tensor([9, 2, 30, 31, 0, 17, 5])
    cache = torch.randn(32, 2, 16, generator=gen).to(dtype)
    expected = cache.clone().index_copy_(0, slots, k)
    with torch.inference_mode():
        pointwise.scatter_rows(cache, slots, k)
        assert torch.equal(cache, expected)
        before = cache.clone()
        with pytest.raises(IndexError):
            pointwise.scatter_rows(cache, torch.tensor([1, 2, 3, 4, 5, 6, 32]), k)
        assert torch.equal(cache, before)
