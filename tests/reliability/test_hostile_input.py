"""Hostile input: whatever a client sends, a 4xx JSON error or a correct answer, never a 500.

Hypothesis generates requests, and a small reference model of the contract
says what each must get (the order of checks: authentication, key, body
framing and size, then the body itself). Three drivers:

* raw sockets to the real gunicorn, so the requests can carry what no HTTP
  library would send: duplicated key headers, bytes outside ASCII, control
  characters, chunked bodies, a Content-Length that lies;
* the Flask test client, for breadth (many more examples, and inputs that
  gunicorn would have refused itself, which the app must survive too);
* named cases for the request-body size limit (MAX_CONTENT_LENGTH, 64 KiB in
  this stack) and framing.

Every example is sent twice with the same bytes: a stored answer (201, 402)
must come back byte-identical as a replay, any other must be the same error
again. Requests gunicorn refuses at the HTTP level (a control character in a
header, an invalid method token) get gunicorn's own plain 400 page: they never
reach the application, so only the status is checked for them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from example_app import create_app
from example_app.processor_client import InProcessProcessorClient
from example_app.processor_core import FakeProcessor

from .figures import Figures
from .load import RawAnswer, build_request, raw_exchange
from .stack import Stack

pytestmark = pytest.mark.reliability

#: Bounded and repeatable: derandomized, no example database, no deadline (the
#: real stack's latency is not what is under test here).
RAW_SETTINGS = settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
CLIENT_SETTINGS = settings(RAW_SETTINGS, max_examples=400)

VISIBLE = "".join(chr(c) for c in range(0x21, 0x7F))
#: Header-value bytes gunicorn refuses before the app sees the request.
HTTP_FORBIDDEN = [c for c in range(0x00, 0x20) if c not in (0x09, 0x0A, 0x0D)] + [0x7F]
SAFE_TEXT = st.text(
    alphabet=st.characters(
        min_codepoint=0x20, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Cc")
    ),
    min_size=1,
    max_size=64,
)

NON_ASCII = st.characters(
    min_codepoint=0x80, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Cc")
)

_nonces = itertools.count()

HOSTILE_KEYS = ["quoted", "ows", "missing", "empty", "long", "space", "tab", "non_ascii",
                "control", "duplicated", "bad_quoted"]  # fmt: skip


def mostly(draw: st.DrawFn, normal: str, hostile: list[str], *, odds: int = 3) -> str:
    """``normal`` ``odds`` times in ``odds + 1``, else one of ``hostile``: each example
    is hostile in a few ways at once, so that every check of the contract is reached."""
    return normal if draw(st.integers(0, odds)) else draw(st.sampled_from(hostile))


# -- the reference model ------------------------------------------------------------


def reference_key(values: list[bytes], joiner: str) -> str | None:
    """The key a request carries under the contract, or ``None`` if it is invalid.

    Surrounding whitespace is not part of a field value (RFC 9110 §5.5), and a
    server joins repeated lines with commas (§5.3): gunicorn with ``,``, the
    test client with ``, ``. The extension then accepts the sf-string form
    ``"abc"`` as ``abc`` and wants 1..255 visible ASCII characters, one value:
    a comma outside quotes (two lines joined, or one line listing two) is invalid.
    """
    value = joiner.join(v.decode("latin-1").strip(" \t") for v in values)
    if len(value) >= 2 and value[0] == value[-1] == '"':
        out, inner, i = [], value[1:-1], 0
        while i < len(inner):
            if inner[i] == "\\":
                if i + 1 >= len(inner) or inner[i + 1] not in '"\\':
                    return None
                out.append(inner[i + 1])
                i += 2
                continue
            if inner[i] == '"':
                return None
            out.append(inner[i])
            i += 1
        value = "".join(out)
    elif "," in value:
        return None
    if not value or len(value) > 255 or not all(ch in VISIBLE for ch in value):
        return None
    return value


@dataclasses.dataclass(frozen=True)
class Expect:
    """What the contract says a request gets: allowed statuses and, for errors, codes."""

    statuses: frozenset[int]
    codes: frozenset[str] = frozenset()
    #: For a charge: the fields the 201 (or the 402's absence of them) must carry.
    charge: dict[str, Any] | None = None

    @classmethod
    def error(cls, status: int, *codes: str) -> Expect:
        return cls(frozenset({status}), frozenset(codes))


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    target: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    #: "length" (a true Content-Length), "chunked", "short" (declares more than it
    #: sends, then half-closes), "huge" (declares a terabyte).
    framing: str
    #: Whether gunicorn accepts the request at the HTTP level.
    http_ok: bool
    #: Whether the Authorization header names an API key.
    auth_ok: bool
    #: The valid charge the body asks for, if it is one.
    charge: dict[str, Any] | None
    label: str
    expect: Expect = Expect(frozenset())


@st.composite
def key_values(draw: st.DrawFn, nonce: str) -> tuple[str, list[bytes], bool]:
    """(kind, header values, accepted by gunicorn). Valid keys start with a nonce,
    so no two examples share a key unless they mean to."""
    kind = mostly(draw, "valid", HOSTILE_KEYS, odds=1)
    part = draw(st.text(alphabet=VISIBLE, max_size=40))
    if kind == "valid":
        return kind, [(nonce + part).encode()], True
    if kind == "quoted":
        inner = draw(st.text(alphabet=VISIBLE.replace('"', "").replace("\\", ""), max_size=20))
        escaped = draw(st.sampled_from(["", '\\"', "\\\\"]))
        return kind, [f'"{nonce}{inner}{escaped}"'.encode()], True
    if kind == "bad_quoted":
        return kind, [draw(st.sampled_from([f'"{nonce}{part}"x"', f'"{nonce}\\q"'])).encode()], True
    if kind == "ows":
        return kind, [f" \t{nonce}{part} ".encode()], True
    if kind == "missing":
        return kind, [], True
    if kind == "empty":
        return kind, [b""], True
    if kind == "long":
        size = draw(st.integers(256, 600))
        return kind, [(nonce + "k" * size).encode()], True
    if kind == "space":
        return kind, [f"{nonce}a b{part}".encode()], True
    if kind == "tab":
        return kind, [f"{nonce}a\tb".encode()], True
    if kind == "non_ascii":  # one byte of Latin-1, or text in UTF-8
        text = draw(st.text(NON_ASCII, min_size=1, max_size=5))
        raw = bytes([draw(st.integers(0x80, 0xFF))]) if draw(st.booleans()) else text.encode()
        return kind, [nonce.encode() + raw + part.encode()], True
    if kind == "control":
        byte = draw(st.sampled_from(HTTP_FORBIDDEN))
        return kind, [nonce.encode() + bytes([byte]) + part.encode()], False
    second = draw(st.sampled_from(["same", "other"]))
    first = (nonce + part).encode()
    return kind, [first, first if second == "same" else (nonce + "-2").encode()], True


@st.composite
def bodies(draw: st.DrawFn, customer: str) -> tuple[str, bytes, dict[str, Any] | None]:
    """(kind, bytes, the charge it asks for if it is a valid charge)."""
    kind = mostly(
        draw,
        "charge",
        ["decline", "json", "garbage", "deep", "empty", "padded_at_limit", "over_limit",
         "unknown_field"],
    )  # fmt: skip
    amount = draw(st.integers(1, 99_999_999))
    currency = draw(st.sampled_from(["usd", "EUR", "gbp"]))
    charge = {"amount": amount, "currency": currency, "customer": customer, "source": "tok_visa"}
    if kind in ("charge", "decline"):
        if kind == "decline":
            charge["source"] = "tok_decline_" + draw(st.text(VISIBLE, max_size=10))
        if draw(st.booleans()):
            charge["description"] = draw(st.none() | SAFE_TEXT)
        return kind, json.dumps(charge, ensure_ascii=draw(st.booleans())).encode(), charge
    if kind == "unknown_field":
        return kind, json.dumps(charge | {draw(SAFE_TEXT): 1}).encode(), None
    if kind == "json":
        value = draw(
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                allow_infinity=False) | st.text(max_size=20),
                lambda inner: st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                max_leaves=12,
            )
        )  # fmt: skip
        return kind, json.dumps(value).encode(), None
    if kind == "garbage":
        return kind, draw(st.binary(min_size=1, max_size=300)), None
    if kind == "deep":
        depth = draw(st.sampled_from([50, 1_000, 10_000, 30_000]))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        return kind, opener * depth + b"1" + closer * depth, None
    if kind == "empty":
        return kind, b"", None
    encoded = json.dumps(charge).encode()
    size = LIMIT if kind == "padded_at_limit" else draw(st.integers(LIMIT + 1, 4 * LIMIT))
    # Trailing whitespace keeps it the same valid charge, just bigger.
    return kind, encoded + b" " * (size - len(encoded)), charge


LIMIT = 64 * 1024  # the stack's MAX_CONTENT_LENGTH (StackOptions default)
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "application/merge+json"]
OTHER_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"]
BODY_CODES = ("invalid_json", "validation_failed")


@st.composite
def cases(draw: st.DrawFn, api_key: str, customer_prefix: str) -> Case:
    nonce = f"h{next(_nonces)}-"
    customer = customer_prefix + nonce.rstrip("-")
    method = mostly(
        draw, "POST", ["GET", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS", "FOO", "post", "P@ST"]
    )
    target = mostly(draw, "/v1/charges", ["/v1/charges?x=%FF&y", "/v1/charges/", "/v1/nope"])
    key_kind, key_values_, key_http_ok = draw(key_values(nonce))
    auth_kind = mostly(draw, "ok", ["lower", "missing", "basic", "empty", "obs"])
    authorization = {
        "ok": f"Bearer {api_key}".encode(),
        "lower": f"bearer {api_key}".encode(),
        "basic": b"Basic dXNlcjpwYXNz",
        "empty": b"Bearer ",
        "obs": f"Bearer {api_key}\xe9".encode("latin-1"),
        "missing": b"",
    }[auth_kind]
    content_type = mostly(draw, JSON_TYPES[0], [*JSON_TYPES[1:], *OTHER_TYPES])
    body_kind, body, charge = draw(bodies(customer))
    framing = mostly(draw, "length", ["chunked", "short", "huge"])
    if method in ("GET", "HEAD", "OPTIONS"):
        body, body_kind, charge, framing = b"", "none", None, "length"

    headers: list[tuple[bytes, bytes]] = [(b"Content-Type", content_type.encode())]
    if auth_kind != "missing":
        headers.append((b"Authorization", authorization))
    headers += [(b"Idempotency-Key", value) for value in key_values_]
    method_ok = method.isupper() and method.isalpha()
    case = Case(
        method=method,
        target=target,
        headers=tuple(headers),
        body=body,
        framing=framing,
        http_ok=key_http_ok and method_ok,
        auth_ok=auth_kind in ("ok", "lower", "obs"),
        charge=charge,
        label=f"{method} {target} key={key_kind} auth={auth_kind} body={body_kind} "
        f"type={content_type} framing={framing}",
    )
    return dataclasses.replace(case, expect=expected(case, joiner=","))


def declared_length(case: Case) -> int | None:
    return {"length": len(case.body), "short": len(case.body) + 10, "huge": 10**12}.get(
        case.framing
    )


def expected(case: Case, *, joiner: str) -> Expect:
    """The contract's answer for ``case``, in its order of checks."""
    if not case.http_ok:
        return Expect(frozenset({400}))  # gunicorn's own page: never reaches the app
    route = case.target.split("?")[0]
    if route != "/v1/charges":
        return Expect.error(404, "not_found")
    if case.method == "OPTIONS":
        return Expect(frozenset({200}))
    if case.method in ("GET", "HEAD"):
        if not case.auth_ok:
            return Expect.error(401, "missing_api_key")
        return Expect.error(400, "validation_failed")  # no ?customer=
    if case.method != "POST":
        return Expect.error(405, "method_not_allowed")
    if not case.auth_ok:
        return Expect.error(401, "missing_api_key")
    values = [v for n, v in case.headers if n == b"Idempotency-Key"]
    if not values:
        return Expect.error(400, "missing_key")
    if reference_key(values, joiner) is None:
        return Expect.error(400, "invalid_key")
    declared = declared_length(case)
    if (declared is not None and declared > LIMIT) or (
        declared is None and len(case.body) >= LIMIT  # chunked: cut at the limit, refused
    ):
        return Expect.error(413, "request_entity_too_large")
    if case.framing == "short":
        return Expect.error(400, "malformed_body")
    content_type = dict(case.headers)[b"Content-Type"].decode()
    if content_type not in JSON_TYPES:
        return Expect.error(400, "invalid_content_type")
    if case.charge is None:
        return Expect.error(400, *BODY_CODES)
    if str(case.charge["source"]).startswith("tok_decline"):
        return Expect.error(402, "card_declined")
    return Expect(frozenset({201}), charge=case.charge)


