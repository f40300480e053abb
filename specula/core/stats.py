"""What one generation did: counts and timings, and the output returned by :func:`specula.generate`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transformers.generation.utils import GenerateDecoderOnlyOutput

if TYPE_CHECKING:
    from ..verifier.exactness import Exactness

TREE_COUNTERS = ("tree_passes", "tree_drafted", "tree_gain")  # SpecStats' counters of passes that sent a tree
PREDICTION_COUNTERS = ("accepted_prediction_tokens", "rejected_prediction_tokens")


@dataclass
class SpecStats:
    """Counters of one ``specula.generate`` call.

    A *pass* is one forward pass of the target over the last token of each request and its drafts (the prefill is
    the first). ``passes`` counts them, so plain decoding of N tokens takes N passes and ``tokens_per_pass`` is 1.0;
    ``accepted_per_position[i]`` counts the passes whose draft token i was accepted.
    ``tree_passes`` counts the passes that sent a tree (a draft that branches), ``tree_drafted`` their draft tokens,
    and ``tree_gain`` the tokens those trees accepted beyond what their first branch alone would have.
    ``exactness`` says how verification passes were computed (bitwise ``model.generate`` or ordinary) and why,
    ``compiled`` whether they ran compiled at static shapes (:mod:`specula.verifier.static`).
    With a prediction (``prediction=``), ``accepted_prediction_tokens`` / ``rejected_prediction_tokens`` count its
    tokens that passes verified and kept / rejected (as OpenAI's usage reports them).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    tree_passes: int = 0
    tree_drafted: int = 0
    tree_gain: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    rows: list["SpecStats"] = field(default_factory=list, repr=False)  # per request of a batch, in its order
    exactness: "Exactness | None" = None
    compiled: bool = False

    @classmethod
    def total(cls, rows: list["SpecStats"], passes: int, wall_time_s: float, prefill_time_s: float) -> "SpecStats":
        """The batch's totals over its rows' stats (kept in ``rows``): ``passes`` counts the passes, which the
        rows share; a row's ``passes`` counts the passes it took part in, its ``wall_time_s`` ends when it finished."""
        per_position = [0] * max((len(row.accepted_per_position) for row in rows), default=0)
        for row in rows:
            for position, count in enumerate(row.accepted_per_position):
                per_position[position] += count
        return cls(
            prompt_tokens=sum(row.prompt_tokens for row in rows),
            new_tokens=sum(row.new_tokens for row in rows),
            passes=passes,
            drafted=sum(row.drafted for row in rows),
            accepted=sum(row.accepted for row in rows),
            accepted_per_position=per_position,
            wall_time_s=wall_time_s,
            prefill_time_s=prefill_time_s,
            draft_time_s=sum(row.draft_time_s for row in rows),
            rows=rows,
            exactness=next((row.exactness for row in rows if row.exactness is not None), None),
            compiled=any(row.compiled for row in rows),
            **{name: sum(getattr(row, name) for row in rows) for name in TREE_COUNTERS + PREDICTION_COUNTERS},
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per target forward pass."""
        return self.new_tokens / self.passes if self.passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    def record_pass(self, drafted: int, accepted: int, tree_gain: int | None = None) -> None:
        """One target forward pass verified ``drafted`` draft tokens and accepted ``accepted`` of them (a path of a
        tree); ``tree_gain``, for a tree, is how many more than its first branch alone would have."""
        if tree_gain is not None:
            self.tree_passes, self.tree_drafted, self.tree_gain = (
                self.tree_passes + 1,
                self.tree_drafted + drafted,
                self.tree_gain + tree_gain,
            )
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted > len(self.accepted_per_position):
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def __str__(self) -> str:
        return (
            f"{self.new_tokens} new tokens in {self.wall_time_s:.2f}s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.passes} passes ({self.tokens_per_pass:.2f} tok/pass), "
            f"accepted {self.accepted}/{self.drafted} drafted ({self.acceptance_rate:.0%})"
            + (
                f", {self.tree_passes} trees ({self.tree_drafted / self.tree_passes:.1f} tokens each, "
                f"+{self.tree_gain} tokens over their first branches)"
                if self.tree_passes
                else ""
            )
            + (
                f", prediction {self.accepted_prediction_tokens} accepted / {self.rejected_prediction_tokens} rejected"
                if self.accepted_prediction_tokens or self.rejected_prediction_tokens
                else ""
            )
            + (f"; {self.exactness}" if self.exactness is not None else "")
            + ("; compiled passes" if self.compiled else "")
        )


@dataclass
class GenerateOutput(GenerateDecoderOnlyOutput):
    """What specula's entry points return: ``model.generate``'s output with ``return_dict_in_generate=True``
    (``sequences``: prompts + new tokens, ``[B, prompt_len + new_tokens]``, rows that ended early padded after their
    end as ``model.generate`` pads them) plus specula's ``stats``."""

    stats: SpecStats | None = None
