"""``specula serve`` as a real process on 127.0.0.1, driven by the official ``openai`` client: answers equal
``model.generate``'s, streams join to them, predictions are counted, concurrent clients get their own answers, bad
requests get 400 with the field named while the server goes on, a client that goes away frees its row, an API key
is asked for when set, SIGTERM stops it. Every wait is bounded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi", reason="the server's extra: pip install 'specula[serve]'")
openai = pytest.importorskip("openai")

from specula.hf import loading  # noqa: E402
from specula.jobs.requests import encode  # noqa: E402

START = 180  # seconds a server may take to load and measure
MAX_TOKENS = 12
PROMPTS = ["the quick brown fox", "tests of the server", "one two three four", "a b c d e f"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(folder, *options: str) -> tuple[subprocess.Popen, str]:
    """A ``specula serve`` process on a free loopback port, once its health route answers."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specula.cli",
            "serve",
            "--model",
            str(folder),
            "--dtype",
            "fp32",
            "--port",
            str(port),
            "--max-new-tokens",
            str(MAX_TOKENS),
            *options,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError(f"the server did not start: {process.communicate(timeout=30)[1][-2000:]}")


def stop(process: subprocess.Popen) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("the server did not stop within 60 s of SIGTERM") from None
    return process.returncode, stderr


