"""A memory budget for the cache (``--max-memory``): requests wait for room, the buffers never hold more than the
budget, answers stay model.generate's, and a request that could never fit is refused before any work."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import arena_on_cpu, hf_greedy
from tiny_models import tiny_model

import specula
from specula import cli
from specula.decoding.budget import CacheBudget, parse_size
from specula.decoding.driver import finished_rows
from specula.decoding.loop import room
from specula.verifier import cache_layers, static
from specula.verifier.cache_layers import PreallocatedLayer
from specula.verifier.runner import CachedModel

NEW = 6


def cache_bytes(target: CachedModel) -> int:
    return sum(layer.held_bytes() for layer in target.cache.layers if isinstance(layer, PreallocatedLayer))


def decode_watched(monkeypatch, model, jobs: list[specula.Job], budget: CacheBudget) -> tuple[list, list]:
    """The finished rows of ``jobs`` decoded in 4 slots within ``budget``, and each pass's (rows, cache bytes)."""
    seen, forward_rows = [], CachedModel.forward_rows

    def watched(self, blocks, *args, **kwargs):
        seen.append((len(blocks), cache_bytes(self)))
        return forward_rows(self, blocks, *args, **kwargs)

    monkeypatch.setattr(CachedModel, "forward_rows", watched)
    decoder = specula.Decoder(model, specula.PromptLookup(), slots=4, budget=budget)
    rows = list(finished_rows(decoder, jobs))
    for row in rows:
        expected = hf_greedy(model, torch.from_numpy(row.job.prompt)[None], row.job.max_new_tokens, eos_token_id=[])
        assert row.output.tolist() == expected[0, len(row.job.prompt) :].tolist()
    assert len(rows) == len(jobs)
    return rows, seen


@pytest.mark.parametrize("kind", ["paged", "rectangle", "arena"])
def test_requests_wait_for_room_and_the_cache_stays_within_the_budget(monkeypatch, kind) -> None:
    """Four slots, five requests, a budget of two rows: no pass holds more than two rows nor its buffers more than the
    budget, and every request gets model.generate's tokens (mutant: no budget, four rows a pass). Each kind of
    buffers: the CPU's pages, rectangles, one arena for all layers (a GPU's, here over the CPU's pages)."""
    paged = kind != "rectangle"
    if kind == "rectangle":
        monkeypatch.setattr(cache_layers, "PAGED", ())
    if kind == "arena":
        arena_on_cpu(monkeypatch)
    model = tiny_model("llama")
    prompts = [np.roll(np.array([1, 40, 3, 77, 12, 55, 23, 9, 60, 14]), shift) for shift in range(5)]
    jobs = [specula.Job(prompt, NEW) for prompt in prompts]
    budget = CacheBudget.of(model, 0)
    assert budget.per_row == paged
    budget = replace(budget, limit=2 * budget.row_bytes(room(jobs[0])))  # (two rows of these)
    _, seen = decode_watched(monkeypatch, model, jobs, budget)
    assert max(rows for rows, _ in seen) == 2 and max(size for _, size in seen) <= budget.limit


@pytest.mark.parametrize("arena", [False, True])
def test_beside_a_long_request_short_ones_join_while_their_own_tokens_fit(monkeypatch, arena) -> None:
    """Paged (the CPU's cache, or an arena's), a budget of one long request's tokens and three short ones': all four
    decode in one batch, within the budget (mutant: a rectangle's accounting, every row as long as the longest,
    admits two)."""
    if arena:
        arena_on_cpu(monkeypatch)
    model = tiny_model("llama")
    prompt = np.array([1, 40, 3, 77, 12, 55, 23, 9, 60, 14])
    jobs = [specula.Job(prompt, 400)] + [specula.Job(np.roll(prompt, shift), NEW) for shift in range(1, 4)]
    budget = CacheBudget.of(model, 0)
    budget = replace(budget, limit=sum(budget.row_bytes(room(job)) for job in jobs))
    _, seen = decode_watched(monkeypatch, model, jobs, budget)
    assert max(rows for rows, _ in seen) == 4 and max(size for _, size in seen) <= budget.limit


def test_a_request_that_could_never_fit_is_refused() -> None:
    model = tiny_model("llama")
    job = specula.Job(np.arange(3, 13), NEW)
    budget = CacheBudget.of(model, 0)
    budget = replace(budget, limit=budget.row_bytes(room(job)) - 1)
    with pytest.raises(ValueError, match="over the cache's memory budget"):
        list(specula.Decoder(model, None, slots=2, budget=budget).run([job]))


def test_a_file_skips_a_request_over_the_budget_saying_why(model_folder, tmp_path, capsys) -> None:
    lines = [
        {"id": "short", "prompt": "the quick brown fox", "max_tokens": 4},
        {"id": "long", "prompt": "the quick brown fox", "max_tokens": 400},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    cli.main(
        [
            "generate",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--model",
            str(model_folder),
            "--dtype",
            "fp32",
            "--max-memory",
            "100KB",
        ]
    )  # (256 bytes a token: 390 tokens)
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [answer["id"] for answer in answers if "error" not in answer] == ["short"]
    assert "memory budget of 0.00 GB (--max-memory)" in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("1.5 g", 1.5e9), ("100", 100)])
def test_sizes_read_as_people_write_them(text, size) -> None:
    assert parse_size(text) == size


def test_a_size_without_a_known_unit_says_how_to_write_one() -> None:
    with pytest.raises(ValueError, match="such as 4GB or 512MiB"):
        parse_size("4 gallons")


def test_an_arenas_budget_counts_chunks_and_compiled_passes_rectangles(monkeypatch) -> None:
    """Where batches hold their rows in an arena (a GPU's, here the CPU's pages without their per-layer paging), a
    row's room is counted in whole chunks of every layer's states; where passes run compiled over rectangles of their
    own, as the longest row's (mutant: the arena's accounting whatever the passes read)."""
    arena_on_cpu(monkeypatch)
    monkeypatch.setattr(cache_layers, "PAGED", ())
    model = tiny_model("llama")
    arena, page = CacheBudget.of(model, 10**6), cache_layers.Pages.granule
    assert arena.per_row and arena.chunk == page and arena.row_bytes(1) == page
    assert arena.row_bytes(page // arena.per_token + 1) == 2 * page
    assert not CacheBudget.of(model, 10**6, compiled=True).per_row
    monkeypatch.setattr(static, "ON_ARENA", ("cpu",))
    assert CacheBudget.of(model, 10**6, compiled=True).per_row
