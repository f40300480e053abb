"""specula generate --ray: a local Ray instance (2 CPUs) answers a file as the local run does."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import ray  # an optional extra of specula's, installed by the README's test command

from specula import cli


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def write_requests(path, count: int, too_long: str) -> None:
    lines = [
        json.dumps(
            {
                "id": f"q{i}" if i % 2 else 100 + i,
                "prompt": "the quick brown fox jumps over the lazy dog " * (1 + i % 3) + f"number {i}",
            }
        )
        for i in range(count)
    ]
    lines.insert(3, "not a request")  # line 4: reported by the driver
    lines.insert(6, json.dumps({"id": "long", "prompt": too_long}))  # line 7: refused by a worker
    path.write_text("\n".join(lines) + "\n")


def answers(path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({json.dumps(row["id"]) for row in rows}) == len(rows), "an id was answered twice"
    return {json.dumps(row["id"]): row for row in rows}


def generate(*argv) -> None:
    cli.main(["generate", *map(str, argv)])


def test_ray_workers_answer_as_the_local_run(model_folder, tmp_path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    write_requests(source, 12, "word " * 5000)  # past the tiny model's context
    common = ["--input", source, "--model", model_folder, "--dtype", "fp32", "--max-new-tokens", 12]
    generate(*common, "--output", tmp_path / "local.jsonl")
    capsys.readouterr()
    generate(*common, "--output", tmp_path / "ray.jsonl", "--ray", "--workers", 2)
    err = capsys.readouterr().err
    local, distributed = answers(tmp_path / "local.jsonl"), answers(tmp_path / "ray.jsonl")
    assert len(local) == 12 and set(distributed) == set(local)  # ids preserved, the two bad lines left out
    for key, row in local.items():
        assert distributed[key]["text"] == row["text"]
        assert set(distributed[key]["stats"]) == set(row["stats"])
    assert "in.jsonl:4: " in err and "in.jsonl:7: " in err and "12 requests" in err and "2 Ray workers" in err


def test_ray_resumes_a_stopped_run(model_folder, tmp_path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    write_requests(source, 6, "short")
    common = ["--input", source, "--model", model_folder, "--dtype", "fp32", "--max-new-tokens", 8]
    generate(*common, "--output", tmp_path / "local.jsonl")
    lines = (tmp_path / "local.jsonl").read_text().splitlines()
    (tmp_path / "ray.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])  # and a torn line
    capsys.readouterr()
    generate(*common, "--output", tmp_path / "ray.jsonl", "--ray", "--resume")
    texts = {key: row["text"] for key, row in answers(tmp_path / "ray.jsonl").items()}
    assert texts == {key: row["text"] for key, row in answers(tmp_path / "local.jsonl").items()}
    assert "3 answered before (--resume)" in capsys.readouterr().err


def test_a_failing_worker_is_a_one_line_error(model_folder, tmp_path) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    shutil.copy(model_folder / "config.json", broken)  # looks like a model folder, has no weights
    source = tmp_path / "in.jsonl"
    write_requests(source, 2, "short")
    with pytest.raises(SystemExit, match="error: a Ray worker failed \\(0 answers written\\): "):
        generate("--input", source, "--output", tmp_path / "out.jsonl", "--model", broken, "--ray")


def test_ray_missing_is_a_clear_error(tmp_path, capsys, monkeypatch) -> None:
    source = tmp_path / "in.jsonl"
    write_requests(source, 2, "short")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(SystemExit) as stopped:
        generate("--input", source, "--output", tmp_path / "out.jsonl", "--ray")
    assert stopped.value.code == 2 and 'pip install "specula[ray]"' in capsys.readouterr().err


@pytest.mark.slow
def test_ray_on_the_default_model(tmp_path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    requests = Path(__file__).parents[2] / "examples" / "requests.jsonl"
    source.write_text("".join(requests.read_text().splitlines(keepends=True)[:3]))
    common = ["--input", source, "--dtype", "fp32", "--max-new-tokens", 24]
    generate(*common, "--output", tmp_path / "local.jsonl")
    generate(*common, "--output", tmp_path / "ray.jsonl", "--ray", "--workers", 2)
    local, distributed = answers(tmp_path / "local.jsonl"), answers(tmp_path / "ray.jsonl")
    assert len(local) == 3 and {key: row["text"] for key, row in distributed.items()} == {
        key: row["text"] for key, row in local.items()
    }