@pytest.fixture(scope="module")
def server(model_folder):
    process, url = start_server(model_folder, "--batch-size", "4", "--proposer", "prompt-lookup")
    yield url
    stop(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def name(client) -> str:
    """The name the server gives its model (its folder's)."""
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(model_folder):
    """What ``model.generate`` makes of a request, as text (fp32, greedy, or sampled after ``manual_seed``)."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32)

    def generate(request: dict, seed: int | None = None, **kwargs) -> str:
        ids = encode(tokenizer, request)
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=seed is not None, **kwargs
        )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return generate


@pytest.fixture(scope="module")
def reference_logprobs(model_folder):
    """``model.generate``'s new tokens for a request (as text) with their log probabilities (fp32, greedy)."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32)

    def generate(request: dict, max_tokens: int = MAX_TOKENS, prompt: bool = False) -> list[tuple[str, float | None]]:
        ids = encode(tokenizer, request)
        if prompt:  # (the prompt's tokens instead: the first has none)
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            return [(tokenizer.decode(ids[0, :1]), None)] + [
                (tokenizer.decode([token]), logprobs[at, token].item()) for at, token in enumerate(ids[0, 1:].tolist())
            ]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        return [(tokenizer.decode([token]), logprobs[at, token].item()) for at, token in enumerate(tokens)]

    return generate


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
        return json.load(answer)


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_and_text_completions_are_model_generate(client, name, reference) -> None:
    answer = client.chat.completions.create(model=name, messages=chat(PROMPTS[0]), temperature=0)
    assert answer.object == "chat.completion" and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content == reference({"messages": chat(PROMPTS[0])})
    assert answer.usage.completion_tokens == MAX_TOKENS
    text = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=5, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens == 5
    assert reference({"prompt": PROMPTS[1]}).startswith(text.choices[0].text)


def test_a_seeded_request_draws_model_generates_tokens(client, name, reference) -> None:
    drawn = [
        client.chat.completions.create(model=name, messages=chat(PROMPTS[2]), temperature=0.9, seed=seed)
        .choices[0]
        .message.content
        for seed in (7, 7, 8)
    ]
    assert drawn[0] == drawn[1] == reference({"messages": chat(PROMPTS[2])}, seed=7, temperature=0.9)
    assert drawn[2] == reference({"messages": chat(PROMPTS[2])}, seed=8, temperature=0.9) != drawn[0]


def test_streamed_chunks_join_to_the_answer(client, name) -> None:
    whole = client.chat.completions.create(model=name, messages=chat(PROMPTS[3]), temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=name, messages=chat(PROMPTS[3]), temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert text == whole.choices[0].message.content
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert finishes == ["length"] and chunks[-1].usage.completion_tokens == MAX_TOKENS and not chunks[-1].choices
    streamed = list(client.completions.create(model=name, prompt=PROMPTS[3], temperature=0, stream=True))
    plain = client.completions.create(model=name, prompt=PROMPTS[3], temperature=0)
    assert "".join(chunk.choices[0].text for chunk in streamed) == plain.choices[0].text
    stop = plain.choices[0].text[6:9]  # a stop string in the middle of the answer: streamed up to it, not past
    streamed = list(client.completions.create(model=name, prompt=PROMPTS[3], temperature=0, stream=True, stop=stop))
    cut = client.completions.create(model=name, prompt=PROMPTS[3], temperature=0, stop=stop)
    assert (
        "".join(chunk.choices[0].text for chunk in streamed)
        == cut.choices[0].text
        == plain.choices[0].text[: plain.choices[0].text.find(stop)]
    )
    assert streamed[-1].choices[0].finish_reason == cut.choices[0].finish_reason == "stop"


def test_log_probabilities_are_the_models_own_whole_and_streamed(client, name, reference_logprobs) -> None:
    messages = chat(PROMPTS[1])
    expected = reference_logprobs({"messages": messages})
    whole = client.chat.completions.create(model=name, messages=messages, temperature=0, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert [entry.token for entry in content] == [token for token, _ in expected]
    assert all(abs(entry.logprob - logprob) < 1e-4 for entry, (_, logprob) in zip(content, expected))
    assert all(bytes(entry.bytes).decode() == entry.token for entry in content)
    for entry in content:  # (the token itself is among its position's two likeliest, or below both)
        first, second = entry.top_logprobs
        assert first.logprob >= second.logprob and first.logprob >= entry.logprob - 1e-6
        assert entry.token in (first.token, second.token) or entry.logprob <= second.logprob + 1e-6
    streamed = client.chat.completions.create(
        model=name, messages=messages, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    pieces = [
        entry for chunk in streamed for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content
    ]
    assert [(entry.token, entry.logprob) for entry in pieces] == [(entry.token, entry.logprob) for entry in content]
    assert client.chat.completions.create(model=name, messages=messages, temperature=0).choices[0].logprobs is None
    text = client.completions.create(model=name, prompt=PROMPTS[1], temperature=0, max_tokens=5, logprobs=1)
    listed = text.choices[0].logprobs
    expected = reference_logprobs({"prompt": PROMPTS[1]}, max_tokens=5)
    assert listed.tokens == [token for token, _ in expected] and len(listed.top_logprobs) == 5
    assert all(abs(got - logprob) < 1e-4 for got, (_, logprob) in zip(listed.token_logprobs, expected))
    assert listed.text_offset == [sum(map(len, listed.tokens[:at])) for at in range(5)]
    chunks = list(
        client.completions.create(model=name, prompt=PROMPTS[1], temperature=0, max_tokens=5, logprobs=1, stream=True)
    )
    assert [token for chunk in chunks if chunk.choices[0].logprobs for token in chunk.choices[0].logprobs.tokens] == (
        listed.tokens
    )


def test_echo_answers_after_the_prompt_and_lists_its_tokens(client, name, reference_logprobs) -> None:
    """A text completion with ``echo`` (lm-evaluation-harness scores a text so: ``max_tokens`` 0, ``logprobs``)."""
    prompted = reference_logprobs({"prompt": PROMPTS[2]}, prompt=True)
    scored = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPTS[2] and scored.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [token for token, _ in prompted] and choice.logprobs.token_logprobs[0] is None
    assert all(abs(got - want) < 1e-4 for got, (_, want) in zip(choice.logprobs.token_logprobs[1:], prompted[1:]))
    assert choice.logprobs.top_logprobs[0] is None and all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])
    answered = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=4, echo=True, logprobs=0)
    plain = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=4)
    assert answered.choices[0].text == PROMPTS[2] + plain.choices[0].text
    assert answered.choices[0].logprobs.tokens[: len(prompted)] == choice.logprobs.tokens
    assert len(answered.choices[0].logprobs.tokens) == len(prompted) + 4
    streamed = list(
        client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=4, echo=True, logprobs=0, stream=True)
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == answered.choices[0].text
    assert [t for chunk in streamed if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens] == (
        answered.choices[0].logprobs.tokens
    )


