"""A tiny document model rendered twice: Markdown for a PR comment, HTML for a browser.

The report is built once as blocks (headings, paragraphs, tables, code, images, collapsible
details) and each renderer turns the same blocks into its format, so the Markdown and the HTML
can never say different things. The HTML is one self-contained file: styles inline, images as
inline SVG, no script and no network access when it is opened.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Cell:
    """A table cell; ``tone`` colours it in HTML (good, bad, warn, muted) and is ignored in Markdown."""

    text: str
    tone: str = ""
    code: bool = False


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str
    tone: str = ""


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[Union[str, Cell], ...], ...]
    align: str = ""  # one letter per column: l or r (default l)


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Image:
    """A figure: inline SVG in HTML, a link to ``file`` (written beside report.md) in Markdown."""

    alt: str
    svg: str
    file: str


@dataclass(frozen=True)
class Details:
    summary: str
    blocks: tuple["Block", ...] = field(default_factory=tuple)


Block = Union[Heading, Para, Bullets, Table, Code, Image, Details]


# --- Markdown -------------------------------------------------------------------------------

def _md_cell(value: Union[str, Cell]) -> str:
    text = value.text if isinstance(value, Cell) else value
    text = text.replace("|", "\\|").replace("\n", "<br>")
    if isinstance(value, Cell) and value.code and text:
        return f"`{text}`"
    return text


def to_markdown(blocks: list[Block]) -> str:
    """GitHub-flavoured Markdown (tables, <details>) that fits a PR comment or $GITHUB_STEP_SUMMARY."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append("#" * block.level + " " + block.text)
        elif isinstance(block, Para):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            align = block.align or "l" * len(block.headers)
            out.append("\n".join([
                "| " + " | ".join(block.headers) + " |",
                "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
                *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows),
            ]))
        elif isinstance(block, Code):
            fence = "````" if "```" in block.text else "```"
            out.append(f"{fence}\n{block.text}\n{fence}")
        elif isinstance(block, Image):
            out.append(f"![{block.alt}]({block.file})")
        elif isinstance(block, Details):
            out.append(f"<details><summary>{html.escape(block.summary)}</summary>\n\n"
                       + to_markdown(list(block.blocks)) + "\n</details>")
    return "\n\n".join(out) + "\n"


# --- HTML -----------------------------------------------------------------------------------

_CSS = """
body { font: 14px/1.45 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 1150px; padding: 0 16px; color: #1f2328; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #d0d7de; }
h3 { font-size: 15px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; vertical-align: top; }
th { background: #f6f8fa; text-align: left; }
td.r, th.r { text-align: right; }
.good { background: #dafbe1; color: #116329; font-weight: 600; }
.bad { background: #ffebe9; color: #a40e26; font-weight: 600; }
.warn { background: #fff8c5; color: #7d4e00; }
.muted { color: #656d76; }
p.bad, p.good { padding: 6px 10px; display: inline-block; }
pre { background: #f6f8fa; padding: 8px 12px; white-space: pre-wrap; word-break: break-all; font-size: 12px; }
code { font-size: 12px; background: #f6f8fa; padding: 0 3px; }
figure { margin: 8px 0; } figure svg { max-width: 100%; height: auto; }
details { margin: 6px 0; } summary { cursor: pointer; }
"""


def _html_inline(text: str) -> str:
    """Escape, then honour the two Markdown marks the report uses in running text: `code`, **bold**."""
    escaped = html.escape(text)
    parts = escaped.split("`")
    for i in range(1, len(parts), 2):
        parts[i] = f"<code>{parts[i]}</code>"
    joined = "".join(parts)
    bold = joined.split("**")
    for i in range(1, len(bold), 2):
        bold[i] = f"<strong>{bold[i]}</strong>"
    return "".join(bold)


def _html_cell(value: Union[str, Cell], tag: str, align: str) -> str:
    classes = []
    if align == "r":
        classes.append("r")
    if isinstance(value, Cell):
        if value.tone:
            classes.append(value.tone)
        inner = f"<code>{html.escape(value.text)}</code>" if value.code and value.text else _html_inline(value.text)
    else:
        inner = _html_inline(value)
    inner = inner.replace("\n", "<br>")
    attr = f' class="{" ".join(classes)}"' if classes else ""
    return f"<{tag}{attr}>{inner}</{tag}>"


def _html_blocks(blocks: list[Block]) -> list[str]:
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{_html_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Para):
            cls = f' class="{block.tone}"' if block.tone else ""
            out.append(f"<p{cls}>{_html_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            out.append("<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            align = block.align or "l" * len(block.headers)
            head = "".join(_html_cell(h, "th", a) for h, a in zip(block.headers, align))
            body = "".join("<tr>" + "".join(_html_cell(c, "td", a) for c, a in zip(row, align)) + "</tr>"
                           for row in block.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif isinstance(block, Code):
            out.append(f"<pre>{html.escape(block.text)}</pre>")
        elif isinstance(block, Image):
            out.append(f'<figure role="img" aria-label="{html.escape(block.alt)}">{block.svg}</figure>')
        elif isinstance(block, Details):
            # open on the page (a browser has room); folded in Markdown, where a PR comment has not
            out.append(f"<details open><summary>{_html_inline(block.summary)}</summary>"
                       + "".join(_html_blocks(list(block.blocks))) + "</details>")
    return out


def to_html(title: str, blocks: list[Block]) -> str:
    """One self-contained HTML page (no scripts, no external resources)."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(_html_blocks(blocks)) + "\n</body></html>\n")
