"""
The public port's route table: every route the core answers, with its method, the most
body it takes, whether the management guard runs at its head, whether a page on an
allowed origin may call it (CORS), whether a browser page from another origin is refused
(the Origin rule of section 12), whether its body streams to a worker, and whether it is
answered without Klein's routing.

This is the one place these are said.  Klein's URL map, the site's admission at the head
(L{rhapsode._http.site.CoreSite}) and the security marks in C{/openapi.json} are all built
from it; each part of the core (the native routes, the doors, management) supplies the
handlers its routes name, and the composition root checks that every route has exactly
one (L{klein_app}).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from klein import Klein
from twisted.web.iweb import IRequest
from werkzeug.exceptions import MethodNotAllowed, NotFound

from rhapsode_protocol import contract
from rhapsode_protocol.http.answers import no_route
from rhapsode_protocol.http.site import DEFAULT_BODY_LIMIT

from .._manage.patch import settings_patch_schema

__all__ = [
    "BATCH_BODY",
    "CORS_ROUTES",
    "JSON_BODY",
    "MANAGEMENT",
    "NODE_ROUTES",
    "ORIGIN_CHECKED",
    "ROUTES",
    "UPDATE",
    "UPDATE_CHECK",
    "UPLOAD_BODY",
    "RouteSpec",
    "klein_app",
    "openapi_document",
    "openapi_path",
    "route",
    "routes_for",
]

#: The most a JSON speech body may be.
JSON_BODY = 1024 * 1024
#: A batch's JSON: up to 32 items.
BATCH_BODY = 4 * 1024 * 1024
#: A voice upload above this is refused (protocol.md section 7): generous for any clip.
UPLOAD_BODY = 25 * 1000 * 1000

#: Who may call a route: anybody, the management guard's callers, or (for /metrics)
#: the guard's callers unless C{metrics.public} opens it.
OPEN, MANAGED, METRICS = "open", "management", "metrics"


@dataclass(frozen=True)
class RouteSpec:
    """
    One route of the public port.

    @ivar name: the handler's name, which the part answering the route supplies.
    @ivar body: the most body the route takes, in bytes.
    @ivar guard: L{OPEN}, L{MANAGED} or L{METRICS}.
    @ivar cors: a page on one of C{cors.origins} may call it from a browser.
    @ivar origin_checked: a browser page whose Origin is neither this machine's nor in
        C{management.origins} is refused (C{/mcp}, the speech WebSocket).
    @ivar upload: its body streams to a worker as it arrives (a voice upload).
    @ivar direct: answered without Klein's routing (matched on every utterance).
    """

    method: str
    rule: str
    name: str
    body: int = DEFAULT_BODY_LIMIT
    guard: str = OPEN
    cors: bool = False
    origin_checked: bool = False
    upload: bool = False
    direct: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.method, self.rule)


_ENGINE = "/engines/<string:engine_id>"
_VOICES = _ENGINE + "/voices"
_VOICE = _VOICES + "/<string:voice_id>"
_JOB = "/installs/<string:job_id>"
#: The update check (protocol.md section 9): open routes, like /health and /catalog.
UPDATE = "/update"
UPDATE_CHECK = "/update/check"

ROUTES: tuple[RouteSpec, ...] = (
    # The public API (protocol.md sections 3, 4, 6, 7 and 9).
    RouteSpec("GET", "/engines", "engines", cors=True),
    RouteSpec("GET", "/health", "health", cors=True),
    RouteSpec("GET", "/residency", "residency"),
    RouteSpec("GET", "/openapi.json", "openapi"),
    RouteSpec("GET", "/catalog", "catalog", cors=True),
    RouteSpec("GET", "/metrics", "metrics", guard=METRICS),
    RouteSpec("GET", _ENGINE + "/capabilities", "capabilities", cors=True),
    RouteSpec("GET", _VOICES, "voices", cors=True),
    RouteSpec("GET", _VOICE + "/preview", "preview", cors=True),
    RouteSpec("POST", "/speak", "speak", body=JSON_BODY, cors=True, direct=True),
    RouteSpec("POST", _ENGINE + "/dialogue", "dialogue", body=JSON_BODY, cors=True),
    # Managing voices and models (section 10's guard, at the head).
    RouteSpec("POST", _VOICES, "create_voice", body=UPLOAD_BODY, guard=MANAGED, upload=True),
    RouteSpec("DELETE", _VOICE, "delete_voice", guard=MANAGED),
    RouteSpec("POST", _ENGINE + "/unload", "unload", guard=MANAGED),
    # The translations on top (sections 11 and 12, and the peer's modes).
    RouteSpec("POST", "/v1/audio/speech", "openai_speech", body=JSON_BODY, cors=True, direct=True),
    RouteSpec("POST", "/v1/audio/speech/batch", "openai_batch", body=BATCH_BODY, cors=True),
    # Kokoro-FastAPI's captioned speech, with word timings (protocol.md section 4).
    RouteSpec("POST", "/dev/captioned_speech", "captioned_speech", body=JSON_BODY, cors=True),
    RouteSpec("GET", "/v1/audio/speech/stream", "openai_stream", cors=True, origin_checked=True),
    RouteSpec("GET", "/v1/models", "openai_models", cors=True),
    RouteSpec("GET", "/v1/models/<string:model_id>", "openai_model", cors=True),
    RouteSpec("GET", "/v1/audio/models", "openai_audio_models", cors=True),
    RouteSpec("GET", "/v1/audio/voices", "openai_voices", cors=True),
    RouteSpec("POST", "/mcp", "mcp", body=JSON_BODY, origin_checked=True),
    # Settings, installing and the update check (sections 9 and 10).
    RouteSpec("GET", "/settings", "get_settings", guard=MANAGED),
    RouteSpec("PATCH", "/settings", "patch_settings", guard=MANAGED),
    RouteSpec("POST", _ENGINE + "/install", "install", guard=MANAGED),
    RouteSpec("POST", _ENGINE + "/reinstall", "reinstall", guard=MANAGED),
    RouteSpec("POST", _ENGINE + "/pull", "pull", guard=MANAGED),
    RouteSpec("DELETE", _ENGINE, "uninstall", guard=MANAGED),
    RouteSpec("GET", "/installs", "jobs", guard=MANAGED),
    RouteSpec("POST", "/installs/outdated", "outdated", guard=MANAGED),
    RouteSpec("GET", _JOB, "job", guard=MANAGED),
    RouteSpec("GET", _JOB + "/events", "job_events", guard=MANAGED),
    RouteSpec("GET", UPDATE, "update", cors=True),
    RouteSpec("POST", UPDATE_CHECK, "update_check", cors=True),
)


_WORKER = "/worker/<string:engine_id>"
_WORKER_VOICES = _WORKER + "/voices"

#: A cluster node's own routes (server.role "node", docs/cluster.md): its state for the
#: cluster's router, and each engine's worker routes for the cluster's front.  Voice
#: uploads and deletions, and fetches, are the management guard's here as on the front
#: (the node is reached from its own machine, by the cluster's replica).
NODE_ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec("GET", "/node", "node_state"),
    RouteSpec("GET", _WORKER + "/capabilities", "node_capabilities"),
    RouteSpec("GET", _WORKER + "/health", "node_health"),
    RouteSpec("GET", _WORKER_VOICES, "node_voices"),
    RouteSpec("POST", _WORKER_VOICES, "node_create_voice", body=UPLOAD_BODY, guard=MANAGED, upload=True),
    RouteSpec("DELETE", _WORKER_VOICES + "/<string:voice_id>", "node_delete_voice", guard=MANAGED),
    RouteSpec("GET", _WORKER_VOICES + "/<string:voice_id>/preview", "node_preview"),
    RouteSpec("POST", _WORKER + "/speak", "node_speak", body=JSON_BODY),
    RouteSpec("POST", _WORKER + "/dialogue", "node_dialogue", body=JSON_BODY),
    RouteSpec("POST", _WORKER + "/fetch", "node_fetch", guard=MANAGED),
    RouteSpec("POST", _WORKER + "/unload", "node_refused"),
    RouteSpec("POST", _WORKER + "/terminate", "node_refused"),
)


def routes_for(role: str) -> tuple[RouteSpec, ...]:
    """
    The routes a core of C{role} answers: every core's, and a node's own beside them.
    """
    return ROUTES + NODE_ROUTES if role == "node" else ROUTES


def route(name: str, routes: Iterable[RouteSpec] = ROUTES) -> RouteSpec:
    """
    The route whose handler is C{name}.
    """
    for spec in routes:
        if spec.name == name:
            return spec
    raise KeyError(name)


def _keys(wanted: Callable[[RouteSpec], bool]) -> frozenset[tuple[str, str]]:
    return frozenset(spec.key for spec in ROUTES if wanted(spec))


#: The (method, rule) of every management route (the guard runs at their heads).
MANAGEMENT = _keys(lambda spec: spec.guard == MANAGED)
#: The routes a page on one of C{cors.origins} may call from a browser.
CORS_ROUTES = _keys(lambda spec: spec.cors)
#: The routes that refuse a browser page from an origin not allowed.
ORIGIN_CHECKED = _keys(lambda spec: spec.origin_checked)

Handler = Callable[..., Any]


def klein_app(handlers: Mapping[str, Handler], routes: Iterable[RouteSpec] = ROUTES) -> Klein:
    """
    A Klein app routing every route of C{routes} to its handler in C{handlers} (each
    called as C{handler(request, **arguments)}), and answering a request no route takes
    as the site would at its head (404, or 405 with C{Allow}).

    @raise ValueError: a route with no handler, or a handler no route names.
    """
    routes = tuple(routes)
    names = {spec.name for spec in routes}
    missing = sorted(names - set(handlers))
    extra = sorted(set(handlers) - names)
    if missing or extra:
        raise ValueError(f"routes without a handler: {missing}; handlers without a route: {extra}")
    app = Klein()
    for spec in routes:
        # The endpoint is the rule's own: one handler (node_refused) may answer two routes.
        app.route(spec.rule, methods=[spec.method], endpoint=f"{spec.method} {spec.rule}")(handlers[spec.name])

    @app.handle_errors(NotFound, MethodNotAllowed)
    def unrouted(request: IRequest, failure: Any) -> bytes:
        return no_route(request, failure)

    return app


_ARGUMENT = re.compile(r"<(?:[a-z]+:)?[a-z_]+>|\{[a-z_]+\}")
#: How the document names the management token, for the routes the guard runs for.
_TOKEN_SCHEME = {
    "type": "http",
    "scheme": "bearer",
    "description": "The management token (management.token). A caller on this machine needs none; "
    "a browser page must also come from this machine or an origin in management.origins.",
}


def openapi_path(rule: str) -> str:
    """
    A route's rule with its arguments blanked (C{/engines/{}/voices}), as an OpenAPI
    path is compared with it.
    """
    return _ARGUMENT.sub("{}", rule)


def openapi_document(version: str, routes: Iterable[RouteSpec] = ROUTES, metrics_public: bool = False) -> dict[str, Any]:
    """
    The public API's OpenAPI document (the contract's, at C{version}) with what the route
    table says of each operation it describes: the management guard as a security
    requirement (anonymous for this machine's callers, else the token), and the body
    limit, the CORS rule and the Origin rule as C{x-rhapsode-*} extensions.
    """
    document = contract.public_openapi(version)
    paths = {openapi_path(path): operations for path, operations in document["paths"].items()}
    guarded = False
    for spec in routes:
        operation = paths.get(openapi_path(spec.rule), {}).get(spec.method.lower())
        if operation is None:
            continue
        if spec.guard == MANAGED or (spec.guard == METRICS and not metrics_public):
            operation["security"] = [{}, {"managementToken": []}]
            guarded = True
        if spec.method in ("POST", "PATCH", "PUT"):
            operation["x-rhapsode-body-limit"] = spec.body
            envelope = "OpenAIError" if spec.rule.startswith("/v1/") else "Error"
            operation["responses"].setdefault("413", {
                "description": f"bad_request: the body is over {spec.body} bytes (x-rhapsode-body-limit), "
                "refused before it is read, or as it arrives past the limit.",
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{envelope}"}}},
            })
        operation["x-rhapsode-cors"] = spec.cors
        if spec.origin_checked:
            operation["x-rhapsode-origin-checked"] = True
    if guarded:
        document["components"]["securitySchemes"] = {"managementToken": dict(_TOKEN_SCHEME)}
    schemas = document["components"]["schemas"]
    if "SettingsPatch" in schemas:
        # Every section and key the settings API takes, typed, and no other.
        schemas["SettingsPatch"] = settings_patch_schema()
    return document
