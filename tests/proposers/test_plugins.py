"""Proposers from other packages: real packages, built and installed by pip into a folder for the test, registering
entry points in the ``specula.proposers`` group; one works, one is broken."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ECHO = '''
"""A proposer that drafts the last tokens of the context again."""
import specula


class Echo(specula.Proposer):
    """drafts the last N tokens again (echo:N, default 2)"""

    def __init__(self, n="2"):
        self.n = int(n)

    def propose(self, context_ids, max_tokens):
        return specula.Draft(context_ids[-self.n:][:max_tokens])


def not_a_proposer():
    return 42
'''


def install(packages: Path, name: str, module: str, source: str, entry_points: dict[str, str]) -> None:
    """Build and install package ``name`` (one module) into ``packages`` with pip."""
    project = packages.parent / f"src-{name}"
    project.mkdir()
    (project / f"{module}.py").write_text(textwrap.dedent(source))
    points = "\n".join(f'{key} = "{value}"' for key, value in entry_points.items())
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{name}"
        version = "0.3.1"

        [tool.setuptools]
        py-modules = ["{module}"]
        """)
        + f'\n[project.entry-points."specula.proposers"]\n{points}\n'
    )
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            *isolation,
            "--target",
            str(packages),
            str(project),
        ],
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that has both packages installed."""
    packages = tmp_path_factory.mktemp("plugins") / "site"
    install(
        packages,
        "specula-echo",
        "specula_echo",
        ECHO,
        {"echo": "specula_echo:Echo", "no-proposer": "specula_echo:not_a_proposer", "ngram": "specula_echo:Echo"},
    )
    install(
        packages,
        "specula-broken",
        "specula_broken",
        "import a_module_that_does_not_exist\n",
        {"broken": "specula_broken:Proposer"},
    )
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(packages), os.environ.get("PYTHONPATH", "")]))


def specula(environment: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specula.cli", *map(str, argv)], env=environment, capture_output=True, text=True
    )


def test_proposers_lists_built_in_registered_and_broken(plugins) -> None:
    listed = specula(plugins, "proposers")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert any(line.startswith("prompt-lookup ") for line in lines)
    echo = lines.index(next(line for line in lines if line.startswith("echo ")))
    assert "drafts the last N tokens again" in lines[echo]
    assert "package specula-echo 0.3.1 (specula_echo:Echo)" in lines[echo + 1]
    broken = next(line for line in lines if line.startswith("broken "))
    assert "BROKEN" in broken and "a_module_that_does_not_exist" in broken
    shadowed = [line for line in lines if line.startswith("ngram ")]
    assert len(shadowed) == 2 and "ignored: a built-in proposer has this name" in shadowed[1]


def test_a_registered_proposer_drafts_and_output_is_unchanged(plugins, model_folder, tmp_path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "the quick brown fox the quick brown fox the quick"}) + "\n")
    answers = {}
    for proposer in ("echo:3", "none"):
        output = tmp_path / f"{proposer.replace(':', '-')}.jsonl"
        run = specula(
            plugins,
            "generate",
            "--input",
            source,
            "--output",
            output,
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--max-new-tokens",
            16,
            "--proposer",
            proposer,
        )
        assert run.returncode == 0, run.stderr
        answers[proposer] = json.loads(output.read_text())
    assert answers["echo:3"]["text"] == answers["none"]["text"]
    assert answers["echo:3"]["stats"]["drafted"] > 0 and answers["none"]["stats"]["drafted"] == 0


@pytest.mark.parametrize(
    "proposer, message",
    [
        (
            "broken",
            "proposer 'broken' from package specula-broken 0.3.1 (specula_broken:Proposer) cannot be loaded: "
            "ModuleNotFoundError",
        ),
        ("no-proposer", "returned a int, not a specula.Proposer"),
        ("echo:x", "proposer 'echo' from package specula-echo 0.3.1 failed to start with argument 'x': ValueError"),
        ("nothing", "Unknown proposer 'nothing'; built-in: prompt-lookup,"),
    ],
)
def test_bad_plugins_are_one_line_errors_before_the_model_loads(plugins, tmp_path, proposer, message) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi"}\n')
    run = specula(
        plugins,
        "generate",
        "--input",
        source,
        "--output",
        tmp_path / "out.jsonl",
        "--model",
        tmp_path / "no-such-model",
        "--proposer",
        proposer,
    )
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert "no-such-model" not in run.stderr  # the proposer was checked first


def test_a_broken_plugin_does_not_stop_the_built_in_proposers(plugins, model_folder, tmp_path) -> None:
    run = specula(
        plugins,
        "generate",
        "--prompt",
        "the quick brown fox the quick",
        "--raw",
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--max-new-tokens",
        8,
        "--proposer",
        "prompt-lookup",
    )
    assert run.returncode == 0, run.stderr
