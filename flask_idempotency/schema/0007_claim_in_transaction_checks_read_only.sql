-- The transaction claim (0005), refusing a read-only transaction itself.
--
-- Advisory locks and reads work on a hot standby and under
-- default_transaction_read_only, so the claim's round trip used to open with a
-- write that touches nothing (DELETE ... WHERE false), which fails there with
-- SQLSTATE 25006 before anything is claimed. The same refusal, made here from
-- transaction_read_only (on in both cases), spares PostgreSQL parsing,
-- planning and running that statement on every first request (the claim and
-- its ROLLBACK went from 175 to 135 us of backend CPU here, measured with
-- python -m benchmarks.statements on a shared two-core machine).
--
-- A new name, so that code relying on the check never runs against a schema
-- without it: there the claim gets "function does not exist" and answers 503
-- (fail closed) instead of claiming on a read-only server. The 0005 function
-- stays for processes of the previous version while a deploy rolls.
CREATE OR REPLACE FUNCTION idempotency_claim_in_transaction_rw(
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
    IF current_setting('transaction_read_only')::boolean THEN
        RAISE EXCEPTION 'cannot claim an idempotency key in a read-only transaction'
            USING ERRCODE = '25006';  -- read_only_sql_transaction, as a write would raise
    END IF;
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
