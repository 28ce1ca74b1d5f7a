-- One statement per operation, and less WAL per first request (issue 38).
--
-- Until now each of the claim, the completion and the transaction mode's
-- completed record was sent after two or three SET LOCALs (statement and lock
-- timeouts, the claim's asynchronous commit): PostgreSQL parsed and ran four or
-- five statements per first request, and three per replay, that only set
-- something. These functions take the lock timeout (and, for the claim, whether
-- its commit may be asynchronous) as arguments and set them themselves:
--
-- * lock_timeout is listed in each function's SET clause, so the value set
--   inside lasts for the function's own statements only and is restored when it
--   returns (a SET LOCAL of a variable the SET clause names is confined to the
--   function): the view's statements run under the session's setting.
-- * synchronous_commit is not in the claim's SET clause, so the claim's set
--   lasts to the end of its transaction: the claim's own (row mode claims in
--   autocommit), whose commit is the one it makes asynchronous.
-- * statement_timeout cannot be set for the statement already running; the
--   claim and the completion wait on nothing but row locks (bounded by the lock
--   timeout; when lock_timeout is 0 the caller passes the statement timeout) and
--   the client's own deadline (store/watchdog.py) bounds the rest, as it always
--   bounded a COMMIT waiting for a standby.
--
-- A first key is taken with a plain INSERT, not INSERT ... ON CONFLICT: the row
-- was just read and is absent, and a speculative insertion writes one more WAL
-- record (its confirmation) for a race that almost never happens. When it does
-- (another claimer inserted the key since the read) the INSERT fails with
-- unique_violation (SQLSTATE 23505) and the caller asks again, as it did when
-- the ON CONFLICT branch found the row changed. (Catching it in the function
-- would need an exception block: a subtransaction on every first request, whose
-- id the commit record then carries, 12 bytes of WAL.) Taking over
-- an expired record or a dead holder of the same request is an UPDATE of the row
-- read, guarded by the same conditions, so a concurrent takeover or purge makes
-- it update nothing, and the caller asks again.
--
-- Only added, under new names: 0.2.x workers send their own statements and call
-- idempotency_complete and idempotency_insert_completed, which stay as they are,
-- so a rolling upgrade applies this while they serve. Records are the same rows
-- in the same two states; nothing here changes what either release reads.

