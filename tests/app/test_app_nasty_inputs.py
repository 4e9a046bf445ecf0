"""The nasty-input matrix: every input that once gave a 500 or was silently coerced gets a 400 in our shape,
naming the field; nothing reaches the engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.app.fake_engine import FakeEngine
from tests.app.support import CHAT, COMPLETIONS, ERROR_KEYS, MODEL, make_app, running

RESPONSES = "/v1/responses"
MESSAGES_ROUTE = "/v1/messages"

SURROGATE = "\ud800"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **fields}


def response(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", **fields}


def image(url: Any, **extra: Any) -> dict[str, Any]:
    """A chat with one image part (the app's model reads no images)."""
    part = {"type": "image_url", "image_url": {"url": url, **extra}}
    return chat(messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}])


def input_image(**part: Any) -> dict[str, Any]:
    content = [{"type": "input_text", "text": "what?"}, {"type": "input_image", **part}]
    return response(input=[{"role": "user", "content": content}])


def thought(text: Any) -> list[dict[str, Any]]:
    """A reasoning item given back, with the answer it led to."""
    item = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    return [{"role": "user", "content": "hi"}, item, {"role": "assistant", "content": "ok"}]


CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # lone surrogates, wherever a string goes
    ("chat content", CHAT, chat(messages=[{"role": "user", "content": f"a{SURROGATE}b"}]), "messages.0.content"),
    (
        "text part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
        "messages.0.content",
    ),
    ("model", CHAT, chat(model=SURROGATE), "model"),
    ("stop", CHAT, chat(stop=[SURROGATE]), "stop"),
    ("user", CHAT, chat(user=SURROGATE), "user"),
    ("role", CHAT, chat(messages=[{"role": SURROGATE, "content": "hi"}]), "messages.0.role"),
    ("name", CHAT, chat(messages=[{"role": "user", "content": "hi", "name": SURROGATE}]), "messages.0.name"),
    ("metadata key", CHAT, chat(metadata={SURROGATE: "x"}), "metadata"),
    ("logit_bias key", CHAT, chat(logit_bias={SURROGATE: 1}), "logit_bias"),
    ("stream_options key", CHAT, chat(stream=True, stream_options={SURROGATE: True}), "stream_options"),
    ("prompt", COMPLETIONS, completion(prompt=SURROGATE), "prompt"),
    ("prompt list", COMPLETIONS, completion(prompt=["ok", SURROGATE]), "prompt"),
    # logit_bias keys: ASCII token ids within the vocabulary
    ("superscript two", CHAT, chat(logit_bias={"²": 1}), "logit_bias"),
    ("double minus", CHAT, chat(logit_bias={"--5": 1}), "logit_bias"),
    ("arabic-indic three", CHAT, chat(logit_bias={"٣": 1}), "logit_bias"),
    ("negative id", CHAT, chat(logit_bias={"-5": 1}), "logit_bias"),
    ("beyond vocabulary", CHAT, chat(logit_bias={"99999999": 1}), "logit_bias"),
    ("thousands of digits", CHAT, chat(logit_bias={"9" * 5000: 1}), "logit_bias"),
    ("bias not finite", CHAT, chat(logit_bias={"5": float("inf")}), "logit_bias"),
    # token ids before any decode
    ("echo below 0", COMPLETIONS, completion(prompt=[-1], echo=True), "prompt"),
    ("echo at 2**32", COMPLETIONS, completion(prompt=[2**32], echo=True), "prompt"),
    ("echo at 2**70", COMPLETIONS, completion(prompt=[[5, 2**70]], echo=True), "prompt"),
    ("ids beyond vocabulary", COMPLETIONS, completion(prompt=[10**9]), "prompt"),
    # bounds that reach torch
    ("top_k 2**63", CHAT, chat(top_k=2**63), "top_k"),
    ("top_k beyond vocabulary", COMPLETIONS, completion(top_k=10**7), "top_k"),
    ("seed 2**64", CHAT, chat(seed=2**64), "seed"),
    ("n 2**64", CHAT, chat(n=2**64), "n"),
    ("max_completion_tokens 2**64", CHAT, chat(max_completion_tokens=2**64), "max_completion_tokens"),
    ("temperature NaN", CHAT, chat(temperature=float("nan")), "temperature"),
    ("top_p Infinity", COMPLETIONS, completion(top_p=float("inf")), "top_p"),
    # no coercion into integers or booleans
    ("n string", CHAT, chat(n="2"), "n"),
    ("n bool", CHAT, chat(n=True), "n"),
    ("n float", CHAT, chat(n=2.0), "n"),
    ("max_tokens string", CHAT, chat(max_tokens="4"), "max_tokens"),
    ("max_tokens float", COMPLETIONS, completion(max_tokens=4.0), "max_tokens"),
    ("stream string", CHAT, chat(stream="yes"), "stream"),
    ("stream int", COMPLETIONS, completion(stream=1), "stream"),
    ("seed string", CHAT, chat(seed="7"), "seed"),
    ("temperature string", CHAT, chat(temperature="0.5"), "temperature"),
    ("temperature bool", CHAT, chat(temperature=True), "temperature"),
    ("prompt of booleans", COMPLETIONS, completion(prompt=[False]), "prompt"),
    ("logprobs string", COMPLETIONS, completion(logprobs="1"), "logprobs"),
    ("echo int", COMPLETIONS, completion(echo=1), "echo"),
    ("chat logprobs int", CHAT, chat(logprobs=1), "logprobs"),
    ("top_k float", CHAT, chat(top_k=5.0), "top_k"),
    ("min_tokens string", COMPLETIONS, completion(min_tokens="1"), "min_tokens"),
    ("ignore_eos string", CHAT, chat(ignore_eos="true"), "ignore_eos"),
    ("best_of string", COMPLETIONS, completion(best_of="1"), "best_of"),
    ("top_logprobs bool", CHAT, chat(logprobs=True, top_logprobs=True), "top_logprobs"),
    ("include_usage int", CHAT, chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    ("token ids with a boolean", COMPLETIONS, completion(prompt=[[1, True]]), "prompt"),
    ("stop count", CHAT, chat(stop=[str(i) for i in range(65)]), "stop"),
    ("stop length", CHAT, chat(stop=["x" * 9000, "y" * 9000]), "stop"),
    ("one long stop", COMPLETIONS, completion(stop="z" * 20000), "stop"),
]
# The fields of reasoning models, images and structured outputs: run in one test (one app start for them all).
NEW_FIELD_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # the template's variables and the reasoning controls
    ("template kwargs a string", CHAT, chat(chat_template_kwargs="enable_thinking"), "chat_template_kwargs"),
    ("template kwargs a list", CHAT, chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    ("template kwargs surrogate key", CHAT, chat(chat_template_kwargs={SURROGATE: 1}), "chat_template_kwargs"),
    ("template kwargs surrogate value", CHAT, chat(chat_template_kwargs={"x": [SURROGATE]}), "chat_template_kwargs"),
    ("enable_thinking a string", CHAT, chat(chat_template_kwargs={"enable_thinking": "no"}), "chat_template_kwargs"),
    ("enable_thinking null", CHAT, chat(chat_template_kwargs={"enable_thinking": None}), "chat_template_kwargs"),
    ("thinking an int", CHAT, chat(chat_template_kwargs={"thinking": 0}), "chat_template_kwargs"),
    ("template kwargs messages", CHAT, chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    ("template kwargs tools", CHAT, chat(chat_template_kwargs={"tools": "x"}), "chat_template_kwargs"),
    (
        "template kwargs generation prompt",
        CHAT,
        chat(chat_template_kwargs={"add_generation_prompt": False}),
        "chat_template_kwargs",
    ),
    ("template kwargs effort", CHAT, chat(chat_template_kwargs={"reasoning_effort": 9}), "chat_template_kwargs"),
    ("reasoning_effort unknown", CHAT, chat(reasoning_effort="ultra"), "reasoning_effort"),
    ("reasoning_effort int", CHAT, chat(reasoning_effort=3), "reasoning_effort"),
    ("reasoning_effort surrogate", CHAT, chat(reasoning_effort=SURROGATE), "reasoning_effort"),
    ("include_reasoning string", CHAT, chat(include_reasoning="no"), "include_reasoning"),
    ("include_reasoning int", CHAT, chat(include_reasoning=0), "include_reasoning"),
    ("separate_reasoning string", CHAT, chat(separate_reasoning="false"), "separate_reasoning"),
    ("stream_reasoning null", CHAT, chat(stream_reasoning=None), "stream_reasoning"),
    # image parts (the app's model reads none: each is a 400 before any fetch)
    ("image url empty", CHAT, image(""), "messages"),
    ("image url a number", CHAT, image(7), "messages"),
    ("image url surrogate", CHAT, image(f"data:image/png;base64,{SURROGATE}"), "messages"),
    ("image url javascript", CHAT, image("javascript:alert(1)"), "messages"),
    ("image url file", CHAT, image("file:///etc/passwd"), "messages"),
    ("image url metadata host", CHAT, image("http://169.254.169.254/latest/meta-data/"), "messages"),
    ("image url loopback", CHAT, image("http://127.0.0.1:1/x.png"), "messages"),
    ("image data not base64", CHAT, image("data:image/png;base64,@@@"), "messages"),
    ("image data huge header", CHAT, image("data:" + "x" * 100_000 + ";base64,AAAA"), "messages"),
    ("image detail unknown", CHAT, image("data:image/png;base64,AAAA", detail="max"), "messages"),
    ("image url object extra", CHAT, image("data:image/png;base64,AAAA", format="png"), "messages"),
    ("image part without url", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    # the Responses API's reasoning and images
    ("responses reasoning a string", RESPONSES, response(reasoning="high"), "reasoning"),
    ("responses effort unknown", RESPONSES, response(reasoning={"effort": "ultra"}), "reasoning.effort"),
    ("responses effort surrogate", RESPONSES, response(reasoning={"effort": SURROGATE}), "reasoning.effort"),
    ("responses summary int", RESPONSES, response(reasoning={"summary": 1}), "reasoning.summary"),
    ("responses reasoning extra", RESPONSES, response(reasoning={"budget": 10**20}), "reasoning.budget"),
    ("responses thought surrogate", RESPONSES, response(input=thought(SURROGATE)), "input"),
    ("responses thought a number", RESPONSES, response(input=thought(5)), "input"),
    ("responses thought alone", RESPONSES, response(input=thought("hm")[1:2]), "input"),
    ("responses thought part type", RESPONSES, response(input=[{"type": "reasoning", "content": [{"x": 1}]}]), "input"),
    ("responses image file_id", RESPONSES, input_image(file_id="file-1"), "input"),
    ("responses image no url", RESPONSES, input_image(detail="auto"), "input"),
    ("responses image url a list", RESPONSES, input_image(image_url=["x"]), "input"),
    ("responses image url javascript", RESPONSES, input_image(image_url="javascript:alert(1)"), "input"),
    ("responses image metadata host", RESPONSES, input_image(image_url="http://169.254.169.254/"), "input"),
    ("responses image detail", RESPONSES, input_image(image_url="data:image/png;base64,AAAA", detail="x"), "input"),
    # structured outputs beyond JSON: shapes refused before any grammar is compiled
    ("choice empty", CHAT, chat(structured_outputs={"choice": []}), "structured_outputs.choice"),
    ("choice of numbers", COMPLETIONS, completion(structured_outputs={"choice": [1, 2]}), "structured_outputs.choice"),
    ("choice a string", CHAT, chat(structured_outputs={"choice": "yes"}), "structured_outputs.choice"),
    ("choice surrogate", CHAT, chat(structured_outputs={"choice": ["a", SURROGATE]}), "structured_outputs.choice"),
    ("choice null in list", CHAT, chat(guided_choice=["a", None]), "guided_choice"),
    ("guided_choice empty", COMPLETIONS, completion(guided_choice=[]), "guided_choice"),
    ("regex a number", CHAT, chat(structured_outputs={"regex": 5}), "structured_outputs.regex"),
    ("regex surrogate", COMPLETIONS, completion(regex=SURROGATE), "regex"),
    ("grammar a list", CHAT, chat(structured_outputs={"grammar": ["root ::= x"]}), "structured_outputs.grammar"),
    ("ebnf an object", COMPLETIONS, completion(ebnf={"root": "x"}), "ebnf"),
    ("json not JSON", CHAT, chat(structured_outputs={"json": "{nope"}), "structured_outputs.json"),
    ("json a list", CHAT, chat(guided_json=[1]), "guided_json"),
    ("json text of a list", COMPLETIONS, completion(json_schema="[1]"), "json_schema"),
    ("json_object a string", CHAT, chat(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
    ("structured_outputs unknown key", CHAT, chat(structured_outputs={"backend": "xgrammar"}), "structured_outputs"),
    ("structured_outputs a string", COMPLETIONS, completion(structured_outputs="regex"), "structured_outputs"),
    ("format regex without value", CHAT, chat(response_format={"type": "regex"}), "response_format"),
    ("format grammar with value", CHAT, chat(response_format={"type": "grammar", "value": "x"}), "response_format"),
    (
        "format regex a number",
        COMPLETIONS,
        completion(response_format={"type": "regex", "value": 1}),
        "response_format",
    ),
    ("format type unknown", COMPLETIONS, completion(response_format={"type": "ebnf"}), "response_format"),
    ("responses choice empty", RESPONSES, response(structured_outputs={"choice": []}), "structured_outputs.choice"),
    ("responses regex a list", RESPONSES, response(structured_outputs={"regex": ["a"]}), "structured_outputs.regex"),
]


def message(**fields: Any) -> dict[str, Any]:
    """An Anthropic Messages request."""
    return {"model": MODEL, "max_tokens": 8, "messages": MESSAGES, **fields}


def user_blocks(*blocks: Any) -> dict[str, Any]:
    return message(messages=[{"role": "user", "content": list(blocks)}])


def image_block(**source: Any) -> dict[str, Any]:
    return {"type": "image", "source": source}


def after_tool_use(result: Any, **call: Any) -> dict[str, Any]:
    """A tool use by the assistant, then `result` in the user's turn."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}, **call}
    return message(messages=[*MESSAGES, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}])


TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1"}
# /v1/messages: each gets a 400 in Anthropic's shape, nothing reaches the engine.
MESSAGES_CASES: list[tuple[str, dict[str, Any]]] = [
    ("surrogate content", message(messages=[{"role": "user", "content": SURROGATE}])),
    ("surrogate text block", user_blocks({"type": "text", "text": SURROGATE})),
    ("surrogate system", message(system=SURROGATE)),
    ("surrogate system block", message(system=[{"type": "text", "text": SURROGATE}])),
    ("surrogate stop sequence", message(stop_sequences=[SURROGATE])),
    ("surrogate model", message(model=SURROGATE)),
    ("surrogate user id", message(metadata={"user_id": SURROGATE})),
    ("surrogate tool name", message(tools=[{"name": SURROGATE, "input_schema": {}}])),
    ("surrogate tool result", after_tool_use({**TOOL_RESULT, "content": SURROGATE})),
    ("surrogate tool input key", after_tool_use({**TOOL_RESULT, "content": "ok"}, input={SURROGATE: 1})),
    ("max_tokens string", message(max_tokens="4")),
    ("max_tokens float", message(max_tokens=4.0)),
    ("max_tokens bool", message(max_tokens=True)),
    ("max_tokens 2**64", message(max_tokens=2**64)),
    ("stream string", message(stream="yes")),
    ("temperature string", message(temperature="0.5")),
    ("temperature NaN", message(temperature=float("nan"))),
    ("top_p Infinity", message(top_p=float("inf"))),
    ("top_k float", message(top_k=5.0)),
    ("top_k 2**63", message(top_k=2**63)),
    ("top_k beyond vocabulary", message(top_k=10**7)),
    ("stop count", message(stop_sequences=[str(i) for i in range(65)])),
    ("stop length", message(stop_sequences=["x" * 9000, "y" * 9000])),
    ("messages a string", message(messages="hi")),
    ("content a number", message(messages=[{"role": "user", "content": 5}])),
    ("role tool", message(messages=[{"role": "tool", "content": "hi"}])),
    ("block without type", user_blocks({"text": "hi"})),
    ("system block an image", message(system=[image_block(type="url", url="http://x/y.png")])),
    ("image on a text model", user_blocks(image_block(type="base64", media_type="image/png", data="AAAA"))),
    ("image data not base64", user_blocks(image_block(type="base64", media_type="image/png", data="@@@"))),
    ("image url javascript", user_blocks(image_block(type="url", url="javascript:alert(1)"))),
    ("image source unknown", user_blocks(image_block(type="file", file_id="f"))),
    ("tool result image", after_tool_use({**TOOL_RESULT, "content": [image_block(type="url", url="http://x")]})),
    ("tool result no id", after_tool_use({"type": "tool_result", "content": "ok"})),
    ("tool input a list", after_tool_use({**TOOL_RESULT, "content": "ok"}, input=[1])),
    ("tool_choice unknown", message(tool_choice={"type": "sometimes"})),
    ("tool_choice a string", message(tool_choice="auto")),
    ("tool_choice any without tools", message(tool_choice={"type": "any"})),
    ("tool schema a list", message(tools=[{"name": "f", "input_schema": [1]}])),
    ("duplicate tool names", message(tools=[{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}])),
    ("thinking a string", message(thinking="on")),
    ("thinking budget a string", message(thinking={"type": "enabled", "budget_tokens": "2000"})),
    ("thinking budget huge", message(thinking={"type": "enabled", "budget_tokens": 2**70})),
    ("output format a string", message(output_config={"format": "json"})),
    ("output effort unknown", message(output_config={"effort": "ultra"})),
    ("metadata extra key", message(metadata={"user": "x"})),
    ("service tier unknown", message(service_tier="priority")),
]


def assert_our_400(response: httpx.Response, param: str | None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert body["error"]["type"] == "invalid_request_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert (body["error"]["param"] or "").startswith(param), body
    return body["error"]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_nasty_input_gets_our_400_naming_the_field(
    client: httpx.AsyncClient, fake: FakeEngine, path: str, body: dict[str, Any], param: str
) -> None:
    # ensure_ascii: a lone surrogate travels as the escape "\ud800"; NaN and Infinity as Python's json writes them.
    raw = json.dumps(body).encode()
    response = await client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_our_400(response, param)
    assert fake.submitted == []


async def test_nasty_reasoning_and_image_fields_get_our_400(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    for name, path, body, param in NEW_FIELD_CASES:
        raw = json.dumps(body).encode()
        response = await client.post(path, content=raw, headers={"content-type": "application/json"})
        try:
            assert_our_400(response, param)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    assert fake.submitted == []


def assert_anthropic_400(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == "invalid_request_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


def deep_tool_input() -> bytes:
    """A tool use whose input is nested thousands deep."""
    body = json.dumps(after_tool_use({**TOOL_RESULT, "content": "ok"}))
    return body.replace('"input": {}', f'"input": {{"a": {nested(DEEP)}}}').encode()


async def test_nasty_messages_get_anthropics_400(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    """Each case on /v1/messages, and on count_tokens (without max_tokens) where it is not a generation field's."""
    cases = [
        (name, json.dumps(body).encode(), json.dumps({k: v for k, v in body.items() if k != "max_tokens"}).encode())
        for name, body in MESSAGES_CASES
    ]
    for name, raw, counted in [*cases, ("nested tool input", deep_tool_input(), deep_tool_input())]:
        for path, content in ((MESSAGES_ROUTE, raw), (MESSAGES_ROUTE + "/count_tokens", counted)):
            response = await client.post(path, content=content, headers={"content-type": "application/json"})
            if path.endswith("count_tokens") and response.status_code == 200:
                continue  # a generation field's case: count_tokens does not take it
            try:
                assert_anthropic_400(response)
            except AssertionError as exc:
                raise AssertionError(f"{name} ({path}): {exc}") from None
    assert fake.submitted == []


async def test_an_integer_python_will_not_read_gets_a_400(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    raw = json.dumps(chat()).replace("{", '{"seed": ' + "9" * 5000 + ", ", 1).encode()
    response = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert assert_our_400(response, None)["code"] == "invalid_body"
    assert fake.submitted == []


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
async def test_a_body_that_is_not_utf8_gets_a_400(client: httpx.AsyncClient, fake: FakeEngine, encoding: str) -> None:
    raw = json.dumps(chat()).encode(encoding)  # json.loads would have guessed the encoding and taken it
    response = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert assert_our_400(response, None)["code"] == "invalid_encoding"
    assert fake.submitted == []


async def test_a_vanishing_temperature_means_greedy(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    response = await client.post(CHAT, json=chat(temperature=1e-300, max_tokens=3))
    assert response.status_code == 200
    assert fake.submitted[0].params.temperature == 0.0 and fake.submitted[0].params.greedy


async def test_json_integers_are_valid_floats(client: httpx.AsyncClient, fake: FakeEngine) -> None:
    response = await client.post(CHAT, json=chat(temperature=1, top_p=1, max_tokens=3))
    assert response.status_code == 200
    assert fake.submitted[0].params.temperature == 1.0


async def test_a_refused_cors_preflight_answers_in_our_shape(fake: FakeEngine, hf_tokenizer: Any) -> None:
    app = make_app(fake, hf_tokenizer, allowed_origins=["https://good.example"])
    async with running(app) as client:
        headers = {"origin": "https://evil.example", "access-control-request-method": "POST"}
        refused = await client.options(CHAT, headers=headers)
        allowed = await client.options(CHAT, headers={**headers, "origin": "https://good.example"})
    error = assert_our_400(refused, None)
    assert error["code"] == "cors_rejected" and "origin" in error["message"]
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://good.example"


GET_ROUTES = ["/health", "/v1/models", "/models", "/metrics", f"/v1/models/{MODEL}", "/openapi.json"]


@pytest.mark.parametrize("path", GET_ROUTES)
async def test_head_works_on_every_get_route(client: httpx.AsyncClient, path: str) -> None:
    got, head = await client.get(path), await client.head(path)
    assert head.status_code == got.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


async def test_a_wrong_method_gets_405_in_our_shape_with_allow(client: httpx.AsyncClient) -> None:
    wrong = [("DELETE", CHAT, {"POST"}), ("PUT", "/health", {"GET", "HEAD"}), ("POST", "/v1/models", {"GET", "HEAD"})]
    for method, path, allowed in wrong:
        response = await client.request(method, path)
        assert response.status_code == 405, (method, path)
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and error["code"] == "method_not_allowed"
        assert set(response.headers["allow"].split(", ")) == allowed, response.headers["allow"]


DEEP = 3000  # Python's recursion limit is 1000


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep_arguments(stream: bool) -> bytes:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": nested(DEEP)}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    return json.dumps(chat(messages=messages, stream=stream)).encode()


def deep_body(field: str) -> bytes:
    return json.dumps(chat()).replace("{", f'{{"{field}": {nested(DEEP)}, ', 1).encode()


@pytest.mark.parametrize(
    "raw",
    [
        deep_arguments(stream=False),
        deep_arguments(stream=True),
        deep_body("metadata"),
        deep_body("tools"),
        deep_body("chat_template_kwargs"),
    ],
    ids=["tool-call arguments", "tool-call arguments, streamed", "a body field", "tools", "template variables"],
)
async def test_input_nested_thousands_deep_gets_a_400(client: httpx.AsyncClient, fake: FakeEngine, raw: bytes) -> None:
    response = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    error = assert_our_400(response, None)
    assert error["code"] == "nested_too_deeply" and "nested too deeply" in error["message"]
    assert fake.submitted == []
