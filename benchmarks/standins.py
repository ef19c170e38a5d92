"""Stand-ins the tests and the benchmarks both build: a char tokenizer of V ids, and tiny
checkpoints of every drafter layout that needs one (MTP layers of a DeepSeek-V3, a Gemma-4
target with its assistant, EAGLE-3 heads, Medusa heads), with fixed seeds, no downloads.

test_specdec.py imports them from here (`from benchmarks.standins import ...`, the repository
root on its path), and so do benchmarks/same_numbers.py and benchmarks/transformers_cycles.py
(`import standins`, beside them): a benchmark imports specdec and this, never the test file.
"""
import json
import os

import torch
from tokenizers import Tokenizer, models, normalizers
from transformers import PreTrainedTokenizerFast


V = 48  # stand-in vocabulary


CHARS = list(" abcdefghijklmnopqrstuvwxyz0123456789.,?!:'\n-")


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tokenizer(swap: tuple[str, str] | None = None, template: bool = True):
    """Character-level tokenizer (BPE with no merges), ids 0..47; `swap` permutes two ids."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    assert len(vocab) == V
    if swap:
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    if template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def make_mtp_checkpoint(folder, heads: int, noise: float, layers: int = 2, seed: int = 0,
                        live: bool = False):
    """A tiny DeepSeek-V3 with `heads` MTP layers, saved as such checkpoints are: the MTP
    layers are decoder layers numbered after the model's own, plus enorm, hnorm, eh_proj and
    shared_head.norm. The target is a bigram model (attention and MLP outputs zeroed) and each
    head's eh_proj is [I | 0] + noise: with noise 0 a head predicts exactly the target's next
    choice, with noise it often does not. live: the MTP layers' attention and MLP are kept,
    their attention weights times 10, so what an MTP query attends over its history changes
    its argmax at about a third of the positions."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
              n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    big = DeepseekV3ForCausalLM(DeepseekV3Config(num_hidden_layers=layers + heads,
                                                 num_mtp_layers=heads, **kw))
    with torch.no_grad():
        for name, p in big.named_parameters():
            mtp_layer = any(f"layers.{layers + k}." in name for k in range(heads))
            if "layers." in name and ("o_proj" in name or "down_proj" in name) and not (
                    live and mtp_layer):
                p.zero_()
            if live and mtp_layer and "self_attn" in name and "norm" not in name:
                p.mul_(10.0)
    big.save_pretrained(folder)
    weights = load_file(f"{folder}/model.safetensors")
    for k in range(heads):
        pre = f"model.layers.{layers + k}."
        weights[pre + "enorm.weight"] = torch.ones(32)
        weights[pre + "hnorm.weight"] = torch.ones(32)
        weights[pre + "shared_head.norm.weight"] = big.model.norm.weight.detach().clone()
        weights[pre + "eh_proj.weight"] = torch.cat([torch.eye(32), torch.zeros(32, 32)], 1) \
            + noise * torch.randn(32, 64)
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    cfg = DeepseekV3Config.from_pretrained(folder)
    cfg.num_hidden_layers = layers
    cfg.save_pretrained(folder)


def load_mtp_target(folder):
    from transformers import DeepseekV3ForCausalLM
    target = DeepseekV3ForCausalLM.from_pretrained(folder).eval().requires_grad_(False)
    heads = target.config.num_mtp_layers
    # DeepSeek-V3 names its MTP layers model.layers.61.* (the real model's count); point the
    # instance at this tiny model's layers 2.. instead
    target._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{2 + k}\."
                                                 for k in range(heads)]
    return target


