"""The client half (``flask_idempotency.client``) against the real stack: retrying
calls through a proxy that fails single requests, counted at the sources of truth."""
