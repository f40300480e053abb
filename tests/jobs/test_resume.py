"""Answers files that survive a stopped run: --resume after SIGKILL, a torn last line, Ctrl-C (SIGINT)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specula import cli
from specula.cli import commands
from specula.jobs.answer_file import AnswerFile
from specula.jobs.requests import answer_key

WORDS = "the quick brown fox jumps over the lazy dog and def foo bar baz return print hello world".split()


def requests_file(path: Path, count: int) -> Path:
    """``count`` requests: string ids, int ids and no id (the line number), one bad line in the middle."""
    lines = []
    for i in range(count):
        prompt = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(6 + i % 5)) + " " + WORDS[i % len(WORDS)]
        request = {"prompt": prompt}
        if i % 3 == 0:
            request["id"] = f"r{i}"
        elif i % 3 == 1:
            request["id"] = 1000 + i
        lines.append(json.dumps(request))
    lines.insert(count // 2, "not json")
    path.write_text("\n".join(lines) + "\n")
    return path


def texts(path: Path) -> dict[str, str]:
    """id -> text of an answers file, checking every line is a complete answer and no id comes twice."""
    answers = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [answer_key(answer["id"]) for answer in answers]
    assert len(keys) == len(set(keys)), "an id was answered twice"
    return {key: answer["text"] for key, answer in zip(keys, answers)}


def command(model_folder, source: Path, output: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "specula.cli",
        "generate",
        "--input",
        str(source),
        "--output",
        str(output),
        "--model",
        str(model_folder),
        "--dtype",
        "fp32",
        "--max-new-tokens",
        "48",
        "--batch-size",
        "2",
        *extra,
    ]


def wait_for_answers(process: subprocess.Popen, output: Path, count: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if output.exists() and output.read_text().count("\n") >= count:
            return
        time.sleep(0.01)
    pytest.fail(f"the run ended or stalled before writing {count} answers")


@pytest.fixture(scope="module")
def uninterrupted(model_folder, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("resume")
    source = requests_file(folder / "in.jsonl", 40)
    subprocess.run(command(model_folder, source, folder / "all.jsonl"), check=True, capture_output=True)
    return source, texts(folder / "all.jsonl")


def test_a_killed_run_resumes_answering_each_request_once(model_folder, uninterrupted, tmp_path) -> None:
    source, expected = uninterrupted
    assert len(expected) == 40
    output = tmp_path / "out.jsonl"
    process = subprocess.Popen(command(model_folder, source, output), stderr=subprocess.DEVNULL)
    wait_for_answers(process, output, 3)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = texts(output)
    assert 3 <= len(before) < 40, "the run was not stopped half-way"
    # A line torn as a killed writer leaves it: half of an answer the run had not finished.
    missing = next(key for key in expected if key not in before)
    with output.open("a") as file:
        file.write(json.dumps({"id": json.loads(missing), "text": expected[missing]})[:20])
    resumed = subprocess.run(command(model_folder, source, output, "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "cut short" in resumed.stderr and f"{len(before)} answered before (--resume)" in resumed.stderr
    assert "in.jsonl:21: " in resumed.stderr  # the bad line is reported again, not fatal
    assert texts(output) == expected  # every id exactly once, each answer as the uninterrupted run's


def test_ctrl_c_finishes_the_line_and_exits_cleanly(model_folder, uninterrupted, tmp_path) -> None:
    source, expected = uninterrupted
    output = tmp_path / "out.jsonl"
    process = subprocess.Popen(command(model_folder, source, output), stderr=subprocess.PIPE, text=True)
    wait_for_answers(process, output, 2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "interrupted: rerun with --resume" in err
    before = texts(output)  # complete lines only
    assert 2 <= len(before) < 40 and output.read_text().endswith("\n")
    assert f"{len(before)} requests," in err  # the summary counts what was written
    subprocess.run(command(model_folder, source, output, "--resume"), check=True, capture_output=True)
    assert texts(output) == expected


def test_resume_skips_answered_ids_in_process(model_folder, tmp_path, capsys) -> None:
    source = requests_file(tmp_path / "in.jsonl", 6)
    output = tmp_path / "out.jsonl"
    cli.main(
        [
            "generate",
            "--input",
            str(source),
            "--output",
            str(output),
            "--model",
            str(model_folder),
            "--dtype",
            "fp32",
            "--max-new-tokens",
            "4",
        ]
    )
    full = texts(output)
    kept = output.read_text().splitlines()[:2]
    output.write_text("\n".join(kept) + "\n")
    cli.main(
        [
            "generate",
            "--input",
            str(source),
            "--output",
            str(output),
            "--model",
            str(model_folder),
            "--dtype",
            "fp32",
            "--max-new-tokens",
            "4",
            "--resume",
        ]
    )
    assert texts(output) == full
    assert output.read_text().splitlines()[:2] == kept  # appended, the earlier answers untouched
    assert "4 requests," in capsys.readouterr().err


def test_answer_file_recovery(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n{"id": 3, "te')
    answers = AnswerFile(path, resume=True)
    assert answers.torn and answers.done == {answer_key(1), answer_key("1")}  # 1 and "1" are different ids
    answers.write({"id": 3, "text": "c"})
    answers.close()
    assert path.read_text() == '{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n{"id": 3, "text": "c"}\n'
    # A bad line before the last is not a torn write: the file is not an answers file.
    path.write_text('{"id": 1}\nhello\n{"id": 2}\n')
    with pytest.raises(ValueError, match=r"out.jsonl:2 is not an answer"):
        AnswerFile(path, resume=True)
    # A failed run (e.g. --strict finding a bad line) leaves an existing file as it was.
    with pytest.raises(RuntimeError), AnswerFile(path) as answers:
        raise RuntimeError
    assert path.read_text() == '{"id": 1}\nhello\n{"id": 2}\n'


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--resume", "--overwrite"], "give one of them"),
        (["--resume", "--prompt", "hi"], "--resume works on files"),
    ],
)
def test_resume_argument_errors(argv, message, tmp_path, capsys) -> None:
    source = requests_file(tmp_path / "in.jsonl", 2)
    if "--prompt" not in argv:
        argv = ["--input", str(source), "--output", str(tmp_path / "out.jsonl"), *argv]
    with pytest.raises(SystemExit) as stopped:
        cli.main(["generate", *argv])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_resume_refuses_a_file_that_is_not_answers(model_folder, tmp_path, capsys, monkeypatch) -> None:
    source = requests_file(tmp_path / "in.jsonl", 2)
    (tmp_path / "out.jsonl").write_text("some notes\nmore notes\n")
    monkeypatch.setattr(commands, "_load", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as stopped:  # a usage error (the wrong --output), as the other file checks
        cli.main(["generate", "--input", str(source), "--output", str(tmp_path / "out.jsonl"), "--resume"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "out.jsonl:1 is not an answer" in err and err.count("error:") == 1
    assert (tmp_path / "out.jsonl").read_text() == "some notes\nmore notes\n"


def test_a_repeated_id_is_reported_and_answered_once(model_folder, tmp_path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    lines = ['{"id": 3, "prompt": "a b c"}', '{"prompt": "d e f"}', '{"prompt": "g h i"}', '{"id": 3, "prompt": "x"}']
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    cli.main(
        [
            "generate",
            "--input",
            str(source),
            "--output",
            str(output),
            "--model",
            str(model_folder),
            "--dtype",
            "fp32",
            "--max-new-tokens",
            "2",
        ]
    )
    assert sorted(texts(output)) == ["2", "3"]  # line 3 (known as 3) and line 4 repeat line 1's id
    err = capsys.readouterr().err
    assert "in.jsonl:3: its id 3 is line 1's too" in err and "in.jsonl:4: its id 3 is line 1's too" in err
