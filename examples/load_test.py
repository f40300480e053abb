"""``specula serve`` under load, watched for memory: streams with hang-ups, bad bodies and requests that run to the
end of the model's context, against the server's resident set and the keys and values those requests hold.

A real server process on a loopback port, driven by the official ``openai`` client and raw HTTP, in three steps:

1. ``--clients`` concurrent streamed chats of ``--max-tokens`` tokens (greedy), ``--hang-ups`` of them closing their
   stream after three chunks, while ``--bad`` malformed bodies are posted (each must be a 400 with OpenAI's error
   object); the whole answers are checked against ``model.generate`` in this process.
2. One request that runs to the end of the context (below) beside ``--mixed`` short chats: rows that share passes
   with a long one, each holding its own tokens.
3. ``--long`` concurrent requests without ``max_tokens`` whose prompts leave ``--tail`` tokens of the context: each
   runs to the end of the context, so its row holds a whole context of keys and values.
4. Idle again: the resident set after the load.

The resident set is sampled from ``/health`` every ``--every`` seconds throughout. The report (stdout, and
``--json``) gives it idle, at its peak (in step 2, and in all) and after, the keys and values the long requests
held (their tokens times the bytes a token takes, from ``/health``; in step 2 the long one's and the short ones'),
and whether the peak stayed within idle + ``1.5x`` those and the level after within ``0.5 GB`` of idle. Exit status
1 where an answer differed, a bad body was not a 400, or a request failed (``--strict-memory``: also where a memory
bound was missed).

Usage: python examples/load_test.py [--model PATH] [--dtype fp32] [--clients 32] [--hang-ups 8] [--bad 12]
       [--mixed 7] [--long 8] [--tail 256] [--max-tokens 48] [--max-memory SIZE] [--json FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import torch
from serve_bench import start

from specula.hf.loading import load_model, resolve_model
from specula.jobs.requests import encode
from specula.verifier.support import context_limit

TOPICS = ["the sea", "a small town", "trains", "winter", "a garden", "the moon", "old maps", "bread"]
BAD = [
    b"{not json",
    b"[]",
    b'{"messages": []}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
]
GB = 1e9


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
        return json.load(answer)


class Watch(threading.Thread):
    """Samples the server's resident set until stopped; ``peak`` is the highest seen."""

    def __init__(self, url: str, every: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every, self.peak, self.done = url, every, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, health(self.url)["memory"]["resident_bytes"])
            except OSError:
                pass
            self.done.wait(self.every)


def chat(client: openai.OpenAI, name: str, topic: str, max_tokens: int | None, hang_up: bool) -> dict:
    """One streamed chat; its text, or only that it hung up after three chunks."""
    messages = [{"role": "user", "content": topic if max_tokens is None else f"Write a few sentences about {topic}."}]
    stream = client.chat.completions.create(
        model=name,
        messages=messages,
        stream=True,
        temperature=0,
        **({} if max_tokens is None else {"max_tokens": max_tokens}),
    )
    text, finish = [], None
    for count, chunk in enumerate(stream, start=1):
        if hang_up and count == 3:
            stream.close()
            return {"messages": messages, "hung_up": True}
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"messages": messages, "text": "".join(text), "finish": finish, "hung_up": False}


