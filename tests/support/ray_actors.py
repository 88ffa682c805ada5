"""Ray actors of the Ray tests (imported by name on Ray's workers)."""

import ray
import torch


@ray.remote(num_cpus=0)
class Trainer:
    """A trainer on a node of its own: pushes a model directory's weights over dist."""

    def push(self, model_dir: str, address: str, version: int) -> int:
        import transformers

        from tandem.exchange import WeightSender

        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return WeightSender(model, address, transport="dist").push(version=version).version

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class Where:
    """A trainer rank that only says where it was placed."""

    def __init__(self, rank: int, world_size: int, tag: str = ""):
        self.rank, self.world_size, self.tag = rank, world_size, tag

    def where(self) -> tuple:
        return self.rank, self.world_size, self.tag, ray.get_runtime_context().get_node_id()
