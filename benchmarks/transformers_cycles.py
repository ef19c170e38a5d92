"""specdec's simulated cycles against transformers' own assisted generation, at T = 0.

    python benchmarks/transformers_cycles.py [--max-samples 8] [--new-tokens 32] [--json FILE]

At T = 0 both run the same greedy loop: per prompt the same tokens and, cycle by cycle, the
same (proposed, accepted) counts, logged from the inside (specdec.record_cycle; transformers'
update_candidate_strategy: scores.shape[1] - 1 candidates, num_matches accepted). Rows: the
target SmolLM2-135M-Instruct (GGUF) with its first 24 layers as `assistant_model=` (a
constant block of gamma, no confidence cut) and with prompt lookup (`prompt_lookup_num_tokens`,
n-grams of 1..2), gamma 4, builtin prompts (chat template); MTP (`use_mtp=True`) on the tests'
tiny DeepSeek-V3 stand-in with two live MTP layers (gamma 2), as SmolLM2 has no MTP layers.
specdec runs one prompt per batch and all in one batch; transformers one prompt at a time.

specdec, as the engines, takes the first token from the target's prefill and drafts after it;
so does transformers' MTP generator (its first cycle, the prefill, logs 0 candidates: dropped),
but a draft model and prompt lookup draft the first token themselves: those run in
transformers on the prompt plus the target's own first token, one token less to go.
Compared: all tokens; the counts of the cycles before the first that began with under gamma + 1
tokens of budget left (transformers shortens that block, or crops its matches) and never the
last (cut at the budget or an EOS). Both stop at the target's EOS ids. pad_token_id is the
vocabulary size, which no model writes: transformers masks the assistant's inputs equal to it
(SmolLM2's pad is its EOS). The early-exit draft shares its modules with the target; it runs
as transformers' assistant as it is (the assistant's cache is its own), no copy needed.
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import specdec  # noqa: E402

GGUF = os.path.join(HERE, "..", "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


@contextlib.contextmanager
def wrapped(owner, name: str, log):
    """owner.name replaced, for the block, by a call that hands its arguments to log first."""
    real, own = getattr(owner, name), name in vars(owner)

    def call(*args, **kwargs):
        log(*args, **kwargs)
        return real(*args, **kwargs)
    setattr(owner, name, call)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, real)
        else:  # inherited: uncover the base class's again
            delattr(owner, name)


def specdec_runs(target, drafter, seqs, gamma: int, budget: int, eos, batch_size: int):
    """specdec's greedy simulation -> per prompt (tokens, [(proposed, accepted) per cycle])."""
    log: dict[int, list] = {}  # by id(RowStats): every row is alive until the run returns

    def cycle(row, cyc, config):
        log.setdefault(id(row), []).append((cyc.count, cyc.n_acc))
    config = specdec.LoopConfig(specdec.SamplingParams(0.0), gamma, budget,
                                specdec.vocab_width(target), frozenset(eos), target.device)
    with wrapped(specdec, "record_cycle", cycle):
        rows = specdec.run_simulation(target, drafter, seqs, config, batch_size=batch_size)
    return [(rows[i].tokens, log.get(id(rows[i]), [])) for i in range(len(seqs))]


def transformers_run(target, generator, ids: list[int], budget: int, eos, from_prefill: bool,
                     **generate_kwargs):
    """transformers' greedy assisted generation of one prompt -> (tokens, cycles) as specdec's:
    from the prefill (MTP: its first, empty cycle dropped), or else on the prompt plus the
    target's own first token, one token less to go."""
    log = []

    def cycle(self, input_ids, scores, num_matches):  # scores (1, candidates + 1, V)
        log.append((scores.shape[1] - 1, int(num_matches)))
    first = [] if from_prefill else [int(target(torch.tensor([ids])).logits[0, -1].argmax())]
    x = torch.tensor([ids + first])
    with wrapped(generator, "update_candidate_strategy", cycle):
        out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=budget - len(first),
                              eos_token_id=sorted(eos) or None,
                              pad_token_id=specdec.vocab_width(target), **generate_kwargs)
    if from_prefill:
        assert log[0] == (0, 0), f"the prefill drafts nothing, got {log[0]}"
        log = log[1:]
    return first + out[0, x.shape[1]:].tolist(), log


def compared_cycles(theirs: list, gamma: int, budget: int) -> int:
    """How many of transformers' cycles the budget leaves whole: those before the first that
    began with fewer than gamma + 1 tokens left, and never the last."""
    emitted = 1  # the prefill's token
    for c, (_, accepted) in enumerate(theirs[:-1]):
        if emitted + gamma + 1 > budget:
            return c
        emitted += accepted + 1
    return max(len(theirs) - 1, 0)


def first_difference(target, ids, ours, theirs, our_cycles, their_cycles) -> str:
    """Where a prompt's two runs part: the first differing token, with the target's top-2 logit
    gap there (a near tie shows as a tiny gap), or else the first differing cycle."""
    pos = next((i for i, (a, b) in enumerate(zip(ours + [None], theirs + [None])) if a != b),
               None)
    if pos is not None:
        top = target(torch.tensor([ids + ours[:pos]])).logits[0, -1].float().topk(2)
        return (f"token {pos}: specdec {ours[pos:pos + 1]}, transformers {theirs[pos:pos + 1]}"
                f"; target top-2 {top.indices.tolist()}, logit gap "
                f"{float(top.values[0] - top.values[1]):.2e}")
    c = next(i for i, (a, b) in enumerate(zip(our_cycles + [None], their_cycles)) if a != b)
    return f"cycle {c}: specdec {our_cycles[c:c + 1]}, transformers {their_cycles[c]}"


