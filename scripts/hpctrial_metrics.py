#!/usr/bin/python3
"""Read the metrics hpctrial records (each trial's metrics.jsonl), without hpctrial.

    python3 hpctrial_metrics.py EXPDIR                      # every trial's validations, as CSV
    python3 hpctrial_metrics.py EXPDIR --kind training      # or its training metrics
    python3 hpctrial_metrics.py EXPDIR/trial-3/metrics.jsonl --kind all

From Python (the hpctrial modulefile puts this module on PYTHONPATH):
    from hpctrial_metrics import read_metrics, experiment_metrics
    for trial, records in experiment_metrics("runs/mnist").items():
        losses = [r["metrics"]["validation_loss"] for r in records if r["kind"] == "validation"]

Each record is one line of metrics.jsonl as a dict: kind ("training", "validation", "timings"),
batches, epoch, records, time (ISO 8601, UTC) and metrics {name: float}. A value hpctrial wrote
as "NaN", "Infinity" or "-Infinity" (JSON has no literal for them) is read as that float.
Only Python's standard library is used.
"""
import argparse
import csv
import json
import math
import os
import re
import sys

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_TRIAL_DIR = re.compile(r"^trial-(\d+)$")


def _number(value):
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    return value


def read_metrics(path, kind=None):
    """The records of one metrics.jsonl, oldest first; only those of `kind` when given.

    A line that is not JSON raises ValueError naming the file and the line (a file cut short by
    a killed job ends in at most one partial line, which is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line, without its newline: a write cut short
                break
            raise ValueError(f"{path}:{number}: not a JSON record ({e})") from None
        if kind is not None and record.get("kind") != kind:
            continue
        record["metrics"] = {k: _number(v) for k, v in record.get("metrics", {}).items()}
        records.append(record)
    return records


def experiment_metrics(directory, kind=None):
    """{trial id: records} for every trial directory of an experiment that has metrics."""
    out = {}
    for name in os.listdir(directory):
        match = _TRIAL_DIR.match(name)
        path = os.path.join(directory, name, "metrics.jsonl")
        if match and os.path.isfile(path):
            out[int(match.group(1))] = read_metrics(path, kind)
    return dict(sorted(out.items()))


def rows(by_trial):
    """Flat rows (trial, kind, batches, epoch, records, time, then each metric) for a table."""
    for trial, records in by_trial.items():
        for r in records:
            row = {"trial": trial, "kind": r.get("kind"), "batches": r.get("batches"), "epoch": r.get("epoch"),
                   "records": r.get("records"), "time": r.get("time")}
            row.update(r["metrics"])
            yield row


def main(argv=None):
    parser = argparse.ArgumentParser(description="Print hpctrial metrics as CSV.")
    parser.add_argument("path", help="an experiment directory, a trial directory, or a metrics.jsonl")
    parser.add_argument("--kind", default="validation", help="training, validation, timings or all")
    args = parser.parse_args(argv)
    kind = None if args.kind == "all" else args.kind
    path = args.path.rstrip("/")
    try:
        if os.path.isfile(path):
            match = _TRIAL_DIR.match(os.path.basename(os.path.dirname(os.path.abspath(path))))
            by_trial = {int(match.group(1)) if match else 0: read_metrics(path, kind)}
        elif os.path.isfile(os.path.join(path, "metrics.jsonl")):
            match = _TRIAL_DIR.match(os.path.basename(os.path.abspath(path)))
            by_trial = {int(match.group(1)) if match else 0: read_metrics(os.path.join(path, "metrics.jsonl"), kind)}
        elif os.path.isdir(path):
            by_trial = experiment_metrics(path, kind)
        else:
            raise FileNotFoundError(f"{path}: no such experiment directory, trial directory or metrics file")
    except (OSError, ValueError) as e:
        print(f"hpctrial_metrics: {e}", file=sys.stderr)
        return 1
    table = list(rows(by_trial))
    names = []
    for row in table:
        names += [k for k in row if k not in names]
    writer = csv.DictWriter(sys.stdout, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
