"""`tandem bench sync --quick`: the result has the documented shape, nothing is left in /dev/shm."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tandem.bench.moe_layout import QUICK_MOE
from tandem.bench.sync import REPEATS, run


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _segments() -> set[Path]:
    return set(Path("/dev/shm").glob("tandem-*"))


@pytest.mark.timeout(300)
def test_quick_sync_bench_shape(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the model is cached under ./.tandem
    before = _segments()
    result = run(quick=True)
    json.dumps(result)  # serialisable as the CLI prints it
    assert not _segments() - before, "a staged segment was left in /dev/shm"
    assert result["benchmark"] == "sync" and result["quick"] is True
    assert (tmp_path / ".tandem/bench-sync-quick/config.json").is_file()
    model = result["model"]
    assert all(_positive(model[k]) for k in ("params", "bytes", "hidden", "layers", "vocab"))
    assert model["bytes"] == 4 * model["params"]  # float32

    shm, gloo = result["shm"], result["gloo"]
    shm_direct, gloo_direct = result["shm_in_place"], result["gloo_in_place"]
    assert shm["transport"] == shm_direct["transport"] == "shm"
    assert gloo["transport"] == gloo_direct["transport"] == "dist"
    assert [shm["mode"], shm_direct["mode"], gloo["mode"], gloo_direct["mode"]] == [
        "staged",
        "in_place",
        "staged",
        "in_place",
    ]
    for push in (gloo, shm_direct, gloo_direct):
        assert push["bytes_moved"] == push["bytes_needed"] == shm["bytes_needed"]
    assert shm["bytes_moved"] == shm["bytes_needed"] >= model["bytes"]
    assert sum(shm["bytes_sent_per_rank"]) == shm["bytes_needed"]
    assert len(shm["seconds_per_push"]) == REPEATS
    assert shm["seconds"] == min(shm["seconds_per_push"])
    assert result["bytes_moved_over_needed"] == 1.0
    assert _positive(shm["unverified_seconds"]) and _positive(shm_direct["unverified_seconds"])
    assert _positive(gloo_direct["unverified_seconds"])
    for name in ("shm", "shm_in_place", "gloo", "gloo_in_place", "memcpy", "raw_gloo", "naive"):
        assert _positive(result[name]["seconds"]), name
        assert _positive(result[name]["gib_per_s"]), name
    memcpy = result["memcpy"]  # the floor: the faster copy of the same bytes as the push
    assert memcpy["bytes"] == shm["bytes_needed"]
    assert memcpy["seconds"] == min(v for k, v in memcpy.items() if k.endswith("_copy_seconds"))
    assert memcpy["seconds"] == memcpy[f"{memcpy['method']}_seconds"]
    assert len(memcpy["seconds_per_sitting"]) == 2  # the raw floors: one sitting in --quick
    for floor in (memcpy, result["raw_gloo"], result["raw_mooncake"]):  # the faster sitting
        assert floor["seconds"] == min(floor["seconds_per_sitting"])
    raw = result["raw_gloo"]
    assert [len(row) for row in raw["streams"]] == [2, 2]  # 2 trainer ranks x 2 engine ranks
    assert raw["bytes"] == sum(map(sum, raw["streams"])) == shm["bytes_needed"]
    # the streams the dist push's transports counted, per trainer rank and engine rank
    assert raw["streams"] == gloo_direct["bytes_by_receiver_per_rank"]
    checks = result["checks"]  # every push carried new weights and was checked
    assert checks["pushes_checked"] == 9 * (1 + REPEATS)
    assert 0 <= checks["max_abs_logprob_error"] <= checks["tolerance"]
    naive = result["naive"]
    assert naive["state_dict_bytes"] == model["bytes"]
    assert 0 < naive["gather_seconds"] < naive["seconds"]
    assert naive["seconds"] == min(naive["seconds_per_push"])
    assert all(_positive(n) for n in naive["checked_pieces"])  # both engine ranks checked
    assert naive["method"] and naive["timing"]

    planner = result["planner"]
    assert planner["trainer_ranks"] == QUICK_MOE.trainer_ranks
    assert planner["engine_ranks"] == QUICK_MOE.engine_ranks
    assert _positive(planner["seconds"]) and _positive(planner["transfers"])
    assert 1.0 <= planner["sender_max_over_mean"] < 2.0
    assert 1.0 <= planner["bound_max_over_mean"] <= planner["sender_max_over_mean"]
    assert planner["max_over_bound"] >= 1.0 - 1e-9

    mooncake, raw_mc = result["mooncake"], result["raw_mooncake"]
    assert mooncake["transport"] == "mooncake" and mooncake["bytes_moved"] == shm["bytes_needed"]
    assert raw_mc["streams"] == mooncake["bytes_by_receiver_per_rank"]  # the same bytes, read raw
    assert _positive(raw_mc["seconds"]) and raw_mc["bytes"] == shm["bytes_needed"]
    # every FSDP2 shard is contiguous float32: only the engine's column shards are staged
    assert all(0 < n < shm["bytes_needed"] / 2 for n in mooncake["bytes_staged_per_rank"])
    model_ = result["link_model"]
    assert all(
        _positive(model_[k]) for k in ("copy_one_Bps", "copy_all_Bps", "crc_one_Bps", "crc_all_Bps")
    )
    assert result["mooncake_in_place"]["mode"] == "in_place"
    assert raw_mc["streams"] == result["mooncake_in_place"]["bytes_by_receiver_per_rank"]
    for name in ("shm", "shm_in_place", "gloo", "gloo_in_place", "mooncake", "mooncake_in_place"):
        push = result[name]
        assert _positive(push["predicted_seconds"]) and push["predicted_phases"], name
        assert push["predicted_over_measured"] == pytest.approx(
            push["predicted_seconds"] / push["seconds"], abs=1e-3
        )

    ratios = result["ratios"]
    assert set(ratios) == {
        "shm_vs_memcpy",
        "gloo_vs_raw_gloo",
        "vs_naive",
        "vs_naive_gloo",
        "shm_staged_vs_memcpy",
        "gloo_staged_vs_raw_gloo",
        "shm_unverified_vs_memcpy",
        "shm_vs_torch_copy",
        "gloo_unverified_vs_raw_gloo",
        "mooncake_vs_raw",
        "mooncake_staged_vs_raw",
    }
    assert all(_positive(v) for v in ratios.values())
    expected = result["memcpy"]["seconds"] / shm_direct["seconds"]
    assert ratios["shm_vs_memcpy"] == pytest.approx(expected, abs=1e-3)  # 3 decimals
    expected = result["raw_gloo"]["seconds"] / gloo_direct["seconds"]
    assert ratios["gloo_vs_raw_gloo"] == pytest.approx(expected, abs=1e-3)


def test_moe_layouts_cover_every_canonical_tensor_once():
    """The planner's synthetic layouts: senders hold every canonical element exactly once per
    stage replica; every receiver box is covered (the planner raises otherwise)."""
    from tandem.bench.moe_layout import moe_layouts
    from tandem.exchange.plan import plan_transfers

    senders, receivers = moe_layouts(QUICK_MOE)
    assert len(senders) == QUICK_MOE.trainer_ranks and len(receivers) == QUICK_MOE.engine_ranks
    canonical = {}
    for lay in senders:
        for region in lay.regions:
            canonical[region.piece.name] = region.piece.full_shape
    assert sum(math.prod(s) for s in canonical.values()) == QUICK_MOE.params()
    plan = plan_transfers(senders, receivers)
    needed = sum(math.prod(b - a for a, b in r.piece.box) for lay in receivers for r in lay.regions)
    assert plan.total_numel == needed


def test_raw_gloo_walks_streams_in_the_push_order():
    """The raw gloo baseline's stream order is the dist push's (`stream_order`), both ends."""
    from tandem.bench.sync_worker import _rounds
    from tandem.exchange.transports.p2p import stream_order

    for senders, receivers in ((2, 2), (2, 3), (3, 2)):
        pairs = _rounds(senders, receivers)
        for s in range(senders):
            assert [d for r, d in pairs if r == s] == stream_order(
                s, range(receivers), senders, receivers, sending=True
            )
        for d in range(receivers):
            assert [s for s, r in pairs if r == d] == stream_order(
                d, range(senders), senders, receivers, sending=False
            )
