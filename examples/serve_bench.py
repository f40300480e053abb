"""``specula serve`` under load: N concurrent clients over workload files, time to first token and tokens per second,
against the same server with ``--proposer none`` and, where it runs offline, ``transformers serve``.

Each server is started once on a loopback port and driven in turn, round after round (so a busy moment of the
machine falls on every server alike); each request is streamed through the official ``openai`` client (greedy,
``include_usage``). Per workload and server: tokens per second over the whole round (all clients), the median of
each request's own tokens per second (its tokens over its time from sending to its last chunk), the median time to
first token, the speedup of the first against ``none`` (medians over rounds), the share of answers identical to
``none``'s, the mean tokens of an answer and the share the model ended itself (not cut at ``--max-tokens``).
``predict`` sends code edits with the code they edit as the prediction (the first fenced code block of the request,
as an editor sends the file).

Usage: python examples/serve_bench.py [--model PATH] [--only code_edit,summarize] [--limit 8] [--clients 8]
       [--max-tokens 1024] [--rounds 3] [--transformers-serve] [--json FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from specula.hf.loading import resolve_model
from specula.jobs.requests import load_workloads

START = 900  # seconds a server may take to load and measure this machine


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(command: list[str], name: str) -> tuple[subprocess.Popen, str]:
    """``command`` (told its port by ``{port}``), once its health route answers."""
    port = free_port()
    process = subprocess.Popen(
        [part.replace("{port}", str(port)) for part in command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                print(f"{name}: up at {url}", file=sys.stderr)
                return process, url
        except OSError:
            time.sleep(1.0)
    process.kill()
    raise SystemExit(f"{name} did not start: {process.communicate()[1][-2000:]}")


def predicted_code(request) -> str | None:
    """The first fenced code block of a request's last message: the code an edit applies to."""
    found = re.search(r"```[a-z]*\n(.*?)\n```", request.messages[-1]["content"], re.S) if request.messages else None
    return found.group(1) if found else None


def one(client: openai.OpenAI, model: str, request, max_tokens: int, predict: bool) -> dict:
    """One streamed request: its tokens, time to first token and time to its last chunk."""
    extra = {"prediction": {"type": "content", "content": predicted_code(request)}} if predict else {}
    sent = time.perf_counter()
    first, tokens, text, finish = None, 0, [], None
    for chunk in client.chat.completions.create(
        model=model,
        messages=request.messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return {
        "tokens": tokens,
        "ttft": (first or done) - sent,
        "seconds": done - sent,
        "text": "".join(text),
        "ended": finish == "stop",
    }


def drive(url: str, requests: list, clients: int, max_tokens: int, predict: bool, model: str | None = None) -> dict:
    """Every request through ``clients`` concurrent clients; the round's figures (``model``: the name requests
    give, by default the server's own)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0)
    model = model or client.models.list().data[0].id
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda request: one(client, model, request, max_tokens, predict), requests))
    wall = time.perf_counter() - started
    return {
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "tok_s_request": statistics.median(r["tokens"] / r["seconds"] for r in results),
        "ttft": statistics.median(r["ttft"] for r in results),
        "texts": [r["text"] for r in results],
        "tokens": statistics.mean(r["tokens"] for r in results),
        "ended": statistics.mean(r["ended"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workloads", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "workloads")
    parser.add_argument("--only", default="code_edit,summarize")
    parser.add_argument("--limit", type=int, default=8, help="requests per workload")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="each request's max_tokens: room for a whole answer (an edit returns the whole file)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", default=None, help="the servers' --max-batch (default: measured)")
    parser.add_argument(
        "--transformers-serve",
        action="store_true",
        help="also `transformers serve` on the same model (offline, its defaults), one round",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workloads = load_workloads(args.workloads, args.limit, args.only.split(","))
    folder = str(resolve_model(args.model))  # (the default model: its converted folder)
    specula_serve = [
        sys.executable,
        "-m",
        "specula.cli",
        "serve",
        "--port",
        "{port}",
        "--dtype",
        args.dtype,
        "--max-new-tokens",
        str(args.max_tokens),
        *(["--model", folder] if args.model else []),
        *(["--max-batch", args.max_batch] if args.max_batch else []),
    ]
    servers = {
        "none": start(specula_serve + ["--proposer", "none"], "specula serve --proposer none"),
        "prompt-lookup": start(specula_serve + ["--proposer", "prompt-lookup"], "specula serve"),
    }
    runs = [(workload, name, False) for workload in workloads for name in servers]
    runs += [(workload, "prompt-lookup+prediction", True) for workload in workloads if workload == "code_edit"]
    figures: dict = {}
    try:
        for round_ in range(args.rounds):
            for workload, name, predict in runs:
                url = servers[name.partition("+")[0]][1]
                result = drive(url, workloads[workload], args.clients, args.max_tokens, predict)
                figures.setdefault((workload, name), []).append(result)
                print(f"round {round_ + 1}: {workload} {name}: {result['tok_s']:.1f} tok/s", file=sys.stderr)
        if args.transformers_serve:
            servers["transformers serve"] = start(
                ["transformers", "serve", "--port", "{port}", folder], "transformers serve"
            )
            for workload in workloads:
                figures[(workload, "transformers serve")] = [
                    drive(
                        servers["transformers serve"][1],
                        workloads[workload],
                        args.clients,
                        args.max_tokens,
                        False,
                        folder,
                    )
                ]
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    rows = []
    for (workload, name), results in figures.items():
        base = statistics.median(r["tok_s"] for r in figures[(workload, "none")])
        same = statistics.mean(
            a == b for r, n in zip(results, figures[(workload, "none")]) for a, b in zip(r["texts"], n["texts"])
        )
        rows.append(
            {
                "workload": workload,
                "server": name,
                "tok_s": statistics.median(r["tok_s"] for r in results),
                "tok_s_request": statistics.median(r["tok_s_request"] for r in results),
                "ttft_s": statistics.median(r["ttft"] for r in results),
                "same_as_none": same,
                "tokens": statistics.mean(r["tokens"] for r in results),
                "ended": statistics.mean(r["ended"] for r in results),
            }
        )
        rows[-1]["speedup"] = rows[-1]["tok_s"] / base
    print(
        f"{args.model or 'SmolLM2-135M-Instruct'}, --dtype {args.dtype}, {args.clients} clients, "
        f"{args.limit} requests a workload, {args.max_tokens} tokens, "
        f"medians of {args.rounds} interleaved rounds (transformers serve: one); {os.cpu_count()} CPUs"
    )
    print(
        f"{'workload':<11}{'server':<26}{'tok/s':>8}{'per req':>9}{'TTFT s':>8}{'speedup':>9}{'same':>6}"
        f"{'tokens':>8}{'ended':>7}"
    )
    for row in rows:
        print(
            f"{row['workload']:<11}{row['server']:<26}{row['tok_s']:>8.1f}{row['tok_s_request']:>9.2f}"
            f"{row['ttft_s']:>8.2f}{row['speedup']:>8.2f}x{row['same_as_none']:>6.0%}{row['tokens']:>8.0f}"
            f"{row['ended']:>7.0%}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
