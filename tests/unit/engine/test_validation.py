"""Bad input raises a clear, typed error and leaves the engine usable."""

import json
import shutil

import pytest
import torch

from tandem import LLM, ModelLoadError, SamplingParams, UnsupportedModelError
from tandem.models.tiny import make_tiny_model


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"max_tokens": True}, "max_tokens"),
        ({"logprobs_mode": "both"}, "logprobs_mode"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, max_model_len=64) as engine:
        yield engine


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "empty"),
        ([], "empty"),
        ([1] * 64, "max_model_len is 64"),
        ([5, 99999], "outside"),
        ([5, -1], "outside"),
    ],
)
def test_bad_prompts_raise_and_nothing_runs(llm, prompt, message):
    good = "A good prompt"
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    out = llm.generate(good, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_error_names_the_prompt_by_its_place_in_the_list(llm):
    prompts = ["A good prompt", [5, 6], [5, 99999], "another"]
    with pytest.raises(ValueError, match=r"^prompt 2: prompt has token ids outside"):
        llm.generate(prompts, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"^prompt 0: prompt is empty"):
        llm.generate([""], SamplingParams(max_tokens=4))


def test_max_tokens_past_the_context_is_refused_none_fills_it(llm):
    """As vLLM: max_tokens over what the prompt leaves of max_model_len is an error naming the
    field and the limit (nothing runs); None generates up to the limit."""
    prompt = [7] * 60
    with pytest.raises(ValueError, match=r"prompt 0: max_tokens is too large: 50.*64.*<= 4"):
        llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match="max_tokens is too large: 1000000000"):
        llm.generate(["hi"], SamplingParams(max_tokens=10**9))
    assert not llm.engine.has_unfinished()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(llm.generate([prompt], params)[0].outputs[0].token_ids) == 4
    out = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"


def test_engine_options_are_checked(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_memroy"):
        LLM(llama_dir, kv_cache_memroy=1)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=100000)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(llama_dir, kv_cache_memory=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(llama_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(llama_dir, kv_cache_memory=100)
    with pytest.raises(ValueError, match="max_num_batched_tokens .* max_num_seqs"):
        LLM(llama_dir, max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="mismatch|SamplingParams"):
        LLM(llama_dir).generate(["a", "b"], [SamplingParams()])


def test_request_larger_than_the_kv_cache_is_refused(llama_dir):
    with LLM(llama_dir, kv_cache_memory=4 * 16 * 2 * 2 * 2 * 16 * 4) as small:
        with pytest.raises(ValueError, match="KV blocks"):
            small.generate([[3] * 100], SamplingParams(max_tokens=10))


@pytest.fixture
def model_copy(llama_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(llama_dir, path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_hub_id_is_told_to_download_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local meta-llama/ here
    with pytest.raises(ModelLoadError, match="model directory not found") as err:
        LLM("meta-llama/Llama-3.2-1B")
    assert "Hugging Face hub id" in str(err.value)
    assert "huggingface-cli download meta-llama/Llama-3.2-1B --local-dir" in str(err.value)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path / "nowhere"))  # a path, not an id: no hint
    assert "hub id" not in str(err.value)


def test_missing_directory_and_files_name_the_file(model_copy, tmp_path, llama_dir):
    with pytest.raises(ModelLoadError, match="nowhere"):
        LLM(str(tmp_path / "nowhere"))
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        LLM(str(model_copy))
    shutil.copy(f"{llama_dir}/tokenizer.json", model_copy)
    (model_copy / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors.*unreadable"):
        LLM(str(model_copy))
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(model_copy))
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json.*JSON"):
        LLM(str(model_copy))
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(model_copy))


def test_unsupported_architecture_and_fields_name_the_field(model_copy):
    _edit_config(model_copy, architectures=["MambaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="architectures.*MambaForCausalLM"):
        LLM(str(model_copy))
    _edit_config(model_copy, architectures=["LlamaForCausalLM"], hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        LLM(str(model_copy))
    _edit_config(model_copy, hidden_act="silu", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="rope_type.*yarn"):
        LLM(str(model_copy))
    _edit_config(model_copy, rope_scaling=None, num_hidden_layers="two")
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        LLM(str(model_copy))


def test_checkpoint_mismatches_are_listed_together(model_copy):
    _edit_config(model_copy, num_hidden_layers=3, intermediate_size=200)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model_copy))
    message = str(info.value)
    assert "missing tensor model.layers.2.self_attn.q_proj.weight" in message
    assert "model.layers.0.mlp.gate_proj.weight has shape (176, 64)" in message
    _edit_config(model_copy, num_hidden_layers=1, intermediate_size=176)
    with pytest.raises(ModelLoadError, match="unexpected tensor model.layers.1.mlp.up_proj.weight"):
        LLM(str(model_copy))


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, llama_dir):
    sharded = make_tiny_model(tmp_path / "sharded", "llama", max_shard_bytes=20_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(str(sharded)) as a, LLM(llama_dir) as b:
        out_a, out_b = a.generate("The dog", params), b.generate("The dog", params)
    assert out_a[0].outputs[0].token_ids == out_b[0].outputs[0].token_ids
    assert out_a[0].outputs[0].logprobs == out_b[0].outputs[0].logprobs


def test_gpt2_hub_names_without_prefix_and_mask_buffers_load(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    original = model_factory("gpt2")
    hub = tmp_path / "gpt2-hub"
    shutil.copytree(original, hub)
    tensors = load_file(hub / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    save_file(renamed, hub / "model.safetensors")
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(str(hub)) as a, LLM(original) as b:
        assert a.generate("Hi", params)[0].outputs[0].logprobs == (
            b.generate("Hi", params)[0].outputs[0].logprobs
        )
