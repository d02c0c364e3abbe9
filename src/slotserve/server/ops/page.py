"""The web page at ``/`` and its static files.

The page is plain static files (`server/ops/web/`: HTML, CSS, JS, no build step) served from the
package. Its chat panel talks to the server's own OpenAI endpoints; its dashboard reads the
feed of `ops.dashboard`. Only the files named in `ASSETS` are served.

Owns: the page and asset routes. Must not touch: the engine, the feed, the OpenAI routes.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from slotserve.server.http.errors import APIError

# The page's files and their media types; nothing else under web/ is served.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "sse.js": "text/javascript; charset=utf-8",
}

router = APIRouter(redirect_slashes=False)


def _asset(name: str) -> Response:
    """One of the page's files, read from the installed package."""
    if name not in ASSETS:
        raise APIError(404, f"no such file: {name}", "invalid_request_error")
    body = resources.files("slotserve.server.ops").joinpath("web", name).read_bytes()
    # no-cache: the page is small and a restarted server may serve a newer one.
    return Response(body, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def page() -> Response:
    """The page itself. Open without a key: it holds no data, and asks for the key."""
    return _asset("index.html")


@router.get("/web/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    """One of the page's static files (`ASSETS`); anything else is a 404."""
    return _asset(name)
