"""Every link and image in the repository's Markdown points at something that exists, inside the
repository: a file or folder, and where it names one, an anchor of that page. No network: web
links (any ``scheme:``) are not followed.

Scope: every ``.md`` file of the checkout that git tracks or would (README.md, docs/, bench/,
examples/, ...; ignored folders such as ``.venv`` are not read). Read: inline links and images
``[text](target "title")``, reference definitions ``[label]: target``, and HTML ``<img src>`` /
``<a href>``; not what sits in fenced code blocks, inline code or HTML comments. Anchors are
GitHub's: each heading's text, lowercased, every character that is not a letter, digit, ``_``,
``-`` or space dropped, spaces made ``-``; a repeated heading gets ``-1``, ``-2``, ...; ``<a
name>`` / ``id`` attributes count too.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"build", "dist", "node_modules", "__pycache__"}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
# [text](target) / ![alt](target), the text holding at most one level of nested brackets.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML_REF = re.compile(r"<(?:img|a|source)\b[^>]*?\s(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_HTML_ANCHOR = re.compile(r"<[a-z]+\b[^>]*?\s(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_ATX = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)\s*$")


def markdown_files(root: Path) -> list[Path]:
    """The ``.md`` files of the checkout as git sees them (tracked, or new and not ignored); outside
    a git checkout every ``.md`` under ``root`` less hidden folders (``.venv``, ...) and build output."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.md"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        listed = None
    if listed is not None and (root / ".git").exists():
        return sorted({root / name for name in listed.decode().split("\0") if name and (root / name).is_file()})
    out = []
    for path in sorted(root.rglob("*.md")):
        parts = path.relative_to(root).parts[:-1]
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        out.append(path)
    return out


def prose_lines(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, line, line without its inline code) outside fenced code and HTML comments."""
    text = _COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text)
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if m and m.group(1).startswith(fence):
                fence = None
            continue
        yield number, line, _CODE_SPAN.sub("", line)


def targets(text: str) -> Iterator[tuple[int, str]]:
    """Every link target of a page, with its line."""
    for number, _, line in prose_lines(text):
        for rx in (_INLINE, _REF_DEF, _HTML_REF):
            for m in rx.finditer(line):
                yield number, m.group(1).strip("<>")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image counts as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a page offers: its headings' slugs (repeats numbered) and HTML ids/names."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    previous = ""
    for _, line, prose in prose_lines(text):
        out.update(_HTML_ANCHOR.findall(prose))
        m = _ATX.match(line)
        heading = m.group(2) if m else (previous.strip() if previous.strip() and _SETEXT.match(line) else None)
        previous = line
        if heading is None:
            continue
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(root: Path) -> list[str]:
    """``file:line: target (why)`` for each link that points nowhere."""
    root = root.resolve()
    problems = []
    for page in markdown_files(root):
        text = page.read_text(encoding="utf-8")
        rel = page.relative_to(root)
        for number, target in targets(text):
            if _SCHEME.match(target):
                continue  # a web address (or mailto:): not followed
            path_part, _, anchor = target.partition("#")
            path_part = re.sub(r"%20", " ", path_part.split("?", 1)[0])
            dest = (root / path_part.lstrip("/")) if path_part.startswith("/") else (page.parent / path_part)
            dest = dest.resolve() if path_part else page
            where = f"{rel}:{number}: {target}"
            if not dest.is_relative_to(root):
                problems.append(f"{where} (outside the repository)")
            elif not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where} (no heading or id {anchor!r} in {dest.relative_to(root)})")
    return problems


def test_every_markdown_link_and_image_resolves() -> None:
    pages = markdown_files(ROOT)
    assert ROOT / "README.md" in pages and ROOT / "docs" / "conformance.md" in pages
    problems = broken_links(ROOT)
    assert not problems, "broken links in the Markdown:\n" + "\n".join(problems)


# -- the checker itself: each kind of break is found, nothing else is --------------------------------

_GOOD = {
    "README.md": (
        "# Title\n\nSee [docs](docs/a.md), [a section](docs/a.md#a-heading-with-code), ![img](docs/img/x.png),\n"
        '[folder](docs/), [here](#title), [web](https://example.com/nowhere), <img src="docs/img/x.png">,\n'
        "[twice](docs/a.md#same-1), [id](docs/a.md#custom) and\n\n[ref]: docs/a.md#setext-heading\n"
    ),
    "docs/a.md": (
        '# A heading with `code`!\n\n## Same\n\n## Same\n\n<a name="custom"></a>\n\nSetext heading\n---\n\n'
        "```bash\n[not a link](missing.md)\n```\n\nInline `[not a link](missing.md)` and <!-- [hidden](gone.md) -->\n"
    ),
    "docs/img/x.png": "",
}

_BREAKS = {
    "a missing file": ("see [x](docs/missing.md)", "no such file"),
    "a missing image": ("![x](docs/img/missing.png)", "no such file"),
    "a missing anchor": ("[x](docs/a.md#no-such-heading)", "no heading or id 'no-such-heading'"),
    "a missing anchor on the same page": ("[x](#nowhere)", "no heading or id 'nowhere'"),
    "a path outside the repository": ("[notes](../shared/gpu/README.md)", "outside the repository"),
    "a reference definition to nothing": ("\n[r]: docs/gone.md", "no such file"),
    "an HTML image to nothing": ('<img src="docs/img/gone.png">', "no such file"),
}


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_tree_whose_links_all_resolve_passes(tmp_path: Path) -> None:
    _tree(tmp_path / "repo", _GOOD)
    assert broken_links(tmp_path / "repo") == []


@pytest.mark.parametrize("kind", sorted(_BREAKS))
def test_each_kind_of_broken_link_is_found(tmp_path: Path, kind: str) -> None:
    line, why = _BREAKS[kind]
    files = dict(_GOOD)
    files["README.md"] += "\n" + line + "\n"
    _tree(tmp_path / "repo", files)
    (problem,) = broken_links(tmp_path / "repo")
    assert problem.startswith("README.md:") and why in problem, problem


def test_hidden_and_build_folders_are_not_read(tmp_path: Path) -> None:
    files = dict(_GOOD)
    files[".venv/lib/x.md"] = "[x](missing.md)"
    files["build/lib/y.md"] = "[y](missing.md)"
    _tree(tmp_path / "repo", files)
    assert broken_links(tmp_path / "repo") == []


def test_slugs_follow_github() -> None:
    assert slug("ai-dynamo 1.6.x") == "ai-dynamo-16x"
    assert slug("`stream_version_spans` (per token)") == "stream_version_spans-per-token"
    assert slug("Prompt logprobs: SGLang 0.5.16 names the vocabulary's last id 0") == (
        "prompt-logprobs-sglang-0516-names-the-vocabularys-last-id-0"
    )
    assert slug("Results on 2 \u00d7 H200 (2026-11-30): not obtained") == "results-on-2--h200-2026-11-30-not-obtained"
