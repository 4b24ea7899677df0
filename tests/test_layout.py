"""The code layout the design card promises: each top-level folder holds the package
of its name, imports run one way (core <- daemon, core <- client <- integrations and
kvctl), each wing of the client stays within its size, and the core and the daemon
are built from parts they own, not from classes stacked across modules."""

from __future__ import annotations

import abc
import argparse
import ast
import asyncio
import enum
import importlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

import kvbench
import kvclient
import kvctl
import kvproto
import kvstore
import kvstored

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {
    "kvstore": REPO / "kvstore",
    "kvstored": REPO / "daemon" / "kvstored",
    "kvclient": REPO / "client" / "kvclient",
    "kvctl": REPO / "client" / "kvctl",
    "kvproto": REPO / "proto" / "kvproto",
    "kvbench": REPO / "benchmarks" / "kvbench",
}
# the client's public paths of its integrations: one re-export each
PUBLIC_PATHS = {"kvclient.vllm", "kvclient.hf"}


def test_each_package_lives_in_the_folder_of_its_name() -> None:
    for package in (kvstore, kvstored, kvclient, kvctl, kvproto, kvbench):
        folder = Path(package.__file__).resolve().parent
        assert folder == FOLDERS[package.__name__], package.__name__


def modules(package: str) -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every hand-written module of ``package``."""
    root = FOLDERS[package]
    for path in sorted(root.rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join((package, *parts)), path


def imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(imported module, at module level?) for every import statement of a file."""
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, id(node) in top


def forbidden_imports(package: str, rules: dict[str, tuple[str, ...]]) -> list[str]:
    """'module imports name' for each import of a package's modules that ``rules``
    (module prefix -> forbidden module prefixes) forbid; the longest prefix rules."""
    found = []
    for name, path in modules(package):
        prefix = max((p for p in rules if name == p or name.startswith(p + ".")), key=len)
        for imported, _ in imports(path):
            if any(imported == bad or imported.startswith(bad + ".") for bad in rules[prefix]):
                found.append(f"{name} imports {imported}")
    return found


def test_imports_run_one_way() -> None:
    """The core knows no service, the daemon no client, the client library no
    benchmark and no operator's tool, the client core none of its integrations."""
    wings = ("kvclient.integrations",)
    assert forbidden_imports("kvstore", {"kvstore": ("kvstored", "kvclient", "kvctl",
                                                     "kvbench", "grpc")}) == []
    assert forbidden_imports("kvproto", {"kvproto": ("kvstore", "kvstored", "kvclient",
                                                     "kvctl", "kvbench")}) == []
    assert forbidden_imports("kvstored", {"kvstored": ("kvclient", "kvctl", "kvbench")}) == []
    client_rules = {"kvclient": ("kvstored", "kvctl", "kvbench", *wings),
                    "kvclient.integrations": ("kvstored", "kvctl", "kvbench")}
    client_rules.update({path: ("kvstored", "kvctl", "kvbench") for path in PUBLIC_PATHS})
    assert forbidden_imports("kvclient", client_rules) == []
    assert forbidden_imports("kvctl", {"kvctl": ("kvstored",)}) == []


def test_kvctl_loads_the_benchmark_harness_only_for_bench() -> None:
    """kvctl may use kvbench for ``kvctl bench``, imported inside that command."""
    eager = [
        f"{name} imports {imported}"
        for name, path in modules("kvctl")
        for imported, top in imports(path)
        if top and imported.split(".")[0] == "kvbench"
    ]
    assert eager == []


def test_the_forbidden_import_check_finds_one(tmp_path: Path) -> None:
    """The check above is not blind: an import inside a function is found too."""
    path = tmp_path / "mod.py"
    path.write_text("import os\n\ndef f():\n    from kvbench.cli import run_bench\n")
    assert ("kvbench.cli", False) in list(imports(path))


