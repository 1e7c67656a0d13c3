"""The blocking client of deft-server (deft.v1.Deft); `deft_client.aio` is the asyncio one.

Installed as a package (`pip install clients/python`, README.md) the stubs of
proto/deft/v1/deft.proto come with it (generated at build time); from a source checkout, put
the build's stubs (build/tests/integration/python_stubs) and clients/python on PYTHONPATH.

    from deft_client import DeftClient
    # TLS and an API key: DeftClient("host:50051", tls_ca="ca.pem", api_key="...")
    with DeftClient("127.0.0.1:50051") as client:
        print(client.model_info())
        for branch in client.generate("Once upon a time", n=4, max_tokens=32):
            print(branch.index, branch.finish_reason, branch.text)
        run = client.run_tree("Once upon a time", branch_factor=2, every_tokens=8,
                              max_depth=3, score="mean", keep_best=2, max_tokens=32)
        print(run.best_path, run.best_text)
        with client.session() as session:
            root = session.create("Once upon a time")
            children = session.branch(root, 2)
            steps = session.decode(children, max_tokens=8, temperature=0.8, seed=1)
            print(session.score(children[0], " The end.").logprob)
            print(session.verify(children[1], tokens=[5, 6], parents=[-1, 0]).accepted)
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import threading
import time
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

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
    # A speculative branch's stats: {"steps", "drafted", "accepted"} (None without speculation).
    speculative: Optional[Dict[str, int]] = None


Prompt = Union[str, Sequence[int]]

SPECULATIVE_POLICIES = {
    "off": deft_pb2.SpeculativeOptions.POLICY_OFF,
    "static": deft_pb2.SpeculativeOptions.POLICY_STATIC_TREE,
    "dynamic": deft_pb2.SpeculativeOptions.POLICY_DYNAMIC_TREE,
    "ngram": deft_pb2.SpeculativeOptions.POLICY_NGRAM,
}


def speculative_options(policy: str = "static", tree_tokens: int = 0, depth: int = 0,
                        top_k: int = 0) -> deft_pb2.SpeculativeOptions:
    """Server-side speculative decoding: policy "static" or "dynamic" (the server's draft model
    drafts the tree) or "ngram" (prompt lookup); 0 sizes take the server's defaults."""
    if policy not in SPECULATIVE_POLICIES:
        raise ValueError(f"speculative policy {policy!r} is not one of {list(SPECULATIVE_POLICIES)}")
    return deft_pb2.SpeculativeOptions(policy=SPECULATIVE_POLICIES[policy], tree_tokens=tree_tokens,
                                       depth=depth, top_k=top_k)


def generate_request(prompt: Prompt, n: int = 1,
                     speculative: Union[None, str, Dict, deft_pb2.SpeculativeOptions] = None,
                     **sampling) -> deft_pb2.GenerateRequest:
    """A GenerateRequest: sampling keywords as sampling_params(); `speculative` a policy name,
    a dict of speculative_options() keywords, or SpeculativeOptions."""
    request = deft_pb2.GenerateRequest(prompt=_prompt(prompt), n=n,
                                       sampling=sampling_params(**sampling))
    if isinstance(speculative, str):
        request.speculative.CopyFrom(speculative_options(speculative))
    elif isinstance(speculative, dict):
        request.speculative.CopyFrom(speculative_options(**speculative))
    elif speculative is not None:
        request.speculative.CopyFrom(speculative)
    return request


def _add_response(branches: Dict[int, Branch], response: deft_pb2.GenerateResponse) -> None:
    """Adds one streamed GenerateResponse to its branch."""
    branch = branches.setdefault(response.branch, Branch(index=response.branch))
    branch.ids.extend(response.delta.ids)
    branch.text += response.delta.text
    branch.logprobs.extend(response.delta.logprobs)
    reason = FINISH_REASON_NAMES.get(response.finish_reason)
    if reason is not None:
        branch.finish_reason = reason
        if response.HasField("speculative"):
            stats = response.speculative
            branch.speculative = {"steps": stats.steps, "drafted": stats.drafted,
                                  "accepted": stats.accepted}


