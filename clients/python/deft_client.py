"""A small Python client of deft-server (deft.v1.Deft).

Needs Debian's python3-grpcio and the stubs generated from proto/deft/v1/deft.proto (the build
writes them to build/tests/integration/python_stubs; put that folder on PYTHONPATH), or run
    python3 -m grpc_tools.protoc -Iproto --python_out=OUT --grpc_python_out=OUT deft/v1/deft.proto

    from deft_client import DeftClient
    with DeftClient("127.0.0.1:50051") as client:
        print(client.model_info())
        for branch in client.generate("Once upon a time", n=4, max_tokens=32):
            print(branch.index, branch.finish_reason, branch.text)
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Sequence, Union

import grpc

from deft.v1 import deft_pb2, deft_pb2_grpc

# grpc.health.v1 by hand: HealthCheckRequest{string service = 1},
# HealthCheckResponse{ServingStatus status = 1}. (Stubs generated under grpc/health/v1 would be
# shadowed by the grpc package.)
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _encode_health_request(service: str) -> bytes:
    data = service.encode("utf-8")
    if not data:
        return b""
    if len(data) >= 128:
        raise ValueError("service name too long for this minimal encoder")
    return b"\x0a" + bytes([len(data)]) + data


def _decode_health_response(data: bytes) -> str:
    # Field 1, varint: 0x08 then the status (a small enum, one byte).
    if len(data) >= 2 and data[0] == 0x08:
        return HEALTH_STATUS_NAMES.get(data[1], str(data[1]))
    return "UNKNOWN"


FINISH_REASON_NAMES = {
    deft_pb2.FINISH_REASON_UNSPECIFIED: None,
    deft_pb2.FINISH_REASON_LENGTH: "length",
    deft_pb2.FINISH_REASON_STOP: "stop",
    deft_pb2.FINISH_REASON_EOS: "eos",
    deft_pb2.FINISH_REASON_PRUNED: "pruned",
    deft_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


@dataclasses.dataclass
class Branch:
    """One generated branch, assembled from its streamed deltas."""

    index: int
    ids: List[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: List[float] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None


Prompt = Union[str, Sequence[int]]


def _prompt(prompt: Prompt) -> deft_pb2.Prompt:
    if isinstance(prompt, str):
        return deft_pb2.Prompt(text=prompt)
    return deft_pb2.Prompt(tokens=deft_pb2.TokenIds(ids=list(prompt)))


class DeftClient:
    """Blocking client; every method raises grpc.RpcError (with .code() and .details()) when
    the server refuses a request."""

    def __init__(self, address: str, timeout: float = 60.0):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address)
        self.stub = deft_pb2_grpc.DeftStub(self.channel)
        self._health = self.channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "DeftClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- health, model, tokenizer ----
    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ...; raises grpc.RpcError (NOT_FOUND) for an unknown
        service."""
        return self._health(service, timeout=self.timeout)

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
        if self.health() != "SERVING":
            raise RuntimeError(f"{self.address} is not SERVING")

    def model_info(self) -> deft_pb2.ModelInfoResponse:
        return self.stub.ModelInfo(deft_pb2.ModelInfoRequest(), timeout=self.timeout)

    def tokenize(self, text: str, add_bos: bool = False) -> List[int]:
        request = deft_pb2.TokenizeRequest(text=text, add_bos=add_bos)
        return list(self.stub.Tokenize(request, timeout=self.timeout).ids)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        request = deft_pb2.DetokenizeRequest(ids=list(ids), skip_special=skip_special)
        return self.stub.Detokenize(request, timeout=self.timeout).text

    # ---- generation ----
    def generate_stream(
        self,
        prompt: Prompt,
        n: int = 1,
        max_tokens: int = 0,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 0.0,
        seed: int = 0,
        top_logprobs: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ):
        """The raw response stream (iterate it; call .cancel() on it to stop early)."""
        sampling = deft_pb2.SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            top_logprobs=top_logprobs,
            max_tokens=max_tokens,
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
            ignore_eos=ignore_eos,
        )
        request = deft_pb2.GenerateRequest(prompt=_prompt(prompt), n=n, sampling=sampling)
        return self.stub.Generate(request, timeout=self.timeout)

    def generate(self, prompt: Prompt, n: int = 1, **kwargs) -> List[Branch]:
        """n samples from one prompt, each assembled from its streamed deltas."""
        branches: Dict[int, Branch] = {}
        for response in self.generate_stream(prompt, n=n, **kwargs):
            branch = branches.setdefault(response.branch, Branch(index=response.branch))
            branch.ids.extend(response.delta.ids)
            branch.text += response.delta.text
            branch.logprobs.extend(response.delta.logprobs)
            reason = FINISH_REASON_NAMES.get(response.finish_reason)
            if reason is not None:
                branch.finish_reason = reason
        return [branches[index] for index in sorted(branches)]

    # ---- not implemented by the server yet ----
    def verify(self, request: deft_pb2.VerifyRequest) -> deft_pb2.VerifyResponse:
        return self.stub.Verify(request, timeout=self.timeout)

    def run_tree(self, request: deft_pb2.RunTreeRequest) -> Iterator[deft_pb2.TreeEvent]:
        return self.stub.RunTree(request, timeout=self.timeout)
