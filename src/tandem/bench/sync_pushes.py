"""tandem's own pushes in `tandem bench sync`, each one carrying new weights and checked.

Two FSDP2 trainer processes (gloo, one torch thread each) push into the engine of the
benchmark process in every mode of `MODES`: per mode one untimed push (plans, caches,
mappings), then ``repeats`` timed ones. Before every push each trainer rank scales its shard of
every parameter by the next factor of `SCALES` (untimed), so every push moves weights the
engine does not hold yet. After every push, untimed, trainer rank 0 reports the version and
waits; this process checks the engine's greedy output against a reference model whose weights
went through the same scalings (`Reference`), then lets the trainers go on.

    python -m tandem.bench.sync_pushes RANK PORT DIR ADDRESS REPEATS MODE[,MODE...]

`GATHERED` is no tandem push but the RL frameworks' path, timed the same way: per push both
ranks gather every parameter (``full_tensor()``, names in sorted order) and rank 0 sends each
full tensor to the engine's process (``ADDRESS``: ``host:port`` of a 2-rank gloo group it
joins as rank 0, the engine's process as rank 1), which loads them all into its engine and
answers one byte; the push ends at that answer.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.bench.sync_baselines import tail
from tandem.wire import free_port

# mode -> WeightSender options; each mode gets one untimed push, then the timed ones
MODES: dict[str, dict[str, Any]] = {
    "shm": {"transport": "shm"},
    "shm-unverified": {"transport": "shm", "verify": False},  # no CRC32 on either side
    "shm-in_place": {"transport": "shm", "mode": "in_place"},
    "shm-in_place-unverified": {"transport": "shm", "mode": "in_place", "verify": False},
    "dist": {"transport": "dist", "mode": "staged"},
    "dist-in_place": {"transport": "dist", "mode": "in_place"},
    "dist-in_place-unverified": {"transport": "dist", "mode": "in_place", "verify": False},
    "mooncake": {"transport": "mooncake"},  # one-sided reads, TCP on loopback
    "mooncake-in_place": {"transport": "mooncake", "mode": "in_place"},
}
GATHERED = "gathered"  # the RL frameworks' path (see the module's docstring)
# The trainers multiply every weight by these in turn before each push: large changes (a push
# that did not land fails the check by far), and bounded (the product of a pair is ~1).
SCALES = (1.25, 0.8)
PROMPT = [3, 17, 101, 42, 7, 250, 11, 64]
TOLERANCE = 1e-3  # on a generated token's log-prob (float32, TP=2 against transformers)
NEW_TOKENS = 4


class Reference:
    """The trainer's model as it stands after ``n`` scalings (transformers, this process)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.scalings = 0

    def advance_to(self, scalings: int) -> None:
        with torch.no_grad():
            while self.scalings < scalings:
                factor = SCALES[self.scalings % len(SCALES)]
                for p in self.model.parameters():
                    p.mul_(factor)  # the same float32 op the trainers apply to their shards
                self.scalings += 1

    def logprobs(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + tokens])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : -1]
        return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def scored(
    reference: Reference,
    tokens: list[int],
    logprobs: list[float],
    served: int | None,
    version: int | None,
) -> float:
    """The largest log-prob error of an engine's greedy ``tokens`` after push ``version``,
    scored by the reference; raises if the engine serves another version (None: not
    versioned) or other weights."""
    if served != version:
        raise RuntimeError(f"engine served version {served} after push {version}")
    error = float((torch.tensor(logprobs) - reference.logprobs(PROMPT, tokens)).abs().max())
    if error > TOLERANCE:
        raise RuntimeError(
            f"after push {version} the engine's log-probs differ from the trainer's by {error:.3g}"
        )
    return error


def check(llm, reference: Reference, version: int) -> float:
    """`scored` for a tandem engine."""
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    return scored(
        reference, out.outputs[0].token_ids, out.outputs[0].logprobs, out.weight_version, version
    )


def run_pushes(
    address: str,
    model_dir: Path,
    repeats: int,
    timeout: float,
    check: Callable[[Reference, int], float],
    modes: tuple[str, ...] = tuple(MODES),
) -> tuple[dict, dict]:
    """Each mode of ``modes`` (names in `MODES`) by the same 2 trainer processes pushing to
    ``address``, ``check(reference, version)`` after every push: (per mode the figures of both
    ranks, the checks made; ``checks["scalings"]``: the scalings the trainers' weights went
    through)."""
    port = str(free_port())
    argv = [sys.executable, "-m", "tandem.bench.sync_pushes"]
    args = [port, str(model_dir), address, str(repeats), ",".join(modes)]
    reference = Reference(model_dir)
    errors: list[float] = []

    def pushed(event: dict) -> None:
        reference.advance_to(event["scalings"])
        errors.append(check(reference, event["pushed"]))

    rank0, rank1 = drive_trainers(
        [[*argv, "0", *args], [*argv, "1", *args]], trainer_env(), timeout, pushed, "push trainer"
    )
    checks = {
        "pushes_checked": len(errors),
        "max_abs_logprob_error": max(errors),
        "tolerance": TOLERANCE,
        "prompt_tokens": len(PROMPT),
        "generated_tokens": NEW_TOKENS,
        "scales": list(SCALES),
        "scalings": reference.scalings,
    }
    return {mode: [rank0["modes"][mode], rank1["modes"][mode]] for mode in modes}, checks


