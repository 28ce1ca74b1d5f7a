"""``python -m benchmarks.pgcost``: what PostgreSQL is made to do per request, counted.

Timings on a shared machine drift by a tenth between runs; what PostgreSQL does
for a request does not. On a throwaway server of its own (``pg_stat_statements``
and ``pg_walinspect`` loaded, autovacuum off, no checkpoint unless asked), the
same one-row "create charge" view is served through Flask's test client, no
Redis, for each subject:

* ``bare``: no idempotency (``BEGIN``, ``INSERT``, ``COMMIT``);
* ``floor1``: the transaction mode's floor: a ``SELECT`` of the key, then the
  completed record inserted before the view's ``COMMIT`` (one more row write);
* ``floor-row``: the row mode's floor: a ``SELECT``, a claim row committed on its
  own (``INSERT ... ON CONFLICT DO NOTHING``), then one ``UPDATE`` with the
  answer before the view's ``COMMIT``;
* ``prod-row``, ``prod-tx``: this library, ``Idempotency(app)`` and
  ``idempotency.connection()``, in each claim mode;
* ``prod-sqla``, ``bare-sqla``: Flask-SQLAlchemy's ``db.session``, with
  ``Idempotency(app, db=db)`` and without.

Per request, for first requests (new keys) and for their replays: WAL bytes
(from the insert position, less the bgwriter's timed ``Standby`` records, which
``pg_walinspect`` tells apart), full-page-image bytes among them, WAL records,
top-level and nested statements (``pg_stat_statements``, utility statements
included), round trips (a proxy counting the protocol's query messages), COMMIT
records; and the bytes each subject's records table holds per key. Repeated
runs agree within about 1 %. ``docs/performance.md`` has the table and how to
read it; ``--checkpoint-timeout 30 --sustain 120`` runs the first requests for
two minutes under 30-second checkpoints, to count the full-page images that
random keys cost once checkpoints happen.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions
from flask import Flask, Response, jsonify, request

REPO_ROOT = Path(__file__).resolve().parent.parent
BODY = {"amount": 1500, "currency": "eur", "customer": "cus_8Xb3fQ2k"}
HEADERS = {"Authorization": "Bearer sk_test_1", "Content-Type": "application/json"}
SERVER_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_utility": "on",
    "pg_stat_statements.max": "10000",
    "autovacuum": "off",
    "checkpoint_timeout": "1d",
    "max_wal_size": "10GB",
    "shared_buffers": "256MB",
}
CHARGES = """CREATE TABLE charges (id bigserial PRIMARY KEY, amount integer NOT NULL,
    currency text NOT NULL, customer text NOT NULL)"""
FLOOR = """CREATE TABLE floor_records (record_key bytea PRIMARY KEY, fingerprint bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(), status smallint, headers jsonb, body bytea)"""
INSERT_CHARGE = "INSERT INTO charges (amount, currency, customer) VALUES (%s, %s, %s) RETURNING id"


class Proxy:
    """A TCP proxy counting the frontend's query messages ('Q' simple, 'S' sync)."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.lock = threading.Lock()
        self.round_trips = 0
        self.sockets: list[socket.socket] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Stop listening and close every connection it passed on."""
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for sock in (self.sock, *sockets):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return  # closed
            with self.lock:
                self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        """Forward ``src`` to ``dst``; going up, count each message before it is
        forwarded, so a request's count is in before its answer can come back."""
        buf, started = b"", not up  # the startup packet carries no type byte
        with suppress(OSError):
            while data := src.recv(65536):
                if not up:
                    dst.sendall(data)
                    continue
                buf += data
                while True:
                    if not started:
                        if len(buf) < 8 or len(buf) < struct.unpack("!I", buf[:4])[0]:
                            break
                        length, code = struct.unpack("!II", buf[:8])
                        buf, started = buf[length:], code not in (80877103, 80877104)
                        continue
                    if len(buf) < 5 or len(buf) < 1 + struct.unpack("!I", buf[1:5])[0]:
                        break
                    kind, buf = buf[:1], buf[1 + struct.unpack("!I", buf[1:5])[0] :]
                    if kind in (b"Q", b"S"):
                        with self.lock:
                            self.round_trips += 1
                dst.sendall(data)
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def one(cur: Any) -> Any:
    """The row a statement that always returns one returned."""
    row = cur.fetchone()
    assert row is not None
    return row


def digest(*parts: str | bytes) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\x00")
    return h.digest()


@dataclass
class Subject:
    name: str
    #: Builds the app on a DSN (through the proxy); returns it and a close().
    build: Callable[[str], tuple[Flask, Callable[[], None]]]
    #: The table whose bytes per key are reported; None for no idempotency.
    records: str | None
    #: The schema beyond ``charges``.
    schema: Callable[[Any], None]