def make_gemma4_pair(attention: bool, noise: float, seed: int = 0, k: int = 3,
                     swap: bool = False, window: int = 64, assistant_window: int | None = None):
    """A tiny Gemma-4 text target (a bigram model: its attention and MLP outputs zeroed) and a
    tiny Gemma4AssistantForCausalLM that drafts f(token) through pre_projection = [I | 0] +
    noise (on the embedding's half); swap: its head confuses a few tokens. With
    attention=False the assistant's own attention outputs are zeroed too, so what
    it reads from the target's cache cannot matter. window: the target's sliding window (and
    the assistant's, unless assistant_window is given)."""
    from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM,
                              Gemma4ForCausalLM, Gemma4TextConfig)
    common = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                  sliding_window=window, max_position_embeddings=256,
                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, vocab_size=V,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    target = Gemma4ForCausalLM(Gemma4TextConfig(
        hidden_size=32, tie_word_embeddings=False, intermediate_size=64, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common))
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
        text_config=dict(model_type="gemma4_text", hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                         **{**common, "sliding_window": assistant_window or window}),
        backbone_hidden_size=32, use_ordered_embeddings=False))
    with torch.no_grad():
        for model in (target, assistant) if not attention else (target,):
            for name, p in model.named_parameters():
                if "o_proj" in name or "down_proj" in name:
                    p.zero_()
        assistant.pre_projection.weight.copy_(
            torch.cat([torch.eye(32) + noise * torch.randn(32, 32), torch.zeros(32, 32)], 1))
        assistant.model.norm.weight.copy_(target.model.norm.weight)
        head = target.lm_head.weight.clone()
        head[[3, 4, 5, 6, 7, 8]] = head[[8, 7, 6, 5, 4, 3]]  # wrong about a few tokens
        assistant.model.embed_tokens.weight.copy_(head if swap else target.lm_head.weight)
    assistant.lm_head.weight = assistant.model.embed_tokens.weight
    assistant.generation_config.num_assistant_tokens = k
    for m in (target, assistant):
        m.generation_config.eos_token_id = m.generation_config.pad_token_id = None
    return target.eval().requires_grad_(False), assistant.eval().requires_grad_(False)


