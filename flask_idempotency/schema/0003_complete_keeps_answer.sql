-- A stored answer is kept for at least the record's TTL after it is stored.
-- Records of views slower than their TTL had their lease renewed past the
-- original expiry (see RENEW); completing with the old expires_at would store
-- an answer that is already expired, and the retry would run the view again.
-- Here the TTL counts from the completion: expires_at - created_at is the TTL
-- (or more, if renewals pushed it out), and the answer lives that long.
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
           expires_at = greatest(expires_at, now() + (expires_at - created_at))
     WHERE record_key = p_record_key AND lock_token = p_token AND state = 'processing'
     RETURNING extract(epoch FROM expires_at - now()) INTO remaining;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency lease lost' USING ERRCODE = 'IK409';
    END IF;
    RETURN remaining;
END
$$;
