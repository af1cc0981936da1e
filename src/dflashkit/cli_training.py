"""The training side of the CLI: `dflashkit data prompts / generate`, `dflashkit train`, `dflashkit check-drafter`."""

from __future__ import annotations

import dataclasses
import json

from .cli_flags import Help, add_target_flags
from .errors import DFlashError


def cmd_data_prompts(args) -> int:
    from .data import build_prompts, write_prompts

    records, report = build_prompts(args.held_out, args.source, args.second_turns)
    path = write_prompts(records, report, args.out)
    print(json.dumps({"prompts": str(path), **report}))
    return 0


def cmd_data_generate(args) -> int:
    from .data import generate_responses, read_prompts
    from .decode_config import DecodeConfig
    from .engine import DFlashEngine
    from .loader import load_target
    from .sampling import SamplingParams

    # Plain AR over big batches: the data is the target's own output, and speculation does not pay at batch 64.
    target, tok = load_target(args.target, dtype=args.dtype, device=args.device, backend=args.backend)
    engine = DFlashEngine(target, None, tokenizer=tok, config=DecodeConfig.autoregressive())
    records = read_prompts(args.prompts)
    for split in args.split:
        paths = generate_responses(engine, tok, records, args.out, split, chunk_size=args.chunk_size,
                                   max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                                   sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p))
        print(json.dumps({"split": split, "chunks": len(paths)}))
    return 0


def cmd_train(args) -> int:
    from .pipeline import RunConfig, run
    from .train import TrainConfig, train

    if args.out is None:  # the recipe alone: every field in the file (data already generated)
        if not args.config:
            raise DFlashError("give --out DIR (the whole path: prompts, data, training, check) or --config "
                              "RECIPE.json.")
        cfg = TrainConfig.from_file(args.config)
        flags = {k: v for k, v in (("arch", args.arch), ("init_from", args.init_from)) if v is not None}
        cfg = dataclasses.replace(cfg, **flags)  # the flags win over the file, as in the one-command run
        train(cfg)
        print(json.dumps({"out_dir": cfg.out_dir}))
        return 0
    overrides = _recipe_overrides(args.config) if args.config else {}
    overrides.update({k: v for k, v in (("arch", args.arch), ("init_from", args.init_from)) if v is not None})
    result = run(RunConfig(out=args.out, target=args.target, prompts=args.prompts, preset=args.preset,
                           steps=args.steps, minutes=args.minutes, device=args.device, overrides=overrides))
    if "stopped" in result:
        print(f"stopped in the {result['stopped']} stage (time budget); run the same command again to continue.")
    else:
        print(result["check"]["summary"])
        print(f"drafter: {result['drafter']}  (dflashkit generate --drafter {args.out} --prompt ...)")
    print(json.dumps({k: v for k, v in result.items() if k != "check"}))
    return 0


def _recipe_overrides(path: str) -> dict:
    """TrainConfig fields from a JSON file, for the one-command run (its out, data and target come from flags)."""
    from .train import TrainConfig

    try:
        d = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot read the recipe {path} ({e}); give a JSON object of TrainConfig fields.") from None
    TrainConfig.check_keys(d, exclude=("out_dir", "data_dir", "target"))
    return d


def cmd_check_drafter(args) -> int:
    from .bench.datasets import load_dataset, load_prompt_file
    from .diagnosis import check
    from .decode_config import DecodeConfig
    from .engine import DFlashEngine
    from .loader import encode_chat, load_models

    target, tok, drafter, _ = load_models(args.target, args.drafter_dir, dtype=args.dtype, device=args.device,
                                          backend=args.backend, check=False)
    items = load_prompt_file(args.prompts, args.limit) if args.prompts else load_dataset("sharegpt-heldout", args.limit)
    engine = DFlashEngine(target, drafter, tokenizer=tok, config=DecodeConfig(policy="fixed"))
    d = check(engine, [encode_chat(tok, it[0]) for it in items], args.max_new_tokens)
    print(json.dumps(d.to_json(), indent=2) if args.json else d.summary())
    return 0 if d.ok else 1


