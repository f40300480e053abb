"""specula bench's model.generate rows say how generate decoded: the cache it used and whether it compiled."""

from __future__ import annotations

from architectures import sweep_prompts, tiny_causal_lm
from transformers import PreTrainedModel
from transformers.generation.utils import GenerationMixin

from specula.tools.bench import BenchRow, format_table, hf_method


def test_hf_rows_say_which_cache_generate_used_and_whether_it_compiled(monkeypatch) -> None:
    model, prompt = tiny_causal_lm("llama"), sweep_prompts()[0]
    plain = hf_method(model)
    lookup = hf_method(model, prompt_lookup_num_tokens=10)
    static = hf_method(model, cache_implementation="static")
    for method in (plain, lookup, static):
        tokens, _, _ = method(prompt, 6)
        assert len(tokens) == 6
    # on a CPU generate compiles nothing by itself (only on accelerators, or where a compile_config asks for all)
    assert (plain.setup, lookup.setup, static.setup) == (
        "DynamicCache, not compiled",
        "DynamicCache, not compiled",
        "StaticCache, not compiled",
    )
    assert not hasattr(model, "_compiled_call") and "_valid_auto_compile_criteria" not in vars(model)

    # where generate decides to compile, the row says so (its decision is recorded, not guessed)
    compiling = hf_method(tiny_causal_lm("llama"))
    decisions = []
    monkeypatch.setattr(
        GenerationMixin, "_valid_auto_compile_criteria", lambda self, *args: decisions.append(True) or True
    )
    monkeypatch.setattr(PreTrainedModel, "get_compiled_call", lambda self, config: self.__call__)
    compiling(prompt, 2)
    assert decisions and compiling.setup == "DynamicCache, compiled"

    row = BenchRow("w", "hf-greedy", 1, 6, 1.0, 6.0, 1.0, 1.0, 1.0, None, None, 0, hf_setup=plain.setup)
    assert format_table([row]).endswith("model.generate decoded with: hf-greedy DynamicCache, not compiled")
