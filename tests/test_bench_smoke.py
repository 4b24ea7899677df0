"""``kvctl bench`` end to end at a tiny size: it starts its own daemon, runs every kind
of case once (but the cold-cache pass, which would drop this machine's page cache) and
writes its reports. Numbers are not checked (the benchmark is a
program, see docs/benchmarks/datapath.md); only that each case ran and was recorded.
The Redis baseline runs when ``redis-server`` and redis-py are here, else it is
skipped with a note."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench import harness, servers
from kvbench import report as reports
from kvctl.cli import main


@pytest.mark.slow
def test_bench_quick_run_writes_every_case(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    report, data = tmp_path / "datapath.md", tmp_path / "results.json"
    redis_missing = servers.redis_unavailable()
    argv = ["bench", "--quick", "--no-cold", "--layouts", "tiny", "llama2", "--batches", "1", "4",
            "--repeat", "1", "--json", str(data), "--report", str(report)]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    # a short summary leads: what ran, that a quick run judges no goal, why a baseline
    # was skipped; the full table only when asked (--table)
    assert printed[0].startswith("kvctl bench: ") and " cases in " in printed[0]
    assert printed[1].startswith("quick run: ")
    assert not any(line.startswith(("MISSED", "  MISSED")) for line in printed)
    # each goal shows this run's figure, none met or missed: a quick run judges no
    # goal (the second line says why), never "2 goals met, 8 missed"
    goals = [line.split()[0] for line in printed[2:] if line.startswith("  ")]
    assert goals and set(goals) == {"-"} and "no goal is judged" in printed[1], printed
    assert len(printed) < 25 and not any(line.startswith("system ") for line in printed)
    if redis_missing:
        assert f"note: Redis baseline skipped: {redis_missing}." in printed
        redis_goal = next(line for line in printed if "vs Redis MGET" in line)
        assert "not measured: Redis baseline skipped" in redis_goal

    out = json.loads(data.read_text())
    seen = {(r["system"], r["op"], r["path"], r["tier"]) for r in out["results"]}
    for path in ("arena", "inline"):
        for op in ("put", "get", "lookup+get"):
            assert ("kvstore", op, path, "host") in seen, (op, path)
        assert ("kvstore", "miss", path, "miss") in seen
        assert ("kvstore", "get", path, "disk-warm") in seen
    assert ("kvstore", "put-nowait", "arena", "host") in seen  # puts sent ahead
    assert ("kvstore", "write-back", "-", "disk") in seen  # the first fill of the tier
    assert ("kvstore", "write-back", "-", "disk-reuse") in seen  # again, into freed pages
    assert ("write", "write-back", "-", "disk") in seen  # the first fill's floor
    assert ("memcpy", "get", "-", "-") in seen
    assert ("stream", "put", "-", "-") in seen  # the put's floor
    assert ("pread", "get", "-", "disk-warm") in seen  # the warm disk hit's floor
    assert ("memcpy", "get", "-", "disk-warm") in seen  # measured in turns with it
    assert {("grpc-raw", op, "inline", "-") for op in ("get", "put", "echo")} <= seen
    assert (("redis", "get", "-", "host") in seen) == (not redis_missing)
    if redis_missing:
        assert any("Redis baseline skipped" in note for note in out["notes"])
    ok = [r for r in out["results"] if r["system"] == "kvstore" and r["op"] == "get"]
    assert ok and all(r["gbps"] > 0 and not r["note"] for r in ok)

    text = report.read_text()
    assert harness.BEGIN_MARK in text and "### Targets" in text
    # the case tables: a row per layout and batch, the get's figure beside its ratio
    get_row = next(line for line in text.splitlines() if line.startswith("| tiny/2 | 2 KiB | 1 |"))
    assert "x) |" in get_row and "### Time per call: p50 ms" in text
    # a second run replaces only its own part of an existing document
    report.write_text("# kept\n\nhand-written\n\n" + text[text.index(harness.BEGIN_MARK) :])
    reports.write_report(report, "new body\n")
    assert report.read_text() == (
        f"# kept\n\nhand-written\n\n{harness.BEGIN_MARK}\nnew body\n{harness.END_MARK}\n"
    )


def test_targets_show_the_floor_of_the_worst_case() -> None:
    """The put and disk-warm targets name their worst case's floor, as a ratio to the
    memcpy of that same case (not of another case)."""

    def result(
        system: str, op: str, path: str, tier: str, batch: int, gbps: float
    ) -> harness.Result:
        r = harness.Result(system, op, path, tier, "llama3-8b/2", 256 << 10, batch, 1, batch,
                         int(gbps * 1e9))  # fmt: skip
        r.seconds = 1.0
        return r

    results = [
        result("memcpy", "get", "-", "-", 16, 20.0),
        result("memcpy", "get", "-", "-", 128, 10.0),
        result("stream", "put", "-", "-", 16, 15.0),
        result("stream", "put", "-", "-", 128, 12.0),
        result("pread", "get", "-", "disk-warm", 16, 18.0),
        result("kvstore", "put", "arena", "host", 16, 8.0),  # 0.40x: the worst put
        result("kvstore", "put", "arena", "host", 128, 9.0),  # 0.90x
        result("kvstore", "get", "arena", "disk-warm", 16, 4.0),
        result("kvstore", "put-nowait", "arena", "host", 16, 16.0),  # 0.80x
        result("kvstore", "put-nowait", "arena", "host", 128, 9.6),  # 0.96x
    ]
    by_goal = {(t.name.split(",")[0], t.goal): t for t in reports.targets(results)}
    put = by_goal[("arena put", ">= 0.7x memcpy")]
    assert put.met is False and put.measured.startswith("0.40x")
    assert put.floor == "stream 0.75x memcpy"
    disk = by_goal[("disk warm hit (arena get)", ">= 0.5x memcpy")]
    assert disk.measured.startswith("0.20x") and disk.floor == "pread 0.90x memcpy"
    assert by_goal[("arena get", ">= 0.7x memcpy")].floor == "-"
    ahead = by_goal[("arena put sent ahead (put_nowait)", ">= 0.7x memcpy")]
    assert ahead.met is True and ahead.measured.startswith("0.80x")
    assert ahead.floor == "stream 0.75x memcpy"


def test_the_warm_disk_target_compares_the_memcpy_measured_beside_it() -> None:
    """The warm disk cases measure their own memcpy, in turns with the gets: the target,
    its floor and the tables use that one, not the host cases' memcpy of minutes before;
    a case without one (cold) falls back to the host cases'."""

    def result(system: str, path: str, tier: str, gbps: float) -> harness.Result:
        r = harness.Result(system, "get", path, tier, "llama3-8b/2", 256 << 10, 16, 1, 16,
                         int(gbps * 1e9))  # fmt: skip
        r.seconds = 1.0
        return r

    results = [
        result("memcpy", "-", "-", 20.0),  # the host cases', measured earlier
        result("memcpy", "-", "disk-warm", 10.0),  # beside the warm disk gets
        result("pread", "-", "disk-warm", 9.0),
        result("kvstore", "arena", "disk-warm", 6.0),
        result("kvstore", "arena", "disk-cold", 2.0),
    ]
    disk = next(t for t in reports.targets(results) if t.name.startswith("disk warm"))
    assert disk.met is True and disk.measured.startswith("0.60x")
    assert disk.floor == "pread 0.90x memcpy"
    rows = reports.result_rows(results[3:], results)
    assert [row[11] for row in rows] == ["0.60x", "0.10x"]


