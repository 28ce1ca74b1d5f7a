"""The client half (``flask_idempotency.client``): its rules alone, the three clients
against a scripted server, and storms against the real stack through a proxy that
fails single requests, counted at the sources of truth."""
