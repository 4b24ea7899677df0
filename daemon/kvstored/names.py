"""Stable namespace names: what "re-opening a namespace with a different layout" means.

A namespace's id is derived from its whole spec (``model@digest``), so a client that
changes its layout by mistake (another dtype, block size, world size) would silently
get a fresh, empty namespace. A client that cares opens with a *name*
(``OpenNamespace(name="llama3-8b-tp0")``): the first open binds the name to that spec;
re-opening the name with any other spec raises LayoutMismatch (FAILED_PRECONDITION)
and changes nothing. Any request may then use the name where an ns_id is expected.

Names are per tenant (``scope``, see kvstored.auth): two tenants may each bind
"llama" to a namespace of their own, and neither resolves the other's. A scoped name
is kept as ``<tenant>@<name>`` (``@`` is not allowed in names, so it cannot clash).

Bindings are kept in ``<disk_dir>/namespace-names.json`` (written atomically) when the
disk tier is on, so they survive restarts like the blocks do; in memory otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import InvalidArgument, LayoutMismatch, StoreError
from kvstore.keys import NamespaceSpec

log = logging.getLogger("kvstored.names")

FILE_NAME = "namespace-names.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class NamespaceNames:
    """name -> (ns_id, declared spec fields); thread-safe."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._path = Path(directory) / FILE_NAME if directory else None
        self._bound: dict[str, tuple[str, dict[str, object]]] = {}
        if self._path is not None and self._path.exists():
            try:
                data = json.loads(self._path.read_text())
                # declared fields as this version has them (a field added since, such
                # as codec, takes its default: a binding made before it still holds)
                self._bound = {
                    n: (v["ns_id"], NamespaceSpec.from_dict(v["spec"]).to_dict())
                    for n, v in data.items()
                }
            except (OSError, ValueError, KeyError, TypeError, AttributeError, StoreError) as exc:
                log.warning("ignoring unreadable %s: %s", self._path, exc)

    def bind(
        self,
        name: str,
        spec: NamespaceSpec,
        open_fn: Callable[[NamespaceSpec], NamespaceSpec],
        scope: str = "",
    ) -> NamespaceSpec:
        """Open ``spec`` under ``name`` (idempotent); LayoutMismatch if bound to another spec."""
        if not NAME_RE.match(name):
            raise InvalidArgument(
                f"name must be 1-128 characters of [A-Za-z0-9._:/-] starting with a letter "
                f"or digit, got {name!r}"
            )
        shown, name = name, _key(scope, name)
        with self._lock:
            bound = self._bound.get(name)
            if bound is not None and bound[1] != spec.to_dict():
                diff = ", ".join(
                    "tenant_salt changed"  # a salt never leaves the daemon
                    if k == "tenant_salt" else f"{k}={bound[1].get(k)!r}->{v!r}"
                    for k, v in spec.to_dict().items()
                    if bound[1].get(k) != v
                )
                raise LayoutMismatch(
                    f"namespace name {shown!r} is bound to {bound[0]}; re-opened with a "
                    f"different layout ({diff})"
                )
            opened = open_fn(spec)
            if bound is None:
                self._bound[name] = (opened.ns_id, opened.to_dict())
                self._save()
            return opened

    def resolve(self, ns_id_or_name: str, scope: str = "") -> str:
        """A name bound in ``scope`` -> its ns_id; anything else is returned as given."""
        bound = self._bound.get(_key(scope, ns_id_or_name))
        return bound[0] if bound is not None else ns_id_or_name

    def names_by_ns_id(self) -> dict[str, str]:
        with self._lock:
            out: dict[str, str] = {}
            for name, (ns_id, _) in sorted(self._bound.items()):
                out.setdefault(ns_id, name.rpartition("@")[2])
            return out

    def _save(self) -> None:  # under the lock
        if self._path is None:
            return
        data = {n: {"ns_id": i, "spec": s} for n, (i, s) in sorted(self._bound.items())}
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)


def _key(scope: str, name: str) -> str:
    return f"{scope}@{name}" if scope else name
