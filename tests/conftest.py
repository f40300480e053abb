import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# row-exact calibrations of this test run, not the user's (specula.verifier.calibration)
os.environ["SPECULA_CALIBRATIONS"] = str(Path(tempfile.mkdtemp(prefix="specula-calibrations-")) / "row_exact.json")

from tiny_models import CHAT_TEMPLATE, tiny_model, tiny_tokenizer  # noqa: E402

from specula.policy.costs import KEPT  # noqa: E402
from specula.verifier import calibration  # noqa: E402


@pytest.fixture(autouse=True)
def _no_pass_costs_kept_by_earlier_tests():
    """Each test starts without the pass costs the decoding of the tests before it kept for a next process."""
    calibration.shared().drop(KEPT)

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
