"""Command-line pieces both halves of the CLI use (`cli.py`, `cli_training.py`): the help formatter and the target
flags."""

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
    p.add_argument("--quant", default="none", choices=["none", "int4", "int4-a8"],
                   help="int4 = run a Q4_1 GGUF target on its own 4-bit codes with the rowlinear kernel (a different "
                        "target from its bf16 dequantisation, exact against its own AR); int4-a8 = the same codes "
                        "with each token's activations rounded to 8 bits and integer dot products, as llama.cpp "
                        "computes (another target again) (default: %(default)s)")
