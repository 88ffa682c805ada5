"""Sync at scale: the schedule simulation on hand-checkable cases, its bound, the layouts the
planner is fed from metadata, and `tandem plan`'s output and errors."""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest

from tandem.cli import main
from tandem.exchange.adapters.megatron import GPT_TO_LLAMA, MegatronLlamaConfig, TPRank
from tandem.exchange.plan import numel
from tandem.models.tiny import FAMILIES
from tandem.scale import Cluster, FleetSpec, TrainerSpec, predict_sync
from tandem.scale.layouts import canonical_shapes, fleet_layouts, trainer_layouts
from tandem.scale.shapes import model_spec
from tandem.scale.simulate import Flow, Network, simulate
from tandem.scale.wire import WireFormat

GB = 10**9


def _net(senders=1, receivers=1, latency=0.0, convert=None, gpus=None):
    """Every rank on a GPU of its own, every link across nodes at 1 GB/s."""
    gpus = gpus or (list(range(senders)), list(range(100, 100 + receivers)))
    return Network(gpus[0], gpus[1], lambda a, b: "nic", {"nic": 1.0 * GB}, latency, convert)


def test_one_link_takes_its_bytes_over_its_bandwidth_then_the_latency():
    net = _net(latency=1e-3)
    sim = simulate([Flow(0, 0, 4 * GB, 4 * GB)], {}, net, bucket_bytes=GB)
    assert sim.hops == 4
    assert sim.seconds == pytest.approx(4.0 + 1e-3)
    assert sim.bound(net) == (pytest.approx(4.0), "gpu 0 nic out")


def test_two_links_in_series_pipeline_bucket_by_bucket():
    # sender -> receiver 0 -> receiver 1: receiver 1's last bucket lands one bucket behind
    sim = simulate([Flow(0, 0, 4 * GB, 4 * GB)], {0: 1}, _net(receivers=2), bucket_bytes=GB)
    assert sim.landed == {0: pytest.approx(4.0), 1: pytest.approx(5.0)}
    assert sim.link_bytes[(100, "nic", "out")] == 4 * GB  # the relay's egress
    assert sim.link_bytes[(101, "nic", "in")] == 4 * GB


