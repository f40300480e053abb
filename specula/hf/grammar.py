"""Output held to a grammar (OpenAI's ``response_format``: a JSON schema, or any JSON object) as a transformers logits
processor, so that specula's acceptance masks every verified position as ``model.generate`` masks each step.

The grammar is llguidance's (the engine vLLM, SGLang and llama.cpp take for it): a matcher that consumes tokens and
says which tokens may come next. A verification pass scores several positions, each after the tokens before it, and
rejected drafts are forgotten, so the processor keeps no state of its own: each call brings the matcher to the tokens
it is shown (rolled back to what they share with what it consumed, then the rest consumed), and a draft token the
grammar refuses leaves the positions after it unmasked (the acceptance rejects that token, and never reads them).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch
from transformers import LogitsProcessor


class GrammarConstraint(LogitsProcessor):
    """Tokens outside ``grammar`` (an llguidance grammar: :func:`json_grammar`) get ``-inf``, after the first
    ``prompt_length`` tokens; once the grammar is complete, only an end-of-sequence token may follow
    (``tokenizer``: the model's, a fast one; ``vocab``: the model's vocabulary size)."""

    def __init__(self, tokenizer, vocab: int, grammar: str, prompt_length: int) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(_tokenizer_info(tokenizer, vocab), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.vocab, self.prompt_length = vocab, prompt_length
        self.consumed: list[int] = []  # the tokens the matcher holds now

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != 1:
            raise ValueError("a grammar constraint holds one sequence: give each request its own")
        if not self._follow(input_ids[0, self.prompt_length :].tolist()):
            return scores  # (after a draft token the grammar refuses: a position the acceptance never reads)
        allowed = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)[: scores.shape[-1]] > 0
        mask = torch.zeros(scores.shape[-1], dtype=torch.bool)
        mask[: len(allowed)] = torch.from_numpy(allowed.copy())
        return scores.masked_fill(~mask.to(scores.device), float("-inf"))

    def guide(self, output: np.ndarray, draft: list[int], budget: int) -> tuple[int, list[int]]:
        """How many of ``draft``'s tokens the grammar takes after ``output`` (the output so far), and the tokens it
        then forces, ``budget`` in all (:class:`specula.proposers.guide.Guide`)."""
        if not self._follow(output.tolist()):
            return 0, []
        taken = self.matcher.validate_tokens(draft) if draft else 0
        self.matcher.consume_tokens(draft[:taken])
        forced = self.matcher.compute_ff_tokens()[: max(budget - taken, 0)]
        self.matcher.rollback(taken)
        return taken, forced

    def _follow(self, generated: list[int]) -> bool:
        """Bring the matcher to ``generated`` (rolled back to what it shares with what it consumed, the rest
        consumed); ``False`` where the grammar refuses one of them (it then holds those before)."""
        shared = next((i for i, (a, b) in enumerate(zip(self.consumed, generated)) if a != b), None)
        shared = min(len(self.consumed), len(generated)) if shared is None else shared
        if len(self.consumed) > shared:
            self.matcher.rollback(len(self.consumed) - shared)
            del self.consumed[shared:]
        rest = generated[shared:]
        valid = self.matcher.validate_tokens(rest) if rest else 0
        self.matcher.consume_tokens(rest[:valid])
        self.consumed += rest[:valid]
        return valid == len(rest)


def guide_grammar(options: dict) -> str | None:
    """The llguidance grammar a request's settings hold its output to: OpenAI's ``response_format``
    (:func:`json_grammar`; vLLM's ``guided_json`` comes as one), vLLM's ``guided_regex`` (a regular expression the
    whole output matches), ``guided_choice`` (one of its texts) or ``guided_grammar`` (a Lark or GBNF grammar, as
    vLLM's llguidance backend takes it); ``None``: free text."""
    from llguidance import LLMatcher, grammar_from

    if "response_format" in options:
        return json_grammar(options["response_format"])
    name = next((name for name in ("guided_choice", "guided_regex", "guided_grammar") if name in options), None)
    try:
        if name == "guided_choice":  # (each text a string of the grammar: JSON's escapes are its own)
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options[name])))
        elif name == "guided_regex":
            grammar = LLMatcher.grammar_from_regex(options[name])
        elif name == "guided_grammar":
            grammar = grammar_from("grammar", options[name])
        else:
            return None
        error = LLMatcher.validate_grammar(grammar)
    except ValueError as failure:
        error = str(failure)
    if error:
        raise ValueError(f'"{name}" cannot be used ({error})')
    return grammar


def json_grammar(response_format: dict) -> str | None:
    """The llguidance grammar of OpenAI's ``response_format`` (``{"type": "json_object"}``: any JSON object;
    ``{"type": "json_schema", "json_schema": {"schema": ...}}``: that schema); ``None`` for text."""
    from llguidance import LLMatcher

    kind = response_format.get("type")
    if kind == "text":
        return None
    schema = {"type": "object"} if kind == "json_object" else response_format["json_schema"].get("schema", {})
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except ValueError as error:
        raise ValueError(f'"response_format": its schema cannot be used ({error})') from None
    if error := LLMatcher.validate_grammar(grammar):
        raise ValueError(f'"response_format": its schema cannot be used ({error})')
    return grammar


@functools.lru_cache(maxsize=4)
def _tokenizer_info(tokenizer, vocab: int):
    """llguidance's view of ``tokenizer`` over the model's ``vocab`` tokens (made once: about a second)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    except ValueError as error:  # (a slow tokenizer, or a decoder llguidance does not read: SentencePiece's Metaspace)
        raise ValueError(
            f"this model's tokenizer is not one llguidance reads ({error}): no grammar can hold its answers; "
            "ask for text"
        ) from None
