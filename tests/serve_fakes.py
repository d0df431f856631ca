"""A fake decoder with the ``decoders.api`` contract, whose decode the test holds on an Event, and
the server app run by uvicorn in a thread of the test process (for tests/test_serve_queue.py)."""
from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

from decoders.api import Generation, GenerationStats

BOUND = 60  # seconds: the longest any wait on the server may take before the test fails


class FakeDecoder:
    """Token i of a prompt's answer is ``(sum(prompt) + i) % 90 + 10`` (never the EOS, 1). With
    ``gate`` cleared, every decode emits its first token, then holds until the gate is set."""

    name = "fake"
    eos_token_ids = (1,)

    def __init__(self):
        self.model = SimpleNamespace(name="fake-model", vocab_size=100, identity={"name": "fake-model"})
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.calls: list[tuple[list[int], threading.Event]] = []

    @staticmethod
    def answer(prompt_ids: list[int], n: int) -> list[int]:
        return [(sum(prompt_ids) + i) % 90 + 10 for i in range(n)]

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 90 + 10 for c in text]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return [2] + self.encode("".join(f"{m['role']}:{m['content']};" for m in messages)) + [3]

    def text(self, ids) -> str:
        return "".join(f"<{t}>" for t in ids)

    def generate(self, prompt, max_new_tokens=256, *, on_token=None, cancel=None) -> Generation:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.calls.append((ids, cancel))
        self.started.set()
        out = []
        for i, tok in enumerate(self.answer(ids, max_new_tokens)):
            if i == 1:
                assert self.gate.wait(BOUND), "the test never opened the gate"
            out.append(tok)
            if on_token is not None:
                on_token([tok], self.text([tok]))
            if cancel is not None and cancel.is_set():
                return self.generation(ids, out, "cancelled")
        return self.generation(ids, out, "length")

    def generation(self, ids, out, reason) -> Generation:
        stats = GenerationStats(prompt_tokens=len(ids), new_tokens=len(out), seconds=1.0, time_to_first_token_s=0.5,
                                tokens_per_s=float(len(out)), drafted=0, accepted=0, mean_accepted_length=None,
                                forwards=len(out))
        return Generation(ids, out, self.text(out), reason, stats)


class ThreadServer:
    """The app on 127.0.0.1, a free port, served by uvicorn in a daemon thread. The socket listens
    before the thread starts, so a request sent at once waits in the backlog: no start-up wait."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(BOUND)
        self.sock.close()
