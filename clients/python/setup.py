"""Build hook of the deft-client package (pyproject.toml holds the metadata): generates the
gRPC stubs of deft/v1/deft.proto into the build with grpc_tools.protoc, so the wheel carries
`deft.v1.deft_pb2` and `deft.v1.deft_pb2_grpc` beside `deft_client`. The proto is found at
$DEFT_PROTO_DIR, else ../../proto (this folder inside the repository)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        proto_dir = os.environ.get("DEFT_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
        proto = os.path.join(proto_dir, "deft", "v1", "deft.proto")
        if not os.path.isfile(proto):
            raise SystemExit(f"deft-client: {proto} not found; set DEFT_PROTO_DIR to the "
                             "repository's proto/ folder")
        from grpc_tools import protoc  # a build requirement (pyproject.toml)

        out = os.path.abspath(self.build_lib)
        os.makedirs(out, exist_ok=True)
        args = ["grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={out}",
                f"--grpc_python_out={out}"]
        # Type stubs (.pyi) for the messages when this protoc can write them (protobuf >= 3.20).
        if protoc.main(args + [f"--pyi_out={out}", "deft/v1/deft.proto"]) != 0:
            if protoc.main(args + ["deft/v1/deft.proto"]) != 0:
                raise SystemExit("deft-client: grpc_tools.protoc failed on deft/v1/deft.proto")


setup(cmdclass={"build_py": BuildPyWithStubs})
