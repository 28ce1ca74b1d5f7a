"""``wsgi:app`` with extension settings the example app does not read from its
environment: each ``TOPOLOGY_IDEMPOTENCY_<NAME>`` variable, parsed as JSON, becomes
the config key ``IDEMPOTENCY_<NAME>``
(``TOPOLOGY_IDEMPOTENCY_DATABASE_OPTIONS={"prepare_statements": false}``).

Served as ``support.topology_wsgi:app`` by the topology tests (``tests/`` is on
gunicorn's PYTHONPATH there, see gunicorn_server.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

from example_app import create_app
from example_app.config import config_from_env as example_config_from_env

PREFIX = "TOPOLOGY_"


def config_from_env(environ: os._Environ[str] | dict[str, str]) -> dict[str, Any]:
    config = {
        name.removeprefix(PREFIX): json.loads(value)
        for name, value in environ.items()
        if name.startswith(PREFIX + "IDEMPOTENCY_")
    }
    # A group of options given here adds to the example's own (its pool size, which
    # gunicorn.conf.py sets), rather than replacing the whole mapping.
    own = example_config_from_env(environ)
    for name, value in config.items():
        if name.endswith("_OPTIONS") and isinstance(own.get(name), dict):
            config[name] = {**own[name], **value}
    return config


app = create_app(config_from_env(os.environ))
