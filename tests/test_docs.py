"""The README and the docs point at files that exist: every relative Markdown link and image in
README.md and docs/*.md resolves to a file or folder of the checkout (a page moved or renamed
breaks the test, not the reader). Links inside code (fenced blocks, `inline`) are not links."""
import re
from urllib.parse import unquote

import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit

PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*(?:<([^>\n]+)>|([^)\s]+))(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)          # http:, https:, mailto:, ...


def relative_links(text):
    """The relative targets of a page's Markdown links and images, anchors dropped."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = []
    for bracketed, bare in LINK.findall(text):
        target = bracketed or bare
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        targets.append(unquote(target.split("#", 1)[0]))
    return targets


def test_link_parser_finds_links_and_skips_code_and_urls():
    text = ("See [a](docs/a.md#part), ![plot](results/x.png) and [b](<b c.md>).\n"
            "`[not](inline.md)` [web](https://example.org/x.md) [top](#top)\n"
            "```\n[fenced](fenced.md)\n```\n")
    assert relative_links(text) == ["docs/a.md", "results/x.png", "b c.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = (page.parent / target).resolve()
        if not (path.exists() and path.is_relative_to(ROOT)):
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_readme_is_a_front_door():
    """Issue 24: at most ~120 lines, with the quick check, the plugin, the evidence and the
    limitations findable from it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 120
    assert "bash scripts/run_lab.sh" in text and "bash scripts/test.sh" in text
    assert "python -m pytest -m unit" in text
    assert "hc.DistributedOptimizer(" in text
    assert "## Limitations" in text
    links = relative_links(text)
    assert any(link.startswith("results/") for link in links)
    assert {"docs/performance.md", "docs/extending.md", "docs/instructor.md",
            "docs/testing.md"} <= set(links)
