"""`dflashkit` command line. Commands own no logic: they parse flags and call the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__
from .cli_flags import Help, add_model_flags, add_target_flags, decode_config
from .cli_training import training_parsers
from .errors import DFlashError

log = logging.getLogger("dflashkit")


def exactness_label(target) -> str:
    """What 'identical to AR' rests on here: bitwise (measured batch-invariant kernels) or the near-tie rule."""
    from .invariance import mode

    if mode(target) == "bitwise":
        return "bitwise (verified logits equal one-token logits on this machine: any difference is a bug)"
    cause = getattr(target, "invariance_cause", "")
    return ("near-tie rule (this backend/dtype is not batch-invariant here: outputs may part at rounding ties"
            + (f"; {cause})" if cause else ")"))


def load_target_and_drafter(args):
    """(target, tokenizer, drafter or None, drafter_trained) from the target flags (`loader.load_models`)."""
    from .loader import load_models as load

    return load(args.target, getattr(args, "drafter", None), dtype=args.dtype, device=args.device,
                backend=getattr(args, "backend", "auto"), kernel=getattr(args, "kernel", "auto"),
                quant=getattr(args, "quant", "auto"))


def load_models(args):
    """(engine, tokenizer, drafter_trained) from the model and drafting flags."""
    from .engine import DFlashEngine

    config = decode_config(args)  # flag errors before the weights load
    target, tok, drafter, trained = load_target_and_drafter(args)
    return DFlashEngine(target, drafter, tokenizer=tok, config=config), tok, trained


def _generate_one(engine, ids: list[int], kw: dict, stream: bool):
    """One prompt to the end; with `stream`, each step's new text goes to stdout as it commits."""
    from .engine import Generation

    if not stream:
        return engine.generate([ids], **kw)[0]
    tokens, last, shown = [], None, ""
    for step in engine.stream([ids], **kw):
        for o in step:
            tokens += o.tokens
            last = o
            text = engine.decode(tokens, kw.get("stop"))
            if len(text) > len(shown) and not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
                print(text[len(shown):], end="", flush=True)
                shown = text
    print(flush=True)
    return Generation(tokens, last.finish_reason, last.stats, engine.decode(tokens, kw.get("stop")))


def cmd_generate(args) -> int:
    from .decode_config import DecodeConfig
    from .loader import encode_chat
    from .sampling import SamplingParams

    if not args.prompt.strip():  # checked before the weights load
        raise DFlashError("--prompt is empty; give the text to answer.")
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens}).")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    engine, tok, trained = load_models(args)
    ids = encode_chat(tok, args.prompt)
    kw = dict(sampling=params, max_new_tokens=args.max_new_tokens, stop=args.stop)
    if args.compare and engine.config.speculative:
        # Both runs timed warm: the first decoding of a process pays page faults, thread start-up and first
        # allocations, and it was the speculative one (measured: 0.86x AR cold, then 1.09-1.40x in the next runs).
        for config in (None, DecodeConfig.autoregressive()):
            engine.generate([ids], config=config, sampling=params, max_new_tokens=4)
    g = _generate_one(engine, ids, kw, args.stream and not args.json)
    # The comparison is plain AR: block size 1 and no lookup branch.
    ar = (engine.generate([ids], config=DecodeConfig.autoregressive(), **kw)[0]
          if args.compare and engine.config.speculative else None)
    stats = g.stats.to_dict()
    stats.update(finish_reason=g.finish_reason, block_size=engine.block_size, lookup=engine.config.lookup.max_tokens,
                 tree=engine.config.tree, drafter_trained=trained,
                 backend=getattr(engine.target, "engine_name", type(engine.target).__name__),
                 exactness=exactness_label(engine.target))
    if ar is not None:
        stats["ar_tokens_per_s"] = round(ar.stats.tokens_per_s, 3)
        ar_tps = ar.stats.tokens_per_s
        stats["speedup_vs_ar"] = round(g.stats.tokens_per_s / ar_tps, 3) if ar_tps else None
        stats["identical_to_ar"] = ar.tokens == g.tokens
        if not stats["identical_to_ar"]:
            from .bench import first_divergence
            stats["first_difference"] = first_divergence(engine.target, ids, ar.tokens, g.tokens)
    if args.json:
        out = {"text": g.text, "stats": stats}
        if ar is not None:
            out["ar_text"] = ar.text
        print(json.dumps(out))
        return 0
    if not args.stream:
        print(g.text)
    print()
    if not trained and engine.block_size > 1:
        print("[note] the drafter is UNTRAINED (initialised from a fixed seed): output is exact, acceptance is "
              "near zero.")
    _print_stats(stats, args, engine, ar)
    return 0


