"""The load test (``examples/load_test.py``) in its bounded form: a real server under concurrent streams with
hang-ups, bad bodies and requests that run to the end of the context; every whole answer is model.generate's, every
bad body a 400, the hung-up streams cancelled, and the resident set back near its idle level after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server's extra: pip install 'specula[serve]'")
pytest.importorskip("openai")

SCRIPT = Path(__file__).parents[2] / "examples" / "load_test.py"


def test_the_server_under_load_answers_right_and_gives_its_memory_back(model_folder, tmp_path) -> None:
    report = tmp_path / "load.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            str(model_folder),
            "--clients",
            "6",
            "--hang-ups",
            "2",
            "--bad",
            "6",
            "--mixed",
            "2",
            "--long",
            "2",
            "--tail",
            "64",
            "--max-tokens",
            "12",
            "--max-memory",
            "1MB",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["answers_identical"] == "4/4" and result["bad_bodies_400"] == "6/6" and result["hung_up"] == 2
    assert result["long_finished_at_length"] == "2/2" and result["budget_bytes"] == 1_000_000
    # (a hang-up cancels its request unless the request's last tokens came first: 12 tokens, several a pass)
    assert 1 <= result["health"]["cancelled"] <= 2 and result["health"]["failed"] == 0
    assert result["after_within_0.5GB_of_idle"] and result["mixed"]["kv_bytes"] > 0
