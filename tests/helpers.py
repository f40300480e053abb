"""Proposers with known behaviour, and the HF reference the verifier is compared with."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import specula
from specula.machine.memory import Pages
from specula.tools.replay import Replay

MODELS = Path(os.environ.get("SPECULA_MODELS", Path.home() / ".cache" / "specula-models"))  # Qwen2.5-Coder's
SHARED = Path(__file__).resolve().parents[2] / "shared"  # ../shared beside the clone: workloads, scripts


WEATHER = {  # a function OpenAI's API would be offered (OpenAI's "tools" shape)
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


def qwen_folder(size: str) -> Path:
    """The folder of Qwen2.5-Coder-``size``-Instruct, converted by ``../shared/scripts/get-models.sh`` (the README's
    test command runs it); a skip where neither it nor the script is here."""
    folder = MODELS / f"qwen2.5-coder-{size}"
    fetch = f"bash ../shared/scripts/get-models.sh {MODELS} qwen2.5-coder-0.5b qwen2.5-coder-1.5b"
    if not (folder / "config.json").exists() and not (SHARED / "scripts" / "get-models.sh").exists():
        pytest.skip(f"{folder} is missing, and so is the shared folder whose script fetches it ({fetch})")
    assert (folder / "config.json").exists(), f"{folder} is missing: run `{fetch}`"
    return folder


class TickingClock:
    """A fake ``time.perf_counter``: a millisecond a call, and a jump where a test says a step is slow (instead of
    sleeping, which a loaded machine would confuse with the passes' own time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now

    def jump(self, seconds: float) -> None:
        self.now += seconds


def exact_generate(*args, **kwargs) -> specula.GenerateOutput:
    """``specula.generate`` with row-exact verification (``exact=True``), whatever the default would choose on this
    machine: what tests of bitwise identity in bf16 and fp16 run."""
    return specula.generate(*args, **{"exact": True, **kwargs})


def hf_greedy(model, input_ids, max_new_tokens, eos_token_id=None, attention_mask=None, **kwargs) -> torch.Tensor:
    """``model.generate`` greedy: the output specula must reproduce token for token."""
    return model.generate(
        input_ids,
        attention_mask=attention_mask if attention_mask is not None else torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        **kwargs,
    )


class Oracle(Replay):
    """:class:`specula.tools.replay.Replay` of reference runs given as tensors (prompt + output, one per row)."""

    def __init__(self, reference: torch.Tensor | list[torch.Tensor], num_draft: int) -> None:
        references = reference if isinstance(reference, list) else [reference]
        super().__init__([r.reshape(-1).tolist() for r in references], num_draft)


class AlwaysWrong(Oracle):
    """Proposes a token other than the reference's at every position: nothing can be accepted."""

    def __init__(self, reference: torch.Tensor, num_draft: int, vocab_size: int) -> None:
        super().__init__(reference, num_draft)
        self.vocab_size = vocab_size

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        right = super().propose(context_ids, max_tokens).tokens
        return specula.Draft((right + 1) % self.vocab_size)


class PartlyRight(Oracle):
    """The reference continuation with one token wrong, at a place that moves with the context length: blocks are
    accepted up to 0, 1, ... ``num_draft - 1`` tokens (and now and then whole, where the draft is cut short)."""

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        tokens = super().propose(context_ids, max_tokens).tokens.clone()
        wrong = len(context_ids) % self.num_draft
        if wrong < len(tokens):
            tokens[wrong] = tokens[wrong] - 1 if tokens[wrong] > 0 else 1
        return specula.Draft(tokens)


class TreeOracle(specula.Proposer):
    """Trees around the reference continuation (prompt + output, one per request) of known shapes:

    - ``"second"``: at every depth a wrong token first, the right one second (the accepted path is not the
      first child anywhere, and its tokens are not contiguous in the block);
    - ``"detour"``: a wrong first token, then the right tokens as a chain under the root's second child (each
      right token's parent is the token just before it in the draft, yet not all tokens before are its ancestors);
    - ``"late"``: the right tokens as the first branch, then a wrong sibling of the first (a token after deeper
      ones: the draft's order is not by depth);
    - ``"wrong"``: three branches of two tokens, all wrong;
    - ``"chain"``: the right tokens as a plain chain.
    """

    proposes_trees = True

    def __init__(self, references: list[torch.Tensor], shape: str, vocab_size: int, depth: int = 4) -> None:
        self.references = [r.reshape(-1).tolist() for r in references]
        self.shape, self.vocab, self.depth = shape, vocab_size, depth

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> specula.Draft:
        start, context = len(context_ids), context_ids.tolist()
        reference = next(r for r in self.references if r[:start] == context)
        right = reference[start : start + self.depth]
        if self.shape == "chain" or not right:
            tokens, parents = right, None
        elif self.shape == "detour":
            tokens, parents = [(right[0] + 1) % self.vocab] + right, [-1, -1] + list(range(1, len(right)))
        elif self.shape == "late":
            tokens, parents = right + [(right[0] + 1) % self.vocab], list(range(-1, len(right) - 1)) + [-1]
        elif self.shape == "second":
            tokens, parents, last = [], [], -1
            for token in right:
                tokens += [(token + 1) % self.vocab, token]
                parents += [last, last]
                last = len(tokens) - 1
        else:
            tokens, parents = [], []
            for offset in (1, 2, 3):
                tokens += [(right[0] + offset) % self.vocab, 7]
                parents += [-1, len(tokens) - 2]
        draft = specula.Draft(tokens, parents=parents)
        return draft.to_depth(max_tokens)


class Recorder(specula.Proposer):
    """Wraps a proposer and records every hook call, to check what the loop tells proposers."""

    def __init__(self, inner: specula.Proposer) -> None:
        self.inner = inner
        self.prompts: list[list[int]] = []
        self.observed: list[tuple[list[int], int]] = []

    def begin(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        self.inner.begin(prompt_ids, sampling)

    def propose(self, context_ids, max_tokens):
        return self.inner.propose(context_ids, max_tokens)

    def observe(self, new_ids, num_accepted):
        self.observed.append((list(new_ids), num_accepted))
        self.inner.observe(new_ids, num_accepted)


class NoisyModelDrafter(specula.Proposer):
    """A stochastic drafter whose q is close to, but not, the target's p: the model's own logits plus fixed noise.

    It drafts as a small model would: greedily when the target decodes greedily, else by sampling each token from
    ``sampling.probs`` of its logits and returning those distributions as ``Draft.probs``. ``sampling`` replaces the
    settings the loop gives it, to build a drafter that warps differently from the target.
    """

    samples_drafts = True

    def __init__(self, model, num_draft: int, noise: float = 1.0, sampling: specula.Sampling | None = None) -> None:
        vocab = model.config.vocab_size
        self.model = model
        self.noise = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)) * noise
        self.num_draft = num_draft
        self.fixed_sampling = sampling

    def begin(self, prompt_ids, sampling):
        self.sampling = self.fixed_sampling or sampling

    def propose(self, context_ids, max_tokens):
        context, tokens, probs = [int(t) for t in context_ids], [], []
        for _ in range(min(self.num_draft, max_tokens)):
            logits = self.model(torch.tensor([context])).logits[0, -1:] + self.noise[context[-1]]
            if self.sampling.greedy:
                token = int(logits.argmax())
            else:
                q = self.sampling.probs(logits)
                token = int(self.sampling.sample(q))
                probs.append(q[0])
            tokens.append(token)
            context.append(token)
        return specula.Draft(tokens, torch.stack(probs) if probs else None)


