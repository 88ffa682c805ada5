"""docs/layout.md against the tree, and README.md's limits.

The layout page holds ```text blocks: trees whose lines name a path (first word; a trailing "/"
is a folder, two spaces of indent per level) followed by what it holds. A name in angle brackets
(``<area>/``) is a placeholder: any folder is fine there.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = ROOT / "docs" / "layout.md"
README = ROOT / "README.md"
PACKAGE = ROOT / "src" / "tandem"
TESTS = ROOT / "tests"
IGNORED = {"__pycache__"}
# Folders whose every sub-folder must fit the doc (those directly under them are checked).
TEST_LEVELS = ("", "unit", "integration", "integrations")


def parse_trees(text: str) -> list[tuple[str, bool]]:
    """Every (path relative to the repository, is a folder) the ```text blocks name."""
    entries = []
    blocks = re.findall(r"^```text\n(.*?)^```", text, flags=re.M | re.S)
    assert blocks, "docs/layout.md has no ```text tree block"
    for block in blocks:
        stack: list[tuple[int, str]] = []  # (indent, folder path ending in "/")
        for line in block.splitlines():
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip(" "))
            name = line.split()[0]
            assert indent % 2 == 0, f"odd indent in tree line: {line!r}"
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if not stack:
                assert indent == 0, f"tree line with no parent: {line!r}"
            path = (stack[-1][1] if stack else "") + name
            is_dir = name.endswith("/")
            entries.append((path.rstrip("/"), is_dir))
            if is_dir:
                stack.append((indent, path))
    return entries


def is_placeholder(path: str) -> bool:
    return "<" in path


def named() -> list[tuple[str, bool]]:
    return parse_trees(LAYOUT.read_text())


def covered(relative: str, entries: list[tuple[str, bool]], is_dir: bool) -> bool:
    """Whether the doc names ``relative`` itself, or a placeholder folder in its place."""
    parent = relative.rsplit("/", 1)[0]
    for path, entry_is_dir in entries:
        if path == relative and entry_is_dir == is_dir:
            return True
        if is_dir and entry_is_dir and is_placeholder(path) and path.rsplit("/", 1)[0] == parent:
            return True
    return False


def test_every_package_and_module_of_src_tandem_is_in_the_layout():
    entries = named()
    missing = []
    for child in sorted(PACKAGE.iterdir()):
        relative = child.relative_to(ROOT).as_posix()
        if child.name in IGNORED or child.name.startswith("."):
            continue
        if child.is_dir() and any(child.glob("*.py")):  # a package (regular or namespace)
            if not covered(relative, entries, is_dir=True):
                missing.append(relative + "/")
        elif child.is_file() and child.suffix == ".py":
            if not covered(relative, entries, is_dir=False):
                missing.append(relative)
    assert not missing, f"in src/tandem but not in docs/layout.md: {missing}"


def test_every_src_tandem_path_the_layout_names_exists():
    entries = [(p, d) for p, d in named() if p.startswith("src/")]
    assert any(p == "src/tandem" for p, _ in entries), "docs/layout.md has no src/tandem/ tree"
    wrong = [p for p, d in entries if not (ROOT / p).exists() or (ROOT / p).is_dir() != d]
    assert not wrong, f"named in docs/layout.md but not in the tree (or not of that kind): {wrong}"


def test_every_tests_path_the_layout_names_exists():
    entries = [(p, d) for p, d in named() if p == "tests" or p.startswith("tests/")]
    assert any(p == "tests" for p, _ in entries), "docs/layout.md has no tests/ tree"
    wrong = [
        p
        for p, d in entries
        if not is_placeholder(p) and (not (ROOT / p).exists() or (ROOT / p).is_dir() != d)
    ]
    assert not wrong, f"named in docs/layout.md but not under tests/ (or not of that kind): {wrong}"


def test_every_folder_under_tests_fits_the_layout():
    entries = named()
    stray = []
    for level in TEST_LEVELS:
        folder = TESTS / level if level else TESTS
        if not folder.is_dir():
            continue  # a missing named folder is the test above's to report
        for child in sorted(folder.iterdir()):
            if child.name in IGNORED or child.name.startswith("."):
                continue
            relative = child.relative_to(ROOT).as_posix()
            if child.is_dir():
                if not covered(relative, entries, is_dir=True):
                    stray.append(relative + "/")
            elif level == "" and child.suffix == ".py" and child.name != "__init__.py":
                if not covered(relative, entries, is_dir=False):
                    stray.append(relative)
    assert not stray, f"under tests/ but not in the shape docs/layout.md gives: {stray}"


def test_parse_trees_on_a_known_block():
    text = "x\n```text\na/\n  b.py   what\n  c/     more\n    <area>/\nd/\n```\n"
    assert parse_trees(text) == [
        ("a", True),
        ("a/b.py", False),
        ("a/c", True),
        ("a/c/<area>", True),
        ("d", True),
    ]


def readme_lines() -> list[str]:
    return README.read_text().splitlines()


def test_readme_is_at_most_300_lines():
    assert len(readme_lines()) <= 300, f"README.md has {len(readme_lines())} lines"


def test_readme_names_no_commit_hash():
    hashes = re.findall(r"`([0-9a-f]{7,40})`", README.read_text())
    assert not hashes, f"README.md names commits: {hashes}"


def link_targets(text: str) -> list[str]:
    """Markdown link and image targets, and bare docs/... paths, less anchors; no URLs."""
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    targets += re.findall(r"(?<![\w/(.-])(docs/[\w./-]+\.(?:md|png))", text)
    out = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path = target.split("#", 1)[0]
        if path:
            out.append(path)
    return out


def test_readme_links_only_to_files_that_exist():
    text = README.read_text()
    targets = link_targets(text)
    assert targets, "README.md links to nothing"
    missing = sorted({t for t in targets if not (README.parent / t).exists()})
    outside = sorted({t for t in targets if not (README.parent / t).resolve().is_relative_to(ROOT)})
    assert not missing, f"README.md links to files that do not exist: {missing}"
    assert not outside, f"README.md links outside the repository: {outside}"


def test_docs_index_lists_every_page_and_its_links_exist():
    index = ROOT / "docs" / "index.md"
    text = index.read_text()
    targets = link_targets(text)
    missing = sorted({t for t in targets if not (index.parent / t).exists()})
    assert not missing, f"docs/index.md links to files that do not exist: {missing}"
    listed = {Path(t).name for t in targets}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= listed, f"docs pages missing from docs/index.md: {sorted(pages - listed)}"
