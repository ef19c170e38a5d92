"""Prompts per second with one process and with two (torchrun, gloo), one thread each.

    python benchmarks/ranks.py                 # SmolLM2 (../shared/models) and its 24-layer draft
    python benchmarks/ranks.py --prompts 32 --tokens 64

Both runs measure the same prompts with the same seed; the time counted is from the CLI's
"measuring" line (models loaded) to its exit, so loading is left out. The two JSON files must be
identical: two ranks change how the work is shared, never a number. Run it with nothing else on
the machine (the two ranks take both cores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GGUF = os.path.join(ROOT, "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def timed_run(cmd: list[str]) -> tuple[float, str]:
    """Seconds from the CLI's 'measuring' status line to its exit, and its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    start = None
    for line in proc.stderr:
        if start is None and line.startswith("specdec: measuring"):
            start = time.perf_counter()
    out = proc.stdout.read()
    if proc.wait() != 0 or start is None:
        sys.exit(f"run failed ({proc.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=GGUF)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    if not os.path.exists(args.model):
        sys.exit(f"no model at {args.model}: give --model (a GGUF file or model folder)")
    work = tempfile.mkdtemp()
    common = ["specdec.py", "--target", args.model, "--draft-layers", "24", "--simulate",
              "--max-samples", str(args.prompts), "--continuation-tokens", str(args.tokens),
              "--batch-size", str(args.batch_size)]
    one, _ = timed_run([sys.executable] + common + ["--json", f"{work}/one.json"])
    two, _ = timed_run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
                       + common + ["--json", f"{work}/two.json"])
    with open(f"{work}/one.json") as a, open(f"{work}/two.json") as b:
        same = json.load(a) == json.load(b)
    print(f"{args.prompts} prompts x {args.tokens} tokens, --draft-layers 24 --simulate, "
          f"batch {args.batch_size}, one thread per process")
    print("| processes | measuring time | prompts/s |\n|---|---|---|")
    for n, t in ((1, one), (2, two)):
        print(f"| {n} | {t:.1f} s | {args.prompts / t:.2f} |")
    print(f"speed-up with 2 processes: {one / two:.2f}x; JSON identical: {same}")


if __name__ == "__main__":
    main()
