"""The server's engine loop: one thread owns the engine and its running `DecodeBatch`es; requests join and leave
between steps (continuous batching), and Prometheus counters of what it did.

A request that asks for `speculate: false` decodes autoregressively (block size 1, no lookup) in a second batch of
the same engine, stepped in turn with the first: the same weights in the same process, so a client can compare
the two modes without the process-to-process spread of two servers (bench/serve_load.py `--one-server`).

Failure isolation: request fields are validated before a request is queued (`SamplingParams`, the API limits), and
a request whose admission still fails (prefill, its sampler) fails alone. A failure inside a decoding step cannot
come from one request's input; it fails the rows of that batch, is logged, and the loop goes on with a new batch.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .batch import cache_positions
from .decode_config import DecodeConfig
from .engine import DFlashEngine
from .errors import DFlashError
from .prefill import PromptPrefill, prefill_context
from .sampling import SamplingParams
from .stats import tau_from_counts

log = logging.getLogger(__name__)

# Prompt tokens prefilled between two decoding steps (`dflashkit serve --prefill-chunk`). Why chunks: a prompt's
# prefill is one forward, and every running stream waits for it (several 1,400-token prompts: up to a minute on 2
# AVX2 cores). Why 64 (bench/results/serve-pressure): the streams' inter-token p99 0.55 s (256: 1.9 s; whole: 13 s)
# at more throughput than whole prompts; 256 gives ~8 % more throughput and shorter long-prompt TTFT.
DEFAULT_PREFILL_CHUNK = 64


@dataclass
class Job:
    seq: object  # batch.SeqState
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue  # StepOutput items, then None
    cancelled: bool = False
    speculate: bool = True  # False: decoded autoregressively, in the scheduler's AR batch
    stream: bool = True  # False: only the end (None) or an error is handed over, not each step's tokens


@dataclass
class Metrics:
    """What the server did, counted from the finished sequences' own stats (`GenerationStats`): a dashboard's tau and
    acceptance rate, computed from these counters, are the engine's."""

    requests: int = 0  # HTTP requests admitted to the queue (one per request, whatever its n)
    sequences: int = 0  # sequences they asked for (n per request)
    requests_rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0  # verify cycles, per sequence (a batch's step counts once per row in it)
    drafted: dict = field(default_factory=lambda: {"drafter": 0, "lookup": 0})  # draft nodes verified, per source
    accepted: dict = field(default_factory=lambda: {"drafter": 0, "lookup": 0})  # ... and accepted
    accepted_per_position: list[int] = field(default_factory=list)
    latency_buckets: tuple = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
    latency_counts: list[int] = field(default_factory=lambda: [0] * 9)  # one per bucket
    latency_sum: float = 0.0
    latency_n: int = 0

    def observe(self, stats, latency: float) -> None:
        span = stats.span  # the most tokens one pass can commit: span - 1 draft positions
        self.prompt_tokens += stats.prompt_tokens
        self.generated_tokens += stats.new_tokens
        self.target_passes += stats.target_passes
        self.drafted["drafter"] += stats.drafted_drafter
        self.drafted["lookup"] += stats.drafted_lookup
        self.accepted["drafter"] += stats.accepted_drafter
        self.accepted["lookup"] += stats.accepted_lookup
        if len(self.accepted_per_position) < span - 1:
            self.accepted_per_position += [0] * (span - 1 - len(self.accepted_per_position))
        for a in stats.accepted:
            for j in range(a):
                self.accepted_per_position[j] += 1
        for i, b in enumerate(self.latency_buckets):
            self.latency_counts[i] += latency <= b
        self.latency_sum += latency
        self.latency_n += 1

    def prometheus(self, policy: dict | None = None) -> str:
        """policy: `DFlashEngine.policy_stats()`, what the adaptive policy chose per drafting setting."""
        tau = tau_from_counts(self.target_passes, sum(self.accepted.values()))
        lines = [
            "# TYPE dflashkit_requests_total counter", f"dflashkit_requests_total {self.requests}",
            "# TYPE dflashkit_sequences_total counter", f"dflashkit_sequences_total {self.sequences}",
            "# TYPE dflashkit_requests_rejected_total counter",
            f"dflashkit_requests_rejected_total {self.requests_rejected}",
            "# TYPE dflashkit_prompt_tokens_total counter", f"dflashkit_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE dflashkit_generated_tokens_total counter",
            f"dflashkit_generated_tokens_total {self.generated_tokens}",
            "# TYPE dflashkit_target_passes_total counter", f"dflashkit_target_passes_total {self.target_passes}",
            "# HELP dflashkit_draft_tokens_total draft nodes the target verified, by who proposed them",
            "# TYPE dflashkit_draft_tokens_total counter",
            *[f'dflashkit_draft_tokens_total{{source="{k}"}} {v}' for k, v in self.drafted.items()],
            "# HELP dflashkit_accepted_tokens_total draft nodes the target accepted, by who proposed them",
            "# TYPE dflashkit_accepted_tokens_total counter",
            *[f'dflashkit_accepted_tokens_total{{source="{k}"}} {v}' for k, v in self.accepted.items()],
            "# HELP dflashkit_tau tokens committed per verify cycle: (passes + accepted) / passes",
            "# TYPE dflashkit_tau gauge", f"dflashkit_tau {tau:.4f}",
            "# TYPE dflashkit_accepted_per_position_total counter",
        ]
        lines += [f'dflashkit_accepted_per_position_total{{position="{j + 1}"}} {c}'
                  for j, c in enumerate(self.accepted_per_position)]
        lines.append("# TYPE dflashkit_request_latency_seconds histogram")
        for b, c in zip(self.latency_buckets, self.latency_counts):
            lines.append(f'dflashkit_request_latency_seconds_bucket{{le="{b}"}} {c}')
        lines += [f'dflashkit_request_latency_seconds_bucket{{le="+Inf"}} {self.latency_n}',
                  f"dflashkit_request_latency_seconds_sum {self.latency_sum:.6f}",
                  f"dflashkit_request_latency_seconds_count {self.latency_n}"]
        names = {"steps": "policy_steps_total", "drafter_steps": "policy_drafter_steps_total",
                 "plain_steps": "policy_plain_steps_total", "nodes": "policy_verified_draft_nodes_total",
                 "width": "policy_verify_width_total"}
        for key, name in names.items():  # per-step choices: how often it drafted, how much it verified
            lines.append(f"# TYPE dflashkit_{name} counter")
            lines += [f'dflashkit_{name}{{setting="{k}"}} {v[key]}' for k, v in (policy or {}).items()]
        return "\n".join(lines) + "\n"


