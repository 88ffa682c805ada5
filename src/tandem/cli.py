"""The `tandem` command."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tandem.models.tiny import FAMILIES
from tandem.server import serve_args, vllm_flags


def _make_tiny_model(args) -> int:
    from tandem.models.tiny import make_tiny_model

    path = make_tiny_model(
        args.dir,
        args.family,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_shard_bytes=args.max_shard_bytes,
    )
    if args.quantization == "fp8":
        from tandem.models.fp8_checkpoint import save_fp8_checkpoint

        save_fp8_checkpoint(path, path, (args.fp8_block, args.fp8_block))
    kind = "" if args.quantization is None else f" block-FP8 ({args.fp8_block} x {args.fp8_block})"
    print(f"wrote a random-init{kind} {args.family} model to {path}")
    return 0


def _generate(args) -> int:
    from tandem import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        logprobs=0 if args.logprobs else None,
    )
    options = dict(dtype=args.dtype, device=args.device, model_modules=args.model_module)
    options.update(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
    with LLM(args.model, **options) as llm:
        for out in llm.generate(args.prompt, params):
            c = out.outputs[0]
            record = {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids}
            if args.logprobs:
                record["logprobs"] = c.logprobs
            record["finish_reason"] = c.finish_reason
            print(json.dumps(record))
    return 0


def _classify(args) -> int:
    """Classifier logits (or, with --embed, embeddings) per text or image, one JSON line each."""
    from tandem import LLM

    if bool(args.text) == bool(args.image):
        raise ValueError("give --text or --image (repeat for several), not both")
    task = "embed" if args.embed else "classify"
    options = dict(
        dtype=args.dtype,
        device=args.device,
        task=task,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
    )
    with LLM(args.model, **options) as llm:
        spec = llm.engine.spec
        inputs = args.text
        if args.image:
            from tandem.engine.images import load_image

            inputs = [load_image(path, args.model, spec.config.image_size) for path in args.image]
        rows = llm.embed(inputs) if args.embed else llm.classify(inputs)
        for name, row in zip(args.text or args.image, rows, strict=True):
            record = {"input": name, "embedding" if args.embed else "logits": row}
            if not args.embed:
                best = max(range(len(row)), key=row.__getitem__)
                record["label"] = spec.config.id2label.get(str(best), str(best))
            print(json.dumps(record))
    return 0


def _demo(args) -> int:
    from tandem.rl import report
    from tandem.rl.config import DemoConfig
    from tandem.rl.loop import run

    counts = {k: v for k in ("steps", "warmup_steps") if (v := getattr(args, k)) is not None}
    config = DemoConfig(
        model_dir=args.model_dir,
        out_dir=args.out_dir,
        **counts,
        placement="disaggregated" if args.disaggregated else "colocate",
        async_staleness=args.async_staleness,
        seed=args.seed,
        engine_dtype=args.engine_dtype,
        is_correction=args.is_correction,
        is_cap=args.is_cap,
        delta=args.delta,
    )
    mode = config.placement + (
        "" if args.async_staleness is None else f", async (staleness <= {args.async_staleness})"
    )
    correction = (
        "no mismatch correction"
        if config.is_correction == "none"
        else f"{config.is_correction} correction, cap {config.is_cap:g}"
    )
    print(
        f"tandem demo: RL on the built-in tiny model ({mode}): engine LLM(tp=2, "
        f"{config.engine_dtype}; {correction}), trainer "
        f"FSDP2 x 2 (AdamW), weights by {config.transport}; task: reverse "
        f"{config.digits} digits (Q:472 -> A:274), reward = per-digit accuracy; "
        f"{config.warmup_steps} supervised warm-up steps, then {config.steps} GRPO steps",
        flush=True,
    )
    progress = report.Progress(config.steps)
    result = run(config, on_step=progress.update, on_event=progress.event)
    result["summary"] = report.summary(result)
    log_path, plot_path = report.write(result, config.out_dir)
    s = result["summary"]
    print(
        f"held-out greedy accuracy {s['eval_start']:.3f} -> {s['eval_end']:.3f} "
        f"(exact {s['exact_start']:.2f} -> {s['exact_end']:.2f}; before the warm-up "
        f"{s['eval_init']:.3f}; best constant answer {s['constant_policy_reward']:.3f}); "
        f"sampled reward {s['reward_start']:.3f} -> {s['reward_end']:.3f}"
    )
    print(
        f"trainer vs engine: sampled-token log-probs max {s['max_logprob_mismatch']:.1e} "
        f"(after the last push {s['final_logprob_mismatch']:.1e}), next-token KL max "
        f"{s['max_kl']:.1e} (whole-vocabulary log-prob gap {s['max_logprob_gap_vocab']:.1e}); "
        f"sync {s['mean_sync_ms']:.0f} ms/step; staleness max {s['staleness_max']}; "
        f"{s['seconds']:.0f} s"
    )
    gap = "-" if s["mean_logprob_gap"] is None else f"{s['mean_logprob_gap']:.1e}"
    print(
        f"engine {s['engine_dtype']}, correction {s['is_correction']} (cap {s['is_cap']:g}): "
        f"sampled-token log-prob gap mean {gap}; importance weight mean "
        f"{s['mean_is_weight']:.4f}; tokens over the cap {100 * s['is_capped_fraction_mean']:.2g}"
        f"% (max {100 * s['is_capped_fraction_max']:.2g}% in a step); outside PPO's clip "
        f"{100 * s['clip_fraction_mean']:.2g}%"
    )
    print(f"wrote {log_path} and {plot_path}")
    return 0


def _serve(args) -> int:
    from tandem.errors import ModelLoadError, UnsupportedModelError
    from tandem.server.config import ConfigError

    try:
        config = serve_args.serve_config(args)
    except ConfigError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    if args.node_rank:
        from tandem.engine.multiproc import run_node

        ec = config.engine_config()
        p = ec.parallel
        print(
            f"node {args.node_rank}/{p.nnodes}: joining the engine at "
            f"{p.master_addr}:{p.master_port}",
            flush=True,
        )
        return run_node(ec, args.node_rank)
    from tandem.engine.executor import EngineDeadError
    from tandem.server.launch import serve

    try:
        return serve(config)
    except (ModelLoadError, UnsupportedModelError, EngineDeadError, ValueError, OSError) as exc:
        print(f"tandem serve: cannot start: {exc}", file=sys.stderr)  # before serving anything
        return 2


def _router(args) -> int:
    from tandem.router.app import RouterSettings
    from tandem.router.launch import route

    admin_key = args.admin_key or os.environ.get("TANDEM_ADMIN_KEY")
    if admin_key is not None and len(admin_key) < 16:
        print("tandem router: --admin-key must have at least 16 characters", file=sys.stderr)
        return 2
    settings = RouterSettings(
        api_key=args.api_key,
        admin_key=admin_key,
        exchange_host=args.exchange_host,
        push_phase_timeout_s=args.push_phase_timeout_s,
        max_staleness=args.max_staleness,
    )
    if args.max_staleness is not None and args.max_staleness < 0:
        print("tandem router: --max-staleness must be >= 0", file=sys.stderr)
        return 2
    try:
        return route(
            args.replica, args.host, args.port, settings, args.health_interval, args.log_level
        )
    except (ValueError, OSError) as exc:
        print(f"tandem router: cannot start: {exc}", file=sys.stderr)
        return 2


def _bench(args) -> int:
    """Run the scenario the command line selects (`tandem.bench.registry`), or list them."""
    from tandem.bench import registry

    if args.what == "list":
        rows = registry.listing_json()
        print(json.dumps(rows, indent=2) if args.json else registry.listing())
        return 0
    scenario = registry.select(args.what, vars(args))
    result = registry.run(scenario, vars(args))
    print(json.dumps(result, indent=2) if args.json else scenario.summary(result))
    return 0


def _plan(args) -> int:
    from tandem.scale import Cluster, FleetSpec, TrainerSpec, predict_sync
    from tandem.scale.predict import summary

    if args.bucket_mb <= 0:
        raise ValueError(f"bucket-mb must be > 0, got {args.bucket_mb}")
    prediction = predict_sync(
        args.model,
        TrainerSpec.parse(args.trainer),
        FleetSpec.parse(args.fleet),
        args.engine_dtype,
        Cluster.parse(args.cluster),
        int(args.bucket_mb * (1 << 20)),
        args.delta_density,
    )
    print(json.dumps(prediction.to_json(), indent=2) if args.json else summary(prediction))
    return 0


def _parallel_sizes(p: argparse.ArgumentParser) -> None:
    """``--tp`` and ``--pp`` under vLLM's spellings too."""
    tp = ("--tensor-parallel-size", "-tp", "--tp")
    p.add_argument(*tp, dest="tp", type=int, default=1, help="tensor parallel size")
    pp = ("--pipeline-parallel-size", "-pp", "--pp")
    p.add_argument(*pp, dest="pp", type=int, default=1, help="pipeline parallel size")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-tiny-model", help="write a random-init HF-format model + tokenizer")
    m.add_argument("dir")
    m.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--vocab-size", type=int, default=512)
    m.add_argument(
        "--max-shard-bytes",
        type=int,
        default=None,
        help="split the weights into shards with an index file",
    )
    m.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="fp8: an HF block-FP8 checkpoint (e4m3 + weight_scale_inv)",
    )
    m.add_argument("--fp8-block", type=int, default=128, help="the FP8 scale block's side")
    m.set_defaults(func=_make_tiny_model)

    g = sub.add_parser("generate", help="generate from a model directory, one JSON line each")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--logprobs", action="store_true")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="cpu")
    _parallel_sizes(g)
    g.add_argument(
        "--model-module",
        action="append",
        default=[],
        help="import this module first (registers a custom architecture)",
    )
    g.set_defaults(func=_generate)

    c = sub.add_parser("classify", help="classifier logits (or --embed: embeddings) per input")
    c.add_argument("--model", required=True)
    c.add_argument("--text", action="append", default=[], help="repeat for several")
    c.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image file (ViT; read with Pillow); repeat for several",
    )
    c.add_argument("--embed", action="store_true", help="embeddings instead of logits")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--device", default="cpu")
    _parallel_sizes(c)
    c.set_defaults(func=_classify)

    s = sub.add_parser(
        "serve", help="OpenAI-compatible server; with --node-rank N >= 1, host node N's ranks"
    )
    serve_args.add_arguments(s)
    s.set_defaults(func=_serve)

    d = sub.add_parser("demo", help="an RL loop on the built-in tiny model (what `make demo` runs)")
    where = d.add_mutually_exclusive_group()
    where.add_argument(
        "--colocate",
        action="store_true",
        help="(default) engine sleeps while the trainer steps; weights by shm",
    )
    where.add_argument(
        "--disaggregated", action="store_true", help="engine stays up; weights by torch.distributed"
    )
    d.add_argument(
        "--async",
        dest="async_staleness",
        type=int,
        default=None,
        metavar="N",
        help="rollouts continue during training; drop samples > N versions stale",
    )
    d.add_argument("--steps", type=int, default=None, help="RL steps (default 150)")
    d.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="supervised steps before RL (default 10; 0: none)",
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--engine-dtype",
        choices=["float32", "bfloat16", "fp8"],
        default="float32",
        help=(
            "the engine's precision (the trainer's is float32; fp8: block-FP8 weights, "
            "bfloat16 activations)"
        ),
    )
    d.add_argument(
        "--delta",
        choices=["auto", "on", "off"],
        default="auto",
        help="the trainers' pushes: only the changed weights (on), every byte (off), or auto",
    )
    d.add_argument(
        "--is-correction",
        choices=["tis", "mis", "none"],
        default="none",
        help=(
            "correct the engine/trainer log-prob mismatch by importance weights: truncated "
            "(tis) or masked (mis) at --is-cap"
        ),
    )
    d.add_argument(
        "--is-cap",
        type=float,
        default=2.0,
        metavar="C",
        help="the importance weight's cap (default 2)",
    )
    d.add_argument("--model-dir", default=".tandem/tiny-llama")
    d.add_argument("--out-dir", default=".tandem/demo", help="demo.json and demo.png go here")
    d.set_defaults(func=_demo)

    r = sub.add_parser("router", help="one front over `tandem serve` replicas started apart")
    r.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a `tandem serve` (http://host:port); repeat for each",
    )
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    r.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    r.add_argument("--api-key", help="required on /v1 routes (forwarded to the replicas)")
    r.add_argument(
        "--admin-key",
        help="enables the RL controls; the replicas must share it (default $TANDEM_ADMIN_KEY)",
    )
    r.add_argument(
        "--exchange-host",
        default="127.0.0.1",
        help=(
            "address the router's weight-exchange server listens on (trainers push there; "
            "default 127.0.0.1)"
        ),
    )
    r.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        help="seconds between health checks of each replica",
    )
    r.add_argument(
        "--push-phase-timeout",
        dest="push_phase_timeout_s",
        type=float,
        default=300.0,
        help=(
            "seconds a weight push's transport waits before failing the push (default 300); "
            "a replica silent past it is quarantined"
        ),
    )
    r.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        metavar="N",
        help=(
            "replicas more than N weight versions behind the newest (one being rolled out "
            "counts) take no requests; those wait for one that may (default: any version)"
        ),
    )
    r.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    r.set_defaults(func=_router)

    pl = sub.add_parser(
        "plan",
        help=(
            "plan a fleet push at cluster scale from metadata; bytes per link, the bound and "
            "the predicted time"
        ),
    )
    pl.add_argument(
        "--model",
        required=True,
        help=(
            "a built-in shape (llama-70b, qwen3-235b-a22b, kimi-k2) or a directory with config.json"
        ),
    )
    pl.add_argument(
        "--trainer",
        required=True,
        help="fsdp:ranks=N or megatron:tp=..,pp=..,ep=..,dp=.. (or ranks=N); dtype=bf16 by default",
    )
    pl.add_argument("--fleet", required=True, help="replicas=R,tp=T[,pp=P]")
    pl.add_argument("--engine-dtype", default="bf16", help="bf16 | fp8 | fp32")
    pl.add_argument(
        "--cluster",
        default="",
        help=(
            "gpus_per_node=8,nvlink_GBps=450,nic_GBps=50[,latency_us=10,convert_GBps=1000,"
            "local_GBps=1000,placement=separate|shared]"
        ),
    )
    pl.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size (MiB)")
    pl.add_argument(
        "--delta-density",
        type=float,
        default=None,
        help="a delta push: the fraction of weights whose engine-dtype value changed (0..1)",
    )
    pl.add_argument("--json", action="store_true", help="print the full JSON result")
    pl.set_defaults(func=_plan)

    from tandem.bench import registry  # the table only: a bench is imported when it runs

    b = sub.add_parser(
        "bench",
        help="benchmarks with baselines measured in the same run",
        description=(
            "Benchmarks with baselines measured in the same run: each scenario below\n"
            "prints its ratios, or with --json its raw figures and a top-level `ratios` object."
        ),
        epilog=f"scenarios (`tandem bench list`):\n{registry.listing()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("what", choices=[*registry.commands(), "list"], help="list: the scenarios")
    for opt in registry.arguments():
        b.add_argument(*opt.names, **opt.settings)
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, unknown = p.parse_known_args(vllm_flags.dashed(sys.argv[1:] if argv is None else argv))
    if unknown and args.command != "serve":
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unknown:
        vllm_flags.refuse_unknown(p, unknown)
    try:
        return args.func(args)
    except ValueError as exc:  # includes ModelLoadError: a clear message, not a stack trace
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
