#!/usr/bin/env bash
# Makes local stand-ins for the base images docker/Dockerfile builds FROM, for machines that reach
# no container registry but do reach a Debian mirror (the one this machine's apt is configured with):
#   localhost/debian:12                  Debian 12 (bookworm), debootstrap --variant=minbase
#   localhost/cuda:VER-devel-debian12    + this machine's CUDA toolkit (nvcc, headers, cudart,
#                                          cuBLAS/cuBLASLt; not cuDNN, NCCL, cuFFT, ... which the
#                                          project does not use), in place of nvidia/cuda:*-devel
#   localhost/cuda:VER-runtime-debian12  + only the CUDA libraries the server loads (cudart,
#                                          cuBLAS, cuBLASLt; no compiler), in place of nvidia/cuda:*-runtime
#   localhost/nginx:debian12             + Debian's nginx (1.22), in place of the official nginx
#                                          image of docker/compose.yaml (docker/test-images.sh lb)
# The CUDA ones lay the toolkit out as the official images do (/usr/local/cuda-VER, the
# /usr/local/cuda link, ld.so.conf, PATH, NVIDIA_* variables), so the Dockerfile treats both alike.
#
# usage: docker/make-local-base.sh [debian] [cuda-devel] [cuda-runtime] [nginx]   (none: all)
# Environment: CUDA_HOME (default /usr/local/cuda), DEFT_BASE_WORK (scratch, default a temporary
# directory under /var/tmp). buildah uses its usual storage configuration (storage.conf,
# CONTAINERS_STORAGE_CONF, STORAGE_DRIVER); docker/test-images.sh sets one up. Needs root.
set -euo pipefail

cuda_home=${CUDA_HOME:-/usr/local/cuda}
debian_image=localhost/debian:12
work=${DEFT_BASE_WORK:-$(mktemp -d /var/tmp/deft-base.XXXXXX)}
mkdir -p "$work"
container=
cleanup() {
  [[ -n $container ]] && buildah rm "$container" >/dev/null 2>&1
  [[ -z ${DEFT_BASE_WORK:-} ]] && rm -rf "$work"
  return 0
}
trap cleanup EXIT

log() { echo "make-local-base: $*" >&2; }

