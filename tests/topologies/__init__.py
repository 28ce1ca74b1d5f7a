"""Deployment topologies: the extension behind the components production runs it with
(read-only servers and failover, PgBouncer, TLS), each started by the tests themselves.
Run by ``make test-topologies`` (marker ``topology``)."""
