-- Recovery of abandoned requests (flask_idempotency/recovery.py, phases.py).
--
-- recovery: what a route declaring recover= needs to finish an attempt whose
-- holder died (its endpoint, the request as the view saw it, the route's own
-- recovery data), written by the claim statement itself, so it costs no round
-- trip; NULL for every other route. Cleared when the record completes.
--
-- phases: the recovery points a view committed so far, in order, as a JSON
-- array of [name, data] pairs. A request that takes a dead holder's record
-- over (a client's retry or `flask idempotency recover`) resumes after the
-- last of them. Cleared when the record completes; dropped by a claim of an
-- expired record (a new request).
ALTER TABLE idempotency_records
    ADD COLUMN IF NOT EXISTS recovery bytea,
    ADD COLUMN IF NOT EXISTS phases jsonb;

-- The completer's batch: processing records with a recovery payload, oldest
-- lease first. Partial, so it holds only attempts of recover= routes in flight
-- (a few rows), and the other routes' claims never touch it.
CREATE INDEX IF NOT EXISTS idempotency_records_recoverable_idx
    ON idempotency_records (lease_expires_at)
    WHERE state = 'processing' AND recovery IS NOT NULL;

-- Totals of the completer's outcomes for `flask idempotency stats`, bumped in
-- the transaction that stores the recovered answer or deletes the record.
CREATE TABLE IF NOT EXISTS idempotency_recovery_totals (
    outcome  text        PRIMARY KEY,
    total    bigint      NOT NULL DEFAULT 0,
    last_at  timestamptz
);

-- The completion of 0003, now also dropping what only an unfinished attempt
-- needed: the request kept for recovery (it may carry payment details) and
-- the recovery points.
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
           expires_at = greatest(expires_at, now() + (expires_at - created_at)),
           recovery = NULL, phases = NULL
     WHERE record_key = p_record_key AND lock_token = p_token AND state = 'processing'
     RETURNING extract(epoch FROM expires_at - now()) INTO remaining;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency lease lost' USING ERRCODE = 'IK409';
    END IF;
    RETURN remaining;
END
$$;

-- A recovery point: appended in the view's transaction, just before its
-- COMMIT, so the phase's writes and the record's progress commit together.
-- Fenced like the completion: refused (IK409, the transaction rolls back)
-- unless the caller still holds the record.
CREATE OR REPLACE FUNCTION idempotency_checkpoint(
    p_record_key bytea, p_token bigint, p_phase text, p_data jsonb
) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    UPDATE idempotency_records
       SET phases = coalesce(phases, '[]'::jsonb) || jsonb_build_array(jsonb_build_array(p_phase, p_data))
     WHERE record_key = p_record_key AND lock_token = p_token AND state = 'processing';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency lease lost' USING ERRCODE = 'IK409';
    END IF;
END
$$;
