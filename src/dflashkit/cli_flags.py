"""Command-line pieces both halves of the CLI use (`cli.py`, `cli_training.py`): the help formatter, the target
flags, and the drafting flags with the `DecodeConfig` they describe."""

from __future__ import annotations

import argparse


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help, unless the help already says it (or there is none to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def add_target_flags(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    p.add_argument("--target", default=None,
                   help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    if drafter:
        p.add_argument("--drafter", default=None, help="Z Lab-format drafter directory (default: the bundled drafter)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "float64"],
                   help="weights and activations")
    p.add_argument("--backend", default="auto", choices=["auto", "lean", "hf"],
                   help="target forward: lean = dflashkit's batch-invariant forward (bit-identical speculative "
                        "output in bf16; Llama, Qwen3, Gemma 3), hf = transformers' modules; auto = lean where it "
                        "applies (default: %(default)s)")
    p.add_argument("--kernel", default="auto", choices=["auto", "torch", "rowlinear"],
                   help="lean kernels: torch = F.linear + tensor-op attention (row-invariant on some CPUs only: the "
                        "self-check says); rowlinear = dflashkit's row-invariant C++ linears and attention (AVX2; "
                        "compiled once with g++); auto = rowlinear for bf16 on a CPU where it builds, else torch "
                        "(default: %(default)s)")
    p.add_argument("--quant", default="auto", choices=["auto", "none", "int4", "int4-a8"],
                   help="none = the bf16 model (a Q4_1 GGUF's weights rounded to bf16); int4 = a Q4_1 GGUF target "
                        "on its own 4-bit codes, exact products on bf16 activations (another target than the bf16 "
                        "one, exact against its own AR); int4-a8 = the same codes with each token's activations "
                        "rounded to 8 bits and integer dot products, as llama.cpp computes (another target again); "
                        "auto = int4 for a GGUF target on a CPU with AVX512-BF16 and --kernel auto, else none "
                        "(DFLASHKIT_BF16_WEIGHTS=1 keeps none) (default: %(default)s)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Target, drafter and the drafting flags; their defaults are `DecodeConfig.recommended()`'s."""
    from .decode_config import RECOMMENDED_DRAFT_VOCAB, DecodeConfig

    rec = DecodeConfig.recommended()
    add_target_flags(p)
    p.add_argument("--lookup", type=int, default=rec.lookup.max_tokens,
                   help="also verify an n-gram lookup branch of up to N tokens copied from earlier in the sequence, "
                        "beside the DFlash block (a draft tree; output stays exact). 0 = off. bench: the lookup length "
                        "of its dflash-lookup and lookup methods (its ar and dflash rows never use lookup)")
    p.add_argument("--tree", type=int, default=rec.tree,
                   help="draft a TREE: the drafter's N most likely paths through its top tokens per block slot, "
                        "verified in one pass (output stays exact); 0 = the plain chain of argmaxes. bench: the tree "
                        "of its dflash-lookup and dflash-tree methods")
    p.add_argument("--tree-min-prob", type=float, default=rec.tree_min_prob,
                   help="with --tree: also drop the paths the drafter gives less than this probability (the verify "
                        "pass then holds only the likely nodes; 0 = keep all N)")
    p.add_argument("--draft-vocab", type=int, default=rec.draft_vocab,
                   help="draft over the drafter's N most frequent training ids only (needs its token_ranking.json; "
                        "fewer LM-head rows to read; verification keeps the full vocabulary). 0 = all ids; "
                        f"default: {RECOMMENDED_DRAFT_VOCAB} if the drafter has a token ranking, else 0")
    p.add_argument("--lookup-per-n", type=int, default=rec.lookup.tokens_per_n,
                   help="propose at most this many lookup tokens per matched suffix token (0 = always --lookup)")
    p.add_argument("--policy", default=rec.policy, choices=["adaptive", "fixed"],
                   help="adaptive: each step drafts and verifies only what pays on this machine at this load (a cost "
                        "model calibrated once per machine, acceptance learned while decoding; plain AR steps when "
                        "nothing pays); fixed: the whole tree and lookup branch every step. bench: the policy of "
                        "its dflash-lookup rows")
    p.add_argument("--lookup-skip", type=int, default=rec.lookup.skip_drafter_n,
                   help="skip the drafter's forward when the lookup matched a suffix of at least this many tokens "
                        "(0 = never)")
    p.add_argument("--lookup-corpus", type=int, default=rec.lookup.corpus_n,
                   help="where the sequence's own lookup match is under 2 tokens, copy from the target's earlier "
                        "answers (the drafter directory's corpus.npz) if they match at least N tokens (0 = never)")


def decode_config(args, block_size: bool = True):
    """The `DecodeConfig` the drafting flags describe (validated; block size from --block-size if given and
    `block_size`: bench takes a list of block sizes and sets each row's itself)."""
    from .decode_config import DecodeConfig
    from .lookup import LookupParams

    lookup = LookupParams(max_tokens=args.lookup, skip_drafter_n=args.lookup_skip, tokens_per_n=args.lookup_per_n,
                          corpus_n=args.lookup_corpus)
    return DecodeConfig(block_size=getattr(args, "block_size", None) if block_size else None, tree=args.tree,
                        tree_min_prob=args.tree_min_prob, draft_vocab=args.draft_vocab, lookup=lookup,
                        policy=args.policy)
