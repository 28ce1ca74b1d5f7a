"""The pytest plugin users get (flask_idempotency/testing), run the way a user runs it.

Each test writes a user's project with ``pytester`` (a small payments app in
its conftest.py, its own migration for a ``charges`` table, test files that use
the plugin's fixtures and ``assert_idempotent``) and runs pytest on it. The
databases come from the run's server through ``--idempotency-dsn`` (the noproc
path), except in the test of the default path, where pytest-postgresql starts
a server of its own from pgserver's ``pg_ctl``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flask_idempotency.testing import databases
from flask_idempotency.testing.assertions import preview
from support._files import unprivileged_user
from support.postgres_install import find_bindir, usable_bindir
from support.postgres_proc import pg_ctl_executable

pytest_plugins = ["pytester"]

#: Never in any output: the inner tests send it as their key, and a body holds it at its end.
SECRET_KEY = "key-that-must-not-leak-7f3a"
SECRET_TAIL = "BODY-TAIL-THAT-MUST-NOT-LEAK"

USER_CONFTEST = (
    textwrap.dedent(
        """
    import psycopg2
    import pytest
    from flask import Flask, jsonify, request

    from flask_idempotency import Idempotency

    AUTH = {"Authorization": "Bearer sk_test_user"}
    SECRET_KEY = "__KEY__"


    def create_app(dsn):
        app = Flask("user_app")
        app.config["IDEMPOTENCY_DATABASE_URL"] = dsn
        app.config["IDEMPOTENCY_DATABASE_OPTIONS"] = {"pool_size": 25}
        idempotency = Idempotency(app)

        def insert_charge():
            with idempotency.connection().cursor() as cur:
                cur.execute(
                    "INSERT INTO charges (amount) VALUES (%s) RETURNING id",
                    (request.get_json()["amount"],),
                )
                return cur.fetchone()[0]

        @app.post("/v1/charges")
        @idempotency.required
        def create_charge():
            charge_id = insert_charge()
            return jsonify(id=f"ch_{charge_id}", amount=request.get_json()["amount"]), 201

        @app.post("/v1/unsafe")  # forgot the decorator
        def unsafe_charge():
            conn = psycopg2.connect(dsn)
            with conn, conn.cursor() as cur:
                cur.execute("INSERT INTO charges (amount) VALUES (1) RETURNING id")
                charge_id = cur.fetchone()[0]
            conn.close()
            return jsonify(id=f"ch_{charge_id}", padding="x" * 200, tail="__TAIL__"), 201

        @app.post("/v1/forgetful")  # decorated, but its answers are never stored
        @idempotency.required(should_store=lambda status: False)
        def forgetful_charge():
            app.extensions["forgetful_calls"].append(1)  # its rows roll back: count here
            return jsonify(id=f"ch_{len(app.extensions['forgetful_calls'])}"), 201

        app.extensions["forgetful_calls"] = []

        return app


    @pytest.fixture
    def app(idempotency_dsn):
        app = create_app(idempotency_dsn)
        yield app
        app.extensions["idempotency"].close()


    @pytest.fixture
    def charges(idempotency_dsn):
        def count():
            conn = psycopg2.connect(idempotency_dsn)
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT count(*) FROM charges")
                    return cur.fetchone()[0]
            finally:
                conn.close()
        return count
    """
    )
    .replace("__TAIL__", SECRET_TAIL)
    .replace("__KEY__", SECRET_KEY)
)

CHARGES_MIGRATION = """
CREATE TABLE charges (id bigserial PRIMARY KEY, amount integer NOT NULL);
"""

PASSING_TESTS = textwrap.dedent(
    """
    from conftest import AUTH
    from flask_idempotency.testing import assert_idempotent


    def test_charges_are_idempotent(app, charges, idempotency_dsn, idempotency_live_server):
        server = idempotency_live_server(app)
        report = assert_idempotent(
            server.url + "/v1/charges",
            json={"amount": 1500},
            headers=AUTH,
            duplicates=20,
            executions=charges,
            database_url=idempotency_dsn,
        )
        assert report.status == 201
        assert report.executions == 1
        assert report.mismatch_status == 422
        assert len(report.answers) == 20
        assert charges() == 1


    def test_each_test_gets_an_empty_database(charges, idempotency_database):
        assert charges() == 0
        assert idempotency_database.records() == []
    """
)

FAILING_TESTS = textwrap.dedent(
    """
    from conftest import AUTH, SECRET_KEY
    from flask_idempotency.testing import assert_idempotent


    def test_undecorated_route(app, charges, idempotency_dsn, idempotency_live_server):
        server = idempotency_live_server(app)
        assert_idempotent(
            server.url + "/v1/unsafe", json={"amount": 1}, headers=AUTH, key=SECRET_KEY,
            executions=charges, database_url=idempotency_dsn,
        )


    def test_route_whose_answers_are_not_stored(app, charges, idempotency_live_server):
        server = idempotency_live_server(app)
        assert_idempotent(
            server.url + "/v1/forgetful", json={"amount": 2}, headers=AUTH, key=SECRET_KEY,
            executions=lambda: len(app.extensions["forgetful_calls"]), duplicates=8,
        )
    """
).replace("__KEY__", SECRET_KEY)


@pytest.fixture
def user_project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A user's project: the app in conftest.py, its migration, the plugin configured."""
    pytester.makeconftest(USER_CONFTEST)
    pytester.mkdir("migrations")
    (pytester.path / "migrations" / "0001_charges.sql").write_text(CHARGES_MIGRATION)
    pytester.makeini(
        """
        [pytest]
        idempotency_migration_dirs = migrations
        """
    )
    return pytester


