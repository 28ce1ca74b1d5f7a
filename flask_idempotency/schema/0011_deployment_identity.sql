-- The identity of this database, for the Redis cache (flask_idempotency/cache/keyring.py).
--
-- Two deployments (two databases) may share one Redis with the same settings,
-- and even the same SECRET_KEY (a staging copy of production). Their cache keys
-- and the key that seals their entries are both derived from this id, so
-- neither ever reads, let alone replays, the other's answers. It is written
-- once, here, and never changes: changing it would only turn every cached entry
-- into a miss. It is not a secret (SECRET_KEY is); it only has to differ
-- between databases, which 128 random bits do. (gen_random_uuid() is core only
-- from PostgreSQL 13; random() and the clock do on 12.)
--
-- Only added: 0.2.x workers never read this table, so a rolling upgrade can
-- apply it while they serve.
CREATE TABLE IF NOT EXISTS idempotency_deployment (
    -- One row only: the primary key can hold nothing but true.
    only_row    boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    id          bytea       NOT NULL CHECK (length(id) = 16),
    created_at  timestamptz NOT NULL DEFAULT now()
);

INSERT INTO idempotency_deployment (id)
VALUES (decode(md5(random()::text || random()::text || clock_timestamp()::text
                   || pg_backend_pid()::text), 'hex'))
ON CONFLICT (only_row) DO NOTHING;
