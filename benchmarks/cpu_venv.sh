# Sourced by engines_check.sh and references_check.sh: the steps both take to build a venv that
# runs on this CPU (the CPU torch held with a constraint file, so no dependency pulls a CUDA
# build), and arctic-inference built from its sdist inside it.

venv_lacks() {  # VENV IMPORTS: true when VENV is missing or cannot run `import IMPORTS`
  [ ! -x "$1/bin/python" ] || ! "$1/bin/python" -c "import $2" 2>/dev/null
}

cpu_venv() {  # VENV TRANSFORMERS_VERSION [PIP_ARGS...]: create, activate, install requirements
  python3 -m venv "$1"
  # shellcheck disable=SC1091
  source "$1/bin/activate"
  hold=$(mktemp)
  echo "torch==2.13.0" > "$hold"
  pip install --quiet torch==2.13.0
  pip install --quiet -c "$hold" -r requirements.txt "transformers==$2" "${@:3}"
}

build_arctic() {  # arctic-inference 0.3.0: its build imports torch, so no build isolation
  pip install --quiet -c "$hold" setuptools wheel ninja "cmake>=3.12" nanobind==2.9.2 \
    protobuf grpcio-tools
  CMAKE_ARGS="-DPython_EXECUTABLE=$VIRTUAL_ENV/bin/python" \
    pip install --quiet -c "$hold" --no-build-isolation --no-deps arctic-inference==0.3.0
}

cpu_venv_done() {  # the constraint file gone; the torch that ended up installed is the CPU one
  rm -f "$hold"
  python -c "import torch; assert torch.version.cuda is None, torch.__version__"
}
