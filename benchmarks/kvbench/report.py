"""Reports of ``kvctl bench``: tables, targets, the markdown report and its plot."""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvbench.harness import BEGIN_MARK, END_MARK, RAW_CHUNK, MiB, Result
from kvbench.run import Bench
from kvbench.verdict import busy_machine, goal_state

# -- reports ----------------------------------------------------------------------------


def _find(results: Sequence[Result], **match: Any) -> Result | None:
    for r in results:
        if all(getattr(r, k) == v for k, v in match.items()):
            return r
    return None


def _baseline(results: Sequence[Result], system: str, op: str, r: Result) -> Result | None:
    """The ``system`` row of ``r``'s case: the one measured beside it (the same tier:
    the warm disk cases have their own memcpy) where there is one, else the host
    cases' (tier ``-``)."""
    case = dict(system=system, op=op, layout=r.layout, batch=r.batch)
    return _find(results, tier=r.tier, **case) or _find(results, tier="-", **case)


def _fmt_size(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:g} MiB"
    if n >= 1024:
        return f"{n / 1024:g} KiB"
    return f"{n} B"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _num(x: float, digits: int = 2) -> str:
    return "-" if not x or math.isnan(x) else f"{x:,.{digits}f}"


def result_rows(
    chosen: Sequence[Result], results: Sequence[Result] | None = None
) -> list[list[str]]:
    """Table rows of ``chosen``, with ratios to the baselines of each one's case among
    ``results`` (the whole run; ``chosen`` by default)."""
    if results is None:
        results = chosen
    rows = []
    for r in chosen:
        memcpy = _baseline(results, "memcpy", "get", r)
        redis_op = "put" if r.op in ("put", "put-nowait") else "get"
        redis = _find(results, system="redis", op=redis_op, layout=r.layout, batch=r.batch)
        raw = _baseline(results, "grpc-raw", r.op, r) if r.path == "inline" else None
        rows.append(
            [
                r.system,
                r.op,
                r.path,
                r.tier,
                r.layout,
                _fmt_size(r.block_bytes),
                str(r.batch),
                _num(r.gbps),
                _num(r.blocks_per_s, 0),
                _num(r.percentile(50), 3),
                _num(r.percentile(99), 3),
                _ratio(r.gbps, memcpy.gbps) if memcpy and r.bytes else "-",
                _ratio(r.gbps, redis.gbps) if redis and r.bytes and r.system == "kvstore" else "-",
                _ratio(r.gbps, raw.gbps) if raw and r.system == "kvstore" else "-",
                r.note,
            ]
        )
    return rows


HEADERS = [
    "system",
    "op",
    "path",
    "tier",
    "layout",
    "block",
    "batch",
    "GB/s",
    "blocks/s",
    "p50 ms",
    "p99 ms",
    "x memcpy",
    "x Redis",
    "x grpc raw",
    "note",
]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run
    floor: str = "-"  # the same case's floor on this machine, where one applies
    relative: bool = False  # a ratio to a baseline measured beside it in the run


