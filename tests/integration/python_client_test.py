"""Integration test of the Python client (clients/python/deft_client.py) against the real
deft-server binary on a loopback port. Run by ctest (integration.python_client) with
PYTHONPATH holding the generated stubs and the client, and DEFT_SERVER_BINARY set."""

import os
import signal
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc

from deft_client import DeftClient
from deft.v1 import deft_pb2

SERVER = os.environ["DEFT_SERVER_BINARY"]
KV_PAGES = 512
MAX_TEXT_BYTES = 2048


class Server:
    def __init__(self, *extra):
        self.dir = tempfile.TemporaryDirectory(prefix="deft-py-")
        port_file = os.path.join(self.dir.name, "ports.txt")
        self.log_path = os.path.join(self.dir.name, "server.log")
        args = [SERVER, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--port-file", port_file, "--kv-pages", str(KV_PAGES),
                "--max-text-bytes", str(MAX_TEXT_BYTES), "--shutdown-grace-seconds", "5",
                *extra]
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(args, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            if self.process.poll() is not None:
                raise RuntimeError(f"deft-server exited with {self.process.returncode}:\n{self.log()}")
            if time.time() > deadline:
                raise RuntimeError(f"deft-server did not listen:\n{self.log()}")
            time.sleep(0.02)
        with open(port_file) as f:
            ports = dict(line.split("=") for line in f.read().split())
        self.grpc_port = int(ports["grpc"])
        self.metrics_port = int(ports["metrics"])
        self.address = f"127.0.0.1:{self.grpc_port}"

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def metrics(self):
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()
        values = {}
        for line in body.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split(" ", 1)
                values[name] = float(value)
        return values

    def wait_metric(self, name, value, timeout=10.0):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            last = self.metrics().get(name)
            if last == value:
                return last
            time.sleep(0.02)
        return last

    def stop(self, sig=signal.SIGTERM, timeout=30):
        self.process.send_signal(sig)
        code = self.process.wait(timeout=timeout)
        self.log_file.close()
        return code


server = None
client = None


def setUpModule():
    global server, client
    server = Server()
    client = DeftClient(server.address)
    client.wait_until_serving()


def tearDownModule():
    assert client.health() == "SERVING"
    client.close()
    code = server.stop()
    assert code == 0, f"deft-server exited with {code}:\n{server.log()}"


class PythonClientTest(unittest.TestCase):
    def tearDown(self):
        # Every test leaves the engine idle and the KV cache empty.
        self.assertEqual(server.wait_metric("deft_live_jobs", 0), 0)
        self.assertEqual(server.wait_metric("deft_kv_pages_used", 0), 0)

    def assertRpcError(self, code, mention, call, *args, **kwargs):
        with self.assertRaises(grpc.RpcError) as raised:
            result = call(*args, **kwargs)
            if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
                list(result)
        self.assertEqual(raised.exception.code(), code, raised.exception.details())
        self.assertIn(mention, raised.exception.details())

    def test_health(self):
        self.assertEqual(client.health(), "SERVING")
        self.assertEqual(client.health("deft.v1.Deft"), "SERVING")
        self.assertRpcError(grpc.StatusCode.NOT_FOUND, "", client.health, "no.such.Service")

    def test_reflection_lists_the_service(self):
        # grpc.reflection.v1alpha ServerReflectionRequest{list_services = 7: ""}, by hand.
        call = client.channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        responses = list(call(iter([b"\x3a\x00"]), timeout=10))
        self.assertEqual(len(responses), 1)
        self.assertIn(b"deft.v1.Deft", responses[0])
        self.assertIn(b"grpc.health.v1.Health", responses[0])

    def test_model_info(self):
        info = client.model_info()
        self.assertEqual(info.architecture, "LlamaForCausalLM")
        self.assertEqual(info.vocab_size, 512)
        self.assertEqual(info.num_layers, 4)
        self.assertEqual(info.kv_capacity_tokens, KV_PAGES * 16)
        self.assertEqual(info.backend, "cpu")

    def test_tokenize_round_trip(self):
        text = "The tree grew tall, and its branches spread."
        ids = client.tokenize(text)
        self.assertTrue(ids)
        self.assertEqual(client.tokenize(text, add_bos=True), [1] + ids)
        self.assertEqual(client.detokenize(ids), text)

    def test_tokenizer_bad_inputs(self):
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, str(MAX_TEXT_BYTES),
                            client.tokenize, "a" * (MAX_TEXT_BYTES + 1))
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, "ids[2] = 512",
                            client.detokenize, [3, 4, 512])
        self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, "ids[0] = -5",
                            client.detokenize, [-5])

    def test_generate(self):
        branches = client.generate("Once upon a time", n=3, max_tokens=10)
        self.assertEqual([b.index for b in branches], [0, 1, 2])
        for branch in branches:
            self.assertIn(branch.finish_reason, ("length", "eos"))
            self.assertEqual(len(branch.logprobs), len(branch.ids))
            if branch.finish_reason == "length":
                self.assertEqual(len(branch.ids), 10)
        # Greedy with n > 1: branch i starts with the i-th most likely token, then argmax;
        # branch 0 is the plain greedy continuation.
        self.assertEqual(len({b.ids[0] for b in branches}), 3)
        alone = client.generate("Once upon a time", n=1, max_tokens=10)
        self.assertEqual(alone[0].ids, branches[0].ids)

    def test_generate_matches_the_cpp_client_semantics_for_token_prompts(self):
        a = client.generate([1, 20, 21, 22], n=2, max_tokens=6, temperature=0.9, seed=7)
        b = client.generate([1, 20, 21, 22], n=2, max_tokens=6, temperature=0.9, seed=7)
        self.assertEqual([x.ids for x in a], [x.ids for x in b])

    def test_generate_bad_inputs(self):
        cases = [
            (dict(prompt=[1, 999]), "prompt.tokens.ids[1] = 999"),
            (dict(prompt=[]), "prompt"),
            (dict(prompt="hi", n=-2), "n = -2"),
            (dict(prompt="hi", temperature=-1.0), "temperature"),
            (dict(prompt="hi", top_p=2.0), "top_p"),
            (dict(prompt="hi", max_tokens=-1), "max_tokens"),
            (dict(prompt="hi", stop=[""]), "sampling.stop[0]"),
            (dict(prompt="hi", stop_token_ids=[70000]), "70000"),
        ]
        for kwargs, mention in cases:
            with self.subTest(kwargs=kwargs):
                self.assertRpcError(grpc.StatusCode.INVALID_ARGUMENT, mention, client.generate,
                                    **kwargs)
        self.assertRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV pool", client.generate,
                            [1, 2], n=64, max_tokens=120)

    def test_malformed_message(self):
        # Bytes that are not a TokenizeRequest: gRPC's parser refuses them (INTERNAL) before
        # the handler; the server stays up.
        call = client.channel.unary_unary("/deft.v1.Deft/Tokenize",
                                          request_serializer=lambda raw: raw,
                                          response_deserializer=lambda raw: raw)
        with self.assertRaises(grpc.RpcError) as raised:
            call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INTERNAL)
        self.assertEqual(client.health(), "SERVING")

    def test_cancel_mid_stream_frees_kv(self):
        stream = client.generate_stream([1, 5, 6, 7], n=2, max_tokens=3000, ignore_eos=True)
        for _, response in zip(range(6), stream):
            pass
        self.assertEqual(server.metrics()["deft_live_jobs"], 1)
        stream.cancel()
        with self.assertRaises(grpc.RpcError) as raised:
            list(stream)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.CANCELLED)

    def test_closing_the_channel_mid_stream_frees_kv(self):
        other = DeftClient(server.address)
        stream = other.generate_stream("Once upon a time", n=2, max_tokens=3000,
                                       ignore_eos=True)
        next(iter(stream))
        self.assertEqual(server.metrics()["deft_live_jobs"], 1)
        other.close()  # the client goes away without cancelling

    def test_concurrent_generations_equal_each_alone(self):
        prompts = [[1] + [3 + (j * 37 + t * 11) % 500 for t in range(2 + j % 4)]
                   for j in range(8)]
        alone = [client.generate(p, n=2, max_tokens=12) for p in prompts]
        together = [None] * len(prompts)

        def run(j):
            with DeftClient(server.address) as own:
                together[j] = own.generate(prompts[j], n=2, max_tokens=12)

        threads = [threading.Thread(target=run, args=(j,)) for j in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for j in range(len(prompts)):
            self.assertEqual([b.ids for b in alone[j]], [b.ids for b in together[j]])


if __name__ == "__main__":
    unittest.main()