@pytest.mark.parametrize("bucket, expected", [(GB, 12.0), (GB // 2, 10.0)])
def test_a_relay_chain_adds_one_bucket_per_hop(bucket, expected):
    chain = {0: 1, 1: 2, 2: 3, 3: 4}  # depth 5: 4 hops behind the first
    sim = simulate([Flow(0, 0, 8 * GB, 8 * GB)], chain, _net(receivers=5), bucket)
    assert sim.seconds == pytest.approx(expected)


def test_a_hot_link_binds_and_spreading_cures_it():
    hot = [Flow(0, 0, 2 * GB, 2 * GB), Flow(1, 0, 2 * GB, 2 * GB)]
    net = _net(senders=2, receivers=2)
    sim = simulate(hot, {}, net, GB // 4)
    assert sim.seconds == pytest.approx(4.0)
    assert sim.bound(net) == (pytest.approx(4.0), "gpu 100 nic in")
    spread = [Flow(0, 0, 2 * GB, 2 * GB), Flow(1, 1, 2 * GB, 2 * GB)]
    assert simulate(spread, {}, net, GB // 4).seconds == pytest.approx(2.0)


def test_a_sender_casts_ahead_of_sending():
    # 2 GB of bf16 cast to 1 GB of fp8 at 0.5 GB/s of source: 4 s of casting, then the last
    # quarter-GB bucket's 0.25 s on the wire
    net = _net(convert=0.5 * GB)
    sim = simulate([Flow(0, 0, GB, 2 * GB)], {}, net, GB // 4)
    assert sim.seconds == pytest.approx(4.25)
    assert sim.bound(net) == (pytest.approx(4.0), "sender 0 conversion")


def test_the_bound_is_never_above_the_prediction():
    rng = random.Random(0)
    for case in range(40):
        senders, receivers = rng.randint(1, 6), rng.randint(1, 8)
        gpus = (
            [rng.randrange(12) for _ in range(senders)],
            rng.sample(range(12, 40), receivers),
        )
        net = Network(
            gpus[0],
            gpus[1],
            lambda a, b: "nvlink" if a // 8 == b // 8 else "nic",
            {"nic": 1.0 * GB, "nvlink": 9.0 * GB},
            rng.choice([0.0, 1e-3]),
            rng.choice([None, 3.0 * GB]),
        )
        pairs = [(s, d) for s in range(senders) for d in range(receivers) if rng.random() < 0.6]
        flows = [Flow(s, d, rng.randint(1, 3 * GB), rng.randint(1, 6 * GB)) for s, d in pairs]
        order = list(range(receivers))
        rng.shuffle(order)
        chain = dict(zip(order, order[1:], strict=False)) if rng.random() < 0.5 else {}
        chain = {a: b for a, b in chain.items() if b not in {f.dst for f in flows}}
        sim = simulate(flows, chain, net, rng.choice([GB // 8, GB]))
        bound, where = sim.bound(net)
        assert sim.seconds >= bound * (1 - 1e-9), (case, sim.seconds, bound, where)


def test_cluster_places_and_names_links():
    c = Cluster.parse("gpus_per_node=8,nic_GBps=25")
    assert c.nic_GBps == 25 and c.nvlink_GBps == 450
    assert c.gpus(10, 4) == (list(range(10)), [16, 17, 18, 19])  # fleet on nodes of its own
    assert Cluster(placement="shared").gpus(10, 4)[1] == [0, 1, 2, 3]
    assert (c.link(3, 3), c.link(0, 7), c.link(7, 8)) == ("local", "nvlink", "nic")


def _config_dir(tmp_path, family, **overrides):
    path = tmp_path / family
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**FAMILIES[family], **overrides}))
    return str(path)


def _boxes(layout):
    return {(r.piece.name, r.piece.box) for r in layout.regions}


def test_fsdp_holds_torch_chunks_of_dim0_and_whole_experts(tmp_path):
    spec = model_spec(_config_dir(tmp_path, "qwen3_moe", vocab_size=512))
    shapes = canonical_shapes(fleet_layouts(spec, FleetSpec(1, 2), "bfloat16"))
    ranks = trainer_layouts(spec, TrainerSpec("fsdp", 4), shapes)
    experts = spec.config.num_experts  # 6 over 4 ranks: torch.chunk gives 2, 2, 2, 0
    held = [
        {
            n.split(".experts.")[1].split(".")[0]
            for n, _ in _boxes(lay)
            if ".experts." in n and n.startswith("model.layers.0.")
        }
        for lay in ranks
    ]
    assert held == [{"0", "1"}, {"2", "3"}, {"4", "5"}, set()] and experts == 6
    embed = shapes["model.embed_tokens.weight"]
    rows = [b for lay in ranks for n, b in _boxes(lay) if n == "model.embed_tokens.weight"]
    assert rows == [
        ((0, 128), (0, embed[1])),
        ((128, 256), (0, embed[1])),
        ((256, 384), (0, embed[1])),
        ((384, 512), (0, embed[1])),
    ]


def test_megatron_rules_match_the_megatron_adapters_boxes(tmp_path):
    """Dense TP 2: the boxes each rank holds are the ones tandem's Megatron-core adapter
    (fed by a real GPTModel in test_megatron_push) reads off the same config."""
    spec = model_spec(_config_dir(tmp_path, "llama", vocab_size=512))
    c = spec.config
    shapes = canonical_shapes(fleet_layouts(spec, FleetSpec(1, 1), "bfloat16"))
    ranks = trainer_layouts(spec, TrainerSpec("megatron", 2, tp=2), shapes)
    cfg = MegatronLlamaConfig(
        c.hidden_size,
        c.num_attention_heads,
        c.kv_heads,
        c.dim_per_head,
        c.intermediate_size,
        c.vocab_size,
        c.vocab_size,
        c.num_hidden_layers,
    )
    for tp_rank in range(2):
        expected = defaultdict(list)
        for template, kind in GPT_TO_LLAMA.items():
            if "bias" in template or "q_layernorm" in template or "k_layernorm" in template:
                continue
            for layer in range(c.num_hidden_layers) if "{i}" in template else [None]:
                made = kind.layout(TPRank(cfg, tp_rank, 2), layer)
                for piece in made[1] if made else []:
                    expected[piece.name].append(piece.box)
        ours = defaultdict(list)
        for name, box in _boxes(ranks[tp_rank]):
            ours[name].append(box)
        assert {n: _merged(b) for n, b in ours.items()} == {
            n: _merged(b) for n, b in expected.items() if n in shapes
        }


def _merged(boxes):
    """Boxes that differ only in dim 0, joined where they touch."""
    out = []
    for box in sorted(set(boxes)):
        if out and out[-1][0][1] == box[0][0] and out[-1][1:] == box[1:]:
            out[-1] = ((out[-1][0][0], box[0][1]), *box[1:])
        else:
            out.append(box)
    return out


def test_megatron_pp_and_ep_place_every_expert_on_one_rank_per_copy(tmp_path):
    spec = model_spec(_config_dir(tmp_path, "qwen3_moe", vocab_size=512))
    shapes = canonical_shapes(fleet_layouts(spec, FleetSpec(1, 1), "bfloat16"))
    t = TrainerSpec.parse("megatron:pp=2,ep=2,dp=2")  # 4 ranks: stage 0 = ranks 0-1
    ranks = trainer_layouts(spec, t, shapes)
    holders = defaultdict(set)
    for lay in ranks:
        for name, _ in _boxes(lay):
            holders[name].add(lay.rank)
    assert holders["model.layers.0.mlp.experts.0.up_proj.weight"] == {0}
    assert holders["model.layers.0.mlp.experts.5.up_proj.weight"] == {1}
    assert holders["model.layers.1.mlp.experts.0.up_proj.weight"] == {2}  # stage 1
    assert holders["model.layers.0.self_attn.q_proj.weight"] == {0, 1}  # dp copies
    assert holders["model.embed_tokens.weight"] == {0, 1}
    assert holders["lm_head.weight"] == holders["model.norm.weight"] == {2, 3}


def test_a_plan_sends_each_engine_byte_once_and_relays_the_rest(tmp_path):
    model = _config_dir(tmp_path, "llama", vocab_size=512)
    fleet = FleetSpec(3, 2)
    p = predict_sync(model, TrainerSpec("fsdp", 4), fleet, "bf16", Cluster(gpus_per_node=4))
    replica0 = fleet_layouts(model_spec(model), fleet, "bfloat16")[:2]
    needed = sum(2 * numel(r.piece.box) for lay in replica0 for r in lay.regions)
    assert p.trainer_egress_bytes == needed
    assert p.replica_ingress_bytes == [needed] * 3
    assert p.relays == 2 * p.transfers
    assert p.bound_seconds <= p.predicted_seconds
    # fleet GPUs 4-9 on nodes 1-2 (4 a node): trainers -> replica 0 and replica 1 -> 2 cross
    # nodes, replica 0 -> 1 stays on node 1
    assert p.link_class_bytes == {"nic": 2 * needed, "nvlink": needed}


def test_fp8_wire_is_a_byte_per_weight_plus_block_scales():
    w = WireFormat("fp8")
    proj = "model.layers.3.mlp.experts.7.up_proj.weight"
    assert w.box_bytes(proj, (256, 384), ((0, 256), (0, 384))) == 256 * 384 + 4 * 2 * 3
    assert w.box_bytes(proj, (256, 384), ((100, 200), (0, 100))) == 100 * 100 + 4 * 2
    embed = "model.embed_tokens.weight"
    assert w.box_bytes(embed, (512, 64), ((0, 512), (0, 64))) == 2 * 512 * 64
    router = "model.layers.3.mlp.gate.weight"
    assert w.box_bytes(router, (8, 64), ((0, 8), (0, 64))) == 2 * 8 * 64
    assert WireFormat("bf16").box_bytes(proj, (256, 384), ((0, 256), (0, 384))) == 2 * 256 * 384


def test_a_delta_wire_carries_each_boxs_smallest_payload(tmp_path):
    """At density d a box of n elements carries min(dense, bitmap + values, indices + values)
    bytes, each part 8-byte aligned (by hand: 256 x 384 = 98,304 elements)."""
    proj = "model.layers.3.mlp.experts.7.up_proj.weight"
    box = ((0, 256), (0, 384))
    bf16 = {d: WireFormat("bf16", d).box_bytes(proj, (256, 384), box) for d in (0.01, 0.2, 1)}
    assert bf16[0.01] == 3_936 + 1_968  # indices: 983 x 4 = 3,932 and 983 x 2 = 1,966, aligned
    assert bf16[0.2] == 98_304 // 8 + 2 * 19_661 + 6  # bitmap: 12,288 + 39,322 -> 39,328
    assert bf16[1] == 2 * 98_304  # dense
    fp8 = WireFormat("fp8", 0.01).box_bytes(proj, (256, 384), box)
    assert fp8 == (3_936 + 984) + 4 * 2 * 3  # indices + one-byte values, and the block scales
    with pytest.raises(ValueError, match="delta_density"):
        WireFormat("bf16", 1.5)
    model = _config_dir(tmp_path, "llama", vocab_size=512)
    fleet, trainer = FleetSpec(2, 2), TrainerSpec("fsdp", 4)
    dense = predict_sync(model, trainer, fleet, "bf16", Cluster(gpus_per_node=4))
    delta = predict_sync(model, trainer, fleet, "bf16", Cluster(gpus_per_node=4), 16 << 20, 0.01)
    assert delta.delta_density == 0.01 and delta.notes
    assert 0.02 < delta.trainer_egress_bytes / dense.trainer_egress_bytes < 0.1
    assert delta.bound_seconds < dense.bound_seconds


def test_tandem_plan_prints_the_promised_json(tmp_path, capsys):
    model = _config_dir(tmp_path, "qwen3_moe", vocab_size=512)
    argv = [
        "plan",
        "--model",
        model,
        "--trainer",
        "megatron:tp=2,ep=2,dp=2",
        "--fleet",
        "replicas=2,tp=2",
        "--engine-dtype",
        "fp8",
        "--cluster",
        "gpus_per_node=4,nvlink_GBps=450,nic_GBps=50",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "predicted_seconds",
        "bound_seconds",
        "predicted_over_bound",
        "planner_seconds",
        "link_class_bytes",
        "busiest_links",
        "trainer_egress_bytes",
    ):
        assert key in out, key
    assert out["predicted_over_bound"] >= 1.0
    assert set(out["link_class_bytes"]) == {"nic", "nvlink"}  # both replicas on one node
    assert out["link_class_bytes"]["nvlink"] == out["trainer_egress_bytes"]  # the relay


@pytest.mark.parametrize(
    "flag, value, field",
    [
        ("--trainer", "fsdp:rank=8", "trainer.rank"),
        ("--trainer", "zero:ranks=8", "trainer: kind"),
        ("--trainer", "megatron:tp=2,pp=2,ranks=6", "trainer.ranks"),
        ("--trainer", "megatron:ep=3,dp=2", "trainer.ep"),
        ("--fleet", "tp=2", "fleet.replicas"),
        ("--fleet", "replicas=2,tp=2,ep=4", "fleet.ep"),
        ("--fleet", "replicas=two", "fleet.replicas"),
        ("--cluster", "nic_GBps=0", "cluster.nic_GBps"),
        ("--cluster", "nics=8", "cluster.nics"),
        ("--cluster", "placement=mixed", "cluster.placement"),
        ("--engine-dtype", "int4", "engine_dtype"),
        ("--model", "no-such-model", "model"),
    ],
)
def test_tandem_plan_errors_name_the_field(tmp_path, capsys, flag, value, field):
    args = {
        "--model": _config_dir(tmp_path, "llama"),
        "--trainer": "fsdp:ranks=4",
        "--fleet": "replicas=2,tp=2",
        "--engine-dtype": "bf16",
        "--cluster": "",
    }
    args[flag] = value
    assert main(["plan", *(x for kv in args.items() for x in kv)]) == 1
    assert field in capsys.readouterr().err


def test_the_local_link_model_on_hand_computed_pushes():
    """`tandem.scale.local`: each phase by hand (GB/s figures, 2 cores)."""
    from tandem.scale.local import LocalRates, predict_push

    rates = LocalRates(10 * GB, 16 * GB, 20 * GB, 30 * GB, 2, stream_Bps=5 * GB)
    streams = [[100 * 10**6, 0], [0, 100 * 10**6]]  # each trainer rank feeds one engine rank
    # shm in place: 2 trainers copy (min(10, 16 / 2) = 8 GB/s) and CRC (min(20, 30 / 2) = 15)
    # their 100 MB at once; then 2 ranks CRC theirs
    copy, crc = 0.1 / 8, 0.1 / 15
    p = predict_push("shm_in_place", streams, rates)
    assert p["phases"] == pytest.approx({"deliver": copy + crc, "verify": crc})
    p = predict_push("shm", streams, rates, verify=False)  # no CRC anywhere
    assert p["phases"] == pytest.approx({"deliver": copy, "commit": copy})
    # dist in place into 2 replicas: 200 MB to replica 0, 200 MB relayed on, every byte
    # through the node's loopback (5 GB/s) with a CRC on both ends (30 GB/s for all cores)
    p = predict_push("dist_in_place", streams, rates, replicas=2)
    assert p["seconds"] == pytest.approx(0.4 * (1 / 5 + 2 / 30))
    # mooncake: each trainer CRCs its 100 MB and copies the 40 MB it staged
    p = predict_push("mooncake", streams, rates, staged=[40 * 10**6, 40 * 10**6])
    assert p["phases"]["deliver"] == pytest.approx(0.1 / 15 + 0.04 / 8)
    assert p["phases"]["receive"] == pytest.approx(0.2 / 5)
