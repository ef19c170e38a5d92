"""specdec.py at a git revision and in this checkout, loaded side by side as two modules (for
the benchmarks that time a change against the file before it)."""
import importlib.util
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def load(path: str, name: str):
    """The Python file at `path` as a module called `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def before_and_now(rev: str):
    """(specdec.py at git revision `rev`, this checkout's specdec.py), as modules."""
    old_src = subprocess.run(["git", "show", f"{rev}:specdec.py"], cwd=HERE,
                             capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "specdec_before.py")
    with open(path, "w") as f:
        f.write(old_src)
    return (load(path, "specdec_before"),
            load(os.path.join(HERE, "..", "specdec.py"), "specdec_now"))