def make_eagle3_checkpoint(folder, fmt: str, target, seed: int = 0, draft_vocab: int = 32,
                           zero: bool = False):
    """A tiny EAGLE-3 head for `target` (hidden 32, 4 heads of 8, 2 KV heads) saved as `fmt`
    publishes it: "specforge" (Llama-like config, architectures LlamaForCausalLMEagle3,
    midlayer.* in safetensors), "speculators" (speculators_model_type eagle3, the layer's
    settings in transformer_layer_config, layers.0.*, a verifier_* tensor to ignore) or
    "eagle" (the original EAGLE-3 layout: midlayer.* in pytorch_model.bin, with its own
    embed_tokens). The draft vocabulary is `draft_vocab` of the target's ids, d2t their
    offsets. zero: every weight zero but the norms (a head whose q is uniform on its
    vocabulary). Returns (the tensors, the draft vocabulary's target ids)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, t_h, inter = 32, target.config.hidden_size, 48
    ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values


    def rnd(*shape, scale=0.3):
        return torch.zeros(shape) if zero else scale * torch.randn(*shape, generator=g)
    w = {"midlayer.self_attn.q_proj.weight": rnd(32, 2 * h),
         "midlayer.self_attn.k_proj.weight": rnd(16, 2 * h),
         "midlayer.self_attn.v_proj.weight": rnd(16, 2 * h),
         "midlayer.self_attn.o_proj.weight": rnd(h, 32),
         "midlayer.mlp.gate_proj.weight": rnd(inter, h),
         "midlayer.mlp.up_proj.weight": rnd(inter, h),
         "midlayer.mlp.down_proj.weight": rnd(h, inter),
         "fc.weight": rnd(h, 3 * t_h, scale=0.2), "lm_head.weight": rnd(draft_vocab, h, scale=1.0),
         "d2t": ids - torch.arange(draft_vocab),
         "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{n}.weight"] = torch.ones(h) + (0 if zero else rnd(h, scale=0.1))
    w["norm.weight"] = torch.ones(h)
    layer = dict(hidden_size=h, intermediate_size=inter, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, vocab_size=V,
                 max_position_embeddings=256, rope_theta=10000.0, hidden_act="silu")
    os.makedirs(folder, exist_ok=True)
    if fmt == "speculators":
        config = dict(speculators_model_type="eagle3", transformer_layer_config=layer,
                      draft_vocab_size=draft_vocab, norm_before_residual=False,
                      target_hidden_size=t_h)
        w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
        w["verifier_lm_head.weight"] = torch.zeros(V, t_h)
        save_file(w, os.path.join(folder, "model.safetensors"))
    else:
        config = dict(layer, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                      num_hidden_layers=1, draft_vocab_size=draft_vocab)
        if fmt == "eagle":
            w["embed_tokens.weight"] = target.get_input_embeddings().weight.clone()
            torch.save(w, os.path.join(folder, "pytorch_model.bin"))
        else:
            save_file(w, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return {k.replace("layers.0.", "midlayer."): v for k, v in w.items()}, ids


def make_medusa_checkpoint(folder, fmt: str, hidden: int = 32, heads: int = 3,
                           layers: int = 1, seed: int = 0, t: dict | None = None, target=None):
    """Tiny Medusa-1 heads saved as a layout teams publish, from tensors t by (head, what)
    (random when not given; returned):
      "medusa"      medusa_head.K.L.linear.*, medusa_head.K.<L>.weight in safetensors, config
                    medusa_num_heads (the layout before this round's loader)
      "fd-pt"       FasterDecoding's head-only medusa_lm_head.pt, medusa_head.state_dict()'s
                    keys K.L.linear.*, K.<L>.weight; its config claims 2 heads (FasterDecoding's
                    loader overrides it)
      "fd-st"       the same keys in medusa_lm_head.safetensors (train_legacy.py, version 2)
      "fd-v2"       medusa_lm_head.safetensors with no K.<L>: every head ends in the target's
                    own lm_head (FasterDecoding's Medusa-2 code); t's heads must be it
      "full"        a full model: `target`'s own tensors and config, medusa_head.* beside them
      "vllm"        vLLM: model_type medusa, blocks.K.layers.L.*, lm_heads.K.*
      "vllm-shared" vLLM with original_lm_head: one lm_heads.0 for all; t's heads must be equal
      "vllm-map"    vLLM with a token_map: head rows permuted, the map saying which id each is"""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    if t is None:
        t = {(k, f"w{i}"): 0.3 * torch.randn(hidden, hidden, generator=g) for k in range(heads)
             for i in range(layers)}
        t.update({(k, f"b{i}"): 0.1 * torch.randn(hidden, generator=g) for k in range(heads)
                  for i in range(layers)})
        t.update({(k, "head"): torch.randn(V, hidden, generator=g) for k in range(heads)})
    heads = max(k for k, _ in t) + 1
    layers = sum(1 for k, i in t if k == 0 and i.startswith("w"))
    os.makedirs(folder, exist_ok=True)
    fd = {f"{k}.{i[1:]}.linear.{'weight' if i[0] == 'w' else 'bias'}": v.clone()
          for (k, i), v in t.items() if i != "head"}
    fd_heads = {f"{k}.{layers}.weight": v.clone() for (k, i), v in t.items() if i == "head"}
    config = dict(medusa_num_heads=heads, medusa_num_layers=layers,
                  base_model_name_or_path="target")
    if fmt == "medusa":
        save_file({"medusa_head." + k: v for k, v in {**fd, **fd_heads}.items()},
                  os.path.join(folder, "medusa_lm_head.safetensors"))
    elif fmt == "fd-pt":
        torch.save({**fd, **fd_heads}, os.path.join(folder, "medusa_lm_head.pt"))
        config["medusa_num_heads"] = 2
    elif fmt in ("fd-st", "fd-v2"):
        save_file({**fd, **(fd_heads if fmt == "fd-st" else {})},
                  os.path.join(folder, "medusa_lm_head.safetensors"))
        config["version"] = "2"
    elif fmt == "full":
        target.save_pretrained(folder)
        from safetensors.torch import load_file
        w = load_file(os.path.join(folder, "model.safetensors"))
        w.update({"medusa_head." + k: v for k, v in {**fd, **fd_heads}.items()})
        save_file(w, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json")) as f:
            config = {**json.load(f), "medusa_num_heads": heads, "medusa_num_layers": layers}
    else:
        w = {f"blocks.{k}.layers.{i[1:]}.{'weight' if i[0] == 'w' else 'bias'}": v.clone()
             for (k, i), v in t.items() if i != "head"}
        config = dict(model_type="medusa", architectures=["MedusaModel"], num_heads=heads,
                      num_hidden_layers=layers, hidden_size=hidden, vocab_size=V,
                      medusa_fc_bias=True)
        if fmt == "vllm-shared":
            w["lm_heads.0.weight"] = t[0, "head"].clone()
            config["original_lm_head"] = True
        elif fmt == "vllm-map":
            order = torch.randperm(V, generator=g)
            w.update({f"lm_heads.{k}.weight": v[order].clone() for (k, i), v in t.items()
                      if i == "head"})
            w["token_map"] = order
        else:
            w.update({f"lm_heads.{k}.weight": v.clone() for (k, i), v in t.items()
                      if i == "head"})
        save_file(w, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return t


REPEATS = ["the cat sat on the mat and the cat sat on the", "abc abc abc abc",
           "hello hello hello world hello", "one two three one two three one", "no repeat"]


MTP_PROMPTS = ["hello there", "the cat sat", "abc", "what is 2+2?"]
