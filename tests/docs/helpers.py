"""Reading the project's Markdown: its links, its headings' anchors, and the README's tour."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOUR_MARK = "<!-- tour"  # the HTML comment right above the README's tour block

_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^()\s]+)\)")
_AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>\s]+)>")
_CODE_SPAN = re.compile(r"`+[^`]*`+")


def documents() -> list[Path]:
    """Every Markdown file the project documents itself with: README.md, docs/, deploy/README.md."""
    return [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    out, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append((number, _CODE_SPAN.sub("``", line)))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in ``text``'s prose (link text may wrap lines)."""
    kept = dict(prose_lines(text))
    prose = "\n".join(kept.get(n, "") for n in range(1, len(text.splitlines()) + 1))
    found = []
    for pattern in (_LINK, _IMAGE, _AUTOLINK):
        found += [(m.start(1), m.group(1)) for m in pattern.finditer(prose)]
    return [(prose.count("\n", 0, start) + 1, target) for start, target in sorted(found)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading_anchors(text: str) -> set[str]:
    """The anchors of ``text``'s headings, code spans included in their text as GitHub keeps them (a
    repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        out.add(base if not count else f"{base}-{count}")
        seen[base] = count + 1
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """What is wrong with the links of the Markdown file ``path`` (empty: nothing): a link out of the
    repository, a relative path that does not exist, an anchor no heading of its file has."""
    text = path.read_text() if text is None else text
    problems = []
    for number, target in links(text):
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            problems.append(f"{where}: links outside the repository")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{where}: points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md":
            headings = heading_anchors(text if resolved == path else resolved.read_text())
            if anchor not in headings:
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def tour(text: str) -> tuple[str, list[str]]:
    """The README's tour: its first line (the state-dir assignment) and each command after it."""
    start = text.index(TOUR_MARK)
    block = text[text.index("```", start):]
    body = block[block.index("\n") + 1:block.index("\n```", 3)]
    lines = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return lines[0], lines[1:]
