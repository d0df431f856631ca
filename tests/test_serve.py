"""``harness serve`` as a user runs it: the command in a subprocess on 127.0.0.1 (port 0, the
printed port read back), the tiny model on the CPU with the default decoder (spec), and the official
``openai`` client. Every answer must be the serial control's greedy tokens; the record must pass
``audit tokens``. Waits are bounded waits on events and lines, never sleeps."""
from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
BOUND = 300  # seconds: the model load on a loaded machine, or one request, before the test fails
LIMIT = 512
CLIENTS = 8


class Server:
    """``python -m harness serve`` with its stdout read line by line by a thread, stderr to a file."""

    def __init__(self, tmp: Path):
        self.record = tmp / "record.jsonl"
        self.stderr_path = tmp / "stderr.txt"
        self.stderr = self.stderr_path.open("w")
        cmd = [sys.executable, "-m", "harness", "serve", "--model", "tiny", "--device", "cpu", "--port", "0",
               "--queue-size", str(CLIENTS), "--max-new-tokens-limit", str(LIMIT), "--record", str(self.record)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        line = self.lines.get(timeout=BOUND)
        match = re.fullmatch(r"serving tiny with decoder spec on (http://127\.0\.0\.1:(\d+)/v1)\n", line or "")
        assert match, f"no address printed: {line!r}; stderr: {self.stderr_path.read_text()}"
        self.base_url = match.group(1)
        self.url = self.base_url.removesuffix("/v1")

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def log(self) -> str:
        if not self.stderr.closed:
            self.stderr.flush()
        return self.stderr_path.read_text()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(BOUND)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(BOUND)
        finally:
            self.stderr.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"))
    yield s
    assert s.stop() == 0, s.log()  # Ctrl-C is the normal way to stop it
    rest = []
    while (line := s.lines.get(timeout=BOUND)) is not None:
        rest.append(line)
    assert rest == [], "stdout carries only the address line; logs go to stderr"


@pytest.fixture(scope="module")
def control(tiny):
    """The serial control behind the same API: the tokens every answer must equal."""
    from decoders import get_decoder
    from decoders.api import ExactDecoder

    serial = get_decoder("serial")
    serial.prepare(tiny)
    return ExactDecoder(serial, tiny)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=BOUND)


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=BOUND).json()


def streamed(chunks) -> tuple[list[int], str, str | None]:
    tokens, text, finish = [], "", None
    for c in chunks:
        for choice in c.choices:
            tokens += choice.token_ids
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            finish = choice.finish_reason or finish
    return tokens, text, finish


def test_completion_of_text_is_the_serial_greedy_answer(server, client, control):
    r = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=24)
    ids = control.encode("def add(a, b):")
    want = control.generate(ids, 24)
    assert r.prompt_token_ids == ids
    assert r.choices[0].token_ids == want.token_ids
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)


def test_streamed_completion_of_token_ids_is_the_serial_greedy_answer(server, client, control):
    ids = random.Random(1).choices(range(control.model.vocab_size), k=40)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=48, stream=True))
    want = control.generate(ids, 48)
    assert chunks[0].prompt_token_ids == ids
    assert streamed(chunks) == (want.token_ids, want.text, want.finish_reason)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_is_the_serial_greedy_answer_of_the_templated_prompt(server, client, control, stream):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    ids = control.encode_chat(messages)
    want = control.generate(ids, 32)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=32, stream=stream)
    if stream:
        chunks = list(r)
        assert chunks[0].prompt_token_ids == ids
        assert streamed(chunks) == (want.token_ids, want.text, want.finish_reason)
    else:
        assert r.prompt_token_ids == ids and r.choices[0].token_ids == want.token_ids
        assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason


def test_what_it_cannot_honour_is_400_and_it_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="no effect at temperature 0"):
        client.completions.create(model="tiny", prompt=[3, 4], max_tokens=2, top_p=0.5)
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        client.completions.create(model="tiny", prompt=[3, 4], max_tokens=2, temperature=0.7, top_p=1.5)
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": [1, 2', timeout=BOUND,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": LIMIT + 1}, timeout=BOUND)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    # by default the server's context is the model's (tiny: 4096): the audit judges nothing past it
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 4000, "max_tokens": 100}, timeout=BOUND)
    assert r.status_code == 400 and "context of 4096" in r.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt=[3, 4], max_tokens=2).choices[0].token_ids


def test_the_default_context_is_the_models_capped_and_a_given_one_is_kept():
    from harness.serve.options import DEFAULT_MAX_CONTEXT, ServeOptions

    assert ServeOptions().context_for(4096) == 4096
    assert ServeOptions().context_for(262144) == DEFAULT_MAX_CONTEXT
    assert ServeOptions().context_for(None) == DEFAULT_MAX_CONTEXT
    assert ServeOptions(max_context=100).context_for(4096) == 100


def test_a_max_context_beyond_the_models_is_refused_before_the_load(monkeypatch):
    """``--max-context`` past the model's context is one error before the socket is bound or any
    weights load."""
    import core.models
    from core.errors import UserError
    from harness.serve.options import ServeOptions
    from harness.serve.run import run_serve

    def never(*args, **kwargs):
        raise AssertionError("called before the context was checked")
    monkeypatch.setattr(core.models, "load_model", never)
    monkeypatch.setattr("harness.serve.run.listen", never)
    with pytest.raises(UserError, match="--max-context = 100000000 positions, beyond model tiny's context of 4096"):
        run_serve(ServeOptions(model="tiny", device="cpu", port=0, max_context=100_000_000))