def targets(results: Sequence[Result]) -> list[Target]:
    """The data-path targets, each from this run's results (worst qualifying case)."""
    out: list[Target] = []

    def worst_ratio(
        op: str,
        path: str,
        tier: str,
        base_system: str,
        base_op: str,
        keep: Callable[[Result], bool],
    ) -> tuple[float, str, Result] | None:
        worst = None
        for r in results:
            if r.system != "kvstore" or (r.op, r.path, r.tier) != (op, path, tier) or not keep(r):
                continue
            base = _baseline(results, base_system, base_op, r)
            if base is None or not base.gbps or not r.gbps:
                continue
            ratio = r.gbps / base.gbps
            label = f"{ratio:.2f}x ({r.layout} x{r.batch}: {r.gbps:.2f} vs {base.gbps:.2f} GB/s)"
            if worst is None or ratio < worst[0]:
                worst = (ratio, label, r)
        return worst

    big = lambda r: r.block_bytes >= 256 * 1024 and r.batch >= 16  # noqa: E731

    def ratio_target(
        name: str,
        goal: str,
        least: float,
        worst: tuple[float, str, Result] | None,
        floor_system: str = "",
    ) -> None:
        """A target met when the worst qualifying ratio is at least ``least``; with
        ``floor_system``, the ratio of that floor to memcpy in the same case beside it."""
        met = None if worst is None else worst[0] >= least
        floor = "-"
        if worst is not None and floor_system:
            r = worst[2]
            found = _find(results, system=floor_system, layout=r.layout, batch=r.batch)
            memcpy = _baseline(results, "memcpy", "get", found) if found else None
            if found and memcpy and found.gbps and memcpy.gbps:
                floor = f"{floor_system} {found.gbps / memcpy.gbps:.2f}x memcpy"
        measured = worst[1] if worst else "not measured"
        out.append(Target(name, goal, measured, met, floor, relative=True))

    for op in ("get", "put", "put-nowait"):
        name = "arena put sent ahead (put_nowait)" if op == "put-nowait" else f"arena {op}"
        ratio_target(
            f"{name}, host hit, blocks >= 256 KiB, batch >= 16",
            ">= 0.7x memcpy",
            0.7,
            worst_ratio(op, "arena", "host", "memcpy", "get", big),
            "" if op == "get" else "stream",
        )
    ratio_target(
        "arena get, host hit, vs Redis MGET of the same blocks (>= 256 KiB, batch >= 16)",
        ">= 4x Redis",
        4,
        worst_ratio("get", "arena", "host", "redis", "get", big),
    )
    for op in ("get", "put"):
        ratio_target(
            f"inline {op} vs raw grpc bytes, same size and direction (>= 256 KiB, batch >= 16)",
            ">= 0.8x grpc raw",
            0.8,
            worst_ratio(op, "inline", "host", "grpc-raw", op, big),
        )
    ratio_target(
        "disk warm hit (arena get), blocks >= 256 KiB, batch >= 16",
        ">= 0.5x memcpy",
        0.5,
        worst_ratio("get", "arena", "disk-warm", "memcpy", "get", big),
        "pread",
    )
    floor = _find(results, system="write", op="write-back")
    for tier, name in (
        ("disk", "sustained write-back (host full, demotions to LMDB), first fill of the tier"),
        ("disk-reuse", "sustained write-back, again into the pages the first fill freed"),
    ):
        wb = _find(results, system="kvstore", op="write-back", tier=tier)
        out.append(
            Target(
                name,
                ">= 1 GB/s",
                f"{wb.gbps:.2f} GB/s" if wb else "not measured",
                None if wb is None else wb.gbps >= 1.0,
                f"fresh-file write {floor.gbps:.2f} GB/s" if floor and tier == "disk" else "-",
            )
        )
    best = None
    for r in results:
        tiny = r.system == "kvstore" and r.op == "lookup+get" and r.layout.startswith("tiny")
        if tiny and (best is None or r.blocks_per_s > best.blocks_per_s):
            best = r
    out.append(
        Target(
            "2-token blocks (tiny layout), batched, lookup + get per client",
            ">= 100,000 blocks/s",
            f"{best.blocks_per_s:,.0f} blocks/s ({best.path} x{best.batch})"
            if best
            else "not measured",
            None if best is None else best.blocks_per_s >= 100_000,
        )
    )
    return out


def machine_line() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0, 0, 0)
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}, grpcio {grpc.__version__}; "
        f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )


