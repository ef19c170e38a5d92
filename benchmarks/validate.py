"""The README's validation table: the two measurement routes on a real pair, and the endpoints.

    python benchmarks/validate.py [--max-samples 32] [--continuation-tokens 64] [--out FILE]
    python benchmarks/validate.py --save-random-draft DIR   # the random draft, for the CLI

Target: ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf. Drafts: the model itself (alpha = 1),
its first 24 and first 15 decoder layers (early-exit self-drafts), and an unrelated tiny random
Llama that shares the tokenizer (alpha near 0). Each at temperature 0.7 and 0, with simulation.

The gap between distributional and generative alpha is judged against its standard error,
computed per prompt (the prompt is the independent unit, and both routes run on the same
prompts, so the error is that of the paired difference of two ratio estimators).
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import specdec  # noqa: E402

GGUF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "models",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


def random_draft(target: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A 2-layer, 64-wide random Llama with the target's vocabulary: no relation to it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=specdec.vocab_width(target), hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def paired_gap_stderr(rows: list[dict]) -> float:
    """Standard error of alpha_tf - alpha_gen with prompts as units (linearised ratios)."""
    rows = [r for r in rows if r.get("scored") and r.get("examined")]
    n = len(rows)
    a = sum(r["alpha_sum"] for r in rows) / sum(r["scored"] for r in rows)
    b = sum(r["accepted"] for r in rows) / sum(r["examined"] for r in rows)
    mean_s = sum(r["scored"] for r in rows) / n
    mean_e = sum(r["examined"] for r in rows) / n
    z = [(r["alpha_sum"] - a * r["scored"]) / mean_s - (r["accepted"] - b * r["examined"]) / mean_e
         for r in rows]
    return math.sqrt(sum(x * x for x in z) / (n * (n - 1)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-samples", type=int, default=32)
    ap.add_argument("--continuation-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--out", help="also write all reports as JSON here")
    ap.add_argument("--save-random-draft", metavar="DIR",
                    help="only save the random draft (with the target's tokenizer) to DIR, so "
                    "that `python specdec.py --target GGUF --draft DIR` reproduces its row")
    args = ap.parse_args()
    if not os.path.isfile(GGUF):
        print(f"skipped: {GGUF} not found")
        return 0
    target, tok, dev = specdec.load_model_and_tokenizer(GGUF, progress=False)
    if args.save_random_draft:
        random_draft(target).save_pretrained(args.save_random_draft)
        tok.save_pretrained(args.save_random_draft)
        print(f"saved the random draft to {args.save_random_draft}")
        return 0
    seqs = specdec.build_sequences(specdec.load_texts("builtin"), tok,
                                   max_samples=args.max_samples)
    drafts = [("itself (30 layers)", target),
              ("first 24 layers", specdec.early_exit_draft(target, 24)),
              ("first 15 layers", specdec.early_exit_draft(target, 15)),
              ("random 2-layer Llama", random_draft(target))]
    print(f"# {len(seqs)} builtin prompts, {args.continuation_tokens} continuation tokens, "
          f"gamma {args.gamma}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| draft | T | alpha (teacher-forced) | positions | alpha (simulated) | examined "
          "| gap ± se | within 2 se | E[acc] iid | E[acc] positional | sim mean acc. length "
          "| closer | est. speedup (tf / sim) |")
    print("|" + "---|" * 13)
    everything = []
    for temperature in (0.7, 0.0):
        reports = specdec.measure_drafts(
            target, drafts, seqs, sampling=specdec.SamplingParams(temperature), device=dev,
            gamma=args.gamma, continuation_tokens=args.continuation_tokens, simulate=True,
            separate_continuation=True,  # the two routes on texts of their own: they share nothing
            eos=specdec.eos_ids(target, tok), target_name="SmolLM2-135M-Instruct")
        for r in reports:
            gap = r.alpha - r.empirical_alpha
            se = paired_gap_stderr(r.per_prompt)
            within = "yes" if abs(gap) <= 2 * se + 1e-6 else "NO"  # 1e-6: float rounding
            d_iid = abs(r.expected_accepted_iid - r.mean_accepted_length)
            d_pos = abs(r.expected_accepted_positional - r.mean_accepted_length)
            closer = ("tie" if abs(d_iid - d_pos) < 1e-6
                      else "iid" if d_iid < d_pos else "positional")
            print(f"| {r.draft} | {temperature:g} | {r.alpha:.3f} ± {r.alpha_stderr:.3f} "
                  f"| {r.scored_positions:,} | {r.empirical_alpha:.3f} ± "
                  f"{r.empirical_alpha_stderr:.3f} | {r.examined_tokens:,} "
                  f"| {gap:+.3f} ± {se:.3f} | {within} | {r.expected_accepted_iid:.3f} "
                  f"| {r.expected_accepted_positional:.3f} | {r.mean_accepted_length:.3f} "
                  f"| {closer} | {r.est_speedup:.2f}x / {r.empirical_est_speedup:.2f}x |",
                  flush=True)
            everything.append(r.to_dict())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
