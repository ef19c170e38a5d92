"""Do two versions of specdec print the same numbers? Run it on each, then compare the files.

    python benchmarks/same_numbers.py --out before.json          # on the old checkout
    python benchmarks/same_numbers.py --out after.json           # on the new one
    python benchmarks/same_numbers.py --compare before.json after.json

It runs the CLI (`main([... --json ...])`, the interface both versions share) on a fixed set of
configurations, every drafter kind under both proposal rules (--proposal sample, and argmax at
T > 0):
  * tiny random Llama stand-ins saved to a temporary folder: several temperatures, top-k/top-p,
    simulation, several drafts, early-exit drafts, a model that emits EOS often, the
    positional estimator, prompt scoring; a draft model, early-exit drafts and n-gram lookup
    under each rule;
  * MTP layers with their attention live (each once, and reused for --mtp-steps 3) and a
    Gemma-4 assistant, each under each rule;
  * EAGLE-3 heads for the stand-in target in the SpecForge, speculators and original EAGLE-3
    layouts, and Medusa heads in every published layout (FasterDecoding .pt/.safetensors,
    Medusa-2 on the target's head, full model, vLLM with own/shared heads and a token_map),
    each under each rule;
  * when ../shared/models holds it, SmolLM2-135M-Instruct (GGUF): the early-exit pair alone,
    and per rule one run ranking an early exit at 24 layers, n-gram lookup, a random EAGLE-3
    head (SpecForge layout, draft vocabulary of 4096 ids with d2t, aux layers 2, 15, 27) and
    random Medusa heads (FasterDecoding .pt with heads of its own; vLLM over a token_map),
    all written here with fixed seeds.
The stand-ins, the MTP model, the Gemma-4 pair and the stand-in heads are built by
benchmarks/standins.py (the factories the tests use too), so the file must sit beside the
specdec.py being run.
--only NAME... runs those configurations alone. --compare lists every number that differs;
`--ignore KEY` leaves a field out (for a change that is meant to alter it). Names of models
(fields ending in target or draft) and run_key (the hash of run_key_parts, which holds those
names) are not compared: they carry folder names.
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
EAGLE3_LAYOUTS = ["specforge", "speculators", "eagle"]
MEDUSA_LAYOUTS = ["fd-pt", "fd-st", "medusa", "full", "vllm", "vllm-map"]  # heads of their own
MEDUSA_SHARED = ["fd-v2", "vllm-shared"]  # every head ends in one output head: the target's
SMOL = dict(hidden=576, layers=30, vocab=49152, heads=9, kv_heads=3, head_dim=64,
            intermediate=1536)  # SmolLM2-135M
ROOT_NAME = "<stand-ins>"  # the temporary folder, as the saved outputs name it


def save_stand_ins(root: str) -> dict[str, str]:
    """Two unrelated tiny Llamas, one biased towards an EOS id, and a char tokenizer; then the
    drafter stand-ins (save_drafter_stand_ins, save_head_stand_ins)."""
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
    save_head_stand_ins(root, paths)
    return paths


def save_drafter_stand_ins(root: str, tok, paths: dict[str, str]) -> None:
    """A tiny DeepSeek-V3 with two MTP layers (their attention live) and a tiny Gemma-4 target
    with its assistant, built by standins' factories, saved with the char tokenizer."""
    import standins as T
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


