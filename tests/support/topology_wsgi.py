"""``wsgi:app`` with extension settings the example app does not read from its
environment: each ``TOPOLOGY_IDEMPOTENCY_<NAME>`` variable, parsed as JSON, becomes
the config key ``IDEMPOTENCY_<NAME>`` (``TOPOLOGY_IDEMPOTENCY_PREPARE_STATEMENTS=false``).

Served as ``support.topology_wsgi:app`` by the topology tests (``tests/`` is on
gunicorn's PYTHONPATH there, see gunicorn_server.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

from example_app import create_app

PREFIX = "TOPOLOGY_"


def config_from_env(environ: os._Environ[str] | dict[str, str]) -> dict[str, Any]:
    return {
        name.removeprefix(PREFIX): json.loads(value)
        for name, value in environ.items()
        if name.startswith(PREFIX + "IDEMPOTENCY_")
    }


app = create_app(config_from_env(os.environ))
