"""The commands and snippets a newcomer reads: the README's, then the docs site's.

Tests and benchmarks run what these documents say, as written
(tests/test_readme_commands.py, :mod:`kvbench.vllm_server`), so a page that gains a
command is a page whose command is run. The README comes first: its quick start is
the first ``kvstored`` line and its "Run the tests" line the first ``pytest`` one. The
docs site's pages follow in path order, less the benchmark reports (each names the
command that produced it, on machines these tests do not have) and the changelog
(history, not instructions). A block that is not meant to be run is fenced as
``console`` or ``text``, never ``bash`` or ``python``.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
NOT_INSTRUCTIONS = ("benchmarks", "changelog.md")  # under docs/: reports and history


def documents() -> list[Path]:
    """README.md, then docs/**/*.md but the reports and the changelog."""
    pages = [p for p in sorted(DOCS.rglob("*.md"))
             if p.relative_to(DOCS).parts[0] not in NOT_INSTRUCTIONS]  # fmt: skip
    return [README, *pages]


def fenced_blocks(language: str) -> list[str]:
    """The bodies of the documents' ```language blocks, in reading order."""
    return [block for doc in documents()
            for block in re.findall(rf"```{language}\n(.*?)```", doc.read_text(), re.S)]


def bash_lines() -> list[str]:
    """Lines of the documents' ```bash blocks, comments and blank lines dropped."""
    lines = []
    for block in fenced_blocks("bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines
