"""A Triton kernel's stall samples and instructions, per line of its Python source.

    ncu --import REPORT.ncu-rep --page source --print-source cuda,sass --csv > lines.csv
    python benchmarks/ncu_lines.py lines.csv [--top 30] [--reasons long_sb,wait]

Reads Nsight Compute's source page (Triton's line info maps each SASS instruction to a
line of the kernel's Python) and prints, as Markdown, each line's share of the kernel's
warp stall samples and executed instructions, largest first, with the line's text.
Instructions without a line (layout conversions, spills) count in the totals the shares
are of. With --reasons, then per stall reason (the page's ``stall_*`` columns, e.g.
long_sb, short_sb, wait, barrier): the reason's share of all stall samples and the
lines with the largest shares of it.
"""

import argparse
import collections
import csv
import os

METRICS = ("Warp Stall Sampling (All Samples)", "Instructions Executed")


def _column(header, name):
    if name not in header:
        raise SystemExit(
            f"ncu_lines.py: no {name!r} column in the source page (its first "
            f"columns: {header[:6]}); export it with --page source "
            "--print-source cuda,sass --csv"
        )
    return header.index(name)


def _count(cell: str) -> int:
    """A counter's cell: digits (thousands separators dropped), or 0 for "-"."""
    cell = cell.replace(",", "").strip()
    return int(cell) if cell.isdigit() else 0


def _source_cell(text: str) -> str:
    """A line's text as a Markdown cell: pipes escaped, at most 100 characters."""
    return "`" + text.replace("|", "\\|")[:100] + "`"


def per_line(path, reasons=()):
    """{(file, line): [stall samples, instructions, text, {reason: samples}]}, total
    samples, total instructions (every SASS row, with or without a line), and
    {reason: total samples} of the ``stall_<reason>`` columns named in ``reasons``."""
    lines = collections.defaultdict(lambda: [0, 0, "", collections.Counter()])
    totals = collections.Counter()
    total_samples = total_inst = 0
    source = header = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] in ("File Path", "File Name"):
                source = os.path.basename(row[1])
                continue
            if row[0] == "Line No":
                header = row
                columns = [_column(header, name) for name in METRICS]
                by_reason = {r: _column(header, f"stall_{r}") for r in reasons}
                continue
            if header is None or len(row) < len(header):
                continue
            samples, inst = _count(row[columns[0]]), _count(row[columns[1]])
            if row[0].strip():  # a line's aggregate
                entry = lines[(source, int(row[0]))]
                entry[0] += samples
                entry[1] += inst
                entry[2] = row[1].strip()
                for r, c in by_reason.items():
                    entry[3][r] += _count(row[c])
            else:  # one SASS instruction (the aggregates' parts)
                total_samples += samples
                total_inst += inst
                for r, c in by_reason.items():
                    totals[r] += _count(row[c])
    return lines, total_samples, total_inst, totals


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--reasons", default="", help="comma-separated stall reasons")
    a = p.parse_args()
    reasons = [r for r in a.reasons.split(",") if r]
    lines, samples, inst, totals = per_line(a.csv, reasons)
    print(f"{samples} stall samples, {inst} warp instructions executed\n")
    print("| stall samples | instructions | line | source |\n|---|---|---|---|")
    ranked = sorted(lines.items(), key=lambda kv: -kv[1][0])[: a.top]
    for (source, line), (s, i, text, _) in ranked:
        print(
            f"| {100 * s / max(samples, 1):.1f} % | {100 * i / max(inst, 1):.1f} % "
            f"| {source}:{line} | {_source_cell(text)} |"
        )
    for r in reasons:
        share = 100 * totals[r] / max(samples, 1)
        print(f"\n{r}: {share:.1f} % of the stall samples\n")
        print(f"| share of {r} | line | source |\n|---|---|---|")
        ranked = sorted(lines.items(), key=lambda kv: -kv[1][3][r])[: a.top]
        for (source, line), (_, _, text, counts) in ranked:
            if counts[r]:
                print(
                    f"| {100 * counts[r] / max(totals[r], 1):.1f} % "
                    f"| {source}:{line} | {_source_cell(text)} |"
                )


if __name__ == "__main__":
    main()