def test_a_users_idempotent_route_passes(user_project: pytest.Pytester, database_url: str) -> None:
    user_project.makepyfile(test_charges=PASSING_TESTS)
    result = user_project.runpytest("-p", "no:cacheprovider", f"--idempotency-dsn={database_url}")
    result.assert_outcomes(passed=2)


def test_non_idempotent_routes_fail_with_a_clear_message(
    user_project: pytest.Pytester, database_url: str
) -> None:
    user_project.makepyfile(test_unsafe=FAILING_TESTS)
    result = user_project.runpytest("-p", "no:cacheprovider", f"--idempotency-dsn={database_url}")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*POST /v1/unsafe is not idempotent under 20 concurrent duplicates:",
            "*the view ran 20 times for 20 identical requests (executions hook); expected once",
            "*none of the 20 answers was a replay*Is the route decorated*",
            "*the answers are not byte-identical*",
            "*idempotency_records gained 0 records*",
            "*the same key with a different body answered 201, expected 422*",
            "*the view ran once for the mismatched request",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*POST /v1/forgetful is not idempotent under 8 concurrent duplicates:",
            "*the view ran 8 times for 8 identical requests*",
            "*none of the 8 answers was a replay, though the route marks them*not stored*",
        ]
    )
    output = result.stdout.str() + result.stderr.str()
    assert SECRET_KEY not in output
    assert SECRET_TAIL not in output


def test_the_default_server_is_pytest_postgresqls_process_fixture(
    user_project: pytest.Pytester,
) -> None:
    """No DSN: pytest-postgresql's ``postgresql_proc`` starts a server (pgserver's
    pg_ctl through its own ``--postgresql-exec``), shared by a session-scoped database."""
    user_project.makepyfile(
        test_session=textwrap.dedent(
            """
            from conftest import AUTH
            from flask_idempotency.testing import assert_idempotent


            def test_first(app, charges, idempotency_dsn, idempotency_live_server, postgresql_proc):
                assert f":{postgresql_proc.port}/" in idempotency_dsn
                server = idempotency_live_server(app)
                assert_idempotent(server.url + "/v1/charges", json={"amount": 7}, headers=AUTH,
                                  duplicates=5, executions=charges, database_url=idempotency_dsn)


            def test_second_shares_the_session_database(charges, idempotency_database):
                assert charges() == 1
                assert idempotency_database.records() == [("completed", 201)]
            """
        )
    )
    result = user_project.runpytest(
        "-p",
        "no:cacheprovider",
        f"--postgresql-exec={pg_ctl_executable()}",
        "--idempotency-db-scope=session",
    )
    result.assert_outcomes(passed=2)


