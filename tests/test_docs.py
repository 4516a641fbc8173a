"""The docs site builds with `mkdocs build --strict` (a broken link, a missing anchor or a page left out of the nav
fails it), the README's relative links point at files that exist, and the README keeps the blocks the jobs rewrite."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _need_mkdocs() -> None:
    """mkdocs is in the test extra; a checkout that has not reinstalled skips, CI (`CI` set, as .ci/run does) fails."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("mkdocs is not installed (it is in the test extra: pip install -e '.[test]')")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_docs_site_builds_strict(tmp_path):
    _need_mkdocs()
    done = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The check above has teeth: strict mode turns a link to a missing page into a failed build."""
    _need_mkdocs()
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\n[gone](no-such-page.md)\n")
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def _relative_links(text: str) -> list[str]:
    """Targets of markdown links and images that are not URLs or in-page anchors, anchors dropped."""
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_links_point_at_files_that_exist():
    links = _relative_links(README.read_text())
    assert links, "the README links to its docs pages"
    missing = [t for t in links if not (REPO / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_links_every_docs_page_in_the_nav():
    yaml = pytest.importorskip("yaml")  # PyYAML comes with mkdocs and ray

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages = {next(iter(item.values())) for item in nav}
    linked = {Path(t).relative_to("docs").as_posix() for t in _relative_links(README.read_text()) if t.startswith("docs/")}
    assert pages - {"index.md"} <= linked, f"pages the README does not link: {sorted(pages - linked - {'index.md'})}"
    assert all((REPO / "docs" / p).is_file() for p in pages)


@pytest.mark.parametrize("page,name", [("README.md", "bench-results"), ("README.md", "load-results"), ("docs/soak.md", "soak-results")])
def test_pages_keep_the_blocks_the_jobs_rewrite(page, name):
    """`specray bench --readme README.md`, `specray bench-serve --readme README.md` and
    `specray soak --readme docs/soak.md` rewrite these blocks."""
    text = (REPO / page).read_text()
    assert text.count(f"<!-- {name} -->") == 1 and text.count(f"<!-- /{name} -->") == 1
    assert text.index(f"<!-- {name} -->") < text.index(f"<!-- /{name} -->")


def test_readme_fits_on_a_screen():
    """About 150 lines: the two commands, a tour, the Results and links; everything else is a docs page."""
    assert len(README.read_text().splitlines()) <= 200
