"""A third environment costs one folder and one registry line: tests/toy_env/, a key-value store written against
docs/environments.md's interface only, copied into a clone of the repository as common/envs/toy/ with its line
in KINDS, trains through `bash loop.sh tiny --set ENV=toy` for two rounds (its tiny model built from its own warm
start), and nothing else of the clone changed."""

import json
import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tiny preset's two rounds, of 4 tasks x 2 samples, on the HF engine (no server to start)
SMALL = ["--set", "ENGINE=hf", "--set", "TASKS_PER_ROUND=4", "--set", "N=2", "--set", "MAX_NEW=48",
         "--set", "EVAL_NEW=48"]


def git(clone, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=clone, check=True,
                          capture_output=True, text=True).stdout


def test_a_third_environment_is_one_folder_and_one_registry_line(tmp_path):
    clone = tmp_path / "seal"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, listed):
        if os.path.isfile(os.path.join(ROOT, rel)) and not rel.startswith("tests/"):
            os.makedirs(clone / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), clone / rel)
    (clone / ".venv").symlink_to(os.path.join(ROOT, ".venv"))
    git(clone, "init", "-q")
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "clone")

    shutil.copytree(os.path.join(ROOT, "tests", "toy_env"), clone / "common" / "envs" / "toy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    registry = clone / "common" / "envs" / "__init__.py"
    text = registry.read_text()
    assert text.count("\nKINDS = {") == 1
    registry.write_text(text.replace("\nKINDS = {", '\nfrom common.envs.toy import Toy  # noqa: E402\nKINDS = {"toy": Toy, ', 1))

    res = subprocess.run(["bash", "loop.sh", "tiny", "--set", "ENV=toy", *SMALL, "--runs", str(clone / "runs")],
                         cwd=clone, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert git(clone, "status", "--porcelain", "--untracked-files=normal").splitlines() == [
        " M common/envs/__init__.py", "?? common/envs/toy/"]

    run = clone / "runs" / "tiny-seal-toy"
    assert json.loads((run / "config.json").read_text())["settings"]["tasks"] == "toy:train"
    for t in (0, 1):
        rollouts = [json.loads(line) for line in open(run / f"round_00{t}" / "rollouts.jsonl")]
        assert len(rollouts) == 8 and {r["env"] for r in rollouts} == {"toy"}
        assert len(open(run / f"round_00{t}" / "diagnoses.jsonl").readlines()) == 8
    # the trainer ran both rounds (whether it stepped depends on what the tiny model sampled: a group
    # whose samples all scored alike has no advantage)
    for t in (0, 1):
        lines = open(run / f"round_00{t}" / "train_metrics.jsonl").readlines()
        assert lines and all("global_step" in json.loads(line) for line in lines)
    info = json.loads((clone / "runs" / "base-tiny-toy" / "config.json").read_text())
    assert os.path.basename(os.path.dirname(info["settings"]["model"])) == ".cache"  # the toy's own build
    assert json.loads((run / "eval" / "round_001" / "scores.json").read_text()).keys() >= {"store", "erase", "average"}
    assert "## Toy key-value store (test split, %)" in (run / "report.md").read_text()
    assert (run / "viewer" / "index.html").is_file()
