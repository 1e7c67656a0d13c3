"""The asyncio client of deft-server (grpc.aio): the same calls as DeftClient, as coroutines.

    import asyncio
    from deft_client.aio import AsyncDeftClient

    async def main():
        async with AsyncDeftClient("127.0.0.1:50051") as client:
            await client.wait_until_serving()
            for branch in await client.generate("Once upon a time", n=4, max_tokens=32):
                print(branch.index, branch.text)
            async for response in client.generate_stream("Once", n=2, max_tokens=8):
                print(response.branch, response.delta.text)
            async with client.session() as session:
                root = await session.create("Once upon a time")
                kids = await session.branch(root, 2)
                print(await session.decode(kids, max_tokens=8, temperature=0.8, seed=1))

    asyncio.run(main())

Refused calls raise grpc.aio.AioRpcError (.code(), .details()); a refused session command
raises SessionError and the session stays usable."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from deft.v1 import deft_pb2, deft_pb2_grpc

from ._sync import (
    FINISH_REASON_NAMES,
    HEALTH_CHECK_METHOD,
    Branch,
    DraftDistributions,
    NodeText,
    Prompt,
    SessionClosed,
    SessionError,
    TreeRun,
    _decode_health_response,
    _encode_health_request,
    _add_response,
    _api_key,
    _channel_credentials,
    _prompt,
    generate_request,
    run_tree_request,
    sampling_params,
    verify_fields,
)

__all__ = ["AsyncDeftClient", "AsyncSession"]


class AsyncDeftClient:
    """asyncio client; the constructor's arguments are DeftClient's (TLS, mutual TLS, api_key
    defaulting to $DEFT_API_KEY, sent as `authorization: Bearer KEY` on every call)."""

    def __init__(self, address: str, timeout: float = 60.0, *, tls: bool = False,
                 tls_ca: Union[None, str, bytes] = None,
                 tls_cert: Union[None, str, bytes] = None,
                 tls_key: Union[None, str, bytes] = None,
                 api_key: Optional[str] = None):
        self.address = address
        self.timeout = timeout
        credentials = _channel_credentials(tls, tls_ca, tls_cert, tls_key)
        self.channel = (grpc.aio.secure_channel(address, credentials) if credentials
                        else grpc.aio.insecure_channel(address))
        api_key = _api_key(api_key)
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ())
        self.stub = deft_pb2_grpc.DeftStub(self.channel)
        self._health = self.channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response,
        )

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncDeftClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- health, model, tokenizer ----
    async def health(self, service: str = "") -> str:
        return await self._health(service, timeout=self.timeout, metadata=self._metadata)

    async def wait_until_serving(self, timeout: float = 60.0) -> None:
        """Waits until the server reports SERVING; RuntimeError after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        status = "UNKNOWN"
        while loop.time() < deadline:
            try:
                status = await self.health()
                if status == "SERVING":
                    return
            except grpc.aio.AioRpcError:
                pass  # not listening yet
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.address} is {status}, not SERVING, after {timeout} s")

    async def model_info(self) -> deft_pb2.ModelInfoResponse:
        return await self.stub.ModelInfo(deft_pb2.ModelInfoRequest(), timeout=self.timeout,
                                         metadata=self._metadata)

    async def tokenize(self, text: str, add_bos: bool = False) -> List[int]:
        response = await self.stub.Tokenize(deft_pb2.TokenizeRequest(text=text, add_bos=add_bos),
                                            timeout=self.timeout, metadata=self._metadata)
        return list(response.ids)

    async def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        request = deft_pb2.DetokenizeRequest(ids=list(ids), skip_special=skip_special)
        response = await self.stub.Detokenize(request, timeout=self.timeout,
                                              metadata=self._metadata)
        return response.text

    # ---- generation ----
    def generate_stream(self, prompt: Prompt, n: int = 1, speculative=None,
                        **sampling) -> AsyncIterator[deft_pb2.GenerateResponse]:
        """The raw response stream (`async for`; .cancel() on it stops the job). Keywords:
        generate_request()."""
        request = generate_request(prompt, n=n, speculative=speculative, **sampling)
        return self.stub.Generate(request, timeout=self.timeout, metadata=self._metadata)

    async def generate(self, prompt: Prompt, n: int = 1, **kwargs) -> List[Branch]:
        """n samples from one prompt (sharing its KV), each assembled from its deltas."""
        branches: Dict[int, Branch] = {}
        async for response in self.generate_stream(prompt, n=n, **kwargs):
            _add_response(branches, response)
        return [branches[index] for index in sorted(branches)]

    def run_tree_stream(self, prompt: Union[Prompt, deft_pb2.RunTreeRequest],
                        **options) -> AsyncIterator[deft_pb2.TreeEvent]:
        """The raw TreeEvent stream of a RunTree job; keywords: run_tree_request()."""
        request = prompt if isinstance(prompt, deft_pb2.RunTreeRequest) else run_tree_request(
            prompt, **options)
        return self.stub.RunTree(request, timeout=self.timeout, metadata=self._metadata)

    async def run_tree(self, prompt: Union[Prompt, deft_pb2.RunTreeRequest],
                       **options) -> TreeRun:
        run = TreeRun()
        async for event in self.run_tree_stream(prompt, **options):
            run.add(event)
        return run

    async def verify(self, session: Union["AsyncSession", int], node: int,
                     tokens: Sequence[int], parents: Sequence[int],
                     draft_probs: Sequence[float] = (),
                     draft_distributions: DraftDistributions = (),
                     draft_sampling: Optional[str] = None,
                     **sampling) -> deft_pb2.VerifyResponse:
        """The Verify RPC on a session's node (prefer AsyncSession.verify behind a balancer)."""
        session_id = session.session_id if isinstance(session, AsyncSession) else session
        if session_id is None:
            raise ValueError("the session has no id yet (send a command first)")
        request = deft_pb2.VerifyRequest(
            session_id=session_id, node=node,
            **verify_fields(tokens, parents, draft_probs, draft_distributions, draft_sampling,
                            **sampling))
        return await self.stub.Verify(request, timeout=self.timeout, metadata=self._metadata)

    def session(self) -> "AsyncSession":
        """A TreeSession stream: `async with client.session() as session: ...`."""
        return AsyncSession(self)