def _print_stats(stats: dict, args, engine, ar) -> None:
    print(f"[stats] block size {stats['block_size']}, drafter tree {stats['tree'] or 'off'}, "
          f"lookup branch {stats['lookup'] or 'off'}, {stats['new_tokens']} tokens, "
          f"tau {stats['tau']:.2f} tokens/pass, {stats['tokens_per_s']:.1f} tok/s, TTFT {stats['ttft_ms']:.0f} ms")
    print(f"[stats] cumulative acceptance per position: {[round(x, 2) for x in stats['acceptance']]}")
    print(f"[stats] accepted-length histogram (1..{stats['max_tokens_per_pass']} tokens per pass; a pass commits "
          f"its accepted drafts + 1): {stats['accepted_length_histogram']}")
    if ar is None:
        return
    print(f"[stats] autoregressive (block size 1, no lookup, same engine): {stats['ar_tokens_per_s']:.1f} tok/s -> "
          f"speedup {stats['speedup_vs_ar']}x; identical output: {stats['identical_to_ar']}")
    print(f"[stats] exactness on this machine ({stats['backend']}, {args.dtype}): {stats['exactness']}")
    d = stats.get("first_difference")
    if not d:
        return
    print(f"[compare] autoregressive text:\n{ar.text}\n[compare] the outputs part at token {d['index']}.")
    if getattr(engine.target, "batch_invariant", None):
        print("[stats] BUG: the outputs differ although this machine's kernels were measured batch-invariant; "
              "please report it with this prompt.")
    else:
        print(f"[stats] there the target's top-2 logits differ by {d['gap']:.4f} "
              f"({'a near-tie' if d['near_tie'] else 'NOT a near-tie'}: {args.dtype} rounds a block forward "
              f"differently from a one-token forward; limit {d['threshold']:.4f}). "
              "Use --backend lean (bit-identical where supported) or --dtype float32 for bit-closer paths.")


def cmd_bench(args) -> int:
    from .bench import BenchConfig, markdown, run_bench, write_report

    decode = decode_config(args, block_size=False)
    methods = [m.strip() for m in ",".join(args.methods).split(",") if m.strip()]
    if not args.dataset and not args.prompts:
        raise DFlashError("give --dataset NAME (repeatable) or --prompts FILE.jsonl.")
    temps = args.temperature or [0.0]
    if any(t < 0 for t in temps) or any(n < 1 for n in args.batch_size or []) or args.sweep_rounds < 1:
        raise DFlashError("--temperature must be >= 0, --batch-size >= 1 and --sweep-rounds >= 1.")
    from .bench.datasets import check_dataset, load_prompt_file
    for d in args.dataset or []:  # a bad dataset name or prompt file fails here, before the weights load
        check_dataset(d, args.speed_bench_dir)
    if args.prompts:
        load_prompt_file(args.prompts, 1)
    cfg = BenchConfig(datasets=args.dataset or [], prompts_file=args.prompts, limit=args.limit,
                      max_new_tokens=args.max_new_tokens, block_sizes=args.block_size or [16],
                      temperature=temps[0], temperatures=temps[1:], batch_sizes=args.batch_size or [],
                      sweep_rounds=args.sweep_rounds, methods=methods, out=args.out,
                      target=args.target, drafter=args.drafter, dtype=args.dtype, device=args.device,
                      backend=args.backend, kernel=args.kernel, quant=args.quant,
                      speed_bench_dir=args.speed_bench_dir, noise_prompts=args.noise_prompts,
                      decode=decode,
                      lookup_block_sizes=args.lookup_block_size or [], command="dflashkit " + " ".join(sys.argv[1:]))
    report = write_report(run_bench(cfg), args.out)
    print(markdown(report))
    return 0


