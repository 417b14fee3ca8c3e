"""Metric families filled field by field: one table row per family instead of a hand-built
family and a hand-written `add_metric` line for each (the collector's probe families, the
network families).

A `FieldFamily` names the family, its help text, and the attribute of each row it exports;
`fill` adds one row's values to the families built from a table, in the table's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

Family = CounterMetricFamily | GaugeMetricFamily


@dataclass(frozen=True)
class FieldFamily:
    """One family exporting the attribute `field` of each row.

    `counter`: a counter (the name without `_total`) instead of a gauge. `by`: the field holds
    (key, value) pairs and `by` is the extra label that carries the key. `optional`: a None value
    is left out (the row's source could not tell), never exported as 0. `gate`: the whole row is
    left out of this family where the attribute `gate` is None (a group of fields that is off)."""

    name: str
    doc: str
    field: str
    counter: bool = False
    by: str | None = None
    optional: bool = False
    gate: str | None = None

    def family(self, labels: Sequence[str]) -> Family:
        names = [*labels, self.by] if self.by is not None else list(labels)
        kind = CounterMetricFamily if self.counter else GaugeMetricFamily
        return kind(self.name, self.doc, labels=names)

    def add(self, family: Family, labels: list[str], row: Any) -> None:
        if self.gate is not None and getattr(row, self.gate) is None:
            return
        value = getattr(row, self.field)
        if self.by is not None:
            for key, item in value:
                family.add_metric([*labels, str(key)], item)
        elif value is not None or not self.optional:
            family.add_metric(labels, value)


Families = list[tuple[FieldFamily, Family]]


def new_families(table: Sequence[FieldFamily], labels: Sequence[str]) -> Families:
    """A fresh family for every row of `table` (label names `labels`, plus each one's `by`)."""
    return [(spec, spec.family(labels)) for spec in table]


def fill(built: Families, labels: list[str], row: Any) -> None:
    """Add `row`'s values (label values `labels`) to every family in `built`."""
    for spec, family in built:
        spec.add(family, labels, row)


def as_metrics(built: Families) -> list[Metric]:
    """The families of `built`, in their table's order."""
    return [family for _, family in built]
