#!/usr/bin/env bash
# The install layout end to end: `cmake --install` into a prefix, the prefix moved elsewhere, then
# its deft-tree and deft-server run from there on the installed default model and tokenizer
# plugin (their logs must name the moved prefix), and its deft-cli talks to that server.
#   install_test.sh BUILD_DIR
set -euo pipefail
build=$1
work=$(mktemp -d)
server_pid=
cleanup() {
  [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

cmake --install "$build" --prefix "$work/first" >/dev/null
mv "$work/first" "$work/moved"
prefix=$work/moved
for path in bin/deft-server bin/deft-cli bin/deft-tree lib/deft/libdeft_sentencepiece.so \
            share/deft/models/default/config.json share/deft/configs/default.json; do
  [[ -e $prefix/$path ]] || { echo "install_test: $path is missing from the prefix"; exit 1; }
done

# deft-tree: the installed default model (its tokenizer.model goes through the plugin).
(cd "$work" && "$prefix/bin/deft-tree" --branch 2 --every 4 --depth 1 --max-tokens 8) \
  >"$work/tree.txt" 2>&1 || { cat "$work/tree.txt"; exit 1; }
grep -q "summary: model $prefix/share/deft/models/default" "$work/tree.txt" ||
  { echo "install_test: deft-tree did not run the installed model:"; cat "$work/tree.txt"; exit 1; }

# deft-server from the moved prefix, on any free port (the port file says which).
(cd "$work" && exec "$prefix/bin/deft-server" --config "$prefix/share/deft/configs/default.json" \
  --listen 127.0.0.1:0 --metrics-listen "" --http-listen 127.0.0.1:0 --port-file "$work/ports" --log-level info) \
  >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 300); do
  [[ -s $work/ports ]] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.1
done
[[ -s $work/ports ]] || { echo "install_test: the server did not start"; cat "$work/server.log"; exit 1; }
port=$(head -1 "$work/ports" | tr -dc '0-9')
grep -q "$prefix/share/deft/models/default" "$work/server.log" ||
  { echo "install_test: the server did not load the installed model:"; cat "$work/server.log"; exit 1; }
# The port is open before the model loads; health says SERVING once it has.
for _ in $(seq 1 300); do
  "$prefix/bin/deft-cli" --server "127.0.0.1:$port" health >/dev/null 2>&1 && break
  sleep 0.1
done
"$prefix/bin/deft-cli" --server "127.0.0.1:$port" health
"$prefix/bin/deft-cli" --server "127.0.0.1:$port" generate --n 2 --max-tokens 4 "Once upon a time"
echo "install_test: the moved prefix $prefix serves"
