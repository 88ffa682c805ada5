"""Place trainer actors next to (or apart from) a tandem engine whose ranks are Ray actors.

    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    trainers = launch_trainers(MyTrainer, 2, llm, layout="colocated",
                               kwargs={"exchange_address": llm.exchange_address})

``colocated``: trainer ``i`` runs on the node of engine rank ``i`` (round robin), so a push can
use shared memory when the exchange allows it and GPUs are shared (give trainers fractional
GPUs). ``split``: the trainers get a placement group of their own (``strategy``), typically on
other nodes; pushes then go over torch.distributed (``transport="dist"``). The trainer class is
yours: it builds its model and calls ``WeightSender(model, exchange_address, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class TrainerGroup:
    """The trainer actors and, for ``split``, their placement group."""

    actors: list[Any]
    placement_group: Any = None
    nodes: list[str] = field(default_factory=list)  # the node each actor was placed on

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


def launch_trainers(
    trainer_cls: type,
    count: int,
    llm,
    *,
    layout: Literal["colocated", "split"] = "split",
    strategy: str = "PACK",
    num_cpus: float = 1,
    num_gpus: float = 0,
    args: tuple = (),
    kwargs: dict | None = None,
) -> TrainerGroup:
    """``count`` actors of ``trainer_cls`` (a plain class; made a Ray actor here), each built
    with ``trainer_cls(*args, rank=i, world_size=count, **kwargs)``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    if layout not in ("colocated", "split"):
        raise ValueError(f"layout must be 'colocated' or 'split', got {layout!r}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(trainer_cls)
    kwargs = kwargs or {}
    group = TrainerGroup([])
    if layout == "colocated":
        engine_nodes = [p["node_id"] for p in llm.worker_locations()]
        for i in range(count):
            node = engine_nodes[i % len(engine_nodes)]
            strategy_i = NodeAffinitySchedulingStrategy(node, soft=False)
            group.actors.append(
                remote.options(scheduling_strategy=strategy_i).remote(
                    *args, rank=i, world_size=count, **kwargs
                )
            )
            group.nodes.append(node)
        return group
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    group.placement_group = placement_group([bundle] * count, strategy=strategy)
    ray.get(group.placement_group.ready())
    for i in range(count):
        place = PlacementGroupSchedulingStrategy(
            group.placement_group, placement_group_bundle_index=i
        )
        group.actors.append(
            remote.options(scheduling_strategy=place).remote(
                *args, rank=i, world_size=count, **kwargs
            )
        )
    table = ray.util.placement_group_table(group.placement_group)
    group.nodes = [table["bundles_to_node_id"][i] for i in range(count)]
    return group