def test_several_choices_whole_and_streamed(client, name, reference) -> None:
    """``n``: a seeded request's choice i is ``model.generate``'s after ``manual_seed(seed + i)``; streamed, each
    choice's chunks (by index) join to it."""
    messages = chat(PROMPTS[0])
    whole = client.chat.completions.create(model=name, messages=messages, temperature=0.9, seed=3, n=3)
    texts = [choice.message.content for choice in sorted(whole.choices, key=lambda choice: choice.index)]
    assert texts == [reference({"messages": messages}, seed=3 + i, temperature=0.9) for i in range(3)]
    assert whole.usage.completion_tokens == 3 * MAX_TOKENS
    streamed = client.chat.completions.create(
        model=name, messages=messages, temperature=0.9, seed=3, n=3, stream=True, stream_options={"include_usage": True}
    )
    joined, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in streamed:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            joined[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert joined == texts and finishes == ["length"] * 3 and usage.completion_tokens == 3 * MAX_TOKENS
    greedy = client.completions.create(model=name, prompt=PROMPTS[1], temperature=0, max_tokens=5, n=2)
    assert [choice.index for choice in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text


def test_a_prediction_is_verified_and_counted(client, name) -> None:
    expected = client.chat.completions.create(model=name, messages=chat(PROMPTS[0]), temperature=0, max_tokens=48)
    predicted = client.chat.completions.create(
        model=name,
        messages=chat(PROMPTS[0]),
        temperature=0,
        max_tokens=48,
        prediction={"type": "content", "content": expected.choices[0].message.content},
    )
    assert predicted.choices[0].message.content == expected.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0


def test_concurrent_clients_each_get_their_own_answer(client, name, reference) -> None:
    prompts = [f"{PROMPTS[n % 4]} {n}" for n in range(16)]

    def ask(prompt: str) -> str:
        return (
            client.chat.completions.create(model=name, messages=chat(prompt), temperature=0).choices[0].message.content
        )

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts, timeout=300))
    assert answers == [reference({"messages": chat(prompt)}) for prompt in prompts]


