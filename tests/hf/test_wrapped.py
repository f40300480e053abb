"""What users hold around a model: a PEFT model (LoRA unmerged, several adapters, the active one switched) and a module
``torch.compile`` returned decode as their own ``generate`` does; a PEFT model whose forward does more is refused
(specula.hf.wrapped, specula.hf.loading's ``adapter``, the CLI's ``--adapter``)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import hf_greedy
from tiny_models import tiny_model

import specula
from specula import cli
from specula.hf import loading
from specula.jobs.requests import encode

peft = pytest.importorskip("peft", reason="the PEFT tests need peft: pip install 'specula[peft]'")

PROMPT = torch.arange(3, 23).repeat(3)[None]  # (text that repeats: PromptLookup's drafts are verified)


def lora(model: torch.nn.Module, name: str = "default", seed: int = 0, into: "peft.PeftModel | None" = None):
    """A LoRA adapter with random, non-zero weights on every attention projection (as trained ones are)."""
    config = peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    torch.manual_seed(seed)
    if into is not None:
        into.add_adapter(name, config)
        return into
    return peft.get_peft_model(model, config, adapter_name=name).eval()


def new_tokens(out: torch.Tensor) -> list[int]:
    return out[0, PROMPT.shape[1] :].tolist()


def test_a_peft_model_decodes_as_its_own_generate_through_both_entry_points(drafts_cost_nothing) -> None:
    base = tiny_model("llama")
    plain = new_tokens(hf_greedy(base, PROMPT, 24, eos_token_id=[]))
    model = lora(base)
    expected = new_tokens(hf_greedy(model, PROMPT, 24, eos_token_id=[]))
    assert expected != plain  # (the adapter changes what the model says: a test that drops it fails)
    out = specula.generate(model, PROMPT, specula.PromptLookup(), max_new_tokens=24, eos_token_id=[])
    assert new_tokens(out.sequences) == expected and out.stats.accepted > 0
    through = model.generate(
        PROMPT,
        attention_mask=torch.ones_like(PROMPT),
        custom_generate=specula.custom_generate,
        proposer=specula.PromptLookup(),
        max_new_tokens=24,
        eos_token_id=[],
        do_sample=False,
    )
    assert new_tokens(through) == expected


def test_the_active_adapter_is_the_one_applied() -> None:
    model = lora(tiny_model("llama"), "first", seed=1)
    lora(None, "second", seed=2, into=model)
    answers = {}
    for name in ("first", "second"):
        model.set_adapter(name)
        expected = new_tokens(hf_greedy(model, PROMPT, 16, eos_token_id=[]))
        out = specula.generate(model, PROMPT, specula.PromptLookup(), max_new_tokens=16, eos_token_id=[])
        assert new_tokens(out.sequences) == expected, name
        answers[name] = expected
    assert answers["first"] != answers["second"]


def test_a_prompt_tuned_model_is_refused_saying_why() -> None:
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(tiny_model("llama"), config)
    with pytest.raises(ValueError, match="adds virtual tokens to every pass"):
        specula.generate(model, PROMPT, specula.PromptLookup(), max_new_tokens=4)


def test_a_compiled_module_decodes_as_the_model_it_compiled() -> None:
    model = tiny_model("llama")
    expected = new_tokens(hf_greedy(model, PROMPT, 16, eos_token_id=[]))
    out = specula.generate(torch.compile(model), PROMPT, specula.PromptLookup(), max_new_tokens=16, eos_token_id=[])
    assert new_tokens(out.sequences) == expected


def test_the_cli_applies_an_adapter_folder(model_folder, tmp_path) -> None:
    """``--adapter DIR``: answers as the PEFT model loaded from that folder answers; a folder that holds no adapter is
    one line naming it, before the model loads."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32, tune_layout=False)
    adapted = lora(model)
    adapted.save_pretrained(tmp_path / "adapter")
    prompt = "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3"
    ids = encode(tokenizer, {"prompt": prompt})
    expected = tokenizer.decode(
        hf_greedy(adapted, ids, 12, eos_token_id=[])[0, ids.shape[1] :], skip_special_tokens=True
    )
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": prompt}) + "\n")
    cli.main(
        [
            "generate",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--model",
            str(model_folder),
            "--adapter",
            str(tmp_path / "adapter"),
            "--dtype",
            "fp32",
            "--max-new-tokens",
            "12",
        ]
    )
    assert json.loads((tmp_path / "out.jsonl").read_text())["text"] == expected
    with pytest.raises(SystemExit, match="is not a PEFT adapter's folder"):
        cli.main(["generate", "--prompt", "hi", "--model", str(model_folder), "--adapter", str(tmp_path)])