def cmd_serve(args) -> int:
    import signal

    from .openai_api import Limits
    from .scheduler import DEFAULT_PREFILL_CHUNK
    from .server import build_app, check_port, serve_in_thread

    low = {"--prefill-chunk": 0}  # the others are >= 1
    for flag, v in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue), ("--max-len", args.max_len),
                    ("--max-body-bytes", args.max_body_bytes), ("--max-messages", args.max_messages),
                    ("--max-n", args.max_n), ("--prefill-chunk", args.prefill_chunk or 0)):
        if v < low.get(flag, 1):
            raise DFlashError(f"{flag} must be >= {low.get(flag, 1)} (got {v}).")
    check_port(args.host, args.port)  # before the weights load: a busy port fails in a second, not after 10
    limits = Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages, max_n=args.max_n)
    engine, tok, trained = load_models(args)
    if tok is None:
        raise DFlashError("the server needs the target's tokenizer; give a target directory that has one.")
    name = args.model_name or ("smollm2-135m-instruct-dflash" if args.target is None else str(args.target))
    chunk = DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk
    app = build_app(engine, tok, name, max_batch=args.max_batch, max_queue=args.max_queue, max_len=args.max_len,
                    engine_thread=False, limits=limits, api_key=args.api_key, prefill_chunk=chunk)
    # HTTP in a thread, the engine loop on this (main) thread, which loaded the model: one OpenMP thread team
    # (see Scheduler.run). SIGINT/SIGTERM stop uvicorn, whose shutdown drains the scheduler; run() then returns.
    srv, th, url = serve_in_thread(app, host=args.host, port=args.port)

    def stop(signum, frame):
        srv.should_exit = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    c = engine.config
    log.info("serving %s (block size %d, tree %d, lookup %d, drafter %s) on %s", name, c.block_size, c.tree,
             c.lookup.max_tokens, "trained" if trained else "UNTRAINED", url)
    app.state.scheduler.run()
    th.join(60)
    return 0


def cmd_export(args) -> int:
    from .export import export_speculators, export_zlab
    from .loader import parse_dtype, resolve_target_dir

    if args.draft_vocab < 0 or (args.draft_vocab and args.format != "gguf"):
        raise DFlashError("--draft-vocab is an integer >= 0 and applies to --format gguf only.")
    target, tok, drafter, trained = load_target_and_drafter(args)
    if drafter is None:
        raise DFlashError("nothing to export: give --drafter DIR (the bundled drafter is for the default target).")
    dtype = parse_dtype(args.export_dtype)
    if args.format == "gguf":
        out = _export_gguf(args, target, drafter)
    elif args.format == "zlab":
        out = export_zlab(drafter, args.out, dtype)
    else:
        out = export_speculators(drafter, target, str(resolve_target_dir(args.target)), args.out, dtype)
    print(json.dumps({"format": args.format, "out": str(out), "drafter_trained": trained}))
    return 0


