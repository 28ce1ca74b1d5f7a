"""The reliability suite: storms, crashes, outages and hostile input against the real stack.

A package (as is every folder under ``tests/``) so that its ``conftest`` and
helper modules have names of their own: mypy and pytest would otherwise see two
top-level modules called ``conftest``.
"""
