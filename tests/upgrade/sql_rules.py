"""What a migration may do while workers of the previous release still serve.

Those workers run the statements and call the functions of their own release.
A migration applied under them may only add: new tables, indexes, functions
under new names, nullable or defaulted columns. Everything else changes or
removes something they use: a DROP, a RENAME, a column's type, a NOT NULL their
inserts do not satisfy, or a function replaced in place (``CREATE OR REPLACE``
changes it for every session at once, theirs included; a new overload of a name
they call can make their calls ambiguous or resolve to it).

The SQL is read with comments and string literals taken out, dollar-quoted
bodies kept (a DROP inside a function body runs too), and split into top-level
statements. It is a reader for the project's own migration files, not a parser
of every SQL PostgreSQL accepts; each rule says what it looks for.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")


def statements(source: str) -> list[str]:
    """The top-level statements of ``source``, upper-cased and on one line each,
    without comments; string literals become ``''``."""
    out: list[str] = []
    current: list[str] = []
    i, n = 0, len(source)
    dollar: str | None = None  # the closing tag while inside a dollar-quoted body
    while i < n:
        if source.startswith("--", i):
            end = source.find("\n", i)
            i = n if end < 0 else end
            continue
        if source.startswith("/*", i):
            end = source.find("*/", i + 2)
            i = n if end < 0 else end + 2
            current.append(" ")
            continue
        ch = source[i]
        if ch == "'":
            i += 1
            while i < n:
                if source[i] == "'" and source.startswith("''", i):
                    i += 2
                elif source[i] == "'":
                    break
                else:
                    i += 1
            i += 1
            current.append("''")
            continue
        if ch == "$":
            tag = _DOLLAR_TAG.match(source, i)
            if tag is not None:
                if dollar is None:
                    dollar = tag.group()
                elif tag.group() == dollar:
                    dollar = None
                current.append(f" {tag.group()} ")
                i = tag.end()
                continue
        if ch == ";" and dollar is None:
            out.append("".join(current))
            current = []
            i += 1
            continue
        current.append(ch)
        i += 1
    out.append("".join(current))
    cleaned = (" ".join(s.split()).upper() for s in out)
    return [s for s in cleaned if s]


_NAME = r'((?:"?[\w]+"?\.)?"?[\w]+"?)'
_ROUTINE = re.compile(r"\bCREATE\s+(OR\s+REPLACE\s+)?(?:FUNCTION|PROCEDURE)\s+" + _NAME + r"\s*\(")
_VIEW = re.compile(r"\bCREATE\s+(OR\s+REPLACE\s+)?(?:MATERIALIZED\s+)?VIEW\s+" + _NAME)
_COLUMN_TYPE = re.compile(r'\bALTER\s+(?:COLUMN\s+)?"?\w+"?\s+(?:SET\s+DATA\s+)?TYPE\b')
_SET_NOT_NULL = re.compile(r'\bALTER\s+(?:COLUMN\s+)?"?(\w+)"?\s+SET\s+NOT\s+NULL\b')
_SET_DEFAULT = r'\bALTER\s+(?:COLUMN\s+)?"?{}"?\s+SET\s+DEFAULT\b'
#: ``ADD [COLUMN] [IF NOT EXISTS] name definition``, up to the next clause.
_ADD_COLUMN = re.compile(
    r'\bADD\s+(?:COLUMN\s+)?(?:IF\s+NOT\s+EXISTS\s+)?"?(\w+)"?\s+(.*?)(?=,\s*(?:ADD|ALTER|DROP|'
    r"SET|RESET|OWNER|ENABLE|DISABLE|VALIDATE)\b|$)"
)
_NOT_COLUMNS = {"CONSTRAINT", "CHECK", "UNIQUE", "PRIMARY", "FOREIGN", "EXCLUDE"}


def _bare(name: str) -> str:
    """A routine's or view's name without quotes or the ``public.`` schema."""
    name = name.replace('"', "").lower()
    return name.removeprefix("public.")


def defined_routines(sources: Iterable[str]) -> set[str]:
    """The functions and procedures (and views) the ``sources`` create, by name."""
    names: set[str] = set()
    for source in sources:
        for statement in statements(source):
            for pattern in (_ROUTINE, _VIEW):
                names.update(_bare(m.group(2)) for m in pattern.finditer(statement))
    return names


@dataclass(frozen=True)
class Violation:
    statement: str
    reason: str

    def __str__(self) -> str:
        shown = self.statement if len(self.statement) < 160 else self.statement[:157] + "..."
        return f"{self.reason}: {shown}"


def violations(source: str, earlier_routines: Sequence[str] | set[str]) -> list[Violation]:
    """What in ``source`` (a migration applied under the previous release's workers)
    is not add-only. ``earlier_routines``: names the earlier files define."""
    earlier = set(earlier_routines)
    found: list[Violation] = []
    all_statements = statements(source)
    whole = " ; ".join(all_statements)
    for statement in all_statements:

        def flag(reason: str, statement: str = statement) -> None:
            found.append(Violation(statement, reason))

        if re.search(r"\bDROP\b", statement):
            flag("DROP removes something the previous release's workers may use")
        if re.search(r"\bRENAME\b", statement):
            flag("RENAME removes a name the previous release's workers use")
        if re.search(r"\bTRUNCATE\b", statement):
            flag("TRUNCATE deletes the previous release's records")
        if _COLUMN_TYPE.search(statement):
            flag("a column's type changes under the previous release's workers")
        for match in _SET_NOT_NULL.finditer(statement):
            column = match.group(1)
            if not re.search(_SET_DEFAULT.format(column), whole) and not _added_with_default(
                whole, column
            ):
                flag(f"SET NOT NULL on {column.lower()} without a default: old inserts fail")
        if re.search(r"\bALTER\s+TABLE\b", statement):
            for match in _ADD_COLUMN.finditer(statement):
                column, definition = match.group(1), match.group(2)
                if column in _NOT_COLUMNS:
                    continue
                required = re.search(r"\bNOT\s+NULL\b|\bPRIMARY\s+KEY\b", definition)
                defaulted = re.search(r"\bDEFAULT\b|\bGENERATED\b", definition)
                if required and not defaulted:
                    flag(f"column {column.lower()} is NOT NULL without a default: old inserts fail")
        for pattern, kind in ((_ROUTINE, "function"), (_VIEW, "view")):
            for match in pattern.finditer(statement):
                name = _bare(match.group(2))
                if name not in earlier:
                    continue
                if match.group(1):
                    flag(
                        f"CREATE OR REPLACE of the {kind} {name}, which an earlier file "
                        "defines: it changes under the previous release's workers too "
                        "(create it under a new name)"
                    )
                else:
                    flag(
                        f"a new {kind} named {name}, as an earlier file's: the previous "
                        "release's calls may become ambiguous or resolve to it "
                        "(use a new name)"
                    )
    return found


def _added_with_default(whole: str, column: str) -> bool:
    for match in _ADD_COLUMN.finditer(whole):
        if match.group(1) == column and re.search(r"\bDEFAULT\b", match.group(2)):
            return True
    return False
