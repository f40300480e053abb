"""NGramPredictor: drafts from n-gram statistics of everything it has seen, no draft model needed."""

from __future__ import annotations

import os
import zipfile
from typing import Sequence

import numpy as np
import torch

from ..core.draft import Draft, check_int, merged
from ..core.sampling import Sampling
from . import kernels
from .base import RequestProposer

_FORMAT = "specula.NGramPredictor/1"


def _as_tokens(token_ids: object) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    array = np.asarray(token_ids).reshape(-1)
    if array.dtype.kind not in "iu":
        if array.size:
            raise ValueError(f"token ids must be integers, got dtype {array.dtype}.")
        array = array.astype(np.int64)
    return array.astype(np.int64, copy=False)


class NGramPredictor(RequestProposer):
    """Hashed n-gram frequency tables (orders 2..``max_order``) learnt from the prompt and every generated token.

    ``predict`` chains the tables' own most likely continuations, the longest known context first, and stops as
    soon as that continuation is not confident enough (seen fewer than ``min_count`` times, or in less than
    ``min_share`` of its context's occurrences, per context length 1, 2, 3, ...). As a proposer it learns each
    request's prompt when it starts and its new tokens after each step, in tables every request shares (each keeps
    only its own recent tokens); kept across generations it keeps learning, and
    ``save`` / ``load`` persist it. With ``tree=True`` it proposes a tree: that chain, and as alternatives the best
    continuation of each shorter context that disagrees (the runners-up its tables hold), each followed by its own
    chain, all verified in one pass (:class:`specula.Draft` ``parents``).

    Memory is fixed at construction: each order has ``capacity`` slots (a power of two) for its contexts and as many
    for its (context, next token) pairs, 32-byte records up to ``max_order=5``: 12.6 MB for the defaults. A table
    holds at most ``capacity / 2`` pairs; when it is that full it ages: all its counts are halved and what drops to
    zero is forgotten, so frequent patterns stay and rare ones make room.

    Args:
        max_order: longest n-gram (context of ``max_order - 1`` tokens), >= 2.
        num_draft: most tokens proposed per step.
        history: recent tokens kept so n-grams continue across ``update`` calls, >= ``max_order``.
        capacity: slots per order and table (rounded up to a power of two).
        min_count: least count of a drafted continuation, per context length 1, 2, ... (the last value applies to
            longer contexts; a single int applies to all).
        min_share: least share of its context's occurrences, per context length, likewise.
        tree: propose the shorter contexts' best continuations too, as a tree (the loop sends what pays of it).
    """

    def __init__(
        self,
        max_order: int = 4,
        num_draft: int = 10,
        history: int = 512,
        capacity: int = 1 << 16,
        min_count: int | Sequence[int] = (2, 1, 1),
        min_share: float | Sequence[float] = (0.5, 0.5, 0.5),
        tree: bool = False,
    ) -> None:
        check_int("max_order", max_order, 2, " (bigrams)")
        check_int("num_draft", num_draft, 1)
        check_int("history", history, max_order, " (max_order)")
        check_int("capacity", capacity, 4, " slots")
        rows = max_order - 1
        self.max_order, self.num_draft, self.history = max_order, num_draft, history
        self.proposes_trees = bool(tree)
        self.min_count = self._per_row(min_count, rows, "min_count", np.int64)
        self.min_share = self._per_row(min_share, rows, "min_share", np.float64)
        if (self.min_count < 1).any() or ((self.min_share < 0) | (self.min_share > 1)).any():
            raise ValueError("min_count must be >= 1 and min_share within [0, 1].")
        slots = 1 << (capacity - 1).bit_length()
        # Records are padded to a power-of-two width so that none straddles two cache lines.
        width = 1 << (kernels.PAIR_KEYS + rows).bit_length()
        self.tables = {  # record layouts: see specula.proposers.kernels
            "contexts": np.zeros((rows, slots, width), np.int32),
            "pairs": np.zeros((rows, slots, width), np.int32),
            "n_pairs": np.zeros(rows, np.int64),
        }
        self.recent = np.empty(0, np.int64)  # the last tokens ``update`` saw
        self._recent: dict[object, np.ndarray] = {}  # the same, per request being decoded

    @staticmethod
    def _per_row(value, rows: int, name: str, dtype) -> np.ndarray:
        values = np.atleast_1d(np.asarray(value, dtype=dtype))
        if values.ndim != 1 or len(values) == 0:
            raise ValueError(f"{name} must be a number or a sequence of numbers, got {value!r}.")
        padding = np.repeat(values[-1:], max(0, rows - len(values)))  # the last value covers longer contexts
        return np.concatenate([values, padding])[:rows]

    @property
    def capacity(self) -> int:
        return self.tables["contexts"].shape[1]

    def update(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Learn every n-gram ending in ``token_ids``, continuing from the tokens seen before."""
        self.recent = self._learn(self.recent, token_ids)

    def _learn(self, recent: np.ndarray, token_ids) -> np.ndarray:
        """Learn every n-gram ending in ``token_ids`` that continues ``recent``; the recent tokens after them."""
        tokens = np.concatenate([recent, _as_tokens(token_ids)])
        context = min(len(recent), self.max_order - 1)  # earlier tokens that new n-grams start in
        if not kernels.ngram_update(
            tokens[len(recent) - context :], context, self.capacity // 2, *self.tables.values()
        ):
            raise ValueError("token ids must be in [0, 2**31).")
        return tokens[-self.history :]

    def reset_context(self) -> None:
        """Start a new, unrelated sequence: n-grams will not span the boundary. The tables are kept."""
        self.recent = np.empty(0, np.int64)

    def predict(self, context_ids: Sequence[int] | np.ndarray | torch.Tensor, max_tokens: int) -> list[int]:
        """Draft up to ``max_tokens`` tokens after ``context_ids`` by chaining predictions."""
        check_int("max_tokens", max_tokens, 0)
        context = _as_tokens(context_ids)[-(self.max_order - 1) :]
        return self._predict(context, max_tokens).tolist()

    def _predict(self, context: np.ndarray, max_tokens: int) -> np.ndarray:
        return kernels.ngram_predict(context, max_tokens, self.min_count, self.min_share, self.tables["contexts"])

    def count(self, context: Sequence[int], token: int) -> int:
        """How often ``token`` followed ``context`` (1 .. max_order - 1 tokens), after ageing."""
        if not 1 <= len(context) < self.max_order:
            raise ValueError(f"context must hold 1..{self.max_order - 1} tokens, got {len(context)}.")
        pair = np.asarray([*context, token], dtype=np.int64)
        return int(kernels.ngram_count(pair, self.tables["pairs"]))

    # Proposer hooks: alone, it continues from what ``update`` saw; requests keep their recent tokens apart
    def begin(self, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        self.reset_context()
        self.update(prompt_ids)

    def observe(self, new_ids: Sequence[int], num_accepted: int) -> None:
        self.update(new_ids)

    def start_request(self, request, prompt_ids: np.ndarray, sampling: Sampling) -> None:
        self._recent[request] = self._learn(np.empty(0, np.int64), prompt_ids)

    def observe_request(self, request, new_ids: Sequence[int], num_accepted: int) -> None:
        self._recent[request] = self._learn(self._recent[request], new_ids)

    def stop_request(self, request) -> None:
        self._recent.pop(request, None)

    def propose(self, context_ids: np.ndarray, max_tokens: int) -> Draft:
        context, length = context_ids[-(self.max_order - 1) :], min(self.num_draft, max_tokens)
        if not self.proposes_trees:
            return Draft(self._predict(context, length))
        firsts = kernels.ngram_alternatives(context, self.min_count, self.min_share, self.tables["contexts"])
        return merged(
            [
                [first, *self._predict(np.append(context, first)[-(self.max_order - 1) :], length - 1).tolist()]
                for first in firsts.tolist()
            ]
        )

    # Persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the tables and settings to ``path`` (a numpy ``.npz`` archive)."""
        settings = np.array([self.max_order, self.num_draft, self.history])
        with open(path, "wb") as file:
            np.savez_compressed(
                file,
                format=np.array(_FORMAT),
                settings=settings,
                min_count=self.min_count,
                min_share=self.min_share,
                recent=self.recent,
                tree=np.array(self.proposes_trees),
                **self.tables,
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NGramPredictor":
        """Read a predictor written by :meth:`save`; a corrupt or foreign file raises ``ValueError``."""
        try:
            with np.load(path, allow_pickle=False) as archive:
                data = {name: archive[name] for name in archive.files}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
            raise ValueError(f"{path} is not a readable NGramPredictor file ({error}).") from error
        if data.get("format", np.array("")).item() != _FORMAT:
            raise ValueError(f"{path} is not an NGramPredictor file of format {_FORMAT!r}.")
        try:
            max_order, num_draft, history = (int(v) for v in data["settings"])
            predictor = cls(
                max_order,
                num_draft,
                history,
                data["contexts"].shape[1],
                data["min_count"].tolist(),
                data["min_share"].tolist(),
                bool(data.get("tree", False)),
            )
            for name, empty in predictor.tables.items():
                if data[name].shape != empty.shape or data[name].dtype != empty.dtype:
                    raise ValueError(f"table {name} has shape {data[name].shape}, expected {empty.shape}")
                predictor.tables[name] = data[name].copy()
            predictor.recent = data["recent"].astype(np.int64)
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{path} is an incompatible or corrupt NGramPredictor file ({error}).") from error
        return predictor

    def __repr__(self) -> str:
        tree = ", tree=True" if self.proposes_trees else ""
        return (
            f"NGramPredictor(max_order={self.max_order}, num_draft={self.num_draft}, history={self.history}, "
            f"capacity={self.capacity}{tree})"
        )
