"""Bad input on deft-server's HTTP ports (the OpenAI API and /metrics share one HTTP stack,
server/http_server.h): oversized request lines, headers and bodies, chunked bodies, garbage
bytes, JSON that is deep, huge or not UTF-8, and clients that stall; each gets an error or a
closed connection, never a crash, and the server goes on serving. Standard library only.
Run by ctest (integration.http_hardening) with DEFT_SERVER_BINARY set."""

import json
import os
import random
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.request

SERVER = os.environ["DEFT_SERVER_BINARY"]
READ_TIMEOUT_S = 10  # HttpServerOptions::read_timeout


def start_server():
    work = tempfile.TemporaryDirectory(prefix="deft-http-")
    port_file = os.path.join(work.name, "ports")
    log = open(os.path.join(work.name, "server.log"), "w")
    process = subprocess.Popen(
        [SERVER, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--port-file", port_file, "--http-threads", "2",
         "--max-text-bytes", "4096", "--kv-pages", "256"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    ports = {}
    while time.time() < deadline:
        if process.poll() is not None:
            break
        if os.path.exists(port_file):
            with open(port_file) as text:
                ports = dict(line.split("=") for line in text.read().split())
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/health",
                                          timeout=2).status == 200:
                    break
            except OSError:
                pass
        time.sleep(0.05)
    return process, work, log, {k: int(v) for k, v in ports.items()}


def exchange(port, data, read_timeout=15.0):
    """Sends raw bytes, returns everything the server answers until it closes (or b"" when it
    closed without a word)."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server may close before reading everything: fine
        answer = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
                if b"\r\n\r\n" in answer and b"Connection: close" not in answer:
                    # keep-alive answer: stop at the end of the body
                    head, _, body = answer.partition(b"\r\n\r\n")
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            if len(body) >= int(line.split(b":")[1]):
                                return answer
        except (socket.timeout, ConnectionResetError):
            pass
        return answer


def status_of(answer):
    if not answer.startswith(b"HTTP/1."):
        return None
    return int(answer.split(b" ", 2)[1])


def body_of(answer):
    return answer.partition(b"\r\n\r\n")[2]


def post(path, body, extra_headers=b""):
    if isinstance(body, str):
        body = body.encode()
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n" + extra_headers +
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class HttpHardeningTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.process, cls.work, cls.log, cls.ports = start_server()
        if "http" not in cls.ports:
            raise RuntimeError("deft-server did not serve HTTP:\n" + cls.server_log())
        cls.http = cls.ports["http"]
        cls.metrics = cls.ports["metrics"]

    @classmethod
    def tearDownClass(cls):
        cls.process.terminate()
        code = cls.process.wait(timeout=30)
        cls.log.close()
        cls.work.cleanup()
        assert code == 0, f"deft-server exit code {code}"

    @classmethod
    def server_log(cls):
        with open(os.path.join(cls.work.name, "server.log")) as log:
            return log.read()

    def assert_alive(self):
        self.assertIsNone(self.process.poll(), self.server_log())
        answer = exchange(self.http, post("/v1/completions",
                                          '{"model": "default", "prompt": "Once", "max_tokens": 2}'))
        self.assertEqual(status_of(answer), 200, answer[:300])
        metrics = exchange(self.metrics, b"GET /metrics HTTP/1.0\r\n\r\n")
        self.assertIn(b"deft_engine_steps_total", metrics)

    def assert_openai_error(self, answer, status, param=None):
        self.assertEqual(status_of(answer), status, answer[:400])
        error = json.loads(body_of(answer))["error"]
        self.assertIsInstance(error["message"], str)
        self.assertIn("type", error)
        if param is not None:
            self.assertEqual(error["param"], param)
        return error

    def test_oversized_request_line_and_header(self):
        for port in (self.http, self.metrics):
            answer = exchange(port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            self.assertIn(status_of(answer), (400, 414, None), answer[:200])
            answer = exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20000 +
                              b"\r\n\r\n")
            self.assertIn(status_of(answer), (400, 431, None), answer[:200])
        self.assert_alive()

    def test_oversized_and_chunked_bodies(self):
        # Content-Length over the limit: 413 before the body is read (none is sent).
        answer = exchange(self.http, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 900000000\r\n\r\n")
        self.assert_openai_error(answer, 413)
        # A body the library would not bound: refused.
        answer = exchange(self.http, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Transfer-Encoding: chunked\r\n\r\n" +
                          b"10000\r\n" + b"x" * 65536 + b"\r\n")
        self.assert_openai_error(answer, 411)
        # The refused body is not read as the next request: the connection closes.
        smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        answer = exchange(self.http, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Transfer-Encoding: chunked\r\n\r\n" + smuggled)
        self.assertEqual(answer.count(b"HTTP/1.1 "), 1, answer)
        answer = exchange(self.http, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 900000000\r\n\r\n" + smuggled)
        self.assertEqual(answer.count(b"HTTP/1.1 "), 1, answer)
        # Text over max_text_bytes inside an accepted body: 400 naming the field.
        answer = exchange(self.http, post("/v1/completions", json.dumps(
            {"model": "default", "prompt": "x" * 5000})))
        self.assert_openai_error(answer, 400, "prompt")
        self.assert_alive()

    def test_garbage(self):
        rng = random.Random(1234)
        for _ in range(20):
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))
            for port in (self.http, self.metrics):
                answer = exchange(port, junk + b"\r\n\r\n", read_timeout=READ_TIMEOUT_S + 5)
                self.assertIn(status_of(answer), (400, 404, 405, None), answer[:200])
        for bad in (b"GET\r\n\r\n", b"HELLO / HTTP/1.1\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n"):
            answer = exchange(self.http, bad, read_timeout=READ_TIMEOUT_S + 5)
            self.assertNotEqual(status_of(answer), 200, (bad, answer[:200]))
        self.assert_alive()

    def test_bad_json(self):
        cases = [
            (b"[" * 100000, None),                      # deep nesting
            (b'{"model": "default", "prompt": "\xff\xfe"}', None),  # not UTF-8
            (b"null", None),
            (b'{"model": "default", "prompt": ["a", "b"]}', "prompt"),  # several prompts
            (b'{"model": "default", "prompt": [1, 99999999]}', "prompt"),  # id out of vocab
            (b'{"model": "default", "prompt": "x", "n": 1e9}', "n"),
            (b'{"model": "default", "prompt": "x", "stop": [1]}', "stop"),
            (b'{"model": "default", "prompt": "x", "logprobs": 99}', "logprobs"),
            (b'{"model": "default", "prompt": "x", "deft": {"tree": {"max_depth": 99}}}', "deft.tree"),
            (b'{"model": "default", "messages": "hi"}', None),
            # Fields of the wrong JSON type inside objects (once a 500 from a throwing lookup).
            (b'{"model": "default", "prompt": "x", "response_format": {"type": 5}}',
             "response_format"),
            (b'{"model": "default", "messages": [{"role": "user", "content": '
             b'[{"type": 7, "text": "a"}]}]}', "messages[0].content[0]"),
            # An id past int32 is refused, not wrapped (2^32 + 2 is not token 2).
            (b'{"model": "default", "prompt": "x", "stop_token_ids": [4294967298]}',
             "stop_token_ids"),
        ]
        for body, param in cases:
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            answer = exchange(self.http, post(path, body))
            self.assert_openai_error(answer, 400, param)
        self.assert_alive()

    def test_slow_clients_lose_their_connection(self):
        # Two stalled clients on a server with two HTTP threads: each is dropped after the read
        # timeout, and the server answers again afterwards.
        stalled = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", self.http))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            stalled.append(sock)
        start = time.time()
        for sock in stalled:
            sock.settimeout(READ_TIMEOUT_S + 10)
            try:
                sock.recv(4096)  # the server closes (maybe after an error answer)
            except (socket.timeout, ConnectionResetError):
                self.fail("the server kept a stalled client beyond its read timeout")
            sock.close()
        self.assertLess(time.time() - start, READ_TIMEOUT_S + 8)
        self.assert_alive()


if __name__ == "__main__":
    unittest.main(verbosity=2)
