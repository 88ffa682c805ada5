"""Random-init models in Hugging Face format, with a real byte-level BPE tokenizer.

Tests, benchmarks and the demo build their models here; nothing is downloaded. The tensor names
and shapes come from the model classes' own placement pieces, so the files always match what
tandem (and transformers) load.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tandem.layers.placement import canonical_shapes
from tandem.models.loader import INDEX_FILE, SINGLE_FILE, read_model_spec

EOS = "<|endoftext|>"

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

FAMILIES: dict[str, dict] = {
    "llama": _LLAMA,
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,  # the dense layers' (mlp_only_layers)
        "moe_intermediate_size": 48,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_local_experts": 5,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "sliding_window": None,
    },
    "bert": {
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
        "label2id": {"negative": 0, "neutral": 1, "positive": 2},
        "pad_token_id": 0,
    },
    "llama_reward": {  # the same network with a 1-label score head
        **_LLAMA,
        "architectures": ["LlamaForSequenceClassification"],
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    },
    "vit": {
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu",
        "image_size": 32,
        "patch_size": 8,
        "num_channels": 3,
        "layer_norm_eps": 1e-12,
        "qkv_bias": True,
        "id2label": {"0": "cat", "1": "dog", "2": "bird", "3": "fish"},
        "label2id": {"cat": 0, "dog": 1, "bird": 2, "fish": 3},
    },
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 512,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    },
}

_WORDS = (
    "the a one two three red blue green small large quick slow cat dog bird fish tree river "
    "stone house road model token policy reward engine weight layer learns runs jumps sees "
    "finds keeps moves sends reads writes counts adds over under near with from into and but "
    "then because while every some many few new old first last good bad"
).split()


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """A generated training text: simple sentences and arithmetic facts."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        if rng.random() < 0.3:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append(f"{a} + {b} = {a + b}.")
        else:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
            out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return out


# A plain-text chat format (the tokenizer has no special tokens besides EOS).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    return tok


BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_wordpiece(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A BERT-style tokenizer: WordPiece, lowercasing, and a post-processor that wraps every
    text as [CLS] text [SEP] (pairs: [CLS] a [SEP] b [SEP], token types 0 then 1)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIALS, show_progress=False
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return tok


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    overrides: dict | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random-init ``family`` model (config overrides applied) to ``out_dir``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**FAMILIES[family], **(overrides or {})}
    if config.get("model_type") == "vit":  # no tokenizer: an image processor's settings
        config.update(torch_dtype="float32")
        size = {"height": config["image_size"], "width": config["image_size"]}
        processor = {**VIT_PREPROCESSOR, "size": size}
        (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
        return _write_weights(out, config, seed, max_shard_bytes)
    if config.get("model_type") == "bert":
        tok = train_wordpiece(vocab_size, seed)
        config.setdefault("vocab_size", max(vocab_size, tok.get_vocab_size()))
        config.update(torch_dtype="float32")
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "mask_token": "[MASK]",
        }
    else:
        tok = train_tokenizer(vocab_size, seed)
        eos = tok.token_to_id(EOS)
        config.setdefault("vocab_size", max(vocab_size, tok.get_vocab_size()))
        config.update(bos_token_id=eos, eos_token_id=eos, torch_dtype="float32")
        if "id2label" in config:  # a classifier reads the last token; pad is EOS
            config.setdefault("pad_token_id", eos)
        (out / "generation_config.json").write_text(
            json.dumps({"bos_token_id": eos, "eos_token_id": eos}, indent=2)
        )
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS,
            "bos_token": EOS,
            "chat_template": CHAT_TEMPLATE,
        }
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return _write_weights(out, config, seed, max_shard_bytes)


VIT_PREPROCESSOR = {
    "image_processor_type": "ViTImageProcessor",
    "do_resize": True,
    "size": {"height": 32, "width": 32},
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _write_weights(out: Path, config: dict, seed: int, max_shard_bytes: int | None) -> Path:
    """config.json, then random weights for every tensor the model class reads."""
    (out / "config.json").write_text(json.dumps(config, indent=2))
    spec = read_model_spec(out)
    with torch.device("meta"):
        shapes = canonical_shapes(spec.cls(spec.config))
    gen = torch.Generator().manual_seed(seed)
    hidden = config.get("hidden_size") or config.get("n_embd")
    tensors = {name: _init(name, shape, hidden, gen) for name, shape in sorted(shapes.items())}
    _save(tensors, out, max_shard_bytes)
    return out


def _init(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Weights that make every sublayer matter: unit-scale outputs, non-trivial norms and biases."""
    noise = torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * noise
    if len(shape) == 1:
        return 1.0 + 0.1 * noise
    return noise / math.sqrt(hidden)


def _save(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None) -> None:
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if max_shard_bytes is None:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
