"""report.md and report.html from one structured document (a list of blocks).

``build_document`` turns a Study and its figures into blocks; ``render_markdown`` and
``render_html`` each render the same blocks, so the two files cannot drift apart. The HTML is
self-contained: inline CSS, PNGs embedded as base64 data URIs, no link to any other file.
"""
from __future__ import annotations

import base64
import datetime
import html
from pathlib import Path

from ...utils.table import Table, fmt, markdown_table
from .figures import Figure
from .census_section import census_blocks
from .load import Study

__all__ = ["Table", "build_document", "render_markdown", "render_html"]

VERDICTS = ("held", "not held", "inconclusive", "present", "weak", "absent")  # claims', then the census's


# blocks: ("h1" | "h2" | "p", text), ("list", [text]), ("code", text), ("table", Table),
# ("figure", Figure, src relative to out)
Block = tuple


def _produced_by(study: Study) -> str:
    m = study.meta
    parts = [f"{k.replace('_', ' ')} {m[k]}" for k in ("preset", "config", "base_precision", "seed", "steps")
             if m.get(k) not in (None, "")]
    if m.get("focus_layer") is not None:
        parts.append(f"focus layer L{m['focus_layer']} (layers count from 0)")
    versions = m.get("versions") or {}
    who = {"repro": "`flashguard repro`", "runs": "`flashguard train` runs", "lab": "`flashguard lab`",
           "watch": "`flashguard.watch` on your own model's training (a watch folder, not a flashguard training "
                    "run)"}[study.kind]
    text = f"Produced by {who}" + (f": {', '.join(parts)}" if parts else "") + "."
    if versions:
        text += " Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "."
    sources = ", ".join(str(p) for p in study.sources)
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return text + f" Inputs: {sources}. Written by `flashguard report` on {when}."


def _injection_section(inj: dict) -> list[Block]:
    """The error-injection comparison (injection/injection.json): its verdicts and its runs."""
    def peaks(d):
        return ", ".join(f"{v:.3g}" for _, v in sorted((d or {}).items())) or "-"
    rows = [[fmt(r.get("name")), fmt(r.get("seed")), fmt((r.get("summary") or {}).get("status")),
             fmt((r.get("summary") or {}).get("diverged_at")), fmt(r.get("first_warning")),
             fmt((r.get("summary") or {}).get("final_loss")),
             peaks(r.get("wq_norm_peak")), peaks(r.get("max_logit_peak"))] for r in inj.get("runs") or []]
    claims = [[fmt(c.get("id")), fmt(c.get("title")), fmt(c.get("verdict")), fmt(c.get("evidence"))]
              for c in inj.get("claims") or []]
    out: list[Block] = [("h2", "Error injection: the causal comparison"),
                        ("p", f"{inj.get('about', '')}. Divergence: {inj.get('divergence_rule', '?')}.")]
    if claims:
        out.append(("table", Table(["id", "claim", "verdict", "evidence"], claims, verdict_col=2)))
    out.append(("table", Table(["run", "seed", "status", "diverged at", "monitor warned at", "final loss",
                                "W_Q norm peak (per layer)",
                                "max logit peak (per layer)"], rows)))
    if (inj.get("margin") or {}).get("text"):
        out.append(("p", f"Margin of the real run: {inj['margin']['text']}."))
    return out


RUN_COLUMNS = [("name", None), ("group", None), ("title", None), ("steps", "steps"), ("final loss", "final_loss"),
               ("min loss", "min_loss"), ("diverged at", "diverged_at"), ("max grad norm", "max_grad_norm"),
               ("status", "status")]


