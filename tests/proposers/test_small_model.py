"""SmallModelDrafter: identical greedy output, its own cache kept in step, vocabulary checks, exact sampling."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from helpers import chi_square_p_value, hf_greedy
from sampling_cases import TRUNCATED, sample_first_two, sharp_model
from tiny_models import CONFIGS, VOCAB, tiny_model

import specula

PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
NEW_TOKENS = 40


@functools.cache
def model(name: str, seed: int = 0) -> torch.nn.Module:
    return tiny_model(name, seed)


def noisy_copy(target: torch.nn.Module, noise: float) -> torch.nn.Module:
    """The target with every weight perturbed: a drafter that agrees often, but not always."""
    drafter = transformers.AutoModelForCausalLM.from_config(target.config)
    torch.manual_seed(1)
    with torch.no_grad():
        for mine, theirs in zip(drafter.parameters(), target.parameters()):
            mine.copy_(theirs + noise * torch.randn_like(theirs) * theirs.std())
    return drafter.eval()


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3", "qwen2"])
def test_the_target_drafting_for_itself_is_identical_and_accepted(name: str) -> None:
    prompt = torch.tensor([PROMPT * 2])  # longer than gemma3's sliding window
    drafter = specula.SmallModelDrafter(tiny_model(name), num_draft=4, min_confidence=0)
    out = specula.generate(
        model(name), prompt, drafter, max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == hf_greedy(model(name), prompt, NEW_TOKENS, eos_token_id=[]).tolist()
    assert out.stats.acceptance_rate > 0.95
    assert out.stats.tokens_per_pass > 3


@pytest.mark.parametrize("target, draft", [("llama", "gpt2"), ("gpt_neox", "llama"), ("mistral", "phi3")])
def test_an_unrelated_drafter_changes_nothing(target: str, draft: str) -> None:
    prompt = torch.tensor([PROMPT])
    out = specula.generate(
        model(target),
        prompt,
        specula.SmallModelDrafter(model(draft, 1)),
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
        adaptive_draft=False,
    )
    assert out.sequences.tolist() == hf_greedy(model(target), prompt, NEW_TOKENS, eos_token_id=[]).tolist()
    assert out.stats.drafted > 0 and out.stats.acceptance_rate < 0.5


class CheckedDrafter(specula.SmallModelDrafter):
    """Checks, at every proposal, that the cache holds exactly the sequence so far and that the draft is what the
    draft model decodes greedily from scratch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checked = 0

    def propose_requests(self, requests, contexts, max_tokens):
        [draft], [context_ids], [state] = (
            super().propose_requests(requests, contexts, max_tokens),
            contexts,
            [self.requests[request] for request in requests],
        )
        # The cache now holds the context and all draft tokens but the last.
        assert state.cache.cached_tokens == state.cache.cache.get_seq_length() == len(context_ids) + len(draft) - 1
        assert state.cached_ids == [*context_ids.tolist(), *draft.tokens.tolist()[:-1]]
        context = torch.tensor([context_ids.tolist()])
        scratch = self.model.generate(
            context,
            attention_mask=torch.ones_like(context),
            do_sample=False,
            max_new_tokens=len(draft),
            pad_token_id=0,
            eos_token_id=[],  # (the drafter drafts past EOS; the loop stops there)
        )
        assert draft.tokens.tolist() == scratch[0, context.shape[1] :].tolist()
        self.checked += 1
        return [draft]


def test_the_drafters_cache_follows_partial_acceptance() -> None:
    prompt = torch.tensor([PROMPT])
    drafter = CheckedDrafter(noisy_copy(model("llama"), 0.2), num_draft=3, min_confidence=0)
    out = specula.generate(
        model("llama"), prompt, drafter, max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == hf_greedy(model("llama"), prompt, NEW_TOKENS, eos_token_id=[]).tolist()
    # A proposal after every step but the last, except with one token left to make (no room for a draft).
    assert 0.2 < out.stats.acceptance_rate < 0.9 and drafter.checked >= out.stats.passes - 2


def test_draft_length_adapts_to_acceptance() -> None:
    drafter = specula.SmallModelDrafter(model("llama"), num_draft=4, max_draft=9)
    drafter.start_request("a", np.array(PROMPT), specula.Sampling())
    drafter.start_request("b", np.array(PROMPT), specula.Sampling())
    state = drafter.requests["a"]
    state.last_draft_length = 4
    drafter.observe_request("a", [5, 6, 7, 8, 9], 4)
    assert state.num_draft == 6
    for expected in (5, 4):
        state.last_draft_length = state.num_draft
        drafter.observe_request("a", [5, 6], 1)
        assert state.num_draft == expected
    for _ in range(5):
        state.last_draft_length = state.num_draft
        drafter.observe_request("a", [5] * (state.num_draft + 1), state.num_draft)
    assert state.num_draft == 9
    assert drafter.requests["b"].num_draft == 4 and drafter.num_draft == 4  # (each request its own length)
    fixed = specula.SmallModelDrafter(model("llama"), num_draft=4, adaptive=False)
    fixed.begin(np.array(PROMPT), specula.Sampling())
    fixed.requests[None].last_draft_length = 4
    fixed.observe([5, 6, 7, 8, 9], 4)
    assert fixed.requests[None].num_draft == 4


def test_a_drafter_in_another_dtype() -> None:
    prompt = torch.tensor([PROMPT])
    drafter = specula.SmallModelDrafter(tiny_model("llama").to(torch.bfloat16))
    out = specula.generate(
        model("llama"), prompt, drafter, max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == hf_greedy(model("llama"), prompt, NEW_TOKENS, eos_token_id=[]).tolist()
    assert out.stats.accepted > 0


def tiny_with_vocab(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.vocab_size = vocab
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def word_tokenizer(words: list[str]) -> transformers.PreTrainedTokenizerFast:
    model = tokenizers.models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0])
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0])