def chi_square_p_value(counts: dict, expected: dict, min_expected: float = 5.0) -> float:
    """Goodness of fit of observed ``counts`` to the ``expected`` probabilities of the same outcomes.

    Outcomes expected fewer than ``min_expected`` times are pooled into one cell (so the chi-square approximation
    holds); an observed outcome with expected probability 0 makes the fit fail outright (p-value 0).
    """
    total = sum(counts.values())
    if any(expected.get(outcome, 0.0) == 0.0 for outcome, count in counts.items() if count):
        return 0.0
    cells, pooled_observed, pooled_expected = [], 0.0, 0.0
    for outcome, probability in expected.items():
        if probability * total >= min_expected:
            cells.append((counts.get(outcome, 0), probability * total))
        else:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += probability * total
    if pooled_expected > 0:
        cells.append((pooled_observed, pooled_expected))
    statistic = sum((observed - e) ** 2 / e for observed, e in cells)
    degrees = len(cells) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(degrees / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def written_with_room(arena) -> bool:
    """Whether every page of ``arena`` (a :class:`~specula.verifier.cache_layers.RowArena` over the CPU's pages) in
    memory lies within the room it gave its rows: on a GPU a write anywhere else goes to the chunk of zeros that
    every unwritten token reads."""
    pages = arena.pages
    allowed = np.zeros_like(pages.held())
    for row, tokens in enumerate(arena.mapped):
        start, end = (pages.itemsize * at for at in arena._span(row, 0, tokens))
        allowed[start // pages.granule : -(-end // pages.granule)] = True  # (the pages the room touches)
    return not (pages.held() & ~allowed).any()


PROT_NONE, PROT_READ, PROT_READ_WRITE = 0, 1, 3


class StrictPages(Pages):
    """The CPU's pages kept as strictly as a GPU's chunks: nothing may be read until made readable (a read elsewhere
    crashes, as an illegal address does on a GPU), nothing written until given room (a write to a page only readable
    crashes, where on a GPU it would change the chunk of zeros every unwritten token reads)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__(shape, dtype)
        self.writable = np.zeros(-(-len(self.map) // self.granule), dtype=bool)  # [pages]
        self._protect(range(len(self.writable)), PROT_NONE)

    def _protect(self, pages: range, prot: int) -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        for page in pages:
            address = ctypes.c_void_p(self.tensor.data_ptr() + page * self.granule)
            assert libc.mprotect(address, ctypes.c_size_t(self.granule), prot) == 0, ctypes.get_errno()

    def _touched(self, start: int, end: int) -> range:
        return range(start * self.itemsize // self.granule, -(-end * self.itemsize // self.granule))

    def readable(self, start: int, end: int) -> None:
        self._protect([page for page in self._touched(start, end) if not self.writable[page]], PROT_READ)

    def ensure(self, start: int, end: int) -> None:
        touched = self._touched(start, end)
        self._protect(touched, PROT_READ_WRITE)
        self.writable[touched.start : touched.stop] = True

    def release(self, start: int, end: int) -> None:
        super().release(start, end)
        first, last = -(-start * self.itemsize // self.granule), end * self.itemsize // self.granule
        self._protect(range(first, last), PROT_READ)
        self.writable[first:last] = False


def arena_on_cpu(monkeypatch, compiled: bool = False) -> None:
    """Batches hold their rows in one arena, as on a GPU (compiled passes too, where ``compiled``), here over the
    CPU's pages kept as strictly as a GPU's chunks (:class:`StrictPages`)."""
    from specula.verifier import cache_layers, static

    monkeypatch.setattr(cache_layers, "ARENA", ("cpu",))
    monkeypatch.setattr(cache_layers.RowArena, "cpu_pages", StrictPages)
    if compiled:
        monkeypatch.setattr(static, "ON_ARENA", ("cpu",))
