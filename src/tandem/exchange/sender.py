"""The trainer side: `WeightSender(model, target).push(version)`, on every trainer rank.

Each rank tells the engine which canonical boxes it holds and how it pushes (`PushSettings`);
the engine plans (once, cached) and answers with the boxes this rank must send (`SendItem`s);
the rank's transport sender half delivers exactly those, converted to the engine's dtype, with
the CRC32 of each as read from the trainer's tensor; the engine's ranks checksum what landed
and reject the push on any mismatch.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tandem.errors import LoRAError, StaleVersionError
from tandem.exchange import collector
from tandem.exchange.adapters.dtensor import dtensor_layout
from tandem.exchange.adapters.experts import regroup_hf_experts
from tandem.exchange.adapters.hf import local_tensor, named_tensors
from tandem.exchange.adapters.megatron import is_megatron_module, megatron_module_layout
from tandem.exchange.delta import AUTO_MAX_FRACTION, AUTO_RETRY_AFTER, PAYLOAD_KEY, Shadow
from tandem.exchange.discovery import target_address
from tandem.exchange.layout import RankLayout
from tandem.exchange.protocol import (
    PUSH,
    PushDone,
    PushEncoded,
    PushHello,
    PushPlan,
    PushReady,
    ReplicaPush,
)
from tandem.exchange.quantize import FP8_NAME, agree_scales, quantized_items
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.rollout import Rollout, RolloutResult
from tandem.exchange.server import target_here
from tandem.exchange.settings import AdapterPush, PushSettings
from tandem.exchange.transports import TRANSPORTS, check, p2p, pushed
from tandem.exchange.transports.base import Delivery
from tandem.lora.checkpoint import canonical_tensors, is_peft_model, peft_adapter
from tandem.lora.config import AdapterConfig
from tandem.wire import PeerGone, recv_frame, send_frame, send_token

LAYOUTS = ("auto", "megatron", "hf")


@dataclass(frozen=True, slots=True)
class PushStats:
    version: int
    bytes_sent: int  # by this rank
    bytes_needed: int  # what all engine ranks hold, in the engine's dtype
    bytes_moved: int  # by all trainer ranks together, as their transports counted
    seconds: float
    transport: str
    bytes_by_receiver: tuple[int, ...] = ()  # sent by this rank, per engine rank (counted)
    # per replica of a fleet (a single engine: one): needed, arrived, relayed on, seconds,
    # and how it came out (committed, held for its rolling wave, or failed and why)
    replicas: tuple[ReplicaPush, ...] = ()
    # by this rank, into staging, where the transport reads the rest in place (mooncake)
    bytes_staged: int | None = None
    # a rolling push answered before its waves committed: their report (see `wait`)
    rollout: Rollout | None = field(default=None, compare=False, repr=False)
    delta: bool = False  # only the changed elements were sent (`tandem.exchange.delta`)
    why_dense: str | None = None  # asked for a delta ("auto" or True), sent dense: why
    # where this rank encoded its boxes against its shadow: the fraction of their elements
    # that changed, and the seconds encoding took (inside ``seconds``)
    density: float | None = None
    encode_seconds: float = 0.0

    @property
    def failed(self) -> dict[int, str]:
        """The replicas that left the push (quarantined) and why, as the push was answered
        (a rolling push's waves may lose more: see `wait`)."""
        return {r.replica: r.error or "" for r in self.replicas if r.state == "failed"}

    @property
    def rolling(self) -> bool:
        """Whether the push is still rolling out (its waves committing replica by replica)."""
        return self.rollout is not None and not self.rollout.done

    def wait(self, timeout: float | None = None) -> RolloutResult:
        """Until the push has ended on every replica (a rolling push: its last wave; any
        other push: already): which replicas committed and which were lost and why
        (`RolloutResult`). `TimeoutError` past ``timeout`` seconds (the rollout goes on);
        `WeightSyncError` if a rollout committed nowhere or the engine was lost."""
        if self.rollout is None:
            return RolloutResult(self.version, self.replicas)
        return self.rollout.wait(timeout)


class WeightSender:
    """Push a trainer model's weights into a tandem engine, in place.

    ``model``: an ``nn.Module`` (or state dict) whose names are the Hugging Face names, plain or
    FSDP2/DTensor-sharded. ``target``: an `LLM`, its ``llm.exchange_address``, the URL of a
    `tandem serve` (``http://host:port`` or ``host:port``, with ``admin_key`` or
    ``$TANDEM_ADMIN_KEY``), or a vLLM ``LLM`` made with tandem's worker extension
    (`tandem.integrations.vllm`; its pushes are staged). With a
    multi-rank trainer every rank calls `push` (rank and world default to the torch.distributed
    default group's). ``verify``: every box's CRC32 is taken from the trainer's tensor as it is
    read, and every engine rank checksums the box where it landed (the staging memory, and the
    live parameter after a staged commit, or the live parameter in place); any mismatch
    rejects the push. ``ignore`` names trainer tensors the engine does not have (a value head).

    LoRA (``lora_name``, or any PEFT model): only the adapter's tensors are sent (A and B of
    the PEFT model's active adapter, plain or FSDP2-sharded; or a state dict of them with
    ``lora_config``, PEFT's config), into the engine's slot for adapter ``lora_name``
    (default: the PEFT adapter's name), where requests naming it (`LoRARequest`) find the
    latest version pushed; ``keep_versions`` of its latest versions stay loaded, so requests
    started on one finish on it. Adapter pushes are staged.

    ``layout``: how to read the model's boxes. ``megatron``: a megatron-core ``GPTModel``
    (wrapped in DDP / Float16Module or not; TP and PP from ``megatron.core.parallel_state``,
    names mapped by the declarative table `GPT_TO_LLAMA`; ``vocab_size`` is the real vocabulary
    when the model's is padded). ``hf``: Hugging Face names, plain or FSDP2/DTensor-sharded.
    ``auto`` (default): ``megatron`` for a megatron-core module, else ``hf``.

    ``transport`` (`tandem.exchange.transports.TRANSPORTS`): ``shm`` (same host: each rank
    stages its boxes in shared memory the engine ranks map — a memfd, kept for later pushes
    until `close`) or ``dist`` (torch.distributed point-to-point in a group of trainer and
    engine ranks; works across hosts) or ``cuda_ipc`` (same node, CUDA, staged only: the engine
    maps each rank's CUDA staging buffer); ``auto`` picks ``cuda_ipc`` for a model on a GPU,
    else ``shm``. ``mode``: ``staged`` stages the push (shm: in the trainer's shared memory;
    dist: in engine memory) and commits only a complete, verified push (the old version serves
    on failure); ``in_place`` writes straight into the live parameters (shm: the trainer rank
    copies each box into the engine's shared parameters, one copy; dist: the engine receives
    into them), with no extra memory, and a broken push makes the engine refuse requests until
    a complete push lands."""

    def __init__(
        self,
        model: nn.Module,
        target,
        *,
        transport: str = "auto",
        mode: str = "staged",
        verify: bool = True,
        ignore: tuple[str, ...] = (),
        rank: int | None = None,
        world_size: int | None = None,
        timeout_s: float = 600.0,
        admin_key: str | None = None,
        layout: str = "auto",
        vocab_size: int | None = None,
        lora_name: str | None = None,
        keep_versions: int = 1,
        lora_config=None,
    ):
        self.adapter: AdapterPush | None = None
        if lora_name is not None or lora_config is not None or is_peft_model(model):
            self.adapter = _adapter_push(model, lora_name, keep_versions, lora_config)
            layout = "hf"
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "auto":
            layout = "megatron" if is_megatron_module(model) else "hf"
        self.layout = layout
        self.vocab_size = vocab_size
        if transport != "auto" and transport not in pushed():
            raise ValueError(f"transport must be 'auto' or one of {pushed()}, got {transport!r}")
        self._address = target_address(target, admin_key)
        self.model = model
        self._lora_config = lora_config
        if transport == "auto":
            on_gpu = any(local_tensor(t).is_cuda for _, t in named_tensors(model))
            # CUDA IPC cannot map a buffer in the process that made it
            here = target_here(self._address)
            in_process = here is not None and here.receivers_in_process
            transport = "cuda_ipc" if on_gpu and not in_process else "shm"
        self.settings = check(PushSettings(transport, mode, verify, adapter=self.adapter))
        self.ignore = list(ignore)
        default = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if default else 0)
        self.world_size = world_size or (dist.get_world_size() if default else 1)
        self.timeout_s = timeout_s
        device = next(
            (local_tensor(t).device for _, t in named_tensors(model)), torch.device("cpu")
        )
        self._half = TRANSPORTS[transport].sender(self.settings, device, self.rank)
        # a delta push's payloads are staged whatever the mode (`tandem.exchange.delta`)
        staged = dataclasses.replace(self.settings, mode="staged")
        self._payload_half = (
            TRANSPORTS[transport].sender(staged, device, self.rank)
            if self.settings.in_place
            else self._half
        )
        self.shadow = Shadow()  # what this rank last pushed, for deltas
        self._payloads = torch.empty(0, dtype=torch.uint8, device=device)
        self._dense_for = 0  # "auto": pushes left before a delta is tried again

    @property
    def transport(self) -> str:
        return self.settings.transport

    @collector.held
    def push(
        self,
        version: int | None = None,
        policy: str = "all",
        max_unavailable: int = 1,
        wave: str = "wait",
        *,
        rollback: bool = False,
        delta: bool | str = "auto",
    ) -> PushStats:
        """Send this rank's boxes and wait until the engine committed (or rejected) them.

        ``version``: what the target serves once it commits; None: the version it serves + 1
        (a LoRA adapter: its latest + 1, else 1). Versions only go forward: a version not
        greater than the one served (a fleet: the newest any replica holds; an adapter: its
        latest) is refused before any byte moves, on every trainer rank, with
        `tandem.errors.StaleVersionError` naming both, and the target keeps serving its
        weights. ``rollback=True`` (every rank alike) takes such a version on purpose: the
        weights pushed serve under it from then on (a fleet: on every replica it reaches).

        A fleet (``data_parallel_size`` > 1, or `tandem router`): ``policy="all"`` commits
        every replica together; ``"rolling"`` returns once every replica verified and holds
        the new version, and the replicas then commit it in waves of at most
        ``max_unavailable`` while the others serve (``wave="wait"``: a wave's requests finish
        first; ``"keep"``: they go on across the commit). A replica that fails is quarantined
        and the others go on: ``PushStats.replicas`` says how each came out.

        Python's garbage collector is held off while the push runs
        (`tandem.exchange.collector`)."""
        start = time.perf_counter()
        settings = check(
            dataclasses.replace(
                self.settings, policy=policy, max_unavailable=max_unavailable, wave=wave
            )
        )
        layout, tensors = self._local()
        if not isinstance(rollback, bool):
            raise ValueError(f"rollback must be a bool, got {rollback!r}")
        if not (delta is True or delta is False or delta == "auto"):
            raise ValueError(f"delta must be True, False or 'auto', got {delta!r}")
        mode = {True: "on", False: "off"}.get(delta, "auto")
        if mode == "auto" and not TRANSPORTS[self.transport].delta_pays:
            mode = "off"  # bytes move at memory speed: a delta costs what it saves
        elif mode == "auto" and self._dense_for > 0:  # a recent delta did not pay
            self._dense_for -= 1
            mode = "off" if self._dense_for > 0 else mode  # the last reads the shadow again
        base = self.shadow.base if mode != "off" else None
        hello = PushHello(
            self.rank,
            self.world_size,
            version,
            layout,
            self.ignore,
            settings,
            rollback,
            mode,
            base,
            self._copy_of(),
        )
        sent = None  # (the items and tensors of the push in its dense form, as quantized)
        density, encode_seconds = None, 0.0  # where this rank encoded its boxes
        delivery = None  # what it holds stays alive until the engine has answered
        endpoint = (self._address.host, self._address.port)
        rollout = None  # a rolling push: the connection then reports its rollout
        sock = socket.create_connection(endpoint, timeout=self.timeout_s)
        try:
            try:
                send_token(sock, self._address.token)
                send_frame(sock, PUSH.encode(hello))
                reply = PUSH.decode(recv_frame(sock))
                if isinstance(reply, PushPlan) and reply.encode:  # a delta's first round
                    sent = self._quantized(reply, layout, tensors)
                    start_encode = time.perf_counter()
                    encoded, density = self._encode(*sent, mode)
                    encode_seconds = time.perf_counter() - start_encode
                    send_frame(sock, PUSH.encode(encoded))
                    reply = PUSH.decode(recv_frame(sock))
                if isinstance(reply, PushPlan):
                    try:
                        if sent is None:
                            sent = self._quantized(reply, layout, tensors)
                        delivery = self._deliver(reply, *sent)
                    except p2p.GroupBroken as exc:  # a peer died or left the push's group
                        raise WeightSyncError(self._why_broken(sock, exc)) from None
                    ready = PushReady(delivery.crcs, delivery.bytes_moved, delivery.staging)
                    send_frame(sock, PUSH.encode(ready))
                    reply = PUSH.decode(recv_frame(sock))
            except (PeerGone, OSError) as exc:
                # the engine may still be reading the staging memory: never write it again
                self._half.close()
                raise WeightSyncError(f"lost the engine during the push ({exc})") from None
            if (
                isinstance(reply, PushDone)
                and reply.error is None
                and any(r.state == "rolling" for r in reply.replicas)
            ):
                rollout = Rollout(sock, reply.version, tuple(reply.replicas))
        finally:
            if rollout is None:
                sock.close()
        if not isinstance(reply, PushDone):
            raise WeightSyncError(f"unexpected reply {type(reply).__name__} from the engine")
        if reply.stale_served is not None:
            name = self.adapter.name if self.adapter is not None else None
            raise StaleVersionError(reply.version, reply.stale_served, name)
        if reply.error is not None:
            self.shadow.failed()
            raise WeightSyncError(reply.error)
        if mode != "off" and reply.push_id and sent is not None:
            self.shadow.committed(reply.push_id, sent[0].items, sent[1])
        else:  # a target that takes no deltas (or none asked for): no shadow is kept
            self.shadow.clear()
        sent = tuple(delivery.bytes_moved) if delivery is not None else ()
        return PushStats(
            reply.version,
            sum(sent),
            reply.bytes_needed,
            reply.bytes_moved,
            time.perf_counter() - start,
            self.transport,
            sent,
            tuple(reply.replicas),
            delivery.bytes_staged if delivery is not None else None,
            rollout,
            reply.delta,
            reply.why_dense,
            density,
            encode_seconds,
        )

    def close(self) -> None:
        """Release this sender's staging memory and its mappings of engine memory (also
        released when the sender is garbage-collected)."""
        self._half.close()
        self._payload_half.close()

    def _why_broken(self, sock: socket.socket, exc: Exception) -> str:
        """The engine's account of a push whose transport broke under this rank (it answers
        once every engine rank has stopped receiving), else the transport's error."""
        try:
            reply = PUSH.decode(recv_frame(sock))
        except (PeerGone, OSError, ValueError):
            reply = None
        if isinstance(reply, PushDone) and reply.error is not None:
            return reply.error
        return f"the transport broke mid-push ({type(exc).__name__}: {exc})"

    def _copy_of(self) -> str | None:
        """The push whose landed weights this rank sends untouched (`PushHello.copy_of`);
        None: they are its own (a trainer's)."""
        return None

    def _local(self) -> tuple[RankLayout, dict[str, torch.Tensor]]:
        """This rank's layout and its local tensors by layout key."""
        if self.layout == "megatron":
            layout, tensors = megatron_module_layout(
                self.model, self.rank, vocab_size=self.vocab_size
            )
            return layout, {k: t.detach() for k, t in tensors.items()}
        if self.adapter is not None:  # only the adapter's tensors, by canonical names
            adapter = _adapter_tensors(self.model, self.adapter.name, self._lora_config)
            tensors = {name: local_tensor(t) for name, t in adapter.items()}
            return dtensor_layout(adapter, self.rank), tensors
        tensors = {name: local_tensor(t) for name, t in named_tensors(self.model)}
        model_type = getattr(getattr(self.model, "config", None), "model_type", None)
        return regroup_hf_experts(dtensor_layout(self.model, self.rank), tensors, model_type)

    def _quantized(self, plan: PushPlan, layout: RankLayout, tensors: dict):
        """(plan, tensors) as delivered: into a block-FP8 engine, the boxes of its FP8
        weights quantized with the scales every trainer rank agreed on (`tandem.exchange.
        quantize`); else as they are."""
        # the agreement is a collective: every rank joins it (the list is the same on all),
        # whether or not its own boxes include FP8 weights
        scales = agree_scales(plan.quantize, layout, tensors, self.world_size)
        if not any(item.dtype == FP8_NAME for item in plan.items):
            return plan, tensors
        items, tensors = quantized_items(plan.items, plan.quantize, tensors, scales)
        return dataclasses.replace(plan, items=items), tensors

    def _encode(self, plan: PushPlan, tensors: dict, mode: str) -> tuple[PushEncoded, float | None]:
        """A delta's first round: every box of ``plan`` encoded against the shadow (which then
        holds this push), the payloads laid back to back for delivery; or why this rank sends
        dense (no shadow of this plan; "auto": the delta would not pay); and the fraction of
        its elements that changed (None: nothing was encoded)."""
        why = self.shadow.why_not(plan.items)
        encoded, density = [], None
        if why is None:
            encoded = self.shadow.encode(plan.items, tensors, self.settings.verify)
            changed = sum(e.box.changed for e in encoded)
            density = changed / max(1, sum(math.prod(i.box_shape) for i in plan.items))
            payload = sum(e.box.nbytes for e in encoded)
            dense = sum(item.nbytes for item in plan.items)
            if mode == "auto" and payload > AUTO_MAX_FRACTION * dense:
                why = f"the delta would carry {payload / max(dense, 1):.0%} of the dense bytes"
                self._dense_for = AUTO_RETRY_AFTER
        if why is not None:
            return PushEncoded([], why), density
        total = sum(e.payload.numel() for e in encoded)
        if self._payloads.numel() < total:  # kept: a transport registers it once (mooncake)
            self._payloads = torch.empty(
                total + total // 4, dtype=torch.uint8, device=self._payloads.device
            )
        at = 0
        for e in encoded:
            self._payloads[at : at + e.payload.numel()].copy_(e.payload)
            at += e.payload.numel()
        return PushEncoded([e.box for e in encoded]), density

    def _deliver(self, reply: PushPlan, plan: PushPlan, tensors: dict) -> Delivery:
        """This rank's part of the plan, through its transport's sender half: ``reply`` as
        the engine sent it, ``plan`` and ``tensors`` the push's dense form as quantized; a
        delta's payloads (``reply.delta``) are staged."""
        if reply.delta:
            return self._payload_half.deliver(reply, {PAYLOAD_KEY: self._payloads})
        return self._half.deliver(dataclasses.replace(reply, items=plan.items), tensors)


