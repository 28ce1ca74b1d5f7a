"""What ``flask idempotency doctor`` reads of the server: its settings as the
app's sessions start with them, the records table's vacuum statistics, its clock.

Read-only, run through :meth:`~.postgres.PostgresStore.read` under the store's
timeouts and deadline, like every other statement of the extension.
"""

from __future__ import annotations

#: The server's own port, and which database and role the app is: a client port
#: that differs from the server's means something forwards the connection.
SERVER_SIDE = """
SELECT current_setting('port')::int, current_database(), current_user,
       current_setting('server_version')
"""


#: What a new session of this role in this database starts with (milliseconds),
#: and where each is set: the role's or the database's own setting, if any.
SESSION_TIMEOUTS = """
SELECT s.name, s.reset_val::bigint,
       (SELECT string_agg(CASE WHEN d.setrole <> 0 AND d.setdatabase <> 0
                                 THEN 'ALTER ROLE ' || current_user || ' IN DATABASE '
                                      || current_database()
                               WHEN d.setrole <> 0 THEN 'ALTER ROLE ' || current_user
                               WHEN d.setdatabase <> 0
                                 THEN 'ALTER DATABASE ' || current_database()
                               ELSE 'ALTER ROLE ALL' END, ', ')
          FROM pg_db_role_setting d
         WHERE d.setdatabase IN (0, (SELECT oid FROM pg_database
                                      WHERE datname = current_database()))
           AND d.setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = current_user))
           AND EXISTS (SELECT 1 FROM unnest(d.setconfig) AS c
                        WHERE c LIKE s.name || '=%'))
  FROM pg_settings s
 WHERE s.name IN ('statement_timeout', 'idle_in_transaction_session_timeout',
                  'idle_session_timeout')
"""


AUTOVACUUM = """
SELECT c.reloptions, coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
       current_setting('autovacuum')::bool, current_setting('track_counts')::bool,
       current_setting('autovacuum_vacuum_scale_factor')::float8,
       current_setting('autovacuum_vacuum_threshold')::int8,
       extract(epoch FROM now() - greatest(s.last_autovacuum, s.last_vacuum))::float8
  FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
 WHERE c.oid = to_regclass('idempotency_records')
"""


SERVER_CLOCK = "SELECT extract(epoch FROM clock_timestamp())::float8"

#: Expired records that purge has not deleted yet, and how long ago the oldest
#: expired: each still holds a stored answer (``flask idempotency doctor``; the
#: count is also what ``purge --dry-run`` would delete).
EXPIRED_RECORDS = """
SELECT count(*), coalesce(extract(epoch FROM now() - min(expires_at)), 0)::float8
  FROM idempotency_records WHERE expires_at <= now()
"""
