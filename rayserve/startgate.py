"""A truthful start for the Ray backend: /v1/models answers 503 until the model can be served.

While Serve brings the replicas up, the ingress answers HTTP before any worker has registered.
A client that lists the models at start-up (openai's clients, health probes, CI scripts) and sees
200 with an empty list concludes that the model does not exist. So, in front of the gateway app,
`StartGate` answers `GET /v1/models` itself with the 503 that `/ready` gives (OpenAI's error
JSON, `Retry-After: 1`, the reason in words) for as long as the router cannot serve; once it can,
every request passes through untouched. It is a plain ASGI wrapper: no state of its own, one
readiness check per models request.
"""

from __future__ import annotations

import json
from collections.abc import Callable

MODELS_PATHS = ("/v1/models", "/v1/models/")


class StartGate:
    """ASGI middleware. `unready_reason()` returns '' when the model can be served, else why not."""

    def __init__(self, app, unready_reason: Callable[[], str]):
        self.app = app
        self.unready_reason = unready_reason

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http" and scope.get("method") == "GET" and scope.get("path") in MODELS_PATHS:
            reason = self.unready_reason()
            if reason:
                await _send_unavailable(send, reason)
                return
        await self.app(scope, receive, send)

    def __getattr__(self, name):  # the wrapped app's attributes (routes, state, ...) stay reachable
        return getattr(self.app, name)


async def _send_unavailable(send, reason: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"the model cannot be served yet: {reason}",
                "type": "service_unavailable",
                "param": None,
                "code": "no_worker_available",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