# -- sending a case -------------------------------------------------------------------


def encode(case: Case) -> tuple[bytes, bool]:
    """The request's bytes, and whether to half-close after sending them."""
    method, target = case.method.encode(), case.target.encode()
    if case.framing == "chunked":
        chunks = [case.body[i : i + 7000] for i in range(0, len(case.body), 7000)]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        headers = (*case.headers, (b"Transfer-Encoding", b"chunked"))
        return build_request(method, target, headers, framed, content_length=False), False
    if case.framing == "short":
        headers = (*case.headers, (b"Content-Length", str(len(case.body) + 10).encode()))
        return build_request(method, target, headers, case.body, content_length=False), True
    if case.framing == "huge":
        headers = (*case.headers, (b"Content-Length", b"1000000000000"))
        return build_request(method, target, headers, case.body[:100], content_length=False), True
    return build_request(method, target, case.headers, case.body), False


def check(case: Case, answer: RawAnswer, *, from_app: bool) -> None:
    """``answer`` is what the contract says ``case`` gets (``from_app``: it must be the
    app's own JSON, not a server's page)."""
    where = f"{case.label}: got {answer.status} {answer.body[:200]!r}"
    assert answer.status != 0, f"no answer ({answer.error}) for {case.label}"
    assert answer.status < 500, where
    assert answer.status in case.expect.statuses, where
    if not from_app or case.method == "HEAD":
        return
    if answer.status >= 400:
        assert answer.content_type.startswith("application/json"), where
        error = answer.json()["error"]
        assert isinstance(error["type"], str) and isinstance(error["code"], str), where
        if case.expect.codes:
            assert error["code"] in case.expect.codes, where
    if answer.status == 201:
        assert case.expect.charge is not None
        body = answer.json()
        sent = case.expect.charge
        assert body["object"] == "charge" and body["status"] == "succeeded", where
        assert body["amount"] == sent["amount"], where
        assert body["currency"] == sent["currency"].lower(), where
        assert body["customer"] == sent["customer"], where


