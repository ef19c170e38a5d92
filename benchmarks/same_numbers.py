"""Do two versions of specdec print the same numbers? Run it on each, then compare the files.

    python benchmarks/same_numbers.py --out before.json          # on the old checkout
    python benchmarks/same_numbers.py --out after.json           # on the new one
    python benchmarks/same_numbers.py --compare before.json after.json

It runs the CLI (`main([... --json ...])`, the interface both versions share) on a fixed set of
configurations: tiny random Llama stand-ins saved to a temporary folder (several temperatures,
top-k/top-p, simulation, several drafts, early-exit drafts, a model that emits EOS often, both
proposal rules), every drafter kind (n-gram lookup, MTP layers with their attention live, also
reused for more steps, a Gemma-4 assistant; built by test_specdec.py's factories, so the file
must sit beside the specdec.py being run), and, when ../shared/models holds it, the SmolLM2
early-exit pair. --compare lists every number that differs; `--ignore KEY` leaves a field out
(for a change that is meant to alter it).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import specdec  # noqa: E402

GGUF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "models",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")
CHARS = list(" abcdefghijklmnopqrstuvwxyz0123456789.,?!:'\n-")


def save_stand_ins(root: str) -> dict[str, str]:
    """Two unrelated tiny Llamas, one biased towards an EOS id, and a char tokenizer."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    paths = {}
    for name, seed, eos in [("target", 0, None), ("draft", 1, None), ("eos", 0, 9)]:
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=256, bos_token_id=None, eos_token_id=eos,
                          pad_token_id=None, initializer_range=0.3, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
        if eos is not None:
            with torch.no_grad():
                model.lm_head.weight[eos] += 0.5 * model.lm_head.weight[4]
        paths[name] = os.path.join(root, name)
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    data = os.path.join(root, "prompts.txt")
    with open(data, "w") as f:
        f.write("hello there\nwhat is two plus two?\nwrite a poem\nthe end\nx\n"
                "a much longer prompt that goes on for a while, with commas, and more\n")
    paths["data"] = data
    save_drafter_stand_ins(root, tok, paths)
    return paths


def save_drafter_stand_ins(root: str, tok, paths: dict[str, str]) -> None:
    """A tiny DeepSeek-V3 with two MTP layers (their attention live) and a tiny Gemma-4 target
    with its assistant, built by the test file's factories, saved with the char tokenizer."""
    import test_specdec as T
    from transformers import DeepseekV3ForCausalLM
    paths["mtp"] = os.path.join(root, "mtp")
    T.make_mtp_checkpoint(paths["mtp"], heads=2, noise=0.05, live=True)
    tok.save_pretrained(paths["mtp"])
    # the tiny model's MTP layers are its layers 2 and 3 (the real model's are 61..)
    DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\.",
                                                                r"model\.layers\.3\."]
    target, assistant = T.make_gemma4_pair(attention=True, noise=0.3, window=4)
    paths["gemma"], paths["assistant"] = (os.path.join(root, n) for n in ("gemma", "assistant"))
    target.save_pretrained(paths["gemma"])
    tok.save_pretrained(paths["gemma"])
    assistant.save_pretrained(paths["assistant"])


def configurations(paths: dict[str, str]) -> dict[str, list[str]]:
    t, d, e, data = paths["target"], paths["draft"], paths["eos"], paths["data"]
    common = ["--data", data, "--quiet", "--continuation-tokens", "14", "--batch-size", "4"]
    runs = {
        "t0.7-sim": ["--target", t, "--draft", d, "--simulate", "--gamma", "3"],
        "greedy-sim": ["--target", t, "--draft", d, "--simulate", "--temperature", "0"],
        "topk-topp-sim": ["--target", t, "--draft", d, "--simulate", "--temperature", "0.8",
                          "--top-k", "5", "--top-p", "0.9", "--gamma", "2"],
        "sweep-two-drafts": ["--target", t, "--draft", d, "--draft", t, "--temperature",
                             "0,1.3", "--simulate", "--seed", "3"],
        "early-exit": ["--target", t, "--draft-layers", "1,2", "--simulate"],
        "eos": ["--target", e, "--draft", d, "--simulate", "--temperature", "1.0"],
        "positional": ["--target", t, "--draft", d, "--estimator", "positional"],
        "prompt-scored": ["--target", t, "--draft", d, "--continuation-tokens", "0"],
        "argmax-rule-sim": ["--target", t, "--draft", d, "--simulate", "--proposal", "argmax",
                            "--temperature", "0.9"],
        "ngram-and-model-sim": ["--target", t, "--draft", "ngram", "--draft", d, "--simulate",
                                "--temperature", "1.0"],
        "mtp-sim": ["--target", paths["mtp"], "--draft", "mtp", "--simulate", "--gamma", "3"],
        "mtp-steps-argmax-sim": ["--target", paths["mtp"], "--draft", "mtp", "--mtp-steps", "3",
                                 "--proposal", "argmax", "--simulate", "--gamma", "4"],
        "assistant-sim": ["--target", paths["gemma"], "--draft", paths["assistant"],
                          "--simulate", "--gamma", "3"],
    }
    runs = {k: v + common if k != "prompt-scored" else v + common[:3] + common[5:]
            for k, v in runs.items()}
    if os.path.isfile(GGUF):
        runs["smollm2-early-exit"] = ["--target", GGUF, "--draft-layers", "24", "--simulate",
                                      "--max-samples", "8", "--continuation-tokens", "32",
                                      "--quiet"]
    return runs


def run_all(out: str, only: list[str] | None) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as root:
        paths = save_stand_ins(root)
        for name, argv in configurations(paths).items():
            if only and name not in only:
                continue
            path = os.path.join(root, name + ".json")
            with contextlib.redirect_stdout(io.StringIO()):
                rc = specdec.main(argv + ["--json", path])
            with open(path) as f:
                results[name] = {"rc": rc, "json": json.load(f)}
            print(f"{name}: exit {rc}", file=sys.stderr)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def _diff(a, b, where: str, ignore: set[str], out: list[str], new_keys: bool = False) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in ignore:
                continue
            if k not in a and new_keys:
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'after' if k in b else 'before'}")
            else:
                _diff(a[k], b[k], f"{where}.{k}", ignore, out, new_keys)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", ignore, out, new_keys)
    elif a != b and not (isinstance(a, str) and isinstance(b, str) and where.endswith(
            ("target", "draft"))):  # model names carry temporary folder names
        out.append(f"{where}: {a!r} != {b!r}")


def compare(before: str, after: str, ignore: set[str], new_keys: bool) -> int:
    with open(before) as f:
        a = json.load(f)
    with open(after) as f:
        b = json.load(f)
    out: list[str] = []
    _diff(a, b, "", ignore, out, new_keys)
    print("\n".join(out) if out else f"identical: {len(a)} runs, every number equal")
    return 1 if out else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--ignore", nargs="*", default=[], help="fields to leave out of --compare")
    ap.add_argument("--new-keys", action="store_true",
                    help="--compare: fields only the second file has are not differences")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.compare:
        sys.exit(compare(*args.compare, set(args.ignore), args.new_keys))
    run_all(args.out, args.only)
