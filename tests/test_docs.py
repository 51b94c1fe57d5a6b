"""The documentation stays navigable: the benchmark summary and each benchmark page fit in 300 lines,
and every relative link in the README, the changelog and docs/ reaches an existing file and, for an
#anchor into a markdown file, an existing heading (GitHub's heading slugs). Reads files only."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_BENCHMARK_PAGE_LINES = 300
LINKING_FILES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")])

_FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)   # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text with fenced code blocks and inline code removed: links and headings in code are not links."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lowercased, every character other than a
    letter, digit, space, '-' or '_' dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading renders as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every #anchor a markdown file offers: its heading slugs (a repeated slug gets -1, -2, ...) and
    explicit <a name/id> anchors."""
    text = _FENCE.sub("", path.read_text())
    found: set[str] = set(_HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(text):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def relative_links(path: Path) -> list[str]:
    text = _prose(path.read_text())
    targets = _LINK.findall(text) + _REFERENCE_DEFINITION.findall(text)
    return [t for t in targets if not _EXTERNAL.match(t)]


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for link in relative_links(path):
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no file {_shown(resolved)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{link}: no heading with anchor #{anchor} in {_shown(resolved)}")
    return broken


def test_github_slug_follows_githubs_rules():
    assert github_slug("RAG: TTFT and fidelity against full prefill (CPU)") == "rag-ttft-and-fidelity-against-full-prefill-cpu"
    assert github_slug("Qwen2.5-Coder-0.5B-Instruct") == "qwen25-coder-05b-instruct"
    assert github_slug("`min_blend_tokens`") == "min_blend_tokens"
    assert github_slug("Early encodings (min_context_tokens)") == "early-encodings-min_context_tokens"


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Setup\n\n```\n## not a heading\n```\n\n## Setup\n")
    assert anchors(page) == {"title", "setup", "setup-1"}


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("## Present heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#present-heading) [gone](missing.md) [bad](other.md#absent) "
                    "[self](#nowhere) `[code](ignored.md)` [web](https://example.com/x.md)\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "other.md#absent", "#nowhere"]


def test_the_benchmark_summary_and_each_benchmark_page_fit_in_300_lines():
    pages = [DOCS / "benchmarks.md", *sorted((DOCS / "benchmarks").glob("*.md"))]
    assert len(pages) > 1, "docs/benchmarks/ holds no page"
    too_long = {_shown(p): n for p in pages
                if (n := len(p.read_text().splitlines())) > MAX_BENCHMARK_PAGE_LINES}
    assert not too_long, f"pages over {MAX_BENCHMARK_PAGE_LINES} lines: {too_long}"


@pytest.mark.parametrize("path", LINKING_FILES, ids=_shown)
def test_every_relative_link_reaches_a_file_and_heading(path: Path):
    broken = broken_links(path)
    assert not broken, "\n".join(broken)
