#!/usr/bin/env bash
# Installs what the build needs and only what is missing: Debian packages (when apt is usable; otherwise it
# prints the exact command and stops), and LibTorch (torch==2.11.0 into .venv) when none is found.
# Idempotent and fast when everything is there: a second run installs nothing.
#   --browser (or BOOTSTRAP_BROWSER=1, e.g. `BOOTSTRAP_BROWSER=1 make deps`): also chromium (~480 MB), for the check
#   that opens the HTML report in a headless browser (tests/report/check_report_in_browser.sh; it skips without one).
#   Optional: where apt is not usable it prints the command and goes on.
set -euo pipefail
cd "$(dirname "$0")/.."

want_browser="${BOOTSTRAP_BROWSER:-0}"
for arg in "$@"; do
  case "$arg" in
    --browser) want_browser=1 ;;
    *) echo "usage: $0 [--browser]" >&2; exit 2 ;;
  esac
done

TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
VENV="${VENV:-.venv}"
PACKAGES=(cmake ninja-build ccache g++ libgtest-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev libgloo-dev zlib1g-dev gnuplot-nox
          doxygen graphviz
          openmpi-bin slurm-wlm munge
          dataset-fashion-mnist iproute2)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "bootstrap: missing Debian packages: ${missing[*]}" >&2
    echo "bootstrap: install them with: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

# Any of the browsers the check looks for will do; chromium is the one installed.
if [ "$want_browser" = 1 ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
   && ! command -v google-chrome >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing Debian package: chromium"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; then
      echo "bootstrap: chromium could not be installed; the report's browser check will skip" >&2
    fi
  else
    echo "bootstrap: no headless browser; the report's browser check will skip" >&2
    echo "bootstrap: install one with: sudo apt-get install -y chromium" >&2
  fi
fi

# LibTorch: a user-provided one (LIBTORCH=<prefix>, Torch_DIR or CMAKE_PREFIX_PATH) wins; then .venv's; then
# python3's; else install torch==$TORCH_VERSION into .venv.
if [ -n "${LIBTORCH:-}${Torch_DIR:-}${CMAKE_PREFIX_PATH:-}" ]; then
  exit 0
fi
if compgen -G "$VENV/lib/python3*/site-packages/torch/share/cmake/Torch/TorchConfig.cmake" >/dev/null; then
  exit 0
fi
if python3 -c 'import torch.utils, os, sys; sys.exit(0 if os.path.exists(torch.utils.cmake_prefix_path + "/Torch/TorchConfig.cmake") else 1)' 2>/dev/null; then
  exit 0
fi
echo "bootstrap: no LibTorch found; installing torch==$TORCH_VERSION into $VENV (a few GB, once)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
cuda=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda)' 2>/dev/null | tail -n 1)
nvcc_version=$( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
echo "bootstrap: torch $TORCH_VERSION installed (CUDA ${cuda}; nvcc ${nvcc_version:-not found})"
if [ -n "$nvcc_version" ] && [ "${cuda%%.*}" != "${nvcc_version%%.*}" ]; then
  echo "bootstrap: warning: torch is built for CUDA $cuda but nvcc is $nvcc_version; configure will refuse the mismatch" >&2
fi
