"""Predictions in request files: "prediction" as text or OpenAI's {"type": "content", ...} shape, answered as
without one, their counts in the answer lines; a bad one skips its line only; the same through Ray workers."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import hf_greedy

from specula import cli
from specula.hf import loading

NEW = 16
PROMPT = "the quick brown fox jumps over the lazy dog the quick brown fox"


def answers(path) -> dict:
    return {row["id"]: row for row in map(json.loads, path.read_text().splitlines())}


@pytest.fixture
def requests(model_folder, tmp_path):
    """A file whose first request predicts the model's own answer, the second a wrong one in OpenAI's shape, the
    third's prediction is not text (skipped), the fourth has none."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    answer = tokenizer.decode(hf_greedy(model, prompt, NEW)[0, prompt.shape[1] :], skip_special_tokens=True)
    lines = [
        {"id": "right", "prompt": PROMPT, "prediction": answer},
        {"id": "wrong", "prompt": PROMPT, "prediction": {"type": "content", "content": "lazy dog " * 9}},
        {"id": "bad", "prompt": PROMPT, "prediction": [1, 2, 3]},
        {"id": "none", "prompt": PROMPT},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(map(json.dumps, lines)) + "\n")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"id": "plain", "prompt": PROMPT}) + "\n")
    return path


def generate(*argv) -> None:
    cli.main(["generate", *map(str, argv)])


@pytest.mark.parametrize("proposer", ["prompt-lookup", "none"])
def test_predicted_answers_are_the_models_and_count_the_prediction(
    model_folder, requests, tmp_path, capsys, proposer, drafts_cost_nothing
) -> None:
    common = ["--model", model_folder, "--dtype", "fp32", "--max-new-tokens", NEW, "--proposer", proposer]
    generate("--input", requests, "--output", tmp_path / "out.jsonl", *common)
    err = capsys.readouterr().err
    generate("--input", tmp_path / "plain.jsonl", "--output", tmp_path / "plain_out.jsonl", *common)
    got, plain = answers(tmp_path / "out.jsonl"), answers(tmp_path / "plain_out.jsonl")["plain"]
    assert set(got) == {"right", "wrong", "none"} and 'in.jsonl:3: "prediction" must be text' in err
    assert all(row["text"] == plain["text"] for row in got.values())
    right, wrong, none = got["right"]["stats"], got["wrong"]["stats"], got["none"]["stats"]
    assert right["accepted_prediction_tokens"] > 0  # (drafts cost nothing: a right prediction is sent)
    assert wrong["rejected_prediction_tokens"] > 0
    for stats in (right, wrong):
        assert stats["accepted_prediction_tokens"] + stats["rejected_prediction_tokens"] <= stats["drafted"]
    assert "accepted_prediction_tokens" not in none and set(none) == set(plain["stats"])


def test_ray_workers_take_predictions(model_folder, requests, tmp_path, capsys) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        common = ["--input", requests, "--model", model_folder, "--dtype", "fp32", "--max-new-tokens", NEW]
        generate(*common, "--output", tmp_path / "local.jsonl")
        generate(*common, "--output", tmp_path / "ray.jsonl", "--ray")
    finally:
        ray.shutdown()
    local, distributed = answers(tmp_path / "local.jsonl"), answers(tmp_path / "ray.jsonl")
    assert set(distributed) == set(local) == {"right", "wrong", "none"}
    for key, row in local.items():
        assert distributed[key]["text"] == row["text"] and set(distributed[key]["stats"]) == set(row["stats"])
    assert distributed["right"]["stats"]["accepted_prediction_tokens"] > 0


def test_bench_adds_predicted_rows_where_a_workload_carries_predictions(
    model_folder, requests, tmp_path, capsys, drafts_cost_nothing
) -> None:
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    lines = requests.read_text().splitlines()
    (workloads / "edits.jsonl").write_text("\n".join(lines[:2] + lines[3:]) + "\n")  # (not the bad line)
    cli.main(
        [
            "bench",
            "--workloads",
            str(workloads),
            "--model",
            str(model_folder),
            "--dtype",
            "fp32",
            "--limit",
            "3",
            "--repeats",
            "1",
            "--proposers",
            "prompt-lookup,none",
            "--no-oracle",
            "--max-new-tokens",
            str(NEW),
            "--json",
            str(tmp_path / "rows.json"),
        ]
    )
    out = capsys.readouterr().out
    rows = {row["method"]: row for row in json.loads((tmp_path / "rows.json").read_text())}
    assert {"specula-prompt-lookup+prediction", "specula-none+prediction"} <= set(rows)
    for name in ("specula-prompt-lookup+prediction", "specula-none+prediction"):
        assert rows[name]["identical_to_greedy"] == 1.0 and rows[name]["accepted_prediction_tokens"] > 0
        assert re.search(rf"^edits +{re.escape(name)} ", out, re.M)  # (a row of the table, the name whole)
    assert rows["specula-prompt-lookup"]["accepted_prediction_tokens"] == 0
    assert "prediction tokens verified, accepted / rejected: edits specula-prompt-lookup+prediction" in out