def test_as_root_with_no_dsn_the_plugin_starts_its_own_server(
    user_project: pytest.Pytester,
) -> None:
    """The case of a CI container: no DSN, pytest running as root, ``pg_ctl`` given as
    the real binary (never a wrapper). PostgreSQL refuses root, so the plugin runs it
    as an unprivileged account; the user's tests pass. (As another user the same run
    takes the ordinary path.)"""
    user_project.makepyfile(test_charges=PASSING_TESTS)
    real_pg_ctl = usable_bindir(find_bindir(), unprivileged_user()) / "pg_ctl"
    result = user_project.runpytest_subprocess(
        "-p", "no:cacheprovider", f"--postgresql-exec={real_pg_ctl}", timeout=300
    )
    output = result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=2)
    assert "cannot be run as root" not in output


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal of root is PostgreSQL's, for root")
def test_as_root_without_a_usable_pg_ctl_the_failure_is_one_line(
    user_project: pytest.Pytester, tmp_path: Path
) -> None:
    """A pg_ctl the unprivileged account cannot reach (here in a 0700 directory of
    root's): one line that says what to pass, not pg_ctl's CalledProcessError."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    pg_ctl = private / "pg_ctl"
    shutil.copy2(find_bindir() / "pg_ctl", pg_ctl)  # the binary, where only root goes
    user_project.makepyfile(test_db="def test_needs_the_database(idempotency_dsn):\n    pass\n")
    # -rN: no short summary, which repeats the message untruncated where pytest
    # sees a CI environment ($CI) and cut to the terminal's width elsewhere.
    result = user_project.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rN", f"--postgresql-exec={pg_ctl}", timeout=120
    )
    result.assert_outcomes(errors=1)
    output = result.stdout.str()
    assert "CalledProcessError" not in output and "Traceback" not in output
    [line] = [line for line in output.splitlines() if "--idempotency-dsn" in line]
    assert "pytest runs as root" in line and "cannot reach" in line
    assert "ini idempotency_dsn" in line


def test_an_unreachable_dsn_fails_the_tests_instead_of_skipping(
    user_project: pytest.Pytester,
) -> None:
    user_project.makepyfile(test_db="def test_needs_the_database(idempotency_dsn):\n    pass\n")
    dsn = "postgresql://postgres:hunter2@127.0.0.1:1/postgres"
    result = user_project.runpytest("-p", "no:cacheprovider", f"--idempotency-dsn={dsn}")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*--idempotency-dsn is set but unusable*unreachable*"])
    assert "hunter2" not in result.stdout.str()


def test_importing_the_plugin_does_not_import_pytest_postgresql() -> None:
    probe = (
        "import sys\n"
        "import flask_idempotency.testing.pytest_plugin\n"
        "import flask_idempotency.testing\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pytest_postgresql', 'psycopg', 'mirakuru', 'port_for'))\n"
        "print(loaded)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_without_pytest_postgresql_the_rest_still_works(
    pytester: pytest.Pytester, fresh_database_url: str
) -> None:
    """pytest-postgresql absent (simulated: its import blocked, its plugin disabled):
    the plugin loads, the live server and assert_idempotent work, and the database
    fixtures say what to install."""
    databases.migrate(fresh_database_url)
    pytester.makepyfile(
        test_user=textwrap.dedent(
            f"""
            import pytest
            from flask import Flask, jsonify
            from flask_idempotency import Idempotency, global_scope
            from flask_idempotency.testing import assert_idempotent


            def test_live_server_and_assertion(idempotency_live_server):
                app = Flask("user_app")
                app.config.update(IDEMPOTENCY_DATABASE_URL={fresh_database_url!r},
                                  IDEMPOTENCY_SCOPE_FUNC=global_scope)
                idempotency = Idempotency(app)

                @app.post("/things")
                @idempotency.required
                def things():
                    return jsonify(ok=True), 201

                try:
                    server = idempotency_live_server(app)
                    assert_idempotent(server.url + "/things", json={{"n": 1}}, duplicates=4,
                                      database_url={fresh_database_url!r})
                finally:
                    app.extensions["idempotency"].close()


            def test_database_fixture(idempotency_dsn):
                pass
            """
        )
    )
    runner = textwrap.dedent(
        """
        import sys

        class NotInstalled:  # `import pytest_postgresql` fails as if it were not installed
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "pytest_postgresql":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NotInstalled())
        import pytest
        sys.exit(pytest.main(["-p", "no:pytest_postgresql", "-p", "no:cacheprovider"]))
        """
    )
    result = pytester.run(sys.executable, "-c", runner, timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    assert "pip install 'flask-idempotency[pytest]'" in result.stdout.str()


def test_preview_shows_only_a_prefix() -> None:
    body = b"x" * 100 + SECRET_TAIL.encode()
    shown = preview(body)
    assert SECRET_TAIL not in shown
    assert shown.startswith("b'xxxx") and "128 bytes" in shown
