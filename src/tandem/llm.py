"""`LLM`: the offline entry point (vLLM-shaped)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tandem.config import EngineConfig
from tandem.engine.admission import RequestError
from tandem.engine.chat_template import NoChatTemplate
from tandem.engine.encode import unit_norm
from tandem.engine.engine import LLMEngine
from tandem.engine.executor import EngineDeadError
from tandem.engine.lora_registry import LoadedAdapter
from tandem.engine.outputs import RequestMetrics, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.tokenizer import Tokenizer
from tandem.fleet.fleet import VERSION_POLL_S, Fleet
from tandem.fleet.policy import Routed, request_load
from tandem.lora.request import LoRARequest

Prompt = str | list[int]


@dataclass(slots=True)
class _Request:
    """One prompt of a `generate` call: where it runs and its sequences there."""

    request_id: str
    text: str | None
    ids: list[int]
    params: SamplingParams
    priority: int
    lora_request: LoRARequest | None = None
    lora: LoadedAdapter | None = None  # the adapter version it runs with
    routed: Routed | None = None  # a fleet's: the replica it runs on
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def replica(self) -> int:
        return 0 if self.routed is None else self.routed.replica

    @property
    def load(self) -> int:
        """The tokens it may still cost, as a fleet's router counts them."""
        return request_load(len(self.ids), self.params.n, self.params.max_tokens or 0)


