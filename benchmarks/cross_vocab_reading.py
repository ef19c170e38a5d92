"""Why SLEM falls below TLI on the README's cross-vocabulary pair: the draft (SmolLM2's first 24
layers given GPT-2's vocabulary, benchmarks/cross_vocab_draft.py) reads the text better split as
its own layers learnt it than split as GPT-2 splits it.

    python benchmarks/cross_vocab_reading.py [--draft /tmp/smol24-gpt2] [--prompts 16]

On the target's greedy continuations (48 tokens after each builtin prompt) it prints the draft's
greedy next-token accuracy, in its own ids, two ways: reading the text token by token as TLI
feeds it (each SmolLM2 token as its GPT-2 id where both vocabularies hold it, re-tokenised
where not: SmolLM2's splits), and reading it as GPT-2's tokenizer splits it, which is what SLEM
feeds the draft (the text decoded and re-encoded). Skips when the model or the draft is absent.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import specdec as sd  # noqa: E402

GGUF = os.path.join(HERE, "..", "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="/tmp/smol24-gpt2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    if not (os.path.isfile(GGUF) and os.path.isdir(args.draft)):
        print(f"skipped: {GGUF} or {args.draft} not found (make the draft with "
              f"benchmarks/cross_vocab_draft.py)")
        return 0
    torch.set_num_threads(2)
    target, ttok, _ = sd.load_model_and_tokenizer(GGUF, "cpu", "float32", progress=False)
    draft, dtok, _ = sd.load_model_and_tokenizer(args.draft, "cpu", "float32", progress=False)
    seqs = sd.build_sequences(sd.load_texts("builtin"), ttok, max_samples=args.prompts)
    vocab = sd.SharedVocab(ttok, dtok, sd.vocab_width(target), sd.vocab_width(draft))
    right = {"TLI's reading (SmolLM2's splits)": [0, 0], "GPT-2's own splits (SLEM's)": [0, 0]}
    with torch.no_grad():
        for s in seqs:
            n = len(s.ids)
            text = target.generate(torch.tensor([s.ids]), max_new_tokens=args.tokens,
                                   do_sample=False)[0].tolist()
            for name, counts in right.items():
                if name.startswith("TLI"):
                    row, ends = vocab.reading(text)
                    start = ends[n - 1]
                else:
                    row = dtok.encode(ttok.decode(text, skip_special_tokens=True))
                    start = len(dtok.encode(ttok.decode(text[:n], skip_special_tokens=True)))
                guess = draft(torch.tensor([row])).logits[0, start - 1:-1].argmax(-1)
                counts[0] += int((guess == torch.tensor(row[start:])).sum())
                counts[1] += len(row) - start
    for name, (hit, total) in right.items():
        print(f"{name}: the draft's argmax is the next token {hit / total:.3f} of the time "
              f"({hit}/{total})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