SAMPLER = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 7}


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_completion_is_serial_sampling_with_that_seed(server, client, control, stream):
    """temperature, top_p, top_k (extra_body: not an OpenAI field), min_p and seed decode with the
    seeded sampler: the answer is serial's under it, says which sampler, and repeats with the seed."""
    from core.sampling import Sampler

    sampler = Sampler(temperature=0.6, top_k=20, top_p=0.95, seed=7)
    ids = control.encode("def add(a, b):")
    want = control.generate(ids, 24, sampler=sampler)
    assert want.token_ids != control.generate(ids, 24).token_ids
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0.6, top_p=0.95, seed=7,
                                  extra_body={"top_k": 20}, stream=stream)
    if stream:
        chunks = list(r)
        assert chunks[0].sampler == sampler.to_json()
        assert streamed(chunks) == (want.token_ids, want.text, want.finish_reason)
    else:
        assert r.sampler == sampler.to_json()
        assert r.choices[0].token_ids == want.token_ids and r.choices[0].text == want.text
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=24, extra_body=SAMPLER)
    assert again.choices[0].token_ids == want.token_ids
    other = client.completions.create(model="tiny", prompt=ids, max_tokens=24, extra_body={**SAMPLER, "seed": 8})
    assert other.choices[0].token_ids == control.generate(ids, 24, sampler=Sampler(0.6, 20, 0.95, 0.0, 8)).token_ids


def test_sampled_chat_is_serial_sampling_of_the_templated_prompt(server, client, control):
    from core.sampling import Sampler

    messages = [{"role": "user", "content": "Name a prime."}]
    ids = control.encode_chat(messages)
    want = control.generate(ids, 20, sampler=Sampler(temperature=1.0, min_p=0.05, seed=3))
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=1.0, seed=3,
                                       extra_body={"min_p": 0.05})
    assert r.choices[0].token_ids == want.token_ids and r.choices[0].message.content == want.text
    assert r.sampler["temperature"] == 1.0 and r.sampler["min_p"] == 0.05


def test_eight_clients_at_once_each_get_the_exact_answer(server, control):
    rng = random.Random(8)
    prompts = [rng.choices(range(control.model.vocab_size), k=rng.randrange(4, 60)) for _ in range(CLIENTS)]
    start = threading.Barrier(CLIENTS)
    got: dict[int, list[int] | Exception] = {}

    def ask(i):
        c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=BOUND)
        start.wait(BOUND)
        try:
            if i % 2:
                got[i] = streamed(c.completions.create(model="tiny", prompt=prompts[i], max_tokens=20, stream=True))[0]
            else:
                got[i] = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=20).choices[0].token_ids
        except Exception as exc:  # noqa: BLE001 - reported below, per client
            got[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    for i, p in enumerate(prompts):
        assert got[i] == control.generate(p, 20).token_ids, (i, got[i])


def test_a_client_dropped_mid_stream_is_cancelled_and_the_server_stays_up(server, client, control):
    before = health(server)["requests"]
    stream = client.completions.create(model="tiny", prompt="import os\n", max_tokens=LIMIT, stream=True)
    first = next(c for c in stream if c.choices[0].token_ids)
    stream.close()
    ids = control.encode("x = 1")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=16)  # queued behind the dropped one
    assert r.choices[0].token_ids == control.generate(ids, 16).token_ids
    after = health(server)
    assert after["status"] == "ok" and after["running"] is None
    assert after["requests"]["cancelled"] == before["cancelled"] + 1, after
    assert after["requests"]["finished"] == before["finished"] + 1, after
    assert first.id not in server.record.read_text()


def test_each_request_logs_a_stats_line(server, client):
    r = client.completions.create(model="tiny", prompt=[7, 8, 9], max_tokens=5)
    line = next(x for x in server.log().splitlines() if x.startswith(f"serve: {r.id} "))
    assert "prompt_tokens=3 new_tokens=5 " in line and " ttft=" in line and " tok/s=" in line, line


def test_audit_tokens_passes_on_the_record(server, tmp_path):
    """Last in this file: every answer above that finished is in the record, and exact, each
    audited with the sampler its line records (greedy where it records none)."""
    from core.sampling import Sampler

    lines = [json.loads(x) for x in server.record.read_text().splitlines()]
    assert len(lines) == health(server)["requests"]["finished"] and len(lines) >= CLIENTS + 4
    assert {"id", "prompt_token_ids", "output_token_ids", "max_new_tokens", "decoder", "model"} <= set(lines[0])
    by_sampler: dict = {}
    for line in lines:
        by_sampler.setdefault(json.dumps(line.get("sampler"), sort_keys=True), []).append(line)
    assert len(by_sampler) >= 4  # greedy and the sampled requests above
    assert sum(map(len, by_sampler.values())) == len(lines)
    for k, (key, members) in enumerate(by_sampler.items()):
        path = tmp_path / f"record-{k}.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in members))
        spec = Sampler.from_json(json.loads(key)).describe()
        proc = subprocess.run([sys.executable, "-m", "audit", "tokens", str(path), "--model", "tiny",
                               "--device", "cpu", "--sampling", spec], cwd=ROOT, capture_output=True, text=True,
                              timeout=BOUND, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "verdict: EXACT" in proc.stdout, proc.stdout
