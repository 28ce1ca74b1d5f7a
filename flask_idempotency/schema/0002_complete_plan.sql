-- plpgsql caches the completion's UPDATE plan for the session's life. Cached
-- while the table is empty or tiny, that plan is a sequential scan, kept as the
-- table grows. These settings hold during each call only: one plan, always the
-- primary-key lookup.
ALTER FUNCTION idempotency_complete(bytea, bigint, smallint, jsonb, bytea)
    SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off;
