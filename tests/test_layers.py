"""The layers hold: import-linter's contract in pyproject.toml is kept by the package, and broken by an upward import
planted anywhere (a mutant per layer boundary, each inside a function, as lazy imports are)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lint(tree: Path) -> subprocess.CompletedProcess:
    """import-linter's verdict on the package under ``tree`` (imported from there, not from the installed one)."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint_imports), "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_layers() -> None:
    result = lint(ROOT)
    assert result.returncode == 0 and "1 kept, 0 broken" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    "module, upward",
    [
        ("machine/timing.py", "specula.verifier.runner"),  # the bottom importing the verifier
        ("core/draft.py", "specula.decoding.loop"),  # the primitives importing the loop
        ("verifier/support.py", "specula.policy.costs"),  # the verifier importing the policy
        ("policy/costs.py", "specula.proposers.base"),  # one side of a layer importing the other
        ("decoding/loop.py", "specula.hf.loading"),  # the loop importing a face
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, upward: str) -> None:
    shutil.copytree(ROOT / "specula", tmp_path / "specula", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    planted = tmp_path / "specula" / module
    planted.write_text(planted.read_text() + f"\n\ndef _planted():\n    import {upward}  # noqa: F401\n")
    result = lint(tmp_path)
    assert result.returncode != 0 and "0 kept, 1 broken" in result.stdout, result.stdout + result.stderr