CREATE OR REPLACE FUNCTION idempotency_claim_v2(
    p_record_key bytea, p_fingerprint bytea, p_token bigint,
    p_lease double precision, p_ttl double precision, p_recovery bytea,
    p_lock_timeout text, p_async_commit boolean
) RETURNS TABLE (
    r_claimed boolean, r_state text, r_fingerprint bytea, r_status_code smallint,
    r_headers jsonb, r_body bytea, r_lease_remaining double precision,
    r_ttl_remaining double precision, r_phases jsonb, r_takeover boolean
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET lock_timeout = 0
AS $$
DECLARE
    -- (simple expressions: evaluated without a statement of their own)
    lock_set text := set_config('lock_timeout', p_lock_timeout, true);
    commit_set text := CASE WHEN p_async_commit
                            THEN set_config('synchronous_commit', 'off', true) END;
    -- The request's fingerprint as a record written before 0.3.0 holds it
    -- (0010's idempotency_claim says why).
    as_written_before bytea := CASE
        WHEN length(p_fingerprint) = 49 AND substring(p_fingerprint FROM 1 FOR 1) = '\x01'::bytea
        THEN substring(p_fingerprint FROM 2 FOR 32)
        ELSE p_fingerprint
    END;
    e idempotency_records%ROWTYPE;
BEGIN
    -- (the answer is the OUT columns, set by assignments and sent with RETURN
    -- NEXT: no statement of its own, as a RETURN QUERY would be)
    -- A read-only server (a hot standby, default_transaction_read_only) answers
    -- nothing, a replay included, as 0010's claim, whose INSERT refused to start
    -- there whether or not it inserted: it may be a standby that is behind.
    IF current_setting('transaction_read_only')::boolean THEN
        RAISE EXCEPTION 'cannot claim an idempotency key in a read-only transaction'
            USING ERRCODE = '25006';  -- read_only_sql_transaction, as a write would raise
    END IF;
    SELECT * INTO e FROM idempotency_records WHERE record_key = p_record_key;
    IF NOT FOUND THEN
        -- (claimed by another since the read: unique_violation, and the caller
        -- asks again; no block of its own, whose subtransaction would log its id)
        INSERT INTO idempotency_records
            (record_key, fingerprint, state, lock_token, lease_expires_at, created_at,
             expires_at, recovery)
        VALUES (p_record_key, p_fingerprint, 'processing', p_token,
                now() + make_interval(secs => p_lease), now(),
                now() + make_interval(secs => p_ttl), p_recovery);
        r_claimed := true;
        r_takeover := false;
        RETURN NEXT;
        RETURN;
    END IF;
    -- coalesce: a processing row without a lease (written by hand, or by a release
    -- that predates leases) is held, not taken, as idempotency_claim answers.
    IF e.expires_at > now()
       AND NOT coalesce(e.state = 'processing' AND e.lease_expires_at <= now()
                        AND e.fingerprint IN (p_fingerprint, as_written_before), false) THEN
        -- a live record: a replay, a 409 or a 422, decided by the caller
        r_claimed := false;
        r_state := e.state;
        r_fingerprint := e.fingerprint;
        r_status_code := e.status_code;
        r_headers := e.headers;
        r_body := e.body;
        r_lease_remaining := extract(epoch FROM e.lease_expires_at - now());
        r_ttl_remaining := extract(epoch FROM e.expires_at - now());
        r_takeover := false;
        RETURN NEXT;
        RETURN;
    END IF;
    -- An expired record (a new request), or a dead holder of this one: take it.
    UPDATE idempotency_records AS r
       SET fingerprint = p_fingerprint, state = 'processing', lock_token = p_token,
           lease_expires_at = now() + make_interval(secs => p_lease),
           created_at = now(), expires_at = now() + make_interval(secs => p_ttl),
           completed_at = NULL, status_code = NULL, headers = NULL, body = NULL,
           takeovers = r.takeovers + 1, recovery = p_recovery,
           phases = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.phases END
     WHERE r.record_key = p_record_key
       AND (r.expires_at <= now()
            OR (r.state = 'processing' AND r.lease_expires_at <= now()
                AND r.fingerprint IN (p_fingerprint, as_written_before)))
    RETURNING r.phases INTO r_phases;
    IF FOUND THEN
        r_claimed := true;
        r_takeover := e.state = 'processing' AND e.expires_at > now();
        RETURN NEXT;
    END IF;
    -- (not found: taken or purged since the read; the caller asks again)
END
$$;

-- Row mode's completion: 0009's idempotency_complete, fenced the same way
-- (IK409 once taken over), with the lock timeout as an argument.
CREATE OR REPLACE FUNCTION idempotency_complete_v2(
    p_record_key bytea, p_token bigint, p_status smallint, p_headers jsonb, p_body bytea,
    p_lock_timeout text
) RETURNS double precision
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET lock_timeout = 0
AS $$
DECLARE
    lock_set text := set_config('lock_timeout', p_lock_timeout, true);
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

-- The transaction mode's completed record: 0009's idempotency_insert_completed,
-- with the lock timeout as an argument, and a plain INSERT when the key has no
-- row (the common case; the claim's advisory lock on the key, held by this
-- transaction, keeps every other claimer of either release from inserting it in
-- between, so no speculative insertion is needed). A row that is there (expired,
-- or a dead row-mode holder of this request) is replaced as before.
CREATE OR REPLACE FUNCTION idempotency_insert_completed_v2(
    p_record_key bytea, p_fingerprint bytea, p_ttl double precision,
    p_status smallint, p_headers jsonb, p_body bytea, p_lock_timeout text
) RETURNS double precision
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET lock_timeout = 0
AS $$
DECLARE
    lock_set text := set_config('lock_timeout', p_lock_timeout, true);
    stored_at timestamptz := clock_timestamp();
    expires timestamptz := greatest(now() + make_interval(secs => p_ttl),
                                    stored_at + make_interval(secs => p_ttl * 0.9));
BEGIN
    PERFORM FROM idempotency_records WHERE record_key = p_record_key;
    IF NOT FOUND THEN
        INSERT INTO idempotency_records
            (record_key, fingerprint, state, created_at, expires_at, completed_at,
             status_code, headers, body)
        VALUES (p_record_key, p_fingerprint, 'completed', now(),
                expires, stored_at, p_status, p_headers, p_body);
        RETURN extract(epoch FROM expires - stored_at);
    END IF;
    UPDATE idempotency_records AS r
       SET fingerprint = p_fingerprint, state = 'completed', lock_token = NULL,
           lease_expires_at = NULL, created_at = now(),
           expires_at = expires, completed_at = stored_at,
           status_code = p_status, headers = p_headers, body = p_body,
           takeovers = r.takeovers + 1
     WHERE r.record_key = p_record_key
       AND (r.expires_at <= stored_at
            OR (r.state = 'processing' AND r.lease_expires_at <= stored_at
                AND r.fingerprint = p_fingerprint));
    IF NOT FOUND THEN
        PERFORM FROM idempotency_records WHERE record_key = p_record_key;
        IF NOT FOUND THEN  -- purged since the read: the key is free again
            INSERT INTO idempotency_records
                (record_key, fingerprint, state, created_at, expires_at, completed_at,
                 status_code, headers, body)
            VALUES (p_record_key, p_fingerprint, 'completed', now(),
                    expires, stored_at, p_status, p_headers, p_body);
            RETURN extract(epoch FROM expires - stored_at);
        END IF;
        RAISE EXCEPTION 'idempotency key held by another claim' USING ERRCODE = 'IK409';
    END IF;
    RETURN extract(epoch FROM expires - stored_at);
END
$$;

