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

Bindings are kept in ``<disk_dir>/namespace-names.jsonl`` when the disk tier is on, so
they survive restarts like the blocks do; in memory otherwise. The file is a log: a
bind appends its line (fsynced), so a flood of names costs each bind one line, never
a rewrite of all of them; a line torn by a crash is skipped at the next load. It holds
the salts of the specs it names, so it is the daemon user's alone (mode 0600). A file
of the former layout (``namespace-names.json``, one JSON object) is read once and
moved into the log.

A scope (tenant) binds at most ``max_per_scope`` names (0: no limit); past it a new
name is OutOfSpace (RESOURCE_EXHAUSTED), so no tenant grows the daemon's memory and
file without bound.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import InvalidArgument, LayoutMismatch, OutOfSpace, StoreError
from kvstore.keys import LABELS, NamespaceSpec

log = logging.getLogger("kvstored.names")

FILE_NAME = "namespace-names.jsonl"
OLD_FILE_NAME = "namespace-names.json"  # the former layout: one object, rewritten per bind
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")

Binding = tuple[str, dict[str, object]]  # ns_id, declared spec fields


class NamespaceNames:
    """name -> (ns_id, declared spec fields); thread-safe."""

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, max_per_scope: int = 0
    ) -> None:
        self._lock = threading.Lock()
        self._path = Path(directory) / FILE_NAME if directory else None
        self._max = max_per_scope
        self._bound: dict[str, Binding] = {}
        self._per_scope: dict[str, int] = {}
        if self._path is not None:
            self._load(self._path)

    def bind(
        self,
        name: str,
        spec: NamespaceSpec,
        open_fn: Callable[[NamespaceSpec], NamespaceSpec],
        scope: str = "",
    ) -> NamespaceSpec:
        """Open ``spec`` under ``name`` (idempotent); LayoutMismatch if bound to another
        spec, OutOfSpace if the scope has ``max_per_scope`` names already."""
        if not NAME_RE.match(name):
            raise InvalidArgument(
                f"name must be 1-128 characters of [A-Za-z0-9._:/-] starting with a letter "
                f"or digit, got {name!r}"
            )
        shown, name = name, _key(scope, name)
        with self._lock:
            bound = self._bound.get(name)
            # labels (the served model, the tokenizer) may change under a name: the
            # layout is what it binds
            held = {} if bound is None else {
                k: v for k, v in bound[1].items() if k not in LABELS
            }
            if bound is not None and held != spec.identity():
                diff = ", ".join(
                    "tenant_salt changed"  # a salt never leaves the daemon
                    if k == "tenant_salt" else f"{k}={held.get(k)!r}->{v!r}"
                    for k, v in spec.identity().items()
                    if held.get(k) != v
                )
                raise LayoutMismatch(
                    f"namespace name {shown!r} is bound to {bound[0]}; re-opened with a "
                    f"different layout ({diff})"
                )
            if bound is None and self._max and self._per_scope.get(scope, 0) >= self._max:
                raise OutOfSpace(
                    f"{self._max} namespace names are bound already, the most one tenant "
                    "may bind (tenant_max_namespaces)"
                )
            opened = open_fn(spec)
            if bound is None:
                self._add(name, (opened.ns_id, opened.identity()))
                self._append(name)
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

    # --- the file -------------------------------------------------------------------
    def _add(self, name: str, binding: Binding) -> None:
        if name not in self._bound:
            scope = name.rpartition("@")[0]
            self._per_scope[scope] = self._per_scope.get(scope, 0) + 1
        self._bound[name] = binding

    def _load(self, path: Path) -> None:
        old = path.with_name(OLD_FILE_NAME)
        entries: list[tuple[str, dict[str, object]]] = []
        if old.exists():
            try:
                entries += json.loads(old.read_text()).items()
            except (OSError, ValueError, AttributeError) as exc:
                log.warning("ignoring unreadable %s: %s", old, exc)
        if path.exists():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                try:
                    record = json.loads(line)
                    entries.append((record.pop("name"), record))
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    log.warning("skipping line %d of %s: %s", number, path, exc)
        for name, value in entries:
            try:  # declared fields as this version has them (a field added since, such
                # as codec, takes its default: a binding made before it still holds)
                spec = NamespaceSpec.from_dict(value["spec"])  # type: ignore[arg-type]
                self._add(name, (str(value["ns_id"]), spec.identity()))
            except (KeyError, TypeError, AttributeError, StoreError) as exc:
                log.warning("skipping the binding of %r in %s: %s", name, path, exc)
        if old.exists():  # into the log once, then gone
            for name in self._bound:
                self._append(name)
            old.unlink()

    def _append(self, name: str) -> None:  # under the lock (or in __init__)
        if self._path is None:
            return
        ns_id, spec = self._bound[name]
        line = json.dumps({"name": name, "ns_id": ns_id, "spec": spec}, sort_keys=True) + "\n"
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def _key(scope: str, name: str) -> str:
    return f"{scope}@{name}" if scope else name
