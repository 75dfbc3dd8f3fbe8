"""Numbers and counts in sentences, shared by the plan's text form (render) and its findings (rules): '4
mini-batches', '494 M', '12.3 ms', '315 MiB', '0-2,5'. Pure Python: never imports torch.
"""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """plural(1, 'rank') -> '1 rank'; plural(4, 'mini-batch') -> '4 mini-batches'; thousands separated."""
    if many is None:
        many = word + ("es" if word.endswith(("tch", "sh", "ss", "x")) else "s")
    return f"{n:,} {word if n == 1 else many}"


def count_unit(n: int) -> str:
    """Parameter counts with 3 significant digits: 86.8 K, 0.43 M, 494 M, 7.62 B."""
    for size, unit in ((1e9, "B"), (1e5, "M"), (1e3, "K")):
        if n >= size:
            shown = f"{n / (1e6 if unit == 'M' else size):.3g}"
            if unit == "M" and float(shown) >= 1000:  # 999.9 M rounds up to the next unit
                return f"{n / 1e9:.3g} B"
            return f"{shown} {unit}"
    return f"{n:,}"


def seconds(s: float) -> str:
    """0.0123 -> '12.3 ms'; 4.56 -> '4.56 s'; 1234 -> '1,234 s'."""
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:,.0f} s" if s >= 1000 else f"{s:.3g} s"


def ranks_text(ranks: list[int], most: int = 12) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'; long lists end with ',...'."""
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            spans.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(spans[:most]) + (",..." if len(spans) > most else "")


def size_text(gib: float) -> str:
    """Bytes for a sentence: '1.52 GiB', '315 MiB', '0.31 MiB'."""
    return f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"