def training_parsers(sub) -> None:
    d = sub.add_parser("data", formatter_class=Help, help="build training data")
    d = d.add_subparsers(dest="data_command", required=True)
    dp = d.add_parser("prompts", formatter_class=Help,
                      help="prompts from ShareGPT (offline) or your JSONL, minus benchmark overlap")
    dp.add_argument("--out", required=True, help="output directory (prompts.jsonl + manifest.json)")
    dp.add_argument("--source", default=None, help="JSONL of {prompt} or {messages} objects (default: ShareGPT)")
    dp.add_argument("--held-out", type=float, default=0.02, help="fraction of conversations held out (by id hash)")
    dp.add_argument("--second-turns", action="store_true",
                    help="also each ShareGPT conversation's second user turn after its first exchange (multi-turn)")
    dp.set_defaults(func=cmd_data_prompts)
    dg = d.add_parser("generate", formatter_class=Help, help="regenerate responses with the target (resumable chunks)")
    dg.add_argument("--prompts", required=True, help="prompts.jsonl from `dflashkit data prompts`")
    dg.add_argument("--out", required=True, help="output directory (chunked JSONL; rerun to resume)")
    dg.add_argument("--split", action="append", default=None, choices=["train", "heldout"],
                    help="which prompts to answer (repeatable; default: both)")
    add_target_flags(dg, drafter=False)
    dg.add_argument("--chunk-size", type=int, default=64, help="prompts per chunk (= batch size)")
    dg.add_argument("--max-prompt-tokens", type=int, default=192, help="longer prompts are skipped")
    dg.add_argument("--max-new-tokens", type=int, default=320, help="response length at most")
    dg.add_argument("--temperature", type=float, default=0.0, help="0 = the target's greedy answers")
    dg.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    dg.set_defaults(func=cmd_data_generate)

    t = sub.add_parser("train", formatter_class=Help,
                       help="train a drafter for a target: prompts, the target's own answers, training, check")
    t.add_argument("--target", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    t.add_argument("--out", default=None, help="run directory (rerun the same command to resume any stage)")
    t.add_argument("--prompts", default=None,
                   help='JSONL of {"prompt": ...} or {"messages": [...]} (default: the bundled ShareGPT prompts)')
    t.add_argument("--preset", default="auto", choices=["auto", "cpu", "gpu"],
                   help="sizes of every stage; auto = gpu when CUDA is available, else cpu")
    t.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    t.add_argument("--minutes", type=float, default=None, help="time budget of the whole run (rerun to continue)")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1")
    t.add_argument("--arch", default=None, choices=["dflash", "dflash2"],
                   help="dflash2: the candidate selector and convolutions (default: the recipe's, dflash)")
    t.add_argument("--init-from", default=None,
                   help="a drafter directory to start from; a v1 drafter with --arch dflash2 becomes a DFlash2 "
                        "drafter that drafts exactly what it drafted, then trains")
    t.add_argument("--config", default=None,
                   help="JSON of TrainConfig fields: with --out, overrides the preset's recipe; alone, the whole "
                        "recipe (out_dir, data_dir...) as before")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("check-drafter", formatter_class=Help,
                       help="does the drafter accept when decoding what training predicts? probes the silent failures")
    c.add_argument("drafter_dir", help="drafter directory (or a `dflashkit train` run directory)")
    c.add_argument("--target", default=None, help="its target (default: the embedded SmolLM2-135M-Instruct)")
    c.add_argument("--prompts", default=None, help="JSONL of prompts (default: held-out ShareGPT prompts)")
    c.add_argument("--limit", type=int, default=8, help="prompts decoded")
    c.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"], help="dtype of both")
    c.add_argument("--device", default="cpu", help="torch device")
    c.add_argument("--backend", default="auto", choices=["auto", "lean", "hf"], help="the target forward")
    c.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    c.set_defaults(func=cmd_check_drafter)
