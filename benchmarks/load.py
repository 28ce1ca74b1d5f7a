"""Load generation in a process of its own: ``wrk`` when installed, else Python.

The server under test and the load generator share the machine's two cores,
so the generator must be cheap and separate: a generator in the runner's own
process would fight the runner (and its GIL) for CPU. ``wrk`` costs a few
microseconds per request and is preferred; the Python fallback (this module
run as ``python -m benchmarks.load``) keeps N keep-alive ``http.client``
connections in threads, bounded by a duration and a request count, and
records every request's latency. Python's own cost per request is higher, so
its absolute numbers are lower and its ratios slightly compressed towards 1;
the report says which generator produced it.

Three kinds of load, each a key pattern:

``first``  a fresh ``Idempotency-Key`` per request (the claim, the view, the completion);
``replay`` keys cycled from a file of keys completed beforehand (stored responses);
``hot``    one key shared by every connection, changing each wall-clock second:
           one request executes, its concurrent duplicates get 409s, the rest replays.
``noop``   ``GET /healthz``: no idempotency, no database, on the same servers. It is
           the framework's own cost, so the ceiling of any ratio to ``bare``.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .app import CHARGES_PATH, HEALTH_PATH, REQUEST_BODY

PATHS: tuple[str, ...] = ("first", "replay", "hot", "noop")
TOOLS: tuple[str, ...] = ("auto", "wrk", "python")

#: A request slower than this counts as an error rather than a latency: a cell
#: must end near its duration even if a server hangs.
REQUEST_TIMEOUT = 10.0

#: Upper bound on requests recorded by the Python generator per cell (memory
#: for the latencies, and a cap should a cell's duration be set absurdly long).
DEFAULT_MAX_REQUESTS = 500_000

_RESULT_MARK = "BENCH_RESULT "

#: wrk's script. Each wrk thread runs its own Lua state: ``setup`` (in the main
#: state) numbers the threads, ``init`` reads the arguments given after ``--``
#: (path kind, key prefix, keys file), ``request`` builds each request with its
#: key, ``response`` counts statuses, and ``done`` gathers every thread's counts
#: and prints one JSON line for the runner.
WRK_SCRIPT = r"""
local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("tid", next_id)
  table.insert(threads, thread)
end

local kind, prefix
local keys = {}
local counter = 0
local position = 0
statuses = {}
local headers = {["Content-Type"] = "application/json"}
local body = BODY

