-- The row mode's claim as one function call (it was a statement of its own,
-- prepared once per connection). PostgreSQL keeps the plans of a function's
-- statements per session, as it kept the prepared statement's, so a claim is
-- still parsed and planned once per connection; and nothing is prepared, so a
-- pooler in transaction mode (PgBouncer) needs no setting.
--
-- It reads first, so a replay or a 409 takes no row lock and writes nothing. The
-- INSERT takes the key when it is new, when the old record expired (treated as
-- absent), or when a processing record's lease ran out under the *same* request
-- (a crashed holder); a different request under a dead holder's key stays a 422
-- until the TTL ends. ON CONFLICT settles races with a concurrent claimer; when a
-- row appears or vanishes between the read and the insert, no row is returned and
-- the caller runs it again (also when the row read was one it could take, but
-- another claimer took it first). Taking over a dead holder of the same request
-- keeps the recovery points it committed; a claim of an expired record drops them.
--
-- Its plans are generic and built with sequential scans ruled out, as
-- idempotency_complete's are (0002): a plan cached while the table was empty or
-- tiny would otherwise keep scanning it as it grows.
--
-- Only added: 0.2.x workers send the same statement themselves and never call
-- this, so a rolling upgrade applies it while they serve.
CREATE OR REPLACE FUNCTION idempotency_claim(
    p_record_key bytea, p_fingerprint bytea, p_token bigint,
    p_lease double precision, p_ttl double precision, p_recovery bytea
) RETURNS TABLE (
    r_claimed boolean, r_state text, r_fingerprint bytea, r_status_code smallint,
    r_headers jsonb, r_body bytea, r_lease_remaining double precision,
    r_ttl_remaining double precision, r_phases jsonb, r_takeover boolean
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    -- The request's fingerprint as a record written before 0.3.0 holds it: the v0
    -- digest inside an unambiguous v1 fingerprint (a marker byte 0x01, the 32-byte
    -- v0 digest, 16 bytes of the media type's; flask_idempotency/fingerprint.py),
    -- else the fingerprint itself (a v0 one, or an ambiguous v1 one, marked 0x02,
    -- which no v0 record can equal: 49 bytes against 32). A dead holder of the
    -- same request is taken over whichever release wrote it.
    as_written_before bytea := CASE
        WHEN length(p_fingerprint) = 49 AND substring(p_fingerprint FROM 1 FOR 1) = '\x01'::bytea
        THEN substring(p_fingerprint FROM 2 FOR 32)
        ELSE p_fingerprint
    END;
BEGIN
    RETURN QUERY
    WITH existing AS (
        SELECT state, fingerprint, status_code, headers, body, lease_expires_at, expires_at
          FROM idempotency_records WHERE record_key = p_record_key
    ), claimed AS (
        INSERT INTO idempotency_records AS r
            (record_key, fingerprint, state, lock_token, lease_expires_at, created_at, expires_at,
             recovery)
        SELECT p_record_key, p_fingerprint, 'processing', p_token,
               now() + make_interval(secs => p_lease), now(),
               now() + make_interval(secs => p_ttl), p_recovery
         WHERE NOT EXISTS (
                SELECT 1 FROM existing e
                 WHERE e.expires_at > now()
                   AND NOT (e.state = 'processing' AND e.lease_expires_at <= now()
                            AND e.fingerprint IN (p_fingerprint, as_written_before)))
        ON CONFLICT (record_key) DO UPDATE
           SET fingerprint = EXCLUDED.fingerprint, state = 'processing',
               lock_token = EXCLUDED.lock_token, lease_expires_at = EXCLUDED.lease_expires_at,
               created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at,
               completed_at = NULL, status_code = NULL, headers = NULL, body = NULL,
               takeovers = r.takeovers + 1, recovery = EXCLUDED.recovery,
               phases = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.phases END
         WHERE r.expires_at <= now()
            OR (r.state = 'processing' AND r.lease_expires_at <= now()
                AND r.fingerprint IN (EXCLUDED.fingerprint, as_written_before))
        RETURNING r.phases
    )
    SELECT true, NULL::text, NULL::bytea, NULL::smallint, NULL::jsonb, NULL::bytea,
           NULL::float8, NULL::float8, claimed.phases,
           EXISTS (SELECT 1 FROM existing e WHERE e.state = 'processing' AND e.expires_at > now())
      FROM claimed
    UNION ALL
    SELECT false, e.state, e.fingerprint, e.status_code, e.headers, e.body,
           extract(epoch FROM e.lease_expires_at - now())::float8,
           extract(epoch FROM e.expires_at - now())::float8, NULL::jsonb, false
      FROM existing e
     WHERE NOT EXISTS (SELECT 1 FROM claimed)
       AND e.expires_at > now()
       AND NOT coalesce(e.state = 'processing' AND e.lease_expires_at <= now()
                        AND e.fingerprint IN (p_fingerprint, as_written_before), false);
END
$$;