def check_repeat(case: Case, first: RawAnswer, second: RawAnswer) -> None:
    """The same bytes again: a stored answer replays identically, an error repeats."""
    where = f"{case.label}: {first.status} then {second.status}"
    if first.status in (201, 402) and case.http_ok:
        assert second.status == first.status and second.body == first.body, where
        assert second.headers.get("idempotent-replayed") == "true", where
        assert first.headers.get("idempotent-replayed") == "false", where
    else:
        assert second.status == first.status, where
        if first.content_type.startswith("application/json") and case.method != "HEAD":
            assert second.json()["error"]["code"] == first.json()["error"]["code"], where


# -- the tests --------------------------------------------------------------------------


def test_hostile_requests_over_raw_sockets(
    stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    workers = stack.app.worker_pids()
    seen: Counter[str] = Counter()
    labels: Counter[str] = Counter()

    @RAW_SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(cases(api_key, run_id))
        payload, half_close = encode(case)
        first = raw_exchange("127.0.0.1", stack.app.port, payload, half_close=half_close)
        check(case, first, from_app=case.http_ok)
        second = raw_exchange("127.0.0.1", stack.app.port, payload, half_close=half_close)
        check_repeat(case, first, second)
        seen[f"{first.status}"] += 1
        labels[case.label.split(" key=")[1].split(" ")[0]] += 1

    run()
    calls, charged = stack.processor_counts(run_id)
    figures(
        examples=sum(seen.values()),
        requests_sent=2 * sum(seen.values()),
        first_answers=dict(sorted(seen.items())),
        key_header_kinds=dict(sorted(labels.items())),
        server_errors=sum(n for status, n in seen.items() if status.startswith("5")),
        charges=sum(charged.values()),
        keys_charged_twice=sum(1 for n in charged.values() if n > 1),
        workers_restarted=len(set(workers) - set(stack.app.worker_pids())),
    )
    assert all(n <= 1 for n in charged.values()), "a key was charged twice"
    assert all(n == 1 for n in calls.values()), "the processor was called twice for a key"
    assert stack.app.worker_pids() == workers, "a worker died"
    assert stack.healthy()


def test_every_kind_of_key_header_once(
    stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    """Each kind the generator knows, pinned (Hypothesis may not draw all of them), and
    the equivalences the contract implies: ``"k"`` and `` k `` are the key ``k``."""
    n = f"{run_id}pin-"
    kinds: dict[str, list[bytes]] = {
        "valid": [f"{n}valid".encode()],
        "quoted": [f'"{n}quoted"'.encode()],
        "quoted with escapes": [f'"{n}q\\"\\\\"'.encode()],
        "ows": [f" \t{n}ows ".encode()],
        "missing": [],
        "empty": [b""],
        "long": [(n + "k" * 256).encode()],
        "space": [f"{n}a b".encode()],
        "tab": [f"{n}a\tb".encode()],
        "latin-1": [n.encode() + b"\xe9"],
        "utf-8": [f"{n}\u20ac".encode()],
        "control": [n.encode() + b"\x01"],
        "duplicated": [f"{n}dup".encode(), f"{n}dup".encode()],
        "bad quoted": [f'"{n}a"b"'.encode()],
        "bad escape": [f'"{n}\\q"'.encode()],
    }
    auth = (b"Authorization", f"Bearer {api_key}".encode())
    json_type = (b"Content-Type", b"application/json")
    got: dict[str, int] = {}
    for i, (kind, values) in enumerate(kinds.items()):
        charge = {"amount": 10 + i, "currency": "usd", "customer": f"{n}{i}", "source": "tok_visa"}
        case = Case(
            method="POST",
            target="/v1/charges",
            headers=(auth, json_type, *[(b"Idempotency-Key", v) for v in values]),
            body=json.dumps(charge).encode(),
            framing="length",
            http_ok=kind != "control",
            auth_ok=True,
            charge=charge,
            label=f"key={kind}",
        )
        case = dataclasses.replace(case, expect=expected(case, joiner=","))
        payload, _ = encode(case)
        first = raw_exchange("127.0.0.1", stack.app.port, payload)
        check(case, first, from_app=case.http_ok)
        check_repeat(case, first, raw_exchange("127.0.0.1", stack.app.port, payload))
        got[kind] = first.status

    # The same key written three ways is one key: the later ones replay the first.
    same = [f"{n}same".encode(), f'"{n}same"'.encode(), f"  {n}same\t".encode()]
    body = json.dumps({"amount": 1, "currency": "usd", "customer": f"{n}s", "source": "tok_visa"})
    answers = [
        raw_exchange(
            "127.0.0.1",
            stack.app.port,
            build_request(b"POST", b"/v1/charges", (auth, json_type, (b"Idempotency-Key", v)),
                          body.encode()),
        )
        for v in same
    ]  # fmt: skip
    figures(**got, spellings_of_one_key=[a.headers.get("idempotent-replayed") for a in answers])
    assert [a.headers.get("idempotent-replayed") for a in answers] == ["false", "true", "true"]
    assert len({a.body for a in answers}) == 1


@pytest.fixture
def client_app(stack: Stack) -> Iterator[Flask]:
    """The same app in process on the stack's database, for the test client."""
    app = create_app(
        {
            "TESTING": False,  # errors must be rendered as in production, not raised
            "DATABASE_URL": stack.database_url,
            "REDIS_URL": None,
            "PROCESSOR_URL": None,
            "PROCESSOR_CLIENT": InProcessProcessorClient(FakeProcessor(), 5.0),
            "MAX_CONTENT_LENGTH": LIMIT,
        }
    )
    yield app
    app.extensions["idempotency"].close()


def test_hostile_requests_through_the_test_client(
    client_app: Flask, api_key: str, run_id: str, figures: Figures
) -> None:
    client = client_app.test_client()
    seen: Counter[int] = Counter()

    @CLIENT_SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(cases(api_key, run_id))
        # The test client is not gunicorn: what gunicorn would refuse reaches the app
        # here (control characters in the key, any method), and it must cope.
        case = dataclasses.replace(
            case, method=case.method.upper().replace("@", "O"), http_ok=True, framing="length"
        )
        case = dataclasses.replace(case, expect=expected(case, joiner=", "))
        path, _, query = case.target.partition("?")
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in case.headers]
        answers = []
        for _ in range(2):
            response = client.open(
                path, method=case.method, query_string=query, headers=headers, data=case.body
            )
            answers.append(
                RawAnswer(
                    response.status_code,
                    {k.lower(): v for k, v in response.headers.items()},
                    response.get_data(),
                )
            )
        check(case, answers[0], from_app=True)
        check_repeat(case, answers[0], answers[1])
        seen[answers[0].status] += 1

    run()
    figures(
        examples=sum(seen.values()),
        first_answers=dict(sorted(seen.items())),
        server_errors=sum(n for status, n in seen.items() if status >= 500),
    )


def test_body_size_limit_and_framing(
    stack: Stack, api_key: str, run_id: str, figures: Figures
) -> None:
    """MAX_CONTENT_LENGTH (64 KiB here) and broken framing, case by case: a refused body
    claims nothing (the key stays free) and never reaches the processor."""
    workers = stack.app.worker_pids()
    auth = (b"Authorization", f"Bearer {api_key}".encode())
    json_type = (b"Content-Type", b"application/json")

    def charge(name: str, size: int | None = None) -> bytes:
        encoded = json.dumps(
            {"amount": 100, "currency": "usd", "customer": run_id + name, "source": "tok_visa"}
        ).encode()
        return encoded if size is None else encoded + b" " * (size - len(encoded))

    def post(name: str, body: bytes, *extra: tuple[bytes, bytes], **options: Any) -> RawAnswer:
        headers = (auth, json_type, (b"Idempotency-Key", f"{run_id}{name}".encode()), *extra)
        content_length = options.pop("content_length", True)
        data = build_request(b"POST", b"/v1/charges", headers, body, content_length=content_length)
        return raw_exchange("127.0.0.1", stack.app.port, data, **options)

    def chunked(body: bytes) -> bytes:
        return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)

    te = (b"Transfer-Encoding", b"chunked")
    results = {
        "at the limit": post("at", charge("at", LIMIT)),
        "one byte over": post("over", charge("over", LIMIT + 1)),
        "declares a terabyte": post(
            "tera", b"{}", (b"Content-Length", b"1000000000000"), content_length=False,
            half_close=True,
        ),
        "chunked under the limit": post(
            "chunked-ok", chunked(charge("chunked-ok", LIMIT - 1)), te, content_length=False
        ),
        "chunked at the limit": post(
            "chunked-big", chunked(charge("chunked-big", LIMIT)), te, content_length=False
        ),
        "chunk size not hex": post(
            "chunked-bad", b"zz\r\n" + charge("chunked-bad") + b"\r\n0\r\n\r\n", te,
            content_length=False,
        ),
        "body cut short": post(
            "short", charge("short"), (b"Content-Length", b"400"), content_length=False,
            half_close=True,
        ),
        "8 KiB key header": post("huge-key" + "k" * 8192, charge("huge-key")),
        "200 extra headers": post(
            "many", charge("many"), *[(b"X-Pad-%d" % i, b"x") for i in range(200)]
        ),
    }  # fmt: skip
    refused_calls, _ = stack.processor_counts(run_id)
    # The refused requests claimed nothing: the same keys now charge normally.
    retried = {
        name: post(key, charge(key))
        for name, key in [("one byte over", "over"), ("body cut short", "short"),
                          ("chunk size not hex", "chunked-bad")]
    }  # fmt: skip
    # Repeated key lines are one comma-joined value (RFC 9110 §5.3): two keys, not one,
    # refused as the same value sent on one line is; neither claims anything.
    joined_first = post("dup-a", charge("dup"), (b"Idempotency-Key", f"{run_id}dup-b".encode()))
    headers = (auth, json_type, (b"Idempotency-Key", f"{run_id}dup-a,{run_id}dup-b".encode()))
    joined_again = raw_exchange(
        "127.0.0.1", stack.app.port, build_request(b"POST", b"/v1/charges", headers, charge("dup"))
    )
    figures(
        **{name: answer.status for name, answer in results.items()},
        retried_after_refusal={name: a.status for name, a in retried.items()},
        duplicated_key_lines=f"{joined_first.status} then {joined_again.status} "
        f"replayed={joined_again.headers.get('idempotent-replayed')}",
        workers_restarted=len(set(workers) - set(stack.app.worker_pids())),
    )

    def error_code(answer: RawAnswer) -> str:
        return str(answer.json()["error"]["code"])

    assert results["at the limit"].status == 201
    assert results["chunked under the limit"].status == 201
    for name in ("one byte over", "declares a terabyte", "chunked at the limit"):
        assert results[name].status == 413, name
        assert error_code(results[name]) == "request_entity_too_large", name
    for name in ("chunk size not hex", "body cut short"):
        assert results[name].status == 400, name
        assert error_code(results[name]) == "malformed_body", name
    for name in ("8 KiB key header", "200 extra headers"):
        assert 400 <= results[name].status < 500, name  # gunicorn's own limits
    for name in ("over", "tera", "chunked-big", "chunked-bad", "short"):
        assert refused_calls[run_id + name] == 0, f"{name} reached the processor"
    for name, answer in retried.items():
        assert (answer.status, answer.headers.get("idempotent-replayed")) == (201, "false"), name
    for answer in (joined_first, joined_again):
        assert answer.status == 400 and error_code(answer) == "invalid_key"
    assert stack.app.worker_pids() == workers and stack.healthy()
