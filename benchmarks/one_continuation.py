"""One continuation for both routes: time and numbers against the version before it.

    python benchmarks/one_continuation.py [--before REV] [--rounds 2]

A `--simulate` run on SmolLM2 (its first 24 layers as the draft, 16 builtin prompts x 64
tokens, T 0.7) with the file at REV (default HEAD~1: the teacher-forced route samples a
continuation of its own) and with this checkout's (it scores the text the simulation
emitted), alternated, `rounds` times each, one thread: the time ratio of the best runs. Then
the numbers at T 0 and T 0.7: the simulated ones must be identical; the teacher-forced ones
identical at T 0 (the simulation emits the target's greedy text) and within their intervals
at T 0.7. Skips when ../shared/models has no SmolLM2.
"""
import argparse
import contextlib
import io
import os
import sys
import time

import torch

from versions import before_and_now

HERE = os.path.dirname(os.path.abspath(__file__))
GGUF = os.path.join(HERE, "..", "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def run(sd, target, texts, tok, dev, temperature: float):
    seqs = sd.build_sequences(texts, tok, max_samples=16)  # each version its own types
    draft = sd.early_exit_draft(target, 24)
    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        r = sd.measure_acceptance(target, draft, seqs, sampling=sd.SamplingParams(temperature),
                                  device=dev, continuation_tokens=64, simulate=True, gamma=4)
    return time.perf_counter() - start, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="HEAD~1")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not os.path.isfile(GGUF):
        print(f"skipped: {GGUF} not found")
        return 0
    torch.set_num_threads(1)
    old, new = before_and_now(args.before)
    target, tok, dev = new.load_model_and_tokenizer(GGUF, progress=False)
    texts = new.load_texts("builtin")
    times = {"before": [], "now": []}
    reports = {}
    for _ in range(args.rounds):
        for name, sd in (("before", old), ("now", new)):
            t, reports[name, 0.7] = run(sd, target, texts, tok, dev, 0.7)
            times[name].append(t)
            print(f"{name}: {t:.1f} s", flush=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"time now / before (best of {args.rounds}): {best['now'] / best['before']:.2f} "
          f"({best['now']:.1f} s / {best['before']:.1f} s)")
    for name, sd in (("before", old), ("now", new)):
        reports[name, 0.0] = run(sd, target, texts, tok, dev, 0.0)[1]
    for t in (0.0, 0.7):
        a, b = reports["before", t], reports["now", t]
        sim_same = all(getattr(a, k) == getattr(b, k) for k in (
            "empirical_alpha", "mean_accepted_length", "cycles", "accepted_by_draft_offset"))
        print(f"T={t:g}: simulated numbers identical: {sim_same}; teacher-forced alpha "
              f"before {a.alpha:.3f} {tuple(round(x, 3) for x in a.alpha_ci)}, now "
              f"{b.alpha:.3f} {tuple(round(x, 3) for x in b.alpha_ci)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