def save_head_stand_ins(root: str, paths: dict[str, str]) -> None:
    """Draft heads for the stand-in target, by standins' factories (seeded generators of
    their own): one EAGLE-3 head (32 of the 48 ids, d2t) saved in each of EAGLE3_LAYOUTS, and
    one set of three Medusa heads saved in each of MEDUSA_LAYOUTS; MEDUSA_SHARED hold the same
    residual blocks, every head ending in the target's own lm_head. Folders eagle3-LAYOUT and
    medusa-LAYOUT."""
    import standins as T
    from transformers import LlamaForCausalLM
    target = LlamaForCausalLM.from_pretrained(paths["target"]).eval()
    for fmt in EAGLE3_LAYOUTS:
        paths[f"eagle3-{fmt}"] = os.path.join(root, f"eagle3-{fmt}")
        T.make_eagle3_checkpoint(paths[f"eagle3-{fmt}"], fmt, target, seed=1)
    t = None
    for fmt in MEDUSA_LAYOUTS:
        paths[f"medusa-{fmt}"] = os.path.join(root, f"medusa-{fmt}")
        t = T.make_medusa_checkpoint(paths[f"medusa-{fmt}"], fmt, seed=2, t=t, target=target)
    own = target.lm_head.weight.detach().clone()
    shared = {**{key: v for key, v in t.items() if key[1] != "head"},
              **{(k, "head"): own for k in range(3)}}
    for fmt in MEDUSA_SHARED:
        paths[f"medusa-{fmt}"] = os.path.join(root, f"medusa-{fmt}")
        T.make_medusa_checkpoint(paths[f"medusa-{fmt}"], fmt, t=shared, target=target)


def smollm2_embedding() -> torch.Tensor:
    """SmolLM2's token embedding, which is also its output head (tied): (49152, 576) float32,
    dequantised from the GGUF file."""
    import gguf
    tensor = next(t for t in gguf.GGUFReader(GGUF).tensors if t.name == "token_embd.weight")
    return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())


def smollm2_ids(g: torch.Generator, n: int, common: int = 3072) -> torch.Tensor:
    """n target ids, sorted: the first `common` (BPE's earliest merges, frequent tokens) and
    n - common drawn from the rest."""
    rest = common + torch.randperm(SMOL["vocab"] - common, generator=g)[:n - common]
    return torch.cat([torch.arange(common), rest]).sort().values


