#!/usr/bin/env bash
# ctest integration.http_curl: the HTTP API's raw forms as curl sees them: the server-sent
# events of a stream (Content-Type, `data: {json}` + blank line per event, usage last, then
# `data: [DONE]`), an error body in OpenAI's shape, /health, /metrics on the same HTTP stack;
# and deft-cli's defaults ($DEFT_SERVER, a tree without flags).
#   http_sse_curl_test.sh DEFT_SERVER_BINARY DEFT_CLI_BINARY
set -euo pipefail
server=$1
cli=$2
work=$(mktemp -d)
pid=
cleanup() {
  [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  echo "--- server log ---"
  cat "$work/server.log"
  exit 1
}

"$server" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
  --port-file "$work/ports" >"$work/server.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  if [[ -f $work/ports ]] && grep -q '^http=' "$work/ports"; then
    http=$(sed -n 's/^http=//p' "$work/ports")
    [[ $(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$http/health") == 200 ]] && break
  fi
  sleep 0.1
done
http=$(sed -n 's/^http=//p' "$work/ports")
grpc=$(sed -n 's/^grpc=//p' "$work/ports")
metrics=$(sed -n 's/^metrics=//p' "$work/ports")
base=http://127.0.0.1:$http

echo "== SSE stream, raw =="
curl -sSN -D "$work/headers" "$base/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "default", "prompt": "Once upon a time", "max_tokens": 4, "n": 2,
       "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true}' \
  >"$work/stream"
cat "$work/stream"
grep -qi '^content-type: text/event-stream' "$work/headers" || fail "no text/event-stream header"
grep -qi '^transfer-encoding: chunked' "$work/headers" || fail "the stream is not chunked"
# Every event is one `data: ` line followed by a blank line.
awk 'NR % 2 == 1 && !/^data: / { exit 1 } NR % 2 == 0 && $0 != "" { exit 1 }' "$work/stream" ||
  fail "an event is not 'data: ...' followed by a blank line"
[[ $(tail -n 2 "$work/stream" | head -n 1) == "data: [DONE]" ]] || fail "no [DONE] at the end"
usage_line=$(tail -n 4 "$work/stream" | head -n 1)
[[ $usage_line == *'"choices":[]'* && $usage_line == *'"completion_tokens":8'* ]] ||
  fail "the chunk before [DONE] is not the usage chunk: $usage_line"
[[ $(grep -c '"finish_reason":"length"' "$work/stream") == 2 ]] || fail "two branches must finish"

echo "== chat stream, raw =="
curl -sSN "$base/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
       "stream": true}' >"$work/chat"
head -n 1 "$work/chat" | grep -q '"delta":{.*"role":"assistant"' || fail "chat: no role first"
[[ $(tail -n 2 "$work/chat" | head -n 1) == "data: [DONE]" ]] || fail "chat: no [DONE]"

echo "== errors in OpenAI's shape =="
code=$(curl -s -o "$work/error" -w '%{http_code}' "$base/v1/completions" -d '{"model": ')
cat "$work/error"; echo
[[ $code == 400 ]] || fail "bad JSON answered $code"
grep -q '"error":{"code":"invalid_json","message":' "$work/error" || fail "bad JSON: not an OpenAI error"
code=$(curl -s -o "$work/error" -w '%{http_code}' "$base/v1/nothing")
[[ $code == 404 ]] && grep -q '"type":"invalid_request_error"' "$work/error" || fail "unknown route: $code"
code=$(curl -s -o "$work/error" -w '%{http_code}' "$base/v1/completions" \
  -d '{"model": "default", "prompt": "x", "top_p": "high"}')
[[ $code == 400 ]] && grep -q '"param":"top_p"' "$work/error" || fail "top_p string: $code"

echo "== /metrics on the same HTTP stack =="
curl -sS "127.0.0.1:$metrics/metrics" >"$work/metrics"
grep -q 'deft_requests_total{.*rpc="openai.completions"' "$work/metrics" ||
  fail "no openai.completions request in /metrics"
[[ $(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$metrics/other") == 404 ]] ||
  fail "metrics port: an unknown path is not 404"

echo "== deft-cli: \$DEFT_SERVER and a tree by default =="
DEFT_SERVER=127.0.0.1:$grpc "$cli" tree --quiet --max-tokens 40 --ignore-eos "Once upon a time" \
  >"$work/tree" 2>&1 || { cat "$work/tree"; fail "deft-cli tree"; }
cat "$work/tree"
grep -q 'depth 2' "$work/tree" || fail "deft-cli tree without flags did not branch twice"
echo "PASS"
