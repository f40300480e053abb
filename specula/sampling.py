"""How the next token is chosen: greedy, or sampled after HF's temperature, top-k and top-p warpers."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# What model.generate(do_sample=True) uses when neither the caller nor the model's generation_config sets a value
# (transformers' GenerationConfig._get_default_generation_params; a test keeps the two in step).
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


# Warpers whose effect on a row of logits does not depend on the tokens before it: rows are processed in one batch.
_ROW_INDEPENDENT = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper,
)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from a model's logits: HF logits processors, then argmax or a random draw.

    :meth:`scores` applies ``processors`` exactly as ``model.generate`` does at every step (float32 logits, the
    tokens so far as ``input_ids``). The verifier uses it for the target's p and a stochastic drafter for its q, so
    both are transformed identically. Build one from sampling settings with :meth:`from_settings`; ``model.generate``
    hands its own prepared list to :func:`specula.custom_generate`.

    Args:
        do_sample: draw from the processed distribution; ``False`` takes its argmax (greedy).
        processors: transformers ``LogitsProcessor`` s and warpers, applied in order.
        generator: the random source; ``None`` uses torch's global RNG (so ``torch.manual_seed`` reproduces a run).
    """

    do_sample: bool = False
    processors: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}.")
        object.__setattr__(self, "processors", LogitsProcessorList(self.processors))

    @classmethod
    def from_settings(
        cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None
    ) -> "Sampling":
        """Temperature, top-k and top-p with transformers' own warpers, in ``model.generate``'s order;
        ``temperature=0`` is greedy, ``top_k=0`` and ``top_p=1.0`` keep every token."""
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0 decodes greedily), got {temperature!r}.")
        if not math.isfinite(temperature):
            raise ValueError(f"temperature must be finite, got {temperature!r}.")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}.")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1.0 keeps every token), got {top_p!r}.")
        if temperature == 0:
            return cls(generator=generator)
        warpers = LogitsProcessorList()
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(float(temperature)))
        if top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=float(top_p)))
        return cls(do_sample=True, processors=warpers, generator=generator)

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    @property
    def reads_tokens(self) -> bool:
        """Whether :meth:`scores` needs ``input_ids`` (a processor depends on the tokens so far)."""
        return not all(isinstance(processor, _ROW_INDEPENDENT) for processor in self.processors)

    def scores(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Processed float32 scores of ``[n, vocab]`` logits. Row ``i`` follows ``input_ids[:, :length - n + 1 + i]``
        (``input_ids``: ``[1, length]``, the tokens the rows were computed from); processors that read the tokens
        need it, the usual warpers do not."""
        logits = logits.float()
        if not self.processors:
            return logits
        if not self.reads_tokens:
            return self.processors(input_ids, logits)
        if input_ids is None:
            raise ValueError("These logits processors read the tokens so far: pass input_ids to Sampling.scores().")
        first = input_ids.shape[1] - logits.shape[0] + 1
        return torch.cat([self.processors(input_ids[:, : first + i], logits[i : i + 1]) for i in range(len(logits))])

    def probs(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, vocab]`` logits -> float32 probabilities of the next token at each of the ``n`` positions."""
        return torch.softmax(self.scores(logits, input_ids), dim=-1)

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
    logits_processor: LogitsProcessorList | None = None,
) -> Sampling:
    """The :class:`Sampling` of a ``specula.generate`` call; unset values come from the model's
    ``generation_config``, then from transformers' defaults, exactly as ``model.generate(do_sample=True)``.
    ``logits_processor`` goes before the warpers, as in ``model.generate``."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}.")
    if not do_sample:
        ignored = [f"{name}={value!r}" for name, value in given.items() if value is not None]
        if ignored:
            warnings.warn(f"{', '.join(ignored)} ignored: do_sample=False decodes greedily.", stacklevel=3)
        return Sampling(processors=logits_processor or [], generator=generator)
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
    warped = Sampling.from_settings(**settings, generator=generator)
    return Sampling(warped.do_sample, [*(logits_processor or []), *warped.processors], generator)
