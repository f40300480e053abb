"""How the next token is chosen: greedy, or sampled after HF's temperature, top-k and top-p warpers."""

from __future__ import annotations

import math
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
from transformers.generation.logits_process import (
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

# Warpers whose effect on a row of logits does not depend on the tokens before it: rows are processed in one batch.
_ROW_INDEPENDENT = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)
# Processors that change their own state at every call (a model pass with its own cache, a watermarking context):
# scoring several positions per pass, and rejected ones, would drift them from what model.generate computes.
_STATEFUL = (UnbatchedClassifierFreeGuidanceLogitsProcessor, SynthIDTextWatermarkLogitsProcessor)


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
        stateful = [type(processor).__name__ for processor in self.processors if isinstance(processor, _STATEFUL)]
        if stateful:
            raise ValueError(
                f"{', '.join(stateful)} keeps state from one call to the next, so specula cannot apply it exactly "
                "(it scores several positions per pass and rolls rejected ones back); use model.generate() for it."
            )

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
