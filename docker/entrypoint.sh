#!/bin/sh
# The images' entry point: starts deft-server with the container's settings, or runs the given
# program when the first argument is not an option (`docker run IMAGE deft-cli ...`).
#   /etc/deft/server.json  listen on 0.0.0.0:50051 (gRPC), 0.0.0.0:8000 (HTTP API) and
#                          0.0.0.0:9464 (metrics); a --config
#                          of yours is read after it, and options override both
#   /models                a Hugging Face checkpoint mounted here (config.json, *.safetensors,
#                          tokenizer) is served; without one, the embedded default model
# exec: the server is PID 1 and gets the runtime's SIGTERM itself (it drains, then exits 0).
set -eu
if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
  exec "$@"
fi
if [ -f /models/config.json ]; then
  set -- --model /models "$@"
fi
exec /opt/deft/bin/deft-server --config /etc/deft/server.json "$@"