def _prompt(prompt: Prompt) -> deft_pb2.Prompt:
    if isinstance(prompt, str):
        return deft_pb2.Prompt(text=prompt)
    return deft_pb2.Prompt(tokens=deft_pb2.TokenIds(ids=list(prompt)))


def sampling_params(
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int = 0,
    top_logprobs: int = 0,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> deft_pb2.SamplingParams:
    """SamplingParams from keywords (temperature 0: greedy; max_tokens 0: the server's
    default)."""
    return deft_pb2.SamplingParams(
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


DRAFT_SAMPLINGS = {
    None: deft_pb2.DRAFT_SAMPLING_UNSPECIFIED,
    "with_replacement": deft_pb2.DRAFT_SAMPLING_WITH_REPLACEMENT,
    "without_replacement": deft_pb2.DRAFT_SAMPLING_WITHOUT_REPLACEMENT,
}

# Per node, the distribution its drafted children were sampled from: {entry: {token: prob}}
# (entry -1: the anchor node), or DraftDistribution messages.
DraftDistributions = Union[Mapping[int, Mapping[int, float]],
                           Iterable[deft_pb2.DraftDistribution]]


def verify_fields(tokens: Sequence[int], parents: Sequence[int],
                  draft_probs: Sequence[float] = (),
                  draft_distributions: DraftDistributions = (),
                  draft_sampling: Optional[str] = None, **sampling) -> dict:
    """The drafted tree's fields of a VerifyRequest / VerifyCommand. With sampled drafts, give
    `draft_distributions` and `draft_sampling` ("with_replacement": each child an independent
    draw; "without_replacement": each drawn from the rest) for exact acceptance; `draft_probs`
    are exact only for deterministic drafts (README, Verify)."""
    if draft_sampling not in DRAFT_SAMPLINGS:
        raise ValueError(f"draft_sampling {draft_sampling!r}: use one of "
                         f"{sorted(k for k in DRAFT_SAMPLINGS if k)} or None")
    if isinstance(draft_distributions, Mapping):
        distributions = [
            deft_pb2.DraftDistribution(entry=entry, tokens=list(q.keys()), probs=list(q.values()))
            for entry, q in draft_distributions.items()
        ]
    else:
        distributions = list(draft_distributions)
    return dict(tokens=list(tokens), parents=list(parents), draft_probs=list(draft_probs),
                draft_distributions=distributions,
                draft_sampling=DRAFT_SAMPLINGS[draft_sampling],
                sampling=sampling_params(**sampling))


class _CallDetails(
        collections.namedtuple(
            "_CallDetails",
            ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call (plaintext or TLS alike; gRPC's call
    credentials would refuse a plaintext channel)."""

    def __init__(self, key: str):
        self._metadata = (("authorization", f"Bearer {key}"),)

    def _details(self, details):
        return _CallDetails(details.method, details.timeout,
                            tuple(details.metadata or ()) + self._metadata,
                            details.credentials, details.wait_for_ready,
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def _pem(value: Union[None, str, bytes]) -> Optional[bytes]:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as file:
        return file.read()


def _channel_credentials(tls: bool, tls_ca, tls_cert, tls_key):
    """The channel credentials of the clients' TLS arguments: None for plaintext (no TLS asked
    for); ValueError for a client certificate without its key or the reverse."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together (a client certificate and its key)")
    if not (tls or tls_ca is not None or tls_cert is not None):
        return None
    return grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca),
                                        private_key=_pem(tls_key),
                                        certificate_chain=_pem(tls_cert))


def _api_key(api_key: Optional[str]) -> Optional[str]:
    """The key given, else $DEFT_API_KEY, else None."""
    return api_key if api_key is not None else (os.environ.get("DEFT_API_KEY") or None)


