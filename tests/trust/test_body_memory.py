"""The extension's memory stays bounded whatever the body's size (contract section 7).

With ``MAX_CONTENT_LENGTH`` unset, as in the quickstart, a 300 MiB upload
(multipart with a Content-Length, and a chunked body without one) goes to a
gunicorn worker once through an undecorated view and once through the same view
decorated, each on a fresh worker. The worker's peak resident memory (``VmHWM``)
grows by a few MiB more with the extension at most: the body is hashed as it
arrives and spooled to a temporary file, as Werkzeug spools uploads, rather than
held whole (it was: 301 MiB more for the multipart upload, 298 for the chunked).
"""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from support.servers import GunicornFactory, GunicornServer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the worker's peak memory from /proc"
)

MIB = 1024 * 1024
#: The finding's size.
BODY_SIZE = 300 * MIB
#: "A few MiB": what the decorated worker's peak may exceed the undecorated one's by.
ALLOWANCE = 8 * MIB
BLOCK = bytes(range(256)) * (MIB // 256)
BOUNDARY = "trust-boundary"
#: The view that reads each framing: the upload's file, or the raw stream.
VIEWS = {"multipart": "files", "chunked": "stream"}


def kib_field(pid: int, name: str) -> int:
    """A ``/proc/<pid>/status`` memory field, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {name} in /proc/{pid}/status")


def multipart() -> tuple[list[bytes], int, str]:
    """A multipart body with one 300 MiB file: its parts (the file's blocks shared),
    its length and its Content-Type."""
    head = (
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="upload"; filename="big.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{BOUNDARY}--\r\n".encode()
    parts = [head, *[BLOCK] * (BODY_SIZE // MIB), tail]
    return parts, sum(map(len, parts)), f"multipart/form-data; boundary={BOUNDARY}"


def upload(server: GunicornServer, path: str, framing: str, key: str | None) -> Any:
    """Send the 300 MiB body, block by block, and return the view's JSON answer."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    try:
        conn.putrequest("POST", path)
        if key is not None:
            conn.putheader("Idempotency-Key", key)
        if framing == "multipart":
            parts, length, content_type = multipart()
            conn.putheader("Content-Type", content_type)
            conn.putheader("Content-Length", str(length))
            conn.endheaders()
            for part in parts:
                conn.send(part)
        else:
            conn.putheader("Content-Type", "application/octet-stream")
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for _ in range(BODY_SIZE // MIB):
                conn.send(b"%x\r\n%s\r\n" % (len(BLOCK), BLOCK))
            conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        body = response.read()
        assert response.status == 201, (response.status, body[:500])
        return json.loads(body)
    finally:
        conn.close()


def warm(server: GunicornServer) -> None:
    """One small request through each view: imports, the pool's connection and the
    claim's first statements are paid before memory is measured."""
    for path, key in (("/plain/read/stream", None), ("/read/stream", "warm-up")):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        headers = {"Content-Type": "application/octet-stream"}
        if key is not None:
            headers["Idempotency-Key"] = key
        conn.request("POST", path, body=b"warm", headers=headers)
        assert conn.getresponse().status == 201
        conn.close()


def peak_growth(
    gunicorn_server: GunicornFactory, database_url: str, path: str, framing: str, key: str | None
) -> int:
    """How far above its resting size one upload takes a fresh worker's memory."""
    server = gunicorn_server(
        "trust.trust_app:create_app()",
        env={"DATABASE_URL": database_url},
        extra_args=["--timeout", "300"],
    )
    warm(server)
    (worker,) = server.worker_pids()
    resting = kib_field(worker, "VmRSS")
    answer = upload(server, path, framing, key)
    growth = kib_field(worker, "VmHWM") - resting
    server.close()
    seen = answer["files"]["upload"]["size"] if framing == "multipart" else answer["size"]
    assert seen == BODY_SIZE
    print(f"{framing} {path}: peak {growth / MIB:.1f} MiB over resting")
    return growth


@pytest.mark.parametrize("framing", ["multipart", "chunked"])
def test_a_300_mib_body_costs_the_worker_a_few_mib_more_than_without_the_extension(
    gunicorn_server: GunicornFactory, clean_db: str, framing: str
) -> None:
    api = VIEWS[framing]
    plain = peak_growth(gunicorn_server, clean_db, f"/plain/read/{api}", framing, None)
    decorated = peak_growth(gunicorn_server, clean_db, f"/read/{api}", framing, "big-1")
    assert decorated - plain < ALLOWANCE, (
        f"{framing}: decorated peak +{decorated / MIB:.1f} MiB, undecorated +{plain / MIB:.1f} MiB"
    )
