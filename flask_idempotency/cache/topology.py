"""Redis behind Sentinel or as a Cluster, named by one URL.

``IDEMPOTENCY_REDIS_URL`` takes, besides ``redis://`` and ``rediss://``:

* ``redis+sentinel://[:password@]host:port[,host:port...]/<service>[/<db>]``:
  the sentinels to ask, and the name of the master they watch. redis-py's
  ``Sentinel`` finds the master, and finds it again after a failover (a
  connection to a demoted master fails, and the next one asks the sentinels).
* ``redis+cluster://[:password@]host:port[,host:port...]``: any nodes of a
  Redis Cluster; redis-py's ``RedisCluster`` learns the slot map from them and
  follows ``MOVED``/``ASK`` redirections.

``rediss+sentinel`` and ``rediss+cluster`` connect to the data nodes over TLS
with the system's trust store; for other TLS options, build the client
yourself and pass it as ``IDEMPOTENCY_REDIS``. The schemes are those of
kombu and Celery (``sentinel://``) and of redis-py's own cluster URL, with a
``redis+`` prefix so that a URL says what it is.

The clients get the cache's failure policy: the given timeout on every socket,
no retries, no health-check ``PING``, all through redis-py's documented options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
import redis.backoff
import redis.cluster
import redis.retry
import redis.sentinel

#: Each scheme, and the kind of deployment it names.
SCHEMES = {f"{tls}+{kind}": kind for tls in ("redis", "rediss") for kind in ("sentinel", "cluster")}
#: Sentinel's own port when a host names none.
SENTINEL_PORT = 26379
CLUSTER_PORT = 6379


@dataclass(frozen=True)
class TopologyURL:
    """What one ``redis+sentinel``/``redis+cluster`` URL says."""

    kind: str  # "sentinel" or "cluster"
    nodes: tuple[tuple[str, int], ...]
    ssl: bool
    username: str | None
    password: str | None
    service: str | None = None  # sentinel: the master's name
    db: int = 0


def is_topology_url(url: str) -> bool:
    return url.partition("://")[0].lower() in SCHEMES


def parse(url: str) -> TopologyURL:
    """Parse a ``redis+sentinel://`` or ``redis+cluster://`` URL; ``ValueError``
    (naming what is wrong, never the password) if it is malformed."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    kind = SCHEMES.get(scheme)
    if not sep or kind is None:
        raise ValueError(f"not a redis+sentinel:// or redis+cluster:// URL: {scheme}://")
    if "?" in rest or "#" in rest:
        raise ValueError(
            f"{scheme}:// URLs take no query options; pass a client as IDEMPOTENCY_REDIS "
            "for options beyond the timeout"
        )
    netloc, _, path = rest.partition("/")
    userinfo, _, netloc = netloc.rpartition("@")
    user, _, secret = userinfo.partition(":")
    username, password = unquote(user) or None, unquote(secret) or None
    default_port = SENTINEL_PORT if kind == "sentinel" else CLUSTER_PORT
    nodes = tuple(_node(part, default_port, scheme) for part in netloc.split(","))
    parts = [p for p in path.split("/") if p]
    service, db = None, 0
    if kind == "sentinel":
        if not parts or len(parts) > 2:
            raise ValueError(f"{scheme}:// needs the master's name: {scheme}://host:port/<name>")
        service = unquote(parts[0])
        if len(parts) == 2:
            db = _whole(parts[1], f"{scheme}:// database number")
    elif parts and parts != ["0"]:
        raise ValueError("a Redis Cluster has database 0 only")
    return TopologyURL(
        kind=kind,
        nodes=nodes,
        ssl=scheme.startswith("rediss"),
        username=username,
        password=password,
        service=service,
        db=db,
    )


def _node(text: str, default_port: int, scheme: str) -> tuple[str, int]:
    host, port = text.strip(), ""
    if host.startswith("["):  # [IPv6]:port
        host, _, port = host[1:].partition("]")
        port = port.removeprefix(":")
    elif host.count(":") == 1:
        host, _, port = host.partition(":")
    if not host:
        raise ValueError(f"{scheme}:// names an empty host")
    return host, _whole(port, f"{scheme}:// port") if port else default_port


def _whole(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be a whole number, not {text!r}") from None
    if value < 0:
        raise ValueError(f"{what} must not be negative")
    return value


def client_for(url: str, timeout: float, connection_options: dict[str, Any]) -> Any:
    """A redis-py client for a topology URL, with the cache's failure policy.
    ``connection_options``: what the plain client also gets (the lean handshake)."""
    spec = parse(url)
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "username": spec.username,
        "password": spec.password,
        "ssl": spec.ssl,
        **connection_options,
    }
    if spec.kind == "sentinel":
        assert spec.service is not None
        sentinel = redis.sentinel.Sentinel(
            list(spec.nodes),
            sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout},
            **common,
        )
        return sentinel.master_for(
            spec.service,
            db=spec.db,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
            health_check_interval=0,
        )
    return redis.cluster.RedisCluster(
        startup_nodes=[redis.cluster.ClusterNode(host, port) for host, port in spec.nodes],
        # One more try after a connection error: the client then reloads the slot
        # map, which is how it follows a failover; a slow node still costs at most
        # two timeouts before the breaker counts it.
        retry=redis.retry.Retry(redis.backoff.NoBackoff(), 1),
        **common,
    )
