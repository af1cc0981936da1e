"""The benchmark harness: dataset loaders, metric arithmetic, near-tie rule, report schema."""

import json
import time

import pytest
import torch

from dflashkit import DecodeConfig, DFlashError, LookupParams
from dflashkit.bench import (BenchConfig, Turn, aggregate, load_dataset, load_prompt_file, markdown,
                             near_tie_threshold, run_bench, run_interleaved, turn_order, write_report)


def test_dataset_loaders():
    he = load_dataset("humaneval")
    assert len(he) == 164 and all(len(x) == 1 and "def " in x[0] for x in he)
    mt = load_dataset("mt-bench")
    assert len(mt) == 80 and all(len(x) == 2 for x in mt)
    assert load_dataset("mt-bench-t1") == [x[:1] for x in mt]  # first turns only
    assert len(load_dataset("math")) == 30 and "boxed" in load_dataset("math")[0][0]
    assert len(load_dataset("humaneval", limit=5)) == 5
    with pytest.raises(DFlashError, match="speed-bench-dir"):
        load_dataset("speed-bench")
    with pytest.raises(DFlashError, match="unknown dataset"):
        load_dataset("gsm9k")


def test_heldout_split_is_disjoint_from_training():
    from dflashkit.data import build_prompts
    records, report = build_prompts()
    held = [r for r in records if r["split"] == "heldout"]
    assert len(load_dataset("sharegpt-heldout")) == len(held) == report["heldout"] > 300
    assert not {r["id"] for r in held} & {r["id"] for r in records if r["split"] == "train"}


def test_second_turn_prompts_follow_the_first_exchange(tmp_path):
    """`build_prompts(second_turns=True)`: a conversation that opens human, gpt, human also gives its second user turn
    after the first exchange (same split as its first turn); shorter ones, or a second turn that overlaps a
    benchmark, give none."""
    from dflashkit.data import build_prompts, humaneval_prompts

    bench_text = humaneval_prompts()[0]["prompt"]
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                           {"from": "human", "value": "tell me more"}]},
             {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
             {"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                           {"from": "human", "value": bench_text}]}]
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps(c) + "\n" for c in convs))
    records, report = build_prompts(0.5, str(f), second_turns=True)
    by_id = {r["id"]: r for r in records}
    assert set(by_id) == {"a", "a/t2", "b", "c"} and report["second_turns"] == 1
    assert [m["role"] for m in by_id["a/t2"]["messages"]] == ["user", "assistant", "user"]
    assert by_id["a/t2"]["messages"][2]["content"] == "tell me more" and by_id["a/t2"]["split"] == by_id["a"]["split"]
    assert {r["id"] for r in build_prompts(0.5, str(f))[0]} == {"a", "b", "c"}  # off by default
    # the CLI door: `dflashkit data prompts --source F --second-turns`
    from dflashkit.cli import main

    assert main(["data", "prompts", "--out", str(tmp_path / "p"), "--source", str(f), "--second-turns"]) == 0
    written = [json.loads(x) for x in (tmp_path / "p" / "prompts.jsonl").read_text().splitlines()]
    assert [r["id"] for r in written] == [r["id"] for r in records] and written[1]["messages"] == by_id["a/t2"]["messages"]


def test_prompt_file_and_speed_bench_dir(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "x"},'
                 ' {"role": "user", "content": "c"}]}\n')
    assert load_prompt_file(str(f)) == [["a"], ["b", "c"]]
    f.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(DFlashError, match="line 2"):
        load_prompt_file(str(f))
    (tmp_path / "sb").mkdir()
    (tmp_path / "sb" / "qa.jsonl").write_text('{"prompt": "q1"}\n{"turns": ["t1", "t2"]}\n')
    assert load_dataset("speed-bench", speed_bench_dir=str(tmp_path / "sb")) == [["q1"], ["t1", "t2"]]
    # NVIDIA's own schema, categories and placeholders: tests/test_speed_bench.py


def test_metric_arithmetic():
    turns = [Turn([1] * 9, accepted=[3, 0, 1], new_tokens=9, ttft_s=0.1, decode_s=1.0),
             Turn([1] * 5, accepted=[0, 2], new_tokens=5, ttft_s=0.3, decode_s=1.0)]
    r = aggregate(turns, span=4)
    assert r["tau"] == pytest.approx((4 + 1 + 2 + 1 + 3) / 5)  # a + 1 per cycle: the bonus token counts
    assert r["acceptance"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])  # cumulative: cycles accepting >= j+1 drafts
    assert 1 + sum(r["acceptance"]) == pytest.approx(r["tau"])
    assert r["accepted_length_histogram"] == [2, 1, 1, 1] and sum(r["accepted_length_histogram"]) == 5
    assert r["tokens_per_s"] == pytest.approx((8 + 4) / 2.0) and r["ttft_ms"] == pytest.approx(200.0)
    assert aggregate([Turn([1, 2], new_tokens=2, decode_s=0.5)], 1)["tau"] == 1.0


