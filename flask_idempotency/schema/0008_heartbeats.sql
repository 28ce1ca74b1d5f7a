-- When the background workers last ran (`flask idempotency doctor`).
--
-- The relay and the completer run as processes of their own (a service, a
-- cron line); one that stopped leaves nothing behind but events that are
-- never published and abandoned records that are never finished. Each run
-- upserts its row here, at most once per interval per process (see
-- flask_idempotency/store/heartbeat.py), so the doctor can say when one was
-- last seen. One row per worker kind: a few upserts a minute, whatever the traffic.
CREATE TABLE IF NOT EXISTS idempotency_heartbeats (
    worker       text        PRIMARY KEY,
    last_run_at  timestamptz NOT NULL DEFAULT now(),
    -- host:pid of the last process that reported (where to look).
    seen_on      text
);
