"""Integration test of the Python client (clients/python/deft_client.py) against the real
deft-server binary on a loopback port. Run by ctest (integration.python_client) with
PYTHONPATH holding the generated stubs and the client, and DEFT_SERVER_BINARY set."""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc

from deft_client import DeftClient, NodeText, SessionError
from deft.v1 import deft_pb2

SERVER = os.environ["DEFT_SERVER_BINARY"]
SOURCE_DIR = os.environ.get("DEFT_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
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

    def test_speculative_generate_gives_the_plain_tokens(self):
        # Prompt lookup needs no draft model; a draft policy needs one (FAILED_PRECONDITION).
        prompt = "Once upon a time there was a tree. Once upon a time"
        plain = client.generate(prompt, n=2, max_tokens=24, temperature=0.7, seed=5)
        spec = client.generate(prompt, n=2, max_tokens=24, temperature=0.7, seed=5,
                               speculative={"policy": "ngram", "tree_tokens": 8})
        self.assertEqual([b.ids for b in spec], [b.ids for b in plain])
        self.assertIsNone(plain[0].speculative)
        self.assertGreater(spec[0].speculative["steps"], 0)
        with self.assertRaises(grpc.RpcError) as raised:
            client.generate("Once", max_tokens=4, speculative="static")
        self.assertEqual(raised.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(ValueError):
            client.generate("Once", speculative="sometimes")

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


class TreeClientTest(unittest.TestCase):
    """RunTree, TreeSession and Verify through the Python client (greedy results compared
    with Generate on the same tokens), and the tree-of-thought example as a smoke test."""

    PROMPT_TEXT = "Once upon a time there was a tree"

    @classmethod
    def setUpClass(cls):
        cls.prompt = client.tokenize(cls.PROMPT_TEXT, add_bos=True)

    def tearDown(self):
        self.assertEqual(server.wait_metric("deft_live_jobs", 0), 0)
        self.assertEqual(server.wait_metric("deft_kv_pages_used", 0), 0)

    def greedy(self, prompt, max_tokens):
        [branch] = client.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
        return branch

    def test_run_tree(self):
        run = client.run_tree(self.prompt, branch_factor=2, every_tokens=4, max_depth=3,
                              score="cumulative", keep_best=2, max_tokens=12, ignore_eos=True)
        self.assertTrue(run.finished)
        self.assertIsInstance(run.events[-1], deft_pb2.TreeEvent)
        self.assertEqual(run.events[-1].WhichOneof("event"), "finished")
        self.assertEqual(run.best_path[0], 0)
        self.assertIn(0, run.nodes)
        for node in run.created:
            self.assertIn(node, run.nodes)
        for node_id, node in run.nodes.items():
            if node_id != 0:
                self.assertEqual(node.ids, run.streamed.get(node_id, NodeText(node_id)).ids)
        for pruned in run.pruned:
            self.assertEqual(run.nodes[pruned].finish_reason, "pruned")
        self.assertTrue(run.pruned, "keep_best 2 of 4 must prune")
        for parent, child in zip(run.best_path, run.best_path[1:]):
            self.assertEqual(run.nodes[child].parent, parent)
        leaf = run.nodes[run.best_path[-1]]
        self.assertIn(leaf.finish_reason, ("length", "eos", "stop"))
        path_ids = sum((run.nodes[n].ids for n in run.best_path[1:]), [])
        self.assertLessEqual(len(path_ids), 12)
        self.assertAlmostEqual(leaf.score, sum(sum(run.nodes[n].logprobs)
                                               for n in run.best_path[1:]), places=3)
        self.assertTrue(run.best_text.endswith("".join(run.nodes[n].text
                                                       for n in run.best_path[1:])))

    def test_run_tree_with_one_branch_is_the_greedy_generation(self):
        run = client.run_tree(self.prompt, branch_factor=1, every_tokens=3, max_depth=8,
                              max_tokens=9, ignore_eos=True)
        path_ids = sum((run.nodes[n].ids for n in run.best_path[1:]), [])
        self.assertEqual(path_ids, self.greedy(self.prompt, 9).ids)

    def test_run_tree_bad_inputs(self):
        for options, mention in [
            (dict(branch_factor=-1, every_tokens=4), "branch_factor"),
            (dict(branch_factor=2, step_end_token=100000), "step_end_token"),
            (dict(branch_factor=2, every_tokens=4, keep_best=-1), "keep_best"),
        ]:
            with self.subTest(options=options):
                with self.assertRaises(grpc.RpcError) as raised:
                    client.run_tree(self.prompt, **options)
                self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT,
                                 raised.exception.details())
                self.assertIn(mention, raised.exception.details())
        with self.assertRaises(ValueError):
            client.run_tree(self.prompt, every_tokens=3, delimiter=".")

    def test_session(self):
        reference = self.greedy(self.prompt, 10)
        with client.session() as session:
            root = session.create(self.prompt)
            self.assertIsNotNone(session.session_id)
            extension = client.tokenize(" and a river")
            extended = session.extend(root, extension)
            self.assertEqual((extended.node, extended.length),
                             (root, len(self.prompt) + len(extension)))
            after = self.greedy(self.prompt + extension, 8)
            children = session.branch(root, 3)
            self.assertEqual(len(set(children)), 3)
            steps = session.decode(children, max_tokens=8, ignore_eos=True)
            for child in children:
                self.assertEqual(steps[child].ids, after.ids)
                self.assertEqual(steps[child].text, after.text)
                self.assertEqual(steps[child].finish_reason, "length")
            scored = session.score(root, after.ids)
            self.assertAlmostEqual(scored.logprob, sum(after.logprobs), places=3)
            for got, want in zip(scored.token_logprobs, after.logprobs):
                self.assertAlmostEqual(got, want, places=3)
            self.assertEqual(session.prune(children[1]), children[1])
            with self.assertRaises(SessionError) as raised:
                session.decode([children[1]], max_tokens=2)
            self.assertEqual(raised.exception.code(), grpc.StatusCode.NOT_FOUND)
            with self.assertRaises(SessionError) as raised:
                session.extend(children[0], [5, 100000])
            self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            # Still usable after the refused commands; a second root shares the prompt.
            other = session.create(self.prompt)
            self.assertEqual(session.decode(other, max_tokens=10, ignore_eos=True)[other].ids,
                             reference.ids)
            self.assertTrue(session.close())

    def test_session_pipelined_commands_answer_in_order(self):
        reference = self.greedy(self.prompt, 6)
        with client.session() as session:
            root = session.create(self.prompt)
            branch = session.send(branch=deft_pb2.BranchCommand(node=root, k=2))
            bad = session.send(prune=deft_pb2.PruneCommand(node=9999))
            children = list(branch.wait(30)[-1].branched.children)
            decode = session.decode_async(children, max_tokens=6, ignore_eos=True)
            score = session.send(score=deft_pb2.ScoreCommand(
                node=root, continuation=deft_pb2.Prompt(tokens=deft_pb2.TokenIds(
                    ids=reference.ids))))
            with self.assertRaises(SessionError) as raised:
                bad.wait(30)
            self.assertEqual(raised.exception.code(), grpc.StatusCode.NOT_FOUND)
            decoded = decode.wait(30)
            per_node = {}
            for response in decoded:
                per_node.setdefault(response.decoded.node, []).extend(response.decoded.delta.ids)
            self.assertEqual(per_node, {child: reference.ids for child in children})
            self.assertAlmostEqual(score.wait(30)[-1].scored.logprob, sum(reference.logprobs),
                                   places=3)

    def test_session_cancel_frees_kv(self):
        session = client.session()
        root = session.create(self.prompt)
        pending = session.decode_async([root], max_tokens=3000, ignore_eos=True)
        time.sleep(0.3)
        self.assertGreater(server.metrics()["deft_kv_pages_used"], 0)
        session.cancel()
        with self.assertRaises(grpc.RpcError) as raised:
            pending.wait(30)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.CANCELLED)

    def test_verify(self):
        g = self.greedy(self.prompt, 10).ids
        with client.session() as session:
            root = session.create(self.prompt)
            wrong = [7 if t != 7 else 8 for t in g]
            # The chain g0..g5 with a wrong sibling before each of its entries.
            tokens, parents, chain = [], [], []
            previous = -1
            for i in range(6):
                tokens += [wrong[i], g[i]]
                parents += [previous, previous]
                chain.append(len(tokens) - 1)
                previous = chain[-1]
            result = session.verify(root, tokens, parents)  # in the session's stream
            self.assertEqual(list(result.accepted), g[:6])
            self.assertEqual(list(result.accepted_entries), chain)
            self.assertEqual(result.bonus_token, g[6])
            # Drafting after the bonus token: it goes first (the Verify RPC this time).
            more = client.verify(session, result.node, [g[6], g[7], wrong[8]], [-1, 0, 1])
            self.assertEqual(list(more.accepted), g[6:8])
            self.assertEqual(more.bonus_token, g[8])
            self.assertEqual(session.decode(more.node, max_tokens=2, ignore_eos=True)[
                more.node].ids, g[8:10])
            for tokens, parents, mention in [([5, 6], [-1, 3], "parent"),
                                             ([5, 6], [1, 0], "parent"),
                                             ([5, 512], [-1, 0], "512"),
                                             ([5, 6], [-1], "parents")]:
                with self.subTest(parents=parents):
                    with self.assertRaises(SessionError) as in_stream:
                        session.verify(root, tokens, parents)
                    with self.assertRaises(grpc.RpcError) as unary:
                        client.verify(session, root, tokens, parents)
                    for raised in (in_stream, unary):
                        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                        self.assertIn(mention, raised.exception.details())
            # Draft distributions: each child improbable under its q is accepted at T = 1.
            for draft_sampling in ("with_replacement", "without_replacement"):
                with self.subTest(draft_sampling=draft_sampling):
                    distributions = {-1: {9: 0.9, 5: 1e-30}, 0: {6: 1e-30, 9: 0.9}}
                    sampled = dict(draft_distributions=distributions,
                                   draft_sampling=draft_sampling, temperature=1.0, seed=3)
                    leaf = session.branch(root, 1)[0]
                    in_stream = session.verify(leaf, [5, 6], [-1, 0], **sampled)
                    self.assertEqual(list(in_stream.accepted), [5, 6])
                    leaf = session.branch(root, 1)[0]
                    unary = client.verify(session, leaf, [5, 6], [-1, 0], **sampled)
                    self.assertEqual(list(unary.accepted), [5, 6])
                    self.assertEqual(unary.bonus_token, in_stream.bonus_token)
            bad = dict(draft_distributions={-1: {5: 0.5}}, draft_sampling="without_replacement",
                       temperature=1.0)
            with self.assertRaises(SessionError) as in_stream:
                session.verify(root, [5, 6], [-1, -1], **bad)
            self.assertEqual(in_stream.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("token 6 is not in draft_distributions[0]", in_stream.exception.details())
            with self.assertRaises(ValueError):
                session.verify(root, [5], [-1], draft_sampling="sometimes")
            # The session stays usable after refused verifies.
            self.assertEqual(list(session.verify(root, [g[0]], [-1]).accepted), g[:1])
            session_id = session.session_id
        with self.assertRaises(grpc.RpcError) as raised:
            client.verify(session_id, root, [5], [-1])
        self.assertEqual(raised.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_tot_bfs_example(self):
        script = os.path.join(SOURCE_DIR, "examples", "tot_bfs.py")
        prompt = "The child asked the tree a question."
        result = subprocess.run(
            [sys.executable, script, "--server", server.address, "--prompt", prompt, "--depth",
             "2", "--branch", "2", "--keep", "2", "--step-tokens", "8"],
            capture_output=True, text=True, timeout=240)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        # Two or four candidates at depth 2 (identical paths are kept once at depth 1).
        self.assertRegex(result.stdout, r"depth 1: 2 candidates, keeping [12]\n")
        self.assertRegex(result.stdout, r"depth 2: [24] candidates, keeping [12]\n")
        self.assertRegex(result.stdout, r"best path: \d+ \d+ \d+\n")
        self.assertIn("best text: " + prompt, result.stdout)


    def test_speculative_example(self):
        # This server has no draft model: prompt lookup, which needs none.
        script = os.path.join(SOURCE_DIR, "examples", "speculative.py")
        result = subprocess.run(
            [sys.executable, script, "--server", server.address, "--policy", "ngram",
             "--max-tokens", "32", "--prompt", "Once upon a time there was a tree. Once upon"],
            capture_output=True, text=True, timeout=240)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("same tokens: True", result.stdout)
        result = subprocess.run([sys.executable, script, "--server", server.address],
                                capture_output=True, text=True, timeout=240)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("no draft model", result.stderr)


def make_certificates(directory):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate of that CA,
    made with the openssl command line."""
    script = """set -e
ossl() { openssl "$@" 2>>openssl.log; }
ossl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj "/CN=DeFT test CA"
ossl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=localhost"
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext
ossl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext
ossl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj "/CN=deft client"
ossl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2
"""
    subprocess.run(["sh", "-c", script], cwd=directory, check=True, timeout=120)
    return lambda name: os.path.join(directory, name)


class SecurityClientTest(unittest.TestCase):
    """DeftClient over mutual TLS with an API key, against a server that requires both."""

    KEY = "python-0123456789abcdef01234567"

    @classmethod
    def setUpClass(cls):
        cls.certs = tempfile.TemporaryDirectory(prefix="deft-py-certs-")
        cls.file = staticmethod(make_certificates(cls.certs.name))
        with open(cls.file("keys.txt"), "w") as keys:
            keys.write(f"# test key\npy:{cls.KEY}\n")
        cls.server = Server("--tls-cert", cls.file("server.pem"), "--tls-key",
                            cls.file("server.key"), "--tls-client-ca", cls.file("ca.pem"),
                            "--api-keys", cls.file("keys.txt"))
        with DeftClient(cls.server.address, tls_ca=cls.file("ca.pem"),
                        tls_cert=cls.file("client.pem"), tls_key=cls.file("client.key"),
                        api_key=cls.KEY) as waiting:
            waiting.wait_until_serving()

    @classmethod
    def tearDownClass(cls):
        code = cls.server.stop()
        assert code == 0, f"deft-server exited with {code}:\n{cls.server.log()}"
        cls.certs.cleanup()

    def client(self, **options):
        return DeftClient(self.server.address, timeout=30, **options)

    def test_tls_client_certificate_and_key(self):
        with self.client(tls_ca=self.file("ca.pem"), tls_cert=self.file("client.pem"),
                         tls_key=self.file("client.key"), api_key=self.KEY) as secure:
            self.assertEqual(secure.model_info().vocab_size, 512)
            branches = secure.generate("Once upon a time", n=2, max_tokens=4, ignore_eos=True)
            self.assertEqual([len(branch.ids) for branch in branches], [4, 4])
            with secure.session() as session:
                root = session.create("Once upon a time")
                self.assertEqual(len(session.branch(root, 2)), 2)
        # PEM bytes work as well as paths.
        with open(self.file("ca.pem"), "rb") as ca, open(self.file("client.pem"), "rb") as cert, \
                open(self.file("client.key"), "rb") as key:
            with self.client(tls_ca=ca.read(), tls_cert=cert.read(), tls_key=key.read(),
                             api_key=self.KEY) as secure:
                self.assertEqual(secure.tokenize("a"), secure.tokenize("a"))

    def test_refusals(self):
        pem = dict(tls_ca=self.file("ca.pem"), tls_cert=self.file("client.pem"),
                   tls_key=self.file("client.key"))
        for api_key, mention in ((None, "API key"), ("wrong-key-0123456789abcdef", "not valid")):
            with self.client(api_key=api_key, **pem) as refused:
                with self.assertRaises(grpc.RpcError) as raised:
                    refused.model_info()
                self.assertEqual(raised.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
                self.assertIn(mention, raised.exception.details())
                self.assertEqual(refused.health(), "SERVING")  # open for probes
        # No client certificate, or no TLS at all: the connection itself is refused.
        for options in (dict(tls_ca=self.file("ca.pem")), {}):
            with self.client(api_key=self.KEY, **options) as refused:
                with self.assertRaises(grpc.RpcError) as raised:
                    refused.model_info()
                self.assertEqual(raised.exception.code(), grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    unittest.main()
