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
from tandem.layers.rotary import apply_rotary, rotate_

pytestmark = pytest.mark.skipif(not pointwise.available(), reason="no C compiler here")

ROWS = [1, 7, 300]  # 300 x 512 elements are enough for the kernels to use every thread


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_transformers(rows, strided):
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 1024, generator=gen) * 3
    x = wide[:, 256:768] if strided else wide[:, :512].contiguous()  # rows 1024 apart
    ref = LlamaRMSNorm(512, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(512, generator=gen))
    ours = RMSNorm(512, 1e-6, "w")
    ours.weight.data.copy_(ref.weight)
    with torch.inference_mode():
        got = ours(x)
        assert pointwise.serves(x)
        torch.testing.assert_close(got, ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_llama_mlp_activation(rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 640, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        got = silu_and_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, 640)


@pytest.mark.parametrize("tokens", ROWS)
def test_rotary_in_place_matches_transformers(tokens):
    """q and k as the model has them: views of one fused qkv projection's output."""
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 8, 4, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
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
    torch.testing.assert_close(q_got, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_got, k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before), "v untouched"


def test_layers_take_torch_where_the_kernels_do_not_serve():
    """Autograd on, or bfloat16: torch's ops, the input left as it was."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 8, generator=gen)
    tables = (torch.randn(4, 1, 8, generator=gen), torch.randn(4, 1, 8, generator=gen))
    before = x.clone()
    out = rotate_(x, tables)  # grad mode on
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, apply_rotary(before, tables))
    with torch.inference_mode():
        xb = x.bfloat16()
        assert not pointwise.serves(xb)
        torch.testing.assert_close(rotate_(xb, tables), apply_rotary(xb, tables))


def test_rotary_refuses_an_odd_head_size():
    x = torch.randn(2, 1, 7)
    with torch.inference_mode(), pytest.raises(ValueError, match="even head size"):
        pointwise.rotary_(x, torch.ones(2, 1, 7), torch.zeros(2, 1, 7))
