#!/usr/bin/env bash
# Builds the DeFT Server images from docker/Dockerfile with buildah on locally made bases
# (docker/make-local-base.sh; no registry needed) and checks them with podman, on a machine
# without a GPU:
#   cpu   the CPU variant (Debian 12): no compiler inside, non-root; its HEALTHCHECK reports
#         SERVING; from the host, through the published ports, deft-cli health and generate answer
#         and /metrics serves; read-only root filesystem; the embedded default model, or the
#         checkpoint mounted at /models; `podman stop` (the image's STOPSIGNAL) ends it with exit 0
#         within the grace
#   cuda  the CUDA image on the local CUDA 13 stand-ins: no nvcc inside; the server starts on the
#         CPU backend (no GPU here), its HEALTHCHECK reports SERVING, generate answers, exit 0
#   lb    docker/compose.yaml's topology with the CPU image: two replicas behind nginx running
#         docker/nginx.conf (Debian's nginx standing in for the official image); generate through
#         nginx reaches both replicas, and still answers once one replica is stopped
# usage: docker/test-images.sh [--no-build] [cpu] [cuda] [lb]      (none: all three)
# Prints a summary (image sizes, each check PASS/FAIL, times) and exits 1 if any check failed.
# Environment: DEFT_TEST_WORK (logs; default /tmp/deft-test-images), DEFT_STORAGE_DRIVER (e.g.
# vfs where overlay does not work: a separate store under /var/lib/containers/storage-vfs),
# DEFT_CLI (the host's deft-cli; default build-docker/clients/cli/deft-cli, built when missing).
# Needs root; installs buildah, podman, runc and debootstrap when missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${DEFT_TEST_WORK:-/tmp/deft-test-images}
mkdir -p "$work"
build=1
variants=()
for arg in "$@"; do
  case $arg in
    --no-build) build=0 ;;
    cpu | cuda | lb) variants+=("$arg") ;;
    *) echo "usage: docker/test-images.sh [--no-build] [cpu] [cuda] [lb]" >&2; exit 2 ;;
  esac
