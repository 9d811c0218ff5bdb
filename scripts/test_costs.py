"""Write tests/assets/test-costs.json from a run's test-durations.tsv (scripts/test.sh writes one):
the seconds each pytest-xdist unit (tests/conftest.py worker_group) took, which tests/conftest.py
uses to hand the longest units out first.

Usage: python scripts/test_costs.py test-durations.tsv COMMIT"""

import json
import sys
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import worker_group  # noqa: E402


def main(durations: str, commit: str) -> None:
    seconds: dict[str, float] = {}
    for line in Path(durations).read_text().splitlines():
        took, nodeid = line.split("\t")[:2]
        seconds[worker_group(nodeid)] = seconds.get(worker_group(nodeid), 0.0) + float(took)
    table = {
        "_provenance": (
            "seconds per pytest-xdist unit (tests/conftest.py worker_group), summed from test-durations.tsv "
            f"of a fresh-clone CI=true .ci/run at {commit} on 2 cores ({date.today()}); "
            "regenerate with python scripts/test_costs.py test-durations.tsv COMMIT"
        ),
        "seconds": {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
    }
    (REPO / "tests" / "assets" / "test-costs.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
