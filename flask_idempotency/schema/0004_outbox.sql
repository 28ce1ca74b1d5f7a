-- flask-idempotency: the transactional outbox (flask_idempotency/events).
-- idempotency.emit() inserts a row in the transaction that also stores the
-- request's answer (or a consumer's completion): an attempt that is released,
-- rolled back or fenced leaves no row, and a replay writes none. The relay
-- (`flask idempotency relay`) publishes pending rows and marks them.
CREATE TABLE IF NOT EXISTS idempotency_outbox (
    -- 'evt_' + 32 hex digits of SHA-256 over the record key, the fencing token of
    -- the attempt that committed and the event's position in it (random when
    -- emitted outside a record). Every publish of the row carries it as its
    -- message id, so consumers recognise a re-publish.
    id            text        PRIMARY KEY,
    -- Emission order: the relay publishes oldest first.
    seq           bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
    -- The record the event came from; NULL outside one (keyless route, transaction()).
    record_key    bytea,
    -- keys.derived_key(record_key, 'events'): downstream systems correlate on it.
    derived_key   text,
    event_type    text        NOT NULL,
    payload       jsonb       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- The relay leaves the row alone until then (backoff after the broker
    -- returned it as unroutable, or refused it).
    available_at  timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz,
    -- Publishes tried: 1 for a row published at the first try.
    attempts      integer     NOT NULL DEFAULT 0,
    -- `flask idempotency purge` deletes a published row after this (its own TTL,
    -- by default its record's). A pending row is never purged.
    expires_at    timestamptz NOT NULL
);

-- The relay's batch: pending rows in emission order, FOR UPDATE SKIP LOCKED.
-- Partial, so it holds only what is still to publish and stays small.
CREATE INDEX IF NOT EXISTS idempotency_outbox_pending_idx
    ON idempotency_outbox (seq) WHERE published_at IS NULL;

-- purge walks published rows past their expiry.
CREATE INDEX IF NOT EXISTS idempotency_outbox_purge_idx
    ON idempotency_outbox (expires_at) WHERE published_at IS NOT NULL;