# The report's case tables: a row per layout and batch, a column per (system, op, path,
# tier); every row of the run is in ``--json`` and in the printed table.
Column = tuple[str, str, str, str, str]  # title, system, op, path, tier
_GET: Column = ("get", "kvstore", "get", "arena", "host")
_PUT: Column = ("put", "kvstore", "put", "arena", "host")
_AHEAD: Column = ("put sent ahead", "kvstore", "put-nowait", "arena", "host")
THROUGHPUT: list[Column] = [
    _GET,
    ("get inline", "kvstore", "get", "inline", "host"),
    _PUT,
    _AHEAD,
    ("put inline", "kvstore", "put", "inline", "host"),
    ("disk warm get", "kvstore", "get", "arena", "disk-warm"),
    ("disk cold get", "kvstore", "get", "arena", "disk-cold"),
]
PER_CALL: list[Column] = [
    ("lookup", "kvstore", "lookup", "arena", "host"),
    ("lookup + get", "kvstore", "lookup+get", "arena", "host"),
    ("acquire", "kvstore", "acquire", "arena", "host"),
    ("miss", "kvstore", "miss", "arena", "miss"),
    _GET,
    _PUT,
    _AHEAD,
]
BASELINES: list[Column] = [
    ("memcpy", "memcpy", "get", "-", "-"),
    ("stream", "stream", "put", "-", "-"),
    ("pread", "pread", "get", "-", "disk-warm"),
    ("grpc raw pull", "grpc-raw", "get", "inline", "-"),
    ("grpc raw push", "grpc-raw", "put", "inline", "-"),
    ("redis get", "redis", "get", "-", "host"),
    ("redis put", "redis", "put", "-", "host"),
]


def _gbps_cell(r: Result, results: Sequence[Result]) -> str:
    if r.system != "kvstore":
        return _num(r.gbps)
    if r.path == "inline":
        base = _baseline(results, "grpc-raw", r.op, r)
    else:
        base = _baseline(results, "memcpy", "get", r)
    return f"{_num(r.gbps)} ({_ratio(r.gbps, base.gbps) if base else '-'})"


def _p50_cell(r: Result, results: Sequence[Result]) -> str:
    return _num(r.percentile(50), 3)


def case_table(
    results: Sequence[Result],
    columns: Sequence[Column],
    cell: Callable[[Result, Sequence[Result]], str],
) -> str:
    """``columns`` of each (layout, batch) of the run as one markdown table ("" when
    none of them was measured)."""
    cases = list(dict.fromkeys((r.layout, r.block_bytes, r.batch) for r in results if r.batch))
    present = [
        c
        for c in columns
        if any(_find(results, **_match(c), layout=lay, batch=b) for lay, _, b in cases)
    ]
    rows = []
    for layout, block, batch in cases:
        found = [_find(results, **_match(c), layout=layout, batch=batch) for c in present]
        if any(found):
            rows.append(
                [layout, _fmt_size(block), str(batch)]
                + [cell(r, results) if r else "-" for r in found]
            )
    if not present or not rows:
        return ""
    return markdown_table(["layout", "block", "batch", *(c[0] for c in present)], rows)


def _match(column: Column) -> dict[str, str]:
    _, system, op, path, tier = column
    return dict(system=system, op=op, path=path, tier=tier)


