"""``kvctl why``: the first block of a prompt that is not served, and why (one line)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvclient.namespace import Namespace
from kvctl.views import short_tokens_note

RULES = {  # how a lost block left its last tier (kvstore.misses.RULES)
    "priority": "evicted from {tier} by leaf-first priority (lowest priority, then least "
    "recently used)",
    "quota": "evicted from {tier}: its tenant was at its {tier} quota",
    "ttl": "dropped before its commit: its writer's lease ran out (ttl)",
    "corrupt": "dropped from disk: its record failed the checksum",
    "deleted": "removed by a Delete or Clear",
}


def collect_why(ns: Namespace, tokens: list[int]) -> dict[str, Any]:
    miss = ns.why(tokens)
    blocks = len(tokens) // ns.block_tokens
    return {
        "ns_id": ns.ns_id,
        "blocks": blocks,
        "request_tokens": len(tokens),
        "block_tokens": ns.block_tokens,
        **dataclasses.asdict(miss),
    }


def render_why(data: dict[str, Any]) -> str:
    return _reason(data) + short_tokens_note(data["request_tokens"], data["block_tokens"])


def _reason(data: dict[str, Any]) -> str:
    reason, head = data["reason"], f"{data['ns_id']}: block {data['block']} of {data['blocks']}"
    if reason == "served" and not data["blocks"]:
        return f"{data['ns_id']}: no full block to serve"
    if reason == "served":
        return f"{data['ns_id']}: all {data['blocks']} blocks are served"
    if reason == "pending":
        return f"{head}: pending, another writer is computing it"
    if reason == "lost":
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data["when"]))
        rule = RULES.get(data["rule"], data["rule"]).format(tier=data["tier"])
        return f"{head}: {rule}, at {stamp}"
    if reason == "other_namespace":
        differs = ", ".join(data["differs"]) or "nothing declared"
        return f"{head}: stored under another namespace, {data['other_ns']} (differs in {differs})"
    return f"{head}: never stored (or lost before the daemon's memory of losses)"
