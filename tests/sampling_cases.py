"""A tiny model with peaked distributions, and the exact joint distribution of its first two sampled tokens: what the
chi-square tests of sampled output compare with."""

from __future__ import annotations

import collections
import functools
import itertools

import torch
import transformers
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import specula

VOCAB = 8
PLAIN = dict(temperature=0.8)
TRUNCATED = dict(temperature=0.7, top_k=4, top_p=0.9)


@functools.cache
def sharp_model() -> torch.nn.Module:
    """A tiny Llama over 8 tokens whose next-token distributions are peaked, so top-k and top-p cut real mass."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def hf_warped_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The target's next-token distribution, built here from transformers' warpers directly (not specula's code)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return torch.softmax(warpers(None, logits.double()), dim=-1)


@functools.cache
def joint_of_two_tokens(prompt: tuple[int, ...], settings_items: tuple) -> dict[tuple[int, int], float]:
    """Exact P(x1, x2 | prompt) of the target under the sampling settings."""
    model, settings_ = sharp_model(), dict(settings_items)
    with torch.no_grad():
        first = hf_warped_probs(model(torch.tensor([prompt])).logits[0, -1:], **settings_)[0]
        batch = torch.tensor([[*prompt, x] for x in range(VOCAB)])
        second = hf_warped_probs(model(batch).logits[:, -1], **settings_)
    return {(x1, x2): float(first[x1] * second[x1, x2]) for x1, x2 in itertools.product(range(VOCAB), repeat=2)}


@functools.cache
def copyable_prompt(settings_items: tuple) -> tuple[int, ...]:
    """A prompt [a b c d a b]: PromptLookup drafts "c d", and the target accepts each with probability near 1/2,
    so both the accept and the reject paths are sampled often."""
    model, settings_ = sharp_model(), dict(settings_items)
    candidates = torch.tensor([[a, b, c, d, a, b, c] for a, b, c, d in itertools.permutations(range(VOCAB), 4)])
    with torch.no_grad():
        probs = hf_warped_probs(model(candidates).logits[:, -2:].reshape(-1, VOCAB), **settings_).reshape(-1, 2, VOCAB)
    p_c = probs[:, 0].gather(1, candidates[:, 2:3])[:, 0]
    p_d = probs[:, 1].gather(1, candidates[:, 3:4])[:, 0]
    balance = torch.minimum(p_c, 1 - p_c) + torch.minimum(p_d, 1 - p_d)
    return tuple(candidates[int(balance.argmax()), :6].tolist())


def sample_first_two(make_proposer, settings_: dict, samples: int, seed: int = 1234, adaptive: bool = False):
    prompt = copyable_prompt(tuple(settings_.items()))
    torch.manual_seed(seed)
    counts, stats = collections.Counter(), specula.SpecStats()
    for _ in range(samples):
        out = specula.generate(
            sharp_model(),
            torch.tensor([prompt]),
            make_proposer(),
            max_new_tokens=3,
            eos_token_id=[],
            do_sample=True,
            adaptive_draft=adaptive,
            **settings_,
        )
        counts[tuple(out.sequences[0, len(prompt) : len(prompt) + 2].tolist())] += 1
        stats.drafted += out.stats.drafted
        stats.accepted += out.stats.accepted
    return counts, joint_of_two_tokens(prompt, tuple(settings_.items())), stats
