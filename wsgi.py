"""The WSGI entry point: ``gunicorn -c gunicorn.conf.py wsgi:app``.

Each gunicorn worker imports this after the fork (no preload), so connection
pools and the lease-renewal thread are created in the process that uses them.
"""

from __future__ import annotations

from example_app import create_app

app = create_app()
