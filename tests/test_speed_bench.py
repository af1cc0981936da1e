"""SPEED-Bench read as NVIDIA publishes it (parquet / JSONL, categories, multi-turn, placeholders), and the
SPEED-Bench-like categories built offline."""

import json

import pytest

from dflashkit import DFlashError
from dflashkit.bench.datasets import check_dataset, load_dataset, load_sets
from dflashkit.bench.speed_bench import PLACEHOLDER, by_category, read_speed_bench

FIELDS = ("question_id", "category", "sub_category", "turns", "source", "src_id", "difficulty", "multiturn")


def record(qid, category, turns, **extra):
    rec = {"question_id": qid, "category": category, "sub_category": "x", "turns": turns, "source": "src",
           "src_id": f"src_{qid}", "difficulty": "easy", "multiturn": len(turns) > 1}
    return {**rec, **extra}


RECORDS = [record("c1", "coding", ["Write a sort."]),
           record("m1", "math", ["What is 2 + 2?", "And times 3?"]),  # multi-turn: asked turn by turn
           record("c2", "coding", ["Write a parser."]),
           record("w1", "writing", ["A poem, please."])]


def write_parquet(path, records):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(records), path)


def test_the_published_schema_reads_from_parquet_with_categories_and_turns(tmp_path):
    d = tmp_path / "data" / "speed" / "qualitative"  # where specdec_bench's prepare step writes it
    d.mkdir(parents=True)
    write_parquet(d / "test.parquet", RECORDS)
    items = read_speed_bench(tmp_path / "data" / "speed")
    assert [(i.question_id, i.category, i.turns) for i in items] == [
        (r["question_id"], r["category"], r["turns"]) for r in RECORDS]
    assert by_category(items) == {"coding": [["Write a sort."], ["Write a parser."]],
                                  "math": [["What is 2 + 2?", "And times 3?"]], "writing": [["A poem, please."]]}
    assert by_category(items, limit=1)["coding"] == [["Write a sort."]]
    sets = load_sets("speed-bench", speed_bench_dir=str(d))
    assert list(sets) == ["speed-bench/coding", "speed-bench/math", "speed-bench/writing"]
    assert sets["speed-bench/math"] == [["What is 2 + 2?", "And times 3?"]]
    assert load_dataset("speed-bench", speed_bench_dir=str(d / "test.parquet")) == [r["turns"] for r in RECORDS]


def test_jsonl_in_the_same_schema_and_the_older_prompt_files(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:2]))
    (tmp_path / "b.jsonl").write_text('{"prompt": "q1"}\n\n{"turns": ["t1", "t2"]}\n')
    sets = load_sets("speed-bench", speed_bench_dir=str(tmp_path))
    assert sets == {"speed-bench/coding": [["Write a sort."]], "speed-bench/math": [["What is 2 + 2?", "And times 3?"]],
                    "speed-bench/all": [["q1"], ["t1", "t2"]]}  # no category: one set named "all"