def render_markdown(bench: Bench, argv: Sequence[str], elapsed: float, png: str | None) -> str:
    results = bench.results
    lines = [
        f"Generated by `{' '.join(argv)}` on {time.strftime('%Y-%m-%d %H:%M')} in {elapsed:.0f} s.",
        "",
        f"- machine: {machine_line()}",
        f"- daemon: kvstored {bench.info.get('daemon', '?')}, host arena "
        f"{_fmt_size(int(bench.info.get('arena_bytes', 0)))}"
        + (", started by the benchmark in a temp dir" if bench.daemon else f" at {bench.addr}"),
        "- floors: stream = each call's bytes into fresh memory with kvstore's streaming copy "
        "(what a put does); pread = each call's bytes from a file in the page cache, one "
        "`preadv` per call (what a warm disk hit does); write = the write-back volume into a "
        "fresh file beside the disk tier's, 64 MiB per `pwrite` + `fdatasync` (what the "
        "first fill of the tier does)",
        f"- baselines: memcpy = one-thread `np.copyto` into a reused buffer; grpc raw = "
        f"grpc.aio server, unix socket, identity serializers, {RAW_CHUNK // 1024} KiB chunks; "
        f"redis = {bench.info.get('redis', 'skipped')}",
        f"- warm disk passes: {bench.info.get('warm', 'n/a')}; cold disk passes: page "
        f"cache dropped with {bench.info.get('cold', 'n/a')}",
        "- GB/s = 1e9 bytes/s of block bytes moved; best of the timed passes; p50/p99 per "
        "call over every timed call; the puts (kvstore, grpc raw push, redis, memcpy) take "
        "their passes in turns, and so do the gets, and the warm disk gets (kvstore, memcpy, "
        "pread: each kvstore pass reads chains of its own, after an untimed warm-up pass); "
        "a cold disk case is one pass",
    ]
    for note in bench.notes:
        lines.append(f"- {note}")
    for skipped in bench.skipped():
        lines.append(f"- skipped: {skipped}")
    lines += ["", "### Targets", ""]
    lines.append(
        markdown_table(
            ["target", "goal", "measured (worst qualifying case)", "met", "floor (same case)"],
            [
                [
                    t.name,
                    t.goal,
                    t.measured,
                    "-" if t.met is None else ("yes" if t.met else "**no**"),
                    t.floor,
                ]
                for t in targets(results)
            ],
        )
    )
    if png:
        lines += ["", f"![throughput against block size]({png})"]
    for title, columns, cell in (
        ("Throughput per case: GB/s (x memcpy; inline: x grpc raw)", THROUGHPUT, _gbps_cell),
        ("Time per call: p50 ms", PER_CALL, _p50_cell),
        ("Baselines per case: GB/s", BASELINES, _gbps_cell),
    ):
        table = case_table(results, columns, cell)
        if table:
            lines += ["", f"### {title}", "", table]
    noted = [r for r in results if r.note and r.op != "write-back"]
    if noted:
        lines += ["", "### Cases with a note (their figures are not what the case asks)", ""]
        lines += [
            f"- {r.system} {r.op} {r.path} {r.tier} {r.layout} x{r.batch}: {r.note}" for r in noted
        ]
    backs = [r for r in results if r.op == "write-back"]
    if backs:
        lines += ["", "### Sustained write-back", ""]
        lines += [f"- {r.system}, {r.tier}: {_num(r.gbps)} GB/s {r.note}".rstrip() for r in backs]
    return "\n".join(lines) + "\n"


