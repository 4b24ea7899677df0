"""MkDocs hook (``hooks:`` in mkdocs.yml): the pages of the docs site made from the
sources themselves at every build, so they cannot drift from them.

- ``reference/config.md``: the daemon's one table of configuration keys
  (``kvstored.config.KEYS``: TOML key, flag, environment variable, type, default, help),
  the table that --help, --print-config and the config loader are made from.
- ``reference/proto.md``: the wire contract, ``proto/kvproto/v1/*.proto``, compiled by
  protoc (grpcio-tools, as scripts/gen_proto.sh does) with its source info, so every
  service, method, message, field and enum is listed with the comment written beside it.
- ``operations/deploy.md``: deploy/README.md, the operator's manual (the tests read its
  metric, log and systemd sections where it is), with its links into docs/ made
  relative to the page and other links into the repository shown as paths.
- The nav entry ``benchmarks/*`` becomes every report under docs/benchmarks/, so a new
  report is in the site without an edit here.

Each of those pages is a short file under docs/ that says, for a reader of the
repository, where its content comes from; MkDocs calls ``on_page_markdown`` with it and
the hook returns the page made from the source instead, which is then built like any
other (``--strict`` checks its links). ``on_config`` runs once, before the nav is read.
"""

from __future__ import annotations

import os
import re
import tempfile
from importlib.resources import files as package_files
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.pages import Page

from kvstored.config import KEYS, TENANTS_TABLE, Key
from kvstored.config_values import format_size

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTOS = ("kvproto/v1/kvstore.proto", "kvproto/v1/gpu.proto")
DEPLOY_README = REPO / "deploy" / "README.md"
BENCHMARKS_NAV = "benchmarks/*"

CONFIG_PAGE = "reference/config.md"
PROTO_PAGE = "reference/proto.md"
DEPLOY_PAGE = "operations/deploy.md"


# --- mkdocs events -----------------------------------------------------------------------


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Expand the nav's ``benchmarks/*`` into the reports under docs/benchmarks/."""
    reports = sorted(Path(config.docs_dir, "benchmarks").glob("*.md"))
    pages = [f"benchmarks/{p.name}" for p in reports]

    def expand(items: list[Any]) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if isinstance(item, dict):
                out.append({title: pages if value == BENCHMARKS_NAV else
                            expand(value) if isinstance(value, list) else value
                            for title, value in item.items()})  # fmt: skip
            else:
                out.append(item)
        return out

    config.nav = expand(config.nav or [])
    return config


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    made = MADE_PAGES.get(page.file.src_uri)
    return made() if made else markdown


# --- the configuration keys --------------------------------------------------------------


