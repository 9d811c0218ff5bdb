"""STANDS IN FOR MODAL'S SERVER (no Modal account is reachable here): its gRPC API on loopback, as
the installed Modal SDK speaks it (the SDK's own `modal_proto` service definition and messages,
grpclib's server), answering the few requests a job's spawn, its lookup, its poll and its cancel
make. The SDK under test is the real one, unchanged, pointed here by `MODAL_SERVER_URL`; every
request it makes is recorded (`seen`), and a request this does not serve fails loudly
(UNIMPLEMENTED), never silently.

What Modal does is modelled only as far as the tests need it: a call is listed by the Function
(or variant) it was made through, with its input (`FunctionCallFetch`, what `modal function calls`
shows); `lose_map_answers` takes each `FunctionMap` (the spawn's request: the call and its input
are made) and then fails its answer (UNAVAILABLE, as a connection lost on the way back), so the
SDK retries and finally raises although Modal holds the calls; `refuse_map` refuses the spawn
before any call is made (its message repeating the Secrets' values); `listing_down` fails the
lookup (UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from google.protobuf import empty_pb2
from google.protobuf.timestamp_pb2 import Timestamp
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server
from modal_proto import api_grpc, api_pb2

from tests.serve.serve_helpers import free_port

FUNCTION = api_pb2.Function.FUNCTION_TYPE_FUNCTION


@dataclass
class Call:
    id: str
    function_id: str
    enqueued: float
    cancelled: bool = False


class LoopbackModal:
    """Modal's gRPC API on 127.0.0.1 (`url`), in a thread with its own event loop; `close()` it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.calls: list[Call] = []
        self.functions: dict[tuple[str, str], str] = {}  # (app, tag) -> Function id
        self.secrets: list[list[str]] = []  # the values of each Secret made (a job's URL and token)
        self.lose_map_answers = self.refuse_map = self.listing_down = False
        handlers = {name: self._handler(name) for name in api_grpc.ModalClientBase.__abstractmethods__}
        servicer = type("Servicer", (api_grpc.ModalClientBase,), handlers)()
        self._loop = asyncio.new_event_loop()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = Server([servicer])  # made in its loop's thread: grpclib binds the loop then
            self._loop.run_until_complete(self._server.start("127.0.0.1", self.port))
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="loopback-modal", daemon=True)
        self._thread.start()
        assert ready.wait(20), "the loopback Modal server did not start"

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(20)

    def live_calls(self, function_id: str | None = None) -> list[str]:
        return [c.id for c in self.calls if not c.cancelled and function_id in (None, c.function_id)]

    def _handler(self, name: str):
        own = getattr(self, f"_{name}", None)

        async def handle(_servicer, stream) -> None:
            request = await stream.recv_message()
            self.seen.append(name)
            if own is None:
                raise GRPCError(Status.UNIMPLEMENTED, f"{name} is not served by the loopback Modal")
            await stream.send_message(own(request))

        return handle

    # -- the requests served ---------------------------------------------------------------
    def _ClientHello(self, request):  # noqa: N802 - the RPC's name
        return api_pb2.ClientHelloResponse()

    def _AuthTokenGet(self, request):  # noqa: N802
        return api_pb2.AuthTokenGetResponse(token="")

    def _FunctionGet(self, request):  # noqa: N802 - Function.from_name's lookup of a deployed Function
        key = (request.app_name, request.object_tag)
        function_id = self.functions.setdefault(key, f"fu-{len(self.functions) + 1}")
        data = api_pb2.FunctionData(
            function_name=request.object_tag,
            ranked_functions=[api_pb2.FunctionData.RankedFunction(function=api_pb2.Function())],
        )
        meta = api_pb2.FunctionHandleMetadata(function_name=request.object_tag, function_type=FUNCTION)
        return api_pb2.FunctionGetResponse(function_id=function_id, handle_metadata=meta, function=data)

    def _FunctionBindParams(self, request):  # noqa: N802 - with_options: a variant per set of options
        variant = f"{request.function_id}-v{len(self.seen)}"
        meta = api_pb2.FunctionHandleMetadata(function_name="train", function_type=FUNCTION)
        return api_pb2.FunctionBindParamsResponse(bound_function_id=variant, handle_metadata=meta)

    def _SecretGetOrCreate(self, request):  # noqa: N802
        self.secrets.append(list(request.env_dict.values()))
        return api_pb2.SecretGetOrCreateResponse(secret_id=f"st-{len(self.seen)}")

    def _FunctionMap(self, request):  # noqa: N802 - the spawn
        if self.refuse_map:  # echoing this spawn's Secret (the last made), as no error should
            raise GRPCError(Status.FAILED_PRECONDITION, f"refused, nothing made: {' '.join(self.secrets[-1])}")
        call = Call(f"fc-{len(self.calls) + 1}", request.function_id, time.time())
        self.calls.append(call)
        if self.lose_map_answers:
            raise GRPCError(Status.UNAVAILABLE, "the answer was lost on its way back")
        inputs = [api_pb2.FunctionPutInputsResponseItem(idx=0, input_id=f"in-{call.id}", input_jwt="jwt")]
        return api_pb2.FunctionMapResponse(function_call_id=call.id, pipelined_inputs=inputs, function_call_jwt="jwt")

    def _FunctionCallFetch(self, request):  # noqa: N802 - `modal function calls`: a Function's inputs
        if self.listing_down:
            raise GRPCError(Status.UNAVAILABLE, "not answering now")
        listed = []
        for call in reversed(self.calls):  # newest first
            if call.function_id == request.function_id:
                at = Timestamp()
                at.FromNanoseconds(int(call.enqueued * 1e9))
                listed.append(api_pb2.FunctionCallInputInfo(function_call_id=call.id, enqueued_at=at))
        return api_pb2.FunctionCallFetchResponse(function_call_inputs=listed[: request.tail.count or None])

    def _FunctionGetOutputs(self, request):  # noqa: N802 - FunctionCall.get: no output yet (it runs)
        return api_pb2.FunctionGetOutputsResponse(num_unfinished_inputs=1)

    def _FunctionCallCancel(self, request):  # noqa: N802
        for call in self.calls:
            if call.id == request.function_call_id:
                call.cancelled = True
        return empty_pb2.Empty()
