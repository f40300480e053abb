"""How the next token is chosen: greedy, or sampled after HF's temperature, top-k and top-p warpers."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

# What model.generate(do_sample=True) uses when neither the caller nor the model's generation_config sets a value
# (transformers' GenerationConfig._get_default_generation_params; a test keeps the two in step).
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class Sampling:
    """The decoding rule of one generation; ``temperature == 0`` means greedy.

    :meth:`probs` turns logits into the distribution a token is drawn from, with transformers' own warpers in
    ``model.generate``'s order (temperature, top-k, top-p), computed in float32. The verifier applies it to the
    target's logits (p) and a stochastic drafter applies it to its own (q): both are warped identically.

    Args:
        temperature: 0 for greedy decoding, else the softmax temperature.
        top_k: keep the ``top_k`` most likely tokens; 0 keeps all.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; 1.0 keeps all.
        generator: the random source; ``None`` uses torch's global RNG (so ``torch.manual_seed`` reproduces a run).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        temperature, top_k, top_p = self.temperature, self.top_k, self.top_p
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0 decodes greedily), got {temperature!r}.")
        if not math.isfinite(temperature):
            raise ValueError(f"temperature must be finite, got {temperature!r}.")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}.")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1.0 keeps every token), got {top_p!r}.")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def warpers(self) -> LogitsProcessorList:
        """The warpers ``model.generate`` would build for these settings."""
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(self.top_p)))
        return warpers

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` logits -> float32 probabilities of the next token at each of the ``n`` positions."""
        return torch.softmax(self.warpers(None, logits.float()), dim=-1)

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` draws from U[0, 1) on ``device``."""
        return torch.rand(n, generator=self.generator, device=self._random_device(device)).to(device)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``[n, vocab]`` (possibly unnormalised) probabilities."""
        device = self._random_device(probs.device)
        return torch.multinomial(probs.to(device), 1, generator=self.generator).squeeze(-1).to(probs.device)

    def _random_device(self, device: torch.device) -> torch.device:
        return device if self.generator is None else self.generator.device


def resolve_sampling(
    model: torch.nn.Module,
    do_sample: bool,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Sampling:
    """The :class:`Sampling` of a ``specula.generate`` call; unset values come from the model's
    ``generation_config``, then from transformers' defaults, exactly as ``model.generate(do_sample=True)``."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}.")
    if not do_sample:
        ignored = [f"{name}={value!r}" for name, value in given.items() if value is not None]
        if ignored:
            warnings.warn(f"{', '.join(ignored)} ignored: do_sample=False decodes greedily.", stacklevel=3)
        return Sampling()
    generation_config = getattr(model, "generation_config", None)
    settings = {}
    for name, value in given.items():
        if value is None:
            value = getattr(generation_config, name, None)
        settings[name] = HF_SAMPLING_DEFAULTS[name] if value is None else value
    if generator is not None and isinstance(generator, torch.Generator):
        model_device = model.get_input_embeddings().weight.device
        if generator.device.type != model_device.type:
            raise ValueError(
                f"generator is on {generator.device} but the model is on {model_device}; create it with "
                f"torch.Generator(device={str(model_device)!r})."
            )
    return Sampling(**settings, generator=generator)
