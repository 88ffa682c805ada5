"""vLLM's ``vllm.general_plugins`` entry point (pyproject.toml): installing tandem into a vLLM
environment registers the ``tandem`` weight-transfer backend in every vLLM process, so
``--weight-transfer-config '{"backend": "tandem"}'`` needs no other flag. vLLM calls `register`
once per process; it registers lazily (nothing of tandem's backend is imported until vLLM
builds it) and only what is not registered yet (vLLM's registries refuse a name twice)."""

from __future__ import annotations

BACKEND = "tandem"


def register() -> None:
    """The ``tandem`` engine in vLLM's worker-side and trainer-side registries."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "tandem.integrations.vllm.backend", "TandemWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "tandem.integrations.vllm.trainer", "TandemTrainerEngine"
        )
