"""Fleets in the tests: what every replica must serve (checked against transformers), waiting
for the fleet to come back, and a generate load on a thread."""

from __future__ import annotations

import threading
import time

import torch

from tandem import SamplingParams

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8], [7, 7, 1, 40], [61, 2, 9, 9, 30, 4]]


def matches(llm, reference: torch.nn.Module, version: int, replicas: int) -> None:
    """Every replica serves ``reference``'s weights: greedy tokens and log-probs as transformers
    computes them on the same ids (teacher-forced)."""
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    prompts = [p for p in PROMPTS for _ in range(replicas)][: 2 * replicas]
    outs = llm.generate(prompts, params)
    assert {o.replica for o in outs} == set(range(replicas))
    for out in outs:
        c = out.outputs[0]
        ids = out.prompt_token_ids + c.token_ids
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
        n = len(out.prompt_token_ids)
        expected = logp[n - 1 : -1].gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        assert (torch.tensor(c.logprobs) - expected).abs().max() <= 1e-4, out.replica
        assert out.weight_version == version


def wait_serving(llm, replicas: int, timeout_s: float = 60.0, version: int | None = None) -> None:
    """Until ``replicas`` serve (at ``version``: a rolling push answers its trainer before
    its later waves, which may not have begun yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = llm.fleet_state()
        if len(state) == replicas and all(
            s["state"] == "serving" and version in (None, s["version"]) for s in state
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"the fleet did not come back: {llm.fleet_state()}")


class Load:
    """Generate calls in a loop on a thread: (start time, outputs) of each, errors kept."""

    def __init__(self, llm, params: SamplingParams):
        self.calls: list[tuple[float, list]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    self.calls.append((start, llm.generate(PROMPTS[:3], params)))
                except BaseException as exc:  # the test fails on any
                    self.errors.append(exc)
                    return

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> list[tuple[float, list]]:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()
        assert not self.errors, self.errors
        return self.calls