# The first URI of an enabled apt source of this machine whose suites include exactly $1, from
# one-line (*.list) and deb822 (*.sources) files. Read at run time: no mirror name is written
# into the repository.
apt_uri() {
  local suite=$1 file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $file ]] || continue
    sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$file" |
      awk -v suite="$suite" '$1 == "deb" && $3 == suite { print $2; exit }'
  done
  for file in /etc/apt/sources.list.d/*.sources; do
    [[ -f $file ]] || continue
    awk -v suite="$suite" 'BEGIN { RS = ""; FS = "\n" }
      { uris = ""; ok = 0; enabled = 1; types = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^#/) continue
          split($i, kv, ":[ \t]*"); key = tolower(kv[1]); value = substr($i, length(kv[1]) + 2)
          gsub(/^[ \t]+|[ \t]+$/, "", value)
          if (key == "uris") uris = value
          if (key == "types" && value ~ /(^| )deb( |$)/) types = 1
          if (key == "enabled" && value == "no") enabled = 0
          if (key == "suites") { n = split(value, s, /[ \t]+/); for (j = 1; j <= n; j++) if (s[j] == suite) ok = 1 }
        }
        if (ok && enabled && types && uris != "") { split(uris, u, /[ \t]+/); print u[1]; exit }
      }' "$file"
  done
}

# Which images exist already: `buildah images` names them.
have_image() { buildah images --noheading --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep -x "$1" >/dev/null; }

make_debian() {
  local mirror suite uri rootfs=$work/rootfs
  mirror=$(apt_uri bookworm | head -1)
  [[ -n $mirror ]] || { log "no bookworm entry in this machine's apt sources"; exit 1; }
  log "debootstrap bookworm (minbase) from this machine's Debian mirror into $rootfs"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --arch=amd64 bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log"; exit 1; }

  # apt in the image: every bookworm suite this machine uses (updates, security), deb822 like
  # the official image, instead of debootstrap's single-line sources.list.
  rm -f "$rootfs/etc/apt/sources.list"
  for suite in bookworm bookworm-updates bookworm-security; do
    uri=$(apt_uri "$suite" | head -1)
    [[ -n $uri ]] || continue
    printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n\n' \
      "$uri" "$suite" /usr/share/keyrings/debian-archive-keyring.gpg
  done >"$rootfs/etc/apt/sources.list.d/debian.sources"
  # As the official image: no package caches kept in layers, no recommends.
  printf 'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n' >"$rootfs/etc/apt/apt.conf.d/docker-clean"
  printf 'APT::Install-Recommends "false";\n' >"$rootfs/etc/apt/apt.conf.d/docker-no-recommends"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/log/*.log \
    "$rootfs"/var/log/apt/* "$rootfs"/tmp/* "$rootfs"/root/.bash_history

  log "importing it as $debian_image"
  container=$(buildah from scratch)
  local mount
  mount=$(buildah mount "$container")
  # An image holds no device nodes, /proc or /sys contents: the runtime provides them.
  tar -C "$rootfs" --numeric-owner --xattrs --exclude='./dev/*' --exclude='./proc/*' \
    --exclude='./sys/*' -cf - . | tar -C "$mount" --numeric-owner --xattrs -xpf -
  buildah umount "$container" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd bash --os linux --arch amd64 \
    --label org.opencontainers.image.description="Debian 12 (bookworm) minbase, debootstrapped locally" \
    "$container"
  buildah commit --quiet --rm "$container" "$debian_image" >/dev/null
  container=
  rm -rf "$rootfs"
  # apt works inside: the same check the build stage depends on.
  log "checking apt-get update inside $debian_image"
  container=$(buildah from "$debian_image")
  buildah run --isolation chroot "$container" -- apt-get update -qq
  buildah rm "$container" >/dev/null
  container=
}

cuda_version() {
  "$cuda_home/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p'
}

# $1: devel | runtime. Copies the toolkit subset under /usr/local/cuda-VER with tar (links kept).
make_cuda() {
  local flavour=$1 version real mount
  [[ -x $cuda_home/bin/nvcc ]] || { log "no CUDA toolkit at $cuda_home"; exit 1; }
  version=$(cuda_version)
  real=$(readlink -f "$cuda_home")
  have_image "$debian_image" || make_debian
  local image=localhost/cuda:$version-$flavour-debian12
  log "making $image from $real"
  container=$(buildah from "$debian_image")
  mount=$(buildah mount "$container")
  mkdir -p "$mount/usr/local/cuda-$version"
  if [[ $flavour == devel ]]; then
    # The whole toolkit but the libraries the project does not link (1.7 GB of 2.7).
    tar -C "$real" --exclude='./lib/libcudnn*' --exclude='./lib/libnccl*' --exclude='./lib/libcufft*' \
      --exclude='./lib/libcusolver*' --exclude='./lib/libcusparse*' --exclude='./lib/libcurand*' \
      --exclude='./lib/libnvrtc*' --exclude='./lib/libnvJitLink*' --exclude='./lib/libnvperf*' \
      --exclude='./lib/libcupti*' --exclude='./lib/libnvblas*' --exclude='./lib/libpcsamplingutil*' \
      --exclude='./lib/libcheckpoint*' -cf - . | tar -C "$mount/usr/local/cuda-$version" -xpf -
  else
    # The shared libraries the installed server needs (ldd of deft-server), their links, and
    # the layout (lib64, targets/) the official runtime image has.
    (cd "$real" && ls -d lib64 targets lib/libcudart.so* lib/libcublas.so* lib/libcublasLt.so* \
      2>/dev/null) >"$work/members"
    tar -C "$real" -cf - -T "$work/members" | tar -C "$mount/usr/local/cuda-$version" -xpf -
  fi
  ln -sfn "cuda-$version" "$mount/usr/local/cuda"
  echo /usr/local/cuda/lib64 >"$mount/etc/ld.so.conf.d/000_cuda.conf"
  buildah umount "$container" >/dev/null
  buildah run --isolation chroot "$container" -- ldconfig
  if [[ $flavour == devel ]]; then
    # Debian 12's CMake 3.25.1 fails in find_package(CUDAToolkit) on CUDA 13, which ships no
    # libnvToolsExt ("set_property could not find TARGET CUDA::nvToolsExt"). Later CMake releases
    # guard that line with if(TARGET ...); the stand-in gets the same guard (the official Ubuntu
    # 24.04 image has CMake 3.28). Installed here, CMake is already present for install_deps.sh.
    # shellcheck disable=SC2016  # the script runs in the image
    buildah run --isolation chroot "$container" -- sh -ec '
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake >/dev/null
      rm -rf /var/lib/apt/lists/*
      for module in /usr/share/cmake-*/Modules/FindCUDAToolkit.cmake; do
        sed -i "s/^\( *\)if(CMAKE_MINIMUM_REQUIRED_VERSION VERSION_GREATER_EQUAL 3.25)\$/\1if(TARGET CUDA::nvToolsExt AND CMAKE_MINIMUM_REQUIRED_VERSION VERSION_GREATER_EQUAL 3.25)/" "$module"
        ! grep -q "^ *if(CMAKE_MINIMUM_REQUIRED_VERSION VERSION_GREATER_EQUAL 3.25)\$" "$module"
      done'
  fi
  local path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  [[ $flavour == devel ]] && path=/usr/local/cuda/bin:$path
  buildah config --env PATH="$path" --env CUDA_VERSION="$version" \
    --env NVIDIA_VISIBLE_DEVICES=all --env NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    --env LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \
    --label org.opencontainers.image.description="Local stand-in for nvidia/cuda:$version-$flavour: Debian 12 + CUDA $version from the build machine" \
    "$container"
  buildah commit --quiet --rm "$container" "$image" >/dev/null
  container=
}

make_nginx() {
  have_image "$debian_image" || make_debian
  log "making localhost/nginx:debian12"
  container=$(buildah from "$debian_image")
  buildah run --isolation chroot "$container" -- sh -ec '
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null
    rm -rf /var/lib/apt/lists/*'
  buildah config --cmd '["nginx", "-g", "daemon off;"]' --port 80 --stop-signal SIGQUIT \
    --label org.opencontainers.image.description="Local stand-in for the official nginx image: Debian 12 + nginx-light" \
    "$container"
  buildah commit --quiet --rm "$container" localhost/nginx:debian12 >/dev/null
  container=
}

targets=("$@")
((${#targets[@]})) || targets=(debian cuda-devel cuda-runtime nginx)
for target in "${targets[@]}"; do
  start=$SECONDS
  case $target in
    debian) make_debian ;;
    cuda-devel) make_cuda devel ;;
    cuda-runtime) make_cuda runtime ;;
    nginx) make_nginx ;;
    *) log "unknown image '$target' (debian, cuda-devel, cuda-runtime, nginx)"; exit 2 ;;
  esac
  log "$target done in $((SECONDS - start)) s"
done
buildah images --noheading --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E '^localhost/(debian|cuda|nginx):' >&2 || true
