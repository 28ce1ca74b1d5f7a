"""The package's face stays small: few public names, few settings, short modules.

Issue 36 cut the ``__all__`` lists from 107 names to 60 (22 -> 19 at the top
level), the documented settings keys from 41 to 25 and every module to 500
lines at most. These bounds keep them from growing back one reasonable-looking
addition at a time; raising one is a decision to take on purpose, here.

Read from the source with ``ast``, not by importing: a module behind an
optional dependency (celery, prometheus) counts as much as the others.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from flask_idempotency.config_keys import GROUPED, config_key
from flask_idempotency.settings import Settings

PACKAGE = Path(__file__).resolve().parents[2] / "flask_idempotency"

#: All ``__all__`` lists of the package together.
MAX_PUBLIC_NAMES = 60
#: ``flask_idempotency.__all__`` alone.
MAX_TOP_LEVEL_NAMES = 20
#: Keys the configuration page lists (a group of options is one key).
MAX_SETTINGS_KEYS = 25
#: Lines of any one module, docstrings and comments included.
MAX_MODULE_LINES = 500
#: Modules allowed over the bound (none: split a module by reason to change instead).
LONG_FOR_NOW: set[str] = set()


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _all_names(path: Path) -> list[str] | None:
    """The module's ``__all__`` as written, or ``None`` when it has none."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            names = ast.literal_eval(value)
            assert isinstance(names, list | tuple), path
            return [str(name) for name in names]
    return None


def _public_names() -> dict[str, list[str]]:
    found = {}
    for path in _modules():
        names = _all_names(path)
        if names is not None:
            found[str(path.relative_to(PACKAGE))] = names
    return found


def test_all_the_all_lists_together_stay_within_the_bound() -> None:
    public = _public_names()
    total = sum(len(names) for names in public.values())
    listing = "\n".join(f"{len(n):3d} {module}" for module, n in sorted(public.items()))
    assert total <= MAX_PUBLIC_NAMES, f"{total} public names:\n{listing}"


def test_the_top_level_exports_stay_within_the_bound() -> None:
    names = _all_names(PACKAGE / "__init__.py")
    assert names is not None
    assert len(names) <= MAX_TOP_LEVEL_NAMES, sorted(names)
    assert len(set(names)) == len(names), "a name listed twice"


def test_the_public_names_are_not_private_ones() -> None:
    """A name in ``__all__`` is public; an internal one is private by its name."""
    listed = [
        (module, name)
        for module, names in _public_names().items()
        for name in names
        if name.startswith("_")
    ]
    assert listed == []


def test_the_documented_settings_keys_stay_within_the_bound() -> None:
    """Counted as the configuration page lists them (``docs/_ext``): each key that
    is not an option of a group, and each group once."""
    keys = {
        f"IDEMPOTENCY_{GROUPED[field.name][0].upper()}"
        if field.name in GROUPED
        else config_key(field.name)
        for field in dataclasses.fields(Settings)
    }
    assert len(keys) <= MAX_SETTINGS_KEYS, sorted(keys)


def test_no_module_is_longer_than_the_bound() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in _modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert set(long) <= LONG_FOR_NOW, long


def test_the_bounds_are_measured_on_the_real_package() -> None:
    """The sanity check: the walk finds the package's modules and its lists."""
    assert len(_modules()) > 50
    assert "__init__.py" in _public_names()
