"""specula drift: reports no drift on identical runs, and a planted divergence with its position and verdict."""

from __future__ import annotations

import json

import torch
from bf16_cases import NEW_TOKENS, model, prompt, reference
from helpers import Oracle

from specula import cli
from specula.tools.drift import drift
from specula.verifier.cache_names import cache_in


def plant(target: torch.nn.Module, position: int, margin: float, in_passes_only: bool = False):
    """A forward hook that makes the runner-up token at ``position`` (a sequence index) win by ``margin`` in
    verification passes (several logits rows) and lose by ``margin`` in one-token steps."""

    def hook(module, args, kwargs, output):
        logits = output.logits[0]
        end = cache_in(kwargs).get_seq_length()
        row = position - (end - logits.shape[0] + 1)
        if 0 <= row < logits.shape[0]:
            top2 = logits[row].float().topk(2).indices
            first, second = int(top2[0]), int(top2[1])
            if logits.shape[0] > 1:
                logits[row, second] = logits[row, first] + margin
            elif not in_passes_only:
                logits[row, second] = logits[row, first] - margin

    return target.register_forward_hook(hook, with_kwargs=True)


def test_identical_runs_report_no_drift() -> None:
    report = drift(model("llama"), prompt(), Oracle(reference("llama"), 7), NEW_TOKENS, eos_token_id=[], exact=True)
    assert report.identical and report.position is None and report.verdict == "identical"


def test_a_planted_near_tie_is_found_and_called_a_near_tie() -> None:
    start = prompt().shape[1]
    handle = plant(model("llama"), start + 5, margin=0.01)
    try:
        report = drift(
            model("llama"),
            prompt(),
            Oracle(reference("llama"), 7),
            NEW_TOKENS,
            eos_token_id=[],
            exact=True,
            adaptive_draft=False,
        )
    finally:
        handle.remove()
    assert not report.identical and report.position == 5
    assert report.plain_token == reference("llama")[0, start + 5] != report.speculative_token
    assert 0 <= report.gap_one_token <= report.tolerance and 0 <= report.gap_verification <= report.tolerance
    assert report.verdict == "near-tie"


def test_a_planted_large_divergence_is_not_a_near_tie() -> None:
    start = prompt().shape[1]
    handle = plant(model("llama"), start + 9, margin=5.0, in_passes_only=True)
    try:
        report = drift(
            model("llama"),
            prompt(),
            Oracle(reference("llama"), 7),
            NEW_TOKENS,
            eos_token_id=[],
            exact=True,
            adaptive_draft=False,
        )
    finally:
        handle.remove()
    assert not report.identical and report.position == 9
    assert report.gap_verification > report.tolerance
    assert report.verdict.startswith("not a near-tie")


def test_drift_and_probe_commands(tmp_path, capsys) -> None:
    folder = tmp_path / "model"
    model("llama").save_pretrained(folder)
    from tiny_models import tiny_tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer: PreTrainedTokenizerFast = tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"id": "x", "prompt": "the quick brown fox jumps over the lazy dog the quick brown"}\n')
    out = tmp_path / "drift.json"
    cli.main(
        [
            "drift",
            "--input",
            str(requests),
            "--model",
            str(folder),
            "--dtype",
            "bf16",
            "--exact",
            "--max-new-tokens",
            "24",
            "--json",
            str(out),
        ]
    )
    assert "1 of 1 identical to model.generate" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["id"] == "x"
    assert json.loads(out.read_text())[0]["drafted"] > 0  # every draft sent, so that the check verified some
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    cli.main(["probe", "--model", str(folder), "--dtype", "bf16", "--text", str(text), "--width", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all("(ordinary verification)" in line for line in lines[:3])  # 3 places, 2 ways
    assert all(line.endswith("every module's output is bit for bit what one-token steps give.") for line in lines[3:])