def _no_schema(cur: Any) -> None:
    pass


def _floor_schema(cur: Any) -> None:
    cur.execute(FLOOR)


def _product_schema(cur: Any) -> None:
    from flask_idempotency.store.migrations import all_migrations, apply

    apply(cur.connection, all_migrations([]))


def _bare(dsn: str) -> tuple[Flask, Callable[[], None]]:
    app = Flask("bare")
    conn = psycopg2.connect(dsn)

    @app.post("/charges")
    def create() -> Any:
        body = request.get_json()
        with conn.cursor() as cur:
            cur.execute(INSERT_CHARGE, (body["amount"], body["currency"], body["customer"]))
            (charge_id,) = one(cur)
        conn.commit()
        return jsonify(id=charge_id, **body), 201

    return app, conn.close


def _floor(one_row: bool) -> Callable[[str], tuple[Flask, Callable[[], None]]]:
    """A hand-written layer at the floor of one claim mode (the module's docstring)."""

    def build(dsn: str) -> tuple[Flask, Callable[[], None]]:
        app = Flask("floor")
        conn = psycopg2.connect(dsn)
        conn.autocommit = True  # the layer sends BEGIN and COMMIT itself, piggybacked

        @app.post("/charges")
        def create() -> Any:
            auth = request.headers.get("Authorization", "")
            scope = hashlib.sha256(auth.encode()).hexdigest()
            key = digest(scope, request.headers["Idempotency-Key"])
            fingerprint = digest(request.method, request.path, request.get_data())
            cur = conn.cursor()
            cur.execute(
                "SELECT fingerprint, status, headers, body FROM floor_records"
                " WHERE record_key = %s",
                (key,),
            )
            row = cur.fetchone()
            if row is not None:
                if bytes(row[0]) != fingerprint or row[1] is None:
                    return jsonify(code="conflict"), 409
                return Response(bytes(row[3]), status=row[1], headers=[tuple(h) for h in row[2]])
            if not one_row:
                cur.execute(
                    "INSERT INTO floor_records (record_key, fingerprint) VALUES (%s, %s) "
                    "ON CONFLICT DO NOTHING RETURNING true",
                    (key, fingerprint),
                )
                if cur.fetchone() is None:
                    return jsonify(code="conflict"), 409
            cur.execute("BEGIN")
            body = request.get_json()
            cur.execute(INSERT_CHARGE, (body["amount"], body["currency"], body["customer"]))
            response = jsonify(id=one(cur)[0], **body)
            response.status_code = 201
            headers = json.dumps([["Content-Type", response.content_type]])
            if one_row:
                cur.execute(
                    "INSERT INTO floor_records (record_key, fingerprint, status, headers, body) "
                    "VALUES (%s, %s, %s, %s, %s); COMMIT",
                    (key, fingerprint, 201, headers, response.get_data()),
                )
            else:
                cur.execute(
                    "UPDATE floor_records SET status = %s, headers = %s, body = %s "
                    "WHERE record_key = %s; COMMIT",
                    (201, headers, response.get_data(), key),
                )
            return response

        return app, conn.close

    return build


def _product(claim_mode: str) -> Callable[[str], tuple[Flask, Callable[[], None]]]:
    def build(dsn: str) -> tuple[Flask, Callable[[], None]]:
        from flask_idempotency import Idempotency
        from flask_idempotency.state import app_state

        app = Flask(f"prod-{claim_mode}")
        app.config.update(IDEMPOTENCY_DATABASE_URL=dsn, IDEMPOTENCY_CLAIM_MODE=claim_mode)
        idempotency = Idempotency(app)

        @app.post("/charges")
        @idempotency.required
        def create() -> Any:
            body = request.get_json()
            with idempotency.connection().cursor() as cur:
                cur.execute(INSERT_CHARGE, (body["amount"], body["currency"], body["customer"]))
                (charge_id,) = one(cur)
            return jsonify(id=charge_id, **body), 201

        return app, lambda: app_state(app).close()

    return build


def _sqla(with_idempotency: bool) -> Callable[[str], tuple[Flask, Callable[[], None]]]:
    def build(dsn: str) -> tuple[Flask, Callable[[], None]]:
        from flask_sqlalchemy import SQLAlchemy
        from sqlalchemy import BigInteger
        from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

        class Base(DeclarativeBase):
            pass

        db = SQLAlchemy(model_class=Base)

        class Charge(db.Model):  # type: ignore[name-defined,misc]
            __tablename__ = "charges"
            id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
            amount: Mapped[int]
            currency: Mapped[str]
            customer: Mapped[str]

        app = Flask("sqla")
        app.config["SQLALCHEMY_DATABASE_URI"] = dsn.replace(
            "postgresql://", "postgresql+psycopg2://"
        )
        db.init_app(app)
        decorate: Callable[[Any], Any] = lambda view: view  # noqa: E731
        closers: list[Callable[[], None]] = []
        if with_idempotency:
            from flask_idempotency import Idempotency
            from flask_idempotency.state import app_state

            decorate = Idempotency(app, db=db).required
            closers.append(lambda: app_state(app).close())

        @app.post("/charges")
        @decorate
        def create() -> Any:
            body = request.get_json()
            charge = Charge(**body)
            db.session.add(charge)
            db.session.commit()
            return {"id": charge.id, **body}, 201

        def close() -> None:
            for closer in closers:
                closer()
            with app.app_context():
                db.engine.dispose()

        return app, close

    return build


