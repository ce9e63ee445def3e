"""Text columns of arrow tables (json, parquet rows) read into Python, invalid UTF-8 included.

Offers `pylist(column)` (a column's values, each one whose text is not UTF-8 an `Undecodable`
holding it as bytes) and `decoded(raw, errors)` (such a value's strings decoded). Arrow loads json
and parquet strings without checking their UTF-8, and its conversion to Python raises on the first
bad one, naming neither row nor file; minillm.data.table applies `data.decode_errors` to them.
"""

from __future__ import annotations

from typing import Any


class Undecodable:
    """A row's value whose text is not UTF-8: `raw`, the value with its strings as bytes."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw


def _as_binary(kind: Any) -> Any:
    """An arrow type with every string in it made binary (a cast that checks no UTF-8)."""
    import pyarrow as pa

    if pa.types.is_string(kind):
        return pa.binary()
    if pa.types.is_large_string(kind):
        return pa.large_binary()
    if pa.types.is_list(kind):
        return pa.list_(_as_binary(kind.value_type))
    if pa.types.is_large_list(kind):
        return pa.large_list(_as_binary(kind.value_type))
    if pa.types.is_struct(kind):
        return pa.struct([pa.field(f.name, _as_binary(f.type)) for f in kind])
    return kind


def decoded(raw: Any, errors: str) -> Any:
    """A value read as bytes (`_as_binary`) with its strings decoded as UTF-8 (`errors`)."""
    if isinstance(raw, bytes):
        return raw.decode("utf-8", errors)
    if isinstance(raw, list):
        return [decoded(v, errors) for v in raw]
    if isinstance(raw, dict):
        return {k: decoded(v, errors) for k, v in raw.items()}
    return raw


def pylist(column: Any) -> list[Any]:
    """An arrow column's values; one whose text is not UTF-8 an `Undecodable` (arrow's own
    conversion raises on the first such value)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    values: list[Any] = []
    for raw in column.cast(_as_binary(column.type)).to_pylist():
        try:
            values.append(decoded(raw, "strict"))
        except UnicodeDecodeError:
            values.append(Undecodable(raw))
    return values
