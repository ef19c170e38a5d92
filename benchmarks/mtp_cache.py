"""MTP layers at long context: seconds per simulated cycle, before and after their cache (#19).

    python benchmarks/mtp_cache.py --before 44ee623 --lengths 256 2048

A random DeepSeek-V3 (hidden 512, 4 layers, 8 experts, vocabulary 4,096) and one random MTP
layer, built here (no download), run through the simulation (T 1, gamma = steps, `--budget`
tokens per row, `--rows` prompts of L random tokens in one batch) by the specdec.py of this
checkout and by the one at REV (`git show REV:specdec.py`, loaded as a module of its own), one
thread. Per cycle it times the whole loop (the target's verify pass included, prefill not) and
the drafter's own part (its session's propose and advance), and checks that both versions
emitted the same tokens. Before the cache every cycle ran the MTP layer over the whole
sequence, so its drafter time grows with L; with it a cycle runs the layer over the newly
committed and drafted positions only, and only attention grows with L.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from versions import before_and_now


def model(vocab: int, hidden: int, layers: int, seed: int = 0):
    """A random DeepSeek-V3 target with one MTP layer, and that layer (MtpModel)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel
    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=8,
        num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=64, max_position_embeddings=8192,
        num_hidden_layers=layers, num_mtp_layers=1, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(seed)
    target = DeepseekV3ForCausalLM(config).eval().requires_grad_(False)
    return target, MtpModel(target, 1).eval().requires_grad_(False)


def timed_run(sd, target, mtp, prompts, steps: int, budget: int) -> dict:
    """One run_simulation of `sd` (a specdec module) -> seconds per cycle of the loop and of
    the drafter's session, the cycles, the tokens."""
    drafter = sd.MtpDrafter(target, mtp, steps=steps)
    spent, started = [0.0], [0.0]
    real_start = drafter.start

    def clocked(call):
        def run(*args):
            t = time.perf_counter()
            out = call(*args)
            spent[0] += time.perf_counter() - t
            return out
        return run

    def start(prompts, view, config):
        session = real_start(prompts, view, config)
        session.propose, session.advance = clocked(session.propose), clocked(session.advance)
        started[0] = time.perf_counter()  # the loop starts here: prefills not counted
        return session
    drafter.start = start
    config = sd.LoopConfig(sd.SamplingParams(1.0), steps, budget, target.config.vocab_size,
                           frozenset(), torch.device("cpu"), seed=1)
    seqs = [sd.TokenSequence(p) for p in prompts]
    with torch.no_grad():
        rows = sd.run_simulation(target, drafter, seqs, config, batch_size=len(prompts))
    loop = time.perf_counter() - started[0]
    cycles = max(r.cycles for r in rows.values())  # the batch's cycles: its longest row's
    return {"cycle": loop / cycles, "draft": spent[0] / cycles, "cycles": cycles,
            "tokens": [rows[i].tokens for i in range(len(prompts))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="HEAD~1", help="the git revision to compare with")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--rows", type=int, default=1, help="prompts in the batch")
    ap.add_argument("--budget", type=int, default=32, help="tokens per row")
    ap.add_argument("--steps", type=int, default=1, help="MTP steps (gamma = steps)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(1)
    versions = dict(zip(("before", "now"), before_and_now(args.before)))
    target, mtp = model(args.vocab, args.hidden, args.layers)
    g = torch.Generator().manual_seed(0)
    print(f"DeepSeek-V3 stand-in: hidden {args.hidden}, {args.layers} layers, vocabulary "
          f"{args.vocab}, 1 MTP layer run for {args.steps} step(s); batch {args.rows}, "
          f"{args.budget} tokens a row, T 1; before = {args.before}\n")
    print("| L | cycles | s/cycle before | s/cycle now | now/before | drafter s/cycle before "
          "| drafter s/cycle now | now/before | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for length in args.lengths:
        prompts = torch.randint(args.vocab, (args.rows, length), generator=g).tolist()
        r = {name: timed_run(sd, target, mtp, prompts, args.steps, args.budget)
             for name, sd in versions.items()}
        b, n = r["before"], r["now"]
        print(f"| {length} | {n['cycles']} | {b['cycle']:.4f} | {n['cycle']:.4f} | "
              f"{n['cycle'] / b['cycle']:.2f} | {b['draft']:.4f} | {n['draft']:.4f} | "
              f"{n['draft'] / b['draft']:.2f} | {'yes' if b['tokens'] == n['tokens'] else 'NO'} "
              f"|", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
