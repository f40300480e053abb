"""specula: lossless speculative decoding for any HuggingFace causal language model.

    import specula
    out = specula.generate(model, input_ids, proposer=specula.PromptLookup(), max_new_tokens=128)
    out.sequences, out.stats

Names are imported on first use, so ``import specula`` (and the ``specula`` command's argument checks) need neither
torch nor transformers until something is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._lazy import submodules

if TYPE_CHECKING:  # (for type checkers and editors: each re-exported as itself)
    from .core.draft import Draft as Draft
    from .core.sampling import Sampling as Sampling
    from .core.stats import GenerateOutput as GenerateOutput
    from .core.stats import SpecStats as SpecStats
    from .decoding.loop import Decoder as Decoder
    from .decoding.loop import Job as Job
    from .hf.generate import custom_generate as custom_generate
    from .hf.generate import generate as generate
    from .hf.generate import prepare_jobs as prepare_jobs
    from .hf.loading import load_model as load_model
    from .proposers.base import Proposer as Proposer
    from .proposers.base import RequestProposer as RequestProposer
    from .proposers.ngram import NGramPredictor as NGramPredictor
    from .proposers.prompt_lookup import PromptLookup as PromptLookup
    from .proposers.small_model import SmallModelDrafter as SmallModelDrafter
    from .verifier.cpu_layout import tune_cpu_layout as tune_cpu_layout
    from .verifier.support import UnsupportedModelError as UnsupportedModelError

_HOMES = {  # each public name -> the module that defines it
    "Decoder": "decoding.loop",
    "Draft": "core.draft",
    "GenerateOutput": "core.stats",
    "Job": "decoding.loop",
    "NGramPredictor": "proposers.ngram",
    "PromptLookup": "proposers.prompt_lookup",
    "Proposer": "proposers.base",
    "RequestProposer": "proposers.base",
    "Sampling": "core.sampling",
    "SmallModelDrafter": "proposers.small_model",
    "SpecStats": "core.stats",
    "UnsupportedModelError": "verifier.support",
    "custom_generate": "hf.generate",
    "generate": "hf.generate",
    "load_model": "hf.loading",
    "prepare_jobs": "hf.generate",
    "tune_cpu_layout": "verifier.cpu_layout",
}
__all__ = sorted(_HOMES)
__version__ = "0.1.0"
_submodule = submodules(__name__)


def __getattr__(name: str):
    """A public name (imported from its module on first use), or one of specula's packages."""
    if name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    return _submodule(name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
