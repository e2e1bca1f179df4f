"""Print a markdown table from a pytest-benchmark JSON file.

Each benchmark may put extra columns in ``benchmark.extra_info`` (e.g. ``gbps``,
``tokens_per_s``, ``provider``); they are shown beside the median time.

Usage: python scripts/bench_table.py results.json
"""

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    rows = data.get("benchmarks", [])
    extra_keys = sorted({k for r in rows for k in r.get("extra_info", {})})
    print(f"machine: {data.get('machine_info', {}).get('cpu', {}).get('brand_raw', '?')}")
    print()
    print("| benchmark | median (ms) | " + " | ".join(extra_keys) + " |")
    print("|---|---|" + "---|" * len(extra_keys))
    for r in rows:
        med = r["stats"]["median"] * 1e3
        extras = []
        for k in extra_keys:
            v = r.get("extra_info", {}).get(k, "")
            extras.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print(f"| {r['name']} | {med:.3f} | " + " | ".join(extras) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
