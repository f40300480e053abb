"""The cache goes by the name the installed transformers gives it: no deprecation warning from the cache renames of
transformers 5.24 (``past_key_values`` / ``cache_params`` -> ``cache``) reaches a user, on any path specula drives."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specula.verifier.cache_names import cache_in, cache_parameter

# Runs in a fresh interpreter: transformers logs each deprecation once per process, so an earlier test would hide it.
_RUN_EVERY_PATH = """
import json, logging, sys, warnings
sys.path.insert(0, TESTS)
import torch
from architectures import sweep_prompts, tiny_causal_lm
from helpers import Oracle
import specula
from specula.tools.drift import drift

caught = []
class Keep(logging.Handler):
    def emit(self, record):
        caught.append(record.getMessage())
logging.getLogger("transformers").addHandler(Keep())
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always")
    prompt = sweep_prompts()[0]
    pair = torch.cat([prompt, prompt.flip(1)])
    for model_type in ("llama", "mamba", "qwen3_next", "deepseek_v32"):  # attention, recurrent, hybrid, sparse
        model = tiny_causal_lm(model_type)
        reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
        specula.generate(model, prompt, Oracle(reference, 4), max_new_tokens=12, adaptive_draft=False)
        specula.generate(model, prompt, specula.PromptLookup(), max_new_tokens=12, do_sample=True,
                         generator=torch.Generator().manual_seed(0))
        rows = pair if model_type != "deepseek_v32" else prompt  # (sparse attention's requests decode one at a time)
        model.generate(rows, attention_mask=torch.ones_like(rows), max_new_tokens=8, do_sample=False,
                       custom_generate=specula.custom_generate, proposer=specula.PromptLookup())
    llama = tiny_causal_lm("llama")
    drift(llama, prompt, specula.PromptLookup(), 8)
    specula.generate(llama, prompt, specula.SmallModelDrafter(tiny_causal_lm("llama", seed=1)), max_new_tokens=8)
print(json.dumps(caught + [f"{w.category.__name__}: {w.message}" for w in warned]))
"""


def test_no_deprecation_warning_from_the_cache_renames() -> None:
    tests = str(Path(__file__).resolve().parents[1])
    result = subprocess.run(
        [sys.executable, "-c", _RUN_EVERY_PATH.replace("TESTS", repr(tests))], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    messages = json.loads(result.stdout.strip().splitlines()[-1])
    renames = [m for m in messages if any(name in m for name in ("past_key_values", "cache_params", "`cache`"))]
    assert renames == []


def test_the_cache_goes_by_the_name_a_forward_declares() -> None:
    def new(input_ids, cache=None, attention_mask=None): ...
    def old(input_ids, past_key_values=None, attention_mask=None): ...
    def mamba(hidden_states, cache_params=None, attention_mask=None): ...
    def xlm(input_ids, cache: dict | None = None): ...  # a dict of its own, not a transformers Cache
    def none(input_ids, attention_mask=None): ...

    names = [cache_parameter(inspect.signature(f).parameters) for f in (new, old, mamba, xlm, none)]
    assert names == ["cache", "past_key_values", "cache_params", None, None]
    assert cache_in({"attention_mask": 1, "cache": "c"}) == "c" and cache_in({"past_key_values": "p"}) == "p"
    assert cache_in({"cache": None, "past_key_values": "p"}) == "p" and cache_in({}) is None


def test_a_filled_cache_is_refused() -> None:
    import torch
    from architectures import sweep_prompts, tiny_causal_lm
    from transformers import DynamicCache

    import specula

    for model_type in ("llama", "mamba"):  # (a cache of recurrent layers only has no length to ask)
        model, prompt = tiny_causal_lm(model_type), sweep_prompts()[0]
        name = cache_parameter(inspect.signature(model.forward).parameters)  # (the installed transformers' name)
        cache = DynamicCache(config=model.config)
        model(prompt, **{name: cache}, use_cache=True)
        with pytest.raises(ValueError, match="cannot continue a filled cache"):
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=4,
                **{name: cache},
                custom_generate=specula.custom_generate,
                proposer=specula.PromptLookup(),
            )
