"""`tandem router` as a process in front of `tandem serve` replicas."""

from __future__ import annotations

import httpx
import torch

from support.serving import Server
from tandem.server.process import ServerProcess


class Router(ServerProcess):
    def __init__(self, *replicas: Server | str, extra: tuple[str, ...] = ()):
        urls = [s if isinstance(s, str) else s.url for s in replicas]
        flags = [f for url in urls for f in ("--replica", url)]
        super().__init__([*flags, "--health-interval", "0.2", *extra], 60.0, command="router")
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def stop(self, *args, **kw) -> int:
        self.client.close()
        return super().stop(*args, **kw)


def decodes(server: Server, trainer) -> None:
    """``server`` greedy-decodes what transformers does on ``trainer``'s weights."""
    prompt = [5, 17, 99, 3]
    r = server.post(
        "/v1/completions",
        json={
            "model": server.model,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
    )
    choice = r.json()["choices"][0]
    ids = prompt + choice["token_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(trainer(torch.tensor([ids])).logits[0], dim=-1)
    want = logp[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert choice["token_ids"] == want
