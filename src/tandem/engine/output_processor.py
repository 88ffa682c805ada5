"""Output text and stop rules, one sampled token at a time, in O(new tokens) decode work.

`IncrementalDetokenizer` keeps one sequence's output text current without decoding the whole
output each step. It decodes only a short window of tokens, in the style of vLLM's prefix/read
offsets:

* ``ids[_read:]`` are the tokens whose text is not yet final. ``ids[_prefix:_read]`` is the token
  (or the few tokens) just before them, decoded with them as context. Decoding
  ``ids[_prefix:]`` and dropping the first ``_prefix_len`` characters (the text of
  ``ids[_prefix:_read]`` on its own) leaves the text of the new tokens as it reads in the full
  output. The context token matters: a Metaspace/Strip decoder drops the leading space of the
  *first* token it decodes and a WordPiece decoder joins ``##`` pieces to the token before.
* A window whose text ends in U+FFFD stops at a partial UTF-8 character (a byte-level BPE token
  or a ``<0xNN>`` byte token may hold only part of one). Its text up to that character is
  appended (it cannot change), the character itself is held back until a later token
  completes it, and the offsets stay put. Otherwise the offsets advance: ``_prefix`` to the
  old ``_read`` and ``_read`` to the end.

The detokenizer only appends, so a stream can send its text as it comes (the one exception is
the final full decode below, which for local decoders only adds a held-back tail).

Exactness. For decoders that render each token on its own, given the token before it
(`_decoder_is_local`: ByteLevel, Metaspace, WordPiece, single-character Replace, ByteFallback,
Fuse, a leading Strip of at most one character, and sequences of these), the text equals
``tokenizer.decode(output_ids, skip_special_tokens)`` after every token whose full decode does
not end in U+FFFD. When it cannot guarantee that, the sequence's first `finish` does ONE full
decode of the output and takes it as the final text: for other decoders (CTC, BPEDecoder, a
trailing Strip, ...), and whenever a U+FFFD appeared (a partial character still held back at
the end, or invalid UTF-8, which a ByteFallback decoder renders differently by context: it turns
a whole run of byte tokens into U+FFFDs when any of them is invalid). That decode costs what a
single step of the old decode-everything-each-step approach cost, once per sequence.

`OutputProcessor` drives the detokenizers and applies the stop rules (EOS, stop token ids, stop
strings, length) after each sampled token. State lives on the sequence: ``seq.detok`` (made on
its first token) and ``seq.text``, which keeps its meaning: set exactly when a stop string cut
the output, to the cut text.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from collections.abc import Sequence as Ids
from typing import TYPE_CHECKING

from tandem.engine.sequence import Sequence

if TYPE_CHECKING:
    from tandem.engine.messages import StepResult

_PARTIAL = "\ufffd"  # what the decoders make of an incomplete (or invalid) UTF-8 sequence

# Decoders that map each token to text on its own, knowing at most whether it is the first one.
_LOCAL_DECODERS = {"ByteLevel", "Metaspace", "WordPiece", "ByteFallback", "Fuse"}


def _decoder_is_local(config: dict | None) -> bool:
    """Whether a decoder (its ``tokenizer.json`` entry) renders a window as the full decode does."""
    if config is None:  # no decoder: the tokens joined with spaces
        return True
    kind = config.get("type")
    if kind == "Sequence":
        return all(_decoder_is_local(d) for d in config.get("decoders", []))
    if kind == "Strip":  # cuts the start of the first token only; a cut end moves with the window
        return config.get("start", 0) <= 1 and config.get("stop", 0) == 0
    if kind == "Replace":  # after Fuse a longer pattern could match across token boundaries
        pattern = config.get("pattern", {})
        return isinstance(pattern.get("String"), str) and len(pattern["String"]) == 1
    return kind in _LOCAL_DECODERS


def decoder_is_local(tokenizer) -> bool:
    """Whether `IncrementalDetokenizer` can track ``tokenizer``'s full decode token by token."""
    config = getattr(tokenizer, "decoder_config", None)
    if config is None:  # a tokenizer that cannot say: do the final full decode
        return False
    return _decoder_is_local(config())


