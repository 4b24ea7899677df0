"""The connector's counts and times, through vLLM's KV connector stats interface.

Each side of the connector counts into a plain dict (:data:`FIELDS`): the scheduler
the prompt tokens it asked kvstore for and the tokens kvstore gave (once per request,
when vLLM allocates its blocks) and the requests it left to vLLM because it cannot key
them (by reason), the workers the blocks they loaded and saved and the
milliseconds that took.

The hit rate is kvstore's own: ``hit_rate = hit_tokens / lookup_tokens``, where
``lookup_tokens`` are the tokens kvstore was asked for, the prompt's full blocks after
those vLLM's own prefix cache already holds, up to the last block a connector may give
(vLLM computes the last prompt token), and ``hit_tokens`` the tokens kvstore served of
them. Tokens vLLM held itself count in neither (counted, they read 0.5 for a request
kvstore served whole and 0.0 for one vLLM held whole); a request vLLM holds whole
asks kvstore for nothing. A request asked while the daemon is down or after a failed
load is asked and missed; a request the connector cannot key is not asked (it counts
in ``unkeyed_*_requests``).

Every counter exists from the start, at 0: :class:`KVStorePromMetrics` makes each
engine's series when vLLM builds it (at start-up), so ``/metrics`` lists all of them
before the first request. vLLM asks each side for :meth:`KVStoreConnector.get_kv_connector_stats`
every step, adds the workers' and the scheduler's (:meth:`KVStoreStats.aggregate`) and
hands the sum to its loggers: the log line ``KV Transfer metrics: ...`` every logging
interval (:meth:`KVStoreStats.reduce`), and the Prometheus counters
``vllm:kvstore_*_total`` of its ``/metrics`` (:class:`KVStorePromMetrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# name -> what the Prometheus counter says (a time in ms is exported in seconds)
FIELDS = {
    "lookup_tokens": "Prompt tokens the kvstore connector asked kvstore for (beyond "
    "vLLM's own prefix cache)",
    "hit_tokens": "Prompt tokens kvstore served of those asked for (vLLM loaded them "
    "instead of computing them)",
    "loaded_blocks": "KV blocks loaded from kvstore into vLLM's cache",
    "load_ms": "Time spent loading KV blocks from kvstore",
    "saved_blocks": "KV blocks saved to kvstore",
    "save_ms": "Time spent saving KV blocks to kvstore",
    # requests left to vLLM, neither loaded nor stored (request_keys.py), by reason
    "unkeyed_lora_requests": "Requests left to vLLM: their LoRA adapter's weights unreadable",
    "unkeyed_input_requests": "Requests left to vLLM: an input kvstore cannot key",
}


def new_counts() -> dict[str, float]:
    """What a side of the connector counts into."""
    return dict.fromkeys(FIELDS, 0)


@dataclass
class KVStoreStats(KVConnectorStats):
    """The counts of one interval (``data``: :data:`FIELDS`), summed over the sides."""

    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

    @classmethod
    def take(cls, counts: dict[str, float]) -> KVStoreStats | None:
        """The counts since the last take (None: nothing happened), and zero them."""
        if not any(counts.values()):
            return None
        stats = cls(data=dict(counts))
        counts.update(new_counts())
        return stats

    def reset(self) -> None:
        self.data = new_counts()

    def aggregate(self, other: KVConnectorStats) -> KVStoreStats:
        for name in FIELDS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        asked = d["lookup_tokens"]
        return {
            "lookup_tokens": int(asked),
            "hit_tokens": int(d["hit_tokens"]),
            # kvstore's own: of the tokens it was asked for (see the module docstring)
            "hit_rate": round(d["hit_tokens"] / asked, 3) if asked else 0.0,
            "loaded_blocks": int(d["loaded_blocks"]),
            "load_ms": round(d["load_ms"], 1),
            "saved_blocks": int(d["saved_blocks"]),
            "save_ms": round(d["save_ms"], 1),
            "unkeyed_lora_requests": int(d["unkeyed_lora_requests"]),
            "unkeyed_input_requests": int(d["unkeyed_input_requests"]),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in FIELDS)


class KVStorePromMetrics(KVConnectorPromMetrics):
    """One counter per field, per engine (vLLM's ``engine`` and model labels), each
    engine's series made at 0 here: a counter never incremented is still on
    ``/metrics``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # field -> engine index -> that engine's series (made now: they show at 0)
        self._series: dict[str, dict[int, Any]] = {}
        for name, text in FIELDS.items():
            exported = name.replace("_ms", "_seconds")
            counter = self._counter_cls(
                name=f"vllm:kvstore_{exported}", documentation=text, labelnames=labelnames
            )
            self._series[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, series in self._series.items():
            value = float(transfer_stats_data.get(name, 0))
            if value:
                series[engine_idx].inc(value / 1e3 if name.endswith("_ms") else value)