def test_the_client_loads_nothing_of_the_daemon() -> None:
    """Every module of the client core imported in a fresh process: no kvstored module
    loads, nor the disk tier (kvstore.disk: LMDB and the writer thread), through
    whatever the core imports of kvstore. (The integrations import the core and, by the
    rules above, nothing of the daemon; importing torch and vLLM here would cost most of
    this test's time.)"""
    names = [name for name, _ in modules("kvclient") if ".integrations" not in name
             and name not in PUBLIC_PATHS]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kvstored'\n"
        "             or m.split('.')[:2] == ['kvstore', 'disk']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


def lines(*folders: Path, without: Path | None = None) -> int:
    return sum(
        len(path.read_text().splitlines())
        for folder in folders
        for path in folder.rglob("*.py")
        if without is None or without not in path.parents
    )


def test_each_wing_of_the_client_stays_within_its_size() -> None:
    """The protocol core and the engine integrations change for different reasons
    (engine API churn): each has its own budget of lines, docstrings included."""
    client = FOLDERS["kvclient"]
    wings = client / "integrations"
    # (+300: windows of long prefixes, issue 55; +30: a namespace handle outlives the
    # daemon's memory of its namespace, opened again: #66's CI failure; +60: many
    # lookups of a namespace in one call, lookup_batch, for vLLM's tier: issue 69)
    assert lines(client, without=wings) <= 5390
    assert lines(FOLDERS["kvctl"]) <= 1060  # (+50 `kvctl why`, issue 43; +50 short prompts, 58)
    # (+140: lookup and why take a prompt's text, tokenized by the model's tokenizer, 69)
    # (+20: one helper escapes every string a client chose, issue 66)
    # (+20: the one-launch page copy, issue 59; +10: loads window by window, issue 55;
    # +170: the connector reports itself in vLLM's log and stats, issue 58)
    # (+150: keys that carry what vLLM's block hashes fold in, issue 66)
    # (+370: kvstore as a secondary tier of vLLM's native offloading, issue 69; +220:
    # connector settings from the environment and a YAML/TOML/JSON file through one
    # table, and a hit rate of kvstore's own, issue 69; +10: bounded error values; +30:
    # the tier's namespace by page layout and the engine's model config where vLLM
    # shows it, an outage of its own for lookups; +20: namespaces labelled with the
    # served model's name and its tokenizer, issue 69)
    assert lines(wings / "vllm") <= 2350  # (+200: hybrid models, issue 58)
    # (+50: copies straight to CUDA, issue 45; +170: layer-wise loads into cache layers
    # with room, issue 59; +10: the rest of a long prefix in windows, issue 55)
    assert lines(wings / "hf") <= 1130


MAX_MODULE_LINES = 700  # a module a newcomer reads in one pass (issue 55)


def test_no_module_is_longer_than_one_reading() -> None:
    """Every module of the packages, docstrings included, at most MAX_MODULE_LINES
    (generated protobuf code aside): a longer one holds two jobs, one of which moves
    to a module of its own."""
    long = [
        f"{name}: {len(path.read_text().splitlines())} lines"
        for package in FOLDERS
        for name, path in modules(package)
        if "_pb2" not in path.name and len(path.read_text().splitlines()) > MAX_MODULE_LINES
    ]
    assert long == []


# -- composition, not inheritance ------------------------------------------------------


# the standard library's documented extension points: a class made to be subclassed,
# whose one hook (error, format, the protocol callbacks) is overridden
HOOKS = (argparse.ArgumentParser, logging.Formatter, asyncio.Protocol)
# declared records and plain values: msgspec's Struct (its dataclass, as NamedTuple is
# tuple's), and a builtin list with data beside it (kvstore.keys.KeyChain)
VALUES = (msgspec.Struct, list)


def is_interface(base: type) -> bool:
    """What a class may inherit from another module: a Protocol, an abstract base
    class, an exception, an enum, a NamedTuple's tuple, a generated gRPC servicer (the
    service's interface: each of its methods answers UNIMPLEMENTED), a HOOKS class, a
    VALUES type."""
    return (
        base is object
        or getattr(base, "_is_protocol", False)
        or isinstance(base, abc.ABCMeta)
        or issubclass(base, BaseException | enum.Enum)
        or base is tuple
        or base.__module__.endswith("_pb2_grpc")
        or base in HOOKS
        or base in VALUES
    )