def _adapter_push(model, name: str | None, keep_versions: int, lora_config) -> AdapterPush:
    """What a push of ``model``'s LoRA adapter tells the engine (rank, scale, targets)."""
    if lora_config is None:
        if not is_peft_model(model):
            raise LoRAError("lora_name needs a PEFT model, or a state dict with lora_config")
        name = name or model.active_adapter
        config, _ = peft_adapter(model, name)
    else:
        config = (
            lora_config
            if isinstance(lora_config, AdapterConfig)
            else AdapterConfig.from_peft(lora_config, f"adapter {name!r}")
        )
    if name is None:
        raise LoRAError("lora_name is needed to push an adapter from a state dict")
    try:
        return AdapterPush(name, config.rank, config.scaling, config.targets, keep_versions)
    except ValueError as exc:
        raise LoRAError(str(exc)) from None


def _adapter_tensors(model, name: str, lora_config) -> dict[str, torch.Tensor]:
    """The adapter's tensors (a PEFT model's live parameters, or a state dict's), by
    canonical names."""
    if lora_config is None:
        return peft_adapter(model, name)[1]
    config = (
        lora_config
        if isinstance(lora_config, AdapterConfig)
        else AdapterConfig.from_peft(lora_config, f"adapter {name!r}")
    )
    return canonical_tensors(dict(model), config, name)