function init(args)
  kind, prefix = args[1], args[2]
  if kind == "replay" then
    for line in io.lines(args[3]) do
      if line ~= "" then keys[#keys + 1] = line end
    end
    position = (tid * 7919) % #keys
  end
end

local noop_request = nil

function request()
  if kind == "noop" then
    noop_request = noop_request or wrk.format("GET", HEALTH)
    return noop_request
  end
  local key
  if kind == "first" then
    counter = counter + 1
    key = prefix .. "-" .. tid .. "-" .. counter
  elseif kind == "replay" then
    position = position % #keys + 1
    key = keys[position]
  else
    key = prefix .. "-" .. os.time()
  end
  headers["Idempotency-Key"] = key
  return wrk.format("POST", PATH, headers, body)
end

function response(status, hdrs, resp_body)
  local k = tostring(status)
  statuses[k] = (statuses[k] or 0) + 1
end

function done(summary, latency, requests)
  local merged = {}
  for _, thread in ipairs(threads) do
    local counts = thread:get("statuses")
    for k, v in pairs(counts) do merged[k] = (merged[k] or 0) + v end
  end
  local parts = {}
  for k, v in pairs(merged) do parts[#parts + 1] = string.format('"%s": %d', k, v) end
  local e = summary.errors
  io.write(string.format(
    'MARK{"requests": %d, "seconds": %.6f, "p50_us": %d, "p99_us": %d, ' ..
    '"errors": %d, "statuses": {%s}}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, table.concat(parts, ", ")))
end
"""


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """One measurement cell: where, which kind of load, how much, for how long."""

    url: str
    path: str
    connections: int
    duration: float
    key_prefix: str
    keys_file: Path | None = None
    max_requests: int = DEFAULT_MAX_REQUESTS

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"unknown path {self.path!r}; choose from {', '.join(PATHS)}")
        if self.path == "replay" and self.keys_file is None:
            raise ValueError("a replay load needs a file of completed keys")
        if self.connections < 1 or self.duration <= 0:
            raise ValueError("connections and duration must be positive")


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What one cell measured. Latencies in milliseconds; ``errors`` are
    transport failures (connect, read, timeout), not HTTP statuses."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    statuses: dict[str, int]
    tool: str

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "rps": self.rps}


def choose_tool(preference: str = "auto") -> str:
    """``wrk`` if asked for or found on PATH (``auto``), else ``python``."""
    if preference not in TOOLS:
        raise ValueError(f"unknown load tool {preference!r}")
    if preference == "wrk" and shutil.which("wrk") is None:
        raise RuntimeError("wrk was asked for but is not on PATH")
    if preference == "auto":
        return "wrk" if shutil.which("wrk") else "python"
    return preference


def run_load(spec: LoadSpec, tool: str) -> LoadResult:
    """Run one cell in a separate process and return what it measured."""
    if tool == "wrk":
        return _run_wrk(spec)
    return _run_python(spec)


def _run_wrk(spec: LoadSpec) -> LoadResult:
    script = (
        WRK_SCRIPT.replace("BODY", _lua_string(REQUEST_BODY.decode()))
        .replace("PATH", _lua_string(CHARGES_PATH))
        .replace("HEALTH", _lua_string(HEALTH_PATH))
    )
    script = script.replace("MARK", _RESULT_MARK)
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
        script_path = Path(tmp) / "load.lua"
        script_path.write_text(script)
        argv = [
            "wrk",
            f"--threads={min(spec.connections, 2)}",
            f"--connections={spec.connections}",
            f"--duration={max(1, round(spec.duration))}s",
            f"--timeout={int(REQUEST_TIMEOUT)}s",
            f"--script={script_path}",
            spec.url,
            "--",
            spec.path,
            spec.key_prefix,
            str(spec.keys_file or ""),
        ]
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=spec.duration + 60, check=False
        )
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip()}")
    raw = _parse_result(proc.stdout)
    return LoadResult(
        requests=int(raw["requests"]),
        seconds=float(raw["seconds"]),
        p50_ms=raw["p50_us"] / 1000.0,
        p99_ms=raw["p99_us"] / 1000.0,
        errors=int(raw["errors"]),
        statuses={str(k): int(v) for k, v in raw["statuses"].items()},
        tool="wrk",
    )


def _run_python(spec: LoadSpec) -> LoadResult:
    argv = [
        sys.executable,
        "-m",
        "benchmarks.load",
        "--url", spec.url,
        "--path", spec.path,
        "--connections", str(spec.connections),
        "--duration", str(spec.duration),
        "--key-prefix", spec.key_prefix,
        "--max-requests", str(spec.max_requests),
    ]  # fmt: skip
    if spec.keys_file is not None:
        argv += ["--keys-file", str(spec.keys_file)]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=spec.duration + 60, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode}): {proc.stderr.strip()}")
    raw = _parse_result(proc.stdout)
    return LoadResult(
        requests=int(raw["requests"]),
        seconds=float(raw["seconds"]),
        p50_ms=float(raw["p50_ms"]),
        p99_ms=float(raw["p99_ms"]),
        errors=int(raw["errors"]),
        statuses={str(k): int(v) for k, v in raw["statuses"].items()},
        tool="python",
    )


def _lua_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _parse_result(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(_RESULT_MARK) :])
            return result
    raise RuntimeError(f"no result line in the load generator's output:\n{stdout[-2000:]}")


# -- the Python generator (runs in its own process) ---------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


class _Budget:
    """The cell's request count, shared by the connection threads."""

    def __init__(self, limit: int) -> None:
        self._left = limit
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._left <= 0:
                return False
            self._left -= 1
            return True


def _keys_for(spec: LoadSpec, worker: int) -> Any:
    """An endless iterator of keys for one connection."""
    if spec.path == "first":
        n = 0
        while True:
            n += 1
            yield f"{spec.key_prefix}-{worker}-{n}"
    elif spec.path == "replay":
        assert spec.keys_file is not None
        keys = [k for k in spec.keys_file.read_text().splitlines() if k]
        position = (worker * 7919) % len(keys)
        while True:
            position = (position + 1) % len(keys)
            yield keys[position]
    elif spec.path == "hot":
        while True:
            yield f"{spec.key_prefix}-{int(time.time())}"
    else:  # noop sends no key
        while True:
            yield ""


def _connection_loop(
    spec: LoadSpec,
    worker: int,
    start: threading.Barrier,
    deadline: list[float],
    budget: _Budget,
    latencies: list[float],
    statuses: Counter[str],
    errors: list[int],
) -> None:
    parts = urlsplit(spec.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
    conn.connect()  # before the clock starts: the cell measures requests, not connects
    headers = {"Content-Type": "application/json", "Idempotency-Key": ""}
    keys = _keys_for(spec, worker)
    start.wait()
    end = deadline[0]
    clock = time.perf_counter
    while clock() < end and budget.take():
        headers["Idempotency-Key"] = next(keys)
        began = clock()
        try:
            if spec.path == "noop":
                conn.request("GET", HEALTH_PATH)
            else:
                conn.request("POST", CHARGES_PATH, REQUEST_BODY, headers)
            response = conn.getresponse()
            response.read()
        except (OSError, http.client.HTTPException):
            errors[0] += 1
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
            continue
        latencies.append(clock() - began)
        statuses[str(response.status)] += 1
        if response.will_close:
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
    conn.close()


def generate(spec: LoadSpec) -> dict[str, Any]:
    """Drive ``spec.connections`` keep-alive connections until the duration or
    the request budget runs out; return the cell's figures as plain data."""
    start = threading.Barrier(spec.connections + 1)
    deadline = [0.0]
    budget = _Budget(spec.max_requests)
    per_thread: list[list[float]] = [[] for _ in range(spec.connections)]
    statuses: list[Counter[str]] = [Counter() for _ in range(spec.connections)]
    errors = [[0] for _ in range(spec.connections)]
    threads = [
        threading.Thread(
            target=_connection_loop,
            args=(spec, i, start, deadline, budget, per_thread[i], statuses[i], errors[i]),
            daemon=True,
        )
        for i in range(spec.connections)
    ]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    deadline[0] = began + spec.duration
    start.wait()
    for thread in threads:
        thread.join(spec.duration + REQUEST_TIMEOUT + 5)
    seconds = time.perf_counter() - began
    latencies = sorted(x for chunk in per_thread for x in chunk)
    merged: Counter[str] = Counter()
    for counts in statuses:
        merged.update(counts)
    return {
        "requests": len(latencies),
        "seconds": seconds,
        "p50_ms": percentile(latencies, 50) * 1000.0,
        "p99_ms": percentile(latencies, 99) * 1000.0,
        "errors": sum(e[0] for e in errors),
        "statuses": dict(merged),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.load", description="The Python load generator (one cell)."
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--path", choices=PATHS, required=True)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--key-prefix", required=True)
    parser.add_argument("--keys-file", type=Path)
    parser.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS)
    args = parser.parse_args(argv)
    spec = LoadSpec(
        url=args.url,
        path=args.path,
        connections=args.connections,
        duration=args.duration,
        key_prefix=args.key_prefix,
        keys_file=args.keys_file,
        max_requests=args.max_requests,
    )
    print(_RESULT_MARK + json.dumps(generate(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
