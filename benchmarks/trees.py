"""A --tree sweep on SmolLM2 and what it costs beside the chain run of the same prompts.

    python benchmarks/trees.py [--rounds 1] [--threads 1]

Runs the README's tree command (SmolLM2-135M-Instruct, its first 24 layers as the draft, the
builtin prompts, --simulate, four --tree shapes and a static tree) and the same command without
the trees, alternated `rounds` times, in this process with `threads` torch threads: prints the
report's trees section, the time of each run and the ratio of the best ones (the issue's goal:
a four-shape sweep within 1.5x of one chain run), and the time the tree-building passes alone
took (draft_trees): the floor of a replay that builds them this way. Skips when
../shared/models has no SmolLM2.
"""
import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import specdec as sd  # noqa: E402

GGUF = os.path.join(HERE, "..", "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
CHAIN = ["--target", GGUF, "--draft-layers", "24", "--simulate", "--quiet"]
TREES = ["--tree", "1,4,5", "--tree", "2,4,8", "--tree", "4,4,16", "--tree", "8,5,32",
         "--tree-choices", "[(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0), (1, 0)]"]


def run(argv: list[str]) -> tuple[float, dict, str]:
    """specdec's main on argv -> (seconds, the JSON report, the text report)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "r.json")
        out = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            code = sd.main(argv + ["--json", path])
        took = time.perf_counter() - start
        assert code == 0, out.getvalue()
        with open(path) as f:
            return took, json.load(f), out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not os.path.isfile(GGUF):
        print(f"skipped: {GGUF} not found")
        return 0
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {"chain": [], "trees": [], "building": []}
    real = sd.draft_trees

    def timed(*a, **k):  # the tree-building passes alone: what the replay cannot do without
        start = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            building[0] += time.perf_counter() - start
    sd.draft_trees = timed
    for _ in range(args.rounds):
        for name, argv in (("chain", CHAIN), ("trees", CHAIN + TREES)):
            building = [0.0]
            took, report, text = run(argv)
            times[name].append(took)
            print(f"{name}: {took:.0f} s", flush=True)
            if name == "trees":
                times["building"].append(building[0])
                shown = text.split("  trees (")[1].split("  ────")[0]
                print("  trees (" + shown, flush=True)
                chain = report["empirical_tokens_per_cycle"]
    best = {k: min(v) for k, v in times.items()}
    print(f"chain of 4, simulated: {chain:.3f} tokens per cycle")
    print(f"time with the trees / without (best of {args.rounds}, {args.threads} thread(s)): "
          f"{best['trees'] / best['chain']:.2f} ({best['trees']:.0f} s / {best['chain']:.0f} s)")
    print(f"of which building the trees (draft_trees's passes): {best['building']:.0f} s, so "
          f"even a replay that did nothing else would take "
          f"{(best['chain'] + best['building']) / best['chain']:.2f}x the chain run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