class DeftClient:
    """Blocking client; every method raises grpc.RpcError (with .code() and .details()) when
    the server refuses a request.

    Plaintext by default. TLS when `tls` is true or any tls_* argument is given: `tls_ca`
    holds the CA certificates to trust (None: the system's), `tls_cert` and `tls_key` a client
    certificate for mutual TLS; each a path or PEM bytes. `api_key` (default: the DEFT_API_KEY
    environment variable) is sent as `authorization: Bearer KEY` on every call."""

    def __init__(self, address: str, timeout: float = 60.0, *, tls: bool = False,
                 tls_ca: Union[None, str, bytes] = None,
                 tls_cert: Union[None, str, bytes] = None,
                 tls_key: Union[None, str, bytes] = None,
                 api_key: Optional[str] = None):
        self.address = address
        self.timeout = timeout
        credentials = _channel_credentials(tls, tls_ca, tls_cert, tls_key)
        self._raw_channel = (grpc.secure_channel(address, credentials) if credentials
                             else grpc.insecure_channel(address))
        api_key = _api_key(api_key)
        self.channel = (grpc.intercept_channel(self._raw_channel, _BearerKey(api_key))
                        if api_key else self._raw_channel)
        self.stub = deft_pb2_grpc.DeftStub(self.channel)
        self._health = self.channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response,
        )

    def close(self) -> None:
        self._raw_channel.close()

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
        """Waits until the server reports SERVING (it listens, NOT_SERVING, while the model
        loads); RuntimeError when it does not within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        grpc.channel_ready_future(self._raw_channel).result(timeout=timeout)
        status = self.health()
        while status != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
            status = self.health()
        if status != "SERVING":
            raise RuntimeError(f"{self.address} is {status}, not SERVING, after {timeout} s")

    def model_info(self) -> deft_pb2.ModelInfoResponse:
        return self.stub.ModelInfo(deft_pb2.ModelInfoRequest(), timeout=self.timeout)

    def tokenize(self, text: str, add_bos: bool = False) -> List[int]:
        request = deft_pb2.TokenizeRequest(text=text, add_bos=add_bos)
        return list(self.stub.Tokenize(request, timeout=self.timeout).ids)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        request = deft_pb2.DetokenizeRequest(ids=list(ids), skip_special=skip_special)
        return self.stub.Detokenize(request, timeout=self.timeout).text

    # ---- generation ----
    def generate_stream(self, prompt: Prompt, n: int = 1, speculative=None, **sampling):
        """The raw response stream (iterate it; call .cancel() on it to stop early). Keywords:
        generate_request()."""
        request = generate_request(prompt, n=n, speculative=speculative, **sampling)
        return self.stub.Generate(request, timeout=self.timeout)

    def generate(self, prompt: Prompt, n: int = 1, **kwargs) -> List[Branch]:
        """n samples from one prompt, each assembled from its streamed deltas."""
        branches: Dict[int, Branch] = {}
        for response in self.generate_stream(prompt, n=n, **kwargs):
            _add_response(branches, response)
        return [branches[index] for index in sorted(branches)]


    # ---- RunTree: a server-side tree job ----
    def run_tree_stream(self, prompt: Union[Prompt, deft_pb2.RunTreeRequest], **options):
        """The raw TreeEvent stream of a RunTree job (.cancel() stops it and frees its KV).
        `prompt` may be a whole RunTreeRequest; otherwise see run_tree_request() for the
        keywords."""
        if isinstance(prompt, deft_pb2.RunTreeRequest):
            if options:
                raise TypeError("options given beside a whole RunTreeRequest")
            request = prompt
        else:
            request = run_tree_request(prompt, **options)
        return self.stub.RunTree(request, timeout=self.timeout)

    def run_tree(self, prompt: Union[Prompt, deft_pb2.RunTreeRequest], **options) -> "TreeRun":
        """Runs a RunTree job to its end: every event, the tokens streamed per node and the
        final tree (best path first)."""
        run = TreeRun()
        for event in self.run_tree_stream(prompt, **options):
            run.add(event)
        return run

    # ---- TreeSession: the client drives the tree ----
    def session(self) -> "Session":
        """Opens a TreeSession stream (use as a context manager, or call close())."""
        return Session(self)

    # ---- Verify: a drafted token tree under a session node ----
    def verify(
        self,
        session: Union["Session", int, deft_pb2.VerifyRequest],
        node: int = 0,
        tokens: Sequence[int] = (),
        parents: Sequence[int] = (),
        draft_probs: Sequence[float] = (),
        draft_distributions: DraftDistributions = (),
        draft_sampling: Optional[str] = None,
        **sampling,
    ) -> deft_pb2.VerifyResponse:
        """Verifies a token tree (tokens[i] hangs under entry parents[i], -1 = under `node`)
        against the target model with the Verify RPC; `session` is a Session, its id, or a whole
        VerifyRequest. Drafts sampled from a distribution pass it (verify_fields). Behind a load
        balancer prefer Session.verify (the session's stream)."""
        if isinstance(session, deft_pb2.VerifyRequest):
            request = session
        else:
            session_id = session.session_id if isinstance(session, Session) else session
            if session_id is None:
                raise ValueError("the session has no id yet (send a command first)")
            request = deft_pb2.VerifyRequest(
                session_id=session_id, node=node,
                **verify_fields(tokens, parents, draft_probs, draft_distributions,
                                draft_sampling, **sampling))
        return self.stub.Verify(request, timeout=self.timeout)


SCORE_KINDS = {
    None: deft_pb2.BranchPolicy.SCORE_UNSPECIFIED,
    "cumulative": deft_pb2.BranchPolicy.SCORE_CUMULATIVE_LOGPROB,
    "mean": deft_pb2.BranchPolicy.SCORE_MEAN_LOGPROB,
}


def run_tree_request(
    prompt: Prompt,
    branch_factor: int = 2,
    every_tokens: Optional[int] = None,
    delimiter: Optional[str] = None,
    step_end_token: Optional[int] = None,
    max_depth: int = 0,
    score: Optional[str] = None,
    keep_best: int = 0,
    **sampling,
) -> deft_pb2.RunTreeRequest:
    """A RunTreeRequest: branch `branch_factor` ways when a trigger fires (at most one of
    every_tokens / delimiter / step_end_token), up to max_depth, score "cumulative" or "mean"
    logprob, keep the best `keep_best` per depth (0: all). Sampling keywords: sampling_params();
    max_tokens counts new tokens per root-to-leaf path."""
    triggers = [t for t in (every_tokens, delimiter, step_end_token) if t is not None]
    if len(triggers) > 1:
        raise ValueError("give at most one of every_tokens, delimiter, step_end_token")
    if score not in SCORE_KINDS:
        raise ValueError(f"score must be one of {sorted(k for k in SCORE_KINDS if k)}")
    policy = deft_pb2.BranchPolicy(branch_factor=branch_factor, max_depth=max_depth,
                                   score=SCORE_KINDS[score], keep_best=keep_best)
    if every_tokens is not None:
        policy.every_tokens = every_tokens
    if delimiter is not None:
        policy.delimiter = delimiter
    if step_end_token is not None:
        policy.step_end_token = step_end_token
    return deft_pb2.RunTreeRequest(prompt=_prompt(prompt), policy=policy,
                                   sampling=sampling_params(**sampling))


@dataclasses.dataclass
class NodeText:
    """The tokens of one node, assembled from streamed NodeTokens messages."""

    node: int
    ids: List[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: List[float] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None

    def add(self, message: deft_pb2.NodeTokens) -> None:
        self.ids.extend(message.delta.ids)
        self.text += message.delta.text
        self.logprobs.extend(message.delta.logprobs)
        reason = FINISH_REASON_NAMES.get(message.finish_reason)
        if reason is not None:
            self.finish_reason = reason


@dataclasses.dataclass
class TreeNode:
    """A node of a finished RunTree job (TreeNodeInfo)."""

    node: int
    parent: int
    depth: int
    ids: List[int]
    text: str
    logprobs: List[float]
    score: float
    finish_reason: Optional[str]


@dataclasses.dataclass
class TreeRun:
    """What a RunTree job streamed: its events, the tokens per node, and the final tree."""

    events: List[deft_pb2.TreeEvent] = dataclasses.field(default_factory=list)
    created: List[int] = dataclasses.field(default_factory=list)  # in node_created order
    pruned: List[int] = dataclasses.field(default_factory=list)
    streamed: Dict[int, NodeText] = dataclasses.field(default_factory=dict)
    best_path: List[int] = dataclasses.field(default_factory=list)
    best_text: str = ""
    nodes: Dict[int, TreeNode] = dataclasses.field(default_factory=dict)
    finished: bool = False

    def add(self, event: deft_pb2.TreeEvent) -> None:
        self.events.append(event)
        kind = event.WhichOneof("event")
        if kind == "node_created":
            self.created.append(event.node_created.node)
        elif kind == "tokens":
            node = event.tokens.node
            self.streamed.setdefault(node, NodeText(node)).add(event.tokens)
        elif kind == "pruned":
            self.pruned.append(event.pruned)
        elif kind == "finished":
            result = event.finished
            self.finished = True
            self.best_path = list(result.best_path)
            self.best_text = result.best_text
            for info in result.nodes:
                self.nodes[info.node] = TreeNode(
                    node=info.node, parent=info.parent, depth=info.depth,
                    ids=list(info.tokens.ids), text=info.tokens.text,
                    logprobs=list(info.tokens.logprobs), score=info.score,
                    finish_reason=FINISH_REASON_NAMES.get(info.finish_reason))


# google.rpc.Code numbers (SessionResponse.error.code) -> grpc.StatusCode.
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SessionError(Exception):
    """A TreeSession command the server refused (the session stays usable)."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{STATUS_CODES.get(code, code)}: {message}")
        self.status = STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN)
        self.message = message

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.message


class Pending:
    """One command in flight: its responses, complete when answered (for decode: when every
    node has its finish_reason, or on an error)."""

    def __init__(self, request: deft_pb2.SessionRequest):
        self.request = request
        self.responses: List[deft_pb2.SessionResponse] = []
        self.failure: Optional[Exception] = None
        self._done = threading.Event()
        kind = request.WhichOneof("command")
        self._waiting = set(request.decode.nodes) if kind == "decode" else None

    def _add(self, response: deft_pb2.SessionResponse) -> None:
        self.responses.append(response)
        kind = response.WhichOneof("result")
        if self._waiting is None or kind != "decoded":
            self._done.set()
        elif response.decoded.finish_reason != deft_pb2.FINISH_REASON_UNSPECIFIED:
            self._waiting.discard(response.decoded.node)
            if not self._waiting:
                self._done.set()

    def _fail(self, failure: Exception) -> None:
        if not self._done.is_set():
            self.failure = failure
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> List[deft_pb2.SessionResponse]:
        """The responses; raises SessionError for an `error` result, or the stream's
        grpc.RpcError when the stream ended first."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"no complete answer to request {self.request.request_id}")
        if self.failure is not None:
            raise self.failure
        last = self.responses[-1]
        if last.WhichOneof("result") == "error":
            raise SessionError(last.error.code, last.error.message)
        return self.responses


class SessionClosed(Exception):
    """The TreeSession stream ended before a command was answered."""


class Session:
    """A TreeSession stream. Commands may be pipelined (send() returns a Pending); the blocking
    methods send one command and wait for its answer. Responses are matched to commands by
    request_id on a reader thread."""

    def __init__(self, client: DeftClient):
        self.client = client
        self.session_id: Optional[int] = None
        self._requests: "queue.Queue[Optional[deft_pb2.SessionRequest]]" = queue.Queue()
        self._pending: Dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._next_id = 1
        self._ended = False
        self._end_error: Optional[Exception] = None
        self._call = client.stub.TreeSession(self._request_iterator())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        if not self._ended:
            self.close()

    # ---- the stream ----
    def _request_iterator(self):
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def _read(self) -> None:
        error: Exception = SessionClosed("the TreeSession stream ended")
        try:
            for response in self._call:
                if self.session_id is None and response.session_id:
                    self.session_id = response.session_id
                with self._lock:
                    pending = self._pending.get(response.request_id)
                if pending is None:
                    continue  # not ours (the server never sends these)
                pending._add(response)
                if pending.done():
                    with self._lock:
                        self._pending.pop(response.request_id, None)
        except grpc.RpcError as rpc_error:
            error = rpc_error
        with self._lock:
            self._ended = True
            self._end_error = error
            left = list(self._pending.values())
            self._pending.clear()
        for pending in left:
            pending._fail(error)

    def send(self, **command) -> Pending:
        """Sends one command, e.g. send(prune=deft_pb2.PruneCommand(node=3)), without
        waiting."""
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            request = deft_pb2.SessionRequest(request_id=request_id, **command)
            pending = Pending(request)
            if self._ended:
                pending._fail(self._end_error)
                return pending
            self._pending[request_id] = pending
        self._requests.put(request)
        return pending

    def _result(self, pending: Pending) -> deft_pb2.SessionResponse:
        return pending.wait(self.client.timeout)[-1]

    # ---- commands ----
    def create(self, prompt: Prompt) -> int:
        """A new root node holding the prompt (text gets BOS); its node id."""
        return self._result(self.send(create=deft_pb2.CreateCommand(prompt=_prompt(prompt)))
                            ).created_node

    def extend(self, node: int, content: Prompt) -> deft_pb2.ExtendResult:
        """Appends text (no BOS) or token ids to a leaf; (node, length in tokens)."""
        command = deft_pb2.ExtendCommand(node=node, content=_prompt(content))
        return self._result(self.send(extend=command)).extended

    def decode_async(self, nodes: Sequence[int], **sampling) -> Pending:
        command = deft_pb2.DecodeCommand(nodes=list(nodes), sampling=sampling_params(**sampling))
        return self.send(decode=command)

    def decode(self, nodes: Union[int, Sequence[int]], **sampling) -> Dict[int, NodeText]:
        """Decodes distinct leaves in the same steps until each finishes; node -> its new
        tokens. Sampling keywords: sampling_params()."""
        if isinstance(nodes, int):
            nodes = [nodes]
        pending = self.decode_async(nodes, **sampling)
        out = {node: NodeText(node) for node in nodes}
        for response in pending.wait(self.client.timeout):
            out[response.decoded.node].add(response.decoded)
        return out

    def branch(self, node: int, k: int) -> List[int]:
        """k empty children under a node; their ids."""
        command = deft_pb2.BranchCommand(node=node, k=k)
        return list(self._result(self.send(branch=command)).branched.children)

    def prune(self, node: int) -> int:
        """Drops a node and its subtree."""
        return self._result(self.send(prune=deft_pb2.PruneCommand(node=node))).pruned

    def score(self, node: int, continuation: Prompt) -> deft_pb2.ScoreResult:
        """Log-probability of a continuation (text without BOS, or ids) after a node, without
        keeping it: (logprob, token_logprobs)."""
        command = deft_pb2.ScoreCommand(node=node, continuation=_prompt(continuation))
        return self._result(self.send(score=command)).scored

    def verify(self, node: int, tokens: Sequence[int], parents: Sequence[int],
               draft_probs: Sequence[float] = (),
               draft_distributions: DraftDistributions = (),
               draft_sampling: Optional[str] = None, **sampling) -> deft_pb2.VerifyResponse:
        """Verifies a token tree (tokens[i] hangs under entry parents[i], -1 = under `node`)
        in this session's stream, in order with its other commands; raises SessionError for a
        refused tree. Unlike DeftClient.verify (a separate RPC), it always reaches the replica
        that holds the session behind a load balancer."""
        command = deft_pb2.VerifyCommand(
            node=node, **verify_fields(tokens, parents, draft_probs, draft_distributions,
                                       draft_sampling, **sampling))
        return self._result(self.send(verify=command)).verified

    def close(self) -> bool:
        """Sends `close`, waits for `closed`, and ends the stream (the server frees every
        node)."""
        try:
            closed = self._result(self.send(close=deft_pb2.CloseCommand())).closed
        finally:
            self._requests.put(None)
            self._reader.join(self.client.timeout)
        return closed

    def cancel(self) -> None:
        """Cancels the stream without closing (as a client that goes away would)."""
        self._call.cancel()
        self._requests.put(None)
        self._reader.join(self.client.timeout)
