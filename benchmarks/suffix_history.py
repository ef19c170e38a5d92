"""What suffix decoding's global tree of earlier responses is worth, and how the measurement's
"earlier" changes the number (docs/drafters.md, suffix decoding): SmolLM2-135M-Instruct as the
target, the builtin prompts, T = 0, gamma 8, 48 tokens, batches of 8, arctic's defaults (depth
24, spec factor 1.0, min token prob 0.1). Five ways, on the same target passes:

  prompt only          --suffix-max-cached-requests 0: the request's own tree alone
  earlier, data order  the default: prompt i's global tree holds the target's continuations of
                       prompts 0..i-1
  earlier, 4 cached    --suffix-max-cached-requests 4: the last 4 of them
  earlier, reversed    the default on the prompts in reverse order
  repeated workload    --suffix-history FILE with the target's own greedy answers to these
                       prompts (written here first, 48 tokens each, one per line of .jsonl),
                       as an agent asking the same things again meets them

For each: tokens per cycle (simulated, its 95% interval), acceptance of drafted tokens, drafted
tokens per cycle. About 20 minutes on two cores (one torch thread).

    python benchmarks/suffix_history.py [--gguf PATH] [--out table.md]
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec as sd  # noqa: E402

GGUF = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / (
    "SmolLM2-135M-Instruct.Q4_1.gguf")
GAMMA, TOKENS, BATCH = 8, 48, 8


def greedy_answers(target, tok, seqs, eos) -> list[str]:
    """The target's own greedy answer to each prompt, as text (what a log holds)."""
    out = []
    for s in seqs:
        x = torch.tensor([list(s.ids)])
        y = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                            max_new_tokens=TOKENS, eos_token_id=sorted(eos))
        out.append(tok.decode(y[0, x.shape[1]:].tolist(), skip_special_tokens=True))
    return out


def row(name: str, r) -> str:
    s = r.simulated
    lo, hi = s.tokens_per_cycle_ci
    drafted = s.drafted_tokens / s.cycles
    return (f"| {name} | {s.tokens_per_cycle:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{s.accept_rate:.3f} | {drafted:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=str(GGUF))
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, tok, _ = sd.load_model_and_tokenizer(args.gguf, device="cpu")
    seqs = sd.build_sequences(sd.load_texts("builtin"), tok)
    eos = sd.eos_ids(target, tok)
    run = dict(sampling=sd.SamplingParams(0.0), device="cpu", gamma=GAMMA,
               continuation_tokens=TOKENS, simulate=True, batch_size=BATCH, eos=eos, seed=0)
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "answers.jsonl")
        with open(log, "w") as f:
            for text in greedy_answers(target, tok, seqs, eos):
                f.write(json.dumps({"response": text}) + "\n")
        history = sd.read_history(log, tok)
    ways = {"prompt only": sd.SuffixDrafter(sd.SuffixOptions(max_cached=0), earlier=False),
            "earlier, data order": sd.SuffixDrafter(),
            "earlier, 4 cached": sd.SuffixDrafter(sd.SuffixOptions(max_cached=4)),
            "repeated workload (--suffix-history)": sd.SuffixDrafter(history=history,
                                                                     earlier=False)}
    reports = sd.measure_drafts(target, list(ways.values()), seqs, **run)
    reversed_, = sd.measure_drafts(target, [sd.SuffixDrafter()], seqs[::-1], **run)
    lines = [f"SmolLM2-135M-Instruct (Q4_1), {len(seqs)} builtin prompts, T = 0, gamma {GAMMA}, "
             f"{TOKENS} tokens, {len(history)} logged answers", "",
             "| global tree | tokens per cycle [95%] | drafted accepted | drafted per cycle |",
             "|---|---|---|---|"]
    lines += [row(name, r) for name, r in zip(ways, reports)]
    lines.insert(6, row("earlier, reversed order", reversed_))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
