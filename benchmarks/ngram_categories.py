"""n-gram prompt lookup against SmolLM2, per category of the builtin prompts (the README table).

    python benchmarks/ngram_categories.py [--temperature 0.7] [--continuation-tokens 64]

Prompt lookup proposes only where the text repeats itself, so how much it buys depends on the
task: extraction and summarisation copy from the prompt, creative writing does not. Per
category: the share of positions with a proposal, alpha where one is made (teacher-forced), and
from the simulation the acceptance rate, tokens per cycle (product-limit, the category's cycles
pooled) and the estimated speedup (drafting costs nothing; a cycle costs one target step).
The engines' rule (argmax proposal, accepted with p(x)) is printed beside Leviathan's: for a
lookup q is one-hot on the copied token, so the two are the same by construction.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import specdec  # noqa: E402

GGUF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "models",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--continuation-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    args = ap.parse_args()
    if not os.path.isfile(GGUF):
        print(f"skipped: {GGUF} not found")
        return 0
    target, tok, dev = specdec.load_model_and_tokenizer(GGUF, progress=False)
    seqs = specdec.build_sequences(specdec.load_texts("builtin"), tok, max_samples=100)
    drafter = specdec.NgramDrafter(2, 1, specdec.eos_ids(target, tok))
    r = specdec.measure_acceptance(
        target, drafter, seqs, sampling=specdec.SamplingParams(args.temperature), device=dev,
        gamma=args.gamma, continuation_tokens=args.continuation_tokens, simulate=True,
        eos=specdec.eos_ids(target, tok), draft_name=drafter.name)
    print(f"# {len(seqs)} builtin prompts, T={args.temperature:g}, gamma {args.gamma}, "
          f"{args.continuation_tokens} tokens, n-gram sizes 2..1, torch {torch.__version__}")
    print("| category | prompts | proposals at | alpha where proposed (teacher-forced) "
          "| the same, engines' rule | alpha (simulated) | tokens per cycle (simulated) "
          "| est. speedup |")
    print("|---|---|---|---|---|---|---|---|")
    by_cat: dict = {}
    for row in r.per_prompt:
        by_cat.setdefault(row["category"], []).append(row)
    for cat in sorted(by_cat) + ["all"]:
        rows = [x for rows in by_cat.values() for x in rows] if cat == "all" else by_cat[cat]
        total = {k: sum(x[k] for x in rows) for k in ("positions", "scored", "alpha_sum",
                                                       "p_argmax_q_sum", "accepted",
                                                       "examined")}
        at_risk = torch.tensor([[a + b for a, b in zip(x["reached"], x["unproposed"])]
                                for x in rows], dtype=torch.float64).sum(0)
        took = torch.tensor([x["accepted_at"] for x in rows], dtype=torch.float64).sum(0)
        tokens = specdec.product_limit(at_risk, took).item() + 1
        print(f"| {cat} | {len(rows)} | {total['scored'] / total['positions']:.0%} "
              f"| {total['alpha_sum'] / max(1, total['scored']):.3f} "
              f"| {total['p_argmax_q_sum'] / max(1, total['scored']):.3f} "
              f"| {total['accepted'] / max(1, total['examined']):.3f} | {tokens:.3f} "
              f"| {tokens:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