def bad(url: str, body: bytes) -> bool:
    """Whether a bad body is answered 400 with OpenAI's error object."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as error:
        return error.code == 400 and set(json.load(error)["error"]) == {"message", "type", "param", "code"}
    return False


def long_prompt(tokenizer, tokens: int) -> str:
    """A user message of about ``tokens`` tokens under the chat template (a text that repeats, as a pasted log)."""
    line = "The server keeps answering while the log grows, line after line. "
    text = line * max(1, tokens // len(tokenizer(line).input_ids))
    while encode(tokenizer, user(text)).shape[1] > tokens:
        text = text[: int(len(text) * 0.95)]
    return text


def user(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--hang-ups", type=int, default=8)
    parser.add_argument("--bad", type=int, default=12)
    parser.add_argument("--mixed", type=int, default=7, help="short chats beside one long request (0: none)")
    parser.add_argument("--long", type=int, default=8)
    parser.add_argument("--tail", type=int, default=256, help="tokens a long request's prompt leaves of the context")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-memory", default=None, help="the server's --max-memory")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between samples of the resident set")
    parser.add_argument("--strict-memory", action="store_true", help="exit 1 where a memory bound was missed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = resolve_model(args.model)
    model, tokenizer = load_model(folder, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    command = [
        sys.executable,
        "-m",
        "specula.cli",
        "serve",
        "--model",
        str(folder),
        "--dtype",
        args.dtype,
        "--port",
        "{port}",
        *(["--max-memory", args.max_memory] if args.max_memory else []),
    ]
    process, url = start(command, "specula serve")
    report: dict = {"model": str(folder), "dtype": args.dtype}
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0)
        name = client.models.list().data[0].id
        time.sleep(1.0)
        idle = health(url)
        report["idle_bytes"], memory = idle["memory"]["resident_bytes"], idle["memory"]
        watch = Watch(url, args.every)
        watch.start()
        with concurrent.futures.ThreadPoolExecutor(args.clients + args.bad) as pool:
            chats = [
                pool.submit(chat, client, name, f"{TOPICS[i % len(TOPICS)]} ({i})", args.max_tokens, i < args.hang_ups)
                for i in range(args.clients)
            ]
            bodies = [pool.submit(bad, url, BAD[i % len(BAD)]) for i in range(args.bad)]
            chats, bodies = [c.result() for c in chats], [b.result() for b in bodies]
        limit = context_limit(model)
        text = long_prompt(tokenizer, limit - args.tail)
        if args.mixed:
            beside = Watch(url, args.every)
            beside.start()
            with concurrent.futures.ThreadPoolExecutor(args.mixed + 1) as pool:
                first = pool.submit(chat, client, name, f"{text} (mixed)", None, False)
                time.sleep(2.0)  # (the long one's prefill first: the short ones share its passes)
                shorts = [
                    pool.submit(chat, client, name, TOPICS[i % len(TOPICS)], args.max_tokens, False)
                    for i in range(args.mixed)
                ]
                first.result(), [short.result() for short in shorts]
            beside.done.set()
            beside.join()
            short_tokens = sum(
                encode(tokenizer, user(TOPICS[i % len(TOPICS)])).shape[1] + args.max_tokens for i in range(args.mixed)
            )
            mixed = (limit + short_tokens) * memory["bytes_per_token"]
            report["mixed"] = {
                "peak_bytes": beside.peak,
                "kv_bytes": mixed,
                "peak_over_idle_in_kv": round((beside.peak - report["idle_bytes"]) / mixed, 2),
                "peak_within_idle_plus_1.5x_kv": beside.peak <= report["idle_bytes"] + 1.5 * mixed,
            }
        with concurrent.futures.ThreadPoolExecutor(max(args.long, 1)) as pool:
            longs = [
                r.result()
                for r in [pool.submit(chat, client, name, f"{text} ({i})", None, False) for i in range(args.long)]
            ]
        while health(url)["in_flight"]:
            time.sleep(0.2)
        time.sleep(2.0)  # (what the allocator gives back, given back)
        watch.done.set()
        watch.join()
        after = health(url)["memory"]["resident_bytes"]
        whole = [c for c in chats if not c["hung_up"]]
        same = 0
        for c in whole:
            ids = encode(tokenizer, {"messages": c["messages"]})
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens, do_sample=False
            )
            same += tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == c["text"]
        held = args.long * limit * memory["bytes_per_token"]
        report.update(
            {
                "peak_bytes": watch.peak,
                "after_bytes": after,
                "long_requests_kv_bytes": held,
                "budget_bytes": memory.get("budget_bytes"),
                "peak_over_idle_in_kv": round((watch.peak - report["idle_bytes"]) / held, 2) if held else None,
                "peak_within_idle_plus_1.5x_kv": watch.peak <= report["idle_bytes"] + 1.5 * held,
                "after_within_0.5GB_of_idle": after <= report["idle_bytes"] + 0.5 * GB,
                "answers_identical": f"{same}/{len(whole)}",
                "hung_up": len(chats) - len(whole),
                "bad_bodies_400": f"{sum(bodies)}/{len(bodies)}",
                "long_finished_at_length": f"{sum(c['finish'] == 'length' for c in longs)}/{len(longs)}",
                "health": health(url),
            }
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    failed = (
        report["answers_identical"] != f"{len(whole)}/{len(whole)}"
        or not all(bodies)
        or report["health"]["failed"]
        or (
            args.strict_memory
            and not (
                report["peak_within_idle_plus_1.5x_kv"]
                and report["after_within_0.5GB_of_idle"]
                and report.get("mixed", {}).get("peak_within_idle_plus_1.5x_kv", True)
            )
        )
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
