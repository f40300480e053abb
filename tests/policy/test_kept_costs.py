"""Ordinary verification in bf16: draft lengths follow pass costs measured once per machine and kept (never slower
than plain where passes are dear), not the clock (the same output on every run)."""

from __future__ import annotations

import numpy as np
import pytest
from bf16_cases import NEW_TOKENS, model, prompt
from helpers import Oracle

import specula
from specula.policy import kept_costs
from specula.policy.acceptance import RequestAcceptance
from specula.policy.adaptive import choose_lengths
from specula.verifier import calibration
from specula.verifier.runner import CachedModel


@pytest.fixture
def kept(monkeypatch, tmp_path):
    """Kept tables come from ``table[0]`` (ratios by :data:`kept_costs.WIDTHS`); counts the measurements."""
    monkeypatch.setenv("SPECULA_CALIBRATIONS", str(tmp_path / "calibrations.json"))
    calibration.forget()
    table, measured = [None], []
    monkeypatch.setattr(kept_costs, "_measure", lambda m: measured.append(m) or table[0])
    yield table, measured
    calibration.forget()


def test_dear_passes_send_no_drafts_and_cheap_ones_do(kept) -> None:
    table, measured = kept
    reference = model("llama").generate(prompt(), attention_mask=prompt() * 0 + 1, do_sample=False,
                                        max_new_tokens=NEW_TOKENS, eos_token_id=[])
    table[0] = [1.0] + [10.0] * (len(kept_costs.WIDTHS) - 1)  # every pass over several tokens costs 10 steps
    dear = specula.generate(model("llama"), prompt(), Oracle(reference, 8), max_new_tokens=NEW_TOKENS,
                            eos_token_id=[], exact=False)
    assert dear.stats.drafted == 0 and len(measured) == 1
    calibration.forget()
    table[0] = [1.0] * len(kept_costs.WIDTHS)  # as cheap as one token (another machine, another file)
    calibration.shared().known.clear()
    cheap = specula.generate(model("llama"), prompt(), Oracle(reference, 8), max_new_tokens=NEW_TOKENS,
                             eos_token_id=[], exact=False)
    assert cheap.stats.accepted > NEW_TOKENS // 2 and len(measured) == 2


def test_the_table_is_kept_so_every_run_decides_alike(kept) -> None:
    table, measured = kept
    table[0] = [1.0, 1.3, 1.6, 2.0, 2.8, 4.0, 7.0]
    runs = [specula.generate(model("qwen2"), prompt(), specula.PromptLookup(), max_new_tokens=NEW_TOKENS,
                             eos_token_id=[], exact=False) for _ in range(2)]
    calibration.forget()  # as a new process: from the file
    runs.append(specula.generate(model("qwen2"), prompt(), specula.PromptLookup(), max_new_tokens=NEW_TOKENS,
                                 eos_token_id=[], exact=False))
    assert len(measured) == 1
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist() == runs[2].sequences.tolist()
    assert [run.stats.drafted for run in runs] == [runs[0].stats.drafted] * 3


def test_the_measurement_times_each_width_against_a_one_token_pass(monkeypatch, tmp_path) -> None:
    """On a fake clock where a pass over n tokens costs 1 + (n - 1) / 4, the kept ratios are exactly that."""
    monkeypatch.setenv("SPECULA_CALIBRATIONS", str(tmp_path / "calibrations.json"))
    calibration.forget()
    now = [0.0]
    forward_rows = CachedModel.forward_rows

    def timed(self, blocks, num_logits, *args, **kwargs):
        now[0] += 1.0 + (len(blocks[0]) - 1) / 4
        return forward_rows(self, blocks, num_logits, *args, **kwargs)

    monkeypatch.setattr(CachedModel, "forward_rows", timed)
    monkeypatch.setattr(calibration, "CLOCK", lambda: now[0])
    costs = kept_costs.kept_pass_costs(model("llama"), 32)
    assert costs.ratios()[[w - 1 for w in kept_costs.WIDTHS]].tolist() == [1 + (w - 1) / 4 for w in kept_costs.WIDTHS]
    costs.record(2, 100.0)  # nothing is recorded into a kept table
    assert costs.ratios()[1] == 1.25
    calibration.forget()


def test_no_draft_is_longer_than_the_widest_pass_kept(kept) -> None:
    """Passes wider than the kept table's widest (33 tokens) were never timed, and are never sent: were a wider one
    taken to cost what the widest measured does, a long prediction would send 64 drafts where 65 tokens cost twice."""
    table, _ = kept
    table[0] = [1.0] * len(kept_costs.WIDTHS)  # every measured width as cheap as one token
    costs = kept_costs.kept_pass_costs(model("llama"), 64)
    nearly_sure = np.cumprod(np.full(64, 0.995))  # P_i of 64 drafts, each right 99.5% of the times
    assert choose_lengths([RequestAcceptance(64, timed=False)], [nearly_sure], costs) == [kept_costs.WIDTHS[-1] - 1]
