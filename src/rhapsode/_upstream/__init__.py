"""
The core's client to its workers (protocol.md section 1): kept-alive HTTP/1.1
connections to one worker over its Unix socket or a URL, the same protocol either way.

L{wire} is one connection and its narrow HTTP/1.1 reader, L{pool} the requests and the
connections kept for them, L{body} a body read whole within a limit, and L{cluster} a
cluster engine's upstream: routed by the cluster, spoken to its node directly.
"""

from .body import BodyTooLarge, Stalls, Watched, WatchedBody, collect, collect_pieces, stalled, worker_json
from .cluster import ClusterClient
from .pool import BytesProducer, WorkerClient
from .wire import ProtocolError, WorkerResponse

__all__ = [
    "BodyTooLarge",
    "BytesProducer",
    "ClusterClient",
    "ProtocolError",
    "Stalls",
    "WorkerClient",
    "Watched",
    "WatchedBody",
    "WorkerResponse",
    "collect",
    "collect_pieces",
    "stalled",
    "worker_json",
]