def compare_row(name: str, target, drafter, seqs, gamma: int, budget: int, eos, generator,
                from_prefill: bool, **generate_kwargs) -> list[dict]:
    """One drafter: transformers once per prompt, specdec one prompt a batch and all in one
    batch -> a table row for each."""
    theirs = [transformers_run(target, generator, list(q.ids), budget, eos, from_prefill,
                               **generate_kwargs) for q in seqs]
    rows = []
    for batch in (1, len(seqs)):
        ours = specdec_runs(target, drafter, seqs, gamma, budget, eos, batch)
        row = dict(drafter=name, batch=batch, prompts=len(seqs), cycles=0, specdec_accepted=0,
                   transformers_accepted=0, same_tokens=0, same_counts=0, differences=[])
        for i, ((tokens, cycles), (their_tokens, their_cycles)) in enumerate(zip(ours, theirs)):
            k = compared_cycles(their_cycles, gamma, budget)
            row["cycles"] += k
            row["specdec_accepted"] += sum(n for _, n in cycles[:k])
            row["transformers_accepted"] += sum(n for _, n in their_cycles[:k])
            row["same_tokens"] += tokens == their_tokens
            row["same_counts"] += cycles[:k] == their_cycles[:k]
            if tokens != their_tokens or cycles[:k] != their_cycles[:k]:
                where = first_difference(target, list(seqs[i].ids), tokens, their_tokens,
                                         cycles, their_cycles[:k])
                row["differences"].append(f"prompt {i}: {where}")
        rows.append(row)
    return rows


def mtp_stand_in(folder: str):
    """The tests' tiny DeepSeek-V3 with two live MTP layers (benchmarks/standins.py), its
    tokenizer and prompts."""
    import standins as tests
    tests.make_mtp_checkpoint(folder, heads=2, noise=0.05, live=True)
    target, tok = tests.load_mtp_target(folder), tests.make_tokenizer(template=False)
    return target, tok, specdec.build_sequences(tests.MTP_PROMPTS + tests.REPEATS, tok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32, help="the token budget per prompt")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not os.path.isfile(GGUF):
        print(f"{GGUF} not found: this check needs the real SmolLM2 target", file=sys.stderr)
        return 2
    from transformers.generation.candidate_generator import (
        AssistedCandidateGenerator, MTPCandidateGenerator, PromptLookupCandidateGenerator)
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    started, gamma, budget = time.perf_counter(), args.gamma, args.new_tokens
    torch.set_grad_enabled(False)
    target, tok, _ = specdec.load_model_and_tokenizer(GGUF, progress=False)
    seqs = specdec.build_sequences(specdec.load_texts("builtin"), tok,
                                   max_samples=args.max_samples)
    eos = specdec.eos_ids(target, tok)
    draft = specdec.early_exit_draft(target, 24)
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    rows = compare_row("SmolLM2: first 24 layers (assistant_model)", target, draft, seqs,
                       gamma, budget, eos, AssistedCandidateGenerator, False,
                       assistant_model=draft)
    rows += compare_row("SmolLM2: prompt lookup, n = 1..2 (prompt_lookup_num_tokens)", target,
                        specdec.NgramDrafter(2, 1), seqs, gamma, budget, eos,
                        PromptLookupCandidateGenerator, False, prompt_lookup_num_tokens=gamma,
                        max_matching_ngram_size=2)
    with tempfile.TemporaryDirectory() as folder:  # (use_mtp loads the MTP layers from it)
        mtp, mtp_tok, mtp_seqs = mtp_stand_in(folder)
        heads = specdec.MtpDrafter.of(mtp)  # gamma = its layers: what use_mtp drafts
        rows += compare_row(f"STAND-IN tiny DeepSeek-V3: {heads.heads} live MTP layers "
                            "(use_mtp)", mtp, heads, mtp_seqs, heads.heads, budget,
                            specdec.eos_ids(mtp, mtp_tok), MTPCandidateGenerator, True,
                            use_mtp=True)
    print(f"# T = 0, {budget} tokens per prompt, gamma {gamma} (MTP: 2), transformers "
          f"{transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {time.perf_counter() - started:.0f} s\n")
    print("| drafter | specdec batch | prompts | cycles compared | specdec accepted "
          "| transformers accepted | same tokens | same counts per cycle |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['drafter']} | {r['batch']} | {r['prompts']} | {r['cycles']} "
              f"| {r['specdec_accepted']} | {r['transformers_accepted']} "
              f"| {r['same_tokens']}/{r['prompts']} | {r['same_counts']}/{r['prompts']} |")
    differ = [f"{r['drafter']}, batch {r['batch']}, {d}" for r in rows for d in r["differences"]]
    print("\nverdict: " + ("specdec's cycles and tokens equal transformers' on every prompt of "
                           "every row" if not differ else
                           f"{len(differ)} prompt run(s) differ:\n  " + "\n  ".join(differ)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