def test_vllms_structured_outputs_name_their_field_and_a_prompt_is_cut(client, name) -> None:
    with pytest.raises(openai.BadRequestError, match='"guided_grammar": this model.s tokenizer is not one llguidance'):
        client.chat.completions.create(  # (a tiny model's Metaspace tokenizer; a real one's: tests/e2e/test_guided.py)
            model=name, messages=chat("hi"), extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}
        )
    cut = client.completions.create(
        model=name, prompt=PROMPTS[1], max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": 2}
    )
    assert cut.usage.prompt_tokens == 2


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": chat("hi"), "n": 0}, "n"),
        ({"messages": chat("hi"), "top_logprobs": 2}, "top_logprobs"),
        ({"messages": chat("hi"), "echo": True}, "echo"),
        ({"messages": chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": chat("hi"), "max_token": 5}, "max_token"),
        ({"messages": chat("hi"), "temperature": -1}, "temperature"),
        ({"messages": chat("hi"), "prediction": {"type": "file", "content": "x"}}, "prediction"),
        ({"messages": chat("hi"), "model": "gpt-4o"}, "model"),
        ({"messages": chat("hi"), "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": chat("word " * 600)}, "messages"),
        ({"messages": chat("hi"), "logit_bias": {"5": 1, "100000": 2}}, "logit_bias"),
        ({"messages": chat("hi"), "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"messages": chat("hi"), "guided_grammar": "start: (("}, "guided_grammar"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field_and_the_server_goes_on(server, body, param) -> None:
    status, answer = post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert post(server, "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode())[0] == 200


def test_a_body_that_is_not_json_is_a_400(server) -> None:
    status, answer = post(server, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not JSON" in answer["error"]["message"]


def test_models_and_health(client, name, server) -> None:
    assert [model.id for model in client.models.list()] == [health(server)["model"]]
    assert {"in_flight", "answered", "cancelled", "tokens"} <= set(health(server))


def test_a_client_that_goes_away_frees_its_row(server) -> None:
    before = health(server)
    body = json.dumps({"prompt": "go on and on", "max_tokens": 400, "stream": True}).encode()
    request = urllib.request.Request(f"{server}/v1/completions", body, {"Content-Type": "application/json"})
    answer = urllib.request.urlopen(request, timeout=60)
    assert answer.readline().startswith(b"data: ")  # (it is decoding)
    answer.close()  # the client goes away
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        health(server)["cancelled"] > before["cancelled"] and health(server)["in_flight"] == 0
    ):
        time.sleep(0.2)
    now = health(server)
    assert now["cancelled"] == before["cancelled"] + 1 and now["in_flight"] == 0
    assert now["tokens"] - before["tokens"] < 400


def test_an_api_key_and_a_memory_budget_when_set_and_sigterm_stops_the_server(model_folder) -> None:
    process, url = start_server(model_folder, "--api-key", "sesame", "--max-batch", "2", "--max-memory", "100KB")
    try:
        refused = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            refused.completions.create(model=model_folder.name, prompt="hi", max_tokens=2)
        allowed = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=60)
        assert (
            allowed.completions.create(model=model_folder.name, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        )
        assert health(url)["status"] == "ok"  # (the health route needs no key)
        memory = health(url)["memory"]  # (the tiny model: 256 bytes of keys and values a token)
        assert memory["budget_bytes"] == 100_000 and memory["tokens"] == 390 and memory["resident_bytes"] > 0
        with pytest.raises(openai.BadRequestError, match="memory budget") as error:  # (a row of over 390 tokens)
            allowed.completions.create(model=model_folder.name, prompt="hi", max_tokens=400)
        assert error.value.body["param"] == "max_tokens"
    finally:
        code, stderr = stop(process)
    assert code in (0, -signal.SIGTERM) and "stopped" in stderr


def test_each_request_names_its_adapter_among_those_served(model_folder, tmp_path) -> None:
    """``--adapter one=DIR --adapter DIR2``: the models route lists the model and both adapters; a completion
    naming an adapter answers as the PEFT model with that adapter active (and says it in ``model``), one naming the
    model as the model without adapters."""
    peft = pytest.importorskip("peft", reason="adapters need peft: pip install 'specula[peft]'")
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32, tune_layout=False)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    adapted = peft.get_peft_model(model, config, adapter_name="first")
    torch.manual_seed(2)
    adapted.add_adapter("second", config)
    adapted.save_pretrained(tmp_path)  # (a folder each)
    prompt = "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3"
    ids = encode(tokenizer, {"prompt": prompt})
    expected = {}
    for served, adapter in (("one", "first"), ("second", "second"), (model_folder.name, None)):
        adapted.set_adapter(adapter or "first")
        with adapted.disable_adapter() if adapter is None else contextlib.nullcontext():
            out = adapted.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected[served] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert len(set(expected.values())) == 3
    process, url = start_server(
        model_folder, "--adapter", f"one={tmp_path / 'first'}", "--adapter", str(tmp_path / "second")
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [entry.id for entry in client.models.list().data] == [model_folder.name, "one", "second"]
        for served, text in expected.items():
            answer = client.completions.create(model=served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert (answer.choices[0].text, answer.model) == (text, served)
    finally:
        stop(process)
