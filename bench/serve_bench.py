"""Time to first token and tokens/s of one decoder through its three doors, side by side.

    python bench/serve_bench.py --model synthetic-9b --decoder spec --limit 3 -n 256 --out DIR

The same prompts (random ids, the ``random-512`` draw) go through

  serve     ``harness serve`` in a process of its own, asked by the ``openai`` client with streaming
            on: TTFT is the wait for the first chunk that carries tokens, tok/s counts every new token
            over the whole answer; one untimed request first, so the server's first answer does
            not carry its start-up;
  generate  ``harness generate --prompt-ids FILE --json``, one process per prompt: its own stats
            (TTFT and tok/s from the Python API's clock, the model load excluded);
  time      ``harness time --control fast-serial --legs 1``: the candidate's first timed leg, whole
            decode (no TTFT: the harness times decodes, not tokens).

Every answer of the server and of generate is compared with the serial-greedy tokens that
``harness time`` recorded for its control leg (fast-serial, bit-identical to the control); a
mismatch is printed and fails the run. The table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
VOCAB = {"synthetic-9b": 248320, "tiny": 512}  # tiny: a CPU check of the script itself


def prompts_file(out: Path, model: str, limit: int) -> tuple[Path, list[dict]]:
    from core.prompts import RANDOM_SETS, random_prompts

    count, seed, prefix = RANDOM_SETS["random-512"]
    rows = random_prompts(VOCAB[model], count, 512, seed, prefix)[:limit]
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": r["id"], "token_ids": r["token_ids"]}) + "\n" for r in rows))
    return path, rows


def run_time(args, prompts: Path, out: Path) -> dict[str, dict]:
    """harness time, candidate vs fast-serial: per prompt, the candidate's first leg and the reference tokens."""
    run_dir = out / "time"
    subprocess.run([PY, "-m", "harness", "time", "--decoder", args.decoder, "--control", "fast-serial",
                    "--model", args.model, "--prompts", str(prompts), "-n", str(args.n), "--legs", "1",
                    "--device", args.device, "--out", str(run_dir), "--force"], cwd=ROOT, check=True)
    rows = {}
    for line in (run_dir / "stream.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "leg" and rec["leg"] == 0:
            row = rows.setdefault(rec["prompt_id"], {})
            row[rec["role"]] = rec
    return {pid: {"tokens": r["control"]["tokens"], "time_tok_s": len(r["candidate"]["tokens"]) / r["candidate"]["wall_s"]}
            for pid, r in rows.items()}


def run_generate(args, rows: list[dict], out: Path) -> dict[str, dict]:
    results = {}
    for r in rows:
        ids = out / f"ids-{r['id']}.json"
        ids.write_text(json.dumps(r["token_ids"]))
        proc = subprocess.run([PY, "-m", "harness", "generate", "--prompt-ids", str(ids), "--json",
                               "--model", args.model, "--decoder", args.decoder, "--device", args.device,
                               "-n", str(args.n)], cwd=ROOT, check=True, capture_output=True, text=True)
        doc = json.loads(proc.stdout)
        results[r["id"]] = {"tokens": doc["token_ids"], "ttft_s": doc["stats"]["time_to_first_token_s"],
                            "tok_s": doc["stats"]["tokens_per_s"]}
    return results


def start_server(args, out: Path) -> tuple[subprocess.Popen, str]:
    log = open(out / "serve.log", "w")
    proc = subprocess.Popen([PY, "-m", "harness", "serve", "--model", args.model, "--decoder", args.decoder,
                             "--device", args.device, "--port", "0"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        found = re.search(r"http://127\.0\.0\.1:(\d+)", (out / "serve.log").read_text())
        if found:
            return proc, f"http://127.0.0.1:{found.group(1)}/v1"
        if proc.poll() is not None:
            raise SystemExit(f"harness serve exited {proc.returncode}; see {out / 'serve.log'}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"harness serve did not say where it listens within {args.start_timeout} s")


def ask(client, served: str, ids: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, []
    stream = client.completions.create(model=served, prompt=ids, max_tokens=n, temperature=0, stream=True)
    for chunk in stream:
        new = (chunk.model_extra or {}).get("token_ids") or getattr(chunk.choices[0], "token_ids", None) or []
        if new and first is None:
            first = time.perf_counter() - t0
        tokens += new
    total = time.perf_counter() - t0
    return {"tokens": tokens, "ttft_s": first, "tok_s": len(tokens) / total}


def run_serve(args, rows: list[dict], out: Path) -> dict[str, dict]:
    from openai import OpenAI

    proc, base = start_server(args, out)
    try:
        client = OpenAI(base_url=base, api_key="none", timeout=600)
        served = client.models.list().data[0].id
        ask(client, served, rows[0]["token_ids"], 8)  # untimed: the server's first answer
        return {r["id"]: ask(client, served, r["token_ids"], args.n) for r in rows}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic-9b", choices=sorted(VOCAB))
    ap.add_argument("--decoder", default="spec")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts, rows = prompts_file(args.out, args.model, args.limit)
    timed = run_time(args, prompts, args.out)
    generated = run_generate(args, rows, args.out)
    served = run_serve(args, rows, args.out)
    (args.out / "serve_bench.json").write_text(json.dumps({"time": timed, "generate": generated, "serve": served}))
    bad = [(door, pid) for door, got in (("generate", generated), ("serve", served)) for pid in got
           if got[pid]["tokens"] != timed[pid]["tokens"]]
    print(f"\n{args.decoder} on {args.model}, {len(rows)} prompts of 512 ids, N={args.n}")
    print("| prompt | serve TTFT ms | serve tok/s | generate TTFT ms | generate tok/s | time tok/s | exact |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pid = r["id"]
        s, g, t = served[pid], generated[pid], timed[pid]
        exact = "yes" if (("serve", pid) not in bad and ("generate", pid) not in bad) else "NO"
        print(f"| {pid} | {s['ttft_s'] * 1e3:.1f} | {s['tok_s']:.1f} | {g['ttft_s'] * 1e3:.1f} | {g['tok_s']:.1f} "
              f"| {t['time_tok_s']:.1f} | {exact} |")
    med = {k: statistics.median(v) for k, v in {
        "serve_ttft": [served[r["id"]]["ttft_s"] * 1e3 for r in rows],
        "serve_tok": [served[r["id"]]["tok_s"] for r in rows],
        "gen_ttft": [generated[r["id"]]["ttft_s"] * 1e3 for r in rows],
        "gen_tok": [generated[r["id"]]["tok_s"] for r in rows],
        "time_tok": [timed[r["id"]]["time_tok_s"] for r in rows]}.items()}
    print(f"| median | {med['serve_ttft']:.1f} | {med['serve_tok']:.1f} | {med['gen_ttft']:.1f} | {med['gen_tok']:.1f} "
          f"| {med['time_tok']:.1f} | {'yes' if not bad else 'NO'} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
