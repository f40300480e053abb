"""Request lines as users write them: OpenAI's request fields checked (every field specula cannot honour named on its
line), OpenAI Batch API files recognised by their shape and answered with Batch API output lines, in input order,
resumable; a bad line answered with the Batch API's error object; a file mixing the shapes refused before the model
loads."""

from __future__ import annotations

import json
import re

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from tiny_models import tiny_model, tiny_tokenizer

from specula import cli
from specula.hf import loading
from specula.jobs.decode import Answerer, Settings
from specula.jobs.requests import BadRequest, Request, Shape, file_shape, model_name, parse_request

PROMPT = "the quick brown fox jumps over the lazy dog the quick brown fox"
NEW = 10


def chat(text: str = PROMPT, **fields) -> dict:
    return {"messages": [{"role": "user", "content": text}], **fields}


def batch_line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"n": 0}, '"n" must be a whole number >= 1'),
        ({"n": 129}, '"n" must be at most 128, got 129'),
        ({"best_of": 2}, '"best_of": 2 cannot be honoured: specula ranks no answers'),
        ({"logprobs": 2}, '"logprobs" must be true or false, got 2'),
        ({"top_logprobs": 3}, '"top_logprobs" needs "logprobs": true'),
        ({"logprobs": True, "top_logprobs": 21}, '"top_logprobs" must be at most 20, got 21'),
        ({"logprobs": True, "top_logprobs": -1}, '"top_logprobs" must be a whole number >= 0'),
        ({"functions": [{"name": "f"}]}, '"functions": .* cannot be honoured: OpenAI\'s older shape of "tools"'),
        ({"tool_choice": "required"}, '"tool_choice": "required" needs "tools"'),
        ({"response_format": {"type": "xml"}}, '"response_format" must be {"type": one of text, json_object'),
        ({"response_format": {"type": "json_schema"}}, '"response_format": a json_schema one needs "json_schema"'),
        ({"stream": True}, '"stream": true cannot be honoured: a file'),
        ({"frequency_penalty": 2.5}, '"frequency_penalty" must be a number from -2 to 2 \\(0: none\\), got 2.5'),
        ({"presence_penalty": "high"}, '"presence_penalty" must be a number from -2 to 2'),
        ({"logit_bias": {"the": 5}}, '"logit_bias" must map token ids \\(as strings\\) to numbers'),
        ({"logit_bias": {"5": 101}}, '"logit_bias" values must be numbers from -100 to 100'),
        ({"echo": True}, '"echo" is a text completion\'s field'),
        ({"echo": "yes"}, '"echo" must be true or false'),
        ({"temperature": -1}, '"temperature" must be a number >= 0'),
        ({"temperature": "hot"}, '"temperature" must be a number'),
        ({"top_p": 0}, r'"top_p" must be a number in \(0, 1\]'),
        ({"top_p": 1.5}, r'"top_p" must be a number in \(0, 1\]'),
        ({"top_k": -2}, '"top_k" must be a whole number >= -1'),
        ({"max_tokens": 0}, '"max_tokens" must be a whole number >= 1'),
        ({"max_tokens": "10"}, '"max_tokens" must be a whole number >= 1 \\(0 only with "echo"\\), got "10"'),
        ({"max_completion_tokens": 2.5}, '"max_completion_tokens" must be a whole number'),
        (
            {"max_tokens": 5, "max_completion_tokens": 6},
            '"max_tokens" \\(5\\) and "max_completion_tokens" \\(6\\) differ',
        ),
        ({"min_tokens": 8, "max_tokens": 4}, '"min_tokens" \\(8\\) is more than "max_tokens" \\(4\\)'),
        ({"min_tokens": -1}, '"min_tokens" must be a whole number >= 0'),
        ({"seed": 1.5}, '"seed" must be a whole number'),
        ({"seed": 2**64}, '"seed" must be less than 2\\*\\*64'),
        ({"stop": ["a", 1]}, '"stop" must be a non-empty string or a list'),
        ({"stop": [""]}, '"stop" must be a non-empty string or a list'),
        ({"stop": 5}, '"stop" must be a non-empty string or a list'),
        ({"repetition_penalty": 0}, '"repetition_penalty" must be a number > 0'),
        ({"model": "gpt-4o"}, "\"model\" is 'gpt-4o', but the loaded model is 'SmolLM2-135M-Instruct'"),
        ({"model": 3}, '"model" must be a string'),
        ({"prediction": {"type": "content"}}, '"prediction": a prediction given as an object'),
        ({"messages": []}, '"messages" must be a non-empty list'),
        ({"messages": [{"role": "user", "content": None}]}, '"messages"\\[0\\] must have a "content": text'),
        ({"messages": [{"content": "hi"}]}, '"messages"\\[0\\] must be an object with a "role"'),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]},
            '"messages"\\[1\\]: unknown role "wizard"; OpenAI\'s roles are system, developer, user, assistant',
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            '"messages"\\[0\\]: specula reads text only',
        ),
    ],
)
@pytest.mark.parametrize("shape", ["own", "batch"])
def test_a_field_specula_cannot_honour_makes_a_bad_line_naming_it(fields, problem, shape) -> None:
    data = chat(**fields) if shape == "own" else batch_line("r1", chat(**fields))
    request = parse_request(data, 3, model_name(None), where="in.jsonl:3")
    assert isinstance(request, BadRequest)
    assert re.match(f"in.jsonl:3: (body: )?{problem}", str(request)), str(request)
    assert request.shape is (Shape.BATCH_API if shape == "batch" else Shape.OWN)
    assert request.id == ("r1" if shape == "batch" else None)


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"messages": chat()["messages"], "max_token": 5}, 'unknown field "max_token": did you mean "max_tokens"\\?'),
        ({"prompt": "x", "temprature": 0.5}, 'unknown field "temprature": did you mean "temperature"\\?'),
        (batch_line("a", chat(foo=1)), 'body: unknown field "foo" for /v1/chat/completions'),
        (batch_line("a", chat(mirostat=0.1)), 'body: unknown field "mirostat"'),
        (batch_line("a", {"prompt": "x", "logprobs": 6}, "/v1/completions"), '"logprobs" must be at most 5'),
        (batch_line("a", {"prompt": "x", "logprobs": True}, "/v1/completions"), '"logprobs" must be a whole'),
        (batch_line("a", {"prompt": "x", "top_logprobs": 2}, "/v1/completions"), '"top_logprobs" is a chat'),
        (batch_line("a", {"prompt": "x", "messages": []}, "/v1/completions"), 'body: unknown field "messages"'),
        (batch_line("a", {"messages": []}, "/v1/completions"), 'a /v1/completions body needs "prompt"'),
        (batch_line("a", chat(), "/v1/embeddings"), '"url" must be one of /v1/chat/completions, /v1/completions'),
        ({**batch_line("a", chat()), "method": "GET"}, '"method" must be "POST"'),
        ({"custom_id": "a", "url": "/v1/completions", "body": {}}, "an OpenAI Batch API line needs .* lacks method"),
        (batch_line("", chat()), '"custom_id" must be a non-empty string'),
        (batch_line("a", "text"), '"body" must be a JSON object'),
        (batch_line("a", {"prompt": ["a", "b"]}, "/v1/completions"), '"prompt" must be a string'),
        ([1, 2], 'each line must be a JSON object with "messages"'),
        ({"text": "x"}, 'each line must be a JSON object with "messages"'),
    ],
)
def test_a_line_that_is_not_a_request_says_why(data, problem) -> None:
    request = parse_request(data, 1)
    assert isinstance(request, BadRequest) and re.match(problem, str(request)), str(request)


