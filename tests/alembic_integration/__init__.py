"""The Alembic / Flask-Migrate integration (flask_idempotency.alembic).

Not named ``tests/alembic``: pytest puts ``tests/`` on sys.path, where a package of
that name would shadow Alembic itself.
"""