SUBJECTS = {
    s.name: s
    for s in (
        Subject("bare", _bare, None, _no_schema),
        Subject("floor1", _floor(one_row=True), "floor_records", _floor_schema),
        Subject("floor-row", _floor(one_row=False), "floor_records", _floor_schema),
        Subject("prod-row", _product("row"), "idempotency_records", _product_schema),
        Subject("prod-tx", _product("transaction"), "idempotency_records", _product_schema),
        Subject("prod-sqla", _sqla(True), "idempotency_records", _product_schema),
        Subject("bare-sqla", _sqla(False), None, _no_schema),
    )
}


class Monitor:
    """Reads the server's counters from a database of its own."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True

    def rows(self, sql: str, args: Any = ()) -> list[Any]:
        with self.conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall() if cur.description else []

    def lsn(self) -> str:
        return str(self.rows("SELECT pg_current_wal_insert_lsn()::text")[0][0])

    def wal(self, start: str, end: str) -> dict[str, float]:
        """WAL between two positions: bytes, FPI bytes, records, COMMITs, less Standby."""
        for _ in range(200):  # pg_walinspect reads flushed WAL only
            if self.rows("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (end,))[0][0]:
                break
            time.sleep(0.05)
        total = self.rows("SELECT %s::pg_lsn - %s::pg_lsn", (end, start))[0][0]
        stats = (
            self.rows(
                'SELECT "resource_manager/record_type", count, combined_size, fpi_size'
                " FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, true) WHERE count > 0",
                (start, end),
            )
            if end != start
            else []
        )
        standby = [r for r in stats if r[0].startswith("Standby")]
        return {
            "wal_bytes": float(total) - sum(r[2] for r in standby),
            "fpi_bytes": float(sum(r[3] for r in stats)),
            "wal_records": float(sum(r[1] for r in stats) - sum(r[1] for r in standby)),
            "commits": float(sum(r[1] for r in stats if r[0] == "Transaction/COMMIT")),
            "checkpoints": float(sum(r[1] for r in stats if r[0].startswith("XLOG/CHECKPOINT"))),
        }

    def statements(self, db: str) -> dict[str, float]:
        ((top, nested, set_local),) = self.rows(
            "SELECT coalesce(sum(calls) FILTER (WHERE toplevel), 0),"
            " coalesce(sum(calls) FILTER (WHERE NOT toplevel), 0),"
            " coalesce(sum(calls) FILTER (WHERE toplevel AND query ILIKE 'SET LOCAL%%'), 0)"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s",
            (db,),
        )
        return {"statements": float(top), "nested": float(nested), "set_local": float(set_local)}


def post(client: Any, key: str) -> None:
    response = client.post("/charges", json=BODY, headers={**HEADERS, "Idempotency-Key": key})
    if response.status_code != 201:
        raise RuntimeError(f"{response.status_code} {response.get_data()[:200]!r}")


@contextmanager
def counted(mon: Monitor, proxy: Proxy, db: str, out: dict[str, float]) -> Iterator[list[int]]:
    """Counts what the block makes PostgreSQL do; ``out`` gets the totals, and the
    block appends how many requests it made to the list it is given."""
    mon.rows("SELECT pg_stat_statements_reset()")
    start, trips, n = mon.lsn(), proxy.round_trips, [0]
    yield n
    out.update(mon.wal(start, mon.lsn()))
    out.update(mon.statements(db))
    out["round_trips"] = float(proxy.round_trips - trips)
    out.update({k: v / max(1, n[0]) for k, v in out.items() if k != "checkpoints"})
    out["requests"] = float(n[0])


def measure(subject: Subject, server: Any, mon: Monitor, proxy: Proxy, args: Any) -> dict[str, Any]:
    db = "s_" + subject.name.replace("-", "_")
    mon.rows(f'DROP DATABASE IF EXISTS "{db}"')
    mon.rows(f'CREATE DATABASE "{db}"')
    setup = psycopg2.connect(server.dsn_for(db))
    setup.autocommit = True
    with setup.cursor() as cur:
        cur.execute(CHARGES)
        subject.schema(cur)
        setup.autocommit = True
        cur.execute("VACUUM")
    app, close = subject.build(server.dsn_for(db).replace(f":{server.port}/", f":{proxy.port}/"))
    client = app.test_client()
    mon.rows("CHECKPOINT")  # (the warm-up takes the pages' first full-page images)
    for i in range(args.warmup):  # every statement parsed, planned and cached once
        post(client, f"warm-{i}")
        post(client, f"warm-{i}")
    first: dict[str, float] = {}
    replay: dict[str, float] = {}
    with counted(mon, proxy, db, first) as n:
        until = time.monotonic() + args.sustain
        while n[0] < args.requests or time.monotonic() < until:
            post(client, f"key-{n[0]}")
            n[0] += 1
    time.sleep(args.stats_wait)  # a backend reports its table counters when idle
    with counted(mon, proxy, db, replay) as m:
        for i in range(args.requests):
            post(client, f"key-{i}")
            m[0] += 1
    stored = None
    if subject.records is not None:
        with setup.cursor() as cur:
            cur.execute(
                f"SELECT pg_total_relation_size('{subject.records}')::float8 / count(*)"
                f" FROM {subject.records}"
            )
            stored = one(cur)[0]
            cur.execute(
                "SELECT n_tup_hot_upd, n_tup_upd FROM pg_stat_user_tables WHERE relname = %s",
                (subject.records,),
            )
            first["hot_updates"], first["updates"] = map(float, one(cur))
    close()
    setup.close()
    return {"subject": subject.name, "first": first, "replay": replay, "stored_per_key": stored}


def report(results: list[dict[str, Any]]) -> str:
    by = {r["subject"]: r for r in results}
    bare = by.get("bare", {}).get("first", {}).get("wal_bytes")
    lines = [
        "| subject | WAL B | over bare | FPI B | statements (nested) | SET LOCAL | round trips"
        " | COMMITs | replay: WAL B, statements, round trips | stored B/key |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        f, p = r["first"], r["replay"]
        over = f"+{f['wal_bytes'] - bare:.0f}" if bare is not None else "n/a"
        stored = f"{r['stored_per_key']:.0f}" if r["stored_per_key"] else "-"
        lines.append(
            f"| {r['subject']} | {f['wal_bytes']:.0f} | {over} | {f['fpi_bytes']:.0f} "
            f"| {f['statements']:.2f} ({f['nested']:.2f}) | {f['set_local']:.2f} "
            f"| {f['round_trips']:.2f} | {f['commits']:.2f} "
            f"| {p['wal_bytes']:.0f}, {p['statements']:.2f}, {p['round_trips']:.2f} | {stored} |"
        )
    goals = []
    for mode, floor in (
        ("prod-row", "floor-row"),
        ("prod-tx", "floor1"),
        ("prod-sqla", "floor-row"),
    ):
        if mode in by and floor in by and bare is not None:
            ours = by[mode]["first"]["wal_bytes"] - bare
            theirs = by[floor]["first"]["wal_bytes"] - bare
            goals.append(f"{mode}: {ours / theirs:.2f}x {floor}'s added WAL")
    return "\n".join(lines) + ("\n\n" + "; ".join(goals) if goals else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pgcost", description=__doc__)
    parser.add_argument("--subjects", default=",".join(SUBJECTS))
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument(
        "--checkpoint-timeout", type=int, default=0, help="seconds; 0: no checkpoint while counting"
    )
    parser.add_argument(
        "--sustain", type=float, default=0.0, help="seconds of first requests, at least"
    )
    parser.add_argument("--stats-wait", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--bindir", default=None, help="PostgreSQL binaries (15 or later)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from support.postgres_server import ThrowawayPostgres

    settings = dict(SERVER_SETTINGS)
    if args.checkpoint_timeout:
        settings.update(checkpoint_timeout=f"{args.checkpoint_timeout}s", max_wal_size="1GB")
    bindir = args.bindir or next(
        (str(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), None
    )
    results = []
    with ThrowawayPostgres(settings=settings, bindir=bindir) as server:
        mon = Monitor(server.dsn)
        mon.rows("CREATE EXTENSION pg_stat_statements")
        mon.rows("CREATE EXTENSION pg_walinspect")
        proxy = Proxy(server.port)
        for name in args.subjects.split(","):
            results.append(measure(SUBJECTS[name], server, mon, proxy, args))
            f = results[-1]["first"]
            print(
                f"{name}: {f['wal_bytes']:.0f} B WAL ({f['fpi_bytes']:.0f} FPI), "
                f"{f['statements']:.2f} statements, {f['round_trips']:.2f} round trips",
                flush=True,
            )
        mon.conn.close()
        proxy.close()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    print(report(results))


if __name__ == "__main__":
    main()
