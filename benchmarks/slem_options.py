"""What SLEM's two options change on a real pair of two families (docs/cross-vocab.md):
Qwen2.5-Coder-0.5B-Instruct (target) and SmolLM2-135M-Instruct (draft), the 38 builtin prompts
as plain text, T = 0, gamma 4, 32 tokens, batches of 8; SLEM as transformers runs it, then
--slem-stop own, then --slem-cache exact. Prints each one's totals and the prompts where it
differs from the default. About 20 minutes on two cores (most of it the Qwen target).

    python benchmarks/fetch_qwen_gguf.py DIR
    python benchmarks/slem_options.py DIR/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \
        ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec as sd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("draft")
    a = ap.parse_args()
    target, tok, _ = sd.load_model_and_tokenizer(a.target, device="cpu", progress=False)
    draft, tok_d, _ = sd.load_model_and_tokenizer(a.draft, device="cpu", progress=False)
    seqs = sd.build_sequences(sd.load_texts("builtin"), tok, chat_template="off",
                              plain_text=True)
    rows = {}
    for stop, cache in (("target", "transformers"), ("own", "transformers"),
                        ("target", "exact")):
        slem = sd.SlemDrafter(f"stop={stop}, cache={cache}", draft, target, tok, tok_d,
                              stop=stop, cache=cache)
        r = sd.measure_drafts(target, [slem], seqs, sampling=sd.SamplingParams(0.0),
                              device="cpu", gamma=4, continuation_tokens=32, simulate=True,
                              batch_size=8, eos=sd.eos_ids(target, tok))[0]
        per = r.run.per_prompt
        rows[stop, cache] = per
        print(f"{slem.name}: accepted {sum(p['accepted'] for p in per)}, cycles "
              f"{sum(p['cycles'] for p in per)}, tokens per cycle "
              f"{r.empirical_tokens_per_cycle:.3f}")
        base = rows["target", "transformers"]
        for p, q in zip(base, per):
            if (p["accepted"], p["cycles"]) != (q["accepted"], q["cycles"]):
                print(f"    prompt {p['index']}: (accepted, cycles) ({p['accepted']}, "
                      f"{p['cycles']}) -> ({q['accepted']}, {q['cycles']})")


if __name__ == "__main__":
    main()
