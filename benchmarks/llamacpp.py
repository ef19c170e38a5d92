"""specdec's prediction held against a running engine's own counts: llama.cpp's server.

    python benchmarks/llamacpp.py build --build-dir BUILD        # llama-server from the sdist
    python benchmarks/llamacpp.py draft TARGET.gguf 24           # TARGET.first24.gguf
    python benchmarks/llamacpp.py compare --server BUILD/bin/llama-server \
        --target ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --draft-layers 24

build: llama.cpp as vendored in the llama-cpp-python sdist on the package registry
(vendor/llama.cpp), configured for this CPU with no network (no curl, no web UI), and only
llama-server built (cmake; ninja where it is installed).

draft: a GGUF of the target's first N decoder layers, its tensors copied byte for byte (the
same quantisation) and its metadata with the block count changed: the early-exit draft that
specdec's --draft-layers N measures, as llama.cpp loads it. Its name is the one
`--engine-config llamacpp` prints for that draft.

compare: for each temperature, specdec measures the pair (the target dequantised to float32,
the draft its first N layers) under the engines' rule (--proposal argmax, --simulate) on
the builtin prompts; then llama-server runs with the very flags `--engine-config llamacpp`
printed for that report ("the draft as measured": draft-simple, a fixed draft length,
--spec-draft-p-min 0, specdec's sampling), and every prompt is sent as the same token ids,
with the same budget. The engine's own counts (each request's timings.draft_n and
draft_n_accepted, and the verify steps its trace logs: LLAMA_TRACE=1) pooled over the
prompts give its accept rate (accepted / drafted) and mean length (1 + accepted / verify
steps), held against specdec's 95% intervals of the same two numbers as the engines count
them (Simulated.accept_rate, logged_tokens_per_cycle). Run it with nothing else on the
machine (it takes a while: see docs/validation.md for the timing).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import specdec as sd  # noqa: E402

SDIST = "llama-cpp-python==0.3.36"
STEP = re.compile(r"task +(\d+) \| accepted +(\d+)/ *(\d+) draft tokens")
OFF = {"top_n_sigma": -1.0, "typical_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
       "repeat_last_n": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
       "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0}  # what specdec never does


def build(build_dir: Path, sdist: str | None) -> Path:
    """llama-server from the sdist's vendor/llama.cpp -> the binary's path."""
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
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j",
                    str(os.cpu_count() or 2)], check=True)
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


def serve(server: str, args: list[str], port: int, log: Path, threads: int
          ) -> subprocess.Popen:
    """llama-server on loopback with the given flags, one slot, its trace on -> the process,
    once it answers."""
    env = dict(os.environ, LLAMA_TRACE="1")
    proc = subprocess.Popen([server, *args, "-np", "1", "-c", "4096", "--host", "127.0.0.1",
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
    verify steps (its trace lines), tokens generated."""
    proc = serve(server, args, port, log, threads)
    try:
        out = []
        for i, ids in enumerate(prompts):
            t = complete(port, ids, budget, temperature, 1000 + i).get("timings", {})
            out.append({"drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                        "generated": t.get("predicted_n", 0)})
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


def compare(a: argparse.Namespace) -> int:
    target, tok, device = sd.load_model_and_tokenizer(a.target, "cpu", "float32", progress=False)
    draft_file = a.draft or f"{a.target.removesuffix('.gguf')}.first{a.draft_layers}.gguf"
    if not a.draft and not os.access(os.path.dirname(os.path.abspath(draft_file)), os.W_OK):
        draft_file = str(Path(a.logs) / os.path.basename(draft_file))  # (a read-only folder)
    if not os.path.exists(draft_file):
        print(f"writing the draft GGUF {draft_file}", file=sys.stderr)
        write_draft(a.target, a.draft_layers, draft_file)
    view = sd.Loaded(sd.early_exit_draft(target, a.draft_layers), tok, a.target,
                     a.draft_layers)
    drafter = sd.drafter_of(f"{a.target} [first {a.draft_layers} layers]", view, target,
                            sd.DraftOptions(tok))
    seqs = sd.build_sequences(sd.load_texts("builtin"), tok, max_samples=a.prompts)
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
        log = Path(a.logs) / f"server_T{temperature:g}.log"
        print(f"T={temperature:g}: llama-server {' '.join(measured['args'])}", file=sys.stderr)
        counts = engine_run(a.server, measured["args"], prompts, a.budget, temperature,
                            a.port, log, a.threads)
        s = report.simulated
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
            "server_flags": measured["args"]})
    print(f"{'T':>4} {'':8} {'accept rate':>26} {'mean len':>26} {'drafted':>8} {'steps':>6}")
    inside = True
    for row in rows:
        for who in ("engine", "specdec"):
            r = row[who]
            print(f"{row['temperature']:>4g} {who:8} "
                  + "".join(f"{v[0]:>8.3f} [{v[1]:.3f}, {v[2]:.3f}]"
                            for v in (r["accept_rate"], r["mean_len"]))
                  + f" {r['drafted']:>8} {r['verify_steps']:>6}")
        for key in ("accept_rate", "mean_len"):
            _, lo, hi = row["specdec"][key]
            ok = lo <= row["engine"][key][0] <= hi
            row[f"{key}_within_ci"] = ok
            inside &= ok
        print(f"     engine within specdec's 95% CI: accept rate "
              f"{row['accept_rate_within_ci']}, mean len {row['mean_len_within_ci']}")
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
    c.add_argument("--draft", default=None, help="the draft .gguf (default: written from "
                   "the target's first --draft-layers layers)")
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
    a = ap.parse_args()
    if a.verb == "build":
        print(build(a.build_dir, a.sdist))
        return 0
    if a.verb == "draft":
        print(write_draft(a.target, a.layers, a.out))
        return 0
    return compare(a)


if __name__ == "__main__":
    sys.exit(main())
