"""The README and every page under docs/ point only at things that exist.

- every relative link ``[text](path)`` names a file of the repository, and every ``#anchor`` (in
  ``path#anchor`` or ``#anchor``) is a heading of the target, slugged as GitHub does, or an
  explicit ``<a id=...>``/``<a name=...>``;
- every repository path in backticks (``tests/...``, ``examples/...``, ``sql/...``, ...) exists;
- every test named in backticks (``test_x``, ``test_file.py``, ``test_file.py::test_x``) is
  defined under tests/.

External http(s) and mailto links are not fetched. The checker is also run on pages broken on
purpose, so a test that cannot fail would be caught.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Outputs that commands write, named in the docs but not kept in the repository.
GENERATED = ("bench/results/",)
PATH_PREFIXES = ("tests/", "examples/", "sql/", "pglockkit/", "bench/", "docs/", "migrations/", ".ci/")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"(`+)(.+?)\1", flags=re.DOTALL)


def _prose(text: str) -> str:
    """The page without its fenced code blocks (headings and links there are not the page's)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page defines: its headings' slugs (repeats get -1, -2, ...) and explicit ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(text), flags=re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def _tests_defined() -> tuple[set[str], dict[str, set[str]]]:
    names: set[str] = set()
    by_file: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined = set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), flags=re.MULTILINE))
        by_file[path.name] = defined
        names |= defined
    return names, by_file


def problems(page: Path, text: str) -> list[str]:
    """What is broken in one page: links, anchors, paths and test names that do not exist."""
    out: list[str] = []
    prose = _prose(text)
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{page.name}: link to a missing file: {target}")
            continue
        if anchor:
            if dest.suffix != ".md":
                out.append(f"{page.name}: anchor into a file that is not markdown: {target}")
            elif anchor not in anchors(text if not path else dest.read_text()):
                out.append(f"{page.name}: no heading or anchor #{anchor} in {dest.name}: {target}")
    names, by_file = _tests_defined()
    for _, code in CODE.findall(prose):
        code = code.strip()
        is_path = code.startswith(PATH_PREFIXES) and re.fullmatch(r"[\w./-]+", code)
        if is_path and not code.startswith(GENERATED) and not (ROOT / code).exists():
            out.append(f"{page.name}: no such path: `{code}`")
        for file, _, test in re.findall(r"\b(test_\w+\.py)(::(test_\w+))?", code):
            if file not in by_file:
                out.append(f"{page.name}: no such test file: `{file}`")
            elif test and test not in by_file[file]:
                out.append(f"{page.name}: no test {test} in {file}")
        if re.fullmatch(r"test_\w+", code) and code not in names:
            out.append(f"{page.name}: no such test: `{code}`")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_path_and_test_name_resolves(page):
    assert problems(page, page.read_text()) == []


def test_the_readme_links_every_page_under_docs():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(_prose(readme))}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert missing == []


def test_every_page_under_docs_links_back_to_the_readme():
    for page in PAGES[1:]:
        if page.name == "sql.md":  # generated from the catalog
            continue
        assert "(../README.md" in page.read_text(), page.name


def test_the_checker_catches_broken_links_anchors_paths_and_test_names():
    page = ROOT / "docs" / "locks.md"
    broken = (
        "# A page\n\n## Its section\n\n"
        "[ok](#its-section) [ok](../README.md#which-lock-should-i-use) [ok](https://example.com/nowhere)\n"
        "[gone](nowhere.md) [gone](#no-such-section) [gone](../README.md#no-such-heading)\n"
        "`tests/no_such_file.py` `test_no_such_test_anywhere` `test_queue.py::test_no_such_test`\n"
        "`test_no_such_file.py`\n\n"
        "```\n## Not a heading\n[not a link](nowhere-either.md)\n```\n"
    )
    found = problems(page, broken)
    assert found == [
        "locks.md: link to a missing file: nowhere.md",
        "locks.md: no heading or anchor #no-such-section in locks.md: #no-such-section",
        "locks.md: no heading or anchor #no-such-heading in README.md: ../README.md#no-such-heading",
        "locks.md: no such path: `tests/no_such_file.py`",
        "locks.md: no such test: `test_no_such_test_anywhere`",
        "locks.md: no test test_no_such_test in test_queue.py",
        "locks.md: no such test file: `test_no_such_file.py`",
    ]


def test_slugs_are_githubs():
    assert slug("Which lock should I use?") == "which-lock-should-i-use"
    assert slug("`pglockkit once`") == "pglockkit-once"
    assert slug("Install, privileges and uninstall") == "install-privileges-and-uninstall"
    assert slug("Errors and SQLSTATEs") == "errors-and-sqlstates"
    assert anchors('# A\n## B\n## B\n<a id="x"></a>\n') == {"a", "b", "b-1", "x"}


# The public docstrings' examples are skipped by doctest (they need a database), so nothing
# checked the results they print. These two can be checked without one.


def test_the_register_namespace_docstring_shows_the_derived_id():
    import pglockkit

    # register_namespace(conn, "billing", ...) with no id returns the id derived from the name.
    doc = pglockkit.register_namespace.__doc__
    name, shown = re.search(r'>>> register_namespace\(conn, "(\w+)"[^\n]*\n\s*(\d+)', doc).groups()
    assert int(shown) == pglockkit.namespace_id(name), (name, shown)


def test_the_install_docstring_shows_a_result_install_can_return():
    import pglockkit
    from pglockkit.install import migrations_dir

    # install() returns the migrations it recorded: all of them, in order, on a fresh database (the
    # first example), or the deltas an older install lacks; never the baseline alone.
    ids = sorted(p.stem for p in migrations_dir().glob("*.sql"))
    shown = re.search(r">>> install\([^\n]*\n\s*\[(.*)\]", pglockkit.install.__doc__).group(1)
    listed = [s.strip().strip("'") for s in shown.split(",") if s.strip() != "..."]
    assert listed and listed == ids[: len(listed)], shown