def concrete_bases_elsewhere(module: ModuleType) -> list[str]:
    """'Class(Base)' for each class of ``module`` that subclasses a concrete class of
    another module."""
    found = []
    for cls in vars(module).values():
        if not isinstance(cls, type) or cls.__module__ != module.__name__:
            continue
        if issubclass(cls, enum.Enum):  # its data type (str, int) is the enum's own
            continue
        for base in cls.__bases__:
            if base.__module__ != module.__name__ and not is_interface(base):
                found.append(f"{module.__name__}.{cls.__name__}({base.__module__}.{base.__name__})")
    return found


def test_the_core_and_the_daemon_compose_parts_instead_of_stacking_classes() -> None:
    """A part is built, tested and read alone: no class of kvstore/ or kvstored/ is a
    subclass of another module's concrete class."""
    found = [
        bad
        for package in ("kvstore", "kvstored")
        for name, _ in modules(package)
        if name not in ("kvstored.__main__",)
        for bad in concrete_bases_elsewhere(importlib.import_module(name))
    ]
    assert found == []


def test_the_subclass_check_finds_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is not blind: a stacked class is found, interfaces are not."""
    (tmp_path / "stack_base.py").write_text(
        "import abc, enum, typing\n"
        "class State:\n    x = 1\n"
        "class Shape(abc.ABC):\n    @abc.abstractmethod\n    def area(self): ...\n"
        "class Kind(enum.Enum):\n    A = 1\n"
        "class Reader(typing.Protocol):\n    def read(self) -> bytes: ...\n"
    )
    (tmp_path / "stack_top.py").write_text(
        "from stack_base import Kind, Reader, Shape, State\n"
        "class Reads(State): pass\n"
        "class Square(Shape):\n    def area(self): return 1\n"
        "class Fault(ValueError): pass\n"
        "class FileReader(Reader):\n    def read(self) -> bytes: return b''\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    top = importlib.import_module("stack_top")
    assert concrete_bases_elsewhere(top) == ["stack_top.Reads(stack_base.State)"]


# -- each near tier keeps its own places -------------------------------------------------

# a node's fields that say where a block is in one of the node's own tiers, and the one
# module that writes them (kvstore.near_tier)
PLACE_FIELDS = {
    "kvstore.host.placement": ("host_offset", "host_coded", "host_children"),
    "kvstore.disk.placement": ("on_disk", "disk_children"),
}


def place_writes(path: Path) -> Iterator[str]:
    """Each field of PLACE_FIELDS that a file assigns (``x.field = ...``, ``+=``) or
    passes by name (``Node(..., field=...)``)."""
    fields = {name for names in PLACE_FIELDS.values() for name in names}
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call):
            yield from (kw.arg for kw in node.keywords if kw.arg in fields)
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in fields:
                yield target.attr


def test_each_near_tier_alone_writes_its_places_in_the_index() -> None:
    """Host and disk are parts: where a block is in one of them is written by that
    tier's part and nowhere else (the stack moves blocks by calling them)."""
    owner = {field: name for name, fields in PLACE_FIELDS.items() for field in fields}
    found = [
        f"{name} writes {field}"
        for package in ("kvstore", "kvstored")
        for name, path in modules(package)
        for field in place_writes(path)
        if owner[field] != name
    ]
    assert found == []


def test_the_place_check_finds_one(tmp_path: Path) -> None:
    """The check above is not blind: an assignment, an increment and a keyword."""
    path = tmp_path / "mod.py"
    path.write_text("n.on_disk = True\nn.host_children += 1\nNode(k, host_offset=3)\n")
    assert list(place_writes(path)) == ["on_disk", "host_children", "host_offset"]
