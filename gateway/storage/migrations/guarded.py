"""Operations that do only what a database lacks, for the migrations of the schemas shipped before
Alembic: an older cachegw added new nullable columns and indexes at start, so a database from then
may hold any later revision's columns already."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op


def inspector() -> sa.Inspector:
    return sa.inspect(op.get_bind())


def has_table(insp: sa.Inspector, table: str) -> bool:
    return insp.has_table(table)


def has_column(insp: sa.Inspector, table: str, column: str) -> bool:
    return insp.has_table(table) and column in {c["name"] for c in insp.get_columns(table)}


def has_index(insp: sa.Inspector, table: str, index: str) -> bool:
    return insp.has_table(table) and index in {i["name"] for i in insp.get_indexes(table)}


def create_table(name: str, *columns: sa.schema.SchemaItem, **kw: Any) -> None:
    if not has_table(inspector(), name):
        op.create_table(name, *columns, **kw)


def add_column(table: str, column: sa.Column) -> None:
    if not has_column(inspector(), table, column.name):
        op.add_column(table, column)


def create_index(name: str, table: str, columns: list[str], **kw: Any) -> None:
    if not has_index(inspector(), table, name):
        op.create_index(name, table, columns, **kw)