class LLM:
    """Generate from a local Hugging Face model directory.

    ``LLM(model, tensor_parallel_size=1, pipeline_parallel_size=1, dtype="auto",
    device="cpu", seed=0, max_model_len=None, max_num_seqs=256, kv_cache_memory=1 << 30, ...)``;
    see `tandem.config.EngineConfig` for every option. Usable as a context manager.

    One replica is one `LLMEngine`, stepped by the threads that call `generate`; with
    ``data_parallel_size`` > 1 the replicas are a `Fleet` (``llm.fleet``, else None).
    """

    def __init__(self, model: str, **options):
        config = EngineConfig(model=str(model), **options)
        self.fleet: Fleet | None = None
        self._engine: LLMEngine | None = None
        if config.parallel.data_parallel_size > 1:
            self.fleet = Fleet.local(config)
        else:
            self._engine = LLMEngine(config)
            self._load = 0  # the tokens `generate` calls still owe (`fleet_state`'s load)
            self._load_lock = threading.Lock()
            self._committed = threading.Condition()  # `wait_for_version`: a push ended
            self._engine.window.update_listeners.append(self._pushed)
        self._request_ids = itertools.count()  # one id per request, across threads

    @property
    def engine(self) -> LLMEngine | None:
        """The engine (with ``data_parallel_size`` > 1: replica 0's, whose config, model and
        tokenizer every replica shares); None once shut down."""
        return self.fleet.lead if self.fleet is not None else self._engine

    def _engines(self) -> list[LLMEngine]:
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down")
        return self.fleet.engines if self.fleet is not None else [self._engine]

    def _each(self, call: Callable[[LLMEngine], Any]) -> list:
        """``call(engine)`` on every replica (a fleet's at once)."""
        if self.fleet is not None:
            return self.fleet.each(call)
        return [call(engine) for engine in self._engines()]

    def _forget_prefixes(self) -> None:
        if self.fleet is not None:  # the router's view of the replicas' caches
            self.fleet.forget_prefixes()

    def _pushed(self, *_done) -> None:
        with self._committed:
            self._committed.notify_all()

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list:
        """``func(model)`` on the served model between steps (vLLM's ``apply_model``): one
        result per rank. For inspection and tooling in this process: the ranks must run in
        it (one replica, ``tensor_parallel_size=1``, ``pipeline_parallel_size=1``, the
        default backend); else `NotImplementedError`, as tandem sends no code to workers."""
        if self.fleet is not None:
            raise NotImplementedError(
                "apply_model needs one replica (data_parallel_size=1): "
                "a fleet's replicas run in worker processes"
            )
        return self._engines()[0].apply_model(func)

    def embed(
        self, inputs: Prompt | Seq[Prompt], normalize: bool = False, pooling: str | None = None
    ) -> list[list[float]]:
        """One vector per input (a string, or a list of token ids used as given): the last
        hidden state at the pooled position (``LLM(..., task="embed")``). Pooling defaults
        to the model's: BERT's [CLS] token (``cls``), a decoder's last token (``last``);
        ``mean`` averages the sequence. ``normalize`` scales each to unit L2 norm. Inputs of
        different lengths are batched without padding: results do not depend on the batch."""
        rows = self._encode(inputs, pooling, "embed")
        return [unit_norm(r) for r in rows] if normalize else rows

    def classify(self, inputs: Prompt | Seq[Prompt]) -> list[list[float]]:
        """The classification (or reward) head's raw logits per input (``LLM(...,
        task="classify")``): BERT's classifier over tanh(pooler([CLS])), a reward model's
        score of the sequence's last token."""
        return self._encode(inputs, None, "classify")

    def _encode(self, inputs, pooling: str | None, task: str) -> list[list[float]]:
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down")
        if self.engine.config.task != task:
            raise ValueError(
                f"{task} needs LLM(..., task={task!r}); this LLM's task is "
                f"{self.engine.config.task!r}"
            )
        if self.engine.spec.cls.inputs == "pixels":
            return self._encode_images(inputs, pooling)
        ids, types = self.engine.admission.tokenize_inputs(_as_prompt_list(inputs))
        return self.engine.encoder.encode(ids, types, pooling)

    def score(self, prompts: Prompt | Seq[Prompt], *, logprobs: bool = True) -> list[torch.Tensor]:
        """Each prompt's next-token distribution at every position, computed by the engine's
        ranks on the weights being served: one float32 tensor [len(prompt), vocab] per prompt
        (a string is tokenized as `generate` does; token ids are used as given), row ``i``
        the ``log_softmax`` of the logits after the prompt's first ``i + 1`` tokens (the raw
        logits with ``logprobs=False``). Prompts run whole between generation steps, packed
        into batches of at most ``max_num_batched_tokens`` tokens, without the KV cache:
        running requests go on undisturbed. With ``data_parallel_size`` > 1 one serving
        replica of the newest version scores. Task ``generate`` only; an empty prompt, one
        past ``max_model_len`` or ids outside the vocabulary raise `RequestError` (a
        ``ValueError``) on ``prompt``, naming which."""
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down")
        if self.engine.config.task != "generate":
            raise ValueError(
                "score needs LLM(..., task='generate'); this LLM's task is "
                f"{self.engine.config.task!r}"
            )
        engine = self._serving_engine()
        ids = [engine.admission.prompt_ids(p) for p in _as_prompt_list(prompts)]
        return engine.encoder.score(ids, logprobs)

    def _serving_engine(self) -> LLMEngine:
        """The engine of a replica that may take requests now, serving the newest version among
        them (waiting as `generate`'s routing does while a rolling push leaves none)."""
        fleet = self.fleet
        if fleet is None:
            return self.engine
        fleet.check()
        allowed = fleet.board.wait_allowed(fleet.timeout_s)
        return max((fleet.engines[r] for r in allowed), key=lambda e: e.weight_version)

    @property
    def dtype(self) -> str:
        """The dtype the engine runs in (``"bfloat16"``, ``"float32"``, ...): ``dtype="auto"``
        resolved at start-up (`tandem.engine.dtype_auto`; ``llm.engine.dtype_choice`` says
        why)."""
        return self.engine.config.dtype

    @property
    def weight_version(self) -> int:
        """The newest version served (a fleet's replicas all serve it after a push with
        ``policy="all"``; during a rolling push `fleet_state` says which serves what)."""
        if self.fleet is not None:
            return self.fleet.weight_version
        return self._engines()[0].weight_version

    @property
    def exchange_address(self) -> str:
        """Where trainer processes on this host push weights (``host:port/token``): pass it to
        `tandem.exchange.WeightSender`. With ``data_parallel_size`` > 1 one push there updates
        every replica. The exchange server starts on first use."""
        if self.fleet is not None:
            return self.fleet.exchange_server().address
        return self._engines()[0].target.exchange_server().address

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (vLLM's name): ``encode``, ``decode``,
        ``apply_chat_template``; None for a model without one (an image model)."""
        return self.engine.tokenizer

    def chat(
        self,
        messages: Seq[Mapping] | Seq[Seq[Mapping]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """`generate` on chats (vLLM's): ``messages`` is one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of them, each rendered with the model's chat
        template by the code ``tandem serve``'s ``/v1/chat/completions`` uses
        (`tandem.engine.chat_template`; ``chat_template`` names one of several templates or
        is template text), then encoded without adding special tokens (the template writes
        them). Raises ``ValueError`` (`NoChatTemplate`, `ChatTemplateError`) before anything
        runs."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise NoChatTemplate("this model has no tokenizer, so no chat template")
        conversations = list(messages)
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        if not conversations:
            raise ValueError("messages is empty")
        texts = [
            tokenizer.chat_template.render(
                c, add_generation_prompt, chat_template, **(chat_template_kwargs or {})
            )
            for c in conversations
        ]
        # the template writes the special tokens (BOS...): the tokenizer adds none, as in
        # transformers' apply_chat_template and vLLM
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(ids, sampling_params, lora_request=lora_request)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``priority`` (one int per prompt, lower first) matters with
        ``scheduling_policy="priority"``. ``lora_request`` (with ``enable_lora``): the LoRA
        adapter of every prompt, or one per prompt (None: the base model); one batch mixes
        them. An adapter the engine lacks is loaded from its ``lora_path`` (or tensors)
        first; each request runs with its adapter's latest version. All prompts are checked
        before any is queued: a bad one raises ``ValueError`` (`LoRAError` for an adapter)
        and nothing runs.
        """
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts"
            )
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        requests: list[_Request] = []
        pinned: dict[str, LoadedAdapter] = {}
        try:
            for lora in loras:  # every adapter pinned first: none evicts another of the call
                if lora is not None and lora.lora_name not in pinned:
                    pinned[lora.lora_name] = self.engine.adapters.pin(lora)
            for i, (prompt, params, prio, lora) in enumerate(
                zip(prompts, sampling_params, priority, loras, strict=True)
            ):
                request_id = str(next(self._request_ids))
                ids = self.engine.admission.prompt_ids(prompt)
                text = prompt if isinstance(prompt, str) else None
                adapter = None if lora is None else pinned[lora.lora_name]
                requests.append(_Request(request_id, text, ids, params, prio, lora, adapter))
                try:
                    self._place(requests[-1])
                except RequestError as exc:  # named by its place in the caller's list
                    raise exc.at(f"prompt {i}") from None
            if self.fleet is None:
                self._run_alone(requests)
            else:
                self._run_on_fleet(requests)
        finally:
            for req in requests:
                if req.routed is not None:
                    self.fleet.finished(req.routed)
            for adapter in pinned.values():
                self.engine.adapters.unpin(adapter)
        outputs = []
        for req in requests:
            out = self._output(req.request_id, req.text, req.ids, req.seqs, req.replica)
            if req.lora is not None:
                out.lora_request, out.lora_version = req.lora_request, req.lora.version
            outputs.append(out)
        return outputs

    def _run_alone(self, requests: list[_Request]) -> None:
        """Queue every request's sequences on the one engine and step until they finish."""
        engine = self._engine
        seqs = [seq for req in requests for seq in req.seqs]
        load = sum(req.load for req in requests)
        with self._load_lock:
            self._load += load
        try:
            engine.controls.lifecycle.check_runnable()  # asleep, torn: queue none
            engine.add(seqs)
            try:
                engine.run(seqs)
            except BaseException:  # nothing of them is left queued for another caller's steps
                engine.abort([seq for seq in seqs if not seq.finished])
                raise
        finally:
            with self._load_lock:
                self._load -= load

    def _run_on_fleet(self, requests: list[_Request]) -> None:
        """Run the routed requests on their replicas; a replica that dies meanwhile: what it
        had not finished runs again on another (nothing of it was returned yet)."""
        fleet = self.fleet
        pending = requests
        while pending:
            for r in sorted({req.replica for req in pending}):
                fleet.engines[r].controls.lifecycle.check_runnable()  # asleep, torn: queue none
            work: dict[int, list[Sequence]] = {}
            for req in pending:
                fleet.engines[req.replica].add(req.seqs)
                work.setdefault(req.replica, []).extend(req.seqs)
            lost = _step_replicas(fleet, work)
            pending = [
                req
                for req in pending
                if req.replica in lost and not all(s.finished for s in req.seqs)
            ]
            for req in pending:
                self._place(req, lost=lost[req.replica])

    def _place(self, req: _Request, lost: str | None = None) -> None:
        """Make ``req``'s sequences on its engine (a fleet: routed; again, elsewhere, after
        its replica was ``lost``)."""
        engine = self._engine
        if self.fleet is not None:
            params, fleet = req.params, self.fleet
            if lost is None:
                req.routed = fleet.route(req.ids, params.n, params.max_tokens or 0)
            else:
                routed, req.routed = req.routed, None  # released by rerun
                req.routed = fleet.rerun(routed, lost, req.ids, params.n, params.max_tokens or 0)
            engine = fleet.engines[req.routed.replica]
        req.seqs = engine.admission.make_sequences(
            req.request_id, req.ids, req.params, req.priority
        )
        if req.lora is not None:
            for seq in req.seqs:
                seq.lora_slot, seq.lora_key = req.lora.slot, req.lora.key

    def _encode_images(self, images, pooling: str | None) -> list[list[float]]:
        """Image models: each input a float tensor [channels, size, size] (HF pixel_values)."""
        spec = self.engine.spec
        images = [images] if isinstance(images, torch.Tensor) else list(images)
        shape = spec.cls.image_shape(spec.config)
        for i, image in enumerate(images):
            if not isinstance(image, torch.Tensor) or tuple(image.shape) != shape:
                got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image)
                raise ValueError(
                    f"input {i}: an image tensor of shape {shape} is needed, got {got}"
                )
        rows = [[0] * spec.config.rows_per_image for _ in images]
        pixels = [image.detach().float().flatten().tolist() for image in images]
        return self.engine.encoder.encode(rows, None, pooling, pixels)

    def _output(
        self, request_id, prompt, prompt_ids, seqs: list[Sequence], replica: int
    ) -> RequestOutput:
        engine = self._engines()[replica]
        completions = [s.output(engine.outputs.text(s)) for s in seqs]
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        metrics = RequestMetrics(
            arrival_time=min(s.arrival for s in seqs),
            first_token_time=min(firsts) if firsts else None,
            finished_time=max(s.finished_time for s in seqs),
        )
        versions = sorted(set().union(*(s.weight_versions for s in seqs)))
        out = RequestOutput(
            request_id,
            prompt,
            prompt_ids,
            completions,
            True,
            versions[-1] if versions else engine.weight_version,
            metrics,
            versions,
            replica=replica,
        )
        k = seqs[0].params.prompt_logprobs
        if k is not None:  # the sample that computed the prompt holds its scores
            scored = max(seqs, key=lambda s: len(s.prompt_logprobs))
            out.prompt_logprobs = list(scored.prompt_logprobs)
            out.prompt_top_logprobs = list(scored.prompt_top_logprobs) if k else None
        return out

    def pause(self, mode: str = "abort") -> None:
        """Stop generating until `resume` (from another thread while `generate` runs):
        ``abort`` ends every request now with finish_reason ``abort`` and what it generated so
        far (``generate`` returns them); ``wait`` lets running sequences finish and admits none;
        ``keep`` freezes them with their KV cache in place. A ``generate`` called while paused
        waits for `resume`. Weight pushes land while paused. Every replica of a fleet."""
        self._each(lambda engine: engine.controls.pause(mode))

    def resume(self) -> None:
        self._each(lambda engine: engine.controls.resume())

    def abort(self, request_ids: list[str] | None = None) -> None:
        """End these requests (None: all) now, with what they generated so far; their
        ``generate`` call returns them with finish_reason ``abort``."""
        self._each(lambda engine: engine.controls.abort_requests(request_ids))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (a weight push does this itself)."""
        self._each(lambda engine: engine.reset_prefix_cache())
        self._forget_prefixes()

    def sleep(self, level: int = 1) -> None:
        """Release memory on every rank (a colocated trainer may use it): level 1 the KV
        cache, level 2 the weights too. `generate` raises `EngineAsleepError` until `wake`;
        after level 2 it raises `WeightsReleasedError` until a push lands or
        `reload_weights`."""
        self._each(lambda engine: engine.controls.sleep(level))
        self._forget_prefixes()

    def wake(self) -> None:
        """Re-allocate what `sleep` released."""
        self._each(lambda engine: engine.controls.wake())

    def reload_weights(self) -> None:
        """Read the weights from the model directory again (version 0)."""
        if self.fleet is None:
            self._engine.controls.reload_weights()
            return
        with self.fleet.holding_pushes():  # no replica seen behind the others meanwhile
            self.fleet.each(lambda engine: engine.controls.reload_weights())
        self.fleet.forget_prefixes()

    def worker_locations(self) -> list[dict]:
        """Where each engine rank runs: ``[{replica, rank, node_id, pid}]`` (node_id: the Ray
        node id with the ray backend, else the host name)."""
        if self.fleet is not None:
            return self.fleet.worker_locations()
        return [{**loc, "replica": 0} for loc in self._engines()[0].worker_locations()]

    def fleet_state(self) -> list[dict]:
        """Each replica: ``{"replica", "state", "version", "load"}`` (state ``serving``,
        ``updating``, ``quarantined`` (with its ``reason``) or ``joining``; version: the one
        it has committed; load: the tokens it still owes to routed requests; while a rolling
        push rolls out, ``rolling_to``: its version, on the replicas yet to commit it)."""
        if self.fleet is not None:
            return self.fleet.fleet_state()
        engine = self._engines()[0]
        with self._load_lock:
            load = self._load
        state = "updating" if engine.controls.lifecycle.updating else "serving"
        return [{"replica": 0, "state": state, "version": engine.weight_version, "load": load}]

    def wait_for_version(self, version: int, timeout: float | None = None) -> None:
        """Return once every serving replica (a single engine: it) serves ``version`` or a
        newer one: a rolling push's last wave has committed (a replica in its wave counts as
        serving; one quarantined or joining does not: it heals to the newest version).
        `TimeoutError` past ``timeout`` seconds, naming each replica's state and version."""
        if self.fleet is not None:
            return self.fleet.wait_for_version(version, timeout)
        engine = self._engines()[0]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._committed:  # the exchange server's listeners notify it after a push
            while engine.weight_version < version:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"the engine serves version {engine.weight_version}, "
                        f"not {version}, after {timeout:g} s"
                    )
                # and looks again now and then: a version may come by another way
                self._committed.wait(VERSION_POLL_S if left is None else min(left, VERSION_POLL_S))

    def add_replica(self) -> int:
        """Grow the fleet by one replica (``data_parallel_size`` >= 2): it starts reading
        nothing from disk, pulls the weights from a live peer (planned and verified like any
        push), and only then takes requests. Its number."""
        if self.fleet is None:
            raise ValueError(
                "add_replica needs a fleet: start the LLM with data_parallel_size >= 2"
            )
        return self.fleet.add_replica()

    def heal(self, replica: int) -> None:
        """Bring a quarantined replica back now (restarted if its workers are gone, then
        filled from a live peer); a fleet does this itself unless ``heal=False``."""
        if self.fleet is None:
            raise ValueError(
                "a single engine has no peer to heal from: heal needs data_parallel_size >= 2"
            )
        self.fleet.heal(replica)

    def shutdown(self) -> None:
        """Stop the workers (if any) and release the model and KV cache. Idempotent."""
        if self.fleet is not None:
            self.fleet.shutdown()
            self.fleet = None
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, str | list | tuple):
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p)}")
    return prompts


