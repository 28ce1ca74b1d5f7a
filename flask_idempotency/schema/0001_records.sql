-- flask-idempotency: one row per (scope, client key), claimed with INSERT ... ON CONFLICT.
-- record_key is SHA-256(scope, key): a leaked table reveals no client keys.
CREATE TABLE IF NOT EXISTS idempotency_records (
    record_key        bytea       PRIMARY KEY,
    fingerprint       bytea       NOT NULL,
    state             text        NOT NULL CHECK (state IN ('processing', 'completed')),
    -- Fencing token of the current holder; a completion must present it.
    lock_token        bigint,
    lease_expires_at  timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    expires_at        timestamptz NOT NULL,
    completed_at      timestamptz,
    status_code       smallint,
    headers           jsonb,
    body              bytea,
    -- How many times an expired lease was taken over (for operators).
    takeovers         integer     NOT NULL DEFAULT 0
);

-- purge walks expired rows in batches, oldest first.
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at_idx
    ON idempotency_records (expires_at);

-- Completion with fencing in one statement: it refuses (and so aborts the
-- surrounding business transaction) unless the caller still holds the lease.
CREATE OR REPLACE FUNCTION idempotency_complete(
    p_record_key bytea, p_token bigint, p_status smallint, p_headers jsonb, p_body bytea
) RETURNS double precision
LANGUAGE plpgsql AS $$
DECLARE
    remaining double precision;
BEGIN
    UPDATE idempotency_records
       SET state = 'completed', status_code = p_status, headers = p_headers, body = p_body,
           completed_at = now(), lock_token = NULL, lease_expires_at = NULL
     WHERE record_key = p_record_key AND lock_token = p_token AND state = 'processing'
     RETURNING extract(epoch FROM expires_at - now()) INTO remaining;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency lease lost' USING ERRCODE = 'IK409';
    END IF;
    RETURN remaining;
END
$$;
