"""`dflashkit bench`: tau, speed and exactness side by side with autoregressive decoding and the peers.

One module per concern: `datasets` (the prompts), `peers` (every method by name, a registry), `exactness`
(near-tie analysis of outputs that part from AR), `runner` (the run and its metrics), `report` (JSON, Markdown,
plots). The acceptance arithmetic itself lives in `dflashkit.stats`.
"""

from .datasets import HUMANEVAL_WRAPPER, MATH_SUFFIX, load_dataset, load_prompt_file
from .exactness import (calibrate_noise, first_divergence, is_near_tie, mismatches, near_tie_threshold,
                        noise_summary, rounding_noise)
from .peers import (PEERS, BenchContext, EngineMethod, HFMethod, LlamaCppMethod, Skip, Turn, VLLMMethod, ZLabMethod,
                    accepted_from_counters, peer_python, vllm_env, vllm_python, zlab_python)
from .report import markdown, plots, write_markdown, write_report
from .runner import BenchConfig, aggregate, batch_sweep, run_bench, run_interleaved, run_item, turn_order

__all__ = ["HUMANEVAL_WRAPPER", "MATH_SUFFIX", "PEERS", "BenchConfig", "BenchContext", "EngineMethod", "HFMethod",
           "LlamaCppMethod", "Skip", "Turn", "VLLMMethod", "ZLabMethod", "accepted_from_counters", "aggregate",
           "batch_sweep", "calibrate_noise", "first_divergence", "is_near_tie", "load_dataset", "load_prompt_file",
           "markdown", "mismatches", "near_tie_threshold", "noise_summary", "peer_python", "plots", "rounding_noise",
           "run_bench", "run_interleaved", "run_item", "turn_order", "vllm_env", "vllm_python", "write_markdown",
           "write_report", "zlab_python"]
