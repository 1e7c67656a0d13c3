#!/usr/bin/env bash
# Installs the Debian 12 packages DeFT Server builds and tests with; installs only what is
# missing, so a machine that has them all pays nothing. The CUDA toolkit is expected at
# /usr/local/cuda when present (it is not a Debian package); without it the CPU build is made.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache git pkg-config
  libabsl-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  python3-grpcio python3-protobuf python3-grpc-tools prometheus-cpp-dev
  libsentencepiece-dev sentencepiece libpcre2-dev
  libssl-dev openssl
  libcpp-httplib-dev curl python3-venv
  clang libfuzzer-14-dev
  nginx
)
# Node and npm run the official `openai` npm client against the HTTP API (and fetch the tokenizer
# references); a machine with its own Node (e.g. NodeSource's, which bundles npm) keeps it.
if ! command -v npm >/dev/null; then
  packages+=(nodejs npm)
fi

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$package")
done
if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
else
  echo "install_deps: all ${#packages[@]} packages present"
fi
