"""The LoRA adapters one `tandem serve` serves (``--enable-lora``), vLLM's way: loaded from PEFT
directories at start-up (``--lora-modules``) or over HTTP (``/v1/load_lora_adapter``), each
served as a model of its own name.

The engine holds ``max_loras`` adapters in its slots at once (`tandem.engine.lora_registry`);
this server remembers every adapter it loaded from a directory, in a slot or not: when a load
needs a slot the engine may evict an idle adapter read from a directory, which stays listed
and is read back into a slot by the next request that names it (as vLLM's LRU cache of
adapters does). Adapters a trainer pushed (`WeightSender` with ``lora_name``) are served while
the engine holds them.

A request pins its adapter's latest version for its whole life (`pin`, released once each of
the call's requests is over), so no load evicts it meanwhile. Loads, unloads and reads back
from a directory take one lock, one at a time; a pin of an adapter in a slot does not wait
for them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.lora_registry import LoadedAdapter
from tandem.errors import LoRAError, LoRASlotsFull
from tandem.lora.request import LoRARequest
from tandem.server.async_fleet import AsyncFleet

log = logging.getLogger("tandem.serve")


class LoRADisabled(LoRAError):
    """The server was started without ``--enable-lora``."""


class UnknownAdapter(LoRAError):
    """No adapter of that name is loaded."""


class AdapterNotFound(LoRAError):
    """No directory at the path a load names."""


class AdapterInUse(LoRAError):
    """Requests run with the adapter: it cannot be unloaded now."""


class NoSlotNow(LoRAError):
    """An adapter evicted from its slot could not be read back into one now (every slot holds
    an adapter that requests run with, say)."""


@dataclass(frozen=True)
class _Module:
    path: str  # the PEFT directory, as given
    int_id: int  # vLLM's lora_int_id, numbered by this server


@dataclass(frozen=True)
class Pin:
    """A request's hold on an adapter version (its slot and prefix-cache key)."""

    adapter: LoadedAdapter
    release: Callable[[], None]  # unpins it (blocking: the engine lock)

    def apply(self, seqs) -> None:
        """Run these sequences (one request's samples) with the adapter."""
        for seq in seqs:
            seq.lora_slot, seq.lora_key = self.adapter.slot, self.adapter.key


class ServedAdapters:
    def __init__(self, engine: AsyncFleet, base_name: str):
        self._engine = engine
        self.base_name = base_name
        self._modules: dict[str, _Module] = {}  # loaded from a directory through this server
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one load / unload / read back at a time

    @property
    def enabled(self) -> bool:
        return self._engine.config.lora.enable_lora

    def names(self) -> list[str]:
        """Every adapter served: loaded through this server (in a slot or evicted), or in a slot
        (pushed by a trainer)."""
        if not self.enabled:
            return []
        return sorted(set(self._modules) | {a.name for a in self._engine.lora_adapters()})

    def sources(self) -> list[tuple[str, str | None]]:
        """(name, PEFT directory or None: pushed) of every adapter served."""
        in_slots = {a.name: a.path for a in self._engine.lora_adapters()} if self.enabled else {}
        modules = dict(self._modules)
        return [
            (name, modules[name].path if name in modules else in_slots.get(name))
            for name in sorted(set(modules) | set(in_slots))
        ]

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoRADisabled("LoRA is not enabled: start the server with --enable-lora")

    # ----- loading (blocking: call in a thread) -----
    def load(self, name: str, path: str) -> LoadedAdapter:
        """Load adapter ``name`` from PEFT directory ``path`` into a slot; a loaded name gets a
        new version (new requests run with it). Raises LoRAError, loading nothing."""
        self._check_enabled()
        if name == self.base_name:
            raise LoRAError(f"adapter name {name!r} is the served model's name")
        if not Path(path).is_dir():
            raise AdapterNotFound(
                f"adapter {name!r}: no adapter found at {path} (no such directory on the server)"
            )
        with self._lock:
            known = self._modules.get(name)
            int_id = known.int_id if known is not None else next(self._ids)
            adapter = self._engine.load_lora_adapter(name, path, int_id)
            self._modules[name] = _Module(path, int_id)
        log.info(
            "LoRA adapter %s version %d loaded from %s (rank %d, slot %d)",
            name,
            adapter.version,
            path,
            adapter.rank,
            adapter.slot,
        )
        return adapter

    def load_all(self, modules: dict[str, str]) -> None:
        """``--lora-modules``: name -> directory, at start-up."""
        for name, path in modules.items():
            self.load(name, path)

    def unload(self, name: str) -> None:
        """Stop serving adapter ``name`` (every version). UnknownAdapter if it is not served,
        AdapterInUse while requests run with it."""
        self._check_enabled()
        with self._lock:
            known = name in self._modules
            if not known and name not in self.names():
                raise UnknownAdapter(f"adapter {name!r} is not loaded")
            try:
                self._engine.unload_lora_adapter(name)
            except LoRAError as exc:
                if name in {a.name for a in self._engine.lora_adapters()}:
                    raise AdapterInUse(str(exc)) from None
                if not known:  # a pushed adapter that left its slot meanwhile
                    raise UnknownAdapter(f"adapter {name!r} is not loaded") from None
                # evicted from its slot: forgetting its directory unloads it
            self._modules.pop(name, None)
        log.info("LoRA adapter %s unloaded", name)

    # ----- requests -----
    def pin(self, name: str) -> Pin:
        """Hold the latest version of adapter ``name`` for a request, reading it back from its
        directory if it was evicted from its slot (blocking). UnknownAdapter, NoSlotNow."""
        module = self._modules.get(name)
        request = LoRARequest(name, module.int_id if module else 0)
        try:
            return Pin(*self._engine.pin_lora(request))
        except LoRAError:
            if module is None:
                raise UnknownAdapter(f"adapter {name!r} is not loaded") from None
        with self._lock:  # evicted: read it back (once, whoever asks first)
            module = self._modules.get(name)
            if module is None:
                raise UnknownAdapter(f"adapter {name!r} is not loaded")
            request = LoRARequest(name, module.int_id, module.path)
            try:
                return Pin(*self._engine.pin_lora(request))
            except LoRASlotsFull as exc:
                raise NoSlotNow(
                    f"adapter {name!r} could not be read back from {module.path} "
                    f"into a slot now: {exc}"
                ) from None

    async def pin_async(self, name: str) -> Pin:
        """`pin` on a worker thread; a caller that goes away meanwhile leaves nothing pinned."""
        future = asyncio.get_running_loop().run_in_executor(None, self.pin, name)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_release_when_pinned)
            raise

    def hold(self, pin: Pin, requests: int) -> Callable[[str], None]:
        """The ``on_over`` of a call of ``requests`` requests running with ``pin``: releases it
        once every one is over (called on the engine thread)."""
        left = [requests]
        lock = threading.Lock()

        def over(request_id: str) -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done:
                _release(pin)

        return over


def release_soon(pin: Pin | None) -> None:
    """Release ``pin`` (if any) on a worker thread: never blocks the event loop."""
    if pin is not None:
        _release_soon(pin)


def _release_when_pinned(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        _release_soon(future.result())


def _release_soon(pin: Pin) -> None:
    threading.Thread(target=_release, args=(pin,), daemon=True, name="tandem-lora-unpin").start()


def _release(pin: Pin) -> None:
    try:
        pin.release()
    except Exception:  # never into the engine thread's loop
        log.exception("unpinning LoRA adapter %s failed", pin.adapter.name)
