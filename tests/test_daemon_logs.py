"""Log lines of a real ``kvstored``: one per lifecycle event and per error, JSON on request."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Daemon

from kvclient import KVClient
from kvstored import config
from kvstored.logs import JsonFormatter, setup_logging
from kvstored.main import main

README = Path(__file__).resolve().parents[1] / "deploy" / "README.md"


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line must be one JSON object."""
    entries = []
    for line in text.splitlines():
        entry = json.loads(line)
        assert isinstance(entry, dict), line
        entries.append(entry)
    return entries


def documented_events() -> set[str]:
    """The ``event`` values listed in the Logs table of deploy/README.md."""
    text = README.read_text()
    table = text[text.index("| event | when |") : text.index("Errors answered INTERNAL")]
    return set(re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE))


def test_json_logs_one_line_per_lifecycle_event_never_per_block(kvstored_factory: Any) -> None:
    daemon: Daemon = kvstored_factory(
        host_bytes="1MiB", disk_bytes="64MiB", log_format="json", metrics_listen="127.0.0.1:0"
    )
    started = len(daemon.output().splitlines())
    # 48 blocks of 64 KiB through a 16-block host tier: puts, evictions, demotions,
    # reads and promotions, none of which is a log line
    with KVClient(daemon.addr) as client:
        ns = client.namespace("log-model", block_tokens=4, block_bytes=64 << 10)
        for chain in range(3):
            tokens = [chain * 1000 + i for i in range(64)]
            assert ns.put(tokens, np.zeros((16, 64 << 10), np.uint8)).stored == 16
            assert ns.get(tokens).tokens == 64
    assert len(daemon.output().splitlines()) == started
    assert daemon.stop() == 0

    entries = json_lines(daemon.output())
    for entry in entries:
        assert {"ts", "level", "logger", "msg", "pid"} <= set(entry), entry
        assert entry["ts"].endswith("Z") and entry["level"] in ("debug", "info", "warning")
    events = [e["event"] for e in entries if "event" in e]
    lifecycle = ["metrics", "serving", "signal", "draining", "closing", "stopped"]
    assert [e for e in events if e in lifecycle] == lifecycle
    assert set(events) <= documented_events(), "an event missing from deploy/README.md"
    metrics = next(e for e in entries if e.get("event") == "metrics")
    assert metrics["url"].startswith("http://127.0.0.1:") and metrics["url"] in metrics["msg"]
    serving = next(e for e in entries if e.get("event") == "serving")
    assert serving["logger"] == "kvstored" and f"serving on {daemon.addr}" in serving["msg"]
    assert len(entries) < 15  # a handful of lines for a whole life, whatever it stored


def test_json_start_failure_is_one_json_error_line(kvstored: Daemon) -> None:
    # a second daemon on a live socket: exit 2 (found before start-up), stderr still JSON
    proc = subprocess.run(
        [sys.executable, "-m", "kvstored", "--listen", kvstored.addr, "--host-bytes", "4MiB",
         "--disk-bytes", "0", "--metrics-listen", "off", "--log-format", "json"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    errors = [e for e in json_lines(proc.stderr) if e["level"] == "error"]
    assert len(errors) == 1
    assert errors[0]["event"] == "start_failed"
    assert "another daemon is listening" in errors[0]["msg"]


def test_text_logs_keep_their_format(kvstored_factory: Any) -> None:
    daemon: Daemon = kvstored_factory(host_bytes="4MiB", disk_bytes=0, metrics_listen="off")
    assert daemon.stop() == 0
    lines = daemon.output().splitlines()
    serving = [line for line in lines if " INFO kvstored: kvstored " in line]
    assert len(serving) == 1 and f"serving on {daemon.addr};" in serving[0]
    assert lines[-1].endswith(" INFO kvstored: stopped")
    assert not any(line.startswith("{") for line in lines)


def test_json_formatter_keeps_tracebacks_and_extra_fields_on_one_line() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    setup_logging("info", "json", stream)
    try:
        log = logging.getLogger("kvstored.test")
        try:
            raise RuntimeError("boom\nsecond line")
        except RuntimeError:
            log.error("Put failed", exc_info=True, extra={"event": "rpc_error", "count": 3})
        log.debug("not shown at info")
    finally:  # give pytest its handlers back
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.captureWarnings(False)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["msg"] == "Put failed" and entry["level"] == "error"
    assert entry["event"] == "rpc_error" and entry["count"] == 3
    assert "RuntimeError: boom" in entry["exc"] and "Traceback" in entry["exc"]
    # values json cannot encode are written as text, not dropped
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    record.path = config  # a module object
    assert "kvstored.config" in json.loads(JsonFormatter().format(record))["path"]


def test_log_format_key(capsys: pytest.CaptureFixture[str]) -> None:
    key = config.KEYS_BY_NAME["log_format"]
    assert key.default == "text" and key.parse(" JSON ") == "json"
    assert main(["--print-config", "--log-format", "json"]) == 0
    assert 'log_format = "json"  # flag --log-format' in capsys.readouterr().out
    assert main(["--print-config", "--log-format", "xml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvstored: error: log_format: must be one of")


def test_the_rate_limited_log_writes_a_kind_once_an_interval_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:

    from kvstored.log_limits import RateLimitedLog

    log = logging.getLogger("kvstored.test_limits")
    limited = RateLimitedLog(every_s=0.2)
    with caplog.at_level(logging.INFO, logger=log.name):
        assert limited.warning(log, "flood", "bad request from %s", "peer-1")
        assert limited.info(log, "other", "another kind is not held back")
        held = 0
        while not limited.warning(log, "flood", "bad request from %s", "peer-2"):
            held += 1  # (until the interval has passed)
    flood = [r for r in caplog.records if r.getMessage().startswith("bad request")]
    assert [r.getMessage().split(" (")[0] for r in flood] == [
        "bad request from peer-1", "bad request from peer-2",
    ]
    assert held > 0 and f"(and {held} more like it in the last" in flood[1].getMessage()
    assert flood[1].event == "flood"  # type: ignore[attr-defined]