def test_methods_run_interleaved_item_by_item_and_follow_their_own_answers():
    """Every item runs under every method before the next item (host drift hits all methods alike), and a later
    turn of an item carries the SAME method's previous answer."""
    calls = []

    class Tok:
        chat_template = "fake"

        def apply_chat_template(self, history, **kw):
            return [len(history)] + [ord(c) for m in history for c in m["content"]]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    class Fake:
        def __init__(self, name):
            self.name = name

        def run(self, prompts, max_new):
            calls.append((self.name, prompts[0]))
            return [Turn([ord(self.name)], new_tokens=1)]

    items = [["a", "b"], ["c"]]
    runs = run_interleaved({"x": Fake("x"), "y": Fake("y")}, items, Tok(), 4, "test")
    order = [(n, chr(p[1])) for n, p in calls]
    assert order == [("x", "a"), ("x", "a"), ("y", "a"), ("y", "a"), ("x", "c"), ("y", "c")]
    second_turns = [p for _, p in calls if p[0] == 3]  # user, assistant, user: the method's own answer inside
    assert [chr(p[2]) for p in second_turns] == ["x", "y"]
    assert [len(v) for v in runs.values()] == [3, 3]


def test_accepted_lengths_from_vllm_counters():
    from dflashkit.bench import accepted_from_counters

    # 4 drafts accepting 0, 1, 3, 3 tokens -> per position (>= 1, >= 2, >= 3) accepted: 3, 2, 2
    acc = accepted_from_counters(4, [3, 2, 2])
    assert sorted(acc) == [0, 1, 3, 3]
    assert aggregate([Turn([0] * 11, acc, 11, 0.0, 1.0)], 4)["tau"] == pytest.approx(1 + 7 / 4)
    assert accepted_from_counters(0, [0, 0]) == []


def test_rounding_noise_is_zero_in_float64_and_measured_in_bfloat16():
    from conftest import make_target

    from dflashkit.bench import noise_summary, rounding_noise

    for arch in ("llama", "gemma3"):  # gemma3: sliding-window layers see the block path too
        t64 = make_target(arch, torch.float64)
        prompt = [5, 9, 17, 33, 4, 60, 7]
        ar = [int(x) for x in torch.randint(4, 90, (40,), generator=torch.Generator().manual_seed(1))]
        rows = rounding_noise(t64, prompt, ar, block=8)
        assert len(rows) == 40 and all(r["gap"] >= 0 for r in rows)
        summary = noise_summary(rows)  # both paths are exact in exact arithmetic: float64 leaves ~1e-13
        assert summary["positions"] == 40 and summary["max"] < 1e-9 and summary["flips"] == 0
        t16 = make_target(arch, torch.bfloat16)
        rows16 = rounding_noise(t16, prompt, ar, block=8)
        assert noise_summary(rows16)["max"] > 0  # bf16: a block forward rounds differently from a one-token one


def test_near_tie_uses_the_measured_noise_bound():
    from conftest import make_target

    from dflashkit.bench import first_divergence

    t = make_target("llama", torch.float64)
    prompt = [5, 9, 17]
    with torch.no_grad():
        logits = t.reference_logits(torch.tensor([prompt]))[0, -1]
    top2 = logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    a, b = [int(top2.indices[0])], [int(top2.indices[1])]
    d = first_divergence(t, prompt, a, b)
    assert d["index"] == 0 and d["gap"] == pytest.approx(gap) and not d["near_tie"]  # a real gap in float64
    assert first_divergence(t, prompt, a, b, noise_bound=gap + 1e-6)["near_tie"]
    assert not first_divergence(t, prompt, a, b, noise_bound=gap / 2)["near_tie"]
    assert first_divergence(t, prompt, a, a) is None


def test_near_tie_threshold():
    assert near_tie_threshold(20.0, torch.bfloat16) == pytest.approx(0.25)  # 2 ulps at 16..32 (7-bit mantissa)
    assert near_tie_threshold(3.0, torch.bfloat16) == pytest.approx(2 * 2 ** -6)
    assert near_tie_threshold(20.0, torch.float32) == 1e-3
    assert near_tie_threshold(20.0, torch.float64) == 1e-9


