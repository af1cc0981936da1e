"""`dflashkit bench-serve`: real server processes driven over HTTP by closed-loop users; the curve's arithmetic."""

import json

import pytest

from dflashkit.bench.serve_curve import CurveConfig, RequestRecord, markdown, throughput_at


def cell(conc, tput, user):
    return {"concurrency": conc, "throughput_tok_s": tput, "per_user_tok_s_median": user, "ttft_s_median": 0.1,
            "ttft_s_p90": 0.2, "requests": 8, "tokens": 64, "wall_s": 1.0, "records": []}


def test_interactivity_is_decode_speed_after_the_first_token_and_the_frontier_picks_the_best_cell():
    r = RequestRecord(tokens=11, ttft_s=0.5, total_s=1.5)
    assert r.decode_tok_s == pytest.approx(10.0)  # 10 tokens after the first in the 1 s after it
    assert RequestRecord(1, 0.2, 0.2).decode_tok_s == 0.0
    cells = [cell(1, 20.0, 20.0), cell(4, 60.0, 15.0), cell(16, 120.0, 7.5)]
    assert throughput_at(cells, 5.0) == 120.0 and throughput_at(cells, 10.0) == 60.0
    assert throughput_at(cells, 20.0) == 20.0 and throughput_at(cells, 25.0) is None
    report = {"cells": {"dflashkit-ar": cells, "dflashkit-ar-again": [cell(c["concurrency"], c["throughput_tok_s"] * 1.1,
                                                                            1.0) for c in cells],
                        "dflashkit": cells}, "skipped": {"vllm": "no vLLM virtualenv: run scripts/vllm-env.sh"},
              "settings": {**CurveConfig(engines=[]).__dict__, "concurrency": [1, 4, 16], "command": "x"},
              "throughput_at": {"dflashkit": {"5.0": 120.0, "10.0": 60.0, "20.0": 20.0, "40.0": None}}}
    md = markdown(report)
    assert "A/A control" in md and "c=1 1.100" in md and "| dflashkit | 120.0 | 60.0 | 20.0 | - |" in md
    assert "skipped `vllm`: no vLLM virtualenv: run scripts/vllm-env.sh" in md


def test_bench_serve_starts_each_server_drives_it_and_stops_it(tmp_path, monkeypatch):
    import dflashkit.bench.servers as servers
    from dflashkit.bench.serve_curve import bench_serve

    monkeypatch.setattr(servers, "vllm_python", lambda: None)  # as on a machine without scripts/vllm-env.sh
    monkeypatch.setenv("DFLASHKIT_LLAMACPP_BIN", str(tmp_path / "no-llamacpp"))
    cfg = CurveConfig(engines=["dflashkit-ar", "dflashkit", "llama-server", "vllm-dflash"], concurrency=[1, 3],
                      min_requests=3, requests_per_user=1, max_tokens=6, max_len=1024, out=str(tmp_path / "out"))
    report = bench_serve(cfg, prompts=4)
    assert set(report["cells"]) == {"dflashkit-ar", "dflashkit"}
    assert "scripts/vllm-env.sh" in report["skipped"]["vllm-dflash"]
    assert "llamacpp-build.sh" in report["skipped"]["llama-server"]  # a missing peer: skipped with its install step
    for rows in report["cells"].values():
        assert [r["concurrency"] for r in rows] == [1, 3] and [r["requests"] for r in rows] == [3, 3]
        for r in rows:
            assert r["tokens"] == sum(q["tokens"] for q in r["records"]) > 0 and r["throughput_tok_s"] > 0
            assert all(0 < q["ttft_s"] <= q["total_s"] and 1 <= q["tokens"] <= 6 for q in r["records"])
    saved = json.loads((tmp_path / "out" / "serve_curve.json").read_text())
    assert saved["settings"]["concurrency"] == [1, 3]
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000
    assert "| dflashkit-ar |" in (tmp_path / "out" / "serve_curve.md").read_text()
    assert (tmp_path / "out" / "logs" / "dflashkit.log").stat().st_size > 0  # its own process, its own log
    import urllib.request
    with pytest.raises(OSError):  # stopped when the command ends
        urllib.request.urlopen(report["servers"]["dflashkit"] + "/health", timeout=5)
    with pytest.raises(ValueError, match="unknown engine"):
        bench_serve(CurveConfig(engines=["tgi"], out=str(tmp_path / "x")))
    with pytest.raises(ValueError, match="concurrency values 1..64"):
        bench_serve(CurveConfig(engines=["dflashkit"], concurrency=[65], out=str(tmp_path / "x")))


def test_cli_bench_serve_refuses_bad_flags_by_name(capsys):
    from dflashkit.cli import main

    assert main(["bench-serve", "--engines", "dflashkit", "--concurrency", "0"]) == 2
    assert "--concurrency values 1..64" in capsys.readouterr().err
    assert main(["bench-serve", "--engines", "sglang"]) == 2
    assert "unknown engine(s) ['sglang']" in capsys.readouterr().err
