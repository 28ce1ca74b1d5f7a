-- Less PostgreSQL work per first request: completions and lease renewals as
-- HOT (heap-only) updates, and no CHECK expression to read back per statement.
--
-- An UPDATE that changes no column named by any index of the table (as a key or
-- in a WHERE) can keep the new row version on its page and write no index
-- entry. The completion changed four such columns: state, lease_expires_at and
-- recovery (the recoverable-claims index of 0006) and expires_at (the purge's
-- index). So every first request wrote a new entry into each index of the table,
-- left a dead one behind for vacuum, and cost PostgreSQL more than a layer that
-- updates only the answer's columns.

-- 1. The completer's index is keyed on record_key, which never changes, with
--    recovery alone in its WHERE. recovery is NULL before and after the
--    completion of every route without recover=, so those completions no longer
--    touch it. recovery IS NOT NULL only while a recover= attempt is in flight
--    or abandoned (the completion, the completer's hand-back and a new
--    request's claim clear it), so the index still holds a few rows, and the
--    completer sorts them by lease itself.
--    Building it reads the whole table once, and claims wait for it: on a large
--    table apply this migration at a quiet time (docs/deployment.md).
CREATE INDEX IF NOT EXISTS idempotency_records_recovery_idx
    ON idempotency_records (record_key) WHERE recovery IS NOT NULL;
DROP INDEX IF EXISTS idempotency_records_recoverable_idx;

-- 2. The completion leaves expires_at as the claim set it unless the view ran
--    longer than a tenth of the record's TTL. A record lives its TTL from its
--    first request, as before 0003; an answer stored late in that span (a slow
--    view, one renewed past its TTL) still lives at least nine tenths of the
--    TTL after it is stored, so a client's prompt retry is answered from it.
--    expires_at - created_at is the TTL (or more, if renewals pushed it out).
--    flask_idempotency/store/sql.py (COMPLETE_BODY) runs the same UPDATE
--    prepared; keep the two SET lists the same.
CREATE OR REPLACE FUNCTION idempotency_complete(
    p_record_key bytea, p_token bigint, p_status smallint, p_headers jsonb, p_body bytea
) RETURNS double precision
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    remaining double precision;
BEGIN
    UPDATE idempotency_records
       SET state = 'completed', status_code = p_status, headers = p_headers, body = p_body,
           completed_at = now(), lock_token = NULL, lease_expires_at = NULL,
           expires_at = greatest(expires_at, now() + (expires_at - created_at) * 0.9),
           recovery = NULL, phases = NULL
     WHERE record_key = p_record_key AND lock_token = p_token AND state = 'processing'
     RETURNING extract(epoch FROM expires_at - now()) INTO remaining;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency lease lost' USING ERRCODE = 'IK409';
    END IF;
    RETURN remaining;
END
$$;

-- 3. Room on each page for the completions of the records just claimed there.
--    A HOT update must fit on its row's page, and a completed record is larger
--    than its claim (the answer). Inserts fill pages to 80% only; the rest is
--    left to the updates of the rows on them. Applies to pages filled from now
--    on; nothing is rewritten.
ALTER TABLE idempotency_records SET (fillfactor = 80);

-- 4. No CHECK on state. PostgreSQL reads a CHECK constraint's expression back
--    from its stored text for every INSERT and UPDATE statement (it is not
--    cached across statements), and for this one that was about a tenth of the
--    database work of a first request. Only the extension's own statements
--    write state, always 'processing' or 'completed'.
ALTER TABLE idempotency_records DROP CONSTRAINT IF EXISTS idempotency_records_state_check;

-- 5. The transaction claim mode's completed record follows the same rule as the
--    row mode's completion (2.): its TTL counts from the first request (the
--    transaction's start, when it was claimed) unless the view ran past a tenth
--    of it; then the answer lives nine tenths of the TTL after it is stored. It
--    returns the seconds the record has left, for the Redis copy.
CREATE OR REPLACE FUNCTION idempotency_insert_completed(
    p_record_key bytea, p_fingerprint bytea, p_ttl double precision,
    p_status smallint, p_headers jsonb, p_body bytea
) RETURNS double precision
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    stored_at timestamptz := clock_timestamp();
    expires timestamptz := greatest(now() + make_interval(secs => p_ttl),
                                    stored_at + make_interval(secs => p_ttl * 0.9));
BEGIN
    INSERT INTO idempotency_records AS r
        (record_key, fingerprint, state, created_at, expires_at, completed_at,
         status_code, headers, body)
    VALUES (p_record_key, p_fingerprint, 'completed', now(),
            expires, stored_at, p_status, p_headers, p_body)
    ON CONFLICT (record_key) DO UPDATE
       SET fingerprint = EXCLUDED.fingerprint, state = 'completed', lock_token = NULL,
           lease_expires_at = NULL, created_at = EXCLUDED.created_at,
           expires_at = EXCLUDED.expires_at, completed_at = EXCLUDED.completed_at,
           status_code = EXCLUDED.status_code, headers = EXCLUDED.headers, body = EXCLUDED.body,
           takeovers = r.takeovers + 1
     WHERE r.expires_at <= stored_at
        OR (r.state = 'processing' AND r.lease_expires_at <= stored_at
            AND r.fingerprint = EXCLUDED.fingerprint);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency key held by another claim' USING ERRCODE = 'IK409';
    END IF;
    RETURN extract(epoch FROM expires - stored_at);
END
$$;