@pytest.mark.real
def test_report_schema_on_the_real_target(tmp_path, monkeypatch):
    import dflashkit.bench.peers as peers

    monkeypatch.setattr(peers, "vllm_python", lambda: None)  # as on a machine without scripts/vllm-env.sh
    cfg = BenchConfig(datasets=["humaneval", "mt-bench"], limit=1, max_new_tokens=6, block_sizes=[4],
                      methods=["ar", "dflash", "hf", "hf-lookup", "llamacpp", "vllm"], out=str(tmp_path), dtype="float32",
                      command="dflashkit bench (test)")
    report = write_report(run_bench(cfg), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["settings"]["command"] == "dflashkit bench (test)"
    assert {"platform", "threads", "torch", "dtype"} <= set(saved["machine"]) and saved["versions"]["torch"]
    assert "scripts/vllm-env.sh" in saved["skipped"]["vllm"]  # an absent peer is skipped with a message, never silently
    optional = {"llamacpp"} - set(saved["skipped"])
    for d in ("humaneval", "mt-bench"):
        assert set(saved["results"][d]) == {"ar", "dflash-b4", "hf", "hf-lookup"} | optional
        for m, r in saved["results"][d].items():
            assert {"tau", "tokens_per_s", "speedup_vs_ar", "tpot_ms", "ttft_ms", "acceptance",
                    "accepted_length_histogram"} <= set(r)
            if m != "ar":
                assert set(r["mismatches_vs_ar"]) == {"count", "near_ties", "near_ties_2ulp", "details"}
        noise = saved["results"][d]["ar"]["rounding_noise"]  # the near-tie bound, measured on this run
        assert noise["positions"] > 0 and noise["max"] >= 0 and noise["block_size"] == 4
        assert saved["results"][d]["ar"]["speedup_vs_ar"] == 1.0
        dfl = saved["results"][d]["dflash-b4"]
        assert len(dfl["acceptance"]) == 3 and 1 + sum(dfl["acceptance"]) == pytest.approx(dfl["tau"], abs=1e-3)
    assert saved["results"]["mt-bench"]["ar"]["turns"] == 2  # both turns ran
    import gzip

    outputs = json.loads(gzip.open(tmp_path / "outputs.json.gz", "rt").read())  # token ids, kept for audits
    assert "outputs" not in saved and set(outputs["mt-bench"]) == set(saved["results"]["mt-bench"])
    assert len(outputs["mt-bench"]["ar"]) == 2 and all(0 < len(t) <= 6 for t in outputs["mt-bench"]["ar"])
    assert (tmp_path / "speedup.png").stat().st_size > 1000 and (tmp_path / "acceptance.png").exists()
    assert "| humaneval | dflash-b4 |" in markdown(report)


@pytest.mark.real
def test_sweeps_block_size_temperature_and_batch(tmp_path):
    cfg = BenchConfig(datasets=["humaneval"], limit=2, max_new_tokens=6, block_sizes=[2, 4], temperatures=[1.0],
                      batch_sizes=[1, 2], methods=["ar", "dflash", "dflash-lookup", "lookup"], out=str(tmp_path),
                      dtype="float32", lookup_block_sizes=[4],
                      decode=DecodeConfig(lookup=LookupParams(max_tokens=4, skip_drafter_n=2), policy="adaptive"))
    report = write_report(run_bench(cfg), tmp_path)
    rows = report["results"]["humaneval"]
    plain = {"ar", "dflash-b2", "dflash-b4", "dflash-b4-lookup4-adaptive", "lookup4"}
    assert set(rows) == plain | {f"{m}@T1" for m in plain}
    assert len(rows["lookup4"]["acceptance"]) == 4 and len(rows["dflash-b4-lookup4-adaptive"]["acceptance"]) == 4
    assert "mismatches_vs_ar" in rows["dflash-b4-lookup4-adaptive"]
    assert rows["dflash-b4-lookup4-adaptive"]["policy"]["steps"] > 0 and "policy" not in rows["dflash-b4"]
    assert rows["ar@T1"]["speedup_vs_ar"] == 1.0  # each temperature has its own ar baseline
    assert "mismatches_vs_ar" in rows["dflash-b4"] and "mismatches_vs_ar" not in rows["dflash-b4@T1"]
    sweep = report["sweeps"]["batch"]["humaneval"]
    assert set(sweep) == plain
    for r in sweep.values():
        assert set(r) == {"1", "2"} and all(v["tokens_per_s"] > 0 and v["prompts"] == 2 for v in r.values())
    assert sweep["ar"]["2"]["tau"] == 1.0 and sweep["dflash-b4"]["1"]["tau"] >= 1.0
    assert sweep["dflash-b4-lookup4-adaptive"]["2"]["policy"]["steps"] > 0  # its choices at that batch size
    for png in ("block_size.png", "batch.png", "policy.png", "temperature.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert "vs batch size" in markdown(report) and "What the adaptive policy chose" in markdown(report)


def test_cli_data_prompts_from_a_user_file(tmp_path, capsys):
    """`dflashkit data prompts --source FILE` end to end through the CLI entry point (no model needed)."""
    import json

    from dflashkit.cli import main
    from dflashkit.data import read_prompts

    src = tmp_path / "mine.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Explain topic number {i} of my own codebase in detail."}) + "\n"
                           for i in range(60)) + json.dumps({"prompt": "   "}) + "\n")
    assert main(["data", "prompts", "--source", str(src), "--out", str(tmp_path / "p"), "--held-out", "0.2"]) == 0
    report = json.loads(capsys.readouterr().out)
    records = read_prompts(report["prompts"])
    assert len(records) == 60 and {r["split"] for r in records} == {"train", "heldout"}
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["dropped_empty"] == 1
    src.write_text("not json\n")
    assert main(["data", "prompts", "--source", str(src), "--out", str(tmp_path / "q")]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err


def test_peer_rows_compare_with_their_own_engines_ar():
    """`speedup_vs_own_ar`: llama.cpp's DFlash rows against llama-server's AR, vLLM's against vLLM's, ours against
    ours (also at a temperature); the llama-server cycle parser reads its trace lines."""
    from dflashkit.bench.llamacpp import ACCEPTED
    from dflashkit.bench.runner import own_ar

    assert own_ar("llamacpp-dflash-b16-v16384") == own_ar("llamacpp-server") == "llamacpp-server"
    assert own_ar("vllm-dflash-b8") == own_ar("vllm") == "vllm" and own_ar("hf-lookup") == "hf"
    assert own_ar("dflash-b16-tree20p0.03-lookup16-adaptive") == "ar" and own_ar("dflash-b16@T0.7") == "ar@T0.7"
    assert own_ar("zlab-b16") is None
    log = ("slot update_slots: id  0 | task 0 | accepted  3/15 draft tokens\n"
           "slot update_slots: id  0 | task 0 | accepted 12/15 draft tokens\n")
    assert [int(a) for a, _ in ACCEPTED.findall(log)] == [3, 12]


def test_lockstep_turn_order_balances_who_goes_first_and_who_follows_whom():
    """Over 2 x n rounds every method goes first equally often AND follows every other method equally often (the
    turns are cyclic: the first follows the last of the round before); rotation alone keeps one cycle, where the
    default always followed the fixed tree."""
    from collections import Counter

    names = ["ar", "fixed", "adaptive"]
    orders = [turn_order(names, k) for k in range(2 * len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert Counter(o[0] for o in orders) == Counter({m: 2 for m in names})
    follows = Counter((o[i - 1], o[i]) for o in orders for i in range(len(o)))
    assert follows == Counter({(a, b): 3 for a in names for b in names if a != b})
    assert turn_order(names, 0) == names and turn_order(names, 1) == names[::-1]


def test_batch_sweep_runs_every_chunk_each_round_in_changing_orders():
    """`--sweep-rounds`: each method runs every chunk once per round, and a chunk's methods do not take their turns
    in the same order every round (the order a method runs in moves its time: `turn_order`)."""
    from dflashkit.bench.runner import batch_sweep

    calls = []

    class Method:
        def __init__(self, name):
            self.name = name

        def run(self, chunk, max_new):
            calls.append((self.name, tuple(p[0] for p in chunk)))
            time.sleep(0.02)  # the chunk's prefill took its first 10 ms (each row's first token came then)
            return [Turn(tokens=[1] * max_new, accepted=[0] * max_new, new_tokens=max_new, ttft_s=0.01)
                    for _ in chunk]

        def policy_stats(self):
            return None

    prompts = [[i] for i in range(16)]  # 4 chunks of 4: with two methods the plain turn order repeats each round
    out = batch_sweep({"a": Method("a"), "b": Method("b")}, prompts, [4], 3, "t", rounds=2)
    assert out["a"]["4"]["rounds"] == 2 and out["b"]["4"]["tau"] == 1.0
    # the steps' own rate: 2 of each row's 3 tokens over the 10 ms after the prefill, of the ~20 ms a chunk took
    assert out["a"]["4"]["decode_tokens_per_s"] == pytest.approx(out["a"]["4"]["tokens_per_s"] * 4 / 3, rel=0.15)
    for m in "ab":
        assert sorted(c for n, c in calls if n == m) == sorted([tuple(range(i, i + 4)) for i in range(0, 16, 4)] * 2)
    firsts = {}  # chunk -> which method went first, per round
    for i in range(0, len(calls), 2):
        firsts.setdefault(calls[i][1], []).append(calls[i][0])
    assert all(len(set(f)) == 2 for f in firsts.values())
