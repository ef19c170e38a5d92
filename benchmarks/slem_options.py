"""What SLEM's two options change on a real pair of two families (docs/cross-vocab.md):
Qwen2.5-Coder-0.5B-Instruct (target) and SmolLM2-135M-Instruct (draft), the 38 builtin prompts
as plain text, T = 0, gamma 4, 32 tokens, batches of 8; SLEM as transformers runs it, then
--slem-stop own, then --slem-cache exact. Prints each one's totals and the prompts where it
differs from the default, and checks that the default's text is the target's own greedy text
(generate, one prompt at a time) on every prompt. About 25 minutes on two cores.

    python benchmarks/fetch_qwen_gguf.py DIR
    python benchmarks/slem_options.py DIR/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \
        ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import sys

import torch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec as sd  # noqa: E402


def options_table(target, tok, draft, tok_d, seqs) -> None:
    """Each way's totals, and the prompts where it differs from the default."""
    rows = {}
    for stop, cache in (("target", "transformers"), ("own", "transformers"),
                        ("target", "exact")):
        slem = sd.SlemDrafter(f"stop={stop}, cache={cache}", draft, target, tok, tok_d,
                              sd.SlemWay(stop, cache))
        r = sd.measure_drafts(target, [slem], seqs, sampling=sd.SamplingParams(0.0),
                              device="cpu", gamma=4, continuation_tokens=32, simulate=True,
                              batch_size=8, eos=sd.eos_ids(target, tok))[0]
        per = r.run.per_prompt
        rows[stop, cache] = per
        print(f"{slem.name}: accepted {sum(p['accepted'] for p in per)}, cycles "
              f"{sum(p['cycles'] for p in per)}, tokens per cycle "
              f"{r.empirical_tokens_per_cycle:.3f}", flush=True)
        for p, q in zip(rows["target", "transformers"], per):
            if (p["accepted"], p["cycles"]) != (q["accepted"], q["cycles"]):
                print(f"    prompt {p['index']}: (accepted, cycles) ({p['accepted']}, "
                      f"{p['cycles']}) -> ({q['accepted']}, {q['cycles']})")


def greedy_text_check(target, tok, draft, tok_d, seqs) -> None:
    """The default's simulated text against the target's own greedy text, prompt by prompt."""
    slem = sd.SlemDrafter("default", draft, target, tok, tok_d)
    eos = frozenset(sd.eos_ids(target, tok))
    config = sd.LoopConfig(sd.SamplingParams(0.0), 4, 32, sd.vocab_width(target), eos,
                           torch.device("cpu"))
    same = 0
    for i in range(0, len(seqs), 8):
        rows = sd.run_simulation(target, slem, seqs[i:i + 8], config)  # {index in the batch: row}
        for j, row in sorted(rows.items()):
            x = torch.tensor([list(seqs[i + j].ids)])
            greedy = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=32, eos_token_id=sorted(eos))
            greedy = greedy[0, x.shape[1]:].tolist()
            same += row.tokens == greedy
            if row.tokens != greedy:
                print(f"    prompt {i + j}: the text is not the target's greedy text")
    print(f"the default's text is the target's greedy text on {same} of {len(seqs)} prompts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--text-only", action="store_true", help="only the greedy-text check")
    a = ap.parse_args()
    target, tok, _ = sd.load_model_and_tokenizer(a.target, device="cpu", progress=False)
    draft, tok_d, _ = sd.load_model_and_tokenizer(a.draft, device="cpu", progress=False)
    seqs = sd.build_sequences(sd.load_texts("builtin"), tok, chat_template="off",
                              plain_text=True)
    if not a.text_only:
        options_table(target, tok, draft, tok_d, seqs)
    greedy_text_check(target, tok, draft, tok_d, seqs)


if __name__ == "__main__":
    main()
