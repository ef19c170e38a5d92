"""A real draft with another tokenizer, made on this machine: SmolLM2-135M's first 24 layers
speaking GPT-2's vocabulary.

    pip download openai-whisper==20250625 --no-deps --no-binary :all: -d /tmp/whisper
    python benchmarks/cross_vocab_draft.py --whisper /tmp/whisper/openai_whisper-20250625.tar.gz \
        --out /tmp/smol24-gpt2

GPT-2's tokenizer ships inside the openai-whisper package (whisper/assets/gpt2.tiktoken: the
50,256 byte-level BPE ranks; its <|endoftext|> is id 50256). It is rebuilt here as a
transformers tokenizer (the ranks give the merges: a token's merge is the split of it into two
tokens whose merged rank it is, ordered by rank) and checked against its own round trip.

The draft is SmolLM2-135M-Instruct's first 24 of 30 decoder layers, final norm and (tied) head,
given GPT-2's vocabulary by embedding transplant: a GPT-2 token whose bytes are a SmolLM2
token takes that token's row; any other takes the mean of the rows of SmolLM2's tokens for
its bytes. The two vocabularies are both byte-level BPE but trained apart: different sizes
(50,257 and 49,152), different ids, a shared part specdec reports. Against the full SmolLM2 it
is an early-exit draft whose tokenizer is not its target's: a pair whose same-tokenizer
version (--draft-layers 24) is measured too.
"""
import argparse
import base64
import os
import sys
import tarfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import specdec as sd  # noqa: E402

GGUF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "models",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


def gpt2_tokenizer(sdist: str):
    """GPT-2's tokenizer from the ranks file inside an openai-whisper source archive."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("assets/gpt2.tiktoken"))
        lines = tar.extractfile(member).read().decode().splitlines()
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in lines if ln)}
    chars = {b: c for c, b in sd._byte_chars().items()}  # byte -> GPT-2's printable stand-in

    def spell(b: bytes) -> str:
        return "".join(chars[x] for x in b)
    merges = []
    for token, rank in ranks.items():  # every split of a token into two tokens is a merge
        splits = [(token[:i], token[i:]) for i in range(1, len(token))  # of its rank (the
                  if token[:i] in ranks and token[i:] in ranks]  # pieces a word holds then
        for a, b in sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]])):  # vary)
            merges.append((rank, ranks[a], ranks[b], spell(a), spell(b)))
    vocab = {spell(t): r for t, r in ranks.items()}
    tk = Tokenizer(models.BPE(vocab, [m[3:] for m in sorted(merges)]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>")
    tok.add_special_tokens({"eos_token": "<|endoftext|>"})
    text = "Speculative decoding: a draft proposes, the target verifies. 2 + 2 = 4; café!\n"
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok) == 50257
    assert tok("hello world")["input_ids"] == [31373, 995]  # GPT-2's own ids
    return tok


@torch.no_grad()
def transplant(gguf: str, tok_g, layers: int = 24):
    """SmolLM2's first `layers` layers with GPT-2's vocabulary (see the module docstring)."""
    from transformers import LlamaForCausalLM
    smol, tok_s, _ = sd.load_model_and_tokenizer(gguf, "cpu", "float32", progress=False)
    texts_s = {k: i for i, k in enumerate(sd.token_texts(tok_s)) if k is not None}
    emb = smol.get_input_embeddings().weight  # (49152, 576), tied to the head
    chars = sd._byte_chars()
    rows = []
    for piece_id, key in enumerate(sd.token_texts(tok_g)):
        if key in texts_s:
            rows.append(emb[texts_s[key]])
            continue
        text = key[1] if isinstance(key, tuple) else "".join(
            {b: c for c, b in chars.items()}[x] for x in key)
        pieces = tok_s.backend_tokenizer.model.tokenize(text)  # (none: a byte SmolLM2 never
        rows.append(emb[[texts_s[bytes(chars[c] for c in p.value)] for p in pieces]].mean(0)
                    if pieces else emb.mean(0))  # saw, such as 0xC0: the mean row)
    config = smol.config.to_dict()
    config.update(num_hidden_layers=layers, vocab_size=len(tok_g), tie_word_embeddings=True,
                  bos_token_id=tok_g.eos_token_id, eos_token_id=tok_g.eos_token_id,
                  pad_token_id=None)
    config.pop("layer_types", None)
    draft = LlamaForCausalLM(type(smol.config)(**config))
    state = {k: v for k, v in smol.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    state["model.embed_tokens.weight"] = torch.stack(rows)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    draft.load_state_dict(state, strict=True)
    return draft.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--whisper", required=True, help="openai-whisper's source archive")
    ap.add_argument("--out", required=True, help="the draft's folder, written")
    ap.add_argument("--gguf", default=GGUF)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    tok = gpt2_tokenizer(args.whisper)
    draft = transplant(args.gguf, tok, args.layers)
    draft.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out}: {args.layers} layers, vocabulary {len(tok):,}")


if __name__ == "__main__":
    main()
