#!/usr/bin/env bash
# The reference implementations as the oracles of DSpark, DFlash-2 and suffix decoding: builds
# a CPU venv with speculators 0.9.0 (its DSparkDraftModel / DFlash2DraftModel forward) and
# arctic-inference 0.3.0 (its C++ SuffixDecodingCache and offline simulator), then runs the
# tests that skip without them:
#   test_dspark_and_dflash2_equal_speculators_own_model  (per position, both routes)
#   the suffix tests naming arctic                        (draft for draft, the simulator)
#
#   bash benchmarks/references_check.sh [VENV]   (default /tmp/specdec-references; a few
#                                                 minutes the first time: arctic builds C++)
#
# speculators 0.9.0 pins transformers <= 5.19 and pulls a GPU stack with its dependencies, so it
# goes in with --no-deps and the light packages its imports name. arctic-inference is an sdist
# whose build needs torch: it builds without isolation, over the CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/cpu_venv.sh
source benchmarks/cpu_venv.sh
VENV=${1:-/tmp/specdec-references}
if venv_lacks "$VENV" "speculators, arctic_inference.suffix_decoding"; then
  cpu_venv "$VENV" 5.19.0
  pip install --quiet -c "$hold" --no-deps speculators==0.9.0 hs-connectors==0.9.0
  pip install --quiet -c "$hold" pydantic pydantic-settings loguru openai pandas protobuf
  build_arctic
  cpu_venv_done
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in (
    'speculators', 'arctic-inference', 'transformers', 'torch')))"
python -m pytest -n 0 -p no:cacheprovider -q -rs --disable-warnings \
  -k "speculators_own_model or arctic" test_specdec.py