def test_a_different_vocabulary_is_refused_naming_both() -> None:
    drafter = specula.SmallModelDrafter(tiny_with_vocab(128))
    with pytest.raises(ValueError, match=r"vocabulary of 128 tokens and the target LlamaForCausalLM has 96"):
        specula.generate(model("llama"), torch.tensor([PROMPT]), drafter, max_new_tokens=4)
    words = [f"w{i}" for i in range(VOCAB)]
    with pytest.raises(ValueError, match=r"drafter's tokenizer .*96 tokens.* and the target's .*96 tokens.*different"):
        specula.SmallModelDrafter(
            model("llama"), tokenizer=word_tokenizer(words), target_tokenizer=word_tokenizer(words[::-1])
        )


def test_padding_rows_beyond_the_tokenizer_are_allowed_and_never_drafted() -> None:
    """Qwen-style: embedding matrices of different sizes whose extra rows are padding past the real vocabulary."""
    drafts = []

    class Recording(specula.SmallModelDrafter):
        def propose_requests(self, requests, contexts, max_tokens):
            made = super().propose_requests(requests, contexts, max_tokens)
            for draft in made:
                drafts.extend(draft.tokens.tolist())
                assert draft.probs is None or (draft.probs.shape[1] == VOCAB and float(draft.probs[:, 90:].sum()) == 0)
            return made

    drafter = Recording(tiny_with_vocab(128), tokenizer=word_tokenizer([f"w{i}" for i in range(90)]))
    prompt = torch.tensor([PROMPT])
    out = specula.generate(
        model("llama"), prompt, drafter, max_new_tokens=NEW_TOKENS, eos_token_id=[], adaptive_draft=False
    )
    assert out.sequences.tolist() == hf_greedy(model("llama"), prompt, NEW_TOKENS, eos_token_id=[]).tolist()
    specula.generate(model("llama"), prompt, drafter, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.5)
    assert drafts and max(drafts) < 90


def test_sampled_drafts_keep_the_targets_distribution() -> None:
    drafter_model = noisy_copy(sharp_model(), 0.3)
    make = lambda: specula.SmallModelDrafter(drafter_model, num_draft=2, adaptive=False)  # noqa: E731
    counts, expected, stats = sample_first_two(make, TRUNCATED, 3000)
    assert 0.2 < stats.acceptance_rate < 0.95, "q must differ from p for this test to exercise the residual"
    assert chi_square_p_value(counts, expected) > 0.001


class CheckedRows(specula.SmallModelDrafter):
    """Checks every batched proposal: each row's draft is what the draft model decodes greedily from that row's
    context alone."""

    checked = 0

    def propose_requests(self, requests, contexts, max_tokens):
        drafts = super().propose_requests(requests, contexts, max_tokens)
        for context_ids, draft in zip(contexts, drafts):
            if not len(draft):
                continue
            context = torch.tensor([context_ids.tolist()])
            scratch = self.model.generate(
                context,
                attention_mask=torch.ones_like(context),
                do_sample=False,
                max_new_tokens=len(draft),
                pad_token_id=0,
                eos_token_id=[],
            )
            assert draft.tokens.tolist() == scratch[0, context.shape[1] :].tolist()
        CheckedRows.checked += 1
        return drafts


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_batch_drafts_all_its_rows_in_shared_passes(name: str) -> None:
    """Rows of different lengths (past gemma3's window) draft in batched passes of the draft model, each row's draft
    its own, and decode model.generate's tokens for each row; drafting row by row takes several times the passes."""
    rows = [
        torch.tensor(PROMPT),
        torch.tensor(PROMPT[3:] + PROMPT),
        torch.tensor(PROMPT[:9]),
        torch.tensor(PROMPT[::-1]),
    ]
    expected = [hf_greedy(model(name), row[None], NEW_TOKENS, eos_token_id=[])[0, len(row) :].tolist() for row in rows]
    width = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :], mask[b, width - len(row) :] = row, 1
    draft_model = noisy_copy(model(name), 0.2)
    passes = []
    draft_model.register_forward_hook(lambda *args: passes.append(1))
    counts = {}
    for kind, batched in ((CheckedRows, True), (specula.SmallModelDrafter, True), (specula.SmallModelDrafter, False)):
        drafter = kind(draft_model, num_draft=3, min_confidence=0)
        drafter.batch.batchable = batched
        passes.clear()
        out = specula.generate(
            model(name),
            ids,
            drafter,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            adaptive_draft=False,
        )
        got = [row[width : width + stats.new_tokens] for row, stats in zip(out.sequences.tolist(), out.stats.rows)]
        assert got == expected
        assert out.stats.accepted > 0
        counts[batched] = len(passes)  # (the checker's own decoding counts too, so it is not counted last)
    assert CheckedRows.checked > 0
    assert counts[True] * 2 < counts[False]
