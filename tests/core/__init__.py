"""The extension's semantics against real PostgreSQL: the contract's rows, scopes, claim modes,
leases and takeover, concurrency through gunicorn, outages and store errors, round trips and
query plans, the CLI and recovery."""
