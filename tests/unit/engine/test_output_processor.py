"""Incremental detokenization and stop rules (tandem.engine.output_processor)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, trainers

from tandem.engine.output_processor import (
    IncrementalDetokenizer,
    OutputProcessor,
    decoder_is_local,
)
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.tokenizer import Tokenizer
from tandem.models.tiny import EOS, corpus, make_tiny_model

MULTIBYTE = ["日本語のテキスト", "中文字符", "😀🎉👍🏽", "héllo wörld", "naïve café", "Ω≈ç√∫", "🇯🇵"]


class CountingTokenizer(Tokenizer):
    """A tandem Tokenizer that counts the tokens passed to decode."""

    decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny_dir(request, tmp_path_factory):
    """A tiny model's directory: byte-level BPE (the GPT-2 / Llama-3 / Qwen kind)."""
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def _save(tmp_path_factory, name: str, tok: HFTokenizer):
    d = tmp_path_factory.mktemp(name)
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A SentencePiece-style BPE (the Llama-2 / Mistral kind): '▁' for spaces, <0xNN> bytes."""
    tok = HFTokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(corpus(lines=1500), trainer=trainer)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte tokens live in the model's vocabulary, as in Llama-2's
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return _save(tmp_path_factory, "sp", HFTokenizer.from_str(json.dumps(spec)))


@pytest.fixture(scope="module")
def metaspace_dir(sp_dir, tmp_path_factory):
    """The same vocabulary with a Metaspace decoder (first token's '▁' dropped)."""
    tok = HFTokenizer.from_file(str(sp_dir / "tokenizer.json"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return _save(tmp_path_factory, "metaspace", tok)


@pytest.fixture(scope="module")
def ctc_dir(sp_dir, tmp_path_factory):
    """A decoder whose text depends on neighbouring tokens (repeats merged): not local."""
    tok = HFTokenizer.from_file(str(sp_dir / "tokenizer.json"))
    tok.decoder = decoders.CTC(pad_token="<unk>", word_delimiter_token="▁")
    return _save(tmp_path_factory, "ctc", tok)


def _special_ids(tok: Tokenizer) -> list[int]:
    return [i for i, t in tok._tok.get_added_tokens_decoder().items() if t.special]


def _random_output(tok: Tokenizer, rng: random.Random, n: int, *, raw_bytes: bool) -> list[int]:
    """~n tokens: encoded text with multi-byte characters, random tokens, special tokens."""
    vocab = tok._tok.get_vocab_size()
    byte_ids = {tok._tok.token_to_id(f"<0x{b:02X}>") for b in range(256)} - {None}
    specials = _special_ids(tok)
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.4:
            words = rng.choices(MULTIBYTE + ["the cat", " runs", "1 + 2 = 3.", "\n", "  "], k=3)
            out += tok.encode(rng.choice(["", " "]) + " ".join(words))
        elif r < 0.85:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            out += [i for i in ids if raw_bytes or i not in byte_ids]
        else:
            out.append(rng.choice(specials))
    return out[:n]


def _check_stream(tok: Tokenizer, ids: list[int], start: int, skip: bool, exact_steps: bool):
    detok = IncrementalDetokenizer(tok, skip, start)
    shown = ""
    for k in range(start + 1, len(ids) + 1):
        added = detok.update(ids[:k])
        assert detok.text == shown + added
        assert not detok.text.endswith("\ufffd")  # never a partial character
        shown = detok.text
        full = tok.decode(ids[start:k], skip)
        if exact_steps and not full.endswith("\ufffd"):
            assert detok.text == full, (k, ids[start:k])
    assert detok.finish(ids) == tok.decode(ids[start:], skip)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_matches_full_decode(tiny_dir, skip):
    tok = Tokenizer(tiny_dir)
    assert decoder_is_local(tok)
    rng = random.Random(1)
    for _ in range(60):
        prompt = tok.encode("a prompt 日本")
        ids = prompt + _random_output(tok, rng, rng.randint(1, 50), raw_bytes=True)
        _check_stream(tok, ids, len(prompt), skip, exact_steps=True)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("which", ["sp", "metaspace"])
def test_sentencepiece_style_matches_full_decode(request, which, skip):
    tok = Tokenizer(request.getfixturevalue(f"{which}_dir"))
    assert decoder_is_local(tok)
    pieces = [tok._tok.id_to_token(i) for i in tok.encode("😀")]
    assert sum(p.startswith("<0x") for p in pieces) == 4  # byte fallback: a token per byte
    rng = random.Random(2)
    for _ in range(60):
        ids = _random_output(tok, rng, rng.randint(1, 50), raw_bytes=False)
        _check_stream(tok, ids, 0, skip, exact_steps=True)
    # Invalid UTF-8 (stray <0xNN> tokens): ByteFallback renders a run of bytes by context,
    # so only the final text (one full decode at finish) is guaranteed.
    for _ in range(60):
        ids = _random_output(tok, rng, rng.randint(1, 50), raw_bytes=True)
        _check_stream(tok, ids, 0, skip, exact_steps=False)


def test_non_local_decoder_final_text(ctc_dir):
    tok = Tokenizer(ctc_dir)
    assert not decoder_is_local(tok)
    rng = random.Random(3)
    for _ in range(40):
        ids = _random_output(tok, rng, rng.randint(1, 40), raw_bytes=True)
        _check_stream(tok, ids, 0, True, exact_steps=False)


# --- OutputProcessor -------------------------------------------------------------------------


def _seq(prompt: list[int], **params) -> Sequence:
    p = SamplingParams(**{"max_tokens": 1000, **params})
    return Sequence(0, "r", 0, prompt, p, p.max_tokens, 0.0)


def _run(proc: OutputProcessor, seq: Sequence, tokens: list[int]) -> list[str]:
    """Feed tokens until the sequence finishes; return stable_text after each token."""
    stable = []
    for t in tokens:
        seq.token_ids.append(t)
        proc.process(seq, t)
        stable.append(proc.stable_text(seq))
        if seq.finished:
            break
    return stable


def _reference(tok: Tokenizer, eos: set[int], max_model_len: int, seq: Sequence, tokens):
    """The old LLMEngine._check_stop: a full decode every step. Returns (steps, text)."""
    params = seq.params
    for n, token in enumerate(tokens, start=1):
        seq.token_ids.append(token)
        text = tok.decode(seq.output_token_ids, params.skip_special_tokens)
        if not params.ignore_eos and token in eos:
            seq.finish("stop")
            return n, text
        if token in params.stop_token_ids:
            seq.finish("stop", token)
            return n, text
        found = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
        if found:
            idx, stop = min(found)
            seq.finish("stop", stop)
            return n, text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
        if seq.num_output_tokens >= seq.max_tokens or len(seq) >= max_model_len:
            seq.finish("length")
            return n, text
    return len(tokens), text


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("llama-proc"), "llama")
    tok = Tokenizer(d)
    return tok, tok._tok.token_to_id(EOS)


def test_stop_rules_match_full_decode_reference(tiny_tok):
    tok, eos = tiny_tok
    rng = random.Random(4)
    kinds = {"stop": 0, "length": 0}
    for case in range(300):
        prompt = tok.encode("prompt:")
        tokens = _random_output(tok, rng, 60, raw_bytes=case % 2 == 0)
        text = tok.decode(tokens)
        stops = []
        for _ in range(rng.randint(0, 3)):  # substrings of the text: across token boundaries
            i = rng.randrange(max(1, len(text) - 1))
            s = text[i : i + rng.randint(1, 6)].replace("\ufffd", "")
            stops.append(s or "zz")
        params = dict(
            stop=stops,
            include_stop_str_in_output=rng.random() < 0.5,
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.sample(tokens, 1) if rng.random() < 0.2 else [],
            max_tokens=rng.choice([1000, rng.randint(1, 60)]),
            skip_special_tokens=rng.random() < 0.7,
        )
        max_model_len = rng.choice([1000, len(prompt) + rng.randint(1, 60)])
        ref = _seq(prompt, **params)
        steps, ref_text = _reference(tok, {eos}, max_model_len, ref, tokens)

        seq = _seq(prompt, **params)
        proc = OutputProcessor(tok, {eos}, max_model_len)
        stable = _run(proc, seq, tokens)
        assert len(stable) == steps
        assert (seq.finished, seq.finish_reason, seq.stop_reason) == (
            ref.finished,
            ref.finish_reason,
            ref.stop_reason,
        )
        final = proc.text(seq)
        # Unfinished (out of tokens): a trailing partial character is still held back.
        assert final == (ref_text if seq.finished else ref_text.rstrip("\ufffd"))
        if seq.finished:
            kinds[seq.finish_reason] += 1
            assert stable[-1] == final
        for a, b in zip(stable, stable[1:], strict=False):
            assert b.startswith(a)  # a stream never takes back what it sent
        for s in stable[:-1] if seq.finished else stable:
            assert not any(stop in s for stop in stops)
    assert kinds["stop"] > 50 and kinds["length"] > 20


def test_stop_string_across_tokens_and_characters(tiny_tok):
    tok, eos = tiny_tok
    tokens = tok.encode("the cat runs 日本語 over 😀 the dog")
    for stop, include, expect in [
        ("at ru", False, "the c"),
        ("at ru", True, "the cat ru"),
        ("本語 o", False, "the cat runs 日"),
        ("😀", True, "the cat runs 日本語 over 😀"),
        ("over 😀", False, "the cat runs 日本語 "),
    ]:
        seq = _seq([], stop=["zzz", stop], include_stop_str_in_output=include)
        proc = OutputProcessor(tok, {eos}, 1000)
        _run(proc, seq, tokens)
        assert (seq.finish_reason, seq.stop_reason) == ("stop", stop)
        assert proc.text(seq) == expect == seq.text
        assert proc.stable_text(seq) == expect
        # It stopped at the token that completed the stop string.
        done = tok.decode(seq.output_token_ids)
        assert stop in done and stop not in tok.decode(seq.output_token_ids[:-1])


def test_stable_text_holds_back_a_stop_prefix(tiny_tok):
    tok, eos = tiny_tok
    proc = OutputProcessor(tok, {eos}, 1000)
    seq = _seq([], stop=["cat runs", "dog"])
    tokens = tok.encode("the cat")
    _run(proc, seq, tokens)
    assert proc.text(seq) == "the cat"
    assert proc.stable_text(seq) == "the "  # "cat" may start "cat runs"
    seq2 = _seq([])
    _run(proc, seq2, tokens)
    assert proc.stable_text(seq2) == "the cat"
    # A partial character is held back by the detokenizer itself.
    seq3 = _seq([])
    emoji = tok.encode("a😀")
    _run(proc, seq3, emoji[:-1])
    assert proc.text(seq3) == proc.stable_text(seq3) == "a"
    _run(proc, seq3, emoji[-1:])
    assert proc.stable_text(seq3) == "a😀"


def test_eos_stop_token_ids_and_length(tiny_tok):
    tok, eos = tiny_tok
    body = tok.encode("the cat runs")
    proc = OutputProcessor(tok, {eos}, 1000)

    seq = _seq([1, 2])
    _run(proc, seq, body + [eos] + body)
    assert (seq.finish_reason, seq.stop_reason, seq.num_output_tokens) == (
        "stop",
        None,
        len(body) + 1,
    )
    assert proc.text(seq) == "the cat runs"
    seq = _seq([1, 2], skip_special_tokens=False)
    _run(proc, seq, body + [eos])
    assert proc.text(seq) == "the cat runs" + EOS

    seq = _seq([], ignore_eos=True, max_tokens=len(body) + 2)
    _run(proc, seq, body + [eos] + body)
    assert (seq.finish_reason, seq.num_output_tokens) == ("length", len(body) + 2)

    seq = _seq([], stop_token_ids=[body[1]])
    _run(proc, seq, body)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", body[1])
    assert proc.text(seq) == tok.decode(body[:2])

    proc = OutputProcessor(tok, {eos}, max_model_len=5)
    seq = _seq([7, 8, 9])
    _run(proc, seq, body + body)
    assert (seq.finish_reason, len(seq)) == ("length", 5)

    # A partial character still held back when the sequence stops is in the final text.
    seq = _seq([], max_tokens=2)
    proc = OutputProcessor(tok, {eos}, 1000)
    _run(proc, seq, tok.encode("a😀"))
    assert proc.text(seq) == tok.decode(tok.encode("a😀")[:2])
    assert proc.text(seq).endswith("\ufffd")


def test_aborted_sequence_gets_its_full_text(tiny_tok):
    tok, eos = tiny_tok
    proc = OutputProcessor(tok, {eos}, 1000)
    seq = _seq([])
    ids = tok.encode("ok 😀")
    _run(proc, seq, ids[:-1])
    assert proc.text(seq) == "ok "
    seq.finish("abort")  # finished outside the processor
    assert proc.text(seq) == proc.stable_text(seq) == tok.decode(ids[:-1])


def test_decode_work_is_linear(tiny_dir):
    tok = CountingTokenizer(tiny_dir)
    text = " ".join(corpus(lines=200)) + " " + " ".join(MULTIBYTE * 10)
    rng = random.Random(5)
    words = text.split(" ")
    rng.shuffle(words)
    tokens = tok.encode(" ".join(words))[:400]
    n = len(tokens)
    assert n == 400
    eos = tok._tok.token_to_id(EOS)
    proc = OutputProcessor(tok, {eos}, 10_000)
    seq = _seq([], stop=["never said", "zz"], max_tokens=n)
    stable = _run(proc, seq, tokens)
    assert seq.finish_reason == "length" and stable[-1] == tok.decode(tokens)
    assert tok.decoded < 8 * n, tok.decoded  # the old full decode each step: ~n^2/2 = 80k
