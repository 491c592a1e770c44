"""``xirang.explain``: the plan's renderers, ``explain_plan`` (the text ``plan.explain()`` returns) and
``explain_data`` (``xirang explain --json``).

They read the plan's data only, so they live beside it in ir/plan_explain.py (ir/ imports nothing
above it); this module keeps the names importable from the public package.
"""
from xirang.ir.plan_explain import CAUSES, GiB, as_row, explain_data, explain_plan, label, why_lost, why_won

__all__ = ["CAUSES", "GiB", "as_row", "explain_data", "explain_plan", "label", "why_lost", "why_won"]