class Scheduler:
    """Owns the engine in one thread; requests join and leave the running batches between steps."""

    def __init__(self, engine: DFlashEngine, max_batch: int, max_queue: int, max_len: int,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        """prefill_chunk: the prompt tokens prefilled between two decoding steps (0: every prompt whole at once)."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise DFlashError(f"--max-batch must be >= 1 (got {max_batch}): the sequences decoded together.")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise DFlashError(f"--max-queue must be >= 1 (got {max_queue}): the requests that may wait for a slot.")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise DFlashError(f"--prefill-chunk must be >= 0 (got {prefill_chunk}): prompt tokens per step, 0 = off.")
        self.engine, self.max_batch, self.max_len = engine, max_batch, max_len
        self.prefill_chunk = prefill_chunk
        self.ar_config = DecodeConfig.autoregressive()
        self.pending: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.jobs: dict[int, Job] = {}
        # Admitted jobs whose prompts are not prefilled yet, in arrival order, with their chunked prefill once begun
        self.prefilling: list[tuple[Job, PromptPrefill | None]] = []
        self.metrics = Metrics()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._draining = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the engine loop in a new thread (tests, embedding). `dflashkit serve` calls `run()` on its main
        thread instead: see `run`."""
        self.thread = threading.Thread(target=self.run, name="dflashkit-engine", daemon=True)
        self.thread.start()

    def run(self) -> None:
        """The engine loop, in the calling thread, until `shutdown`.

        Why the thread matters: torch's OpenMP runtime keeps one thread team per thread that ran a parallel op.
        Once two teams exist (the thread that loaded the model, and an engine thread) and their threads outnumber
        the cores, libgomp stops spinning between parallel regions and every op pays a wake-up: on 2 cores a
        one-token decode step got ~1.5x slower. Running the loop on the thread that loaded the model avoids that."""
        try:
            self._run()
        finally:
            self._done.set()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop admitting; in-flight requests finish (drain), then the engine loop returns."""
        self._draining = True
        self._stop.set()
        self._done.wait(timeout)

    @property
    def context(self) -> int:
        """The most prompt + max_tokens one request may ask for (`--max-len` minus one verify pass)."""
        return self.max_len - self.engine.config.verify_width - 1

    def submit(self, prompt_ids, sampling: SamplingParams, max_new_tokens: int, stop, logprobs: int | None = None,
               loop=None, speculate: bool = True, stream: bool = True) -> Job:
        """Queue a request. stream: hand each step's tokens (`StepOutput`) to `Job.out`; False: only the end (the
        request's tokens are then read from `Job.seq`), so a JSON response costs the event loop nothing per step."""
        if self._draining:
            raise OverloadError("the server is shutting down")
        width = self.engine.config.verify_width
        # The server's own bound first: it is the one a client can change (the target's is larger, or equal).
        if cache_positions(len(prompt_ids), max_new_tokens, width) > self.max_len:
            raise DFlashError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_new_tokens}) exceeds the "
                              f"server's context of {self.context} tokens (--max-len {self.max_len}); shorten the "
                              "prompt or lower max_tokens.")
        seq = self.engine.sequence(next(self._ids), prompt_ids, sampling, max_new_tokens, stop,
                                   None if speculate else self.ar_config)
        seq.logprobs_k = logprobs
        loop = loop or asyncio.get_running_loop()
        job = Job(seq, loop, asyncio.Queue(), speculate=speculate, stream=stream)
        try:
            self.pending.put_nowait(job)
        except queue.Full:
            self.metrics.requests_rejected += 1
            raise OverloadError("the request queue is full; retry later") from None
        self.metrics.sequences += 1
        return job

    def cancel(self, job: Job) -> None:
        job.cancelled = True  # the worker drops its row before the next step

    def _emit(self, job: Job, item) -> None:
        self._send([(job, item)])

    @staticmethod
    def _send(items: list) -> None:
        """Hand (job, item) pairs to their event loops: ONE wake-up per loop for all of them. Why: the engine
        thread holds the GIL through each forward, and every wake-up of the HTTP thread's loop makes it wait for
        that thread's Python work; one call per job per step was 16 wake-ups a step at 16 requests."""
        loops: dict = {}
        for job, item in items:
            loops.setdefault(job.loop, []).append((job.out, item))
        for loop, batch in loops.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _new_batch(self, speculate: bool, reserve: bool = False):
        """reserve: the long-lived batch of this mode, its cache store allocated for max_batch rows at once."""
        batch = self.engine.new_batch(self.max_len, None if speculate else self.ar_config)
        if reserve:
            batch.reserve(self.max_batch)
        return batch

    def _run(self) -> None:
        # by `Job.speculate`; the AR batch opens with its first request
        batches = {True: self._new_batch(True, reserve=True)}
        while True:
            for j in self.jobs.values():
                if j.cancelled and not j.seq.finished:
                    batches[j.speculate].cancel(j.seq.index)
            # admit queued requests up to max_batch (wait briefly when idle, so the stop flag is still seen)
            while len(self.jobs) + len(self.prefilling) < self.max_batch:
                try:
                    idle = not self.jobs and not self.prefilling
                    job = self.pending.get(timeout=0.05) if idle else self.pending.get_nowait()
                except queue.Empty:
                    break
                if not job.cancelled:
                    self.prefilling.append((job, None))
            if self._stop.is_set() and not self.jobs and not self.prefilling:
                return
            whole = self._prefill_turn(batches)
            for mode in (True, False):
                group = [j for j in whole if j.speculate == mode]
                if group and mode not in batches:
                    batches[mode] = self._new_batch(mode, reserve=True)
                try:
                    if group:
                        self._admit(batches[mode], group)
                    if mode in batches and batches[mode].alive:
                        self._dispatch(batches[mode].step())
                except Exception:  # never let one bad step kill the server, nor one row fail the others
                    log.exception("decoding step failed; isolating the row that fails")
                    batches[mode] = self._recover(mode)
            if self.jobs and not any(b.alive for b in batches.values()):  # every job finished or was cancelled
                self._dispatch([])

    def _prefill_turn(self, batches: dict) -> list[Job]:
        """This turn's prefill work, at most `prefill_chunk` prompt tokens (all of it when 0), in arrival order: a
        prompt that fits what is left of the turn is returned to be prefilled whole (in `_admit`'s groups); one
        longer than a chunk is prefilled a chunk per turn and joins its batch after the last. A turn always makes
        progress: its first prompt fits, or gets a chunk."""
        budget = self.prefill_chunk or float("inf")
        whole, keep = [], []
        for job, pp in self.prefilling:
            if job.cancelled:  # left while waiting for its prefill: it never joined a batch
                job.seq.finished, job.seq.finish_reason = True, "cancelled"
                self._emit(job, None)
                continue
            n = len(prefill_context(job.seq)) if pp is None else pp.remaining
            if budget <= 0 or (pp is None and budget < n <= self.prefill_chunk):  # next turn's
                keep.append((job, pp))
            elif pp is None and n <= budget:
                whole.append(job)
                budget -= n
            else:  # longer than a chunk: this turn's remainder of it
                budget -= self._chunk(job, pp, batches, int(budget), keep)
        self.prefilling = keep
        return whole

    def _chunk(self, job: Job, pp: PromptPrefill | None, batches: dict, n: int, keep: list) -> int:
        """Prefill the next (at most) `n` tokens of `job`, beginning its chunked prefill; after the last chunk it
        joins its batch. A failure fails this job alone. Returns the tokens prefilled."""
        mode = job.speculate
        if mode not in batches:
            batches[mode] = self._new_batch(mode, reserve=True)
        try:
            pp = pp or batches[mode].begin_prefill(job.seq)
            n = min(n, pp.remaining)
            outs = batches[mode].prefill_chunk(pp, n)
        except Exception as e:  # its own prompt: it fails alone; no batch is touched before the last chunk joins
            log.exception("prefilling request %d failed", job.seq.index)
            job.seq.finished, job.seq.finish_reason = True, "error"
            self._emit(job, e)
            return 0
        if outs is None:
            keep.append((job, pp))
        else:
            self.jobs[job.seq.index] = job
            self._dispatch(outs)
        return n

    def _admit(self, batch, new: list[Job]) -> None:
        """Prefill new requests and join them to the batch. A request whose admission fails (its own sampler,
        its own prompt) fails alone: the group is retried one by one, and the running rows are untouched (a
        failed `add` joins nothing)."""
        try:
            outs = batch.add([j.seq for j in new])
        except Exception as e:
            if len(new) == 1:
                log.exception("admitting request %d failed", new[0].seq.index)
                self._emit(new[0], e)
                return
            for j in new:
                self._admit(batch, [j])
            return
        for j in new:
            self.jobs[j.seq.index] = j
        self._dispatch(outs)

    def _recover(self, speculate: bool = True):
        """After a failed step of the `speculate` batch: each of its live rows resumes alone (`DecodeBatch.add` of
        its committed tokens) and takes one step; a row that fails alone is finished with its error, the others
        resume together in a new batch.
        (Resumed rows recompute their context once; in low precision that may round differently from the
        incremental cache, as any batch change does.)"""
        survivors = []
        for j in [j for j in self.jobs.values() if not j.seq.finished and j.speculate == speculate]:
            try:
                solo = self._new_batch(speculate)
                solo.add([j.seq])
                outs = solo.step()
            except Exception as e:
                log.exception("request %d fails on its own: finishing it with the error", j.seq.index)
                j.seq.finished, j.seq.finish_reason = True, "error"
                self._emit(j, e)
                del self.jobs[j.seq.index]
                continue
            self._dispatch(outs)
            survivors.append(j)
        batch = self._new_batch(speculate, reserve=True)
        alive = [j for j in survivors if not j.seq.finished]
        try:
            if alive:
                batch.add([j.seq for j in alive])
        except Exception as e:  # each stepped alone, but not together: nothing left to isolate
            log.exception("resuming %d requests failed", len(alive))
            for j in alive:
                self._emit(j, e)
                del self.jobs[j.seq.index]
            batch = self._new_batch(speculate, reserve=True)
        self._dispatch([])
        return batch

    def _dispatch(self, outs) -> None:
        items = []
        for o in outs:
            job = self.jobs.get(o.index)
            if job is not None and o.tokens and job.stream:
                items.append((job, o))
        for idx, job in list(self.jobs.items()):
            if job.seq.finished:
                self.metrics.observe(job.seq.stats, time.perf_counter() - job.seq.t_arrival)
                items.append((job, None))
                del self.jobs[idx]
        self._send(items)


def _deliver(batch: list) -> None:
    """On the event loop: put each item into its job's queue."""
    for out, item in batch:
        out.put_nowait(item)


class OverloadError(Exception):
    pass