def write_page(path: Path, lines: list[str]) -> None:
    """Write a benchmark's page: its lines, then the command line that made it."""
    path.write_text("\n".join([*lines, "", "    " + " ".join(sys.argv)]) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def write_report(path: Path, body: str) -> None:
    block = f"{BEGIN_MARK}\n{body}{END_MARK}\n"
    if path.exists():
        text = path.read_text()
        if BEGIN_MARK in text and END_MARK in text:
            head, rest = text.split(BEGIN_MARK, 1)
            _, tail = rest.split(END_MARK, 1)
            path.write_text(head + block + tail.lstrip("\n"))
            return
        path.write_text(text.rstrip("\n") + "\n\n" + block)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Data-path throughput\n\n" + block)


def plot(results: Sequence[Result], path: Path) -> bool:
    """Throughput against block size, one panel per batch size; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batches = sorted({r.batch for r in results if r.op in ("get", "put") and r.batch})
    if not batches:
        return False
    series = [
        ("memcpy", dict(system="memcpy", op="get"), "k-", None),
        ("stream into fresh memory (put floor)", dict(system="stream"), "k--", None),
        ("pread, page cache (disk warm floor)", dict(system="pread"), "k:", None),
        (
            "kvstore get arena",
            dict(system="kvstore", op="get", path="arena", tier="host"),
            "C0-",
            "o",
        ),
        ("kvstore put arena", dict(system="kvstore", op="put", path="arena"), "C0--", "s"),
        (
            "kvstore put arena, sent ahead",
            dict(system="kvstore", op="put-nowait", path="arena"),
            "C5--",
            "s",
        ),
        (
            "kvstore get arena, disk warm",
            dict(system="kvstore", op="get", path="arena", tier="disk-warm"),
            "C4-",
            "v",
        ),
        (
            "kvstore get inline",
            dict(system="kvstore", op="get", path="inline", tier="host"),
            "C1-",
            "o",
        ),
        ("kvstore put inline", dict(system="kvstore", op="put", path="inline"), "C1--", "s"),
        ("grpc raw pull", dict(system="grpc-raw", op="get"), "C2:", "^"),
        ("grpc raw push", dict(system="grpc-raw", op="put"), "C2-.", "^"),
        ("redis MGET", dict(system="redis", op="get"), "C3-", "D"),
        ("redis MSET", dict(system="redis", op="put"), "C3--", "D"),
    ]
    fig, axes = plt.subplots(1, len(batches), figsize=(5.2 * len(batches), 4.6), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, batch in zip(axes, batches, strict=True):
        for label, match, style, marker in series:
            points = sorted(
                (r.block_bytes, r.gbps)
                for r in results
                if r.batch == batch and r.gbps and all(getattr(r, k) == v for k, v in match.items())
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, marker=marker, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{batch} block{'s' if batch > 1 else ''} per call")
        ax.set_xlabel("block size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (best pass)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("kvstore data path beside memcpy, raw gRPC and Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_table(results: Sequence[Result], stream: Any = None) -> None:
    stream = stream or sys.stdout
    rows = result_rows(results)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEADERS)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True)), file=stream)
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)), file=stream)


def unmeasured_reason(target: Target, notes: Sequence[str], quick: bool) -> str:
    """Why a goal has no figure in this run, in words a reader acts on."""
    if "Redis" in target.name:
        skipped = [n for n in notes if n.startswith("Redis baseline skipped")]
        if skipped:
            return skipped[0].rstrip(".")
    if quick:
        return "a quick run has no case of that size (run without --quick)"
    return "no case of that size ran (see --layouts / --batches)"


def memcpy_pairs(results: Sequence[Result]) -> list[tuple[float, float]]:
    """A/A pairs: memcpy of one case measured beside the host cases and again beside
    the warm disk cases, minutes apart (GB/s each)."""
    pairs = []
    for r in results:
        if r.system == "memcpy" and r.tier == "disk-warm" and r.gbps:
            host = _find(results, system="memcpy", op="get", tier="-", layout=r.layout,
                         batch=r.batch)  # fmt: skip
            if host is not None and host.gbps:
                pairs.append((host.gbps, r.gbps))
    return pairs


def print_summary(
    bench: Bench,
    elapsed: float,
    quick: bool,
    stream: Any = None,
) -> None:
    """What a reader needs first: what ran, the goals, and why anything was skipped or
    not judged. A quick run judges no goal (its cases are too small and short); on a
    busy machine (:func:`kvbench.verdict.busy_machine`) a miss of an absolute goal is not
    judged either: it may be the machine's."""
    stream = stream or sys.stdout
    where = "its own daemon (a temp dir)" if bench.daemon is not None else bench.addr
    print(f"kvctl bench: {len(bench.results)} cases in {elapsed:.0f} s against {where}",
          file=stream)
    busy = busy_machine(memcpy_pairs(bench.results))
    goals = targets(bench.results)
    states = [goal_state(t.met, quick, busy, t.relative) for t in goals]
    if quick:
        print("quick run: a smoke check at small sizes, every case ran; no goal is judged "
              "(its cases are too small and short for the goals; a full run judges them: "
              "kvctl bench, ~10 minutes; docs/benchmarks/datapath.md)", file=stream)
    else:
        met = sum(state == "met" for state, _ in states)
        missed = sum(state == "MISSED" for state, _ in states)
        unmeasured = sum(t.met is None for t in goals)
        unjudged = len(goals) - met - missed - unmeasured
        print(f"goals: {met} met, {missed} missed, {unjudged} not judged (a busy machine), "
              f"{unmeasured} not measured", file=stream)
    if busy:
        print(f"the machine is busy ({busy}): its figures are inconclusive, a slow one "
              "may be the machine's; run again on a quiet machine", file=stream)
    for t, (state, why) in zip(goals, states, strict=True):
        if t.met is None:
            figure = f"not measured: {unmeasured_reason(t, bench.notes, quick)}"
        else:
            floor = "" if t.floor == "-" else f"; floor {t.floor}"
            figure = f"{t.measured} (goal {t.goal}{floor})"
            figure += "; not judged" if quick else (f"; {why}" if why else "")
        print(f"  {state:7} {t.name}: {figure}", file=stream)
    for note in bench.notes:
        print(f"note: {note}", file=stream)


