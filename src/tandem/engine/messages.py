"""Typed messages between the engine core and model workers, in the `CONTROL` codec
(`tandem.wire.Codec`: msgpack, no pickle).

The core sends one `StepMessage` per model step to every rank; the sampling rank answers with a
`StepResult` (one row per sampled sequence, in step order). A step carries only what changed: new
tokens, newly taken KV blocks (the whole table only when it changed otherwise), KV block copies,
and sampling settings the first time a sequence is seen (rule: send the minimum each step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.wire import Codec

CONTROL = Codec("engine control")


@dataclass(slots=True)
class SeqParams:
    """What the sampling rank needs to know about a sequence, sent once."""

    temperature: float
    top_k: int  # <= 0: disabled
    top_p: float
    seed: int | None  # the sample's own stream (seed + sample index); None: engine's stream
    logprobs: int | None
    processed_logprobs: bool
    prompt_logprobs: int | None = None  # score the prompt: top-k alternatives per position
    num_prompt_tokens: int = 0  # positions below this are prompt (targets of prompt scoring)
    return_routed_experts: bool = False
    lora_slot: int = -1  # the LoRA slot its rows apply (`tandem.layers.lora`); -1: none


@dataclass(slots=True)
class SeqStep:
    seq_id: int
    start: int  # tokens of this sequence already in the KV cache
    token_ids: list[int]  # tokens to compute now (positions start, start+1, ...); may be empty
    blocks: list[int]  # the whole block table if replace_table, else blocks appended since
    params: SeqParams | None = None  # set the first time a rank sees this sequence
    replace_table: bool = True
    sample: bool = True  # sample a token from its last row (False: a prompt chunk mid-prefill)
    logits_from: int = -1  # >= 0: sample from that step's last row (a forked sample, no tokens)


@CONTROL.register("step")
@dataclass(slots=True)
class StepMessage:
    step_id: int
    seqs: list[SeqStep]
    released: list[int] = field(default_factory=list)  # finished sequences: drop their state
    copies: list[list[int]] = field(default_factory=list)  # [source, destination] KV blocks,
    # copied before the step runs (a shared block about to be written)


@CONTROL.register("shutdown")
@dataclass(slots=True)
class Shutdown:
    reason: str = "shutdown"


@CONTROL.register("control_address")
@dataclass(slots=True)
class ControlAddress:
    """Where workers started on other nodes find the engine's control server (a value in the
    engine's c10d store), and the dtype the engine resolved (they run it too)."""

    host: str
    port: int
    token: str
    dtype: str


@CONTROL.register("hello")
@dataclass(slots=True)
class Hello:
    """A worker's first frame on the control connection after the engine's token."""

    rank: int
    pid: int


@CONTROL.register("capacity")
@dataclass(slots=True)
class Capacity:
    """Reported once after loading: the KV blocks a rank can hold within the budget, and what it
    holds as canonical boxes (for weight-exchange plans)."""

    rank: int
    num_blocks: int
    layout: RankLayout


@CONTROL.register("start")
@dataclass(slots=True)
class Start:
    """The engine's answer to all capacities: the block count every rank allocates."""

    num_blocks: int


@CONTROL.register("failure")
@dataclass(slots=True)
class Failure:
    """A worker's last words before it exits on an error."""

    rank: int
    error: str


@CONTROL.register("result")
@dataclass(slots=True)
class StepResult:
    step_id: int
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # per sampled row, when a sequence asked (else None): top-k expert ids per MoE layer
    routed_experts: list[list[list[int]] | None] | None = None


@dataclass(slots=True)
class PromptLogprobs:
    """Scores of one sequence's prompt tokens computed in a step: ``logprobs[i]`` is the
    log-prob of the prompt token at position ``first + i`` given the tokens before it."""

    seq_id: int
    first: int
    logprobs: list[float]
    top_ids: list[list[int]]  # empty lists without alternatives
    top_logprobs: list[list[float]]


@CONTROL.register("encode")
@dataclass(slots=True)
class EncodeMessage:
    """Run whole sequences through the model (no KV cache, nothing sampled) and pool each:
    embeddings or a classifier's logits (``task``: ``embed`` | ``classify``)."""

    step_id: int
    seqs: list[list[int]]
    token_types: list[list[int]] | None  # per token, when the model has token types
    pooling: str  # cls | last | mean
    task: str
    pixels: list[list[float]] | None = None  # image models: each image flattened (seqs hold
    # one placeholder id per row it becomes)


@CONTROL.register("encoded")
@dataclass(slots=True)
class EncodeResult:
    step_id: int
    rows: list[list[float]]  # one per sequence: its pooled vector or logits


@CONTROL.register("score")
@dataclass(slots=True)
class ScoreMessage:
    """Run whole prompts through the model (no KV cache, nothing sampled) and return the
    next-token logits (or their ``log_softmax`` with ``logprobs``) at every position."""

    step_id: int
    seqs: list[list[int]]
    logprobs: bool


@CONTROL.register("scored")
@dataclass(slots=True)
class ScoreResult:
    """One piece of a `ScoreMessage`'s answer: rows ``first`` .. ``first + rows - 1`` of its
    sequences' positions laid end to end, each ``width`` (the vocabulary) little-endian float32
    values in ``data``, row after row. A large answer comes in several pieces, in
    order, each within `SCORE_FRAME_BYTES`."""

    step_id: int
    first: int
    rows: int
    width: int
    data: bytes


SCORE_FRAME_BYTES = 64 << 20  # the most row bytes one ScoreResult carries


@CONTROL.register("apply")
@dataclass(slots=True)
class ApplyWeights:
    """Between steps, one phase of a weight push on this rank (see
    `tandem.exchange.receiver.RankReceiver`): the push's settings and this rank's records."""

    phase: PushPhase
    update: UpdateSpec
    records: list[Record]  # this rank's boxes


@CONTROL.register("applied")
@dataclass(slots=True)
class ApplyResult:
    rank: int
    phase: PushPhase
    error: str | None  # None: done
    nbytes: int = 0


@CONTROL.register("kv_cache")
@dataclass(slots=True)
class KVCache:
    """Release (``allocate=False``, the engine sleeps) or re-allocate the KV cache."""

    allocate: bool


@CONTROL.register("kv_cache_done")
@dataclass(slots=True)
class KVCacheDone:
    rank: int
    allocate: bool


@CONTROL.register("release_weights")
@dataclass(slots=True)
class ReleaseWeights:
    """Free the parameters' memory (the engine sleeps at level 2)."""


@CONTROL.register("restore_weights")
@dataclass(slots=True)
class RestoreWeights:
    """Give the parameters memory again (zeroed) before a push writes them."""


@CONTROL.register("reload_weights")
@dataclass(slots=True)
class ReloadWeights:
    """Read every parameter from the checkpoint again."""


@CONTROL.register("weights_done")
@dataclass(slots=True)
class WeightsDone:
    rank: int
    error: str | None  # None: done


WeightMemoryMessage = ReleaseWeights | RestoreWeights | ReloadWeights

Message = (
    StepMessage
    | EncodeMessage
    | EncodeResult
    | ScoreMessage
    | ScoreResult
    | Shutdown
    | StepResult
    | Hello
    | Capacity
    | Start
    | Failure
    | ApplyWeights
    | ApplyResult
    | KVCache
    | KVCacheDone
    | WeightMemoryMessage
    | WeightsDone
)