@pytest.mark.parametrize("slots", [1, 3])
def test_each_request_takes_the_adapter_it_names_in_one_batch(slots: int) -> None:
    """Three requests naming the first adapter, the second and none at all (the base model's weights, PEFT's
    ``__base__``), decoded together: each answers as the model with that adapter active alone (its own generate),
    and a request that names none takes the active adapter."""
    model = lora(tiny_model("llama"), "first", seed=1)
    lora(None, "second", seed=2, into=model)
    prompts = [PROMPT, PROMPT[:, 5:], PROMPT[:, 2:]]
    expected = {}
    for name, prompt in zip(("first", "second"), prompts):
        model.set_adapter(name)
        expected[name] = hf_greedy(model, prompt, 16, eos_token_id=[])[0, prompt.shape[1] :].tolist()
    with model.disable_adapter():
        expected[specula.verifier.adapters.BASE] = hf_greedy(model, prompts[2], 16, eos_token_id=[])[
            0, prompts[2].shape[1] :
        ].tolist()
    model.set_adapter("first")
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # (each adapter changes the answer)
    assert specula.verifier.adapters.adapters_of(model) == ["first", "second"]
    names = ["first", "second", specula.verifier.adapters.BASE, None]
    jobs = [
        specula.Job(prompt[0].numpy(), 16, key=name, adapter=name) for prompt, name in zip(prompts + [PROMPT], names)
    ]
    decoder = specula.Decoder(specula.hf.wrapped.unwrapped(model), specula.PromptLookup(), slots=slots)
    answers = {row.job.key: row.output.tolist() for row, _ in decoder.run(jobs)}
    assert answers == {**expected, None: expected["first"]}


def test_the_cli_loads_several_adapters_and_each_request_names_its_own(model_folder, tmp_path, capsys) -> None:
    """``--adapter one=DIR --adapter DIR2``: a request's ``"model"`` names an adapter (by its given name, or its
    folder's), the model itself (no adapter) or nothing (the first); a name neither loaded nor the model's is a bad
    line naming them, and a name given twice a usage error."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32, tune_layout=False)
    adapted = lora(model, "first", seed=1)
    lora(None, "second", seed=2, into=adapted)
    adapted.save_pretrained(tmp_path)  # (a folder each: tmp_path / "first", tmp_path / "second")
    prompt = "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3"
    ids = encode(tokenizer, {"prompt": prompt})
    expected = {}
    for name in ("first", "second"):
        adapted.set_adapter(name)
        expected[name] = hf_greedy(adapted, ids, 12, eos_token_id=[])[0, ids.shape[1] :]
    with adapted.disable_adapter():
        expected["base"] = hf_greedy(adapted, ids, 12, eos_token_id=[])[0, ids.shape[1] :]
    expected = {name: tokenizer.decode(tokens, skip_special_tokens=True) for name, tokens in expected.items()}
    assert len(set(expected.values())) == 3
    names = {"a": "one", "b": "second", "c": model_folder.name, "d": None, "e": "third"}
    lines = [{"id": key, "prompt": prompt} | ({"model": name} if name else {}) for key, name in names.items()]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = ["--model", str(model_folder), "--dtype", "fp32", "--max-new-tokens", "12", "--batch-size", "4"]
    adapters = ["--adapter", f"one={tmp_path / 'first'}", "--adapter", str(tmp_path / "second")]
    out = tmp_path / "out.jsonl"
    cli.main(["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), *adapters, *common])
    answers = {line["id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert {key: answers[key]["text"] for key in "abcd"} == {
        "a": expected["first"],
        "b": expected["second"],
        "c": expected["base"],
        "d": expected["first"],
    }
    err = capsys.readouterr().err
    assert (
        "e" not in answers and f"but the loaded model is '{model_folder.name}' with the adapters 'one', 'second'" in err
    ), err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi", "--adapter", f"x={tmp_path}", "--adapter", f"x={tmp_path}", *common])


def test_peft_generate_with_an_adapter_for_each_row_decodes_as_without_specula() -> None:
    """``PeftModel.generate(adapter_names=[...], custom_generate=specula.custom_generate)``: each row of the batch
    with its own adapter, as PEFT's own generate decodes it (PEFT's hooks name the whole batch's adapters in every
    forward; specula's passes hold other rows: a prompt alone, rows that left)."""
    model = lora(tiny_model("llama"), "first", seed=1)
    lora(None, "second", seed=2, into=model)
    ids = torch.cat([PROMPT, PROMPT, PROMPT])
    names = ["second", "first", "__base__"]
    kwargs = dict(attention_mask=torch.ones_like(ids), adapter_names=names, max_new_tokens=12, eos_token_id=[])
    expected = model.generate(ids, do_sample=False, **kwargs)
    assert len({tuple(row.tolist()) for row in expected}) == 3
    out = model.generate(ids, custom_generate=specula.custom_generate, proposer=specula.PromptLookup(), **kwargs)
    assert torch.equal(out, expected)
