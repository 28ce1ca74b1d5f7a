"""Every session factory the extension is given joins attempts, however many came
before it: an app per test builds a new ``sessionmaker`` each time, and a new
factory's class can reuse a collected one's ``id()``, which SQLAlchemy's own
``event.contains()`` then reads as already listened to. Its sessions never
joined, so a view's ``commit()`` was a real one (kept with a 500, seen by others
before the answer was stored): seen as a rare failure of ``test_sa_plain.py``.
"""

from __future__ import annotations

import gc

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import scoped_session, sessionmaker

from flask_idempotency.sqlalchemy_session import JOINED, SessionJoin


class Handed(Exception):
    """Raised by the stand-in attempt when a session asks for its connection."""


class _Attempt:
    """What ``_hand_connection`` asks of a joined attempt, and nothing else."""

    class handle:
        @staticmethod
        def connection() -> None:
            raise Handed


def test_each_new_session_factory_joins_even_when_its_class_id_is_reused() -> None:
    engine = sa.create_engine("sqlite://")
    ids = set()
    for _ in range(60):
        sessions = scoped_session(sessionmaker(bind=engine))
        ids.add(id(sessions.session_factory.class_))
        SessionJoin(sessions, pool=None)  # type: ignore[arg-type]
        session = sessions()
        session.info[JOINED] = _Attempt()
        with pytest.raises(Handed):
            session.begin()  # after_transaction_create: the session asks the attempt
        session.info.pop(JOINED)
        sessions.remove()
        del sessions, session
        gc.collect()
    assert len(ids) < 60  # the ids were reused: the case this guards


def test_a_factory_shared_by_apps_is_listened_to_once() -> None:
    engine = sa.create_engine("sqlite://")
    sessions = scoped_session(sessionmaker(bind=engine))
    calls = []

    class Counting:
        class handle:
            @staticmethod
            def connection() -> None:
                calls.append(1)
                raise Handed

    for _ in range(3):  # three apps on one db.session
        SessionJoin(sessions, pool=None)  # type: ignore[arg-type]
    session = sessions()
    session.info[JOINED] = Counting()
    with pytest.raises(Handed):
        session.begin()
    assert calls == [1]
