"""The installed deft-client package (python_package_test.sh installs it into a venv): the
sync and asyncio clients against the real deft-server."""

import asyncio
import os
import subprocess
import tempfile
import time
import unittest

import deft_client
from deft_client import DeftClient, SessionError
from deft_client.aio import AsyncDeftClient

SERVER = os.environ["DEFT_SERVER_BINARY"]


class InstalledPackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory(prefix="deft-pkg-")
        port_file = os.path.join(cls.dir.name, "ports")
        cls.log = open(os.path.join(cls.dir.name, "server.log"), "w")
        cls.process = subprocess.Popen(
            [SERVER, "--listen", "127.0.0.1:0", "--metrics-listen", "", "--port-file", port_file,
             "--kv-pages", "256"], stdout=cls.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            assert cls.process.poll() is None and time.time() < deadline, "no server"
            time.sleep(0.02)
        with open(port_file) as text:
            ports = dict(line.split("=") for line in text.read().split())
        cls.address = f"127.0.0.1:{ports['grpc']}"

    @classmethod
    def tearDownClass(cls):
        cls.process.terminate()
        cls.process.wait(timeout=30)
        cls.log.close()
        cls.dir.cleanup()

    def test_installed_not_from_the_source_tree(self):
        self.assertIn("site-packages", deft_client.__file__)
        self.assertIn("site-packages", deft_client.deft_pb2.__file__)
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(deft_client.__file__),
                                                    "py.typed")))

    def test_sync_client(self):
        with DeftClient(self.address) as client:
            client.wait_until_serving()
            self.assertEqual(client.model_info().vocab_size, 512)
            branches = client.generate("Once upon a time", n=3, max_tokens=4, ignore_eos=True,
                                       temperature=1.0, seed=5)
            self.assertEqual([b.index for b in branches], [0, 1, 2])
            self.assertTrue(all(len(b.ids) == 4 for b in branches))
            run = client.run_tree("Once", branch_factor=2, every_tokens=3, max_depth=2,
                                  max_tokens=8, ignore_eos=True)
            self.assertGreaterEqual(len(run.nodes), 5)
            with client.session() as session:
                root = session.create("Once upon a time")
                kids = session.branch(root, 2)
                self.assertEqual(len(session.decode(kids, max_tokens=3)), 2)
                with self.assertRaises(SessionError):
                    session.prune(10**12)

    def test_asyncio_client(self):
        async def main():
            async with AsyncDeftClient(self.address) as client:
                await client.wait_until_serving()
                self.assertEqual(await client.health(), "SERVING")
                ids = await client.tokenize("Once upon a time")
                self.assertEqual(await client.detokenize(ids), "Once upon a time")
                # Two requests at once on one channel.
                first, second = await asyncio.gather(
                    client.generate("Once", n=2, max_tokens=4, ignore_eos=True),
                    client.generate("The tree", max_tokens=4, ignore_eos=True))
                self.assertEqual(len(first), 2)
                self.assertEqual(len(second[0].ids), 4)
                streamed = [r async for r in client.generate_stream("Once", max_tokens=3,
                                                                     ignore_eos=True)]
                self.assertEqual(sum(len(r.delta.ids) for r in streamed), 3)
                run = await client.run_tree("Once", branch_factor=2, every_tokens=3,
                                            max_depth=1, max_tokens=6, ignore_eos=True)
                self.assertTrue(run.best_path)
                async with client.session() as session:
                    root = await session.create("Once upon a time")
                    kids = await session.branch(root, 2)
                    decoded = await session.decode(kids, max_tokens=3, ignore_eos=True)
                    self.assertEqual(sorted(decoded), sorted(kids))
                    scored = await session.score(kids[0], " a tree")
                    self.assertLess(scored.logprob, 0)
                    with self.assertRaises(SessionError):
                        await session.prune(10**12)
                    self.assertIsNotNone(session.session_id)

        asyncio.run(main())


if __name__ == "__main__":
    unittest.main()
