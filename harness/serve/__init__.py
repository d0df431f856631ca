"""``harness serve``: an OpenAI-compatible HTTP server over one exact decoder.

options (the command's value), schemas (what a request may ask), worker (one decode at a time from a
bounded queue), responses (OpenAI-shaped bodies and SSE chunks), app (the routes), run (load, bind,
serve). Only ``options`` is free of fastapi, uvicorn and torch; the command imports the rest when it
runs, so that ``harness --help`` starts fast.
"""
