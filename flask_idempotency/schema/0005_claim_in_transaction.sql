-- IDEMPOTENCY_CLAIM_MODE = "transaction": the claim lives in the business
-- transaction instead of a row of its own. The claimer holds a
-- transaction-scoped advisory lock on the key, so a concurrent duplicate's
-- try fails at once (409), and a crashed holder's lock ends with its session
-- (no lease, no takeover). The completed record is inserted by the same
-- COMMIT as the view's rows: one commit per request, no processing row.

-- A completed record is read first, without any lock: it cannot change
-- until it expires, so replays (and 422s) of finished keys never queue on
-- each other. Otherwise two transaction-scoped advisory locks: one on the
-- request (key and fingerprint), then one on the key. Whoever holds both runs
-- the view. A duplicate of the same request fails the first (409); a
-- different request under the key gets the first but fails the second (422,
-- as in row mode: a different request under a running key). Neither lock is
-- ever waited for. The record is read again after both are held, in a
-- statement of its own (a VOLATILE function's statements each take a new
-- snapshot under READ COMMITTED), so a holder that committed just before we
-- got the locks is seen: a key that was just completed is never "absent".
-- Returns no row when the key is ours and unrecorded; otherwise one row:
-- locked = false (same_request says which lock failed), or the record.
CREATE OR REPLACE FUNCTION idempotency_claim_in_transaction(
    p_record_key bytea, p_request_lock bigint, p_key_lock bigint
)
RETURNS TABLE (
    locked boolean, same_request boolean, state text, fingerprint bytea,
    status_code smallint, headers jsonb, body bytea,
    lease_remaining double precision, ttl_remaining double precision
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    RETURN QUERY
        SELECT true, NULL::boolean, r.state, r.fingerprint, r.status_code, r.headers, r.body,
               NULL::double precision,
               extract(epoch FROM r.expires_at - clock_timestamp())::float8
          FROM idempotency_records r
         WHERE r.record_key = p_record_key AND r.expires_at > clock_timestamp()
           AND r.state = 'completed';
    IF FOUND THEN
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(p_request_lock) THEN
        RETURN QUERY SELECT false, true, NULL::text, NULL::bytea, NULL::smallint, NULL::jsonb,
                            NULL::bytea, NULL::double precision, NULL::double precision;
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(p_key_lock) THEN
        RETURN QUERY SELECT false, false, NULL::text, NULL::bytea, NULL::smallint, NULL::jsonb,
                            NULL::bytea, NULL::double precision, NULL::double precision;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT true, NULL::boolean, r.state, r.fingerprint, r.status_code, r.headers, r.body,
               extract(epoch FROM r.lease_expires_at - clock_timestamp())::float8,
               extract(epoch FROM r.expires_at - clock_timestamp())::float8
          FROM idempotency_records r
         WHERE r.record_key = p_record_key AND r.expires_at > clock_timestamp();
END
$$;

-- The completed record, written in the view's transaction just before its
-- COMMIT. A live row under the key can only be a row-mode claim of another
-- process (modes mixed during a deploy): then this attempt is refused like a
-- fenced one (IK409), and its transaction rolls back.
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
BEGIN
    INSERT INTO idempotency_records AS r
        (record_key, fingerprint, state, created_at, expires_at, completed_at,
         status_code, headers, body)
    VALUES (p_record_key, p_fingerprint, 'completed', now(),
            stored_at + make_interval(secs => p_ttl), stored_at, p_status, p_headers, p_body)
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
    RETURN p_ttl;
END
$$;