class AsyncSession:
    """A TreeSession stream; commands may run concurrently (gather several coroutines): a
    reader task matches responses to commands by request_id."""

    def __init__(self, client: AsyncDeftClient):
        self.client = client
        self.session_id: Optional[int] = None
        self._call = client.stub.TreeSession(metadata=client._metadata)
        self._next_id = 1
        self._pending: Dict[int, Tuple[deft_pb2.SessionRequest, List[deft_pb2.SessionResponse],
                                       asyncio.Future]] = {}
        self._reader: Optional[asyncio.Task] = None
        self._ended: Optional[BaseException] = None

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        if self._ended is None:
            await self.close()

    async def _read(self) -> None:
        error: BaseException = SessionClosed("the TreeSession stream ended")
        try:
            async for response in self._call:
                if self.session_id is None and response.session_id:
                    self.session_id = response.session_id
                entry = self._pending.get(response.request_id)
                if entry is None:
                    continue
                request, responses, future = entry
                responses.append(response)
                kind = response.WhichOneof("result")
                waiting = request.WhichOneof("command") == "decode" and kind == "decoded"
                if waiting:
                    finished = {r.decoded.node for r in responses
                                if r.WhichOneof("result") == "decoded"
                                and r.decoded.finish_reason != deft_pb2.FINISH_REASON_UNSPECIFIED}
                    if not set(request.decode.nodes) <= finished:
                        continue
                del self._pending[response.request_id]
                if not future.done():
                    future.set_result(responses)
        except grpc.aio.AioRpcError as rpc_error:
            error = rpc_error
        self._ended = error
        for _, _, future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def send(self, **command) -> List[deft_pb2.SessionResponse]:
        """Sends one command (e.g. prune=deft_pb2.PruneCommand(node=3)) and returns its
        responses; SessionError for an `error` result."""
        if self._ended is not None:
            raise self._ended
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        request_id = self._next_id
        self._next_id += 1
        request = deft_pb2.SessionRequest(request_id=request_id, **command)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (request, [], future)
        await self._call.write(request)
        responses = await asyncio.wait_for(future, self.client.timeout)
        last = responses[-1]
        if last.WhichOneof("result") == "error":
            raise SessionError(last.error.code, last.error.message)
        return responses

    async def create(self, prompt: Prompt) -> int:
        command = deft_pb2.CreateCommand(prompt=_prompt(prompt))
        return (await self.send(create=command))[-1].created_node

    async def extend(self, node: int, content: Prompt) -> deft_pb2.ExtendResult:
        command = deft_pb2.ExtendCommand(node=node, content=_prompt(content))
        return (await self.send(extend=command))[-1].extended

    async def decode(self, nodes: Union[int, Sequence[int]], **sampling) -> Dict[int, NodeText]:
        if isinstance(nodes, int):
            nodes = [nodes]
        command = deft_pb2.DecodeCommand(nodes=list(nodes), sampling=sampling_params(**sampling))
        out = {node: NodeText(node) for node in nodes}
        for response in await self.send(decode=command):
            out[response.decoded.node].add(response.decoded)
        return out

    async def branch(self, node: int, k: int) -> List[int]:
        command = deft_pb2.BranchCommand(node=node, k=k)
        return list((await self.send(branch=command))[-1].branched.children)

    async def prune(self, node: int) -> int:
        return (await self.send(prune=deft_pb2.PruneCommand(node=node)))[-1].pruned

    async def score(self, node: int, continuation: Prompt) -> deft_pb2.ScoreResult:
        command = deft_pb2.ScoreCommand(node=node, continuation=_prompt(continuation))
        return (await self.send(score=command))[-1].scored

    async def verify(self, node: int, tokens: Sequence[int], parents: Sequence[int],
                     draft_probs: Sequence[float] = (),
                     draft_distributions: DraftDistributions = (),
                     draft_sampling: Optional[str] = None,
                     **sampling) -> deft_pb2.VerifyResponse:
        command = deft_pb2.VerifyCommand(
            node=node, **verify_fields(tokens, parents, draft_probs, draft_distributions,
                                       draft_sampling, **sampling))
        return (await self.send(verify=command))[-1].verified

    async def close(self) -> bool:
        """Sends `close`, waits for `closed`, ends the stream (the server frees every node)."""
        try:
            closed = (await self.send(close=deft_pb2.CloseCommand()))[-1].closed
        finally:
            await self._call.done_writing()
            if self._reader is not None:
                await asyncio.wait_for(self._reader, self.client.timeout)
        return closed
