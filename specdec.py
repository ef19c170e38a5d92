"""specdec: how often would a draft model's proposals be accepted by a target model?

    python specdec.py --target TARGET --draft DRAFT [--simulate] [--temperature 0.7] [--gamma 4]

Measures the speculative-decoding acceptance rate of a target/draft pair, and the speedup it
buys, with plain forward passes on the machine you have. Two independent routes:

  * distributional (teacher-forced): alpha_t = sum_v min(p_t(v), q_t(v)) at every position of a
    continuation sampled from the target (one forward of each model per sequence);
  * generative (--simulate): the real speculative-sampling loop, draft proposals accepted with
    probability min(1, p/q), rejections resampled from normalise((p - q)+).

Papers: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling".

Notation, kept throughout: p = target distribution, q = draft distribution (as in Leviathan et
al.; Chen et al. swap the letters). gamma = draft block, the tokens proposed per cycle.
Shape legend: B batch rows, T positions, V vocabulary (the prefix both models share),
N scored positions, H hidden width, G = gamma.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import inspect
import io
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------
# sampling maths: everything here is fp32 and works on the last (vocabulary) dimension


@dataclass(frozen=True)
class SamplingParams:
    """The serving-time sampling settings, applied identically to p and q."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top-k must be a whole number >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top-p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Logits (..., V) -> the fp32 distribution a model samples from under `sampling`."""
    x = logits.float()
    if sampling.greedy:
        # temperature 0: the distribution is a point mass on the argmax
        return nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    x = x / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        kth = x.topk(sampling.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th logit are kept
    probs = torch.softmax(x, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token once the mass strictly before it already reaches top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_v min(p, q) = 1 - TV(p, q): the chance a proposal from q survives."""
    return torch.minimum(p, q).sum(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise((p - q)+), what a rejection resamples from; p itself where that is all zero."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs (..., V), uniforms u (...) in [0, 1) -> token ids (...).

    Drawing from explicit uniforms (rather than torch.multinomial) lets every prompt own its
    random stream, so a batched run makes exactly the draws of prompt-by-prompt runs.
    """
    cdf = probs.cumsum(-1)
    target = (u.to(cdf) * cdf[..., -1]).unsqueeze(-1)
    # right=True picks the first entry whose cdf exceeds u: never a zero-probability token...
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    # ...unless u rounds up to the total; then take the last token with probability > 0
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(-1)
    return torch.minimum(idx, last)


def row_generators(seed: int, indices: Sequence[int], phase: int) -> list[torch.Generator]:
    """One random stream per prompt (and per phase), independent of how prompts are batched."""
    return [torch.Generator().manual_seed(((seed * 1_000_003 + i) * 8 + phase) % (1 << 63))
            for i in indices]


def draw_uniforms(gens: list[torch.Generator], n: int, device: torch.device) -> torch.Tensor:
    """(B, n) uniforms, row b from its own stream."""
    return torch.stack([torch.rand(n, generator=g) for g in gens]).to(device)


def expected_accepted_iid(alpha: float, gamma: int) -> float:
    """E[accepted draft tokens per cycle] if every position accepts independently with alpha."""
    if alpha >= 1:
        return float(gamma)
    return alpha * (1 - alpha**gamma) / (1 - alpha)


def positional_windows(alphas: Sequence[torch.Tensor], gamma: int) -> tuple[list[float], list[int]]:
    """Per sequence: the sum over start positions of sum_k prod_{j<k} alpha_{t+j}, and the
    number of start positions (windows that fit)."""
    sums, counts = [], []
    for a in alphas:
        if a.numel() < gamma:
            sums.append(0.0)
            counts.append(0)
            continue
        windows = a.double().unfold(0, gamma, 1)  # (n - gamma + 1, G)
        sums.append(windows.cumprod(-1).sum().item())
        counts.append(windows.shape[0])
    return sums, counts


def expected_accepted_positional(alphas: Sequence[torch.Tensor], gamma: int) -> float | None:
    """Mean over start positions t of sum_{k=1..gamma} prod_{j<k} alpha_{t+j}.

    Uses the measured alpha_t sequence of each continuation, so runs of easy or hard tokens
    count as they occur. Only windows that fit inside a sequence are used.
    """
    sums, counts = positional_windows(alphas, gamma)
    return sum(sums) / sum(counts) if sum(counts) else None


def est_speedup(tokens_per_cycle: float, gamma: int, cost_ratio: float,
                verify_cost: float = 1.0) -> float:
    """Tokens per cycle over the cycle's cost in target-step units: gamma draft steps plus one
    verify pass (1 by default; measured, a (gamma+1)-token pass can cost more than a step)."""
    return tokens_per_cycle / (gamma * cost_ratio + verify_cost)


def ratio_stderr(num: Sequence[float], den: Sequence[float]) -> float | None:
    """Standard error of sum(num)/sum(den) with sequences as the independent units.

    Positions inside one sequence are correlated, so the sequence is the sampling unit
    (the linearised ratio-estimator variance).
    """
    n = len(num)
    if n < 2 or sum(den) == 0:
        return None
    r = sum(num) / sum(den)
    mean_den = sum(den) / n
    var = sum((a - r * b) ** 2 for a, b in zip(num, den)) / (n * (n - 1))
    return math.sqrt(var) / mean_den


def bootstrap_weights(n: int, n_boot: int, seed: int) -> torch.Tensor:
    """(n_boot, n) resampling counts: how often each unit is drawn in each bootstrap sample."""
    if n == 0:
        return torch.zeros(n_boot, 0, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed % (1 << 63))
    idx = torch.randint(n, (n_boot, n), generator=g)
    return torch.zeros(n_boot, n, dtype=torch.float64).scatter_add_(
        1, idx, torch.ones(n_boot, n, dtype=torch.float64))


def bootstrap_ci(num: Sequence[float], den: Sequence[float], weights: torch.Tensor,
                 level: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of sum(num)/sum(den) over resampled units (weights from above).

    The units are prompts: tokens within one prompt are correlated, so resampling tokens would
    give intervals that are too narrow.
    """
    if len(num) < 2:
        return None
    num_t = torch.tensor(num, dtype=torch.float64)
    den_t = torch.tensor(den, dtype=torch.float64)
    top, bottom = weights @ num_t, weights @ den_t  # (n_boot,)
    stats = (top / bottom)[bottom > 0]
    if not stats.numel():
        return None
    lo, hi = torch.quantile(stats, torch.tensor([(1 - level) / 2, (1 + level) / 2],
                                                dtype=torch.float64)).tolist()
    return lo, hi


def accepted_from_offsets(rates: Sequence[float | None], gamma: int) -> float | None:
    """E[accepted] at block gamma from conditional acceptance by offset: sum_k prod_{j<=k} a_j.

    A draft does not know the block size, so a shorter block accepts min(run, gamma) of the
    run a longer one would have accepted. Undefined past the offsets the simulation reached.
    """
    if gamma > len(rates):
        return None
    total, run = 0.0, 1.0
    for a in rates[:gamma]:
        if a is None:  # offset never reached: every earlier cycle was rejected before it
            break
        run *= a
        total += run
    return total


# ----------------------------------------------------------------------------------------------
# models and data


def resolve_device(name: str | None = "auto") -> torch.device:
    """auto picks cuda, then mps, then cpu."""
    if name in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here; use --device cpu")
    if name == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise ValueError("--device mps: MPS is not available here; use --device cpu")
    if name not in ("cpu", "cuda", "mps") and not name.startswith("cuda:"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or mps")
    return torch.device(name)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """auto = fp32 off CUDA (CPU half precision is slow and lossy); bf16 on CUDA where it runs."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, float32, float16 or bfloat16")
    return DTYPES[name]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _from_pretrained(transformers: Any, name: str, source: str, dtype: torch.dtype,
                     kwargs: dict, progress: bool) -> tuple[Any, nn.Module]:
    config = transformers.AutoConfig.from_pretrained(source, **kwargs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{name!r} is not a causal language model (its type is "
                         f"{config.model_type!r}); give a decoder-only LM such as Llama or GPT-2")
    tok = transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    # the GGUF reader draws its own progress bar, which nothing else switches off
    with contextlib.redirect_stderr(sys.stderr if progress else io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    return tok, model


@contextlib.contextmanager
def _quiet_loggers(*names: str, bars: bool = False):
    """Silence the loaders' warnings (and, with bars, their progress bars) for a while, then put
    the caller's settings back: importing specdec must not change anyone's logging."""
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    hf_logging = None  # set when we switched transformers' bars off and owe them back
    if bars and "transformers" in names:
        from transformers.utils import logging as hf_logging
        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
        else:
            hf_logging = None
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
        if hf_logging is not None:
            hf_logging.enable_progress_bar()


def _cached(repo_id: str) -> bool:
    """True if the hub cache already holds a config for repo_id (so no network is needed)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the hub library rejects is simply not cached
        return False


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check, so a machine without network fails in seconds, not after retries."""
    import socket
    from urllib.parse import urlparse
    try:
        from huggingface_hub import constants
        url = urlparse(constants.ENDPOINT)
    except Exception:
        return True  # cannot tell: let transformers try
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_model_and_tokenizer(name: str, device: torch.device | str | None = None,
                             dtype: torch.dtype | str | None = None,
                             use_unsloth: bool = False, progress: bool = True
                             ) -> tuple[nn.Module, Any, torch.device]:
    """Load a causal LM and its tokenizer from a hub id, a local folder or a .gguf file.

    Returns (model in eval mode, tokenizer, device). GGUF weights are dequantised.
    progress=False silences the loaders' own progress bars.
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {}
    source = name
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(name):
            raise ValueError(f"GGUF file not found: {name!r}; check the path")
        try:
            import gguf  # noqa: F401  (transformers needs it to read the file)
        except ImportError:
            raise ValueError("reading .gguf files needs the gguf package: pip install gguf")
        source, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(name)), os.path.basename(name)
    elif os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"folder {name!r} holds no config.json: not a saved model "
                         f"(save_pretrained writes one)")
    elif not os.path.exists(os.path.expanduser(name)) and (
            name.startswith((".", "~", os.path.sep)) or name.count("/") > 1):
        raise ValueError(f"model folder not found: {name!r}; check the path")  # not a hub id
    if use_unsloth:
        return _load_unsloth(name, device, dtype)

    import transformers
    if not os.path.exists(source) and not _cached(source) and not _hub_reachable():
        raise ValueError(f"could not load {name!r}: no such local folder or .gguf file, not in "
                         f"the hub cache, and the hub is unreachable from here; download it "
                         f"where there is a network, or give a local path")
    try:
        with _quiet_loggers("transformers", "huggingface_hub", bars=not progress):
            tok, model = _from_pretrained(transformers, name, source, dtype, kwargs, progress)
    except ValueError as e:
        if "is not a causal language model" in str(e):
            raise
        if "Unrecognized configuration class" in str(e) or "AutoModelForCausalLM" in str(e):
            raise ValueError(f"{name!r} is not a causal language model "
                             f"(AutoModelForCausalLM cannot load it)") from None
        raise ValueError(f"could not load {name!r}: {_one_line(e)}") from None
    except OSError as e:
        raise ValueError(f"could not load {name!r}: not a model folder, .gguf file or hub id "
                         f"that can be read ({_one_line(e)[:200]})") from None
    except Exception as e:  # a corrupt or unsupported checkpoint: say so, not a traceback
        raise ValueError(f"could not load {name!r} ({type(e).__name__}: "
                         f"{_one_line(e)[:200]})") from None
    model.to(device).eval().requires_grad_(False)
    return model, tok, device


def _load_unsloth(name: str, device: torch.device, dtype: torch.dtype):
    """--use-unsloth: load through unsloth.FastLanguageModel (CUDA only)."""
    if not torch.cuda.is_available() or device.type != "cuda":
        raise ValueError("--use-unsloth needs a CUDA GPU; drop the flag to load with transformers")
    try:
        from unsloth import FastLanguageModel
    except ImportError:
        raise ValueError("--use-unsloth: unsloth is not installed (pip install unsloth), "
                         "or drop the flag") from None
    model, tok = FastLanguageModel.from_pretrained(name, dtype=dtype, load_in_4bit=False)
    FastLanguageModel.for_inference(model)
    return model.eval(), tok, device


_LAYER_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers",
                "transformer.layers", "model.language_model.layers", "transformer.blocks")


def _layer_path(model: nn.Module) -> list[str]:
    for path in _LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return path.split(".")
    raise ValueError(f"--draft-layers: cannot find the decoder layer list of "
                     f"{type(model).__name__} (looked for {', '.join(_LAYER_PATHS)})")


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object with dicts of its own (children, parameters, buffers, hooks) that
    hold the same tensors, so changing one module's structure leaves the other's alone."""
    clone = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, dict):
            setattr(clone, name, copy.copy(value))
    return clone


def early_exit_draft(model: nn.Module, n_layers: int) -> nn.Module:
    """A self-speculative draft: the first n_layers decoder layers + final norm + head of `model`.

    Shares every weight with `model` (no copy in memory); `model` itself is left unchanged.
    """
    path = _layer_path(model)
    parent: Any = model
    for part in path:
        parent = getattr(parent, part)
    total = len(parent)
    if not 1 <= n_layers <= total:
        raise ValueError(f"--draft-layers must be between 1 and {total} for this model "
                         f"({total} decoder layers), got {n_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layers]
    draft = node = _shallow_copy(model)
    copies = [draft]  # the modules on the path to the layer list, now the draft's own
    for part in path[:-1]:
        node = _shallow_copy(getattr(node, part))
        setattr(copies[-1], part, node)
        copies.append(node)
    setattr(node, path[-1], nn.ModuleList(list(parent)[:n_layers]))
    for m in copies:
        if hasattr(m, "config"):
            m.config = config
    if getattr(model, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(model.generation_config)
    return draft


def params_per_token(model: nn.Module) -> int:
    """Parameters a model multiplies per token: all but embedding lookups, head counted once."""
    lookups = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
               for p in m.parameters()}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in lookups:
            total += p.numel()
        seen.add(id(p))
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in lookups:  # tied head: a matmul, not a lookup
        total += head.weight.numel()
    return total


def vocab_width(model: nn.Module) -> int:
    """Rows of the output head: the width of the logits."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "weight"):
        return head.weight.shape[0]
    return int(model.config.vocab_size)


def check_tokenizers(tok_p: Any, tok_q: Any, n_shared: int) -> None:
    """Refuse a pair whose tokenizers map a shared id to different tokens."""
    if tok_p is tok_q:
        return
    n = min(n_shared, len(tok_p), len(tok_q))
    ids = list(range(n))
    a, b = tok_p.convert_ids_to_tokens(ids), tok_q.convert_ids_to_tokens(ids)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise ValueError(f"target and draft tokenizers disagree (id {i} is {x!r} for the "
                             f"target, {y!r} for the draft): speculative decoding needs a "
                             f"shared tokenizer; pick a draft from the target's family")


def eos_ids(model: nn.Module, tok: Any = None) -> set[int]:
    """Token ids that end a generation (the generation config's, config's and tokenizer's)."""
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(getattr(model, "config", None), "eos_token_id", None),
                  getattr(tok, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class Prompt(NamedTuple):
    content: str | list  # a plain prompt, or chat messages [{"role", "content"}, ...]
    category: str | None = None


BUILTIN_PROMPTS: list[tuple[str, str]] = [
    ("chat", "What are three good habits for staying focused while working from home?"),
    ("chat", "My friend is sad because her cat died. What could I say to comfort her?"),
    ("chat", "Can you recommend a weekend itinerary for a first visit to Lisbon?"),
    ("chat", "Why is the sky blue? Explain it to a ten-year-old."),
    ("chat", "What is the difference between a virus and a bacterium?"),
    ("chat", "How do I politely decline a meeting invitation from my manager?"),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("code", "Explain what this does: `sorted(d.items(), key=lambda kv: kv[1], reverse=True)`"),
    ("code", "Write a SQL query that finds the five customers with the highest total orders."),
    ("code", "Write a bash one-liner that counts the lines of every .py file in a folder."),
    ("code", "Implement binary search in JavaScript and explain its time complexity."),
    ("code", "Fix the bug: `def avg(xs): return sum(xs) / len(xs) if xs else sum(xs)`"),
    ("maths", "A train travels 180 km in 2.5 hours. What is its average speed in km/h?"),
    ("maths", "Solve for x: 3x + 7 = 22. Show each step."),
    ("maths", "What is the derivative of x^3 * sin(x)?"),
    ("maths", "If I roll two fair dice, what is the probability that the sum is 7?"),
    ("maths", "A shirt costs $40 after a 20% discount. What was the original price?"),
    ("maths", "Prove that the sum of two even numbers is even."),
    ("summarisation", "Summarise in two sentences: The city council voted on Tuesday to "
     "expand the bike-lane network by 40 kilometres over the next three years, funded by a "
     "parking-fee increase. Supporters cited safety data; opponents worried about shops."),
    ("summarisation", "Summarise the plot of Romeo and Juliet in three sentences."),
    ("summarisation", "Give a one-paragraph summary of how photosynthesis works."),
    ("summarisation", "Summarise the main causes of the First World War in a short list."),
    ("summarisation", "TL;DR: Our quarterly revenue grew 12% thanks to the new subscription "
     "plan, but costs rose 18% because of cloud spending and two new offices."),
    ("translation", "Translate into French: 'The library opens at nine and closes at six.'"),
    ("translation", "Translate into Spanish: 'Could you tell me where the train station is?'"),
    ("translation", "Translate into German: 'I would like a coffee with milk, please.'"),
    ("translation", "Translate into English: 'Il pleut depuis ce matin, prends un parapluie.'"),
    ("translation", "Translate into Italian: 'We are going to the beach tomorrow morning.'"),
    ("creative", "Write a short poem about the first snow of winter."),
    ("creative", "Write the opening paragraph of a mystery story set on a night train."),
    ("creative", "Invent a name and a slogan for a bakery that only sells bread made at night."),
    ("creative", "Write a limerick about a forgetful robot."),
    ("creative", "Describe a sunset over the sea without using the words red or orange."),
    ("extraction", "List every date in this text: 'The contract was signed on 3 March 2021, "
     "renewed on 1 April 2022 and ended on 30 June 2023.'"),
    ("extraction", "Extract the name, email and phone number: 'Contact Maria Lopez at "
     "maria.lopez@example.com or call 555-0142.'"),
    ("extraction", "From this review, list the pros and cons: 'Battery life is great and the "
     "screen is sharp, but it is heavy and the speakers are weak.'"),
    ("extraction", "Return JSON with the fields city and temperature: 'It is 23 degrees in "
     "Madrid today.'"),
    ("extraction", "Which programming languages are mentioned? 'We rewrote the Python "
     "service in Go, kept the Rust parser and dropped the old Perl scripts.'"),
]


def _pick_field(record: dict, where: str) -> Prompt:
    """A prompt from one JSON record: chat messages, or the first usual text field."""
    category = next((str(record[k]) for k in ("category", "task", "type") if k in record), None)
    messages = record.get("messages") or record.get("conversations")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        roles = {"human": "user", "gpt": "assistant"}  # ShareGPT's names
        turns = [{"role": roles.get(m.get("role", m.get("from")), m.get("role", m.get("from"))),
                  "content": m.get("content", m.get("value", ""))} for m in messages]
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()  # the target writes the answer itself
        if turns:
            return Prompt(turns, category)
    for key in ("prompt", "instruction", "question", "input", "text", "content", "query"):
        if isinstance(record.get(key), str) and record[key].strip():
            return Prompt(record[key], category)
    raise ValueError(f"{where}: no usable prompt field; saw fields {sorted(record)}; "
                     f"expected one of prompt, instruction, question, input, text, messages")


def load_texts(source: str = "builtin") -> list[Prompt]:
    """Prompts from `builtin`, a .txt file (one per line), a .jsonl/.json file, or
    hf:NAME[:CONFIG][:SPLIT][:FIELD] (NAME a hub data set or a local dataset folder)."""
    if source == "builtin":
        # interleave the categories, so that --max-samples N still spans all of them
        by_cat: dict[str, list[str]] = {}
        for cat, text in BUILTIN_PROMPTS:
            by_cat.setdefault(cat, []).append(text)
        rounds = max(len(v) for v in by_cat.values())
        return [Prompt(v[i], cat) for i in range(rounds) for cat, v in by_cat.items()
                if i < len(v)]
    if source.startswith("hf:"):
        prompts = _load_hf(source)
    else:
        if not os.path.isfile(source):
            raise ValueError(f"data file not found: {source!r}; give builtin, a .txt, .jsonl or "
                             f".json file, or hf:NAME")
        try:
            with open(source, encoding="utf-8") as f:
                raw = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read data file {source!r}: {_one_line(e)}") from None
        if source.endswith(".jsonl"):
            prompts = []
            for n, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{source}:{n}: not valid JSON ({e.msg})") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{source}:{n}: expected a JSON object per line")
                    prompts.append(_pick_field(record, f"{source}:{n}"))
        elif source.endswith(".json"):
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
            if isinstance(data, dict):  # {"data": [...]} or similar: the first list inside
                data = next((v for v in data.values() if isinstance(v, list)), None)
            if not isinstance(data, list):
                raise ValueError(f"{source}: expected a JSON list of prompts or records")
            prompts = [Prompt(x) if isinstance(x, str) else _pick_field(x, f"{source}[{i}]")
                       for i, x in enumerate(data) if isinstance(x, (str, dict))]
        else:
            prompts = [Prompt(line) for line in raw.splitlines() if line.strip()]
    prompts = [p for p in prompts if p.content]
    if not prompts:
        raise ValueError(f"data source {source!r} holds no prompts")
    return prompts


def _load_hf(spec: str) -> list[Prompt]:
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 4:
        raise ValueError(f"malformed {spec!r}: use hf:NAME[:CONFIG][:SPLIT][:FIELD]")
    name, config, split, fieldname = (parts + [None] * 4)[:4]
    try:
        import datasets
    except ImportError:
        raise ValueError("hf: data needs the datasets package: pip install datasets") from None
    local = os.path.isdir(name)
    if not local and not _hub_reachable():
        raise ValueError(f"could not load data set {name!r}: not a local folder and the hub is "
                         f"unreachable from here; save it with save_to_disk where there is a "
                         f"network and pass that folder")
    try:
        if local and (os.path.exists(os.path.join(name, "dataset_info.json"))
                      or os.path.exists(os.path.join(name, "dataset_dict.json"))):
            ds = datasets.load_from_disk(name)
        else:
            with _quiet_loggers("datasets", "huggingface_hub"):
                ds = datasets.load_dataset(name, config or None)
        if isinstance(ds, datasets.DatasetDict):
            split = split or next((x for x in ("test", "train") if x in ds), next(iter(ds)))
            if split not in ds:
                raise ValueError(f"{spec}: no split {split!r}; it has {sorted(ds)}")
            ds = ds[split]
    except ValueError:
        raise
    except Exception as e:  # datasets raises many types for "not found / no network"
        raise ValueError(f"could not load data set {name!r}: {_one_line(e)[:200]}") from None
    if fieldname:
        if fieldname not in ds.column_names:
            raise ValueError(f"{spec}: no field {fieldname!r}; fields are {ds.column_names}")
        cat = next((c for c in ("category", "task", "type") if c in ds.column_names), None)
        cats = [str(c) for c in ds[cat]] if cat else [None] * len(ds)
        return [Prompt(str(x), c) for x, c in zip(ds[fieldname], cats)]
    return [_pick_field(dict(r), spec) for r in ds]


class TokenSequence(NamedTuple):
    ids: list[int]
    category: str | None = None
    truncated: bool = False


def build_sequences(prompts: Sequence[Prompt | str], tokenizer: Any, *,
                    max_samples: int | None = None, max_length: int = 512,
                    chat_template: str = "auto") -> list[TokenSequence]:
    """Tokenise prompts; the chat template wraps them where the tokenizer has one.

    Prompts longer than max_length keep their last max_length tokens (the part the model
    continues).
    """
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {max_samples}")
    if max_length < 1:
        raise ValueError(f"--max-length must be >= 1, got {max_length}")
    if chat_template not in ("auto", "on", "off"):
        raise ValueError(f"--chat-template must be auto, on or off, got {chat_template!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has_template:
        raise ValueError("--chat-template on: this tokenizer has no chat template; use off")
    use_template = has_template and chat_template != "off"
    out = []
    for prompt in list(prompts)[:max_samples]:
        prompt = Prompt(prompt) if isinstance(prompt, str) else prompt
        content = prompt.content
        if use_template:
            messages = content if isinstance(content, list) else [
                {"role": "user", "content": content}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            if isinstance(content, list):
                content = "\n".join(f"{m['role']}: {m['content']}" for m in content)
            ids = tokenizer(content)["input_ids"]
        ids = list(ids)
        if ids:
            out.append(TokenSequence(ids[-max_length:], prompt.category, len(ids) > max_length))
    if not out:
        raise ValueError("no prompt produced any tokens; check the data source")
    return out


# ----------------------------------------------------------------------------------------------
# batched forward passes with masked (dead) cache slots
#
# Rows of a batch hold sequences of different lengths, and during simulation they accept
# different numbers of drafted tokens. Rather than cropping caches row by row, every row's cache
# grows by the same number of physical slots; slots that hold padding or rejected tokens are
# switched off in the 2-D attention mask, and each token gets its logical position id
# explicitly. A cached forward over valid slots then computes exactly what an unpadded,
# uncached forward over the row's tokens computes.


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """transformers renamed past_key_values to cache during 5.x: the name this class takes."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                  cache: Any, last_only: bool = False) -> tuple[torch.Tensor, Any]:
    """ids/pos (B, t), mask (B, past + t) -> logits (B, t or 1, V_model), cache."""
    kwargs = {"logits_to_keep": 1} if last_only else {}
    name = _cache_keyword(type(model))
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                **{name: cache}, **kwargs)
    logits = out.logits[:, -1:] if last_only else out.logits
    return logits, out["cache"] if "cache" in out else out.past_key_values


def left_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Token rows -> ids, mask, logical positions, each (B, T), padding on the left."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        if r:
            ids[b, width - len(r):] = torch.tensor(r)
            mask[b, width - len(r):] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def check_finite(x: torch.Tensor, name: str, where: Callable[[int], str]) -> None:
    """Refuse NaN/inf outputs: x is (R, ..., V); where(r) names row r for the user."""
    ok = torch.isfinite(x).reshape(x.shape[0], -1).all(1)  # (R,)
    if not ok.all():
        raise FloatingPointError(f"the {name} model produced non-finite logits at "
                                 f"{where(int((~ok).nonzero()[0]))}; try --dtype float32 or "
                                 f"check the checkpoint")


def _batches(order: Sequence[int], size: int) -> list[list[int]]:
    order = list(order)
    return [order[i:i + size] for i in range(0, len(order), size)]


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        enabled = False
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, desc):
        pass

    def close(self):
        pass


# ----------------------------------------------------------------------------------------------
# the target's continuation


@torch.no_grad()
def sample_continuations(target: nn.Module, seqs: Sequence[TokenSequence],
                         sampling: SamplingParams, n_tokens: int, *, device: torch.device,
                         vocab: int, eos: set[int], seed: int = 0, batch_size: int = 8,
                         indices: Sequence[int] | None = None, bar: Any = None
                         ) -> list[list[int]]:
    """Sample up to n_tokens from the target after each prompt (stopping at EOS), KV-cached.

    indices[i] names prompt i's random stream (default i), so any batching gives the same draws.
    """
    indices = list(range(len(seqs))) if indices is None else list(indices)
    bar = bar or _NoBar()
    conts: list[list[int]] = [[] for _ in seqs]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))  # similar lengths batch
    for batch in _batches(order, batch_size):
        gens = row_generators(seed, [indices[i] for i in batch], phase=1)
        ids, mask, pos = left_pad([seqs[i].ids for i in batch], device)
        logits, cache = model_forward(target, ids, mask, pos, None, last_only=True)
        next_pos = pos[:, -1:] + 1  # (B, 1)
        alive = [True] * len(batch)
        for step in range(n_tokens):
            check_finite(logits, "target", lambda r: f"prompt {indices[batch[r]]}, "
                                                     f"continuation token {step + 1}")
            probs = processed_probs(logits[:, -1, :vocab], sampling)  # (B, V)
            token = sample_from(probs, draw_uniforms(gens, 1, device)[:, 0])  # (B,)
            for b, t in enumerate(token.tolist()):
                if alive[b]:
                    conts[batch[b]].append(t)
                    alive[b] = t not in eos
            bar.update(len(batch))
            if not any(alive) or step == n_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits, cache = model_forward(target, token[:, None], mask, next_pos, cache)
            next_pos = next_pos + 1
    return conts


# ----------------------------------------------------------------------------------------------
# teacher-forced measurement: alpha_t = sum min(p_t, q_t) on the target's own continuation


def _head_route(model: nn.Module, probe: torch.Tensor) -> bool:
    """True if head(base_model(x)) reproduces model(x).logits, so logits can be made in chunks."""
    base, head = getattr(model, "base_model", None), model.get_output_embeddings()
    if base is None or base is model or head is None:
        return False
    try:
        full = model(input_ids=probe).logits
        via = head(base(input_ids=probe).last_hidden_state)
    except Exception:
        return False
    return full.shape == via.shape and torch.allclose(full.float(), via.float(), atol=1e-4,
                                                      rtol=1e-4)


@torch.no_grad()
def scored_outputs(model: nn.Module, rows: Sequence[Sequence[int]],
                   spans: Sequence[tuple[int, int]], device: torch.device,
                   head_route: bool) -> torch.Tensor:
    """One teacher-forced forward of right-padded rows; the outputs at scored positions.

    spans[b] = (start, end): positions start..end-1 of row b predict its scored tokens.
    Returns hidden states (N, H) when head_route, else logits (N, V_model).
    """
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = torch.arange(width, device=device).expand(len(rows), width)
    if head_route:
        out = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos,
                               use_cache=False)
        states = out.last_hidden_state  # (B, T, H)
    else:
        states = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       use_cache=False).logits  # (B, T, V)
    return torch.cat([states[b, s:e] for b, (s, e) in enumerate(spans)])  # (N, H or V)


def _logits(model: nn.Module, states: torch.Tensor, head_route: bool) -> torch.Tensor:
    return model.get_output_embeddings()(states) if head_route else states


@torch.no_grad()
def position_stats(target: nn.Module, draft: nn.Module, hp: torch.Tensor, hq: torch.Tensor,
                   sampling: SamplingParams, vocab: int, routes: tuple[bool, bool],
                   chunk: int | None = None,
                   where: Callable[[int], str] = lambda n: f"scored position {n}"
                   ) -> dict[str, torch.Tensor]:
    """Per-position acceptance numbers (N,) from scored outputs, a chunk of positions at a time.

    Only a (chunk, V) slice of fp32 probabilities ever exists, whatever N and V are.
    where(n) names scored position n in error messages.
    """
    chunk = chunk or max(16, (1 << 24) // vocab)
    alpha, top1, p_of_q = [], [], []
    for s in range(0, hp.shape[0], chunk):
        lp = _logits(target, hp[s:s + chunk], routes[0])[..., :vocab]  # (n, V)
        lq = _logits(draft, hq[s:s + chunk], routes[1])[..., :vocab]
        check_finite(lp, "target", lambda n: where(s + n))
        check_finite(lq, "draft", lambda n: where(s + n))
        p, q = processed_probs(lp, sampling), processed_probs(lq, sampling)
        a = acceptance(p, q)  # (n,)
        assert -1e-4 <= a.min() and a.max() <= 1 + 1e-4, \
            f"alpha outside [0, 1]: {a.min()}, {a.max()}"
        alpha.append(a.clamp(0, 1))  # only float rounding is clamped, never a wrong value
        top1.append((lp.argmax(-1) == lq.argmax(-1)).float())
        p_of_q.append(p.gather(-1, lq.argmax(-1, keepdim=True)).squeeze(-1))
    return {"alpha": torch.cat(alpha).cpu(), "top1": torch.cat(top1).cpu(),
            "p_argmax_q": torch.cat(p_of_q).cpu()}


# ----------------------------------------------------------------------------------------------
# simulation: the real speculative-sampling loop, many prompts as one batch


@dataclass
class RowStats:
    """What one prompt's simulated cycles produced."""

    accepted: int = 0  # draft tokens accepted (all cycles)
    examined: int = 0  # draft tokens examined: up to and including the first rejection
    cycles: int = 0  # complete (uncensored) cycles
    cycle_accepted: int = 0  # accepted tokens in complete cycles
    censored: int = 0  # cycles cut short by the token budget or EOS
    reached: list[int] = field(default_factory=list)  # cycles that examined offset j (1..G)
    accepted_at: list[int] = field(default_factory=list)  # cycles that accepted offset j
    tokens: list[int] = field(default_factory=list)  # emitted tokens


def _record_cycle(row: RowStats, drafted: list[int], n_acc: int, new_token: int, gamma: int,
                  budget: int, eos: set[int]) -> bool:
    """Account one cycle of one row; returns True when the row is finished.

    A cycle is censored (counted for alpha, not for lengths) when EOS ends it among the accepted
    drafts, or when the token budget left at its start could not hold a full cycle (gamma + 1
    tokens). The budget rule looks only at the start, never at the outcome: censoring the
    cycles that happened to accept more than the room left would bias lengths downwards.
    """
    emitted = drafted[:n_acc] + [new_token]
    cut = next((i + 1 for i, t in enumerate(drafted[:n_acc]) if t in eos), None)
    if cut is not None:  # EOS among accepted drafts: nothing after it is examined or emitted
        examined = accepted = cut
        emitted = emitted[:cut]
    else:
        examined, accepted = min(n_acc + 1, gamma), n_acc
    room = budget - len(row.tokens)
    censored = cut is not None or room < gamma + 1
    row.tokens += emitted[:room]
    row.accepted += accepted
    row.examined += examined
    for j in range(examined):
        row.reached[j] += 1
        row.accepted_at[j] += j < accepted
    if censored:
        row.censored += 1
    else:
        row.cycles += 1
        row.cycle_accepted += accepted
    return cut is not None or len(row.tokens) >= budget or emitted[-1] in eos


@torch.no_grad()
def run_simulation(target: nn.Module, draft: nn.Module, seqs: Sequence[TokenSequence],
                   sampling: SamplingParams, gamma: int, n_tokens: int, *,
                   device: torch.device, vocab: int, eos: set[int], seed: int = 0,
                   batch_size: int = 8, indices: Sequence[int] | None = None, bar: Any = None
                   ) -> dict[int, RowStats]:
    """Speculative sampling from every prompt, up to n_tokens each; statistics per prompt.

    Each cycle: the draft proposes gamma tokens autoregressively from its own output, the target
    scores all gamma+1 positions in one forward, proposal i is accepted with probability
    min(1, p_i(d_i)/q_i(d_i)), the first rejection is replaced by a draw from
    normalise((p - q)+), and a fully accepted block earns a bonus token from p_{gamma+1}.
    Results are keyed by indices[i] (default i), which also names prompt i's random stream.
    """
    indices = list(range(len(seqs))) if indices is None else list(indices)
    bar = bar or _NoBar()
    rows: dict[int, RowStats] = {}
    G = gamma
    steps = torch.arange(G + 1, device=device)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    for batch in _batches(order, batch_size):
        gens = row_generators(seed, [indices[i] for i in batch], phase=2)
        stats = [RowStats(reached=[0] * G, accepted_at=[0] * G) for _ in batch]
        prompts = [seqs[i].ids for i in batch]
        # Invariant: both caches hold every emitted token but the last ("pending") one.
        ids, mask_p, pos = left_pad([r[:-1] for r in prompts], device)  # (B, P-1)
        cache_p = cache_q = None
        if ids.shape[1]:
            _, cache_p = model_forward(target, ids, mask_p, pos, None, last_only=True)
            _, cache_q = model_forward(draft, ids, mask_p, pos, None, last_only=True)
        mask_q = mask_p.clone()
        pending = torch.tensor([r[-1] for r in prompts], device=device)  # (B,)
        npos = torch.tensor([len(r) - 1 for r in prompts], device=device)  # pending's position
        prev_tok = pending.clone()  # last cycle's d_G, which the draft has not yet seen
        prev_ok = torch.zeros_like(pending)  # 1 where that d_G was accepted
        any_prev = False  # whether any row has such a token (known on the host)
        live = list(range(len(batch)))  # batch rows still generating, in tensor-row order
        while live:
            B = len(live)
            u = draw_uniforms([gens[b] for b in live], 2 * G + 1, device)  # (B, 2G+1)
            # Step 1: the draft proposes d_1..d_G. Its first forward feeds the pending token,
            # preceded, when some row accepted a whole block, by last cycle's d_G (a slot that
            # is masked out in the rows that did not).
            if any_prev:
                x = torch.stack([prev_tok, pending], 1)  # (B, 2)
                pos = torch.stack([(npos - 1).clamp_min(0), npos], 1)
                mask_q = torch.cat([mask_q, prev_ok[:, None], torch.ones_like(x[:, :1])], 1)
            else:
                x, pos = pending[:, None], npos[:, None]  # (B, 1)
                mask_q = torch.cat([mask_q, torch.ones_like(x)], 1)
            logits, cache_q = model_forward(draft, x, mask_q, pos, cache_q, last_only=True)
            qs, ds = [], []
            finite_q = torch.ones(B, dtype=torch.bool, device=device)
            for i in range(G):
                finite_q &= torch.isfinite(logits).flatten(1).all(1)
                q = processed_probs(logits[:, -1, :vocab], sampling)  # (B, V)
                d = sample_from(q, u[:, i])  # (B,)
                qs.append(q)
                ds.append(d)
                if i < G - 1:
                    mask_q = torch.cat([mask_q, torch.ones_like(mask_q[:, :1])], 1)
                    logits, cache_q = model_forward(draft, d[:, None], mask_q,
                                                    (npos + 1 + i)[:, None], cache_q)
            q = torch.stack(qs, 1)  # (B, G, V)
            d = torch.stack(ds, 1)  # (B, G)
            # Step 2: one target forward scores the pending token and all G proposals.
            x = torch.cat([pending[:, None], d], 1)  # (B, G+1)
            mask_p = torch.cat([mask_p, torch.ones_like(x)], 1)
            lp, cache_p = model_forward(target, x, mask_p, npos[:, None] + steps, cache_p)
            p = processed_probs(lp[..., :vocab], sampling)  # (B, G+1, V)
            # Step 3: accept d_i with probability min(1, p/q); n_acc = length of accepted run.
            p_d = p[:, :G].gather(-1, d[..., None]).squeeze(-1)  # (B, G)
            q_d = q.gather(-1, d[..., None]).squeeze(-1)  # (B, G), > 0: d was drawn from q
            accept = u[:, G:2 * G] * q_d < p_d
            n_acc = accept.long().cumprod(1).sum(1)  # (B,)
            # Step 4: the next token comes from the residual at the first rejection; after a
            # full block, q is taken as zero there, so the residual is p_{G+1} (the bonus).
            q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)  # (B, G+1, V)
            rows_b = torch.arange(B, device=device)
            new = sample_from(residual(p[rows_b, n_acc], q_pad[rows_b, n_acc]), u[:, 2 * G])
            finite_p = torch.isfinite(lp).flatten(1).all(1)
            host = torch.cat([n_acc[:, None], new[:, None], d, finite_p[:, None],
                              finite_q[:, None]], 1).tolist()  # the cycle's one host sync
            for r, b in enumerate(live):
                for name, ok in (("target", host[r][-2]), ("draft", host[r][-1])):
                    if not ok:
                        raise FloatingPointError(
                            f"the {name} model produced non-finite logits at prompt "
                            f"{indices[batch[b]]}, position {int(npos[r])} (simulation); try "
                            f"--dtype float32 or check the checkpoint")
            still = []
            for r, b in enumerate(live):
                n_b, new_b, drafted = host[r][0], host[r][1], host[r][2:2 + G]
                before = len(stats[b].tokens)
                if _record_cycle(stats[b], drafted, n_b, new_b, G, n_tokens, eos):
                    rows[indices[batch[b]]] = stats[b]
                else:
                    still.append(r)
                bar.update(len(stats[b].tokens) - before)
            # Rejected slots are switched off; trailing ones rejected in every row are cropped.
            kept = (steps[:G] < n_acc[:, None]).long()  # (B, G)
            mask_p[:, -G:] = kept
            if G > 1:
                mask_q[:, -(G - 1):] = kept[:, :G - 1]
            top = max(host[r][0] for r in range(B))
            dead_p, dead_q = G - top, G - 1 - min(top, G - 1)
            for cache, dead in ((cache_p, dead_p), (cache_q, dead_q)):
                if dead:
                    cache.crop(-dead)  # negative: the number of slots to drop
            mask_p = mask_p[:, :mask_p.shape[1] - dead_p]
            mask_q = mask_q[:, :mask_q.shape[1] - dead_q]
            prev_ok, prev_tok, pending, npos = kept[:, -1], d[:, -1], new, npos + n_acc + 1
            if len(still) < B:  # finished rows leave the batch
                live = [live[r] for r in still]
                if not live:
                    break
                keep = torch.tensor(still, device=device)
                cache_p.batch_select_indices(keep)
                cache_q.batch_select_indices(keep)
                mask_p, mask_q, prev_ok, prev_tok, pending, npos = (
                    t[keep] for t in (mask_p, mask_q, prev_ok, prev_tok, pending, npos))
            any_prev = any(host[r][0] == G for r in still)
    return rows


@torch.no_grad()
def simulate_reference(target: nn.Module, draft: nn.Module, seqs: Sequence[TokenSequence],
                       sampling: SamplingParams, gamma: int, n_tokens: int, *,
                       device: torch.device, vocab: int, eos: set[int],
                       seed: int = 0) -> dict[int, RowStats]:
    """The same loop written plainly: one prompt at a time, every forward over the whole prefix.

    Slow (quadratic in length) and kept as an oracle for `run_simulation` and as the benchmark's
    no-cache baseline. Same random streams, so it makes the same draws.
    """
    rows = {}
    for index, seq in enumerate(seqs):
        gen = row_generators(seed, [index], phase=2)[0]
        row = RowStats(reached=[0] * gamma, accepted_at=[0] * gamma)
        prefix = list(seq.ids)
        while True:
            u = torch.rand(2 * gamma + 1, generator=gen)
            drafted, qs = [], []
            for i in range(gamma):
                logits = draft(input_ids=torch.tensor([prefix + drafted], device=device)).logits
                q = processed_probs(logits[0, -1, :vocab], sampling)
                drafted.append(int(sample_from(q, u[i])))
                qs.append(q)
            logits = target(input_ids=torch.tensor([prefix + drafted], device=device)).logits
            ps = processed_probs(logits[0, -gamma - 1:, :vocab], sampling)  # (G+1, V)
            n_acc = 0
            while n_acc < gamma and u[gamma + n_acc] * qs[n_acc][drafted[n_acc]] \
                    < ps[n_acc, drafted[n_acc]]:
                n_acc += 1
            q_next = qs[n_acc] if n_acc < gamma else torch.zeros_like(ps[0])
            new = int(sample_from(residual(ps[n_acc], q_next), u[2 * gamma]))
            before = len(row.tokens)
            finished = _record_cycle(row, drafted, n_acc, new, gamma, n_tokens, eos)
            prefix += row.tokens[before:]
            if finished:
                break
        rows[index] = row
    return rows


# ----------------------------------------------------------------------------------------------
# what a cycle costs


@torch.no_grad()
def measure_costs(target: nn.Module, draft: nn.Module, ids: Sequence[int], gammas: Sequence[int],
                  device: torch.device, repeats: int = 7) -> dict[str, Any]:
    """Time one cached decode step of each model and a (gamma+1)-token verify pass of the target.

    Batch 1, after a prefill of `ids` and two warm-up calls; median of `repeats`. The cache is
    rolled back after every call so each one sees the same context length.
    """
    def timed(model: nn.Module, n_new: int) -> float:
        ctx = torch.tensor([list(ids)], device=device)
        ones = torch.ones_like(ctx)
        _, cache = model_forward(model, ctx, ones, torch.arange(ctx.shape[1], device=device)[None],
                                 None, last_only=True)
        length = cache.get_seq_length()
        x = ctx[:, -1:].expand(1, n_new)
        mask = torch.ones(1, length + n_new, dtype=torch.long, device=device)
        pos = torch.arange(length, length + n_new, device=device)[None]
        times = []
        for i in range(repeats + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            logits, cache = model_forward(model, x, mask, pos, cache)
            logits[0, -1, 0].item()  # wait for the device
            if i >= 2:
                times.append(time.perf_counter() - start)
            cache.crop(length - cache.get_seq_length())  # negative: drop the new slots
        return sorted(times)[len(times) // 2]

    step_p, step_q = timed(target, 1), timed(draft, 1)
    verify = {g: timed(target, g + 1) / step_p for g in gammas}
    return {"target_step_s": step_p, "draft_step_s": step_q, "cost_ratio": step_q / step_p,
            "verify_cost": verify, "device": str(device)}


# ----------------------------------------------------------------------------------------------
# the measurement and its report

GAMMA_TABLE = range(1, 9)  # block sizes the best-gamma table considers
N_BOOT = 1000  # bootstrap resamples for the confidence intervals


@dataclass
class AcceptanceReport:
    """Every number the text report shows (simulation fields are None without simulate)."""

    target: str
    draft: str
    temperature: float
    top_k: int
    top_p: float
    gamma: int
    cost_ratio: float  # one draft step in target steps
    cost_ratio_source: str
    verify_cost: float  # the (gamma+1)-token verify pass in target steps (1 unless measured)
    # distributional (teacher-forced)
    alpha: float | None
    alpha_std: float | None  # std of the per-sequence means
    alpha_stderr: float | None  # standard error of alpha, sequences as units
    alpha_ci: tuple[float, float] | None  # 95% bootstrap over prompts
    scored_positions: int
    n_sequences: int
    scored_on: str  # "continuation" or "prompt"
    estimator: str  # which estimator expected_accepted uses: positional or iid
    expected_accepted: float | None
    expected_accepted_iid: float | None
    expected_accepted_positional: float | None
    tokens_per_cycle: float | None
    tokens_per_cycle_ci: tuple[float, float] | None
    est_speedup: float | None
    est_speedup_ci: tuple[float, float] | None
    greedy_agreement: float | None  # top-1 agreement of the raw logits
    p_argmax_q: float | None  # mean p(argmax q): acceptance of a draft that proposes its argmax
    alpha_by_category: dict[str, float] | None
    sequences_by_category: dict[str, int] | None
    gamma_table: list[dict[str, Any]] | None  # per gamma: tokens per cycle and speedup
    best_gamma: int | None  # the gamma of the table with the highest teacher-forced speedup
    # generative (simulation)
    empirical_alpha: float | None = None
    empirical_alpha_stderr: float | None = None
    empirical_alpha_ci: tuple[float, float] | None = None
    accepted_tokens: int | None = None
    examined_tokens: int | None = None
    cycles: int | None = None  # complete cycles
    censored_cycles: int | None = None
    mean_accepted_length: float | None = None
    empirical_tokens_per_cycle: float | None = None
    empirical_tokens_per_cycle_ci: tuple[float, float] | None = None
    empirical_est_speedup: float | None = None
    empirical_est_speedup_ci: tuple[float, float] | None = None
    alpha_by_draft_offset: list[float | None] | None = None  # P(accept j | j reached)
    reached_by_draft_offset: list[int] | None = None
    accepted_per_cycle_by_draft_offset: list[float] | None = None  # P(accept j), all cycles
    generated_tokens: int | None = None
    simulated_prompts: int | None = None
    # context
    vocab: int = 0
    truncated_prompts: int = 0
    partial: bool = False
    progress_note: str | None = None
    costs: dict[str, Any] | None = None  # the timings behind a measured cost ratio
    # per prompt, for analyses of one's own: index, category, scored positions, alpha_sum
    # (sum of alpha_t) and, with simulate, accepted, examined, cycles, cycle_accepted
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_settings(gamma: int, continuation_tokens: int, batch_size: int,
                   cost_ratio: float | str | None, simulate: bool, seed: int) -> None:
    """Refuse measurement settings outside their ranges (before any model work is done)."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"--gamma must be a whole number >= 1, got {gamma}")
    if continuation_tokens < 0:
        raise ValueError(f"--continuation-tokens must be >= 0, got {continuation_tokens}")
    if simulate and continuation_tokens < 1:
        raise ValueError("--simulate needs --continuation-tokens >= 1 (its token budget per "
                         "prompt)")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"--seed must be in 0..{2**32 - 1}, got {seed}")
    if cost_ratio not in (None, "auto", "measure") and not (
            isinstance(cost_ratio, (int, float)) and 0 <= cost_ratio < math.inf):
        raise ValueError(f"--cost-ratio must be a number >= 0, auto or measure, "
                         f"got {cost_ratio!r}")


def cost_model(target: nn.Module, draft: nn.Module, cost_ratio: float | str | None,
                sequences: list[TokenSequence], gamma: int, device: torch.device
                ) -> dict[str, Any]:
    """cost ratio c, verify cost per gamma (in target steps) and where they came from."""
    gammas = sorted(set(GAMMA_TABLE) | {gamma})
    if cost_ratio == "measure":
        m = measure_costs(target, draft, sequences[0].ids, gammas, device)
        m["source"] = (f"measured on {m['device']}: draft step {m['draft_step_s'] * 1e3:.1f} ms, "
                       f"target step {m['target_step_s'] * 1e3:.1f} ms, "
                       f"verify of {gamma + 1} tokens {m['verify_cost'][gamma]:.2f} target steps")
        return m
    if cost_ratio in (None, "auto"):
        ratio = params_per_token(draft) / params_per_token(target)
        source = "parameters per token, draft/target"
    else:
        ratio, source = float(cost_ratio), "given"
    return {"cost_ratio": ratio, "verify_cost": {g: 1.0 for g in gammas}, "source": source}


def measure_acceptance(target: nn.Module, draft: nn.Module, sequences: Sequence[TokenSequence],
                       *, sampling: SamplingParams = SamplingParams(),
                       device: torch.device | str | None = None, gamma: int = 4,
                       cost_ratio: float | str | None = None, continuation_tokens: int = 64,
                       simulate: bool = False, seed: int = 0, batch_size: int = 8,
                       estimator: str = "iid", progress: bool = False,
                       eos: set[int] | None = None, target_name: str = "target",
                       draft_name: str = "draft") -> AcceptanceReport:
    """Measure acceptance of `draft` against `target` on tokenised prompts.

    The arguments are those of `measure_drafts`, for one draft. Note the library's default
    sampling is SamplingParams() = temperature 1, no top-k/top-p; the CLI's is 0.7.
    """
    return measure_drafts(target, [(draft_name, draft)], sequences, sampling=sampling,
                          device=device, gamma=gamma, cost_ratio=cost_ratio,
                          continuation_tokens=continuation_tokens, simulate=simulate,
                          seed=seed, batch_size=batch_size, estimator=estimator,
                          progress=progress, eos=eos, target_name=target_name)[0]


def measure_drafts(target: nn.Module, drafts: Sequence[tuple[str, nn.Module]],
                   sequences: Sequence[TokenSequence], *,
                   sampling: SamplingParams = SamplingParams(),
                   device: torch.device | str | None = None, gamma: int = 4,
                   cost_ratio: float | str | None = None, continuation_tokens: int = 64,
                   simulate: bool = False, seed: int = 0, batch_size: int = 8,
                   estimator: str = "iid", progress: bool = False,
                   eos: set[int] | None = None, target_name: str = "target",
                   costs: Sequence[dict[str, Any]] | None = None
                   ) -> list[AcceptanceReport]:
    """Measure each (name, draft) against one set of target continuations and target passes.

    Prompts go through in batches, each batch start to finish (continuation, teacher-forced
    scoring, simulation), so a Ctrl-C (KeyboardInterrupt) leaves whole batches measured: the
    reports then cover what finished and are marked partial.
    cost_ratio: one draft step's cost in target steps; None or "auto" = ratio of parameters
    used per token; "measure" = timed on `device` (see measure_costs).
    estimator: "iid" (default; the closed form, which the simulation agreed with better on real
    pairs, see the README) or "positional" for E[accepted]; the report carries both.
    eos: ids that end a continuation (default: the target's generation config).
    costs: per draft, a cost model from `cost_model` made earlier (overrides cost_ratio), so a
    sweep can reuse one timing.
    """
    check_settings(gamma, continuation_tokens, batch_size, cost_ratio, simulate, seed)
    if estimator not in ("positional", "iid"):
        raise ValueError(f"estimator must be positional or iid, got {estimator!r}")
    if not sequences or not drafts:
        raise ValueError("nothing to measure: no sequences or no drafts")
    K = continuation_tokens
    sequences = [s if isinstance(s, TokenSequence) else TokenSequence(list(s)) for s in sequences]
    if K == 0 and all(len(s.ids) < 2 for s in sequences):
        raise ValueError("with --continuation-tokens 0 the prompts are scored, but every prompt "
                         "has fewer than 2 tokens: nothing to score; raise --max-length or use "
                         "--continuation-tokens > 0")
    device = device if isinstance(device, torch.device) else resolve_device(device)
    eos = eos_ids(target) if eos is None else set(eos)
    vp = vocab_width(target)
    vocab = min([vp] + [vocab_width(d) for _, d in drafts])
    if any(max(s.ids) >= vocab for s in sequences):
        raise ValueError(f"a prompt holds a token id >= {vocab}, outside the shared vocabulary")
    if costs is None:
        costs = [cost_model(target, draft, cost_ratio, sequences, gamma, device)
                 for _, draft in drafts]

    # per draft, per prompt index: teacher-forced numbers per position, and simulation stats
    data = [{"alpha": {}, "top1": {}, "p_argmax_q": {}, "sim": {}} for _ in drafts]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    bar = _progress(len(sequences) * K * (1 + simulate * len(drafts)), "measuring", progress)
    probe = torch.tensor([sequences[order[-1]].ids[:16]], device=device)
    route_p = _head_route(target, probe)
    routes_q = [_head_route(d, probe) for _, d in drafts]
    interrupted = False
    try:
        for batch in _batches(order, batch_size):
            sub = [sequences[i] for i in batch]
            # 1. the target's own continuation: the text speculative decoding would produce
            bar.set_description("continuations")
            conts = (sample_continuations(target, sub, sampling, K, device=device, vocab=vocab,
                                          eos=eos, seed=seed, batch_size=len(sub),
                                          indices=batch, bar=bar)
                     if K else [[] for _ in sub])
            # 2. teacher-forced alpha_t at every scored position; one target pass for all drafts
            bar.set_description("teacher-forced")
            rows = [s.ids + c for s, c in zip(sub, conts)]
            spans = [(len(s.ids) - 1, len(s.ids) - 1 + len(c)) if K else (0, len(s.ids) - 1)
                     for s, c in zip(sub, conts)]
            sizes = [e - s for s, e in spans]
            labels = [(i, t) for i, (s, e) in zip(batch, spans) for t in range(s, e)]
            hp = scored_outputs(target, rows, spans, device, route_p)  # (N, H or V)
            for k, (_, draft) in enumerate(drafts):
                hq = scored_outputs(draft, rows, spans, device, routes_q[k])
                st = position_stats(target, draft, hp, hq, sampling, vocab, (route_p, routes_q[k]),
                                    where=lambda n: "prompt {}, position {}".format(*labels[n]))
                for key, values in st.items():
                    data[k][key].update(zip(batch, values.split(sizes)))
            # 3. the real thing: speculative sampling from every prompt of the batch
            if simulate:
                bar.set_description("simulation")
                for k, (_, draft) in enumerate(drafts):
                    # whole batches only: the rows of a batch that finish first are the
                    # fast-accepting ones, so a cut batch would bias a partial report upwards
                    data[k]["sim"].update(run_simulation(
                        target, draft, sub, sampling, gamma, K, device=device, vocab=vocab,
                        eos=eos, seed=seed, batch_size=len(sub), indices=batch, bar=bar))
    except KeyboardInterrupt:
        interrupted = True
    bar.close()
    reports = []
    for (name, draft), d, cost in zip(drafts, data, costs):
        r = _summarise(d, sequences, sampling=sampling, gamma=gamma, K=K, estimator=estimator,
                       cost=cost, simulate=simulate, interrupted=interrupted, seed=seed,
                       target_name=target_name, draft_name=name, vocab=vocab)
        vq = vocab_width(draft)
        if vq != vp:
            r.notes.insert(0, f"vocab widths differ (target {vp}, draft {vq}): both cut to the "
                              f"first {vocab} ids before sampling; exact only if the surplus "
                              f"rows are padding")
        reports.append(r)
    return reports


def _summarise(d: dict, sequences: list[TokenSequence], *, sampling: SamplingParams,
               gamma: int, K: int, estimator: str, cost: dict[str, Any], simulate: bool,
               interrupted: bool, seed: int, target_name: str, draft_name: str,
               vocab: int) -> AcceptanceReport:
    """Per-prompt measurements of one draft -> its report."""
    c, verify = cost["cost_ratio"], cost["verify_cost"]
    keep = sorted(i for i, a in d["alpha"].items() if a.numel())
    alphas = [d["alpha"][i] for i in keep]
    n_pos = sum(a.numel() for a in alphas)
    if not n_pos and not interrupted:
        raise ValueError("nothing to score: no scored position in any sequence; use longer "
                         "prompts or --continuation-tokens > 0")
    weights = bootstrap_weights(len(alphas), N_BOOT, seed)
    alpha = alpha_std = alpha_se = alpha_ci = exp_iid = exp_pos = agree = p_q = None
    by_cat = n_cat = expected = tpc_ci = table = best = None
    used = "positional" if estimator == "positional" else "iid"
    if n_pos:
        sums = [a.double().sum().item() for a in alphas]
        counts = [a.numel() for a in alphas]
        alpha = sum(sums) / n_pos
        means = torch.tensor([s / n for s, n in zip(sums, counts)], dtype=torch.float64)
        alpha_std = means.std().item() if len(means) > 1 else 0.0
        alpha_se = ratio_stderr(sums, counts)
        alpha_ci = bootstrap_ci(sums, counts, weights)
        exp_iid = expected_accepted_iid(alpha, gamma)
        exp_pos = expected_accepted_positional(alphas, gamma)
        if exp_pos is None:
            used = "iid"  # no continuation is gamma tokens long
        if used == "positional":
            expected = exp_pos
            tpc_ci = bootstrap_ci(*positional_windows(alphas, gamma), weights)
        else:
            expected = exp_iid
            tpc_ci = None if alpha_ci is None else tuple(
                expected_accepted_iid(a, gamma) for a in alpha_ci)
        tpc_ci = None if tpc_ci is None else (tpc_ci[0] + 1, tpc_ci[1] + 1)
        agree = torch.cat([d["top1"][i] for i in keep]).double().mean().item()
        p_q = torch.cat([d["p_argmax_q"][i] for i in keep]).double().mean().item()
        cats = [sequences[i].category for i in keep]
        if any(x is not None for x in cats):
            names = sorted({x for x in cats if x is not None})
            by_cat = {x: torch.cat([a for a, y in zip(alphas, cats) if y == x]).double()
                      .mean().item() for x in names}
            n_cat = {x: cats.count(x) for x in names}
        table = []
        for g in sorted(verify):
            e = expected_accepted_positional(alphas, g) if used == "positional" \
                else expected_accepted_iid(alpha, g)
            if e is not None:
                table.append({"gamma": g, "tokens_per_cycle": e + 1,
                              "est_speedup": est_speedup(e + 1, g, c, verify[g])})
        best = max(table, key=lambda row: row["est_speedup"])["gamma"] if table else None
    tpc = None if expected is None else expected + 1
    report = AcceptanceReport(
        target=target_name, draft=draft_name, temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p, gamma=gamma, cost_ratio=c,
        cost_ratio_source=cost["source"], verify_cost=verify[gamma], alpha=alpha,
        alpha_std=alpha_std, alpha_stderr=alpha_se, alpha_ci=alpha_ci, scored_positions=n_pos,
        n_sequences=len(alphas), scored_on="continuation" if K > 0 else "prompt",
        estimator=used, expected_accepted=expected, expected_accepted_iid=exp_iid,
        expected_accepted_positional=exp_pos, tokens_per_cycle=tpc, tokens_per_cycle_ci=tpc_ci,
        est_speedup=None if tpc is None else est_speedup(tpc, gamma, c, verify[gamma]),
        est_speedup_ci=None if tpc_ci is None else tuple(
            est_speedup(x, gamma, c, verify[gamma]) for x in tpc_ci),
        greedy_agreement=agree, p_argmax_q=p_q, alpha_by_category=by_cat,
        sequences_by_category=n_cat, gamma_table=table, best_gamma=best, vocab=vocab,
        truncated_prompts=sum(s.truncated for s in sequences),
        costs={k: v for k, v in cost.items() if k != "source"} if "device" in cost else None)
    if simulate and d["sim"]:
        _fill_simulation(report, [d["sim"][i] for i in sorted(d["sim"])], seed, verify)
    for i in sorted(set(keep) | set(d["sim"])):
        row: dict[str, Any] = {"index": i, "category": sequences[i].category}
        if i in d["alpha"]:
            row.update(scored=d["alpha"][i].numel(), alpha_sum=d["alpha"][i].double().sum().item())
        if i in d["sim"]:
            sim = d["sim"][i]
            row.update(accepted=sim.accepted, examined=sim.examined, cycles=sim.cycles,
                       cycle_accepted=sim.cycle_accepted, censored=sim.censored)
        report.per_prompt.append(row)
    if interrupted:
        report.partial = True
        done_sim = f", {len(d['sim'])} of {len(sequences)} prompts simulated" if simulate else ""
        report.progress_note = (f"interrupted: {len(alphas)} of {len(sequences)} sequences "
                                f"scored{done_sim}")
    _add_notes(report, sampling, K)
    return report


def _fill_simulation(report: AcceptanceReport, rows: list[RowStats], seed: int,
                     verify: dict[int, float]) -> None:
    """Simulation numbers of a report, from the per-prompt statistics."""
    gamma, c = report.gamma, report.cost_ratio
    acc, exam = [r.accepted for r in rows], [r.examined for r in rows]
    cycles = sum(r.cycles for r in rows)
    all_cycles = cycles + sum(r.censored for r in rows)
    weights = bootstrap_weights(len(rows), N_BOOT, seed + 1)
    report.accepted_tokens, report.examined_tokens = sum(acc), sum(exam)
    report.cycles, report.censored_cycles = cycles, all_cycles - cycles
    report.generated_tokens = sum(len(r.tokens) for r in rows)
    report.simulated_prompts = len(rows)
    report.empirical_alpha = sum(acc) / sum(exam) if sum(exam) else None
    report.empirical_alpha_stderr = ratio_stderr(acc, exam)
    report.empirical_alpha_ci = bootstrap_ci(acc, exam, weights)
    if cycles:
        report.mean_accepted_length = sum(r.cycle_accepted for r in rows) / cycles
        report.empirical_tokens_per_cycle = report.mean_accepted_length + 1
        report.empirical_est_speedup = est_speedup(report.empirical_tokens_per_cycle, gamma, c,
                                                   verify[gamma])
        ci = bootstrap_ci([r.cycle_accepted for r in rows], [r.cycles for r in rows], weights)
        if ci is not None:
            report.empirical_tokens_per_cycle_ci = (ci[0] + 1, ci[1] + 1)
            report.empirical_est_speedup_ci = tuple(
                est_speedup(x + 1, gamma, c, verify[gamma]) for x in ci)
    reached = [sum(r.reached[j] for r in rows) for j in range(gamma)]
    took = [sum(r.accepted_at[j] for r in rows) for j in range(gamma)]
    report.reached_by_draft_offset = reached
    report.alpha_by_draft_offset = [t / n if n else None for t, n in zip(took, reached)]
    report.accepted_per_cycle_by_draft_offset = [t / all_cycles if all_cycles else None
                                                 for t in took]
    for row in report.gamma_table or []:  # the simulation speaks for blocks up to its own
        e = (report.mean_accepted_length if row["gamma"] == gamma
             else accepted_from_offsets(report.alpha_by_draft_offset, row["gamma"]))
        row["sim_tokens_per_cycle"] = None if e is None else e + 1
        row["sim_est_speedup"] = None if e is None else est_speedup(
            e + 1, row["gamma"], c, verify[row["gamma"]])


def _add_notes(report: AcceptanceReport, sampling: SamplingParams, K: int) -> None:
    if K == 0:
        report.notes.insert(0, "PROMPT TOKENS SCORED (--continuation-tokens 0): the draft is "
                               "judged on human text, not on what the target would write; "
                               "alpha can differ a lot from serving")
    if sampling.greedy:
        report.notes.append("temperature 0: acceptance is exact top-1 agreement; it "
                            "over-states acceptance under sampling")
    if report.truncated_prompts:
        report.notes.append(f"{report.truncated_prompts} prompt(s) longer than --max-length "
                            f"were cut from the left (their ends kept)")
    if report.cost_ratio_source.startswith("parameters"):
        report.notes.append("cost ratio from parameter counts: a rough guide; memory-bound "
                            "serving and the verify pass's real cost can differ "
                            "(--cost-ratio measure times them)")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ci(ci: Sequence[float] | None, fmt: str = ".3f") -> str:
    return "" if ci is None else f"   95% CI [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def format_report(r: AcceptanceReport) -> str:
    """The text report (layout of SPEC.md), notes underneath."""
    rule = "  " + "─" * 66
    sampling = f"temperature={r.temperature:g}"
    if r.top_k:
        sampling += f"  top_k={r.top_k}"
    if r.top_p < 1:
        sampling += f"  top_p={r.top_p:g}"
    cost = f"(cost_ratio={r.cost_ratio:.2f}, rough)"
    lines = [f"  speculative-decoding acceptance  —  {r.draft}  ⇒  {r.target}",
             f"  sampling: {sampling}    gamma (draft block): {r.gamma}"]
    if r.partial:
        lines.append(f"  PARTIAL RESULT — {r.progress_note}")
    lines += [rule, f"  distributional (teacher-forced on target {r.scored_on})"]
    std = "" if r.alpha_std is None else f"   ± {r.alpha_std:.3f} (per-seq)"
    est = "positional" if r.estimator == "positional" else "i.i.d. closed form"
    lines += [
        f"    acceptance rate  alpha        {_num(r.alpha, '.3f')}{std}{_ci(r.alpha_ci)}",
        f"    scored positions              {r.scored_positions:,} over {r.n_sequences} sequences",
        f"    E[accepted draft tokens]      {_num(r.expected_accepted, '.3f')}  of {r.gamma}"
        f"   ({est} estimator)",
        f"    E[tokens per cycle]           {_num(r.tokens_per_cycle, '.3f')}"
        f"{_ci(r.tokens_per_cycle_ci)}",
        f"    est. speedup                  {_num(r.est_speedup, '5.2f') + 'x':>6}   {cost}"
        f"{_ci(r.est_speedup_ci, '.2f')}"]
    if r.reached_by_draft_offset is not None:
        offsets = "".join(f"{_num(a, '.2f'):>6}" for a in r.alpha_by_draft_offset)
        reached = "".join(f"{n:>6}" for n in r.reached_by_draft_offset)
        lines += [
            rule, "  generative (real rejection sampling — the number to trust)",
            f"    acceptance rate  alpha        {_num(r.empirical_alpha, '.3f')}"
            f"{_ci(r.empirical_alpha_ci)}",
            f"    examined draft tokens         {r.examined_tokens:,} ({r.accepted_tokens:,} "
            f"accepted) from {r.simulated_prompts} prompts",
            f"    mean accepted length          {_num(r.mean_accepted_length, '.3f')}  "
            f"of {r.gamma}   ({r.cycles:,} complete cycles, {r.censored_cycles} censored)",
            f"    tokens per cycle              {_num(r.empirical_tokens_per_cycle, '.3f')}"
            f"{_ci(r.empirical_tokens_per_cycle_ci)}",
            f"    est. speedup                  {_num(r.empirical_est_speedup, '5.2f') + 'x':>6}   "
            f"{cost}{_ci(r.empirical_est_speedup_ci, '.2f')}",
            f"    alpha by draft offset 1..{r.gamma:<3}{offsets}",
            f"    cycles reaching it         {reached}",
            "      (a steep fall = the draft degrades as it runs ahead)"]
    if r.gamma_table:
        sim = any(row.get("sim_tokens_per_cycle") is not None for row in r.gamma_table)
        lines += [rule, f"  best gamma at cost_ratio={r.cost_ratio:.2f} "
                        f"(* = highest est. speedup, teacher-forced)",
                  "    gamma            " + "".join(f"{row['gamma']:>7}" for row in r.gamma_table),
                  "    tokens/cycle     " + "".join(f"{row['tokens_per_cycle']:>7.2f}"
                                                    for row in r.gamma_table),
                  "    est. speedup     " + "".join(
                      f"{row['est_speedup']:>6.2f}{'*' if row['gamma'] == r.best_gamma else ' '}"
                      for row in r.gamma_table)]
        if sim:
            lines += ["    sim tokens/cycle " + "".join(
                          f"{_num(row.get('sim_tokens_per_cycle'), '.2f'):>7}"
                          for row in r.gamma_table),
                      "    sim speedup      " + "".join(
                          f"{_num(row.get('sim_est_speedup'), '.2f'):>7}"
                          for row in r.gamma_table)]
    if r.alpha_by_category:
        lines += [rule, "  alpha by category (teacher-forced)"]
        lines += [f"    {name:<16} {a:.3f}   ({r.sequences_by_category[name]} sequences)"
                  for name, a in r.alpha_by_category.items()]
    lines.append(rule)
    lines += [f"  note: {n}" for n in r.notes]
    verify = "1" if r.verify_cost == 1 else f"{r.verify_cost:.2f}"
    lines.append(f"  note: est. speedup = tokens per cycle / (gamma x cost_ratio + {verify}), "
                 f"cost_ratio from {r.cost_ratio_source}: an indication, not a benchmark")
    return "\n".join(lines)


def format_summary(reports: Sequence[AcceptanceReport]) -> str:
    """One row per (draft, temperature), best estimated speedup first."""
    def speed(r: AcceptanceReport) -> float:
        best = next((row for row in r.gamma_table or [] if row["gamma"] == r.best_gamma), None)
        return -1.0 if best is None else best["est_speedup"]

    lines = ["  ranking (best estimated speedup first; alpha with 95% CI over prompts)",
             f"    {'draft':<40} {'T':>4} {'alpha':>6} {'95% CI':>15} {'gen alpha':>9} "
             f"{'best gamma':>10} {'speedup':>8}"]
    for r in sorted(reports, key=speed, reverse=True):
        ci = "" if r.alpha_ci is None else f"[{r.alpha_ci[0]:.3f}, {r.alpha_ci[1]:.3f}]"
        name = r.draft if len(r.draft) <= 40 else "…" + r.draft[-39:]
        lines.append(f"    {name:<40} {r.temperature:>4g} {_num(r.alpha, '.3f'):>6} {ci:>15} "
                     f"{_num(r.empirical_alpha, '.3f'):>9} {_num(r.best_gamma, 'd'):>10} "
                     f"{_num(speed(r) if r.best_gamma else None, '.2f') + 'x':>8}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2
        self.exit(2, f"specdec: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="specdec.py", description="Measure speculative-decoding acceptance "
                 "(alpha) and expected speedup of draft models against a target model.",
                 epilog="'python specdec.py measure --target ...' is accepted too. Exit status: "
                 "0 done, 1 --min-alpha gate failed, 2 bad input, 130 interrupted (the partial "
                 "report is printed).")
    ap.add_argument("--target", required=True,
                    help="target model: hub id, local folder or .gguf file")
    ap.add_argument("--draft", action="append", default=[], metavar="MODEL",
                    help="draft model: hub id, local folder or .gguf file; repeat to rank "
                    "several drafts against one set of target passes (default: the target "
                    "itself, for --draft-layers)")
    ap.add_argument("--draft-layers", default=None, metavar="N[,N...]",
                    help="early-exit drafts: the first N decoder layers (+ final norm and head) "
                    "of the --draft, or of the target when there is no single --draft, sharing "
                    "its weights; a comma list makes one draft per N")
    ap.add_argument("--data", default="builtin",
                    help="prompts: builtin (default, 38 prompts in 7 categories), a .txt file "
                    "(one per line), .jsonl/.json file, or hf:NAME[:CONFIG][:SPLIT][:FIELD] "
                    "(NAME may be a local dataset folder)")
    ap.add_argument("--max-samples", type=int, default=32, metavar="N",
                    help="prompts used, at most (default 32)")
    ap.add_argument("--max-length", type=int, default=512, metavar="TOKENS",
                    help="prompt tokens kept, from the end (default 512)")
    ap.add_argument("--continuation-tokens", type=int, default=64, metavar="K",
                    help="tokens the target writes after each prompt and that are scored; also "
                    "the simulation's budget per prompt. 0 scores the prompt tokens instead "
                    "(default 64)")
    ap.add_argument("--temperature", default="0.7", metavar="T[,T...]",
                    help="sampling temperature(s), >= 0; 0 = greedy; a comma list measures each "
                    "(default 0.7)")
    ap.add_argument("--top-k", type=int, default=0, metavar="K",
                    help="keep the K most likely tokens, >= 0; 0 = off (default 0)")
    ap.add_argument("--top-p", type=float, default=1.0, metavar="P",
                    help="nucleus sampling mass, in (0, 1]; 1 = off (default 1)")
    ap.add_argument("--gamma", type=int, default=4, metavar="G",
                    help="draft block: tokens proposed per cycle, >= 1 (default 4)")
    ap.add_argument("--simulate", action="store_true",
                    help="also run the real speculative-sampling loop (generative alpha)")
    ap.add_argument("--cost-ratio", default="auto", metavar="C",
                    help="cost of one draft step in target steps: a number >= 0; auto = ratio "
                    "of parameters used per token; measure = time a decode step of each model "
                    "and the target's verify pass on this device (default auto)")
    ap.add_argument("--min-alpha", type=float, default=None, metavar="X",
                    help="CI gate: exit with status 1 (after the report) when the lower 95%% "
                    "confidence bound of alpha (generative with --simulate, else "
                    "distributional) is below X, for any draft or temperature")
    ap.add_argument("--estimator", default="iid", choices=["iid", "positional"],
                    help="E[accepted draft tokens] from alpha: iid = the closed form "
                    "alpha(1-alpha^gamma)/(1-alpha); positional = the mean over start positions "
                    "of the measured alpha_t windows (default iid; JSON has both)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed, 0..4294967295; the same seed gives the same numbers "
                    "(default 0)")
    ap.add_argument("--batch-size", type=int, default=8, metavar="B",
                    help="prompts per forward pass (default 8)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                    help="model weights' dtype; auto = float32 off CUDA, bfloat16 on CUDA; "
                    "probability maths is float32 always")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                    help="where to run; auto = cuda, then mps, then cpu")
    ap.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"],
                    help="wrap prompts in the tokenizer's chat template; auto = when it has one")
    ap.add_argument("--use-unsloth", action="store_true",
                    help="load models through unsloth.FastLanguageModel (needs unsloth and a GPU)")
    ap.add_argument("--json", metavar="PATH",
                    help="also write every number as JSON to PATH ('-' = stdout, the text report "
                    "then goes to stderr); several drafts or temperatures give a list")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bars and no status line on stderr")
    return ap


def write_json_atomic(path: str, data: Any) -> None:
    """Write JSON so that PATH holds either its old content or the whole new file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".specdec-", suffix=".json.tmp", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have made, not mkstemp's 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _check_json_target(path: str | None) -> None:
    if path and path != "-":
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"--json: folder {folder!r} does not exist; create it or pick "
                             f"another path")
        if os.path.isdir(path):
            raise ValueError(f"--json: {path!r} is a folder; give a file path")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"--json: cannot write in {folder!r}; pick another path")


def _number_list(text: str, what: str, kind: type) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} takes a number or a comma list of numbers, "
                         f"got {text!r}") from None
    if not values:
        raise ValueError(f"{what} is empty")
    return values


def run(args: argparse.Namespace) -> list[AcceptanceReport]:
    """Everything main does between parsing and printing: one report per (temperature, draft)."""
    temperatures = _number_list(args.temperature, "--temperature", float)
    samplings = [SamplingParams(t, args.top_k, args.top_p) for t in temperatures]
    layers = (_number_list(args.draft_layers, "--draft-layers", int)
              if args.draft_layers is not None else [])
    if args.max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {args.max_samples}")
    if args.max_length < 1:
        raise ValueError(f"--max-length must be >= 1, got {args.max_length}")
    cost_ratio: float | str = args.cost_ratio
    if cost_ratio not in ("auto", "measure"):
        try:
            cost_ratio = float(cost_ratio)
        except ValueError:
            raise ValueError(f"--cost-ratio must be a number >= 0, auto or measure, "
                             f"got {args.cost_ratio!r}") from None
    check_settings(args.gamma, args.continuation_tokens, args.batch_size, cost_ratio,
                   args.simulate, args.seed)
    _check_json_target(args.json)
    if not args.draft and not layers:
        raise ValueError("give --draft MODEL, or --draft-layers N to draft with the target's "
                         "first N layers")
    prompts = load_texts(args.data)
    progress = not args.quiet and sys.stderr.isatty()
    device = resolve_device(args.device)
    target, tok, device = load_model_and_tokenizer(args.target, device, args.dtype,
                                                   args.use_unsloth, progress)
    loaded = {args.target: (target, tok)}  # a model named twice is loaded once
    for name in args.draft:
        if name not in loaded:
            loaded[name] = load_model_and_tokenizer(name, device, args.dtype,
                                                    args.use_unsloth, progress)[:2]
    # the early-exit drafts come from the single --draft, or else from the target
    base = args.draft[0] if len(args.draft) == 1 else args.target
    drafts = [] if len(args.draft) == 1 and layers else [(n, *loaded[n]) for n in args.draft]
    for n in layers:
        drafts.append((f"{base} [first {n} layers]", early_exit_draft(loaded[base][0], n),
                       loaded[base][1]))
    for _, model, tok_q in drafts:
        check_tokenizers(tok, tok_q, min(vocab_width(target), vocab_width(model)))
    seqs = build_sequences(prompts, tok, max_samples=args.max_samples,
                           max_length=args.max_length, chat_template=args.chat_template)
    if not args.quiet:
        print(f"specdec: measuring {len(seqs)} prompts, {len(drafts)} draft(s), "
              f"{len(samplings)} temperature(s) on {device}", file=sys.stderr, flush=True)
    # time the models once, not once per temperature
    costs = [cost_model(target, model, cost_ratio, seqs, args.gamma, device)
             for _, model, _ in drafts]
    reports: list[AcceptanceReport] = []
    for sampling in samplings:
        batch = measure_drafts(
            target, [(name, model) for name, model, _ in drafts], seqs, sampling=sampling,
            device=device, gamma=args.gamma, cost_ratio=cost_ratio,
            continuation_tokens=args.continuation_tokens, simulate=args.simulate,
            seed=args.seed, batch_size=args.batch_size, progress=progress,
            estimator=args.estimator,
            eos=eos_ids(target, tok), target_name=args.target, costs=costs)
        weights = str(next(target.parameters()).dtype).removeprefix("torch.")
        for r in batch:
            r.notes.append(f"device {device}, weights {weights}")
        reports += batch
        if any(r.partial for r in batch):
            break  # interrupted: report what finished, measure no further temperature
    return reports


def _alpha_low(r: AcceptanceReport) -> tuple[float | None, bool]:
    """What --min-alpha compares with: the lower 95% bound of alpha (generative when simulated),
    or the point value when there is no interval; and whether it is a bound."""
    alpha, ci = ((r.empirical_alpha, r.empirical_alpha_ci) if r.empirical_alpha is not None
                 else (r.alpha, r.alpha_ci))
    return (ci[0], True) if ci else (alpha, False)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Exit status: 0 ok, 1 --min-alpha gate failed, 2 bad input, 130 interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["measure"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        reports = run(args)
    except (ValueError, FloatingPointError) as e:
        print(f"specdec: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted before any measurement finished", file=sys.stderr)
        return 130
    out = sys.stderr if args.json == "-" else sys.stdout
    print("\n\n".join(format_report(r) for r in reports), file=out)
    if len(reports) > 1:
        print("\n" + format_summary(reports), file=out)
    data = reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports]
    if args.json == "-":
        print(json.dumps(data, indent=2))
    elif args.json:
        write_json_atomic(args.json, data)
    if any(r.partial for r in reports):
        return 130
    if args.min_alpha is not None:
        low = [(*_alpha_low(r), r) for r in reports]
        failed = [(a, bound, r) for a, bound, r in low if a is None or a < args.min_alpha]
        for a, bound, r in failed:
            what = "lower 95% bound" if bound else "alpha (no interval from a single prompt)"
            print(f"specdec: alpha gate failed for {r.draft} at temperature {r.temperature:g}: "
                  f"{what} {_num(a, '.3f')} < --min-alpha {args.min_alpha}", file=sys.stderr)
        if failed:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
