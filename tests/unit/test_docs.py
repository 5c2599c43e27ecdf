"""The documents: the flag reference is the command's own, every link lands, the README is short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engramd.cli.flagref import reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A markdown link or image: [text](target), the target up to a space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: Fenced code, whose brackets are code, not links.
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def relative_links(doc: Path) -> list[str]:
    """The targets of `doc`'s links that are not absolute URLs (anchors included)."""
    text = FENCE.sub("", doc.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """The anchor a renderer gives a heading's text (GitHub's: lower case, no punctuation)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """The anchors a renderer gives `doc`'s headings."""
    found: set[str] = set()
    for line in FENCE.sub("", doc.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            name = slug(heading.group(1))
            n = sum(1 for a in found if a == name or re.fullmatch(re.escape(name) + r"-\d+", a))
            found.add(f"{name}-{n}" if n else name)
    return found


def broken(doc: Path, target: str) -> bool:
    """Whether `target` (relative to `doc`) names no file, or no heading of the file it names."""
    name, _, anchor = target.partition("#")
    path = (doc.parent / name) if name else doc
    if not path.exists():
        return True
    return bool(anchor) and path.suffix == ".md" and anchor not in anchors(path)


def test_the_flag_reference_is_what_the_generator_writes() -> None:
    written = (ROOT / "docs" / "flags.md").read_text()
    assert written == reference(), (
        "docs/flags.md differs from the flags declared in engramd/config.py: "
        "run `make docs` (python -m engramd.cli.flagref > docs/flags.md) and commit it"
    )


def test_the_flag_reference_lists_every_flag_of_serve() -> None:
    from engramd.cli.options import FLAGS

    text = reference()
    for flag in FLAGS:
        assert f"| `{flag.option}`" in text, flag.option
        assert f"`{flag.env}`" in text, flag.env
        assert f"`{flag.key}`" in text, flag.key
    for own in ("--config", "--log-level", "--log-json"):
        assert f"| `{own}`" in text, own


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_that_exists(doc: Path) -> None:
    missing = [target for target in relative_links(doc) if broken(doc, target)]
    assert not missing, (
        f"{doc.relative_to(ROOT)} links to files or headings that do not exist: {missing}"
    )


def test_the_small_pages_log_line_points_to_the_fix_commands() -> None:
    """The daemon's one line about 4 KiB pages names a section; it holds every fix."""
    from engramd.host.hugeroot import SMALL_PAGES_DOCS

    name, _, anchor = SMALL_PAGES_DOCS.partition("#")
    doc = ROOT / name
    assert anchor in anchors(doc), f"{SMALL_PAGES_DOCS}: no such heading"
    text = doc.read_text()
    [heading] = [h for h in re.findall(r"^#{1,6} (.*)$", text, re.M) if slug(h) == anchor]
    # To the next heading (## and deeper: a `#` line in the section's code is a comment).
    section = re.split(r"^#{2,6} ", text.split(f" {heading}\n", 1)[1], flags=re.M)[0]
    for command in (
        "mount -t tmpfs -o huge=within_size",
        "deploy/systemd/srv-engramd-shm.mount",
        "mount -o remount,huge=within_size",
        "engramd drop",
        "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
        "--page-size 2M",
    ):
        assert command in section, f"{SMALL_PAGES_DOCS} lacks {command}"


def test_the_readme_stays_a_quickstart() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 250, (
        f"README.md has {lines} lines: keep it under 250 and move the details into docs/"
    )


#: Every `pip install` in the documents, the deployment files and the messages.
PIP_INSTALL = re.compile(r"pip install ([^\n`]*)")
INSTALL_SOURCES = [
    *DOCS,
    *sorted((ROOT / "deploy").rglob("*")),
    *sorted((ROOT / "engramd").rglob("*.py")),
    *sorted((ROOT / "engramd_shared").rglob("*.py")),
    *sorted((ROOT / "client").rglob("*.py")),
]


def test_the_distribution_is_ours_and_no_install_line_fetches_the_other_engramd() -> None:
    """`engramd` on PyPI is an unrelated project with an `engramd` command of its own: an
    install by that name puts foreign code (and no plugin) into an engine's image."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "engramd-node"
    assert project["scripts"] == {"engramd": "engramd.cli.commands:main"}
    fetching_theirs = re.compile(r"""(^|\s)['"]?engramd(\[[^\]]*\])?['"]?(\s|$)""")
    for source in INSTALL_SOURCES:
        if not source.is_file():
            continue
        # What the documents warn against is no install line.
        text = re.sub(
            r"never `pip install engramd`", "", source.read_text(errors="replace"), flags=re.I
        )
        for args in PIP_INSTALL.findall(text):
            assert not fetching_theirs.search(args), f"{source}: pip install {args}"
    readme = (ROOT / "README.md").read_text()
    assert "engramd-node" in readme and "never `pip install engramd`" in readme
    assert "engramd-node" in (ROOT / "docs" / "deploy.md").read_text()