done
((${#variants[@]})) || variants=(cpu cuda lb)

summary=$work/summary.txt
: >"$summary"
failures=0
say() { echo "test-images: $*"; }
record() { # record PASS|FAIL what [detail]
  local line
  line=$(printf '%-4s  %s%s' "$1" "$2" "${3:+  ($3)}")
  echo "$line" >>"$summary"
  echo "$line"
  [[ $1 == PASS ]] || failures=$((failures + 1))
}

# ---- Host tools -----------------------------------------------------------------------------------
missing=()
for tool in buildah podman runc debootstrap curl; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [[ -n ${DEFT_STORAGE_DRIVER:-} ]]; then
  printf '[storage]\ndriver = "%s"\nrunroot = "/run/containers/storage-%s"\ngraphroot = "/var/lib/containers/storage-%s"\n' \
    "$DEFT_STORAGE_DRIVER" "$DEFT_STORAGE_DRIVER" "$DEFT_STORAGE_DRIVER" >"$work/storage.conf"
  export CONTAINERS_STORAGE_CONF=$work/storage.conf
fi
say "storage driver $(buildah info --format '{{.store.GraphDriverName}}' 2>/dev/null || echo '?'), logs in $work"
# podman here: runc, because crun refuses this kind of machine's hybrid cgroup v1/v2 layout; and
# limits no higher than the host's hard ones (without CAP_SYS_RESOURCE the runtime cannot raise
# them to podman's defaults).
run_flags=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096)
command -v runc >/dev/null && run_flags+=(--runtime runc)

cli=${DEFT_CLI:-$root/build-docker/clients/cli/deft-cli}
if [[ ! -x $cli ]]; then
  say "building the host's deft-cli (CPU) into build-docker/"
  DEFT_BUILD_DIR=$root/build-docker DEFT_BUILD_TARGETS=deft-cli \
    "$root/scripts/build.sh" -DDEFT_ENABLE_CUDA=OFF >"$work/host-cli.log" 2>&1 ||
    { tail -20 "$work/host-cli.log"; exit 1; }
fi

have_image() { buildah images --noheading --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep -x "$1" >/dev/null; }
# Waits for background job $1 writing log $2, printing its newest progress line every 30 s.
progress() {
  local pid=$1 log=$2 label=$3 started=$SECONDS last=""
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    if (((SECONDS - started) % 30 < 5)); then
      last=$(grep -E '^(\[[0-9]+/[0-9]+\]|STEP|\[[0-9]/[0-9]\] STEP)' "$log" 2>/dev/null | tail -1 | cut -c1-100)
      say "$label: $((SECONDS - started)) s ${last:+- $last}"
    fi
  done
  wait "$pid"
}

cuda_version=$("${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>/dev/null |
  sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p' || true)
declare -A build_args=(
  [cpu]="--build-arg BUILD_IMAGE=localhost/debian:12 --build-arg RUNTIME_IMAGE=localhost/debian:12 --build-arg DEFT_ENABLE_CUDA=OFF"
  [cuda]="--build-arg BUILD_IMAGE=localhost/cuda:$cuda_version-devel-debian12 --build-arg RUNTIME_IMAGE=localhost/cuda:$cuda_version-runtime-debian12"
)
declare -A bases=([cpu]="debian" [cuda]="cuda-devel cuda-runtime")

# ---- Bases and images -------------------------------------------------------------------------
for variant in "${variants[@]}"; do
  [[ $variant == lb ]] && continue
  image=localhost/deft-server:$variant
  if ((build)); then
    if [[ $variant == cuda && -z $cuda_version ]]; then
      record FAIL "cuda: build" "no CUDA toolkit at ${CUDA_HOME:-/usr/local/cuda}"
      continue
    fi
    need=()
    for base in ${bases[$variant]}; do
      case $base in
        debian) have_image localhost/debian:12 || need+=(debian) ;;
        cuda-devel) have_image "localhost/cuda:$cuda_version-devel-debian12" || need+=(cuda-devel) ;;
        cuda-runtime) have_image "localhost/cuda:$cuda_version-runtime-debian12" || need+=(cuda-runtime) ;;
      esac
    done
    if ((${#need[@]})); then
      say "making local bases: ${need[*]}"
      start=$SECONDS
      if "$root/docker/make-local-base.sh" "${need[@]}" >"$work/base-$variant.log" 2>&1; then
        record PASS "$variant: local bases ${need[*]}" "$((SECONDS - start)) s"
      else
        tail -20 "$work/base-$variant.log"
        record FAIL "$variant: local bases ${need[*]}" "see $work/base-$variant.log"
        continue
      fi
    fi
    say "building $image (log: $work/build-$variant.log)"
    start=$SECONDS
    # shellcheck disable=SC2086  # the build arguments are words
    nice -n 10 buildah build --isolation chroot --format docker --layers --pull=false \
      -f "$root/docker/Dockerfile" ${build_args[$variant]} -t "$image" "$root" \
      >"$work/build-$variant.log" 2>&1 &
    if progress $! "$work/build-$variant.log" "build $variant"; then
      record PASS "$variant: build" "$((SECONDS - start)) s; ccache $(grep -iE '^ *(hits|misses):' "$work/build-$variant.log" | tr -s ' ' | paste -sd, | cut -c1-60)"
    else
      tail -30 "$work/build-$variant.log"
      record FAIL "$variant: build" "see $work/build-$variant.log"
      continue
    fi
  fi
  have_image "$image" || { record FAIL "$variant: image $image exists"; continue; }
done

# ---- Checks of one image ----------------------------------------------------------------------
container=
lb_containers=()
lb_network=deft-test-lb
cleanup() {
  [[ -n $container ]] && podman rm -f "$container" >/dev/null 2>&1
  ((${#lb_containers[@]})) && podman rm -f "${lb_containers[@]}" >/dev/null 2>&1
  podman network exists "$lb_network" 2>/dev/null && podman network rm "$lb_network" >/dev/null 2>&1
  return 0
}
trap cleanup EXIT

# Waits up to 120 s until container $1's HEALTHCHECK (podman healthcheck run: the image's own
# command) passes; on failure prints the last status and the log's tail.
wait_healthy() {
  local status=""
  for _ in $(seq 1 120); do
    status=$(podman healthcheck run "$1" 2>&1) && return 0
    [[ $(podman inspect -f '{{.State.Running}}' "$1") == true ]] || break
    sleep 1
  done
  echo "$1: $status"
  podman logs "$1" 2>&1 | tail -20
  return 1
}

# Starts $image as container $container with extra podman flags and waits until it is healthy.
# Sets grpc_port and metrics_port.
start_server() {
  local label=$1
  shift
  local started=$SECONDS
  podman rm -f "$container" >/dev/null 2>&1 || true
  podman run -d --name "$container" "${run_flags[@]}" -p 127.0.0.1::50051 -p 127.0.0.1::9464 \
    "$@" "$image" >"$work/$container.id" 2>"$work/$container.err" ||
    { cat "$work/$container.err"; record FAIL "$label: container starts"; return 1; }
  grpc_port=$(podman port "$container" 50051/tcp | head -1 | sed 's/.*://')
  metrics_port=$(podman port "$container" 9464/tcp | head -1 | sed 's/.*://')
  if wait_healthy "$container"; then
    record PASS "$label: HEALTHCHECK (deft-cli health in the container) SERVING" "$((SECONDS - started)) s after start"
  else
    record FAIL "$label: HEALTHCHECK SERVING"
    return 1
  fi
}

# Stops the container the way a runtime does (STOPSIGNAL, then SIGKILL after 30 s) and checks a
# clean exit 0 within the server's 10 s grace.
stop_server() {
  local label=$1 started=$SECONDS code
  podman stop --time 30 "$container" >/dev/null 2>&1 || true
  local took=$((SECONDS - started))
  code=$(podman inspect -f '{{.State.ExitCode}}' "$container")
  podman logs "$container" >"$work/$container.log" 2>&1
  if [[ $code == 0 ]] && ((took < 15)) && grep -q SIGTERM "$work/$container.log"; then
    record PASS "$label: podman stop (SIGTERM) -> exit 0" "${took} s"
  else
    tail -5 "$work/$container.log"
    record FAIL "$label: podman stop (SIGTERM) -> exit 0" "exit $code after ${took} s"
  fi
  podman rm -f "$container" >/dev/null 2>&1
  container=
}

check_outside() {
  local label=$1 out
  if out=$("$cli" --server "127.0.0.1:$grpc_port" health 2>&1) && [[ $out == SERVING ]]; then
    record PASS "$label: host deft-cli health via published port $grpc_port" "$out"
  else
    record FAIL "$label: host deft-cli health via published port $grpc_port" "$out"
  fi
  if out=$("$cli" --server "127.0.0.1:$grpc_port" generate --n 2 --max-tokens 8 "Once upon a time" 2>&1) &&
    [[ -n $out ]]; then
    echo "$out" >"$work/$container.generate.txt"
    record PASS "$label: host deft-cli generate --n 2" "$(echo "$out" | tr '\n' ' ' | cut -c1-60)"
  else
    record FAIL "$label: host deft-cli generate --n 2" "$(echo "$out" | tail -1)"
  fi
}

no_compiler() {
  local label=$1 found
  found=$(podman run --rm "${run_flags[@]}" --entrypoint sh "$image" -c \
    'for t in gcc cc c++ g++ nvcc ptxas cmake ninja; do command -v $t; done; ls -d /usr/local/cuda/bin 2>/dev/null' || true)
  if [[ -z $found ]]; then
    record PASS "$label: no compiler or CUDA toolkit binaries in the image"
  else
    record FAIL "$label: no compiler in the image" "$(echo "$found" | paste -sd' ')"
  fi
}

non_root() {
  local label=$1 uid
  uid=$(podman run --rm "${run_flags[@]}" "$image" id -u 2>/dev/null || true)
  if [[ $uid != 0 && $uid =~ ^[0-9]+$ ]]; then
    record PASS "$label: runs as a non-root user" "uid $uid"
  else
    record FAIL "$label: runs as a non-root user" "$uid"
  fi
}

# The server's log has the line "$2" (e.g. "model: DIR ", "on the cpu backend").
model_in_log() {
  local label=$1 pattern=$2
  podman logs "$container" >"$work/$container.log" 2>&1
  if grep -q "$pattern" "$work/$container.log"; then
    record PASS "$label: log says \"${pattern% }\""
  else
    tail -5 "$work/$container.log"
    record FAIL "$label: log says \"${pattern% }\""
  fi
}

# The CUDA image's server is a CUDA build: it links cuBLAS, which the runtime base provides.
links_cublas() {
  local found
  found=$(podman run --rm "${run_flags[@]}" --entrypoint ldd "$image" /opt/deft/bin/deft-server 2>&1 |
    awk '/libcublas/ { print $3 }' | paste -sd' ')
  if [[ $found == /usr/local/cuda* ]]; then
    record PASS "$1: deft-server is a CUDA build (cuBLAS from the base)" "$found"
  else
    record FAIL "$1: deft-server is a CUDA build (cuBLAS from the base)" "${found:-no libcublas}"
  fi
}

# docker/compose.yaml's topology: replicas deft-1 and deft-2 (the CPU image) behind nginx with
# docker/nginx.conf. nginx finds the replicas by --add-host (podman's CNI here has no DNS plugin).
check_balancer() {
  local image=localhost/deft-server:cpu name port served ok=0 started=$SECONDS
  local -a addresses=()
  have_image "$image" || { record FAIL "lb: needs $image (docker/test-images.sh cpu)"; return; }
  if ! have_image localhost/nginx:debian12 &&
    ! "$root/docker/make-local-base.sh" nginx >"$work/base-nginx.log" 2>&1; then
    record FAIL "lb: local nginx image" "see $work/base-nginx.log"
    return
  fi
  podman network exists "$lb_network" || podman network create "$lb_network" >/dev/null
  lb_containers=(deft-test-1 deft-test-2 deft-test-nginx)
  podman rm -f "${lb_containers[@]}" >/dev/null 2>&1 || true
  for name in deft-test-1 deft-test-2; do
    podman run -d --name "$name" --network "$lb_network" "${run_flags[@]}" "$image" \
      >/dev/null 2>"$work/$name.err" || { cat "$work/$name.err"; record FAIL "lb: $name starts"; return; }
    addresses+=("$(podman inspect -f "{{(index .NetworkSettings.Networks \"$lb_network\").IPAddress}}" "$name")")
  done
  for name in deft-test-1 deft-test-2; do
    wait_healthy "$name" || { record FAIL "lb: $name healthy"; return; }
  done
  podman run -d --name deft-test-nginx --network "$lb_network" "${run_flags[@]}" \
    --add-host "deft-1:${addresses[0]}" --add-host "deft-2:${addresses[1]}" \
    -v "$root/docker/nginx.conf:/etc/nginx/nginx.conf:ro" -p 127.0.0.1::50051 localhost/nginx:debian12 \
    >/dev/null 2>"$work/nginx.err" || { cat "$work/nginx.err"; record FAIL "lb: nginx starts"; return; }
  port=$(podman port deft-test-nginx 50051/tcp | head -1 | sed 's/.*://')
  for _ in $(seq 1 20); do
    "$cli" --server "127.0.0.1:$port" health >/dev/null 2>&1 && break
    sleep 0.5
  done
  for _ in 1 2 3 4; do
    "$cli" --server "127.0.0.1:$port" generate --n 1 --max-tokens 4 "Once upon a time" \
      >>"$work/lb-generate.txt" 2>&1 && ok=$((ok + 1))
  done
  podman logs deft-test-nginx >"$work/nginx.log" 2>&1
  served=$(grep -c -e "upstream=${addresses[0]}:" -e "upstream=${addresses[1]}:" "$work/nginx.log" || true)
  if ((ok == 4)) && grep -q "upstream=${addresses[0]}:" "$work/nginx.log" &&
    grep -q "upstream=${addresses[1]}:" "$work/nginx.log"; then
    record PASS "lb: 4 generates through nginx (docker/nginx.conf), both replicas served" \
      "$served proxied calls; $((SECONDS - started)) s"
  else
    tail -5 "$work/nginx.log"
    record FAIL "lb: 4 generates through nginx, both replicas served" "$ok of 4 answered"
  fi
  podman stop --time 30 deft-test-1 >/dev/null 2>&1 || true
  if [[ $(podman inspect -f '{{.State.ExitCode}}' deft-test-1) == 0 ]] &&
    "$cli" --server "127.0.0.1:$port" generate --n 1 --max-tokens 4 "Once upon a time" \
      >>"$work/lb-generate.txt" 2>&1 &&
    "$cli" --server "127.0.0.1:$port" generate --n 1 --max-tokens 4 "Once upon a time" \
      >>"$work/lb-generate.txt" 2>&1; then
    record PASS "lb: deft-1 stopped (exit 0): 2 generates through nginx still answered"
  else
    record FAIL "lb: deft-1 stopped: generates through nginx still answered"
  fi
  podman rm -f "${lb_containers[@]}" >/dev/null 2>&1 || true
  lb_containers=()
  podman network rm "$lb_network" >/dev/null 2>&1 || true
}

for variant in "${variants[@]}"; do
  if [[ $variant == lb ]]; then
    say "checking the compose topology (two CPU replicas behind nginx)"
    check_balancer
    continue
  fi
  image=localhost/deft-server:$variant
  have_image "$image" || continue
  container=deft-test-$variant
  size=$(podman image inspect -f '{{.Size}}' "$image")
  echo "image $image: $((size / 1000000)) MB" >>"$summary"
  say "checking $image ($((size / 1000000)) MB)"
  no_compiler "$variant"
  non_root "$variant"
  [[ $variant == cuda ]] && links_cublas cuda
  # Read-only root filesystem, no tmpfs: as the Kubernetes Deployment runs it.
  if start_server "$variant" --read-only --read-only-tmpfs=false; then
    check_outside "$variant"
    model_in_log "$variant" "model: /opt/deft/share/deft/models/default "
    if [[ $variant == cuda ]]; then
      model_in_log cuda "on the cpu backend"
    fi
    if [[ $variant == cpu ]]; then
      if curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$work/metrics.txt" && grep -q '^# TYPE' "$work/metrics.txt"; then
        record PASS "cpu: /metrics via published port $metrics_port" "$(grep -c '^# TYPE' "$work/metrics.txt") metric families"
      else
        record FAIL "cpu: /metrics via published port $metrics_port"
      fi
    fi
    stop_server "$variant"
  fi
  if [[ $variant == cpu ]]; then
    # The /models convention: the repository's default model is a Hugging Face directory too.
    container=deft-test-cpu-models
    if start_server "cpu /models" --read-only --read-only-tmpfs=false \
      -v "$root/models/default:/models:ro"; then
      model_in_log "cpu /models" "model: /models "
      stop_server "cpu /models"
    fi
  fi
done

echo
echo "==== docker/test-images.sh summary ($(date -u +%FT%TZ), $(git -C "$root" rev-parse --short HEAD)) ===="
cat "$summary"
echo "$failures failed"
((failures == 0))
