"""One key value per request (contract sections 1 and 7).

Two ``Idempotency-Key`` lines are joined by the server into one value with a
comma (gunicorn ``a,b``, Werkzeug ``a, b``), which was accepted as the key
``a,b``: a later retry carrying only ``a`` then ran the view again. An unquoted
comma is now ``400 invalid_key``, nothing claimed; the Structured-Field string
``"abc"`` is ``abc``, and inside its quotes a comma belongs to the key.
"""

from __future__ import annotations

import json
import socket

import pytest

from flask_idempotency.errors import InvalidKey
from flask_idempotency.keys import parse_key
from support.pg_query import query
from support.servers import GunicornFactory, GunicornServer


@pytest.mark.parametrize(
    ("raw", "key"),
    [("abc", "abc"), ('"abc"', "abc"), ('"a,b"', "a,b"), ('" a, b "', None), ('"a\\",b"', 'a",b')],
)
def test_a_quoted_key_may_hold_a_comma(raw: str, key: str | None) -> None:
    if key is None:  # a space is never part of a key, quoted or not
        with pytest.raises(InvalidKey):
            parse_key(raw)
    else:
        assert parse_key(raw) == key


@pytest.mark.parametrize("raw", ["a,b", "a, b", "a,", ",a", '"a","b"', '"a",b', 'a,"b"', ","])
def test_an_unquoted_comma_is_two_values(raw: str) -> None:
    with pytest.raises(InvalidKey):
        parse_key(raw)


def raw_post(
    server: GunicornServer, key_lines: list[str], body: bytes = b"{}"
) -> tuple[int, str, str]:
    """POST /read/data with the given ``Idempotency-Key`` lines, as they go on the wire:
    the status, the header block and the body."""
    head = ["POST /read/data HTTP/1.1", f"Host: {server.host}", "Connection: close"]
    head += [f"Idempotency-Key: {line}" for line in key_lines]
    head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    head_block, _, body_bytes = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), head_block.decode().lower(), body_bytes.decode()


def test_two_key_lines_are_invalid_under_gunicorn(
    gunicorn_server: GunicornFactory, clean_db: str
) -> None:
    server = gunicorn_server("trust.trust_app:create_app()", env={"DATABASE_URL": clean_db})
    status, _, body = raw_post(server, ["a", "b"])
    assert status == 400
    assert json.loads(body)["error"]["code"] == "invalid_key"
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(0,)]
    # The first line alone is a key of its own, never claimed by the refused request.
    assert raw_post(server, ["a"])[0] == 201
    assert raw_post(server, ["a, b"])[0] == 400  # one line listing two values
    # Quoted, the comma is the key's: stored once, replayed to the same quoted key.
    first = raw_post(server, ['"a,b"'])
    assert first[0] == 201 and "idempotent-replayed: false" in first[1]
    retry = raw_post(server, ['"a,b"'])
    assert retry[0] == 201 and "idempotent-replayed: true" in retry[1]
    assert query(clean_db, "SELECT count(*) FROM idempotency_records") == [(2,)]
