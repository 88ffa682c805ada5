"""A cluster as the sync model sees it: GPUs on nodes, and per-direction link speeds.

Every GPU has its own NIC for traffic across nodes and NVLink to the GPUs of its node (both
full duplex: a direction's bandwidth is the figure given). Bytes between two ranks on one GPU
(trainer and engine sharing it) are a local copy. Trainer ranks take GPUs 0.. in rank order;
the fleet's ranks follow on nodes of their own (``placement="separate"``) or take the trainer's
GPUs in order (``"shared"``: each GPU holds a trainer rank and an engine rank).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

GB = 1e9  # link figures are decimal GB/s, as vendors quote them


@dataclass(frozen=True, slots=True)
class Cluster:
    gpus_per_node: int = 8
    nvlink_GBps: float = 450.0
    nic_GBps: float = 50.0
    local_GBps: float = 1000.0  # a copy within one GPU's memory
    convert_GBps: float = 1000.0  # a sender's dtype cast (source bytes per second)
    latency_us: float = 10.0  # per bucket written
    placement: str = "separate"  # "separate" | "shared"

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ValueError(f"cluster.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        for name in ("nvlink_GBps", "nic_GBps", "local_GBps", "convert_GBps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster.{name} must be > 0, got {getattr(self, name)}")
        if self.latency_us < 0:
            raise ValueError(f"cluster.latency_us must be >= 0, got {self.latency_us}")
        if self.placement not in ("separate", "shared"):
            raise ValueError(
                f"cluster.placement must be 'separate' or 'shared', got {self.placement!r}"
            )

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``gpus_per_node=8,nvlink_GBps=450,nic_GBps=50`` (any field; others keep defaults)."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict = {}
        for key, value in parse_pairs(text, "cluster").items():
            if key not in known:
                raise ValueError(f"cluster.{key}: unknown; known: {sorted(known)}")
            values[key] = parse_number(value, f"cluster.{key}") if key != "placement" else value
        return cls(**values)

    @property
    def bandwidth(self) -> dict[str, float]:
        """Bytes per second of one direction of one GPU's link, per link class."""
        return {
            "nic": self.nic_GBps * GB,
            "nvlink": self.nvlink_GBps * GB,
            "local": self.local_GBps * GB,
        }

    def gpus(self, trainer_ranks: int, fleet_ranks: int) -> tuple[list[int], list[int]]:
        """(GPU of each trainer rank, GPU of each fleet rank)."""
        trainer = list(range(trainer_ranks))
        if self.placement == "shared":
            return trainer, list(range(fleet_ranks))
        first = -(-trainer_ranks // self.gpus_per_node) * self.gpus_per_node
        return trainer, list(range(first, first + fleet_ranks))

    def link(self, a: int, b: int) -> str:
        if a == b:
            return "local"
        return "nvlink" if a // self.gpus_per_node == b // self.gpus_per_node else "nic"

    def name(self, gpu: int) -> str:
        return f"node {gpu // self.gpus_per_node} gpu {gpu % self.gpus_per_node}"


def parse_pairs(text: str, what: str) -> dict[str, str]:
    """``a=1,b=2`` -> {"a": "1", "b": "2"}; a malformed part is an error naming ``what``."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"{what}: expected key=value, got {part!r} in {text!r}")
        out[key.strip()] = value.strip()
    return out


def parse_number(value: str, field: str) -> int | float:
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{field}: expected a number, got {value!r}") from None
