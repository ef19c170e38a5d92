#!/usr/bin/env bash
# The serving engines' own configuration code as the judge of what --engine-config prints:
# builds a CPU venv with vLLM 0.33.0 and SGLang 0.5.23 (from the registry, with --no-deps, over
# the CPU torch and specdec's requirements) and runs test_engine_settings_pass_the_engines_own_checks
# in it, which hands every printed setting, for every kind of drafter and tree shape, to
# vLLM's EngineArgs -> create_speculative_config and SGLang's ServerArgs -> resolve_once ->
# check_server_args.
#
#   bash benchmarks/engines_check.sh [VENV]     (default /tmp/specdec-engines; about 5 minutes
#                                                the first time, seconds once the venv exists)
#
# vLLM's suffix method refuses to configure without arctic-inference, which is built too.
# Both engines declare torch 2.14 (a CUDA build on PyPI); the CPU torch 2.13.0 is held with a
# constraint. transformers 5.19.0 is the one release both engines accept (their ranges meet
# there), inside specdec's >=5,<6. The light packages their configuration code imports were
# found by trial; torchvision from PyPI needs benchmarks/torchvision_cpu_fix.py over torch+cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/cpu_venv.sh
source benchmarks/cpu_venv.sh
VENV=${1:-/tmp/specdec-engines}
if venv_lacks "$VENV" "vllm, sglang, arctic_inference.suffix_decoding"; then
  cpu_venv "$VENV" 5.19.0 tokenizers==0.23.2 "python-dateutil<3"
  pip install --quiet -c "$hold" --no-deps vllm==0.33.0 sglang==0.5.23
  pip install --quiet -c "$hold" \
    cbor2==6.3.0 orjson==3.13.0 pyzmq==27.3.0 aiohttp==3.14.5 openai==2.54.0 \
    openai-harmony==0.0.4 msgspec==0.23.0 cloudpickle==3.1.3 pybase64==1.5.1 \
    cachetools==8.0.2 uvloop==0.23.0 py-cpuinfo==9.0.0 triton==3.9.0 starlette==1.10.0 \
    ipython==9.18.1 prometheus-client==0.26.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
    fastapi==0.136.3 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 einops==0.8.2 \
    torchvision==0.28.0 sentencepiece==0.2.1 compressed-tensors==0.17.0
  build_arctic  # (vLLM's suffix method refuses to configure without it)
  site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp benchmarks/torchvision_cpu_fix.py "$site/"
  echo "import torchvision_cpu_fix" > "$site/torchvision_cpu_fix.pth"
  cpu_venv_done
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
python -c "import torch, transformers, vllm, sglang; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'vllm', vllm.__version__, 'sglang', sglang.__version__)"
python -m pytest -n 0 -p no:cacheprovider -q -m slow -rs --disable-warnings \
  -k "pass_the_engines_own_checks" test_specdec.py