def _export_gguf(args, target, drafter):
    """The llama.cpp GGUF: the target's GGUF gives the tokenizer (an HF target is converted by llama.cpp's own
    converter when --target-gguf names a file that does not exist yet)."""
    from .gguf_export import convert_target, export_gguf
    from .loader import default_gguf, resolve_target_dir

    given = Path(args.target_gguf) if args.target_gguf else None
    if given is None and (args.target is None or str(args.target).endswith(".gguf")):
        given = Path(args.target) if args.target else default_gguf()
    if given is None:
        raise DFlashError("an HF target needs --target-gguf FILE: its GGUF (llama.cpp runs the pair), or a new path "
                          "where llama.cpp's converter writes one.")
    if not given.exists():
        log.info("converting %s to %s with llama.cpp's converter", args.target, given)
        convert_target(resolve_target_dir(args.target), given, Path(args.llamacpp_src))
    return export_gguf(drafter, given, args.out, head=target.lm_head_weight, draft_vocab=args.draft_vocab,
                       gguf_type=args.gguf_type)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflashkit", description="DFlash block-diffusion speculative decoding.",
                                 formatter_class=Help)
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ap.add_argument("--version", action="version", version=f"dflashkit {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    _generate_and_data_parsers(sub)
    _bench_and_serve_parsers(sub)
    _export_parser(sub)
    training_parsers(sub)  # data, train, check-drafter (`cli_training.py`)
    return ap


def _generate_and_data_parsers(sub) -> None:
    g = sub.add_parser("generate", formatter_class=Help, help="answer one prompt (chat template applied)")
    g.add_argument("--prompt", required=True, help="the user message (the target's chat template is applied)")
    add_model_flags(g)
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per block; 1 = autoregressive (default: the drafter's)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (output keeps the "
                   "target's distribution exactly)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--stream", action="store_true", help="print the text as it is committed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--compare", action="store_true",
                   help="also run plain AR (same engine), report the speedup and whether the outputs are identical")
    g.add_argument("--json", action="store_true", help='print one JSON object {"text": ..., "stats": {...}}')
    g.set_defaults(func=cmd_generate)



def cmd_bench_serve(args) -> int:
    import torch

    from .bench.serve_curve import CurveConfig, bench_serve, markdown

    try:
        cfg = CurveConfig(engines=[e for e in args.engines.split(",") if e], max_tokens=args.max_tokens,
                          concurrency=[int(c) for c in args.concurrency.split(",") if c], out=args.out,
                          requests_per_user=args.requests_per_user, peer_block=args.peer_block,
                          threads=args.threads or torch.get_num_threads(),
                          command="dflashkit " + " ".join(sys.argv[1:]))
        print(markdown(bench_serve(cfg)))
    except ValueError as e:
        raise DFlashError(f"{e}") from None
    return 0


def _bench_and_serve_parsers(sub) -> None:
    b = sub.add_parser("bench", formatter_class=Help, help="tau and speed vs autoregressive decoding and the peers")
    b.add_argument("--dataset", action="append", default=None,
                   help="humaneval | mt-bench | mt-bench-t1 (first turns) | sharegpt-heldout | math | speed-bench "
                        "(NVIDIA's files, --speed-bench-dir) | speed-bench-like (categories built offline); the "
                        "last two give one row per category (repeatable)")
    b.add_argument("--prompts", default=None, help='JSONL, one {"prompt": ...} or {"messages": [...]} per line')
    b.add_argument("--limit", type=int, default=None,
                   help="first N items of each dataset or category (default: all; speed-bench-like: 20)")
    b.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per turn at most")
    b.add_argument("--block-size", type=int, action="append", default=None, help="repeatable (default 16)")
    b.add_argument("--temperature", type=float, action="append", default=None,
                   help="repeatable; the first runs every method, later ones add ar/dflash rows named m@T<t>")
    b.add_argument("--noise-prompts", type=int, default=8,
                   help="AR outputs on which the near-tie bound of mismatches_vs_ar is measured (block vs "
                        "one-token rounding)")
    b.add_argument("--batch-size", type=int, action="append", default=None,
                   help="repeatable: throughput sweep of ar/dflash with N prompts decoded together (first turns)")
    b.add_argument("--sweep-rounds", type=int, default=1,
                   help="times the batch sweep runs its chunks, the methods' order changing each round (3 reads a "
                        "few per cent at --limit 80 --batch-size 8)")
    b.add_argument("--methods", action="append", default=None,
                   help="comma list: ar,dflash,dflash-lookup,dflash-lookup-fixed,dflash-tree,lookup,hf,hf-lookup,"
                        "llamacpp,llamacpp-server,llamacpp-dflash,zlab,vllm,vllm-dflash")
    b.add_argument("--lookup-block-size", type=int, action="append", default=None,
                   help="repeatable: DFlash block sizes of the dflash-lookup and dflash-tree methods "
                        "(default: --block-size)")
    b.add_argument("--out", default="bench/results/latest",
                   help="results.json, outputs.json.gz, results.md and PNG plots go here")
    b.add_argument("--speed-bench-dir", default=None,
                   help="SPEED-Bench as specdec_bench's prepare step writes it (data/speed/<config>/, parquet or "
                        "JSONL, or one such file)")
    add_model_flags(b)
    b.set_defaults(func=cmd_bench)
    c = sub.add_parser("bench-serve", formatter_class=Help,
                       help="throughput vs per-user speed over concurrency: our server and the peers' (Pareto curve)")
    c.add_argument("--engines", default="dflashkit-ar,dflashkit,dflashkit-ar-again,llama-server,llama-server-dflash,"
                   "vllm,vllm-dflash", help="comma list (missing peers are skipped with the command installing them)")
    c.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma list, each 1..64")
    c.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    c.add_argument("--requests-per-user", type=int, default=2, help="a cell sends max(8, c x this) requests")
    c.add_argument("--peer-block", type=int, default=4, help="llama.cpp's and vLLM's DFlash block (drafts + 1)")
    c.add_argument("--threads", type=int, default=None, help="threads per server (default: torch's count)")
    c.add_argument("--out", default="bench/results/serve-curve",
                   help="serve_curve.json, serve_curve.md, pareto.png and the servers' logs go here")
    c.set_defaults(func=cmd_bench_serve)

    sv = sub.add_parser("serve", formatter_class=Help, help="OpenAI-compatible server with continuous batching")
    add_model_flags(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = every interface)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port")
    sv.add_argument("--block-size", type=int, default=None, help="tokens per block (default: the drafter's)")
    sv.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    sv.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    sv.add_argument("--max-len", type=int, default=2048, help="context per sequence (prompt + max_tokens)")
    sv.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens prefilled between two decoding "
                    "steps, so running streams go on (0 = whole prompts; default: scheduler.DEFAULT_PREFILL_CHUNK)")
    sv.add_argument("--model-name", default=None, help="the model id clients ask for (default: a name for the target)")
    sv.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* (default: open)")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get a 413")
    sv.add_argument("--max-messages", type=int, default=256, help="most chat messages in one request")
    sv.add_argument("--max-n", type=int, default=8, help="most choices (`n`) in one request")
    sv.set_defaults(func=cmd_serve)