def test_placeholders_and_bad_files_are_refused_with_the_remedy(tmp_path):
    placeholder = record("r9", "rag", [PLACEHOLDER + "\n\nContext: {context}"])
    write_parquet(tmp_path / "test.parquet", RECORDS + [placeholder])
    for call in (lambda: read_speed_bench(tmp_path), lambda: check_dataset("speed-bench", str(tmp_path))):
        with pytest.raises(DFlashError, match=r"r9 \(rag\).*placeholder.*prepare_data.py --dataset speed"):
            call()
    with pytest.raises(DFlashError, match="speed-bench-dir.*speed-bench-like"):
        check_dataset("speed-bench")
    with pytest.raises(DFlashError, match="does not exist"):
        read_speed_bench(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="no .parquet or .jsonl"):
        read_speed_bench(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text(json.dumps(record("e1", "qa", [])) + "\n")
    with pytest.raises(DFlashError, match="x.jsonl record 1 has no usable 'turns'"):
        read_speed_bench(bad)
    (bad / "x.jsonl").write_text(json.dumps(record("e2", "qa", ["a", "b"], multiturn=False)) + "\n")
    with pytest.raises(DFlashError, match="e2 says multiturn: false"):
        read_speed_bench(bad)
    (bad / "x.jsonl").write_text("{not json\n")
    with pytest.raises(DFlashError, match="line 1 is not JSON"):
        read_speed_bench(bad)
    (bad / "x.jsonl").unlink()
    (bad / "y.parquet").write_bytes(b"not parquet")
    with pytest.raises(DFlashError, match="cannot read .*y.parquet as parquet"):
        read_speed_bench(bad)


def test_speed_bench_like_categories_are_built_offline_from_prompts_never_tuned_on():
    from transformers import AutoTokenizer

    from dflashkit import data
    from dflashkit.bench.categories import LONG_BUCKETS, UNTUNED_HUMANEVAL
    from dflashkit.loader import resolve_target_dir

    tok = AutoTokenizer.from_pretrained(resolve_target_dir())
    sets = load_sets("speed-bench-like", limit=20, tok=tok)
    cats = {k.split("/", 1)[1]: v for k, v in sets.items()}
    core = ["coding", "math", "extraction", "stem", "humanities", "qa", "writing", "multilingual", "long-1k"]
    assert all(sum(len(it) for it in cats[c]) >= 20 for c in core)  # >= 8 categories x 20 prompts (turns)
    assert {"long-2k", "long-8k"} <= set(cats)
    he = load_dataset("humaneval")
    assert cats["coding"] == [he[i] for i in UNTUNED_HUMANEVAL[:20]] and 0 not in UNTUNED_HUMANEVAL
    mt = {q["turns"][0]: k for k, q in enumerate(data.mtbench_questions())}
    assert all(mt[it[0]] >= 50 for c in ("extraction", "stem", "humanities") for it in cats[c])
    for name, size in LONG_BUCKETS.items():  # each long prompt is its bucket's size in the target's tokens (+-1)
        assert all(abs(len(tok(it[0], add_special_tokens=False)["input_ids"]) - size) <= 2 for it in cats[name])
    held = {r["messages"][0]["content"].strip() for r in data.build_prompts()[0] if r["split"] == "heldout"}
    assert all(it[0] in held for c in ("qa", "writing") for it in cats[c])  # held-out first turns only
    assert all(it[0].split("\n\n", 1)[1] in held for it in cats["multilingual"])
    firsts = [it[0] for v in cats.values() for it in v]
    assert len(set(firsts)) == len(firsts)  # no prompt twice
    with pytest.raises(DFlashError, match="per category"):
        load_dataset("speed-bench-like")


def test_bench_reports_each_category_with_its_table_and_chart(tmp_path):
    from dflashkit.bench import BenchConfig, markdown, run_bench, write_report

    d = tmp_path / "speed"
    d.mkdir()
    (d / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    cfg = BenchConfig(datasets=["speed-bench"], speed_bench_dir=str(d), limit=1, max_new_tokens=4, block_sizes=[4],
                      methods=["ar", "dflash"], out=str(tmp_path / "out"), dtype="float32")
    report = write_report(run_bench(cfg), tmp_path / "out")
    res = report["results"]
    assert list(res) == ["speed-bench/coding", "speed-bench/math", "speed-bench/writing"]  # limit: 1 per category
    assert res["speed-bench/math"]["ar"]["turns"] == 2  # the multi-turn item, answered turn by turn
    assert all(set(rows) == {"ar", "dflash-b4"} and rows["dflash-b4"]["mismatches_vs_ar"]["count"] == 0
               for rows in res.values())
    md = markdown(report)
    assert "Per category, speed-bench" in md and "| math | 2 | dflash-b4 |" in md
    assert (tmp_path / "out" / "categories.png").stat().st_size > 1000