def test_write_back_targets_name_each_pass_and_the_first_fills_floor() -> None:
    """The first fill of the tier and the pass into the pages it freed are two targets;
    only the first shows the fresh-file write beside it."""

    def result(system: str, tier: str, gbps: float) -> harness.Result:
        r = harness.Result(system, "write-back", "-", tier, "llama3-8b/16", 2 << 20, 16, 0, 1,
                         int(gbps * 1e9))  # fmt: skip
        r.seconds = 1.0
        return r

    results = [
        result("write", "disk", 0.6),
        result("kvstore", "disk", 0.45),
        result("kvstore", "disk-reuse", 1.5),
    ]
    first, again = [t for t in reports.targets(results) if "write-back" in t.name]
    assert "first fill" in first.name and first.met is False
    assert first.measured == "0.45 GB/s" and first.floor == "fresh-file write 0.60 GB/s"
    assert "freed" in again.name and again.met is True
    assert again.measured == "1.50 GB/s" and again.floor == "-"


# -- the machine is busy: figures read against its own noise ---------------------------


def test_a_turn_is_blamed_on_the_machine_when_its_noise_explains_the_difference() -> None:
    from kvbench.verdict import turn_verdict

    # the same full prefill measured twice around the turn: 1.0 s and 1.6 s apart
    busy = turn_verdict(turn_s=1.4, load_s=0.05, full_s=(1.0, 1.6))
    assert busy.kind == "busy" and "the machine is busy" in busy.text
    assert "inconclusive" in busy.text and "1000 ms and 1600 ms (60% apart)" in busy.text
    # a turn twice a full prefill's time, its load 17 ms, the A/A pair 60% apart: busy
    noisy = turn_verdict(turn_s=2.0, load_s=0.017, full_s=(1.0, 1.6))
    assert noisy.kind == "busy" and "this turn took 2000 ms, its load 17.0 ms" in noisy.text
    # the same turn on a quiet machine (1.00 s and 1.02 s) is not the machine's: a cache
    # that copies inside the forward pass, after its load was timed, is named slower
    slow = turn_verdict(turn_s=2.0, load_s=0.017, full_s=(1.0, 1.02))
    assert slow.kind == "slower" and "busy" not in slow.text, slow.text
    assert "by 980 ms, of which loading took 17.0 ms: 963 ms unexplained" in slow.text


