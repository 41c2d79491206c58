"""Where each kernel's warps wait, from Nsight Compute's source page (a developer tool, not a test):
the instructions with the most warp-stall samples, per kernel profiled.

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python3 tests/ncu_stalls.py source.csv [--top 12]

The report needs the source counters (`--set full`, or `--section SourceCounters`).
"""
import argparse
import csv


def kernels(path: str):
    """-> [(kernel name, header row, instruction rows)] in the order profiled."""
    found = []
    for row in csv.reader(open(path)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            found.append((row[1], None, []))
        elif row[0] == "Address" and found:
            found[-1] = (found[-1][0], row, found[-1][2])
        elif found and found[-1][1] is not None:
            found[-1][2].append(row)
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    for name, header, rows in kernels(args.csv):
        samples = header.index("Warp Stall Sampling (All Samples)")
        source = header.index("Source")
        counts = [float(r[samples] or 0) for r in rows]
        total = sum(counts) or 1.0
        print(f"{name}: {len(rows)} instructions, {total:.0f} stall samples")
        for count, r in sorted(zip(counts, rows), key=lambda cr: -cr[0])[:args.top]:
            print(f"  {100 * count / total:5.1f}%  {r[source].strip()[:100]}")


if __name__ == "__main__":
    main()
