"""tools/bench.py, the per-step figure docs/measurements.md reports, runs and prints what it says."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_py_reports_the_median_step_time(data_root):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--steps=13",
                             f"--data_root={data_root}"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    median = re.search(r"ours\s+([\d.]+)\s+-> median ([\d.]+) ms", result.stdout)
    assert median and float(median.group(1)) == float(median.group(2)) > 0
