"""The Redis response cache: the fast path, its wire protocol, and its topology URLs."""