def cell(text: str) -> str:
    """``text`` as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def default_text(key: Key) -> str:
    if callable(key.default):
        return "chosen at start-up (see its meaning)"
    if key.default == "" or key.default is None:
        return "none"
    if isinstance(key.default, bool):
        return f"`{str(key.default).lower()}`"
    if key.type == "size" and isinstance(key.default, int):
        return f"`{format_size(key.default)}`" if key.default else "`0`"
    return f"`{key.default}`"


def config_page() -> str:
    rows = [f"| `{k.name}` | `{k.flag}` | `{k.env}` | {k.type} | {default_text(k)} | "
            f"{cell(k.help)} |" for k in KEYS]  # fmt: skip
    return "\n".join([
        "# Configuration keys",
        "",
        "Made at every docs build from the daemon's own table "
        "(`kvstored.config.KEYS`, the one that `kvstored --help`, `--print-config` and "
        "the config loader are made from), so it lists every key there is. How the "
        "sources combine, and what a bad value does: [Configuration]"
        "(../operations/configuration.md).",
        "",
        "Every key is a TOML key (`--config FILE` or `KVSTORED_CONFIG`), a flag and an "
        "environment variable; later wins: default < file < environment < flag. Sizes "
        "take bytes or `KiB`, `MiB`, `GiB`, `TiB`; every number has a bound, and a value "
        "past it stops start-up with one line naming the key (exit 2).",
        "",
        "| TOML key | flag | environment | type | default | meaning |",
        "|---|---|---|---|---|---|",
        *rows,
        f"| `[{TENANTS_TABLE}.<name>]` | | | table | none | TOML only: `token_file`, "
        "optional `host_bytes` / `disk_bytes` quotas and `events_topic`: see "
        "[Tenants, tokens and TLS](../operations/tenants.md) |",
        "",
    ])


# --- the wire contract -------------------------------------------------------------------

_TYPE_NAMES = {number: name.removeprefix("TYPE_").lower()
               for name, number in descriptor_pb2.FieldDescriptorProto.Type.items()}  # fmt: skip
_MESSAGE, _ENUM, _SERVICE, _SYNTAX = 4, 5, 6, 12  # FileDescriptorProto field numbers
_FIELD, _NESTED_MESSAGE, _NESTED_ENUM = 2, 3, 4  # DescriptorProto field numbers
_ENUM_VALUE, _METHOD = 2, 2  # EnumDescriptorProto, ServiceDescriptorProto


def compiled_protos() -> descriptor_pb2.FileDescriptorSet:
    """PROTOS compiled by protoc, comments kept (``--include_source_info``)."""
    includes = str(package_files("grpc_tools") / "_proto")  # protoc's own imports
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "protos.pb")
        status = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{includes}",
                              "--include_source_info", f"--descriptor_set_out={out}",
                              *PROTOS])  # fmt: skip
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTOS} (exit {status})")
        return descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())


class _Comments:
    """The comment written before (or beside) each element of one .proto file."""

    def __init__(self, proto: descriptor_pb2.FileDescriptorProto) -> None:
        self.by_path: dict[tuple[int, ...], str] = {}
        self.header = ""
        for loc in proto.source_code_info.location:
            text = loc.leading_comments or loc.trailing_comments
            if text:
                self.by_path[tuple(loc.path)] = text
            if tuple(loc.path) == (_SYNTAX,) and loc.leading_detached_comments:
                self.header = "\n\n".join(loc.leading_detached_comments)

    def __call__(self, *path: int) -> str:
        return self.by_path.get(path, "")


def _type_name(field: descriptor_pb2.FieldDescriptorProto, package: str) -> str:
    if field.type_name:
        name = field.type_name.removeprefix(f".{package}.")
        return f"[{name}](#{name.lower()})" if "." not in name else name
    return _TYPE_NAMES[field.type]


def _message(msg: descriptor_pb2.DescriptorProto, path: tuple[int, ...], package: str,
             comments: _Comments, prefix: str = "") -> list[str]:
    name = prefix + msg.name
    lines = [f"### {name}", ""]
    if comments(*path):
        lines += [comments(*path).strip(), ""]
    if msg.field:
        lines += ["| field | number | type | meaning |", "|---|---|---|---|"]
        for i, field in enumerate(msg.field):
            kind = _type_name(field, package)
            if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
                kind = f"repeated {kind}"
            if field.HasField("oneof_index") and not field.proto3_optional:
                kind += f" (oneof `{msg.oneof_decl[field.oneof_index].name}`)"
            lines.append(f"| `{field.name}` | {field.number} | {kind} | "
                         f"{cell(comments(*path, _FIELD, i))} |")
        lines.append("")
    else:
        lines += ["No fields.", ""]
    for i, nested in enumerate(msg.nested_type):
        if not nested.options.map_entry:
            lines += _message(nested, (*path, _NESTED_MESSAGE, i), package, comments,
                              f"{name}.")
    for i, enum in enumerate(msg.enum_type):
        lines += _enum(enum, (*path, _NESTED_ENUM, i), comments, f"{name}.")
    return lines


def _enum(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...],
          comments: _Comments, prefix: str = "") -> list[str]:
    lines = [f"### {prefix}{enum.name}", ""]
    if comments(*path):
        lines += [comments(*path).strip(), ""]
    lines += ["| value | number | meaning |", "|---|---|---|"]
    lines += [f"| `{value.name}` | {value.number} | {cell(comments(*path, _ENUM_VALUE, i))} |"
              for i, value in enumerate(enum.value)]
    return [*lines, ""]


def proto_page() -> str:
    lines = [
        "# Wire protocol",
        "",
        "Made at every docs build from `proto/kvproto/v1/*.proto`, compiled by protoc "
        "with the comments kept, so it is the contract the daemon serves. Clients in "
        "Python use `kvclient`, which speaks it; other languages generate a client from "
        "the same files.",
        "",
    ]
    for proto in compiled_protos().file:
        comments = _Comments(proto)
        lines += [f"## `{proto.name}`", ""]
        if comments.header:
            lines += ["```text", comments.header.rstrip(), "```", ""]
        for s, service in enumerate(proto.service):
            lines += [f"### service {proto.package}.{service.name}", ""]
            if comments(_SERVICE, s):
                lines += [comments(_SERVICE, s).strip(), ""]
            lines += ["| method | request | response | meaning |", "|---|---|---|---|"]
            for m, method in enumerate(service.method):
                request = method.input_type.removeprefix(f".{proto.package}.")
                response = method.output_type.removeprefix(f".{proto.package}.")
                stream_in = "stream " if method.client_streaming else ""
                stream_out = "stream " if method.server_streaming else ""
                lines.append(
                    f"| `{method.name}` | {stream_in}[{request}](#{request.lower()}) | "
                    f"{stream_out}[{response}](#{response.lower()}) | "
                    f"{cell(comments(_SERVICE, s, _METHOD, m))} |"
                )
            lines.append("")
        for i, msg in enumerate(proto.message_type):
            lines += _message(msg, (_MESSAGE, i), proto.package, comments)
        for i, enum in enumerate(proto.enum_type):
            lines += _enum(enum, (_ENUM, i), comments)
    return "\n".join(lines)


# --- the operator's manual ---------------------------------------------------------------


def deploy_page() -> str:
    """deploy/README.md as a page of the site: links into docs/ relative to the page,
    links to other files of the repository as their paths (the site has no copy)."""
    docs = (REPO / "docs").resolve()
    page_dir = (docs / DEPLOY_PAGE).parent

    def relink(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if "://" in target or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = (DEPLOY_README.parent / path).resolve()
        if resolved.is_relative_to(docs):
            link = os.path.relpath(resolved, page_dir) + (f"#{anchor}" if anchor else "")
            return f"[{text}]({link})"
        return f"{text} (`{resolved.relative_to(REPO)}`)"

    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", relink, DEPLOY_README.read_text())
    note = ("\n\n*This page is `deploy/README.md`, the manual beside the files it "
            "describes (`deploy/` in the repository).*\n")
    title, _, rest = text.partition("\n")
    return title + note + rest


MADE_PAGES = {CONFIG_PAGE: config_page, PROTO_PAGE: proto_page, DEPLOY_PAGE: deploy_page}
