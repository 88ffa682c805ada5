"""The push window a `tandem serve` holds open for `tandem router` (`WindowHost`): one at a
time, reached only by its token, closed as failed when the front goes quiet; the engine serves
again after every way out."""

import time

import pytest

from tandem import LLM, SamplingParams
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.server.remote_window import WindowError, WindowHost

pytestmark = pytest.mark.timeout(120)


def _spec(version: int) -> UpdateSpec:
    return UpdateSpec(version, PushSettings("shm"), "float32", 1)


def _serves(llm) -> bool:
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    return len(out[0].outputs[0].token_ids) == 2


def test_one_window_at_a_time_by_token_and_quiet_fronts_time_out(llama_dir):
    with LLM(llama_dir) as llm:
        host = WindowHost(llm.engine.target, idle_timeout_s=0.5)
        token = host.open(_spec(1))
        assert llm.engine.controls.lifecycle.updating
        with pytest.raises(WindowError, match="another"):
            host.open(_spec(2))
        with pytest.raises(WindowError, match="no such"):
            host.run("not-the-token", lambda update: None)
        assert host.run(token, lambda update: update.run(PushPhase.VERIFY, {})) == 0
        host.close(token, ok=False)  # the front aborted: nothing committed
        assert not llm.engine.controls.lifecycle.updating
        assert llm.weight_version == 0 and _serves(llm)

        quiet = host.open(_spec(3))
        time.sleep(1.0)  # the front went quiet past idle_timeout_s
        with pytest.raises(WindowError, match="no such"):
            host.run(quiet, lambda update: None)
        assert not llm.engine.controls.lifecycle.updating
        assert llm.weight_version == 0 and _serves(llm)
