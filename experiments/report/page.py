"""Page assembly shared by the reports: figures as divs with fixed ids, plotly.js inline once,
tables sortable by a click on a header (a small inline script), and CDF helpers.

Determinism: plotly would give each div a random id, so every figure is passed `div_id`;
nothing here reads the clock.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

import numpy as np

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")

_STYLE = """
body{font-family:sans-serif;margin:16px 24px;color:#222}
h1{font-size:22px;margin:4px 0}h2{font-size:17px;margin:18px 0 4px}
.note{color:#555;font-size:13px;max-width:1100px}
table{border-collapse:collapse;font-size:12px;margin:6px 0}
th,td{border:1px solid #ccc;padding:2px 6px;text-align:right;white-space:nowrap}
th{background:#eee;cursor:pointer;user-select:none}
td.t,th.t{text-align:left}
td.w{white-space:normal;min-width:300px;max-width:520px}
summary{cursor:pointer}
tr.win td{background:#fff3c4;font-weight:bold}
tr.bad td{color:#999}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
pre{background:#f6f6f6;padding:6px;font-size:12px;white-space:pre-wrap;max-width:1200px}
"""

# Click a header: sort the rows by that column (numbers by data-v, else text), again to reverse.
_SORT_JS = """
document.querySelectorAll('table.sortable').forEach(function(t){
 t.querySelectorAll('th').forEach(function(th,i){
  th.addEventListener('click',function(){
   var asc=th.getAttribute('aria-sort')!=='ascending';
   t.querySelectorAll('th').forEach(function(h){h.removeAttribute('aria-sort')});
   th.setAttribute('aria-sort',asc?'ascending':'descending');
   var body=t.tBodies[0],rows=Array.prototype.slice.call(body.rows);
   function key(r){var c=r.cells[i],v=c.getAttribute('data-v');
    return v===null?c.textContent:(v===''?null:parseFloat(v));}
   rows.sort(function(a,b){var x=key(a),y=key(b);
    if(x===y)return 0;if(x===null)return 1;if(y===null)return -1;
    var c=(typeof x==='number'&&typeof y==='number')?x-y:String(x).localeCompare(String(y));
    return asc?c:-c;});
   rows.forEach(function(r){body.appendChild(r)});
  });
 });
});
"""


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def figure_div(fig, div_id: str) -> str:
    """The figure as a div with a fixed id (plotly.js is in the page's head)."""
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": False})


def page(title: str, parts: Sequence[str]) -> str:
    """A whole HTML page: plotly.js inline in the head, then the parts in order."""
    from plotly.offline import get_plotlyjs

    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" + esc(title)
            + "</title><style>" + _STYLE + "</style><script type='text/javascript'>"
            + get_plotlyjs() + "</script></head><body>\n<h1>" + esc(title) + "</h1>\n"
            + "\n".join(parts) + "\n<script>" + _SORT_JS + "</script></body></html>\n")


LONG = 70  # characters of a table cell shown before the rest folds away


def cell(value: object, digits: int = 3) -> str:
    """A table cell: numbers right-aligned with their exact value in data-v for sorting."""
    if value is None:
        return "<td data-v=''>-</td>"
    if isinstance(value, bool):
        return f"<td class='t'>{'yes' if value else 'no'}</td>"
    if isinstance(value, (int, float)):
        text = f"{value:,}" if isinstance(value, int) else f"{value:,.{digits}f}"
        return f"<td data-v='{float(value)!r}'>{text}</td>"
    text = str(value)
    if len(text) <= LONG:
        return f"<td class='t'>{esc(text)}</td>"
    # a long text (an infeasible candidate's reason): its start, the whole on a click
    return (f"<td class='t w'><details><summary>{esc(text[:LONG])}...</summary>{esc(text)}"
            "</details></td>")


def table(table_id: str, headers: Sequence[str], rows: Sequence[Sequence[object]],
          row_classes: Sequence[str] | None = None, text_cols: Sequence[int] = ()) -> str:
    """A sortable table; `row_classes` style rows (`win`, `bad`)."""
    head = "".join(f"<th class='{'t' if i in text_cols else ''}'>{esc(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    for n, row in enumerate(rows):
        cls = row_classes[n] if row_classes else ""
        body.append(f"<tr class='{cls}'>" + "".join(cell(v) for v in row) + "</tr>")
    return (f"<table id='{esc(table_id)}' class='sortable'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def cdf(values: Sequence[float], scale: float = 1e3, points: int = 400) -> tuple[list, list]:
    """The empirical CDF of `values` (times `scale`), thinned to at most `points` steps."""
    x = np.sort(np.asarray(values, float)) * scale
    if not len(x):
        return [], []
    y = np.arange(1, len(x) + 1) / len(x)
    if len(x) > points:
        idx = np.unique(np.linspace(0, len(x) - 1, points).round().astype(int))
        x, y = x[idx], y[idx]
    return [round(float(v), 4) for v in x], [round(float(v), 5) for v in y]


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else None


def json_block(data: object) -> str:
    return "<pre>" + esc(json.dumps(data, indent=1, sort_keys=True)) + "</pre>"
