"""How the retime's GPU idle probe (``audit.retime.quiet``) sees another process's work.

    python bench/gpu_quiet.py [--device cuda] [--json FILE]

In this process: the probe alone (its solo time, as ``Quiet.calibrate`` takes it), then beside a
second process that keeps the GPU busy in one of several ways (large matrix products; device-to-
device copies; host-to-device copies; a long chain of tiny kernels; queued products that the process leaves behind and
then is stopped with SIGSTOP, as a retime's worker is). For each: the probe's median and
slowest time against its solo time, and whether ``Quiet.wait`` calls the GPU quiet; for the stopped
process, how long ``Quiet.wait`` waited against the work it left. A table last.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from audit.retime.quiet import QUIET_SLACK, CudaProbe, Quiet  # noqa: E402

# the second process: prints "ready" once its kernels are loaded, then keeps the GPU busy in the
# named way until killed ("left": queues SECONDS of products, prints "queued", and waits)
BUSY = r"""
import sys, time, torch
how, dev = sys.argv[1], torch.device(sys.argv[2])
if how in ("matmul", "left"):
    size = 16384 if how == "left" else 8192  # few launches for seconds of work: the queue holds them all
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16); out = torch.empty_like(a)
    step = lambda: torch.matmul(a, a, out=out)
elif how == "copy":
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    step = lambda: b.copy_(a)
elif how == "h2d":  # host-to-device copies over PCIe, from pinned memory
    a = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True); b = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    step = lambda: b.copy_(a, non_blocking=True)
else:  # tiny kernels, one after another
    a = torch.zeros(1024, device=dev)
    step = lambda: a.add_(1)
step(); torch.cuda.synchronize(dev)
if how == "left":
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize(dev)
    n = int(float(sys.argv[3]) / ((time.perf_counter() - t0) / 10))
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(n):
        step()
    print("queued", flush=True)
    time.sleep(3600)
print("ready", flush=True)
while True:
    for _ in range(100):
        step()
    torch.cuda.synchronize(dev)
"""


def probe_times(probe: CudaProbe, n: int) -> list[float]:
    return [probe.run() for _ in range(n)]


def beside(how: str, device: str, probe: CudaProbe, n: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", BUSY, how, device], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        times = probe_times(probe, n)
    finally:
        proc.kill()
        proc.wait()
    return {"times": times}


def left_behind(device: str, quiet: Quiet, seconds: float) -> dict:
    """A process queues ``seconds`` of products, is stopped, and the probe waits for the GPU."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY, "left", device, str(seconds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "queued"
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.perf_counter() - t0
        waited = quiet.wait()
    finally:
        proc.kill()
        proc.wait()
    return {"left_s": seconds, "queued_in_s": stopped, "waited_s": waited}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--probes", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    class Clock:
        def now(self) -> float:
            return time.perf_counter()

    probe = CudaProbe(args.device)
    quiet = Quiet(probe, Clock())
    solo = quiet.calibrate()
    rows = {"alone": {"times": probe_times(probe, args.probes)}}
    for how in ("matmul", "copy", "h2d", "tiny"):
        rows[how] = beside(how, args.device, probe, args.probes)
    left = [left_behind(args.device, quiet, s) for s in (0.5, 2.0)]
    out = {"solo_s": solo, "slack": QUIET_SLACK, "rows": rows, "left_behind": left}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    print(f"\nprobe alone (median of calibration): {solo * 1e3:.2f} ms; quiet at most {QUIET_SLACK}x")
    print("| beside | median ms | slowest ms | median / alone | share of probes quiet |")
    print("|---|---:|---:|---:|---:|")
    for how, row in rows.items():
        t = row["times"]
        quiet_share = sum(x <= QUIET_SLACK * solo for x in t) / len(t)
        print(f"| {how} | {statistics.median(t) * 1e3:.2f} | {max(t) * 1e3:.2f} | "
              f"{statistics.median(t) / solo:.2f}x | {quiet_share:.0%} |")
    print("\n| work left by a stopped process (s) | Quiet.wait waited (s) |")
    print("|---:|---:|")
    for row in left:
        print(f"| {row['left_s']:.1f} | {row['waited_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
