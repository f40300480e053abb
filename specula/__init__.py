"""specula: lossless speculative decoding for any HuggingFace causal language model.

    import specula
    out = specula.generate(model, input_ids, proposer=specula.PromptLookup(), max_new_tokens=128)
    out.sequences, out.stats
"""

from . import _modules
from .hf.generate import SpeculaGenerateOutput, custom_generate, generate, prepare_jobs
from .core.loop import Decoder, Job
from .proposers.ngram import NGramPredictor
from .proposers.prompt_lookup import PromptLookup
from .core.draft import Draft
from .proposers.base import Proposer, RequestProposer
from .core.sampling import Sampling
from .proposers.small_model import SmallModelDrafter
from .core.stats import GenerateOutput, SpecStats
from .target.support import UnsupportedModelError
from .target.cpu_layout import tune_cpu_layout

__all__ = [
    "Decoder", "Draft", "GenerateOutput", "Job", "SpeculaGenerateOutput", "custom_generate", "NGramPredictor",
    "PromptLookup", "Proposer", "RequestProposer", "Sampling", "SmallModelDrafter", "SpecStats", "UnsupportedModelError", "generate",
    "prepare_jobs", "tune_cpu_layout",
]
__version__ = "0.1.0"
_modules.install()


def __getattr__(name: str):
    """specula's packages and modules as attributes, imported on first use (``specula.jobs.ray`` needs the ``ray``
    extra), under their names from before 0.2 too."""
    return _modules.attribute(__name__, name)