def build_document(study: Study, figures: list[Figure], skipped: list[str], lab_figures: list[Figure],
                   out: Path) -> list[Block]:
    title = "flashguard report" + (f": {study.meta['preset']}" if study.meta.get("preset") else "")
    # a reader sees first, in plain words, what ran, what held and what to use (summary_text)
    from .summary_text import summary_from_study
    doc: list[Block] = [("h1", title), *summary_from_study(study), ("h2", "Inputs"), ("p", _produced_by(study))]
    if study.kind != "lab":
        doc.append(("h2", "Claims"))
        if study.claims:
            doc.append(("table", Table(["id", "claim", "verdict", "evidence"],
                                       [[fmt(c.get("id")), fmt(c.get("title")), fmt(c.get("verdict")),
                                         fmt(c.get("evidence"))] for c in study.claims], verdict_col=2)))
        elif study.kind == "watch" or any(r.watch is not None for r in study.runs):
            doc.append(("p", "No claims: watch folders of your own model's training (flashguard.watch: the probes of "
                             "its attention and the monitor, recorded while it trained; not flashguard training runs)"
                        + ("" if study.kind == "watch" else ", beside plain training runs") + "."))
        else:
            doc.append(("p", "No claims: plain training runs (no repro.json), shown side by side."))
        if study.injection is not None:
            doc += _injection_section(study.injection)
        doc.append(("h2", "Runs"))
        rows = [[r.name, r.group, r.title] + [fmt(r.summary.get(k)) for _, k in RUN_COLUMNS[3:]] for r in study.runs]
        doc.append(("table", Table([c for c, _ in RUN_COLUMNS], rows)))
        if study.remedies:
            doc += [("h2", "Remedies"),
                    ("table", Table(["name", "remedy", "diverged at", "final train loss", "min train loss",
                                     "last val loss"],
                                    [[fmt(m.get(k)) for k in ("name", "title", "diverged_at", "final_loss", "min_loss",
                                                              "last_val")]
                                     for m in study.remedies]))]
        doc.append(("h2", "Figures"))
        doc += [("figure", f, f.path.relative_to(out).as_posix()) for f in figures]
        if skipped:
            doc.append(("list", skipped))
        doc += census_blocks(study)
    doc.append(("h2", "Lab: the arithmetic facts"))
    if study.lab is None:
        doc.append(("p", "No lab folder given (run `flashguard lab`, then pass its folder or --lab DIR)."))
    else:
        res = study.lab.result
        doc.append(("p", f"From {study.lab.dir} (`flashguard lab`{', quick' if res.get('quick') else ''}; facts tested "
                         f"in the {res.get('policy', '?')} arithmetic, seed {res.get('seed', '?')}); the full tables "
                         "are in its lab.md."))
        from ..lab.report import TITLES
        details = res.get("details") or {}
        rows = []
        for key, verdict in res["verdicts"].items():
            ev = list(details.get(key) or [])
            rows.append([TITLES.get(key, key), fmt(verdict),
                         "; ".join(ev[:3]) + (f"; ... ({len(ev) - 3} more)" if len(ev) > 3 else "")])
        doc.append(("table", Table(["fact", "verdict", "evidence"], rows, verdict_col=1)))
        doc += [("figure", f, f.path.relative_to(out).as_posix()) for f in lab_figures]
    if study.notes:
        doc += [("h2", "Notes"), ("list", study.notes)]
    return doc


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: list[Block]) -> str:
    out = []
    for kind, *rest in doc:
        if kind == "h1":
            out += [f"# {rest[0]}", ""]
        elif kind == "h2":
            out += [f"## {rest[0]}", ""]
        elif kind == "p":
            out += [rest[0], ""]
        elif kind == "list":
            out += [f"- {item}" for item in rest[0]] + [""]
        elif kind == "code":
            out += ["```python", rest[0], "```", ""]
        elif kind == "table":
            t = rest[0]
            rows = [[_md_cell(f"**{c}**" if i == t.verdict_col else c) for i, c in enumerate(row)] for row in t.rows]
            out += [markdown_table(t.header, rows), ""]
        elif kind == "figure":
            f, src = rest
            out += [f"![{f.title}]({src})", "", f"*{f.title}.* {f.caption}", ""]
    return "\n".join(out)


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { margin-top: 1.8em; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: .35em .6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.v-held { background: #d4f4d4; color: #135f13; font-weight: 600; }
td.v-not-held { background: #f8d4d4; color: #8a1414; font-weight: 600; }
td.v-inconclusive { background: #e6e6e6; color: #444; font-weight: 600; }
td.v-present { background: #fbe3c8; color: #7a3d00; font-weight: 600; }
td.v-weak { background: #fdf3d0; color: #6b5400; font-weight: 600; }
td.v-absent { background: #e6e6e6; color: #444; font-weight: 600; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.92em; color: #444; }
code { background: #f4f4f4; padding: 0 .2em; }
pre { background: #f4f4f4; padding: .6em .8em; overflow-x: auto; }
pre code { padding: 0; }
"""


def _inline(text: str) -> str:
    """Escape, then turn `code` spans (the only Markdown the text uses) into <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def _verdict_class(text: str) -> str:
    return "v-" + text.strip().replace(" ", "-") if text.strip() in VERDICTS else ""


def render_html(doc: list[Block]) -> str:
    title = next((rest[0] for kind, *rest in doc if kind == "h1"), "flashguard report")
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title>", f"<style>{CSS}</style></head><body>"]
    for kind, *rest in doc:
        if kind in ("h1", "h2", "p"):
            out.append(f"<{kind}>{_inline(rest[0])}</{kind}>")
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in rest[0]) + "</ul>")
        elif kind == "code":
            out.append(f"<pre><code>{html.escape(rest[0])}</code></pre>")
        elif kind == "table":
            t = rest[0]
            out.append("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
                       + "</tr></thead><tbody>")
            for row in t.rows:
                cells = []
                for i, c in enumerate(row):
                    cls = _verdict_class(c) if i == t.verdict_col else ""
                    cells.append(f'<td class="{cls}">' if cls else "<td>")
                    cells[-1] += _inline(c) + "</td>"
                out.append("<tr>" + "".join(cells) + "</tr>")
            out.append("</tbody></table>")
        elif kind == "figure":
            f = rest[0]
            data = base64.b64encode(f.path.read_bytes()).decode("ascii")
            out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(f.title)}">'
                       f"<figcaption><b>{html.escape(f.title)}.</b> {_inline(f.caption)}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
