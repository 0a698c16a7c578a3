"""The ``mpitp report`` page as HTML: a :class:`~mpitp.results.report_model.Report` through the jinja2 template
``templates/report.html.j2``.

Everything a file says reaches the page either through jinja2's autoescape (HTML text) or through
:func:`script_json` (data for the page's script), never by string concatenation into markup: this module is the one
place that decides how text from files becomes markup."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from mpitp.results.report_model import Report
from mpitp.results.speed import CHECKPOINT_HEAD, TASK_HEAD


def script_json(data: object) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``<``, ``>`` or ``&`` (so no ``</script>`` and no
    ``<!--``), and no NaN (not JSON)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(report: Report) -> str:
    import jinja2
    from markupsafe import Markup

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["script_json"] = lambda d: Markup(script_json(d))
    diff_data = {"runs": [r.label for r in report.runs], "paths": [r.path for r in report.runs],
                 "bound": report.diff_bound, "iters": report.diff_iters,
                 "pairs": {f"{d.a}|{d.b}": d.text for d in report.diffs}}
    return env.get_template("report.html.j2").render(
        report=report, board=[asdict(r) for r in report.leaderboard], samples=report.samples, diff_data=diff_data,
        task_head=TASK_HEAD, checkpoint_head=CHECKPOINT_HEAD,
        timed=[r for r in report.runs if r.speed_tasks or r.speed_groups])  # runs whose files say where time went