def trainer_env() -> dict[str, str]:
    """This process's environment for the trainer ranks: gloo on loopback, one thread each."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def drive_trainers(
    commands: list[list[str]],
    env: dict[str, str],
    timeout: float,
    pushed: Callable[[dict], None],
    what: str,
    context: Callable[[], str] = lambda: "",
) -> tuple[dict, dict]:
    """Start the 2 trainer ranks (``commands``, in ``env``): rank 0 prints a
    JSON line after every push, ``pushed(event)`` checks it, and rank 0 goes on once told;
    each rank's last line is its figures: (rank 0's, rank 1's). Raises naming ``what`` (and
    ``context()``) if a rank fails, and TimeoutError past ``timeout`` s."""
    logs = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    out1 = tempfile.TemporaryFile()
    procs = [
        subprocess.Popen(
            commands[0], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[0], env=env
        ),
        subprocess.Popen(commands[1], stdout=out1, stderr=logs[1], env=env),
    ]
    deadline = time.monotonic() + timeout
    try:
        while True:  # rank 0 reports every push and waits for our answer
            line = _line(procs[0], deadline, timeout)
            if not line:
                raise RuntimeError(
                    f"{what} rank 0 exited with {procs[0].wait()} before reporting:\n"
                    f"{tail(logs[0])}{context()}"
                )
            event = json.loads(line)
            if "pushed" not in event:
                rank0 = event
                break
            pushed(event)
            procs[0].stdin.write(b"ok\n")
            procs[0].stdin.flush()
        for i, p in enumerate(procs):
            if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"{what} rank {i} exited with {p.returncode}:\n{tail(logs[i])}")
        out1.seek(0)
        rank1 = json.loads(out1.read().decode().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in (*logs, out1):
            f.close()
    return rank0, rank1


def _line(proc: subprocess.Popen, deadline: float, timeout: float) -> bytes:
    """The next line ``proc`` prints (empty once it exited); TimeoutError past ``deadline``:
    a hung trainer never hangs the benchmark."""
    while not select.select([proc.stdout], [], [], 1.0)[0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench pushes ran past {timeout} s")
        if proc.poll() is not None:
            break
    return proc.stdout.readline()


def trainer_main(rank: int, port: str, model_dir: str, address: str, repeats: int, modes: str):
    from tandem.bench.sync_worker import _fsdp_model
    from tandem.exchange import WeightSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = _fsdp_model(model_dir, dist.group.WORLD)
    version, scalings, out = 0, 0, {}
    for name in modes.split(","):
        if name == GATHERED:
            sender = _Gathered(model, address, rank)
        else:
            sender = WeightSender(model, address, **MODES[name])
        seconds, warmup = [], None
        for i in range(1 + repeats):
            with torch.no_grad():  # new weights for every push (each rank scales its shard)
                for p in model.parameters():
                    p.mul_(SCALES[scalings % len(SCALES)])
            scalings += 1
            version += 1
            dist.barrier()
            start = time.perf_counter()
            stats = sender.push(version=version, delta=False)  # dense: `--delta` times deltas
            elapsed = time.perf_counter() - start
            if i:
                seconds.append(elapsed)
            else:
                warmup = stats.seconds
            if rank == 0:  # the benchmark checks the engine before anyone goes on
                print(json.dumps({"pushed": version, "scalings": scalings}), flush=True)
                if sys.stdin.readline().strip() != "ok":
                    raise RuntimeError("the benchmark did not confirm the push")
            dist.barrier()
        sender.close()
        out[name] = {
            "seconds": seconds,
            "warmup_seconds": warmup,
            "version": stats.version,
            "bytes_sent": stats.bytes_sent,
            "bytes_needed": stats.bytes_needed,
            "bytes_moved": stats.bytes_moved,
            "transport": stats.transport,
            "bytes_by_receiver": list(stats.bytes_by_receiver),
            "bytes_staged": stats.bytes_staged,
            "replicas": [asdict(r) for r in stats.replicas],
        }
    dist.barrier()
    print(json.dumps({"rank": rank, "pushes": version, "modes": out}), flush=True)
    dist.destroy_process_group()


class _Gathered:
    """The RL frameworks' path as a sender: gather every full tensor (both ranks), rank 0 sends
    them to the engine's process, which loads them and answers."""

    def __init__(self, model: torch.nn.Module, address: str, rank: int):
        self.params = dict(sorted(model.named_parameters()))
        self.full_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.rank = rank
        self.group = None
        if rank == 0:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), 2, is_master=True)
            self.group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=600))

    def push(self, version: int, delta: bool = False):
        """Every tensor whole (``delta``: taken as `WeightSender.push` takes it; the gathered
        baseline has no delta to send)."""
        if delta:
            raise ValueError("the gathered baseline sends every tensor whole: no delta")
        start = time.perf_counter()
        nbytes = 0
        for param in self.params.values():
            full = param.full_tensor()  # a collective of both trainer ranks
            if self.group is not None:
                self.group.send([full.contiguous()], 1, 0).wait()
                nbytes += full.numel() * full.element_size()
        if self.group is not None:
            self.group.recv([torch.zeros(1, dtype=torch.uint8)], 1, 0).wait()  # loaded
        return _Sent(version, nbytes, self.full_bytes, time.perf_counter() - start)

    def close(self) -> None:
        self.group = None


@dataclass
class _Sent:
    """What `trainer_main` reads of a push's stats (``bytes_needed``: the full model's)."""

    version: int
    bytes_sent: int
    bytes_needed: int
    seconds: float
    transport: str = "gloo, gathered full tensors"
    bytes_by_receiver: tuple = ()
    replicas: tuple = ()
    bytes_staged: int | None = None

    @property
    def bytes_moved(self) -> int:
        return self.bytes_needed


if __name__ == "__main__":
    rank_, port_, dir_, address_, repeats_, modes_ = sys.argv[1:7]
    trainer_main(int(rank_), port_, dir_, address_, int(repeats_), modes_)
