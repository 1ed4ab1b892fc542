"""The report: the workshop page re-created from recompute's own numbers, as HTML (plotly) and PNG (matplotlib).

``build_report`` computes (``Report``), ``render_html`` formats (a string), ``write_pngs`` draws files; the CLI
(``recompute report``) writes. The optional sections come from ``plan_section``, ``bench_section`` and
``trace_section`` (torch). plotly and matplotlib are imported only by the functions that draw.

Example:
    >>> from recompute import ModelSpec, Workload
    >>> from recompute.report import build_report
    >>> report = build_report(ModelSpec.from_name("llama3.1-8b"), Workload(seq_len=16384))
    >>> list(report.models)
    ['llama3.1-8b', 'llama3.1-70b', 'llama3.1-405b']
"""

from __future__ import annotations

from recompute.report.data import Report, build_report
from recompute.report.extras import bench_section, plan_section, trace_section
from recompute.report.html import render_html
from recompute.report.png import write_pngs

__all__ = ["Report", "bench_section", "build_report", "plan_section", "render_html", "trace_section", "write_pngs"]
