import math
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# the measurements of this test run, not the user's (specula.machine.store)
os.environ["SPECULA_CALIBRATIONS"] = str(Path(tempfile.mkdtemp(prefix="specula-measurements-")) / "measurements.json")

from tiny_models import CHAT_TEMPLATE, tiny_model, tiny_tokenizer  # noqa: E402

from specula.machine import load, store  # noqa: E402
from specula.policy.costs import KEPT  # noqa: E402

# run in parallel (the README's `-n auto`, pytest-xdist): each worker takes its share of the cores, not all of them
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


QWEN_FILES = ("test_qwen_pair.py", "test_tool_calls.py", "test_tools_served.py")  # (tests of the Qwen2.5-Coder pair)


def pytest_collection_modifyitems(items) -> None:
    """Tests that start a local Ray instance run on one worker, one after another (``--dist loadgroup``): two
    instances at once would share the machine's cores and memory; so do the tests of the Qwen2.5-Coder pair (a
    worker holding both models takes most of a 24 GB machine: two would not fit; the files that load one of them
    share the worker's copy)."""
    for item in items:
        if "ray" in item.name.split("[")[0].split("_") or item.path.name == "test_ray.py":
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif item.path.name in QWEN_FILES:
            item.add_marker(pytest.mark.xdist_group("qwen pair"))


@pytest.fixture(autouse=True)
def _no_pass_costs_kept_by_earlier_tests():
    """Each test starts without the pass costs the decoding of the tests before it kept for a next process."""
    store.shared().drop(KEPT)


@pytest.fixture(autouse=True)
def _measurements_kept_whatever_the_neighbours(monkeypatch):
    """What a test's store keeps does not depend on what else ran on the CI machine meanwhile (a measurement made
    while other programs took the CPUs is not kept: tests/machine/test_load.py turns that back on)."""
    monkeypatch.setattr(load, "BUSY", math.inf)


@pytest.fixture
def fresh_store(monkeypatch, tmp_path):
    """An empty store of measurements of the test's own, as a new process on a new machine starts; its file's path
    (``store.forget()`` then reads it again, as the next process would)."""
    path = tmp_path / "measurements.json"
    monkeypatch.setenv("SPECULA_CALIBRATIONS", str(path))
    store.forget()
    yield path
    store.forget()


@pytest.fixture
def drafts_cost_nothing(fresh_store, monkeypatch):
    """Passes as a GPU's, whatever the CI machine's clock: kept pass costs flat (a pass over any number of tokens
    costs a one-token pass) and a fake clock on which every pass takes a second, so that the cost model and its
    guard send drafts wherever they may be accepted (tests that count accepted tokens)."""
    from helpers import TickingClock

    from specula.policy import kept_costs
    from specula.verifier.runner import CachedModel

    clock, forward_rows = TickingClock(), CachedModel.forward_rows

    def one_second(self, *args, **kwargs):
        clock.jump(1.0)
        return forward_rows(self, *args, **kwargs)

    monkeypatch.setattr(
        kept_costs, "_measure", lambda model, rows=1, compiled=None: [1.0] * len(kept_costs.widths(rows))
    )
    monkeypatch.setattr(CachedModel, "forward_rows", one_second)
    monkeypatch.setattr(time, "perf_counter", clock)


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    """A tiny Llama and its BPE tokenizer (with a chat template) saved as an ordinary HF folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model fails the test loudly."""
    from specula.cli import commands

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the files were checked")

    monkeypatch.setattr(commands, "load_model", refuse)