def test_what_a_line_may_carry() -> None:
    """Fields at their defaults, fields that change no answer, a user's own data (a workload's reference), the
    loaded model by any of its names; settings normalised."""
    fine = chat(
        n=1,
        logprobs=False,
        stream=False,
        tool_choice="auto",
        response_format={"type": "text"},
        user="u",
        metadata={"a": "b"},
        store=False,
        frequency_penalty=0,
        temperature=None,
        stop="\n\n",
        top_k=-1,
        max_completion_tokens=7,
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
    for data in (fine, {**fine, "reference": "x", "source": "y", "workload": "z", "category": "w"}):
        request = parse_request(data, 2, model_name(None))
        assert isinstance(request, Request) and not request.batch and request.id == 2
        assert request.options == {"stop": ["\n\n"], "top_k": -1, "max_tokens": 7}
    request = parse_request(
        batch_line("q", {"prompt": "x", "seed": 3, "model": "my-model"}, "/v1/completions"),
        5,
        model_name("/models/my-model"),
    )
    assert isinstance(request, Request) and request.batch and request.id == "q" and request.prompt == "x"
    assert request.options == {"seed": 3} and request.model == "my-model"
    asked = [  # (log probabilities: how many alternatives each token lists, whichever way a line asks)
        parse_request(line, 1).options
        for line in (
            chat(logprobs=True),
            chat(logprobs=True, top_logprobs=4),
            chat(logprobs=False, top_logprobs=0),
            batch_line("c", chat(logprobs=True, top_logprobs=20)),
            batch_line("t", {"prompt": "x", "logprobs": 5}, "/v1/completions"),
            batch_line("t", {"prompt": "x", "logprobs": 0}, "/v1/completions"),
        )
    ]
    assert asked == [{"logprobs": 0}, {"logprobs": 4}, {}, {"logprobs": 20}, {"logprobs": 5}, {"logprobs": 0}]
    echoed = [  # (echo: a text completion's; none new only with it)
        parse_request(batch_line("t", {"prompt": "x", "echo": True, "max_tokens": 0}, "/v1/completions"), 1),
        parse_request({"prompt": "x", "echo": False}, 1),
        parse_request(batch_line("t", {"prompt": "x", "max_tokens": 0}, "/v1/completions"), 1),
    ]
    assert echoed[0].options == {"echo": True, "max_tokens": 0} and echoed[1].options == {}
    assert '"max_tokens" must be a whole number >= 1 (0 only with "echo")' in str(echoed[2])
    assert model_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    parts = parse_request(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "hi", "name": "ann"},
            ]
        },
        1,
    )
    assert parts.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi", "name": "ann"},
    ]
    one = parse_request(batch_line("a", {"prompt": ["just one"]}, "/v1/completions"), 1)
    assert isinstance(one, Request) and one.prompt == "just one"
    two = parse_request(batch_line("a", {"prompt": ["one", "two"]}, "/v1/completions"), 1)
    assert isinstance(two, BadRequest) and "one prompt per line" in str(two)


