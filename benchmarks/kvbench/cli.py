"""Entry points: ``kvctl bench`` (:func:`add_arguments`, :func:`run_bench`) and
``python -m kvbench``."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbench.harness import LAYOUTS, settings_for
from kvbench.report import (
    machine_line,
    plot,
    print_summary,
    print_table,
    render_markdown,
    targets,
    write_report,
)
from kvbench.run import Bench
from kvbench.servers import serve_raw
from kvclient.errors import KVStoreError

# -- entry points -----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run (seconds)")
    p.add_argument("--layouts", nargs="+", metavar="L", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--batches", nargs="+", type=int, metavar="N", help="blocks per call")
    p.add_argument("--paths", nargs="+", choices=["arena", "inline"])
    p.add_argument("--repeat", type=int, help="timed passes per case (best is kept)")
    p.add_argument("--max-call-mib", type=int, help="skip calls larger than this")
    p.add_argument("--pass-mib", type=int, help="bytes per timed pass (arena path, memcpy)")
    p.add_argument("--no-disk", action="store_true", help="skip the disk-tier cases")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page-cache pass")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis baseline")
    p.add_argument("--report", metavar="FILE.md", help="write the markdown report (and a PNG)")
    p.add_argument("--json", metavar="FILE", help="write every result as JSON")
    p.add_argument("--table", action="store_true", help="print every case, after the summary")
    p.add_argument("--workdir", help="where an own daemon keeps its files (default: a temp dir)")


def run_bench(args: argparse.Namespace, addr: str | None, argv: Sequence[str]) -> int:
    settings = settings_for(args)
    started = time.monotonic()
    workdir_ctx: Any = (
        contextlib.nullcontext(args.workdir)
        if args.workdir
        else tempfile.TemporaryDirectory(prefix="kvbench-", dir="/tmp")
    )
    with workdir_ctx as workdir:
        bench = Bench(settings, addr, Path(workdir))
        try:
            bench.open()
            bench.run()
        except KVStoreError as exc:
            print(f"kvctl bench: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        finally:
            bench.close()
    elapsed = time.monotonic() - started
    print_summary(bench, elapsed, args.quick)
    if args.table:
        print(file=sys.stdout)
        print_table(bench.results)
    elif not args.report and not args.json:
        print("every case: add --table, or --report FILE.md / --json FILE")
    if args.json:
        data = {
            "argv": list(argv),
            "machine": machine_line(),
            "info": bench.info,
            "notes": bench.notes,
            "results": [r.to_dict() for r in bench.results],
            "targets": [asdict(t) for t in targets(bench.results)],
        }
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.report:
        report = Path(args.report)
        png = report.with_suffix(".png")
        drawn = plot(bench.results, png)
        body = render_markdown(bench, argv, elapsed, png.name if drawn else None)
        write_report(report, body)
        print(f"wrote {report}" + (f" and {png}" if drawn else ""), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve-raw"]:
        serve_raw(argv[1])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m kvbench",
        description="data-path speed of kvstored beside memcpy, raw gRPC and Redis",
    )
    parser.add_argument("--addr", help="a running kvstored (default: start one in a temp dir)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_bench(args, args.addr, ["python -m kvbench", *argv])

