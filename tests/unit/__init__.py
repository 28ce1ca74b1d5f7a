"""Pure parts: key parsing, fingerprints, the flow's decisions, settings validation (no server)."""
