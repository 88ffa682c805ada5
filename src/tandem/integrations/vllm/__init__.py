"""tandem's weight exchange into vLLM engines.

As vLLM's ``tandem`` weight-transfer backend (registered through vLLM's plugin entry point,
`tandem.integrations.vllm.plugin`): ``vllm serve --weight-transfer-config '{"backend":
"tandem"}'`` or ``vllm.LLM(..., weight_transfer_config={"backend": "tandem"})``, pushed into
with vLLM's trainer API and `TandemTrainerInitInfo` (`tandem.integrations.vllm.trainer`).

``LLM(model, worker_extension_cls=WORKER_EXTENSION)`` gives each vLLM worker tandem's receiving
side; `WeightSender(trainer_model, llm)` then pushes into it (`vllm_target`; the exchange finds
`exchange_address_of` through the ``tandem.targets`` entry point), as does a trainer in another
process given ``vllm_target(llm).exchange_address``. Importing this package does not import vLLM;
``import tandem`` does not import this package.
"""

from __future__ import annotations

import weakref

WORKER_EXTENSION = "tandem.integrations.vllm.worker.TandemWorkerExtension"

_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_vllm_engine(obj) -> bool:
    """Whether ``obj`` is a vLLM offline ``LLM`` (without importing vLLM)."""
    return type(obj).__module__.startswith("vllm.") and hasattr(obj, "collective_rpc")


def vllm_target(llm):
    """The `VllmTarget` of ``llm`` (made once per engine, with its exchange server)."""
    from tandem.integrations.vllm.target import OfflineEngine, VllmTarget

    target = _TARGETS.get(llm)
    if target is None:
        target = _TARGETS[llm] = VllmTarget(OfflineEngine(llm))
    return target


def exchange_address_of(obj) -> str | None:
    """Where `WeightSender(model, obj)` pushes when ``obj`` is a vLLM engine (else None): the
    ``tandem.targets`` entry point."""
    return vllm_target(obj).exchange_address if is_vllm_engine(obj) else None


def __getattr__(name: str):
    if name in ("TandemTrainerInitInfo", "TandemTrainerEngine"):  # they import vLLM
        from tandem.integrations.vllm import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "WORKER_EXTENSION",
    "TandemTrainerEngine",
    "TandemTrainerInitInfo",
    "exchange_address_of",
    "is_vllm_engine",
    "vllm_target",
]
