"""Exactness of a benchmark run: where greedy outputs part from the engine's own AR output, and whether that
point is a near-tie of rounding (the top-2 logit gap within 2 ulps, or within the block-vs-one-token rounding
noise measured on the run's own AR outputs).
"""

from __future__ import annotations

import math

import torch

def near_tie_threshold(top1: float, dtype: torch.dtype) -> float:
    """Largest top-2 gap that still counts as a tie of rounding: 2 ulps of the top logit in half precision,
    1e-3 in float32 (the project's convention), 1e-9 in float64."""
    if dtype in (torch.bfloat16, torch.float16):
        mant = 7 if dtype == torch.bfloat16 else 10
        return 2 * 2.0 ** (math.floor(math.log2(max(abs(top1), 1e-30))) - mant)
    return 1e-3 if dtype == torch.float32 else 1e-9


@torch.no_grad()
def rounding_noise(target, prompt: list[int], tokens: list[int], block: int, seed: int = 0) -> list[dict]:
    """How far the verify path's rounding moves the target's top-2 gap, measured on one greedy sequence.

    prompt + tokens is an AR greedy output. The target runs over it twice: one token per forward (AR's path), and
    in blocks of `block` tokens that advance 1-4 positions at a time (a verify step at tau ~2: the rows past the
    accepted prefix are overwritten by the next block, as in DFlash). Per generated position: AR's top-2 gap,
    the same two tokens' gap on the block path, |difference| ("noise") and whether the block path's argmax
    differs ("flip"). Both paths are exact in exact arithmetic; everything measured here is rounding.
    """
    import random

    rng = random.Random(seed)
    P, n = len(prompt), len(tokens)
    seq = torch.tensor([prompt + tokens], device=target.device)
    rows: dict[str, dict[int, torch.Tensor]] = {"one": {}, "block": {}}
    for path, got in rows.items():
        cache = target.new_cache(1, P + n + block + 1)
        h, _ = target.forward(seq[:, :P], torch.arange(P, device=seq.device)[None], cache, kv_len=P, taps=False)
        got[0] = target.logits(h[:, -1:]).float()[0, 0]  # predicts tokens[0]; the same prefill on both paths
        p = P  # position of the next forward's first token (for blocks: the anchor of a verify step)
        while p - P < n - 1:
            q = 1 if path == "one" else min(block, P + n - p)
            h, _ = target.forward(seq[:, p:p + q], torch.arange(p, p + q, device=seq.device)[None], cache,
                                  kv_len=p + q, taps=False)
            logits = target.logits(h).float()[0]
            keep = 1 if path == "one" else min(rng.randint(1, 4), q)  # accepted + bonus rows of a verify step
            for j in range(keep):  # row j at position p + j predicts tokens[p - P + j + 1]
                got.setdefault(p - P + j + 1, logits[j])
            p += keep
    out = []
    for i in range(n):
        a, b = rows["one"][i], rows["block"][i]
        t1, t2 = a.topk(2).indices.tolist()
        ga, gb = float(a[t1] - a[t2]), float(b[t1] - b[t2])
        out.append({"gap": ga, "noise": abs(ga - gb), "flip": int(b.argmax()) != t1})
    return out


def noise_summary(rows: list[dict]) -> dict:
    """The measured size of a rounding tie: `max` is the bound `mismatches` uses."""
    noise = sorted(r["noise"] for r in rows)
    return {"positions": len(rows), "max": round(noise[-1], 6) if noise else 0.0,
            "p99": round(noise[min(len(noise) - 1, int(0.99 * (len(noise) - 1) + 0.5))], 6) if noise else 0.0,
            "flips": sum(r["flip"] for r in rows),
            "max_gap_flipped": round(max((r["gap"] for r in rows if r["flip"]), default=0.0), 6)}


def calibrate_noise(target, tok, items, ar_outputs, block: int, n_prompts: int) -> tuple[dict, list[dict]]:
    """`rounding_noise` over the first turns of the first `n_prompts` items (AR outputs): (its `noise_summary`
    with the prompt count and block size, the per-position rows)."""
    from tqdm import tqdm

    from ..loader import encode_chat

    rows, off = [], 0
    for k, item in enumerate(tqdm(items[:n_prompts], desc="rounding noise", unit="prompt")):
        if len(ar_outputs[off]) > 1:
            rows += rounding_noise(target, encode_chat(tok, item[0]), ar_outputs[off], block, seed=k)
        off += len(item)
    return {"prompts": min(n_prompts, len(items)), "block_size": block, **noise_summary(rows)}, rows


def is_near_tie(gap: float, threshold: float, noise_bound: float) -> bool:
    """The near-tie rule: the top-2 gap is within 2 ulps (`near_tie_threshold`) or within the measured noise."""
    return gap <= max(threshold, noise_bound)


def first_divergence(target, prompt: list[int], a: list[int], b: list[int], noise_bound: float = 0.0) -> dict | None:
    """Where two greedy continuations part, and the target's top-2 logit gap there (one forward over the common
    prefix). None when they do not part at a token choice (equal, or one is a prefix: a stop)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None
    ids = torch.tensor([prompt + a[:i]], device=target.device)
    top = target.reference_logits(ids)[0, -1].float().topk(2).values.tolist()
    limit = near_tie_threshold(top[0], target.dtype)
    gap = top[0] - top[1]
    return {"index": i, "gap": gap, "threshold": limit, "noise_bound": noise_bound,
            "near_tie": is_near_tie(gap, limit, noise_bound)}


def mismatches(target, tok, items, ar_outputs, outputs, noise: dict | None = None) -> dict:
    """Greedy outputs that differ from AR; a difference counts as a near-tie when, at the first differing token,
    the target's top-2 logit gap (one forward over the AR prefix) is within `near_tie_threshold` (2 ulps) or
    within the rounding noise measured on this run's own sequences (`rounding_noise`, `noise["max"]`): a gap
    that the block-vs-one-token rounding difference was seen to move by at least as much.
    Outputs are flat, one per turn in item order. Multi-turn items are compared turn by turn up to the first
    differing turn (later turns follow different histories)."""
    from ..loader import encode_chat

    total = near = near2 = 0
    off = 0
    details = []
    for k, item in enumerate(items):
        history: list[dict] = []
        for t, user in enumerate(item):
            a, b = ar_outputs[off + t], outputs[off + t]
            history.append({"role": "user", "content": user})
            if a != b:
                total += 1
                d = first_divergence(target, encode_chat(tok, history), a, b, (noise or {}).get("max", 0.0))
                near += d is not None and d["near_tie"]
                near2 += d is not None and d["gap"] <= d["threshold"]
                details.append({"item": k, "turn": t, **({key: (round(v, 5) if isinstance(v, float) else v)
                                                          for key, v in d.items()} if d else {"stop_only": True})})
                break
            history.append({"role": "assistant", "content": tok.decode(a, skip_special_tokens=True)})
        off += len(item)
    # details: where each differing output parts from AR and the target's top-2 gap there, to audit the rule
    return {"count": total, "near_ties": int(near), "near_ties_2ulp": int(near2), "details": details}
