"""specdec's prediction held against a running engine: llama.cpp's counts and its clock.

    python benchmarks/llamacpp.py build --build-dir BUILD        # llama-server, llama-bench
    python benchmarks/llamacpp.py draft TARGET.gguf 24           # TARGET.first24.gguf
    python benchmarks/llamacpp.py compare --server BUILD/bin/llama-server \
        --target ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --pair layers:24
    python benchmarks/llamacpp.py speed --bin BUILD/bin \
        --target ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --pair layers:24 \
        --pair ngram:2@repeat --pair model:DRAFT.gguf --concurrency 1,2,4

build: llama.cpp as vendored in the llama-cpp-python sdist on the package registry
(vendor/llama.cpp), configured for this CPU with no network (no curl, no web UI): llama-server
and llama-bench (cmake; ninja where it is installed).

draft: a GGUF of the target's first N decoder layers, its tensors copied byte for byte (the
same quantisation) and its metadata with the block count changed: the early-exit draft that
specdec's --draft-layers N measures, as llama.cpp loads it. Its name is the one
`--engine-config llamacpp` prints for that draft.

A pair (--pair) is what drafts for the target on both sides: layers:N (the target's first N
layers: specdec's early-exit view, llama.cpp's GGUF of them), model:PATH (a draft GGUF of your
own, loaded by both as a separate model) or ngram:N (llama.cpp's ngram-simple lookup of N
tokens, specdec's --ngram-rule llamacpp); @repeat runs it on prompts that ask to copy a text.

compare: for each temperature, specdec measures the pair under the engines' rule (--proposal
argmax, --simulate) on the builtin prompts; then llama-server runs with the very flags
`--engine-config llamacpp` printed for that report ("the draft as measured"), and every prompt
is sent as the same token ids, with the same budget. The engine's own counts (each request's
timings.draft_n and draft_n_accepted, and the verify steps its trace logs: LLAMA_TRACE=1)
pooled over the prompts give its accept rate (accepted / drafted) and mean length (1 +
accepted / verify steps), held against specdec's 95% intervals of the same two numbers as the
engines count them (Simulated.accept_rate, logged_tokens_per_cycle). Beside them, the pair
scored on the engine's own text (each completion's token ids): specdec's draft walked along it
as a chain of gamma (tokens per cycle, its interval) and its teacher-forced alpha there, so a
quantised target whose text parts from specdec's float32 one is measured on what it wrote.

speed: the same pairs on llama.cpp's clock. llama-bench times the target's and each draft's
forwards at every width a cycle runs (-p, at the run's context) and a decoding step (-n); the
overhead outside the forwards is calibrated on llama-server's own timings, from runs that
involve no pair (plain decoding at each concurrency; the target drafting for itself with its
acceptance fixed by --spec-synth-rates, all drafts kept or none, at two draft lengths); the
two make a costs file per pair (specdec's --step-costs). specdec then predicts each pair's
speedup at each concurrency (Speed, "on the run's cycles"), and, beside it, from torch step
times on this device (--cost-ratio measure). llama-server measures decoding with and without
the draft on the same prompts and budget (EOS ignored, so every request decodes the budget),
-np N slots and waves of N concurrent requests: at one slot by its timings (predicted_n - 1
over predicted_ms), at more while every request of a wave decodes (by the streamed tokens).
The table: measured speedup, predicted, their ratio, and whether both say the same about 1.
Run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec as sd  # noqa: E402

SDIST = "llama-cpp-python==0.3.36"
STEP = re.compile(r"task +(\d+) \| accepted +(\d+)/ *(\d+) draft tokens")
OFF = {"top_n_sigma": -1.0, "typical_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
       "repeat_last_n": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
       "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0}  # what specdec never does


def build(build_dir: Path, sdist: str | None) -> Path:
    """llama-server, llama-bench and llama-batched-bench from the sdist's vendor/llama.cpp ->
    the server's path."""
    work = Path(tempfile.mkdtemp(prefix="llamacpp-src-"))
    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", SDIST, "-d", str(work)], check=True)
        sdist = str(next(work.glob("llama_cpp_python-*.tar.gz")))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    ninja = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *ninja,
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_CUDA=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server",
                    "llama-bench", "llama-batched-bench", "-j", str(os.cpu_count() or 2)],
                   check=True)
    return build_dir / "bin" / "llama-server"


def write_draft(target: str, layers: int, out: str | None = None) -> str:
    """The GGUF of the target's first `layers` decoder layers (tensors copied as they are)."""
    import gguf
    out = out or f"{target.removesuffix('.gguf')}.first{layers}.gguf"
    src = gguf.GGUFReader(target)
    arch = src.fields["general.architecture"].contents()
    blocks = f"{arch}.block_count"
    if not 1 <= layers <= src.fields[blocks].contents():
        raise SystemExit(f"{target} has {src.fields[blocks].contents()} layers, not {layers}")
    dst = gguf.GGUFWriter(out, arch=arch, endianess=src.endianess)
    for name, f in src.fields.items():
        if name == "general.architecture" or name.startswith("GGUF."):
            continue  # (the writer writes these itself)
        item = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        dst.add_key_value(name, layers if name == blocks else f.contents(), f.types[0],
                          sub_type=item)
    kept = [t for t in src.tensors if not t.name.startswith("blk.")
            or int(t.name.split(".")[1]) < layers]
    for t in kept:
        dst.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    dst.write_header_to_file()
    dst.write_kv_data_to_file()
    dst.write_ti_data_to_file()
    for t in kept:
        dst.write_tensor_data(t.data, tensor_endianess=src.endianess)
    dst.close()
    return out


