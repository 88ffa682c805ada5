"""Checkpoints as transformers writes them load: every config spelling transformers writes or
reads for a supported family (its config classes' ``attribute_map`` aliases, and what
``save_pretrained`` writes today) parses to the same tandem config as the Hub spelling, and a
Qwen3-MoE model saved by transformers 5.x (``num_local_experts``) serves what transformers
generates from that directory."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.errors import UnsupportedModelError
from tandem.models.loader import read_model_spec
from tandem.models.tiny import FAMILIES

pytestmark = pytest.mark.timeout(300)


def _config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _effective(config) -> dict:
    """What the model runs with: rope (``rope_parameters`` in transformers 5, else
    ``rope_theta`` + ``rope_scaling``) and the head size (written out by transformers 5, else
    hidden / heads) compared as resolved, every other field as parsed."""
    derived = {"head_dim", "rope_theta", "rope_scaling", "rope_parameters"}
    out = config.model_dump(exclude=derived)
    if hasattr(config, "rope"):
        out |= {"rope": config.rope, "dim_per_head": config.dim_per_head}
    return out


def _with_config(src: str, dst: Path, config: dict) -> Path:
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_saved_by_transformers_parses_like_the_hub_spelling(family, model_factory, tmp_path):
    hub = model_factory(family)
    saved = tmp_path / "saved"
    transformers.AutoConfig.from_pretrained(hub).save_pretrained(saved)
    assert _effective(read_model_spec(saved).config) == _effective(read_model_spec(hub).config)


# (family, alias) for every alias transformers' config class keeps for one of our families
ALIASES = [
    (family, alias)
    for family in sorted(FAMILIES)
    for alias in transformers.CONFIG_MAPPING[FAMILIES[family]["model_type"]].attribute_map
]


def test_the_aliases_cover_the_renamed_fields():
    assert ("qwen3_moe", "num_experts") in ALIASES  # transformers 5.x stores num_local_experts
    assert ("gpt2", "hidden_size") in ALIASES


@pytest.mark.parametrize("family,alias", ALIASES)
def test_every_transformers_alias_loads_under_either_name(family, alias, model_factory, tmp_path):
    """transformers reads ``alias`` into ``stored``; a config.json that writes either one (and
    not the other) gives tandem the same config."""
    hub = model_factory(family)
    stored = transformers.CONFIG_MAPPING[FAMILIES[family]["model_type"]].attribute_map[alias]
    config = _config(hub)
    value = config.get(stored, config.get(alias))
    assert value is not None, f"the tiny {family} config sets neither {alias} nor {stored}"
    expected = read_model_spec(hub).config
    for name in (alias, stored):
        other = {k: v for k, v in config.items() if k not in (alias, stored)} | {name: value}
        spelled = _with_config(hub, tmp_path / name, other)
        assert read_model_spec(spelled).config == expected, name
        assert transformers.AutoConfig.from_pretrained(spelled).to_dict()[stored] == value


def test_two_spellings_that_disagree_name_both(model_factory, tmp_path):
    hub = model_factory("qwen3_moe")
    config = _config(hub) | {"num_local_experts": 4}  # num_experts is 6
    with pytest.raises(UnsupportedModelError, match="num_local_experts .*num_experts"):
        read_model_spec(_with_config(hub, tmp_path / "m", config))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_model_saved_by_transformers_serves_its_generation(family, model_factory, tmp_path):
    """A user who trains with transformers (TRL) and calls ``save_pretrained`` gets this file."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory(family), dtype=torch.float32
    )
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    shutil.copy(Path(model_factory(family)) / "tokenizer.json", saved)
    shutil.copy(Path(model_factory(family)) / "tokenizer_config.json", saved)
    if family == "qwen3_moe":
        assert "num_local_experts" in _config(saved) and "num_experts" not in _config(saved)
    prompt = [5, 17, 99, 3, 250, 42, 7]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    with LLM(str(saved)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref
