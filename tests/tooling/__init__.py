"""The package as users get it (build, install, the pytest plugin) and the suite's own harness.

Not called ``packaging``: ``tests/`` is on sys.path, and a ``packaging`` package here would
shadow the PyPI one that pytest, build and pip import."""