def test_a_chat_its_template_refuses_is_skipped_with_the_templates_reason() -> None:
    """A chat template that raises (roles out of order, as many do) skips that request only, saying why."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools "
        "here') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    skipped = []
    answerer = Answerer(
        tiny_model("llama"),
        tokenizer,
        None,
        Settings(max_new_tokens=3, batch_size=2),
        on_skip=lambda request, reason: skipped.append((request.id, reason)),
    )
    lines = [chat("hello", id="fine"), {"id": "tool", "messages": [{"role": "tool", "content": "42"}]}]
    answers = list(answerer([parse_request(line, n) for n, line in enumerate(lines, 1)]))
    assert [answer["id"] for _, answer in answers] == ["fine"] and skipped == [("tool", "no tools here")]


def test_a_file_mixing_the_shapes_is_an_error_before_the_model_loads(tmp_path, no_model_loading) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(batch_line("a", chat())) + "\nnot JSON\n" + json.dumps(chat()) + "\n")
    with pytest.raises(
        ValueError, match="mixes OpenAI Batch API lines \\(line 1\\) with specula's own request lines \\(line 3\\)"
    ):
        file_shape(path)
    with pytest.raises(SystemExit, match="error: --input .*in.jsonl mixes"):
        cli.main(["generate", "--input", str(path), "--output", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()
    path.write_text(json.dumps(batch_line("a", chat())) + "\n" + json.dumps({"custom_id": "b"}) + "\n")
    assert file_shape(path) is Shape.BATCH_API


@pytest.fixture
def batch_file(model_folder, tmp_path):
    """A Batch API file: chat and text completions, one with a prediction and its own settings, bad lines of every
    kind in between, one request whose prompt the model cannot take (found only once it is loaded)."""
    model, tokenizer = loading.load_model(model_folder, dtype=torch.float32)
    lines = [
        json.dumps(batch_line("chat", chat(max_tokens=NEW, model=model_folder.name, logprobs=True, top_logprobs=2))),
        json.dumps(
            batch_line("text", {"prompt": PROMPT, "max_completion_tokens": NEW, "logprobs": 3}, "/v1/completions")
        ),
        "not JSON",
        json.dumps(batch_line("n0", chat(n=0))),
        json.dumps(
            batch_line(
                "predicted",
                {
                    "prompt": PROMPT,
                    "max_tokens": NEW,
                    "prediction": {"type": "content", "content": "lazy dog " * 4},
                    "temperature": 0.7,
                    "seed": 3,
                },
                "/v1/completions",
            )
        ),
        json.dumps(batch_line("long", {"prompt": "word " * 600}, "/v1/completions")),
        json.dumps(batch_line("chat", chat())),  # (its custom_id is line 1's)
        json.dumps(batch_line("other-model", chat(model="gpt-4o"))),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "in.jsonl", tokenizer


def run(model_folder, path, output, *more) -> None:
    cli.main(
        [
            str(arg)
            for arg in [
                "generate",
                "--input",
                path,
                "--output",
                output,
                "--model",
                model_folder,
                "--dtype",
                "fp32",
                "--max-new-tokens",
                4,
                "--temperature",
                0,
                *more,
            ]
        ]
    )


def test_a_batch_api_file_is_answered_in_the_batch_api_shape(model_folder, batch_file, tmp_path, capsys) -> None:
    path, tokenizer = batch_file
    run(model_folder, path, tmp_path / "out.jsonl", "--batch-size", 3)
    err = capsys.readouterr().err
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in out] == ["chat", "text", None, "n0", "predicted", "long", None, "other-model"]
    assert all(
        set(line) == {"id", "custom_id", "response", "error"} and line["id"].startswith("batch_req_") for line in out
    )
    answered = {line["custom_id"]: line for line in out if line["error"] is None}
    assert set(answered) == {"chat", "text", "predicted"}
    for name, line in answered.items():
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        body = line["response"]["body"]
        parsed = (ChatCompletion if name == "chat" else Completion).model_validate(body)
        assert parsed.model == model_folder.name and len(parsed.choices) == 1
        assert parsed.usage.completion_tokens == body["specula"]["new_tokens"] == NEW
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + NEW and parsed.usage.prompt_tokens > 0
        assert parsed.choices[0].finish_reason == "length"
        listed = parsed.choices[0].logprobs
        if name == "chat":  # (asked: each token's, with its position's two likeliest)
            assert len(listed.content) == NEW and all(len(entry.top_logprobs) == 2 for entry in listed.content)
        elif name == "text":
            assert len(listed.tokens) == len(listed.token_logprobs) == len(listed.text_offset) == NEW
            assert all(len(top) <= 3 for top in listed.top_logprobs) and listed.text_offset[0] == 0
        else:
            assert listed is None
        details = parsed.usage.completion_tokens_details
        if name == "predicted":
            assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        else:
            assert details is None
    # the same requests in specula's own shape give the same texts
    own = [
        {"id": "chat", **chat(max_tokens=NEW)},
        {"id": "text", "prompt": PROMPT, "max_tokens": NEW},
        {"id": "predicted", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0.7, "seed": 3},
    ]
    (tmp_path / "own.jsonl").write_text("".join(json.dumps(line) + "\n" for line in own))
    run(model_folder, tmp_path / "own.jsonl", tmp_path / "own_out.jsonl")
    texts = {
        line["id"]: line["text"] for line in map(json.loads, (tmp_path / "own_out.jsonl").read_text().splitlines())
    }
    assert answered["chat"]["response"]["body"]["choices"][0]["message"] == {
        "role": "assistant",
        "content": texts["chat"],
    }
    assert answered["text"]["response"]["body"]["choices"][0]["text"] == texts["text"]
    assert answered["predicted"]["response"]["body"]["choices"][0]["text"] == texts["predicted"]
    errors = {index: line["error"] for index, line in enumerate(out) if line["error"] is not None}
    assert all(error["code"] == "invalid_request" and out[index]["response"] is None for index, error in errors.items())
    assert "not JSON" in errors[2]["message"] and '"n" must be a whole number >= 1' in errors[3]["message"]
    assert (
        "the model accepts at most 512 positions" in errors[5]["message"]
        and 'custom_id "chat" is line 1\'s too' in errors[6]["message"]
    )
    assert "'gpt-4o', but the loaded model is" in errors[7]["message"]
    assert "5 skipped" in err and "3 requests" in err


def test_a_stopped_batch_api_run_resumes_without_answering_anything_twice(
    model_folder, batch_file, tmp_path, capsys
) -> None:
    """The output of a run stopped after its third line (the next one torn): --resume writes the rest, each custom_id
    once, in the shape of an uninterrupted run (an error line for a line without a custom_id of its own is written
    again: nothing in the output says which line it answered)."""
    path, _ = batch_file
    run(model_folder, path, tmp_path / "whole.jsonl")
    whole = (tmp_path / "whole.jsonl").read_text().splitlines()
    (tmp_path / "out.jsonl").write_text("\n".join(whole[:3]) + "\n" + whole[3][:20])
    run(model_folder, path, tmp_path / "out.jsonl", "--resume")
    resumed = [
        json.loads(line)
        for line in (tmp_path / "out.jsonl").read_text().splitlines()
        if json.loads(line)["custom_id"] is not None
    ]
    whole = [line for line in map(json.loads, whole) if line["custom_id"] is not None]
    assert [line["custom_id"] for line in resumed] == [line["custom_id"] for line in whole]
    for got, line in zip(resumed, whole):
        assert (got["error"] is None) == (line["error"] is None)
        if got["error"] is None:
            assert got["response"]["body"]["choices"] == line["response"]["body"]["choices"]
    assert "1 requests" in capsys.readouterr().err.splitlines()[-1]  # (the resumed run answered one: "predicted")


def test_strict_stops_at_a_batch_api_files_first_bad_line(model_folder, batch_file, tmp_path, no_model_loading) -> None:
    path, _ = batch_file
    with pytest.raises(SystemExit, match="in.jsonl:3: not JSON .*--strict"):
        run(model_folder, path, tmp_path / "out.jsonl", "--strict")
    assert not (tmp_path / "out.jsonl").exists()


def test_ray_workers_answer_a_batch_api_file_as_a_local_run_does(model_folder, batch_file, tmp_path, capsys) -> None:
    ray = pytest.importorskip("ray")
    path, _ = batch_file
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        run(model_folder, path, tmp_path / "ray.jsonl", "--ray")
    finally:
        ray.shutdown()
    run(model_folder, path, tmp_path / "local.jsonl")
    distributed, local = (
        [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        for name in ("ray.jsonl", "local.jsonl")
    )
    assert [line["custom_id"] for line in distributed] == [line["custom_id"] for line in local]
    for got, line in zip(distributed, local):
        assert got["error"] == line["error"] or got["error"]["message"] == line["error"]["message"]
        if line["error"] is None:  # (log probabilities of the same tokens, from passes of other batches: fp32 rounding)
            assert alike(got["response"]["body"]["choices"], line["response"]["body"]["choices"])


def alike(one: object, other: object) -> bool:
    """Equal JSON values, but for floats within 1e-4 of each other."""
    if isinstance(one, float) or isinstance(other, float):
        return abs(one - other) <= 1e-4
    if isinstance(one, dict) and isinstance(other, dict):
        return one.keys() == other.keys() and all(alike(one[key], other[key]) for key in one)
    if isinstance(one, list) and isinstance(other, list):
        return len(one) == len(other) and all(map(alike, one, other))
    return one == other