def save_smollm2_eagle3(folder: str, embed: torch.Tensor, seed: int = 0,
                        draft_vocab: int = 4096, aux: tuple[int, int, int] = (2, 15, 27),
                        scale: float = 0.02, norm: torch.Tensor | None = None) -> None:
    """A random EAGLE-3 head for SmolLM2 in SpecForge's layout (config architectures
    LlamaForCausalLMEagle3, draft_vocab_size, eagle_config.eagle_aux_hidden_state_layer_ids;
    midlayer.*, fc, norm, lm_head, d2t, t2d in model.safetensors). Its layer's weights are
    random (std `scale`); fc = [0 | 0 | I] + noise reads mostly the state entering the third
    aux layer (27 by default);
    lm_head is the target's own rows for the draft vocabulary (smollm2_ids) + noise (2.5 x
    scale), so it proposes real tokens and is accepted now and then; `norm`: its final norm's
    weights (the target's, for a head close to an early exit there; default ones)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = SMOL["hidden"], SMOL["intermediate"], SMOL["vocab"]
    q_width, kv_width = SMOL["heads"] * SMOL["head_dim"], SMOL["kv_heads"] * SMOL["head_dim"]

    def rnd(*shape: int, scale: float = scale) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)
    ids = smollm2_ids(g, draft_vocab)
    w = {"midlayer.self_attn.q_proj.weight": rnd(q_width, 2 * h),
         "midlayer.self_attn.k_proj.weight": rnd(kv_width, 2 * h),
         "midlayer.self_attn.v_proj.weight": rnd(kv_width, 2 * h),
         "midlayer.self_attn.o_proj.weight": rnd(h, q_width),
         "midlayer.mlp.gate_proj.weight": rnd(inter, h),
         "midlayer.mlp.up_proj.weight": rnd(inter, h),
         "midlayer.mlp.down_proj.weight": rnd(h, inter),
         "fc.weight": torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], 1) + rnd(h, 3 * h),
         "lm_head.weight": embed[ids] + rnd(draft_vocab, h, scale=2.5 * scale),
         "norm.weight": torch.ones(h) if norm is None else norm.clone(),
         "d2t": ids - torch.arange(draft_vocab),
         "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{n}.weight"] = torch.ones(h)
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=h,
                  intermediate_size=inter, num_attention_heads=SMOL["heads"],
                  num_key_value_heads=SMOL["kv_heads"], head_dim=SMOL["head_dim"],
                  num_hidden_layers=1, rms_norm_eps=1e-5, hidden_act="silu", vocab_size=vocab,
                  draft_vocab_size=draft_vocab, max_position_embeddings=8192,
                  rope_theta=100000.0, tie_word_embeddings=False,
                  eagle_config=dict(eagle_aux_hidden_state_layer_ids=list(aux)))
    os.makedirs(folder, exist_ok=True)
    save_file(w, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def save_smollm2_medusa(folder: str, fmt: str, embed: torch.Tensor, seed: int,
                        heads: int = 3, rows: int = 4096) -> None:
    """Random Medusa heads for SmolLM2 (one residual block each, W std 0.02, b std 0.01: close
    to the identity), each with an output head of its own: the target's rows + noise.
    fmt "fd-pt": FasterDecoding's head-only medusa_lm_head.pt (K.0.linear.*, K.1.weight) over
    the whole vocabulary; "vllm-map": vLLM's layout (model_type medusa, blocks.K.layers.0.*,
    lm_heads.K.weight) over a truncated vocabulary of `rows` ids (smollm2_ids, in a shuffled
    order) named by token_map."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, vocab = SMOL["hidden"], SMOL["vocab"]
    blocks = [(0.02 * torch.randn(h, h, generator=g), 0.01 * torch.randn(h, generator=g))
              for _ in range(heads)]
    ids = smollm2_ids(g, rows)[torch.randperm(rows, generator=g)] if fmt == "vllm-map" \
        else torch.arange(vocab)
    outs = [embed[ids] + 0.05 * torch.randn(len(ids), h, generator=g) for _ in range(heads)]
    os.makedirs(folder, exist_ok=True)
    if fmt == "fd-pt":
        w = {}
        for k, ((weight, bias), out) in enumerate(zip(blocks, outs)):
            w.update({f"{k}.0.linear.weight": weight, f"{k}.0.linear.bias": bias,
                      f"{k}.1.weight": out})
        torch.save(w, os.path.join(folder, "medusa_lm_head.pt"))
        config = dict(medusa_num_heads=heads, medusa_num_layers=1,
                      base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    else:
        w = {"token_map": ids}
        for k, ((weight, bias), out) in enumerate(zip(blocks, outs)):
            w.update({f"blocks.{k}.layers.0.weight": weight, f"blocks.{k}.layers.0.bias": bias,
                      f"lm_heads.{k}.weight": out})
        save_file(w, os.path.join(folder, "model.safetensors"))
        config = dict(model_type="medusa", architectures=["MedusaModel"], num_heads=heads,
                      num_hidden_layers=1, hidden_size=h, vocab_size=vocab,
                      truncated_vocab_size=rows, medusa_fc_bias=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def save_smollm2_heads(root: str, paths: dict[str, str]) -> None:
    """The SmolLM2 heads (folders smollm2-eagle3, smollm2-medusa-fd-pt, smollm2-medusa-vllm-map)."""
    embed = smollm2_embedding()
    paths["smollm2-eagle3"] = os.path.join(root, "smollm2-eagle3")
    save_smollm2_eagle3(paths["smollm2-eagle3"], embed, seed=0)
    for seed, fmt in enumerate(["fd-pt", "vllm-map"], start=1):
        paths[f"smollm2-medusa-{fmt}"] = os.path.join(root, f"smollm2-medusa-{fmt}")
        save_smollm2_medusa(paths[f"smollm2-medusa-{fmt}"], fmt, embed, seed)


def configurations(paths: dict[str, str]) -> dict[str, list[str]]:
    """Every configuration by name: argv for specdec.main, --json aside. The names are the
    keys of the output file: keep them, add new ones under new names."""
    t, d, e, data = paths["target"], paths["draft"], paths["eos"], paths["data"]
    common = ["--data", data, "--quiet", "--continuation-tokens", "14", "--batch-size", "4"]
    argmax = ["--proposal", "argmax"]
    eagle3 = [a for fmt in EAGLE3_LAYOUTS for a in ("--draft", paths[f"eagle3-{fmt}"])]
    medusa = [a for fmt in MEDUSA_LAYOUTS + MEDUSA_SHARED
              for a in ("--draft", paths[f"medusa-{fmt}"])]
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
        # every drafter kind under the rule the runs above lack
        "early-exit-argmax-sim": ["--target", t, "--draft-layers", "1,2", "--simulate",
                                  *argmax, "--temperature", "0.9"],
        "ngram-argmax-sim": ["--target", t, "--draft", "ngram", "--simulate", *argmax,
                             "--temperature", "1.0"],
        "mtp-argmax-sim": ["--target", paths["mtp"], "--draft", "mtp", "--simulate", *argmax,
                           "--gamma", "3"],
        "mtp-steps-sim": ["--target", paths["mtp"], "--draft", "mtp", "--mtp-steps", "3",
                          "--simulate", "--gamma", "4"],
        "assistant-argmax-sim": ["--target", paths["gemma"], "--draft", paths["assistant"],
                                 "--simulate", *argmax, "--gamma", "3"],
        "eagle3-sim": ["--target", t, *eagle3, "--simulate"],
        "eagle3-argmax-sim": ["--target", t, *eagle3, "--simulate", *argmax, "--gamma", "3",
                              "--temperature", "0.9"],
        "medusa-sim": ["--target", t, *medusa, "--simulate"],
        "medusa-argmax-sim": ["--target", t, *medusa, "--simulate", *argmax, "--gamma", "3",
                              "--temperature", "0.9"],
        # the heads and n-gram lookup teacher-forced alone (no simulation: a continuation of
        # the target's own)
        "heads-ngram-teacher-forced": ["--target", t, "--draft", paths["eagle3-specforge"],
                                       "--draft", paths["medusa-fd-pt"], "--draft", "ngram"],
    }
    runs = {k: v + common if k != "prompt-scored" else v + common[:3] + common[5:]
            for k, v in runs.items()}
    if os.path.isfile(GGUF):
        runs["smollm2-early-exit"] = ["--target", GGUF, "--draft-layers", "24", "--simulate",
                                      "--max-samples", "8", "--continuation-tokens", "32",
                                      "--quiet"]
        # per rule, one run ranks every SmolLM2 drafter against the same target passes
        drafters = ["--draft-layers", "24", "--draft", "ngram",
                    "--draft", paths["smollm2-eagle3"],
                    "--draft", paths["smollm2-medusa-fd-pt"],
                    "--draft", paths["smollm2-medusa-vllm-map"]]
        short = ["--simulate", "--max-samples", "6", "--continuation-tokens", "24", "--quiet"]
        runs["smollm2-drafters-sim"] = ["--target", GGUF, *drafters, *short]
        runs["smollm2-drafters-argmax-sim"] = ["--target", GGUF, *drafters, *short, *argmax]
    return runs


def _named_relative(value, root: str):
    """value (read back from JSON) with the temporary folder's name replaced by ROOT_NAME."""
    if isinstance(value, dict):
        return {k: _named_relative(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [_named_relative(v, root) for v in value]
    return value.replace(root, ROOT_NAME) if isinstance(value, str) else value


def run_all(out: str, only: list[str] | None) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as root:
        paths = save_stand_ins(root)
        if os.path.isfile(GGUF):
            save_smollm2_heads(root, paths)
        runs = configurations(paths)
        unknown = sorted(set(only or []) - set(runs))
        if unknown:
            sys.exit(f"--only: no configuration named {', '.join(unknown)} "
                     f"(there are: {', '.join(runs)})")
        for name, argv in runs.items():
            if only and name not in only:
                continue
            path = os.path.join(root, name + ".json")
            with contextlib.redirect_stdout(io.StringIO()):
                rc = specdec.main(argv + ["--json", path])
            with open(path) as f:
                results[name] = {"rc": rc, "json": _named_relative(json.load(f), root)}
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
            ("target", "draft", ".run_key"))):  # model names carry folder names; run_key
        out.append(f"{where}: {a!r} != {b!r}")  # hashes them (run_key_parts are compared)


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