def test_a_turn_on_a_quiet_machine_gets_the_figures_verdict() -> None:
    from kvbench.verdict import turn_verdict

    assert turn_verdict(turn_s=0.25, load_s=0.02, full_s=(1.0, 1.02)).text.startswith(
        "4.0x quicker than a full prefill"
    )
    # a short prompt: the load (25 ms) costs more than computing the whole prompt (10 ms)
    short = turn_verdict(turn_s=0.03, load_s=0.025, full_s=(0.010, 0.0101))
    assert short.kind == "no-gain" and "a short prompt gains nothing" in short.text
    assert turn_verdict(turn_s=1.01, load_s=0.01, full_s=(1.0, 1.02)).kind == "same"


def test_a_quick_bench_judges_no_goal_and_says_why_and_that_the_machine_is_busy(
    capsys: pytest.CaptureFixture,
) -> None:
    from types import SimpleNamespace

    from kvbench.verdict import busy_machine, goal_state

    assert busy_machine([(20.0, 19.0)]) == "" and busy_machine([]) == ""
    assert busy_machine([(20.0, 10.0)]) == "the same copy measured twice differs by 100%"
    assert goal_state(True, quick=False, busy="", relative=False) == ("met", "")
    assert goal_state(False, quick=False, busy="", relative=False) == ("MISSED", "")
    unjudged = goal_state(False, quick=False, busy="x", relative=False)
    assert unjudged == ("-", "not judged: the machine is busy (x)")
    # a ratio to a baseline measured beside it carries the machine's noise: judged
    assert goal_state(False, quick=False, busy="x", relative=True) == ("MISSED", "")
    assert goal_state(False, quick=True, busy="", relative=True)[0] == "-"

    def result(system: str, op: str, path: str, tier: str, gbps: float) -> harness.Result:
        r = harness.Result(system, op, path, tier, "llama3-8b/2", 256 << 10, 16, 1, 16,
                           int(gbps * 1e9))  # fmt: skip
        r.seconds = 1.0
        return r

    # memcpy beside the host cases 20 GB/s, beside the disk cases 10: a busy machine
    results = [
        result("memcpy", "get", "-", "-", 20.0),
        result("memcpy", "get", "-", "disk-warm", 10.0),
        result("kvstore", "get", "arena", "host", 6.0),  # 0.30x memcpy: a "miss"
        result("kvstore", "put", "arena", "host", 18.0),  # 0.90x memcpy: a "met"
        result("kvstore", "write-back", "-", "disk", 0.5),  # an absolute goal (1 GB/s) missed
    ]
    bench = SimpleNamespace(results=results, notes=[], daemon=object(), addr="")
    busy = "the machine is busy (the same copy measured twice differs by 100%)"
    # a quick run: no goal met or missed, the reason said once, then the busy machine
    reports.print_summary(bench, 3.0, True)  # type: ignore[arg-type]
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("quick run: ") and "no goal is judged" in printed[1]
    assert printed[2].startswith(busy)
    goals = [line.split()[0] for line in printed[3:]]
    assert goals and set(goals) == {"-"} and "missed" not in " ".join(printed), printed
    # a full run on that machine: the met goal is met, the miss of a ratio to memcpy is a
    # miss (memcpy beside it was as slow), the miss of an absolute goal is not judged
    reports.print_summary(bench, 3.0, False)  # type: ignore[arg-type]
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("goals: 1 met, 1 missed, 1 not judged (a busy machine)")
    arena_get = next(line for line in printed if "arena get, host hit, blocks" in line)
    assert arena_get.split()[0] == "MISSED", arena_get
    write_back = next(line for line in printed if "first fill of the tier" in line)
    assert write_back.split()[0] == "-" and write_back.endswith(f"not judged: {busy}")
    # the same figures on a quiet machine: the miss is a miss
    quiet = SimpleNamespace(results=results[:1] + results[2:], notes=[], daemon=object(), addr="")
    reports.print_summary(quiet, 3.0, False)  # type: ignore[arg-type]
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("goals: 1 met, 2 missed, 0 not judged")
    assert "busy" not in printed[2]


