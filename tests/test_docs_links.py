"""Every relative link in README.md and docs/ leads somewhere: the file or directory exists, and a ``#anchor`` names
a heading of the Markdown file it points into (GitHub's slugs), so a renamed heading or a moved page fails here,
not in a reader's browser (issue 57)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose_lines(text: str, blank_code: bool = True):
    """(line number, line) outside fenced code blocks, with inline code spans blanked out (``blank_code``: a
    link inside one is an example, while a heading's code is part of its anchor)."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, INLINE_CODE.sub("", line) if blank_code else line


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of each inline or reference-definition link of a Markdown text."""
    found = []
    for number, line in prose_lines(text):
        found += [(number, match.group(1)) for match in LINK.finditer(line)]
        reference = REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def heading_text(markdown: str) -> str:
    """A heading as rendered: links reduced to their text, emphasis and code marks dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("*", "").replace("~", "")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = heading_text(heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a Markdown page has: its headings' slugs (repeats get ``-1``, ``-2``...) and HTML anchors."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text, blank_code=False):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """``page:line target (why)`` for each relative link of ``page`` that leads nowhere."""
    text, problems = page.read_text(), []
    for number, target in links(text):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        why = None
        if not dest.exists():
            why = "no such file"
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            why = f"no heading #{anchor} in {dest.relative_to(root) if dest.is_relative_to(root) else dest}"
        if why:
            problems.append(f"{page.relative_to(root)}:{number} {target} ({why})")
    return problems


def documentation_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def test_slugs_are_githubs():
    assert slug("Shutdown, faults and security") == "shutdown-faults-and-security"
    assert slug("`clover serve`: the Triton model") == "clover-serve-the-triton-model"
    assert slug("What speed to expect?") == "what-speed-to-expect"
    assert slug("Step 1 — τ & the [tree](trees.md)") == "step-1--τ--the-tree"
    assert slug("`draft_step`: one regressive step") == "draft_step-one-regressive-step"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n<a name=\"here\"></a>\n") == {"a", "a-1", "here"}


def test_the_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n## Its part\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/other.md#its-part) [also](#top) [web](https://example.com/x#y) `[code](nowhere.md)`\n"
        "# Top\n[gone](docs/missing.md) [bad anchor](docs/other.md#no-part) [self](#nowhere)\n"
        "```\n[fenced](nowhere.md)\n```\n[ref]: docs/absent.md\n")
    found = broken_links(tmp_path / "README.md", tmp_path)
    assert found == ["README.md:3 docs/missing.md (no such file)",
                     "README.md:3 docs/other.md#no-part (no heading #no-part in docs/other.md)",
                     "README.md:3 #nowhere (no heading #nowhere in README.md)",
                     "README.md:7 docs/absent.md (no such file)"], found


def test_no_broken_links_in_readme_and_docs():
    pages = documentation_pages()
    assert len(pages) > 20 and sum(len(links(p.read_text())) for p in pages) > 100, "the pages were not read"
    found = [problem for page in pages for problem in broken_links(page)]
    assert not found, f"{len(found)} broken links:\n" + "\n".join(found)


README_MAX_LINES = 200  # the README is the front page: what does not fit goes to docs/ (issue 62)


def test_readme_fits_its_line_limit():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, more than {README_MAX_LINES}"


def test_readme_shows_the_list_prompt_the_demo_decodes():
    """README's measured line is for its list prompt; clover serve --demo must decode that same prompt."""
    from clover.serving.launch import DEMO_PROMPTS

    shown = re.findall(r'^clover generate --prompt "(.*)"$', (ROOT / "README.md").read_text(), re.MULTILINE)
    assert shown and shown[0] == DEMO_PROMPTS[0], (shown, DEMO_PROMPTS[0])