def _export_parser(sub) -> None:
    ex = sub.add_parser("export", formatter_class=Help,
                        help="write the drafter for SGLang / Z Lab, vLLM speculators or llama.cpp (GGUF)")
    ex.add_argument("--format", required=True, choices=["zlab", "speculators", "gguf"],
                    help="zlab = Z Lab's checkpoint layout (SGLang, Z Lab's package); speculators = vLLM's; "
                         "gguf = llama.cpp's DFlash drafter file")
    ex.add_argument("--out", required=True, help="output directory (zlab, speculators) or .gguf file (gguf)")
    ex.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the written weights (zlab, speculators)")
    ex.add_argument("--gguf-type", default="f16", choices=["f32", "f16", "bf16", "q8_0"],
                    help="tensor type of the drafter's matrices in the GGUF (norms stay f32)")
    ex.add_argument("--draft-vocab", type=int, default=0,
                    help="gguf: draft over the drafter's N most frequent training ids (llama.cpp's d2t; the head "
                         "reads N rows instead of the whole vocabulary); 0 = full vocabulary")
    ex.add_argument("--target-gguf", default=None,
                    help="gguf: the target's GGUF, whose tokenizer the drafter file carries (default: --target when "
                         "it is a .gguf); for an HF target, a path that does not exist yet is written by "
                         "llama.cpp's converter")
    ex.add_argument("--llamacpp-src", default=".llamacpp/src",
                    help="gguf: llama.cpp's source (for its converter; scripts/llamacpp-build.sh puts it there)")
    add_target_flags(ex)
    ex.set_defaults(func=cmd_export, dtype="float32")



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.methods is None:
        args.methods = ["ar,dflash,hf,hf-lookup"]
    if getattr(args, "data_command", None) == "generate" and args.split is None:
        args.split = ["heldout", "train"]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="[%(name)s] %(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
