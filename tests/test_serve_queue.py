"""``harness serve``'s app over a fake decoder that the test holds on an Event: response shapes,
every refusal (400, 404, 429, 500), a full queue, and a client that leaves mid-stream or while
queued, all deterministic (events and bounded waits, no sleeps). tests/test_serve.py runs the real
command on the tiny model."""
from __future__ import annotations

import json
import queue
import socket
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from core.errors import UserError  # noqa: E402
from harness.serve.app import create_app  # noqa: E402
from harness.serve.schemas import Limits  # noqa: E402
from harness.serve.worker import DecodeWorker, recorder  # noqa: E402
from serve_fakes import BOUND, FakeDecoder, ThreadServer  # noqa: E402

LIMIT = 32
CONTEXT = 200  # the server's --max-context


class TrackingWorker(DecodeWorker):
    """Hands the test every job the queue accepted, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepted: queue.Queue = queue.Queue()

    def submit(self, job) -> bool:
        ok = super().submit(job)
        if ok:
            self.accepted.put(job)
        return ok


class RefusingFake(FakeDecoder):
    """A message whose content is "<bad>" is refused by the chat template; the prompt [99] makes the
    decoder fail."""

    def encode_chat(self, messages):
        if any(m["content"] == "<bad>" for m in messages):
            raise UserError("cannot apply the chat template: content '<bad>'")
        return super().encode_chat(messages)

    def generate(self, prompt, *args, **kwargs):
        if prompt == [99]:
            raise RuntimeError("the fake's fault")
        return super().generate(prompt, *args, **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    fake = RefusingFake()
    record = tmp_path_factory.mktemp("serve") / "record.jsonl"
    worker = TrackingWorker(fake, queue_size=1, on_finished=recorder(record, fake), max_context=CONTEXT)
    limits = Limits(served_model_name="fake-model", default_max_tokens=4, max_new_tokens_limit=LIMIT, vocab_size=100)
    server = ThreadServer(create_app(fake, limits, worker))
    yield server, fake, worker, record
    fake.gate.set()
    server.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="x", max_retries=0, timeout=BOUND)


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=BOUND).json()


def drain(worker: TrackingWorker) -> None:
    while not worker.accepted.empty():
        worker.accepted.get_nowait()


def test_models_and_health(served, client):
    server, *_ = served
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    h = health(server)
    assert h["status"] == "ok" and h["model"] == "fake-model" and h["decoder"] == "fake" and h["capacity"] == 1


def test_completion_has_openai_shape_and_the_token_ids(served, client):
    _, fake, *_ = served
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=5)
    ids = fake.encode("abc")
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "fake-model"
    assert r.prompt_token_ids == ids
    assert r.choices[0].token_ids == fake.answer(ids, 5)
    assert r.choices[0].text == fake.text(fake.answer(ids, 5)) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)
    default = client.completions.create(model="fake-model", prompt=[5, 6], temperature=0)
    assert default.choices[0].token_ids == fake.answer([5, 6], 4)  # the server's default max_tokens


def test_chat_streams_deltas_with_the_token_ids(served, client):
    _, fake, *_ = served
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    ids = fake.encode_chat(messages)
    assert chunks[0].prompt_token_ids == ids and chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    tokens = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert tokens == fake.answer(ids, 6) and text == fake.text(tokens)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    whole = client.chat.completions.create(model="fake-model", messages=messages, max_completion_tokens=6)
    assert whole.object == "chat.completion" and whole.choices[0].message.content == text
    assert whole.choices[0].token_ids == tokens and whole.prompt_token_ids == ids


def test_the_stream_is_sse_framed_and_ends_with_done(served):
    server, *_ = served
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": [4], "max_tokens": 2, "stream": True},
                      timeout=BOUND) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-2]] == [None, None, None, "length"]


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [
    (COMPLETIONS, b'{"prompt": "a", ', "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", "body"),
    (COMPLETIONS, {"max_tokens": 3}, "prompt: required"),
    (CHAT, {"max_tokens": 3}, "messages: required"),
    (COMPLETIONS, {"prompt": 7}, "prompt: must be a string or a list of token ids"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt: must be a string or a list of token ids"),
    (COMPLETIONS, {"prompt": [1, 100]}, "outside the vocabulary"),
    (COMPLETIONS, {"prompt": [-1]}, "outside the vocabulary"),
    (COMPLETIONS, {"prompt": ""}, "empty"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "batched prompts are not supported"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens=0: must be between 1 and 32"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": LIMIT + 1}, "max-new-tokens-limit"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": "4"}, "max_tokens"),
    (COMPLETIONS, {"prompt": [10] * (CONTEXT - 20), "max_tokens": 21}, f"exceed this server's context of {CONTEXT}"),
    (COMPLETIONS, {"prompt": [10] * (CONTEXT - 20), "max_tokens": 20}, None),  # exactly the context
    (COMPLETIONS, {"prompt": "a", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "temperature": 0.7}, "sampling is not implemented"),
    (COMPLETIONS, {"prompt": "a", "top_p": 0.9}, "sampling is not implemented"),
    (COMPLETIONS, {"prompt": "a", "n": 2}, "one choice per request"),
    (COMPLETIONS, {"prompt": "a", "best_of": 3}, "one choice per request"),
    (COMPLETIONS, {"prompt": "a", "logprobs": 1}, "logprobs"),
    (COMPLETIONS, {"prompt": "a", "echo": True}, "echo"),
    (COMPLETIONS, {"prompt": "a", "stop": ["\n"]}, "stop sequences are not supported"),
    (COMPLETIONS, {"prompt": "a", "presence_penalty": 0.5}, "penalties"),
    (COMPLETIONS, {"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "a", "model": "gpt-4"}, "'gpt-4' is not served here: this server serves 'fake-model'"),
    (COMPLETIONS, {"prompt": "a", "mirostat": 1}, "mirostat: not a field this server knows"),
    (CHAT, {"messages": []}, "messages is empty"),
    (CHAT, {"messages": USER, "temperature": 1}, "sampling is not implemented"),
    (CHAT, {"messages": USER, "frequency_penalty": 1}, "penalties"),
    (CHAT, {"messages": USER, "logprobs": True}, "logprobs"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools are not supported"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, "only plain text"),
    (CHAT, {"messages": USER, "max_tokens": 2, "max_completion_tokens": 3}, "differ"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages.0.content: required"),
    (CHAT, {"messages": [{"role": "system"}, *USER]}, "messages.0.content: required"),
    (CHAT, {"messages": [*USER, {"role": "assistant"}]}, "messages.1.content: required"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": []}]}, "content is an empty list of parts"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, "text only"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages.0.role: required"),
    (CHAT, {"messages": [{"role": "bogus", "content": "hi"}]}, "role 'bogus' is not supported"),
    (CHAT, {"messages": [{"role": "User", "content": "hi"}]}, "role 'User' is not supported"),
    (CHAT, {"messages": [{"role": "developer", "content": "x"}, *USER]}, "send these instructions as a 'system'"),
    (CHAT, {"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages[1]: role 'tool' is not supported"),
    (CHAT, {"messages": [*USER, {"role": "function", "content": "x", "name": "f"}]}, "not supported"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": []}]}, "tool_calls"),
    (CHAT, {"messages": [{"role": "user", "content": "<bad>"}]}, "cannot apply the chat template"),
]


@pytest.mark.parametrize("path,body,says", BAD, ids=[str(i) for i in range(len(BAD))])
def test_what_the_server_cannot_honour_is_a_clear_400(served, path, body, says):
    server, *_ = served
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": {"max_tokens": 2, **body}}
    r = httpx.post(server.url + path, timeout=BOUND, **kwargs)
    if says is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and says in err["message"], err


@pytest.mark.parametrize("messages,says", [
    ([{"role": "user"}], "invalid request: messages.0.content: required"),
    ([{"role": "bogus", "content": "hi"}], "messages[0]: role 'bogus' is not supported: the role must be one of "
                                           "'system', 'user', 'assistant'"),
    ([], "messages is empty"),
], ids=["no-content", "unknown-role", "no-messages"])
def test_a_chat_message_the_template_cannot_take_is_400_in_openai_shape(served, messages, says):
    server, fake, *_ = served
    calls = len(fake.calls)
    r = httpx.post(server.url + CHAT, json={"messages": messages, "max_tokens": 2}, timeout=BOUND)
    assert r.status_code == 400, r.text
    # a missing field is pydantic's (no param), what the server cannot honour names its field
    param = None if "required" in says else "messages"
    assert r.json() == {"error": {"message": says, "type": "invalid_request_error", "param": param, "code": None}}
    assert len(fake.calls) == calls  # nothing was decoded


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}]},
     {"role": "user", "content": "Name a prime.", "name": "ann"},
     {"role": "assistant", "content": "2"}, {"role": "user", "content": ""}],
], ids=["system-user", "parts-name-assistant-empty"])
def test_a_system_user_assistant_conversation_is_answered(client, served, messages):
    _, fake, *_ = served
    r = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=3)
    templated = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                  "".join(p["text"] for p in m["content"])} for m in messages]
    ids = fake.encode_chat(templated)
    assert r.prompt_token_ids == ids and r.choices[0].token_ids == fake.answer(ids, 3)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"


def test_the_openai_client_gets_bad_request_for_sampling(client):
    with pytest.raises(openai.BadRequestError, match="sampling is not implemented"):
        client.completions.create(model="fake-model", prompt="a", max_tokens=2, temperature=0.8)


def test_unknown_route_is_404_in_openai_shape(served):
    server, *_ = served
    r = httpx.get(server.url + "/v1/engines", timeout=BOUND)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_full_queue_is_429_and_the_others_are_answered(served, client):
    server, fake, worker, _ = served
    before = health(server)["requests"]
    drain(worker)
    fake.gate.clear()
    fake.started.clear()
    answers = {}

    def ask(name, prompt):
        answers[name] = httpx.post(server.url + COMPLETIONS, json={"prompt": prompt, "max_tokens": 3}, timeout=BOUND)

    try:
        running = threading.Thread(target=ask, args=("running", [11]))
        running.start()
        worker.accepted.get(timeout=BOUND)
        assert fake.started.wait(BOUND)  # holds at the gate: the queue is empty again
        waiting = threading.Thread(target=ask, args=("waiting", [12]))
        waiting.start()
        worker.accepted.get(timeout=BOUND)  # in the queue's one place
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="fake-model", prompt=[13], max_tokens=3)
        assert refused.value.status_code == 429 and refused.value.body["code"] == "queue_full"
    finally:
        fake.gate.set()
    running.join(BOUND)
    waiting.join(BOUND)
    assert answers["running"].json()["choices"][0]["token_ids"] == fake.answer([11], 3)
    assert answers["waiting"].json()["choices"][0]["token_ids"] == fake.answer([12], 3)
    after = health(server)["requests"]
    assert after["rejected"] == before["rejected"] + 1 and after["finished"] == before["finished"] + 2


def test_a_client_dropped_mid_stream_cancels_its_decode(served, client):
    server, fake, worker, record = served
    before = health(server)["requests"]
    fake.gate.clear()
    fake.started.clear()
    try:
        stream = client.completions.create(model="fake-model", prompt=[21], max_tokens=LIMIT, stream=True)
        first = next(c for c in stream if c.choices[0].token_ids)  # the decode is held at the gate
        assert first.choices[0].token_ids == fake.answer([21], 1)
        stream.close()
        cancel = fake.calls[-1][1]
        assert cancel.wait(BOUND), "the server did not cancel the decode of a client that left"
    finally:
        fake.gate.set()
    after_drop = client.completions.create(model="fake-model", prompt=[22], max_tokens=3)  # decodes after the drop
    assert after_drop.choices[0].token_ids == fake.answer([22], 3)
    after = health(server)["requests"]
    assert after["cancelled"] == before["cancelled"] + 1 and after["finished"] == before["finished"] + 1
    recorded = [json.loads(line)["id"] for line in record.read_text().splitlines()]
    assert first.id not in recorded and after_drop.id in recorded


def test_a_client_that_leaves_while_queued_frees_its_place_and_is_never_decoded(served, client):
    server, fake, worker, _ = served
    before = health(server)["requests"]
    drain(worker)
    fake.gate.clear()
    fake.started.clear()
    answers = {}

    def ask(prompt):
        answers[prompt] = client.completions.create(model="fake-model", prompt=[prompt], max_tokens=2)

    try:
        holder = threading.Thread(target=ask, args=(31,))
        holder.start()
        worker.accepted.get(timeout=BOUND)
        assert fake.started.wait(BOUND)
        calls = len(fake.calls)
        body = json.dumps({"prompt": [32], "max_tokens": 2}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=BOUND) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            queued = worker.accepted.get(timeout=BOUND)
        assert queued.cancel.wait(BOUND), "the server did not cancel a queued request whose client left"
        # the queue's one place is free again while [31] still decodes: [33] waits instead of a 429
        follower = threading.Thread(target=ask, args=(33,))
        follower.start()
        worker.accepted.get(timeout=BOUND)
    finally:
        fake.gate.set()
    holder.join(BOUND)
    follower.join(BOUND)
    assert [ids for ids, _ in fake.calls[calls:]] == [[33]]  # [32] was never decoded
    assert answers[31].choices[0].token_ids == fake.answer([31], 2)
    assert answers[33].choices[0].token_ids == fake.answer([33], 2)
    after = health(server)["requests"]
    assert after["cancelled"] == before["cancelled"] + 1 and after["finished"] == before["finished"] + 2
    assert after["rejected"] == before["rejected"]


def test_a_failing_decode_is_500_and_the_server_stays_up(served, client):
    server, fake, *_ = served
    before = health(server)["requests"]
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": [99], "max_tokens": 2}, timeout=BOUND)
    assert r.status_code == 500 and "the fake's fault" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + COMPLETIONS, json={"prompt": [99], "max_tokens": 2, "stream": True},
                      timeout=BOUND) as s:
        body = s.read().decode()  # the prompt was taken, the stream begun: the failure is an event
    events = [e[6:] for e in body.split("\n\n") if e]
    assert s.status_code == 200 and events[-1] == "[DONE]"
    assert "the fake's fault" in json.loads(events[-2])["error"]["message"]
    assert client.completions.create(model="fake-model", prompt=[5], max_tokens=2).choices[0].token_ids == \
        fake.answer([5], 2)
    assert health(server)["requests"]["failed"] == before["failed"] + 2


def test_without_the_extra_the_command_says_how_to_get_it(monkeypatch):
    import importlib.util

    from click.testing import CliRunner

    from harness.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    result = CliRunner().invoke(main, ["serve"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: harness serve needs the [serve] extra (uvicorn not installed): pip install 'qwen35-exact[serve]'"]


@pytest.mark.parametrize("argv,says", [
    (["--record", "/nonexistent-dir/r.jsonl"], "does not exist"),
    (["--decoder-arg", "depth"], "expected KEY=VALUE"),
    (["--device", "gpu"], "device 'gpu' is not supported"),
    (["--port", "70000"], "70000"),
])
def test_bad_options_are_one_error_line_before_any_load(argv, says):
    from click.testing import CliRunner

    from harness.cli import main

    result = CliRunner().invoke(main, ["serve", "--model", "tiny", *argv])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output
