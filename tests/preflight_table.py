"""`pan check`'s printed table, parsed for the tests: check -> [(status, detail with its continuation lines)]."""

from __future__ import annotations


def parse_table(text: str) -> dict[str, list[tuple[str, str]]]:
    rows: dict[str, list[list[str]]] = {}
    last = None
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|", 2)]
        if len(parts) != 3 or parts[0] == "check":
            continue
        if parts[0]:
            last = [parts[1], parts[2]]
            rows.setdefault(parts[0], []).append(last)
        elif last is not None:
            last[1] += " " + parts[2]
    return {k: [tuple(r) for r in v] for k, v in rows.items()}