def _per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    """``generate``'s ``lora_request`` as one entry per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora_requests for {count} prompts")
    for i, lora in enumerate(loras):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise TypeError(f"lora_request[{i}]: a LoRARequest or None, got {type(lora).__name__}")
    return loras


def _step_replicas(fleet: Fleet, work: dict[int, list[Sequence]]) -> dict[int, str]:
    """Step each replica until its sequences in ``work`` (replica -> sequences, queued there)
    are finished: the first in this thread, the others each on a thread of its own. A replica
    that dies meanwhile is held out (`Fleet.hold_out`) and its unfinished sequences left to run
    elsewhere (`Fleet.rerun`): the replicas lost -> why. Any other error (or the death of a
    fleet's only replica) is raised once every replica stopped."""
    items = [(r, seqs) for r, seqs in sorted(work.items()) if seqs]
    errors: list[BaseException] = []
    lost: dict[int, str] = {}

    def drive(r: int, seqs: list[Sequence]) -> None:
        try:
            fleet.engines[r].run(seqs)  # other callers' steps run beside
        except EngineDeadError as exc:
            if len(fleet) == 1:
                errors.append(exc)
                return
            lost[r] = str(exc)
            fleet.hold_out(r, str(exc))
        except BaseException as exc:
            errors.append(exc)
            for other, mine in work.items():  # the caller gets its error now, not after all
                fleet.engines[other].abort([s for s in mine if not s.finished])

    threads = [
        threading.Thread(target=drive, args=item, name=f"tandem-replica-{item[0]}", daemon=True)
        for item in items[1:]
    ]
    for t in threads:
        t.start()
    if items:
        drive(*items[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return lost
