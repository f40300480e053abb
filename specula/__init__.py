"""specula: lossless speculative decoding for any HuggingFace causal language model.

    import specula
    out = specula.generate(model, input_ids, proposer=specula.PromptLookup(), max_new_tokens=128)
    out.sequences, out.stats
"""

import importlib
import pkgutil

from .generate import generate
from .hf import SpeculaGenerateOutput, custom_generate, prepare_jobs
from .loop import Decoder, Job
from .ngram import NGramPredictor
from .prompt_lookup import PromptLookup
from .proposer import Draft, Proposer
from .sampling import Sampling
from .small_model import SmallModelDrafter
from .stats import GenerateOutput, SpecStats
from .cached_model import UnsupportedModelError
from .cpu_layout import tune_cpu_layout

__all__ = [
    "Decoder", "Draft", "GenerateOutput", "Job", "SpeculaGenerateOutput", "custom_generate", "NGramPredictor",
    "PromptLookup", "Proposer", "Sampling", "SmallModelDrafter", "SpecStats", "UnsupportedModelError", "generate",
    "prepare_jobs", "tune_cpu_layout",
]
__version__ = "0.1.0"
_MODULES = frozenset(module.name for module in pkgutil.iter_modules(__path__))


def __getattr__(name: str):
    """specula's modules as attributes of the package, imported on first use (``specula.models.load_model()``
    after ``import specula``; ``specula.ray_job`` needs the ``ray`` extra)."""
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
