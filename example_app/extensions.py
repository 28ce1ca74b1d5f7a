"""The extension instance the blueprints decorate with; bound to an app in ``create_app``.

One instance serves any number of apps: its per-app state lives in
``app.extensions``, so tests can build a fresh app per test.
"""

from __future__ import annotations

from flask_idempotency import Idempotency

idempotency = Idempotency()