def serve(server: str, args: list[str], port: int, log: Path, threads: int, slots: int = 1
          ) -> subprocess.Popen:
    """llama-server on loopback with the given flags and slots, its trace on -> the process,
    once it answers."""
    env = dict(os.environ, LLAMA_TRACE="1")
    proc = subprocess.Popen([server, *args, "-np", str(slots), "-c", str(4096 * slots),
                             "--host", "127.0.0.1",
                             "--port", str(port), "--no-ui", "-t", str(threads)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit(f"llama-server stopped: see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return proc
        except OSError:
            continue
    proc.kill()
    raise SystemExit("llama-server did not start in 300 s")


def complete(port: int, ids: list[int], n_predict: int, temperature: float, seed: int) -> dict:
    body = {"prompt": ids, "n_predict": n_predict, "temperature": temperature, "seed": seed,
            "cache_prompt": False, "return_tokens": True, **OFF}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def engine_run(server: str, args: list[str], prompts: list[list[int]], budget: int,
               temperature: float, port: int, log: Path, threads: int) -> list[dict]:
    """Each prompt through the server -> per prompt: drafted, accepted (its timings) and
    verify steps (its trace lines), tokens generated, and their ids (the engine's text)."""
    proc = serve(server, args, port, log, threads)
    try:
        out = []
        for i, ids in enumerate(prompts):
            got = complete(port, ids, budget, temperature, 1000 + i)
            t = got.get("timings", {})
            out.append({"drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                        "generated": t.get("predicted_n", 0), "tokens": got.get("tokens")})
    finally:
        proc.terminate()
        proc.wait(30)
    steps: dict[int, list[tuple[int, int]]] = {}
    for m in STEP.finditer(log.read_text(errors="replace")):
        steps.setdefault(int(m.group(1)), []).append((int(m.group(2)), int(m.group(3))))
    tasks = sorted(steps)  # one task a request, in order; a request that drafted nothing
    by_request = iter(tasks)  # has no trace line
    for row in out:
        mine = steps[next(by_request)] if row["drafted"] else []
        assert sum(a for a, _ in mine) == row["accepted"], (mine, row)
        assert sum(k for _, k in mine) == row["drafted"], (mine, row)
        row["verify_steps"] = len(mine)
    return out


def interval(rows: list[dict], num: str, den: str, plus: float = 0.0) -> tuple[float, ...]:
    """A pooled ratio and its 95% bootstrap interval over prompts (specdec's own routine)."""
    a, b = [r[num] for r in rows], [r[den] for r in rows]
    lo, hi = sd.bootstrap_ci(a, b, sd.bootstrap_weights(len(rows), sd.N_BOOT, 7))
    return plus + sum(a) / sum(b), plus + lo, plus + hi


# ----------------------------------------------------------------------------------------------
# pairs: a target GGUF and what drafts for it, on both sides


class Pair(NamedTuple):
    """A drafter for the target, as llama.cpp and specdec each run it: `layers:N` (the target's
    first N layers: an early-exit view in specdec, a GGUF of them in llama.cpp), `model:PATH`
    (a draft GGUF of its own, loaded by both as a separate model) or `ngram:N` (llama.cpp's
    ngram-simple lookup of N tokens, specdec's --ngram-rule llamacpp); `prompts` is the prompt
    set it runs on (builtin, or repeat: the builtin texts to copy, where a lookup finds
    matches)."""

    kind: str
    value: str
    prompts: str = "builtin"

    @classmethod
    def parse(cls, text: str) -> Pair:
        spec, _, prompts = text.partition("@")
        kind, _, value = spec.partition(":")
        if kind not in ("layers", "model", "ngram") or not value or \
                prompts not in ("", "builtin", "repeat"):
            raise SystemExit(f"--pair {text!r}: use layers:N, model:PATH.gguf or ngram:N, "
                             f"with @builtin or @repeat for its prompts")
        return cls(kind, value, prompts or "builtin")

    @property
    def name(self) -> str:
        what = {"layers": f"its first {self.value} layers", "ngram": f"n-gram lookup "
                f"(n={self.value})", "model": f"draft model {os.path.basename(self.value)}"}
        return what[self.kind] + ("" if self.prompts == "builtin" else ", prompts to copy")

    def draft_file(self, target: str, folder: str) -> str | None:
        """The draft's GGUF as llama.cpp loads it (written for layers:N; None for a lookup)."""
        if self.kind == "ngram":
            return None
        if self.kind == "model":
            return self.value
        out = os.path.join(folder, f"{Path(target).stem}.first{self.value}.gguf")
        if not os.path.exists(out):
            write_draft(target, int(self.value), out)
        return out

    def server_args(self, draft: str | None, gamma: int) -> list[str]:
        if self.kind == "ngram":
            return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", self.value,
                    "--spec-ngram-simple-size-m", str(gamma), "--spec-draft-n-max", str(gamma)]
        return ["--spec-type", "draft-simple", "--model-draft", draft, "--spec-draft-n-max",
                str(gamma), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]

    def drafter(self, target: Any, tok: Any, path: str) -> Any:
        """specdec's drafter for it."""
        if self.kind == "ngram":
            return sd.NgramDrafter(int(self.value), int(self.value), rule="llamacpp")
        if self.kind == "layers":
            n = int(self.value)
            view = sd.Loaded(sd.early_exit_draft(target, n), tok, path, n)
            return sd.drafter_of(f"{path} [first {n} layers]", view, target,
                                 sd.DraftOptions(tok))
        model, tok_d, _ = sd.load_model_and_tokenizer(self.value, "cpu", "float32",
                                                      progress=False)
        return sd.drafter_of(self.value, sd.Loaded(model, tok_d, self.value), target,
                             sd.DraftOptions(tok))


REPEAT = "Repeat the following text exactly, word for word, and nothing else:\n\n"


def prompt_set(kind: str, tok: Any, n: int) -> list[Any]:
    """The prompts a pair runs on, tokenised as specdec tokenises them: the builtin prompts,
    or (repeat) texts of them to copy, three builtin prompts to a text."""
    texts = sd.load_texts("builtin")
    if kind == "repeat":
        bodies = [" ".join(str(texts[(3 * i + j) % len(texts)].content) for j in range(3))
                  for i in range(n)]
        texts = [sd.Prompt(REPEAT + b, "repeat") for b in bodies]
    return sd.build_sequences(texts, tok, max_samples=n)


# ----------------------------------------------------------------------------------------------
# the engine's clock: llama-bench's step times, llama-server's decode speed


def stream(port: int, ids: list[int], n_predict: int, temperature: float, seed: int,
           start: threading.Barrier | None = None) -> dict:
    """One request, streamed: the client's clock at every chunk with the tokens decoded so far,
    and the server's final timings."""
    body = {"prompt": ids, "n_predict": n_predict, "temperature": temperature, "seed": seed,
            "cache_prompt": False, "ignore_eos": True, "stream": True, **OFF}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    if start is not None:
        start.wait()
    marks, last = [], {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if "tokens_predicted" in chunk:
                marks.append((time.perf_counter(), chunk["tokens_predicted"]))
            last = chunk
    return {"marks": marks, "timings": last.get("timings", {})}


def wave_speed(results: list[dict]) -> tuple[float, float]:
    """A wave of concurrent requests -> (tokens, seconds) while every one of them decoded: from
    the last first token to the first last token, by the client's clock at each chunk."""
    begin = max(r["marks"][0][0] for r in results)
    end = min(r["marks"][-1][0] for r in results)

    def decoded_at(marks: list[tuple[float, int]], t: float) -> int:
        return max((n for s, n in marks if s <= t), default=0)
    tokens = sum(decoded_at(r["marks"], end) - decoded_at(r["marks"], begin) for r in results)
    return tokens, max(end - begin, 1e-9)


def engine_speed(server: str, args: list[str], prompts: list[list[int]], budget: int,
                 temperature: float, slots: int, port: int, log: Path, threads: int) -> dict:
    """The prompts through llama-server with `slots` slots, in waves of that many concurrent
    requests -> the decode speed by the engine's own timings (each request's predicted_n - 1
    over predicted_ms, pooled) and, while every request of a wave decoded, by the stream
    (tokens / seconds, pooled over the waves); with speculation, its counts."""
    proc = serve(server, args, port, log, threads, slots)
    try:
        complete(port, prompts[0], 8, temperature, 0)  # (warm-up, not counted)
        rows, window = [], [0, 0.0]
        for w in range(0, len(prompts), slots):
            wave = prompts[w:w + slots]
            barrier = threading.Barrier(len(wave))
            out: list[dict] = [{}] * len(wave)

            def go(i: int) -> None:
                out[i] = stream(port, wave[i], budget, temperature, 1000 + w + i, barrier)
            threads_ = [threading.Thread(target=go, args=(i,)) for i in range(len(wave))]
            for t in threads_:
                t.start()
            for t in threads_:
                t.join()
            if len(wave) == slots:
                tokens, secs = wave_speed(out)
                window[0] += tokens
                window[1] += secs
            rows += out
    finally:
        proc.terminate()
        proc.wait(30)
    t = [r["timings"] for r in rows]
    n = sum(x["predicted_n"] - 1 for x in t)
    ms = sum(x["predicted_ms"] for x in t)
    return {"slots": slots, "requests": len(rows), "per_request_tokens_per_s": 1e3 * n / ms,
            "tokens_per_s": (window[0] / window[1] if window[1] else None)
            if slots > 1 else 1e3 * n / ms,
            "window_tokens": window[0], "drafted": sum(x.get("draft_n", 0) for x in t),
            "accepted": sum(x.get("draft_n_accepted", 0) for x in t),
            "generated": sum(x["predicted_n"] for x in t)}


def task_steps(log: Path) -> dict[int, list[tuple[int, int]]]:
    """Each task's speculative cycles from a server's trace: (accepted, drafted) in order."""
    steps: dict[int, list[tuple[int, int]]] = {}
    for m in STEP.finditer(log.read_text(errors="replace")):
        steps.setdefault(int(m.group(1)), []).append((int(m.group(2)), int(m.group(3))))
    return steps


# ----------------------------------------------------------------------------------------------
# the overhead outside the forwards, calibrated on llama-server's own timings

OVERHEAD = ("per_step", "per_cycle", "per_row", "per_sample", "per_draft_token")


def least_squares(x: list[list[float]], y: list[float]) -> tuple[list[float], list[float]]:
    """min |x b - y| -> (b with each term below zero taken as zero: an overhead is never
    negative, and one the runs cannot tell from zero is zero; the standard error of each
    term from the fit's residuals, kept whatever the term)."""
    import torch
    xs, ys = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    b = torch.linalg.lstsq(xs, ys[:, None]).solution[:, 0]
    err = ((xs @ b - ys) ** 2).sum().item()
    cov = err / max(1, len(y) - xs.shape[1]) * torch.linalg.pinv(xs.T @ xs)
    return b.clamp_min(0).tolist(), cov.diagonal().clamp_min(0).sqrt().tolist()


def calibrate(a: argparse.Namespace, small: str, prompts: list[list[int]],
              after: Callable[[], dict[str, Any]], before: dict[str, Any]) -> dict[str, Any]:
    """The overhead outside the forwards (docs/speed.md), from llama-server's own timings and
    the benchmarks' forwards of `small`: a model of the target's head and one decoder layer,
    whose forwards are short, so the work outside them (scheduling, cache bookkeeping,
    sampling over the whole vocabulary) shows. The benchmarks run just before the server runs
    (`before`) and just after (`after()`), and the forwards are their mean: the machine's
    speed drifts over minutes. The runs involve no pair: plain decoding at each concurrency
    (an iteration: a forward of B tokens with B logit rows, B samples), and the model drafting
    for itself with --spec-synth-rates fixing its acceptance, every draft kept or none, at one
    slot with draft lengths 2 and 6, and at each larger concurrency with 4 (a cycle: g draft
    steps of B rows, the draft's re-read of the B (g + 1) verified tokens, their verify, the
    accepted + 1 tokens of each slot sampled, the g drafted tokens of each slot sampled). Each
    run is one equation per iteration: its time less the forwards = the overhead terms times
    how often an iteration runs each; the terms fitted by least squares (least_squares). -> the
    overhead, its standard errors, the runs, and the head's rows (the mean of both timings)."""
    def costs_of(rows: dict[str, Any], tag: str) -> sd.StepTimes:
        path = costs_file(os.path.join(a.work, f"costs.small.{tag}.json"), "one layer",
                          rows["bench"], None, {"overhead_ms": {}, "overhead_se_ms": {}}, rows)
        t = sd.read_step_costs(path)
        return t.at(t.target[0].depth)
    first = costs_of(before, "before")
    times: list[sd.StepTimes] = [first]

    def fwd(rows: int, width: int, outputs: int | None = None) -> float:
        return sum(t.forward("target", rows, width, outputs) for t in times) / len(times)
    terms = ("per_step", "per_cycle", "per_sample", "per_draft_token", "per_draft_step")
    rows_x: list[list[float]] = []
    rows_f: list[Callable[[], float]] = []  # each run's forwards an iteration, in seconds
    runs: list[dict[str, Any]] = []
    for b in a.concurrency:
        got = engine_speed(a.server, ["-m", small], prompts[:max(b, len(prompts) // b * b)],
                           a.budget, a.temperature, b, a.port,
                           Path(a.work) / f"cal_plain{b}.log", a.threads)
        rows_x.append([1, 0, b, 0, 0])
        rows_f.append(lambda b=b: fwd(b, 1))
        runs.append({"run": f"plain, {b} slot(s)", "iteration_ms": 1e3 * b / got["tokens_per_s"]})
    runs_at = [(1, g, rate) for g in (2, 6) for rate in (0, 1)] + [
        (b, 4, rate) for b in a.concurrency if b > 1 for rate in (0, 1)]
    for slots, g, rate in runs_at:
        log = Path(a.work) / f"cal_synth{slots}_{g}_{rate}.log"
        args = ["-m", small, "--spec-type", "draft-simple", "--model-draft", small,
                "--spec-draft-n-max", str(g), "--spec-draft-n-min", "0",
                "--spec-draft-p-min", "0", "--spec-synth-rates", ",".join([str(rate)] * g)]
        got = engine_speed(a.server, args, prompts[:max(slots, len(prompts) // slots * slots)],
                           a.budget, a.temperature, slots, a.port, log, a.threads)
        if slots == 1:  # each cycle as the trace logged it: d drafting steps of one row
            steps = task_steps(log)
            cycles = [c for task in sorted(steps)[1:] for c in steps[task]]  # (warm-up out)
            emitted = got["generated"] - got["requests"]
            plain = emitted - sum(k + 1 for k, _ in cycles)
            n = len(cycles) + plain
            drafted = sum(d for _, d in cycles)
            rows_f.append(lambda cycles=cycles, plain=plain, n=n: (sum(
                d * fwd(1, 1) + fwd(1, d + 1, 1) + fwd(1, d + 1) for _, d in cycles)
                + plain * fwd(1, 1)) / n)
            x = [1, len(cycles) / n, emitted / n, drafted / n, drafted / n]
            secs = emitted / got["per_request_tokens_per_s"] / n
        else:  # an iteration while every slot decodes: each drafts g, keeps all or none
            emitted = slots * (g * rate + 1)
            rows_f.append(lambda g=g, slots=slots: (
                g * fwd(slots, 1) + fwd(1, slots * (g + 1), 1) + fwd(slots, g + 1)))
            x = [1, 1, emitted, slots * g, g]
            secs = emitted / got["tokens_per_s"]
        rows_x.append(x)
        runs.append({"run": f"synthetic acceptance {rate}, draft length {g}, {slots} slot(s)",
                     "iteration_ms": 1e3 * secs})
    later = after()
    times.append(costs_of(later, "after"))
    rows_y = [run["iteration_ms"] * 1e-3 - forwards() for run, forwards in zip(runs, rows_f)]
    b, se = least_squares(rows_x, rows_y)
    for run, x, y, forwards in zip(runs, rows_x, rows_y, rows_f):
        run.update(forwards_ms=1e3 * forwards(), overhead_ms=1e3 * y,
                   fitted_ms=1e3 * sum(u * v for u, v in zip(x, b)))
    head = {"head_rows_ms": {k: (before["head_rows_ms"][k] + later["head_rows_ms"][k]) / 2
                             for k in before["head_rows_ms"]},
            "head_rows_se_ms": {k: math.hypot(before["head_rows_se_ms"][k],
                                              later["head_rows_se_ms"][k]) / 2
                                for k in before["head_rows_se_ms"]}}
    return {"overhead_ms": dict(zip(terms, (1e3 * x for x in b))),
            "overhead_se_ms": dict(zip(terms, (1e3 * x for x in se))), "runs": runs,
            "model": small, "head": head}


# ----------------------------------------------------------------------------------------------
# the speed check: specdec's predictions against llama-server's clock


def bench_model(a: argparse.Namespace, model: str, widths: list[int], depths: list[int]
                ) -> str:
    """llama-bench (-o json) of one model, reused when there: a prompt of each width (one
    logit row, a sequence) and decoding steps, at each depth."""
    out = os.path.join(a.work, f"{Path(model).stem}.bench.json")
    if not os.path.exists(out) or not a.reuse:
        cmd = [os.path.join(a.bin, "llama-bench"), "-m", model, "-p",
               ",".join(map(str, widths)), "-n", "32", "-d", ",".join(map(str, depths)),
               "-t", str(a.threads), "-r", str(a.reps), "-o", "json"]
        print(" ".join(cmd), file=sys.stderr)
        with open(out, "w") as f:
            subprocess.run(cmd, stdout=f, stderr=subprocess.DEVNULL, check=True)
    return out


BATCHED_RUNS = 5  # llama-batched-bench runs (it repeats nothing itself): their median is used


def head_rows(a: argparse.Namespace, small: str, widest: int, depth: int, tag: str
              ) -> dict[str, Any]:
    """What computing n logit rows costs beyond one, n = 2..widest, on `small` (the target's
    head under one decoder layer, whose forwards are mostly the head): llama-batched-bench's
    decoding step of n sequences (every row's logits) less llama-bench's prompt of n tokens
    (one row's), each the median of its runs; made non-decreasing in n. -> {"head_rows_ms",
    "head_rows_se_ms", "bench": llama-bench's file, "batched": llama-batched-bench's}."""
    stem = os.path.join(a.work, f"{Path(small).stem}.{tag}")
    bench_file = f"{stem}.bench.json"
    cmd = [os.path.join(a.bin, "llama-bench"), "-m", small, "-p",
           ",".join(map(str, range(2, widest + 1))), "-n", "32", "-d", str(depth), "-t",
           str(a.threads), "-r", str(a.reps), "-o", "json"]
    with open(bench_file, "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.DEVNULL, check=True)
    bench = sd.llama_bench_forwards(json.load(open(bench_file)))
    out = f"{stem}.batched.jsonl"
    cmd = [os.path.join(a.bin, "llama-batched-bench"), "-m", small, "-c",
           str(widest * (depth + 32) + 64), "-npp", str(depth), "-ntg", "16", "-npl",
           ",".join(map(str, range(1, widest + 1))), "-pps", "-t", str(a.threads), "-tb",
           str(a.threads), "--output-format", "jsonl"]
    print(" ".join(cmd), f"(x{BATCHED_RUNS})", file=sys.stderr)
    with open(out, "w") as f:
        for _ in range(BATCHED_RUNS):
            subprocess.run(cmd, stdout=f, stderr=subprocess.DEVNULL, check=True)
    rows = {f.rows: f.time for f in sd.batched_bench_forwards(
        sd._bench_records(out, batched=True))}
    one = {f.width: f.time for f in bench if f.rows == 1 and f.depth == depth}
    ms, se, most = {}, {}, 0.0
    for n in range(2, widest + 1):
        extra = max(most, 1e3 * (rows[n].s - one[n].s))
        ms[str(n)], se[str(n)], most = extra, 1e3 * math.hypot(rows[n].se, one[n].se), extra
    return {"head_rows_ms": ms, "head_rows_se_ms": se, "bench": bench_file, "batched": out}


def costs_file(path: str, source: str, target: str, draft: str | None,
               overhead: dict[str, Any], rows: dict[str, Any]) -> str:
    """A costs file for specdec's --step-costs: llama-bench's forwards of the target and of
    the draft, the head's logit rows, the calibrated overhead, llama.cpp's cycle (its draft
    re-reads the verify batch; it samples the tokens a cycle emits)."""
    data = {"source": source, "target": [os.path.abspath(target)],
            "draft": [os.path.abspath(draft)] if draft else [],
            **{k: rows[k] for k in ("head_rows_ms", "head_rows_se_ms")},
            "overhead_ms": overhead["overhead_ms"], "overhead_se_ms": overhead["overhead_se_ms"],
            "overhead_source": "calibrated on llama-server's timings with a one-layer model of "
                               "the target's head (benchmarks/llamacpp.py speed)",
            "draft_rereads": True, "sampled": "emitted"}
    Path(path).write_text(json.dumps(data, indent=1))
    return path


def simulate(target: Any, drafter: Any, seqs: list, a: argparse.Namespace) -> tuple:
    """specdec's simulation of the pair: the engines' rule, EOS ignored as the server's requests
    do, the budget theirs -> (the measurement, its drafter, the per-prompt sums)."""
    sampling = sd.SamplingParams(a.temperature, proposal="argmax")
    settings = sd.Settings(a.gamma, a.budget, simulate=True, seed=a.seed, eos=frozenset(),
                           concurrency=tuple(a.concurrency))
    m = sd.Measurement(target, seqs, sampling, settings, "cpu")
    drafters = m.drafters([drafter])
    results: list[dict] = [{}]
    m.measure(drafters, m.batches(), results)
    return m, drafters[0], results[0]


def predict(m: Any, drafter: Any, results: dict, step_costs: str | None) -> dict[str, Any]:
    """The speed part of the pair's report from llama-bench's step times (step_costs) or from
    torch's on this device (None: --cost-ratio measure) -> {concurrency: the speedup on the
    run's cycles, the steady state's, its 95% interval, plain and speculative tokens/s} and
    the simulation's counts."""
    s = (dataclasses.replace(m.settings, step_costs=sd.read_step_costs(step_costs))
         if step_costs else dataclasses.replace(m.settings, cost_ratio="measure"))
    cost = sd.cost_model(m.target, drafter, s, m.sequences, m.device)
    report = sd.build_report(m, drafter, results, cost)
    out = {row.concurrency: {"as_run": row.as_run_speedup, "speedup": row.speedup,
                             "ci": row.speedup_ci, "plain_tokens_per_s": row.plain_tokens_per_s,
                             "tokens_per_s": row.tokens_per_s} for row in report.speed.rows}
    sim = report.simulated
    return {"speed": out, "simulated": {
        "tokens_per_cycle": sim.tokens_per_cycle, "accept_rate": sim.accept_rate,
        "logged_tokens_per_cycle": sim.logged_tokens_per_cycle, "drafted": sim.drafted_tokens,
        "accepted": sim.drafted_accepted, "generated": sim.generated_tokens}}


def speed(a: argparse.Namespace) -> int:
    """The speed check (see the module's docstring) -> a JSON and the table."""
    os.makedirs(a.work, exist_ok=True)
    server = a.server = os.path.join(a.bin, "llama-server")
    target, tok, _ = sd.load_model_and_tokenizer(a.target, "cpu", "float32", progress=False)
    pairs = [Pair.parse(p) for p in a.pair]
    sets = {kind: prompt_set(kind, tok, a.prompts) for kind in {p.prompts for p in pairs}}
    depth = {k: round(sum(len(q.ids) for q in v) / len(v) + a.budget / 2)
             for k, v in sets.items()}
    depths = sorted(set(depth.values()))
    widest = max(a.concurrency) * 9  # a verify of gamma up to 8 at each concurrency
    drafts = {p: p.draft_file(a.target, a.work) for p in pairs}
    small = Pair("layers", "1").draft_file(a.target, a.work)
    base = depth.get("builtin", depths[0])
    rows_file = os.path.join(a.work, "head_rows.json")
    calibration = os.path.join(a.work, "overhead.json")
    if not os.path.exists(calibration) or not a.reuse:
        # the machine's speed drifts over minutes: the one-layer model is timed just before
        # the server runs it and just after, and the overhead read against the mean
        first = sets.get("builtin") or next(iter(sets.values()))
        before = head_rows(a, small, widest, base, "before")
        over = calibrate(a, small, [list(q.ids) for q in first],
                         lambda: head_rows(a, small, widest, base, "after"), before)
        Path(calibration).write_text(json.dumps(over, indent=1))
        Path(rows_file).write_text(json.dumps(over["head"], indent=1))
    head = json.load(open(rows_file))
    over = json.load(open(calibration))
    rows = []
    for p in pairs:
        seqs = sets[p.prompts]
        prompts = [list(q.ids) for q in seqs]
        print(f"specdec: {p.name}", file=sys.stderr)
        m, drafter, results = simulate(target, p.drafter(target, tok, a.target), seqs, a)
        torch_costs = predict(m, drafter, results, None)
        # the engine's forwards, timed just before the engine runs the pair (its speed drifts)
        widths = list(range(2, widest + 1))
        bench_t = bench_model(a, a.target, widths, depths)
        bench_d = drafts[p] and bench_model(a, drafts[p], widths, depths)
        r0 = json.load(open(bench_t))[0]
        source = (f"llama-bench (build {r0.get('build_commit')}, {r0.get('n_threads')} "
                  f"threads) of {os.path.basename(a.target)}")
        cost = costs_file(os.path.join(a.work, f"costs.{p.kind}{Path(p.value).stem}.json"),
                          source, bench_t, bench_d, over, head)
        guess = {"llama.cpp": predict(m, drafter, results, cost)["speed"],
                 "torch": torch_costs["speed"], "simulated": torch_costs["simulated"]}
        for b in a.concurrency:
            log = Path(a.work) / f"speed_{p.kind}{Path(p.value).stem}_{b}.log"
            runs = []
            for _ in range(a.rounds):  # plain and speculative in turn: a machine whose speed
                # drifts touches both alike
                plain = engine_speed(server, ["-m", a.target], prompts, a.budget,
                                     a.temperature, b, a.port,
                                     Path(a.work) / f"plain_{p.prompts}_{b}.log", a.threads)
                spec = engine_speed(server, ["-m", a.target, *p.server_args(drafts[p], a.gamma)],
                                    prompts, a.budget, a.temperature, b, a.port, log, a.threads)
                runs.append((plain, spec))
            ratios = sorted(s["tokens_per_s"] / q["tokens_per_s"] for q, s in runs)
            measured = ratios[len(ratios) // 2]
            row = {"pair": p.name, "concurrency": b, "measured": measured,
                   "measured_rounds": ratios,
                   "plain_tokens_per_s": sorted(q["tokens_per_s"] for q, _ in runs)[
                       len(runs) // 2],
                   "spec_tokens_per_s": sorted(s["tokens_per_s"] for _, s in runs)[
                       len(runs) // 2],
                   "engine_accept_rate": sum(s["accepted"] for _, s in runs) / max(
                       1, sum(s["drafted"] for _, s in runs)),
                   "simulated": guess["simulated"]}
            for name in ("llama.cpp", "torch"):
                g = guess[name][b]
                row[name] = {**g, "ratio": g["as_run"] / measured,
                             "same_side": (g["as_run"] > 1) == (measured > 1)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "overhead": over,
                                            "costs_source": source}, indent=1))
    print(f"{'pair':<44}{'B':>3}{'measured':>10}{'llama-bench':>13}{'ratio':>7}"
          f"{'torch':>8}{'ratio':>7}")
    for r in rows:
        lc, tc = r["llama.cpp"], r["torch"]
        print(f"{r['pair']:<44}{r['concurrency']:>3}{r['measured']:>9.3f}x"
              f"{lc['as_run']:>12.3f}x{lc['ratio']:>7.2f}{tc['as_run']:>7.3f}x"
              f"{tc['ratio']:>7.2f}" + ("" if lc["same_side"] else "  (other side of 1)"))
    return 0


def on_engine_text(target: Any, drafter: Any, seqs: list, counts: list[dict],
                   temperature: float, a: argparse.Namespace) -> dict[str, Any]:
    """The pair scored on the text the engine wrote (its quantised target's, to its own end):
    the chain of gamma walked along it (specdec's trees: the tokens per cycle the engine's
    draft would give on that text, with its 95% interval, and the accepted share by depth),
    and the teacher-forced alpha along it (the draft against specdec's target there)."""
    texts = [r["tokens"] for r in counts]
    if any(t is None for t in texts):
        raise SystemExit("llama-server returned no token ids (return_tokens): this build "
                         "cannot be scored on its own text")
    chain = sd.TreeSpec(1, a.gamma, a.gamma + 1)
    report, = sd.measure_drafts(
        target, [drafter], seqs, sampling=sd.SamplingParams(temperature, proposal="argmax"),
        gamma=a.gamma, continuation_tokens=max(2, *map(len, texts)), simulate=False,
        seed=a.seed, eos=frozenset(), device="cpu", trees=(chain,), continuations=texts)
    row = report.trees.rows[0]
    return {"tokens": sum(map(len, texts)), "cycles": row.cycles,
            "mean_len": (row.accept_length, *(row.accept_length_ci or (math.nan,) * 2)),
            "accepted_by_depth": row.accepted_by_depth, "alpha_by_depth": row.alpha_by_depth,
            "teacher_forced_alpha": report.alpha}


def compare(a: argparse.Namespace) -> int:
    target, tok, device = sd.load_model_and_tokenizer(a.target, "cpu", "float32", progress=False)
    pair = Pair.parse(a.pair or f"layers:{a.draft_layers}")
    here = os.path.dirname(os.path.abspath(a.target))  # (a read-only folder: the logs')
    draft = a.draft or pair.draft_file(a.target, here if os.access(here, os.W_OK) else a.logs)
    drafter = pair.drafter(target, tok, a.target)
    seqs = prompt_set(pair.prompts, tok, a.prompts)
    prompts = [list(q.ids) for q in seqs]
    rows = []
    for temperature in a.temperatures:
        sampling = sd.SamplingParams(temperature, proposal="argmax")
        report, = sd.measure_drafts(target, [drafter], seqs, sampling=sampling, gamma=a.gamma,
                                    continuation_tokens=a.budget, simulate=True, seed=a.seed,
                                    eos=sd.eos_ids(target, tok), device=device,
                                    target_name=a.target)
        measured = sd.engine_config(report, "llamacpp")[0]
        assert "as measured" in measured["for"], measured
        args = list(measured["args"])
        if "--model-draft" in args:  # (where this run wrote or found it)
            args[args.index("--model-draft") + 1] = draft
        log = Path(a.logs) / f"server_T{temperature:g}.log"
        print(f"T={temperature:g}: llama-server {' '.join(args)}", file=sys.stderr)
        counts = engine_run(a.server, args, prompts, a.budget, temperature, a.port, log,
                            a.threads)
        s = report.simulated
        text = on_engine_text(target, drafter, seqs, counts, temperature, a)
        engine_rate = interval(counts, "accepted", "drafted")
        engine_len = interval(counts, "accepted", "verify_steps", 1.0)
        rows.append({
            "temperature": temperature, "prompts": len(prompts),
            "engine": {"drafted": sum(r["drafted"] for r in counts),
                       "accepted": sum(r["accepted"] for r in counts),
                       "verify_steps": sum(r["verify_steps"] for r in counts),
                       "generated": sum(r["generated"] for r in counts),
                       "accept_rate": engine_rate, "mean_len": engine_len},
            "specdec": {"drafted": s.drafted_tokens, "accepted": s.drafted_accepted,
                        "verify_steps": s.verify_steps, "generated": s.generated_tokens,
                        "accept_rate": (s.accept_rate, *s.accept_rate_ci),
                        "mean_len": (s.logged_tokens_per_cycle,
                                     *s.logged_tokens_per_cycle_ci),
                        "tokens_per_cycle": s.tokens_per_cycle},
            "on_engine_text": text, "server_flags": args})
    print(f"{'T':>4} {'':8} {'accept rate':>26} {'mean len':>26} {'drafted':>8} {'steps':>6}")
    inside = True
    for row in rows:
        for who in ("engine", "specdec"):
            r = row[who]
            print(f"{row['temperature']:>4g} {who:8} "
                  + "".join(f"{v[0]:>8.3f} [{v[1]:.3f}, {v[2]:.3f}]"
                            for v in (r["accept_rate"], r["mean_len"]))
                  + f" {r['drafted']:>8} {r['verify_steps']:>6}")
        t = row["on_engine_text"]
        print(f"{row['temperature']:>4g} {'its text':8} {'':26}"
              f"{t['mean_len'][0]:>8.3f} [{t['mean_len'][1]:.3f}, {t['mean_len'][2]:.3f}] "
              f"(specdec's draft walked along the engine's {t['tokens']} tokens, "
              f"{t['cycles']} cycles; teacher-forced alpha {t['teacher_forced_alpha']:.3f})")
        for key in ("accept_rate", "mean_len"):
            _, lo, hi = row["specdec"][key]
            ok = lo <= row["engine"][key][0] <= hi
            row[f"{key}_within_ci"] = ok
            inside &= ok
        low, high = t["mean_len"][1:]
        row["mean_len_within_text_ci"] = low <= row["engine"]["mean_len"][0] <= high
        print(f"     engine within specdec's 95% CI: accept rate "
              f"{row['accept_rate_within_ci']}, mean len {row['mean_len_within_ci']}; "
              f"within its own text's: mean len {row['mean_len_within_text_ci']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if inside else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="build llama-server from the llama-cpp-python sdist")
    b.add_argument("--build-dir", required=True, type=Path)
    b.add_argument("--sdist", default=None, help=f"a downloaded sdist (default: {SDIST})")
    d = sub.add_parser("draft", help="write the GGUF of a target's first N layers")
    d.add_argument("target")
    d.add_argument("layers", type=int)
    d.add_argument("--out", default=None)
    c = sub.add_parser("compare", help="specdec's prediction against llama-server's counts")
    c.add_argument("--server", required=True, help="the llama-server binary")
    c.add_argument("--target", required=True, help="the target .gguf")
    c.add_argument("--draft-layers", type=int, default=24)
    c.add_argument("--draft", default=None, help="the draft .gguf of --draft-layers (default: "
                   "written from the target's first --draft-layers layers)")
    c.add_argument("--pair", default=None, help="layers:N, model:PATH.gguf or ngram:N, "
                   "@repeat for prompts to copy (default layers:--draft-layers)")
    c.add_argument("--gamma", type=int, default=4)
    c.add_argument("--temperatures", type=lambda t: [float(x) for x in t.split(",")],
                   default=[0.0, 0.7])
    c.add_argument("--prompts", type=int, default=32)
    c.add_argument("--budget", type=int, default=64, help="tokens generated per prompt")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--port", type=int, default=18090)
    c.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="llama-server's threads (fewer than the cores when the machine is busy)")
    c.add_argument("--logs", default=tempfile.gettempdir())
    c.add_argument("--json", default=None)
    v = sub.add_parser("speed", help="specdec's speedup against llama-server's clock")
    v.add_argument("--bin", required=True, help="the folder of llama-server and llama-bench")
    v.add_argument("--target", required=True, help="the target .gguf")
    v.add_argument("--pair", action="append", required=True,
                   help="layers:N, model:PATH.gguf or ngram:N, @repeat for prompts to copy "
                   "(repeat the option for several)")
    v.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")],
                   default=[1, 2, 4])
    v.add_argument("--gamma", type=int, default=4)
    v.add_argument("--temperature", type=float, default=0.0)
    v.add_argument("--prompts", type=int, default=8)
    v.add_argument("--budget", type=int, default=64, help="tokens generated per prompt")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--reps", type=int, default=5, help="llama-bench's repetitions")
    v.add_argument("--rounds", type=int, default=3, help="runs of the engine with and without "
                   "the draft, in turn, for each pair and concurrency: the median ratio")
    v.add_argument("--port", type=int, default=18090)
    v.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    v.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "specdec-speed"),
                   help="where the drafts' GGUFs, llama-bench's JSON, the costs files and "
                   "the logs go (reused when there)")
    v.add_argument("--reuse", action="store_true", help="reuse the benchmarks and the "
                   "calibration an earlier run left in --work (the machine's speed drifts: "
                   "by default every run times its own)")
    v.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.verb == "speed":
        return speed(a)
    if a.verb == "build":
        print(build(a.build_dir, a.sdist))
        return 0
    if a.verb == "draft":
        print(write_draft(a.target, a.layers, a.out))
        return 0
    return compare(a)


if __name__ == "__main__":
    sys.exit(main())
