"""The OpenAI-compatible endpoint of rollout.agent: a FastAPI app served by uvicorn on a thread of the rollout
process, listening on a Unix socket that the contained agent workers reach through their own loopback
(evenrl.isolation.loopback).

The server only carries requests: each POST to /t/TOKEN/v1/chat/completions, /t/TOKEN/v1/completions or
/t/TOKEN/v1/responses (TOKEN names the trajectory) is queued as a `Pending` with a future, and the rollout's main
thread (evenrl.agents.rollout) takes the queue in batches, renders, samples on the engine, records and answers; the
handler then sends the answer, whole or as server-sent events. So the engine, the tokenizer and every record stay on
one thread. A key whose agent is not running is answered 404 at once: the rollout opens the keys of its trajectories
(`live`), and the worker's note that an agent returned (POST /t/TOKEN/returned, evenrl.agents.job) closes one.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations as objects (Request, imported
# inside _app so that the fastapi extra is needed only by agent runs).
import asyncio
import atexit
import concurrent.futures
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

from evenrl.errors import RunStopped

# A request body larger than this is refused (413) before it is read whole: a flooding agent costs its own calls.
MAX_BODY_BYTES = 8 << 20
_START_TIMEOUT_S = 30.0


@dataclass
class Answer:
    status: int
    body: Optional[dict] = None
    stream: Optional[bytes] = None  # a streamed answer: its server-sent events, whole


@dataclass
class Pending:
    token: str
    kind: str  # "chat", "completion", "responses", or "returned" (the agent's note that it returned)
    body: dict
    future: concurrent.futures.Future


def error(status: int, message: str, code: str = "invalid_request_error") -> Answer:
    return Answer(status, {"error": {"message": message, "type": code, "param": None, "code": code}})


async def read_body(request) -> object:
    """The request's JSON, or the error Answer for it: 413 once more than MAX_BODY_BYTES have arrived (counted as
    they are read, Content-Length or chunked: a flooding agent costs its own call, not the trainer's memory), 400 for
    a body that is not JSON or nests deeper than the parser goes (RecursionError, before it reaches the rollout)."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        return error(413, f"request body over {MAX_BODY_BYTES} bytes")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > MAX_BODY_BYTES:
            return error(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        return error(400, "the request body nests too deeply to read")
    except ValueError:
        return error(400, "the request body is not JSON")


GONE = error(404, "no running agent has this trajectory's key: its agent returned, or the base_url is not evenrl's")


class AgentServer:
    """The endpoint on a Unix socket in a private temporary directory; `requests` is the queue of `Pending`."""

    def __init__(self, model_name: str):
        import uvicorn

        self.model_name = model_name
        self.requests: queue.Queue = queue.Queue()
        # the trajectories whose agents are running (the rollout fills it): a call with any other key, one made
        # after its agent returned included, is refused here without reaching the rollout
        self.live: set[str] = set()
        self.dir = tempfile.mkdtemp(prefix="evenrl-agents-")
        os.chmod(self.dir, 0o700)
        self.socket_path = os.path.join(self.dir, "endpoint.sock")
        config = uvicorn.Config(self._app(), uds=self.socket_path, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30, backlog=1024)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="evenrl-agent-endpoint", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RunStopped(f"rollout.agent: the endpoint did not start on {self.socket_path}")
            time.sleep(0.01)
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response
        from starlette.requests import ClientDisconnect

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        requests, model_name, live = self.requests, self.model_name, self.live

        async def handle(token: str, kind: str, request: Request):
            if token not in live:
                return JSONResponse(GONE.body, status_code=GONE.status)
            try:
                body = await read_body(request)
            except ClientDisconnect:  # the agent went (killed at its time limit) while sending: nobody to answer
                return Response(status_code=499)
            if isinstance(body, Answer):
                answer = body
            elif not isinstance(body, dict):
                answer = error(400, "the request body must be a JSON object")
            else:
                future: concurrent.futures.Future = concurrent.futures.Future()
                requests.put(Pending(token, kind, body, future))
                answer = await asyncio.wrap_future(future)
            if answer.stream is not None:
                return Response(answer.stream, media_type="text/event-stream")
            return JSONResponse(answer.body, status_code=answer.status)

        @app.post("/t/{token}/v1/chat/completions")
        async def chat(token: str, request: Request):
            return await handle(token, "chat", request)

        @app.post("/t/{token}/v1/completions")
        async def completions(token: str, request: Request):
            return await handle(token, "completion", request)

        @app.post("/t/{token}/v1/responses")
        async def responses(token: str, request: Request):
            return await handle(token, "responses", request)

        @app.post("/t/{token}/returned")
        async def returned(token: str):
            """The agent's worker says it returned (evenrl.agents.job): its later calls are refused from now on, and
            the rollout marks the trajectory when it reaches this note (calls queued before it are served)."""
            if token in live:
                live.discard(token)
                requests.put(Pending(token, "returned", {}, concurrent.futures.Future()))
            return {}

        @app.get("/t/{token}/v1/models")
        async def models(token: str):
            return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "evenrl"}]}

        return app
