"""CPU time per arena put, the client's and the daemon's. A program, not a test.

On a two-core machine a stream of puts is bound by the CPU both processes spend per
put, not by either one's wall time: the client copies the blocks and makes the call,
the daemon (on the other core, or on the same one) reserves, commits and answers. This
program starts a kvstored in a temp dir and measures, for each layout and batch, in
turns (round after round, so that the host's drift hits every mode alike):

- ``memcpy``: one-thread ``np.copyto`` of each put's bytes into a reused buffer (the
  copy alone, no daemon);
- ``put``: ``ns.put`` (waits for its answer);
- ``put-nowait``: ``ns.put_nowait`` (sent ahead; the last put of a round waits, so a
  round ends with every block committed).

Per mode: wall time per put, GB/s, and the CPU time per put of the client process (all
its threads) and of the daemon (all its threads), from ``/proc/<pid>/task/*/stat``
(user and system, in clock ticks: fine over a round of hundreds of puts) and
``schedstat`` (nanoseconds). The median round of ``--rounds`` is reported. The client's
background mapping of the arena (``MADV_POPULATE_READ``) is waited for first: a
short measurement made while it runs counts its CPU as the puts'.

    .venv/bin/python benchmarks/put_cpu.py                       # 16 x 256 KiB, 128 x 2 KiB
    .venv/bin/python benchmarks/put_cpu.py --cases llama2:16 --rounds 9 --out /tmp/x.md
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.harness import (
    LAYOUTS,
    MiB,
    TokenSource,
    aligned_buffer,
    program_parser,
    write_program_report,
)
from kvbench.report import machine_line
from kvbench.servers import OwnDaemon
from kvclient import KVClient  # noqa: E402

MODES = ("memcpy", "put", "put-nowait")
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Cpu:
    """CPU seconds of one process so far: user, system, and the scheduler's total."""

    user: float
    system: float
    sched: float

    @classmethod
    def of(cls, pid: int) -> Cpu:
        user = system = sched = 0.0
        task_dir = f"/proc/{pid}/task"
        for task in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"{task_dir}/{task}/schedstat") as f:
                    sched += int(f.read().split()[0]) / 1e9
            except OSError:  # a thread that ended meanwhile
                continue
            user += int(fields[11]) * TICK_S
            system += int(fields[12]) * TICK_S
        return cls(user, system, sched)

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.user - other.user, self.system - other.system, self.sched - other.sched)


@dataclass(frozen=True)
class Round:
    mode: str
    puts: int
    call_bytes: int
    seconds: float
    client: Cpu
    daemon: Cpu

    def per_put_ms(self, seconds: float) -> float:
        return seconds / self.puts * 1e3

    @property
    def gbps(self) -> float:
        return self.puts * self.call_bytes / self.seconds / 1e9


