"""Python client of deft-server: `DeftClient` (blocking) and `deft_client.aio.AsyncDeftClient`
(asyncio), over gRPC (deft.v1.Deft). See clients/python/README.md."""

import grpc

from deft.v1 import deft_pb2, deft_pb2_grpc

from ._sync import (
    DRAFT_SAMPLINGS,
    FINISH_REASON_NAMES,
    SCORE_KINDS,
    Branch,
    DeftClient,
    NodeText,
    Pending,
    Prompt,
    Session,
    SessionClosed,
    SessionError,
    TreeNode,
    TreeRun,
    generate_request,
    run_tree_request,
    sampling_params,
    speculative_options,
    verify_fields,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncDeftClient",
    "Branch",
    "DRAFT_SAMPLINGS",
    "DeftClient",
    "FINISH_REASON_NAMES",
    "NodeText",
    "Pending",
    "Prompt",
    "SCORE_KINDS",
    "Session",
    "SessionClosed",
    "SessionError",
    "TreeNode",
    "TreeRun",
    "deft_pb2",
    "deft_pb2_grpc",
    "grpc",
    "generate_request",
    "run_tree_request",
    "sampling_params",
    "speculative_options",
    "verify_fields",
]


def __getattr__(name: str):
    # The asyncio client on first use: importing grpc.aio costs nothing for sync users then.
    if name == "AsyncDeftClient":
        from .aio import AsyncDeftClient

        return AsyncDeftClient
    raise AttributeError(name)
