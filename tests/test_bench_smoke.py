"""``kvctl bench`` end to end at a tiny size: it starts its own daemon, runs every kind
of case once (but the cold-cache pass, which would drop this machine's page cache) and
writes its reports. Numbers are not checked (the benchmark is a
program, see docs/benchmarks/datapath.md); only that each case ran and was recorded.
The Redis baseline runs when ``redis-server`` and redis-py are here, else it is
skipped with a note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvclient import bench
from kvclient.cli import main


@pytest.mark.slow
def test_bench_quick_run_writes_every_case(tmp_path: Path) -> None:
    report, data = tmp_path / "datapath.md", tmp_path / "results.json"
    redis_missing = bench.redis_unavailable()
    argv = ["bench", "--quick", "--no-cold", "--layouts", "tiny", "llama2", "--batches", "1", "4",
            "--repeat", "1", "--json", str(data), "--report", str(report)]  # fmt: skip
    assert main(argv) == 0

    out = json.loads(data.read_text())
    seen = {(r["system"], r["op"], r["path"], r["tier"]) for r in out["results"]}
    for path in ("arena", "inline"):
        for op in ("put", "get", "lookup+get"):
            assert ("kvstore", op, path, "host") in seen, (op, path)
        assert ("kvstore", "miss", path, "miss") in seen
        assert ("kvstore", "get", path, "disk-warm") in seen
    assert ("kvstore", "write-back", "-", "disk") in seen
    assert ("memcpy", "get", "-", "-") in seen
    assert {("grpc-raw", op, "inline", "-") for op in ("get", "put", "echo")} <= seen
    assert (("redis", "get", "-", "host") in seen) == (not redis_missing)
    if redis_missing:
        assert any("Redis baseline skipped" in note for note in out["notes"])
    ok = [r for r in out["results"] if r["system"] == "kvstore" and r["op"] == "get"]
    assert ok and all(r["gbps"] > 0 and not r["note"] for r in ok)

    text = report.read_text()
    assert bench.BEGIN_MARK in text and "### Targets" in text and "| kvstore | get |" in text
    # a second run replaces only its own part of an existing document
    report.write_text("# kept\n\nhand-written\n\n" + text[text.index(bench.BEGIN_MARK) :])
    bench.write_report(report, "new body\n")
    assert report.read_text() == (
        f"# kept\n\nhand-written\n\n{bench.BEGIN_MARK}\nnew body\n{bench.END_MARK}\n"
    )
