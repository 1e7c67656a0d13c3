"""Imports the project's Python client (clients/python/deft_client) for the examples.

Needs grpcio (Debian: python3-grpcio; re-runs the calling script with /usr/bin/python3 when the
first python3 lacks it) and the deft.v1 stubs: from PYTHONPATH, from build*/tests/integration/
python_stubs, or generated on the fly with grpc_tools (python3-grpc-tools).
"""

import glob
import importlib
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def import_client():
    try:
        import grpc  # noqa: F401
    except ImportError:
        system_python = "/usr/bin/python3"
        if (os.path.exists(system_python) and os.path.realpath(sys.executable) !=
                os.path.realpath(system_python) and not os.environ.get("DEFT_EXAMPLE_REEXEC")):
            os.environ["DEFT_EXAMPLE_REEXEC"] = "1"
            os.execv(system_python, [system_python, os.path.abspath(sys.argv[0])] + sys.argv[1:])
        sys.exit("this example needs grpcio (Debian: apt-get install python3-grpcio)")
    sys.path.insert(0, os.path.join(REPO, "clients", "python"))
    try:
        importlib.import_module("deft.v1.deft_pb2")
    except ImportError:
        built = sorted(glob.glob(os.path.join(REPO, "build*", "tests", "integration",
                                              "python_stubs")))
        found = [d for d in built if os.path.exists(os.path.join(d, "deft", "v1", "deft_pb2.py"))]
        # The newest stubs: an old build folder's may predate the proto's latest fields.
        found.sort(key=lambda d: os.path.getmtime(os.path.join(d, "deft", "v1", "deft_pb2.py")),
                   reverse=True)
        if found:
            sys.path.insert(0, found[0])
        else:
            try:
                from grpc_tools import protoc
            except ImportError:
                sys.exit("no deft.v1 stubs: build the project, put its python_stubs folder on "
                         "PYTHONPATH, or install python3-grpc-tools")
            out = tempfile.mkdtemp(prefix="deft-stubs-")
            proto_dir = os.path.join(REPO, "proto")
            if protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={out}",
                            f"--grpc_python_out={out}", "deft/v1/deft.proto"]) != 0:
                sys.exit("grpc_tools.protoc failed on proto/deft/v1/deft.proto")
            sys.path.insert(0, out)
        importlib.invalidate_caches()
    return importlib.import_module("deft_client")
