"""`DFlashEngine`: batched, streaming, lossless DFlash speculative decoding of a target with a drafter.

The engine validates requests and builds `DecodeBatch`es (`batch.py`: propose -> verify -> commit) from a
target backend (`backends/`), the proposers (`proposers.py`) and one `DecodeConfig` (`decode_config.py`). Its
default is `DecodeConfig.recommended()`, the same system the CLI, the server and the bench run.
`block_size == 1` without lookup is plain autoregressive decoding (the baseline) through the same loop.

`DFlashEngine.stream` is THE generator; `generate`, the CLI, the benchmark and the server consume it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .batch import DecodeBatch, SeqState, StepOutput, cache_positions
from .corpus import Corpus
from .decode_config import DecodeConfig
from .drafter import DFlashDrafter
from .errors import DFlashError
from .measurements import cache_dir
from .kernel_plan import apply_to_drafter, plan_of
from .policy import AdaptivePolicy, FixedPolicy
from .step_cost import CostModel, load_or_calibrate
from .proposers import DrafterProposer, LookupProposer, check_compatible
from .sampling import SamplingParams
from .stats import GenerationStats

log = logging.getLogger(__name__)

__all__ = ["DFlashEngine", "Generation", "StepOutput", "cache_positions"]


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str | None
    stats: GenerationStats
    text: str | None = None


class DFlashEngine:
    """target: a `TargetModel` (`backends/`); drafter: a DFlash drafter for it, or None (block size 1);
    config: how each step drafts (default `DecodeConfig.recommended()`; `DecodeConfig()` is the plain block)."""

    def __init__(self, target, drafter: DFlashDrafter | None = None, tokenizer=None,
                 config: DecodeConfig | None = None, eos_token_ids: Sequence[int] | None = None,
                 cost: CostModel | None = None, cost_file: str | None = "default", corpus: Corpus | None = None):
        """cost: the adaptive policy's cost model (default: calibrated here once, cached in `cost_file`; "default"
        is ~/.cache/dflashkit/cost.json, None caches nothing). corpus: the target's earlier answers for the lookup
        (`LookupParams.corpus_n`; default: the one shipped in the drafter's directory, if any)."""
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.corpus = corpus if corpus is not None else getattr(drafter, "corpus", None)
        self.cost, self.cost_file = cost, cost_file
        self._policies: dict[tuple, AdaptivePolicy] = {}
        if drafter is not None:
            check_compatible(drafter, target)
            target.set_taps(drafter.config.target_layer_ids)
            drafter.to(device=target.device, dtype=target.dtype).eval()
            apply_to_drafter(plan_of(target), drafter)  # the drafter runs the target's kernels
        self._proposers: dict[tuple, DrafterProposer] = {}
        self.drafter_factory, self.lookup_factory = DrafterProposer, LookupProposer
        self.config = self.resolve(config if config is not None else DecodeConfig.recommended())
        if self.corpus is not None and self.config.lookup.corpus_n:
            self.corpus.prepare()  # its index, at start rather than in the first request's first step
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = set(eos_token_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def resolve(self, config: DecodeConfig) -> DecodeConfig:
        """`config` made concrete for this engine's drafter and checked (raises DFlashError naming the remedy)."""
        config = config.resolve(self.drafter)
        if config.block_size > 1:
            self.drafter_proposer(config)  # builds (and caches) it: a bad draft vocabulary fails here
        return config

    def drafter_proposer(self, config: DecodeConfig) -> DrafterProposer | None:
        """The drafter's proposer for a resolved config (None at block size 1), cached per drafting setting (a
        reduced draft vocabulary copies its LM-head rows once)."""
        if config.block_size == 1:
            return None
        key = (config.block_size, config.tree, config.tree_min_prob, config.draft_vocab)
        if key not in self._proposers:
            self._proposers[key] = self.drafter_factory(self.drafter, self.target, *key)
        return self._proposers[key]

    def set_proposers(self, drafter=None, lookup=None) -> None:
        """Build proposers with these classes (same arguments as `DrafterProposer` / `LookupProposer`), e.g.
        subclasses whose `draft` / `suggest` are oracles (tests) or record drafts (scripts/vllm_check.py)."""
        self.drafter_factory = drafter or self.drafter_factory
        self.lookup_factory = lookup or self.lookup_factory
        self._proposers.clear()
        self.resolve(self.config)

    # ---------------------------------------------------------------------------------------------
    def new_batch(self, max_len: int, config: DecodeConfig | None = None) -> DecodeBatch:
        """An empty running batch of up to `max_len` cache positions per row (the server keeps one open)."""
        c = self.config if config is None else self.resolve(config)
        tail = getattr(self.target, "tail_depth", None)
        if tail is not None and c.depth_span - 1 > tail and self.target.batch_invariant:
            # still exact math; only nodes deeper than the tail may round differently from one-token decoding
            log.warning("draft nodes up to depth %d exceed the lean backend's bit-identical depth %d: outputs may "
                        "part from AR at rounding near-ties (raise LeanTarget(tail_depth=...) or draft shallower)",
                        c.depth_span - 1, tail)
        return DecodeBatch(self.target, self.drafter_proposer(c), self.lookup_factory(c.lookup, self.corpus),
                           c.verify_width, c.depth_span, max_len, self.eos_token_ids, self.tokenizer, self.policy(c))

    def policy(self, config: DecodeConfig):
        """The step policy of a resolved config: one `AdaptivePolicy` per drafting setting, kept for the engine's
        life (its calibration carries over from batch to batch), or `FixedPolicy`."""
        if config.policy == "fixed" or not config.speculative:
            return FixedPolicy()
        key = (config.block_size, config.tree, config.draft_vocab, config.lookup)
        if key not in self._policies:
            proposer = self.drafter_proposer(config)
            if self.cost is not None:
                # a copy per policy: online learning moves its points, never the caller's model
                cost = dataclasses.replace(self.cost, verify_ms=list(self.cost.verify_ms),
                                           draft_ms=list(self.cost.draft_ms))
            else:
                file = cache_dir() / "cost.json" if self.cost_file == "default" else self.cost_file
                cost = load_or_calibrate(self.target, proposer, file)
            self._policies[key] = AdaptivePolicy(cost)
        return self._policies[key]

    def policy_stats(self) -> dict:
        """What the adaptive policies chose so far, per drafting setting (the server's /metrics, the bench)."""
        return {f"b{k[0]}-tree{k[1]}-lookup{k[3].max_tokens}": p.stats.summary() for k, p in self._policies.items()}

    def call_config(self, config: DecodeConfig | None = None, **overrides) -> DecodeConfig:
        """The engine's config, or `config`, with per-call overrides (block_size, tree, lookup, ...), resolved."""
        if config is None and not any(v is not None for v in overrides.values()):
            return self.config
        return self.resolve((config or self.config).replace(**overrides))

    @torch.inference_mode()
    def stream(self, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               max_new_tokens: int | Sequence[int] = 256, stop: Sequence[str] | None = None,
               config: DecodeConfig | None = None, **overrides) -> Iterator[list[StepOutput]]:
        """Decode a batch of token-id prompts; yields, per step, the new tokens of each sequence that got some.

        config / overrides (block_size, tree, tree_min_prob, draft_vocab, lookup): this call's drafting, e.g.
        `block_size=1, lookup=LookupParams()` for plain AR."""
        c = self.call_config(config, **overrides)
        n = len(prompts)
        if n == 0:
            return
        params = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        max_new = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(params) != n or len(max_new) != n:
            raise DFlashError("give one sampling setting and one max_new_tokens per prompt (or a single one for all).")
        seqs = []
        for i, p in enumerate(prompts):  # validate all before any work starts
            try:
                seqs.append(self.sequence(i, p, params[i], max_new[i], stop, c))
            except DFlashError as e:
                raise DFlashError(f"prompt {i}: {e}") from None
        batch = self.new_batch(max(cache_positions(len(p), m, c.verify_width) for p, m in zip(prompts, max_new)), c)
        yield batch.add(seqs)
        while batch.alive:
            yield batch.step()

    def sequence(self, index: int, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stop: Sequence[str] | None = None,
                 config: DecodeConfig | None = None) -> SeqState:
        """A validated sequence ready to join a `DecodeBatch` of `config` (default: the engine's)."""
        stop = [x for x in (stop or []) if x]
        self.validate(prompt, max_new_tokens, stop)
        span = (config or self.config).depth_span
        return SeqState(index, list(prompt), max_new_tokens, GenerationStats(span=span, prompt_tokens=len(prompt)),
                        sampling, stop, t_arrival=time.perf_counter())

    def validate(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[str] | None = None) -> None:
        """Raise DFlashError if one request cannot run (the server checks requests before queueing them)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens}).")
        if len(prompt) == 0:
            raise DFlashError("the prompt is empty; give at least one token.")
        if len(prompt) + max_new_tokens > self.target.max_positions:
            raise DFlashError(
                f"the prompt has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it exceeds the target's "
                f"context of {self.target.max_positions} positions. Shorten the prompt or lower max_new_tokens.")
        if stop and self.tokenizer is None:
            raise DFlashError("stop strings need a tokenizer; create the engine with one.")

    # ---------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list[Generation]:
        """Run `stream` to the end; returns one Generation per prompt, in order."""
        toks: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        last: dict[int, StepOutput] = {}
        for step in self.stream(prompts, **kwargs):
            for o in step:
                toks[o.index].extend(o.tokens)
                last[o.index] = o
        gens = []
        for i in range(len(prompts)):
            g = Generation(toks[i], last[i].finish_reason, last[i].stats)
            if self.tokenizer is not None:
                g.text = self.decode(toks[i], kwargs.get("stop"))
            gens.append(g)
        return gens

    def decode(self, tokens: list[int], stop: Sequence[str] | None = None) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for x in stop or []:
            if x and x in text:
                text = text[: text.index(x)]
        return text