def run_program(name: str, *args: object) -> None:
    """Run ``benchmarks/<name>`` with ``args``; fail the test unless it exits 0."""
    program = Path(__file__).resolve().parent.parent / "benchmarks" / name
    argv = [sys.executable, str(program), *map(str, args)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_put_cpu_program_measures_every_mode(tmp_path: Path) -> None:
    """benchmarks/put_cpu.py at a tiny size: it starts and stops its own daemon and
    writes one row per mode, with CPU figures for both processes."""
    out = tmp_path / "put_cpu.md"
    run_program("put_cpu.py", "--cases", "tiny:4", "--puts", "5", "--rounds", "1", "--out", out)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 4 x 2 KiB")]
    assert [row.split(" | ")[1] for row in rows] == ["memcpy", "put", "put-nowait"]
    put = rows[1].split(" | ")
    assert float(put[2]) > 0 and float(put[4].split()[0]) > 0 and float(put[5].split()[0]) > 0


@pytest.mark.slow
def test_call_cost_program_times_every_op_in_both_checkouts(tmp_path: Path) -> None:
    """benchmarks/call_cost.py at a tiny size, this checkout against itself: a worker
    per checkout starts and stops its own daemon, and every op gets a row with times."""
    out = tmp_path / "call_cost.md"
    root = Path(__file__).resolve().parent.parent
    run_program("call_cost.py", "--before", root, "--rounds", "1", "--calls", "20", "--out", out)
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")]
    by_op = {row[0].strip("| "): row for row in rows[1:]}  # after the header
    assert sorted(by_op) == ["acquire", "get", "lookup", "miss"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in by_op.values())


def test_benchmark_programs_refuse_bad_arguments_with_one_clear_line() -> None:
    """A malformed argument stops the program before it starts a daemon or an engine:
    exit code 2 and a line that names what is wrong."""
    with pytest.raises(argparse.ArgumentTypeError, match="expected LAYOUT:BATCH"):
        harness.layout_batch("llama2:0")
    assert harness.layout_batch("llama8:16") == ("llama8", 16)
    programs = Path(__file__).resolve().parent.parent / "benchmarks"
    for name, args, why, timeout in (
        ("vllm_ttft.py", ["--lengths", "2k"], "--lengths must be comma-separated integers", 120),
        ("vllm_ttft.py", ["--rounds", "0"], "--rounds and --prompts must be >= 1", 120),
        ("serve.py", ["--cases", "alone,nope"], "unknown cases ['nope']", 120),
        ("multiturn.py", ["--cases", "nope"], "unknown cases ['nope']", 120),
        ("evict_rates.py", ["--before", ".", "--rounds", "0"], "--rounds must be >= 1", 120),
        ("why_cost.py", ["--before", ".", "--namespaces", "1"], "--namespaces >= 2", 120),
    ):
        done = subprocess.run(
            [sys.executable, str(programs / name), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 2 and why in done.stderr, done.stderr


def test_the_gpu_script_refuses_an_unknown_step_before_it_does_anything(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_run.sh"
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(script), "tests", "tfft"], capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUT": str(out)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == "gpu_run.sh: unknown step 'tfft' (tests, bench, ttft, overlap, model)\n"
    assert not out.exists()  # nothing made, nothing installed, nothing run


def test_security_cost_program_measures_every_pair(tmp_path: Path) -> None:
    """benchmarks/security_cost.py at a tiny size: five daemons, every pair, a verdict."""
    out = tmp_path / "security.md"
    program = Path(__file__).resolve().parent.parent / "benchmarks" / "security_cost.py"
    proc = subprocess.run(
        [sys.executable, str(program), "--quick", "--report", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for row in ("arena, unix socket", "control (A/A)", "gRPC inline", "inline, TCP loopback"):
        assert text.count(f"| {row}") == 4, row
    assert "**Arena path: target (at most 5%)" in text and "measured in process" in text


def test_cases_run_in_turns_and_a_missing_peer_is_named_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every case once a round, the order turning each round; LMCache not prepared is
    one line that says how to prepare it."""
    from kvbench import lmcache_peer
    from kvbench.cases import in_turns

    order = list(in_turns(["a", "b", "c"], 3))
    assert order == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")
    ]
    monkeypatch.setattr(lmcache_peer, "SITE", tmp_path / "none")
    line = lmcache_peer.missing()
    assert "\n" not in line and "benchmarks/peers/prepare_lmcache.py" in line
