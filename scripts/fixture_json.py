"""Writes a test fixture made from a reference implementation: `made_by` (the command and the
versions that made it) and its entries, one entry a line, so a regenerated fixture diffs by
entry. Used by scripts/hf-config-counts.py, deepspeed-schedules.py and
deepspeed-trajectories.py."""
import json


def write(path, made_by, entries):
    with open(path, "w") as f:
        f.write("{\n" + f'  "made_by": {json.dumps(made_by)},\n  "entries": [\n')
        f.write(",\n".join("    " + json.dumps(e) for e in entries))
        f.write("\n  ]\n}\n")