def wait_for_mapping(timeout: float = 60.0) -> None:
    """Wait until this process's background arena mapping threads have finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(t.name == "kvstore-prefault" for t in threading.enumerate()):
            return
        time.sleep(0.05)


def measure_case(
    client: KVClient, daemon_pid: int, layout_name: str, batch: int, puts: int, rounds: int
) -> dict[str, list[Round]]:
    layout = LAYOUTS[layout_name]
    call_bytes = batch * layout.block_bytes
    source = aligned_buffer(puts * call_bytes, fill=None).reshape(puts, batch, layout.block_bytes)
    out = aligned_buffer(call_bytes).reshape(batch, layout.block_bytes)
    ns = client.namespace(f"put-cpu-{layout_name}-{batch}", layout.block_tokens, **layout.spec())
    chains = TokenSource()

    def run_memcpy(_: list[np.ndarray]) -> None:
        for i in range(puts):
            np.copyto(out, source[i])

    def run_put(tokens: list[np.ndarray]) -> None:
        for i in range(puts):
            ns.put(tokens[i], source[i])

    def run_nowait(tokens: list[np.ndarray]) -> None:
        for i in range(puts - 1):
            ns.put_nowait(tokens[i], source[i])
        ns.put_nowait(tokens[-1], source[-1]).result()

    runners: dict[str, Callable[[list[np.ndarray]], None]] = {
        "memcpy": run_memcpy,
        "put": run_put,
        "put-nowait": run_nowait,
    }
    results: dict[str, list[Round]] = {mode: [] for mode in MODES}
    for round_no in range(rounds + 1):  # the first round warms up, untimed
        for mode in MODES:
            tokens = [chains.chain(batch * layout.block_tokens) for _ in range(puts)]
            client.clear(ns.ns_id)  # every round puts new blocks into a namespace as empty
            client_before, daemon_before = Cpu.of(os.getpid()), Cpu.of(daemon_pid)
            start = time.perf_counter()
            runners[mode](tokens)
            seconds = time.perf_counter() - start
            client_cpu = Cpu.of(os.getpid()) - client_before
            daemon_cpu = Cpu.of(daemon_pid) - daemon_before
            if round_no:
                results[mode].append(
                    Round(mode, puts, call_bytes, seconds, client_cpu, daemon_cpu)
                )
    client.clear(ns.ns_id)
    return results


def median_round(rounds: list[Round]) -> Round:
    return sorted(rounds, key=lambda r: r.seconds)[len(rounds) // 2]


def render(cases: list[tuple[str, int, dict[str, list[Round]]]], rounds: int, puts: int) -> str:
    lines = [
        "# CPU time per arena put",
        "",
        "Measured by `benchmarks/put_cpu.py` (re-run it to refresh this file).",
        "",
        f"- machine: {machine_line()}",
        f"- {puts} puts per round, {rounds} timed rounds per mode after one untimed, the "
        "modes in turns; each row is the round with the median wall time",
        "- CPU per put: all threads of the process; user and system from "
        "`/proc/<pid>/task/*/stat` (clock ticks), total from `schedstat`",
        "",
        "| case | mode | wall ms/put | GB/s | client CPU ms/put (user + sys) "
        "| daemon CPU ms/put (user + sys) | client + daemon CPU ms/put |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout_name, batch, results in cases:
        layout = LAYOUTS[layout_name]
        size = layout.block_bytes
        label = f"{batch} x {size >> 10} KiB" if size >= 1024 else f"{batch} x {size} B"
        for mode in MODES:
            r = median_round(results[mode])
            c, d = r.client, r.daemon
            lines.append(
                f"| {label} ({layout.name}) | {mode} | {r.per_put_ms(r.seconds):.3f} "
                f"| {r.gbps:.2f} "
                f"| {r.per_put_ms(c.sched):.3f} ({r.per_put_ms(c.user):.2f} + "
                f"{r.per_put_ms(c.system):.2f}) "
                f"| {r.per_put_ms(d.sched):.3f} ({r.per_put_ms(d.user):.2f} + "
                f"{r.per_put_ms(d.system):.2f}) "
                f"| {r.per_put_ms(c.sched + d.sched):.3f} |"
            )
    lines += [
        "",
        "Reading it: on two cores, puts back to back cannot go faster than half the "
        "client's and the daemon's CPU per put together (both cores busy all the time), "
        "nor faster than the larger of the two. The memcpy row is the copy alone, which "
        "a put also does (into arena slots, not a reused buffer).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = program_parser(__doc__, [("llama2", 16), ("tiny", 128)], "put")
    parser.add_argument("--puts", type=int, default=200, help="puts per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode")
    parser.add_argument("--out", default="docs/benchmarks/put_cpu.md")
    args = parser.parse_args()
    largest = max(batch * LAYOUTS[name].block_bytes for name, batch in args.cases)
    host_bytes = max(256 * MiB, 3 * args.puts * largest)  # a round, its staging, room
    with tempfile.TemporaryDirectory(prefix="kvputcpu-", dir="/tmp") as workdir:
        daemon = OwnDaemon(Path(workdir), host_bytes, 4 * host_bytes)
        daemon.start()
        try:
            assert daemon.proc is not None
            with KVClient(daemon.addr) as client:
                client.server_info()
                if not client.arena_in_use:
                    print("the daemon's arena cannot be mapped here", file=sys.stderr)
                    return 1
                wait_for_mapping()
                cases = []
                for name, batch in args.cases:
                    results = measure_case(
                        client, daemon.proc.pid, name, batch, args.puts, args.rounds
                    )
                    cases.append((name, batch, results))
                    for mode in MODES:
                        r = median_round(results[mode])
                        print(
                            f"{name} x{batch} {mode:10s} {r.per_put_ms(r.seconds):.3f} ms/put "
                            f"{r.gbps:6.2f} GB/s  client CPU {r.per_put_ms(r.client.sched):.3f}"
                            f"  daemon CPU {r.per_put_ms(r.daemon.sched):.3f} ms/put",
                            flush=True,
                        )
        finally:
            daemon.cleanup()
    write_program_report(args.out, render(cases, args.rounds, args.puts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