class IncrementalDetokenizer:
    """The output text of one sequence, extended by each new token.

    ``ids`` passed to `update` and `finish` are all the sequence's tokens (prompt included);
    the output starts at ``start``. ``text`` never ends in a partial character; ``finished``
    says `finish` has run (``text`` is then final).
    """

    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        start: int = 0,
        local: bool | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.start = start
        self.text = ""
        self.finished = False
        # The text can be off from the full decode (see the module docstring): decode in full
        # once at finish. Starts False only for a decoder known to be local.
        self._inexact = not (decoder_is_local(tokenizer) if local is None else local)
        self._prefix = start  # ids[_prefix:_read]: context decoded with the new tokens
        self._read = start  # ids[_read:]: tokens whose text may still change
        self._prefix_len = 0  # len(decode(ids[_prefix:_read]))
        self._held = ""  # text of ids[_read:] already in self.text (before a partial character)
        self._seen = start  # len(ids) at the last update

    def _decode(self, ids: Ids[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def update(self, ids: Ids[int]) -> str:
        """Take the tokens appended to ``ids`` since the last call; return the text added."""
        if self.finished:
            raise RuntimeError("update() after finish()")
        window = self._decode(ids[self._prefix :])
        new = window[self._prefix_len :]
        complete = len(window) > self._prefix_len and not window.endswith(_PARTIAL)
        if _PARTIAL in window:
            self._inexact = True
        if not complete:
            new = new.rstrip(_PARTIAL)
        if not new.startswith(self._held):  # not a local decoder after all
            self._inexact = True
        added = new[len(self._held) :]
        self.text += added
        self._seen = len(ids)
        if complete:
            self._prefix, self._read = self._read, len(ids)
            self._prefix_len = len(self._decode(ids[self._prefix : self._read]))
            self._held = ""
        else:
            self._held += added
        return added

    def finish(self, ids: Ids[int]) -> str:
        """Make ``text`` final (the full decode of the output); return it. Idempotent."""
        if not self.finished:
            self.finished = True
            if self._inexact or len(ids) != self._seen:
                # The one full decode: a held-back partial character, invalid UTF-8 or a
                # decoder that is not local means the appended text may not be the full decode
                # (nor is it when tokens came without an update).
                self.text = self._decode(ids[self.start :])
        return self.text


class OutputProcessor:
    """What each step produced, onto the engine's sequences: tokens, log-probs, routed experts
    and weight versions (`record_step`), then output text and stop rules (`process`, once per
    sampled token, O(new tokens) decode work). `text` is the output so far, `stable_text` the
    part of it a stream may send now.
    """

    def __init__(self, tokenizer, eos_token_ids: Iterable[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._local = decoder_is_local(tokenizer)

    def _detok(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.detok is None:
            seq.detok = IncrementalDetokenizer(
                self.tokenizer, seq.params.skip_special_tokens, seq.num_prompt_tokens, self._local
            )
        return seq.detok

    def record_step(
        self, seqs: list[Sequence], samples: list[bool], out: StepResult, version: int
    ) -> None:
        """One finished step's results onto its sequences (``samples``: whether each one's
        last row was sampled; ``out`` has one row per sampled sequence, in step order);
        ``version`` is the weight version the step ran under."""
        now = time.monotonic()
        if out.prompt_logprobs:
            by_id = {seq.seq_id: seq for seq in seqs}
            for p in out.prompt_logprobs:
                by_id[p.seq_id].record_prompt_logprobs(
                    p.first, p.logprobs, p.top_ids, p.top_logprobs
                )
        rows = itertools.count()
        for seq, sampled in zip(seqs, samples, strict=True):
            if not sampled:  # a prompt chunk: nothing to sample yet
                continue
            row = next(rows)
            if seq.finished:  # aborted while its step was in flight
                continue
            if seq.max_tokens == 0:  # the prompt was only scored
                seq.finish("length")
                continue
            token = out.token_ids[row]
            seq.token_ids.append(token)
            if seq.params.return_routed_experts:
                seq.routed_experts.append(out.routed_experts[row])
            seq.record_version(version)
            if seq.first_token_time is None:
                seq.first_token_time = now
            k = seq.params.logprobs
            if k is not None:
                seq.logprobs.append(out.logprobs[row])
                if k > 0:
                    top = zip(out.top_ids[row][:k], out.top_logprobs[row][:k], strict=True)
                    seq.top_logprobs.append(dict(top))
            self.process(seq, token)

    def process(self, seq: Sequence, token: int) -> None:
        """Advance ``seq``'s text by its newest token ``token`` and finish it if a rule says so."""
        params = seq.params
        if params.detokenize:
            detok = self._detok(seq)
            before = len(detok.text)
            added = detok.update(seq.token_ids)
        if not params.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop")
        if token in params.stop_token_ids:
            return self._finish(seq, "stop", token)
        if params.stop and added:
            # A stop string not found before ends in the new text: it starts at most
            # len(longest stop) - 1 characters before it.
            start = max(0, before - max(map(len, params.stop)) + 1)
            found = _earliest_stop(detok.text, params.stop, start)
            if found is not None:
                seq.text = _cut(detok.text, found, params.include_stop_str_in_output)
                return self._finish(seq, "stop", found[1])
        if seq.num_output_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish(reason, stop_reason)
        self._finalize(seq)

    def _finalize(self, seq: Sequence) -> None:
        """Make a finished sequence's text final (once; also for one finished elsewhere)."""
        if (seq.detok is None and not seq.num_output_tokens) or not seq.params.detokenize:
            return
        detok = self._detok(seq)
        if detok.finished:
            return
        shown = detok.text
        final = detok.finish(seq.token_ids)
        if seq.text is not None and not final.startswith(shown):
            # A stop string cut text that the full decode renders otherwise (only for decoders
            # that are not local, or invalid UTF-8): cut the full decode at its earliest stop.
            found = _earliest_stop(final, seq.params.stop, 0)
            include = seq.params.include_stop_str_in_output
            seq.text = final if found is None else _cut(final, found, include)

    def text(self, seq: Sequence) -> str:
        """The output text so far: the stop-cut text once cut, the full decode once finished."""
        if seq.finished:
            self._finalize(seq)
        if seq.text is not None:
            return seq.text
        return "" if seq.detok is None else seq.detok.text

    def stable_text(self, seq: Sequence) -> str:
        """The part of `text` that will not change: what a stream may send now.

        While the sequence runs this holds back the longest end of the text that starts a stop
        string (partial characters are already held back); once finished it is all of `text`.
        Each call's result is a prefix of every later one (but see the module docstring for a
        non-local decoder or invalid UTF-8, where the final full decode may differ).
        """
        text = self.text(seq)
        if seq.finished or not seq.params.stop:
            return text
        return text[: len(text) - _stop_prefix_len(text, seq.params.stop)]


def _earliest_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """(index, stop) of the earliest stop string in ``text[start:]`` (ties: the smallest)."""
    found = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None


def _cut(text: str, found: tuple[int, str], include_stop: bool) -> str:
    idx, stop = found
    return text[: idx + (len(stop) if include_stop else 0)]


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """The length of the longest end of ``text`` that is the start of a stop string."""
    for k in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
