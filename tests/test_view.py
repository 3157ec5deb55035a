"""The run viewer (common/run/view.py) checked in a real browser: headless Chromium opens it from the
file system and the tests read the page it rendered (its DOM after the scripts ran), not the
HTML the builder wrote. A synthetic run (records in docs/design.md §3's formats, hostile text in
every field the page shows, a truncated artifact) is built by tests/helpers.py; tests/test_loop.py opens the
viewer loop.sh built for its tiny runs (tests/helpers.py check_tiny_runs)."""

import json
import os

import pytest
from helpers import HOSTILE, ROOT, _write, browse, data, rows, synthetic_run, view

from common.envs.bfcl.harness import load_tasks
from common.run import tracking
from common.run import view as view_mod
from common.seal.taxonomy import LABELS, RHO

# ---------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two synthetic runs side by side (seal, vanilla), their viewers built; the seal run's
    round 1 diagnoses cut mid-line and its train metrics missing, as a crash leaves them."""
    runs = tmp_path_factory.mktemp("runs")
    tasks = list(load_tasks(os.path.join(ROOT, "data", "tiny.jsonl")).values())[:4]
    heldin = list(load_tasks(os.path.join(ROOT, "data", "heldin.jsonl")).values())[:4]
    seal = synthetic_run(runs / "seal", tasks, heldin)
    synthetic_run(runs / "vanilla", tasks, heldin, mode="vanilla", hostile=False)
    diag = seal / "round_001" / "diagnoses.jsonl"
    lines = diag.read_text().splitlines(keepends=True)
    diag.write_text("".join(lines[:5]) + lines[5][:40])
    os.remove(seal / "round_001" / "train_metrics.jsonl")
    for name in ("seal", "vanilla"):
        out = view(runs / name)
        assert out.returncode == 0, out.stderr
    return runs


def test_the_page_opens_on_the_newest_round_and_a_filter_narrows_it(runs):
    page = runs / "seal" / "viewer" / "index.html"
    dom = browse(page)
    assert next(dom.all("div", id="view")).attrs["data-view"] == "round"
    assert "Round 1" in next(dom.all("h1")).text()
    assert len(rows(browse(page, "round/0"))) == 16  # 4 tasks x 4 samples
    failed = rows(browse(page, "round/0?label=argument_mismatch"))
    assert len(failed) == 4 and all("argument_mismatch" in r.text() for r in failed)
    mixed = rows(browse(page, "round/0?mixed=1&sort=abs_wa"))
    assert len(mixed) == 8  # the two odd-numbered tasks, largest |w·A| first
    wa = [float(list(r.all("td"))[6].text()) for r in mixed]
    assert [abs(x) for x in wa] == sorted((abs(x) for x in wa), reverse=True) and wa[0] > 0


def test_advantage_and_weight_are_the_trainers(runs):
    seal = data(runs / "seal" / "viewer" / "index.html", "round_000")["rows"]
    vanilla = data(runs / "vanilla" / "viewer" / "index.html", "round_000")["rows"]
    # group of task 1: sample 0 right, three wrong -> A = (1 - 1/4) / (std 0.433 + 1e-6) and -1/3 of that
    group = [r for r in seal if r["task_id"] == seal[4]["task_id"]]
    assert group[0]["A"] == pytest.approx(0.75 / 0.4330127, rel=1e-5)
    assert group[1]["A"] == pytest.approx(-0.25 / 0.4330127, rel=1e-5)
    assert group[1]["w"] == RHO["argument_mismatch"] and group[2]["w"] == RHO["invalid_tool_call"]
    assert all(r["A"] == 0 for r in seal[:4])  # all right: no signal
    assert {r["w"] for r in vanilla} == {1.0}  # --no-reweight


def test_a_trajectory_shows_its_turns_verdict_label_and_ground_truth(runs):
    page = runs / "seal" / "viewer" / "index.html"
    task = data(page, "round_000")["rows"][5]["task_id"]
    dom = browse(page, f"traj/0/{task}/1")
    text = dom.text()
    assert "instance_state_mismatch" in text and "evidence: wrong_value" in text
    assert any(c.text() == "argument_mismatch" for c in dom.all("span", cls="label"))
    assert list(dom.all("li", cls="differs")), "the changed argument is not marked"
    assert list(dom.all("pre", cls="text")) and "Copy values." in text  # the model's text and Ω's cue
    assert "w·A (trained advantage)" in text and "model tokens" in text


def test_a_segmented_trajectory_shows_where_its_prompt_was_re_rendered(tmp_path):
    """A thinking model's trajectory whose prompt the handler re-rendered at turn 1: its token
    counts cover every segment, the strip marks the re-rendered prompt, and each step keeps its
    own model-token count."""
    tasks = [t for t in load_tasks(os.path.join(ROOT, "data", "heldin.jsonl")).values() if len(t["questions"]) > 1][:2]
    run = synthetic_run(tmp_path / "thinking", tasks, tasks[:1], rounds=1, n=2, hostile=False, thinking=True)
    assert view(run).returncode == 0
    page = run / "viewer" / "index.html"
    row = next(r for r in data(page, "round_000")["rows"] if r["sample_index"] == 1)
    assert row["tokens"]["rerendered_at"] == [1]
    rec = next(json.loads(x) for x in open(run / "round_000" / "rollouts.jsonl")
               if json.loads(x)["task_id"] == row["task_id"] and json.loads(x)["sample_index"] == 1)
    segments = [rec["tokens"], *rec["tokens"]["segments"]]
    assert row["tokens"]["trained"] == rec["stats"]["gen_tokens"] == sum(sum(s["mask"]) for s in segments)
    assert row["tokens"]["ids"] == sum(len(s["ids"]) for s in segments)
    dom = browse(page, f"traj/0/{row['task_id']}/{row['sample_index']}")
    assert "re-rendered (reasoning dropped, as bfcl-eval's handler does) at turn 1" in dom.text()
    assert [s.attrs["title"] for s in dom.all("span", cls="m2")] == ["re-rendered prompt 500"]
    steps = sum(len(t["steps"]) for t in rec["turns"])
    assert len([d for d in dom.all("div", cls="muted") if "model tokens" in d.text()]) == steps
    # the trackers' clip ratio counts every segment's outputs: here the last segment's longest is the limit
    outputs = [n for m, n in row["tokens"]["runs"] if m == 1]
    assert len(outputs) == steps
    longest_late = max(n for m, n in view_mod.mask_runs(segments[-1]["mask"]) if m == 1)
    clip = tracking.rollout_figures([rec], longest_late)["response_length/clip_ratio"]
    assert clip == sum(n >= longest_late for n in outputs) / steps


def test_hostile_text_is_shown_as_text(runs):
    page = runs / "seal" / "viewer" / "index.html"
    task = data(page, "round_000")["rows"][5]["task_id"]
    for fragment in (f"traj/0/{task}/1", f"evaltraj/round_001/{data(page, 'eval_round_001')['rows'][1]['task_id']}"):
        dom = browse(page, fragment)
        text = dom.text()
        for s in HOSTILE:
            assert s in text, (fragment, s)  # shown literally...
        assert not list(dom.all("img")) and not list(dom.all("textarea"))  # ...never parsed as markup
        assert [s.attrs.get("src") for s in dom.all("script")] == ["data/run.js", "view.js"]


def test_missing_and_cut_artifacts_are_named_and_the_rest_shown(runs):
    page = runs / "seal" / "viewer" / "index.html"
    dom = browse(page, "run")
    missing = " ".join(li.text() for li in dom.all("li"))
    assert "round_001/diagnoses.jsonl:6: cut or unreadable" in missing
    assert "round_001/train_metrics.jsonl: not written" in missing
    rho = list(next(dom.all("table", id="rho")).all("tr"))  # the interface's table, each round
    assert len(rho) == 3 and rho[1].text().startswith("round 0") and "2.000" in rho[1].text()
    assert len(rows(browse(page, "round/1"))) == 16  # every rollout, 5 of them diagnosed


def test_an_adaptive_run_weighs_and_shows_each_rounds_own_rho(tmp_path):
    """seal-adaptive: the viewer's and the trackers' w are the trainer's under the round's own ρ_t
    (common/train/grpo.py join_round), and the run page's data, the trackers' figures and the report
    show the ρ_t the train metrics recorded."""
    from common.run import report
    from common.train.grpo import adaptive_rho, diagnosis_weight

    tasks = list(load_tasks(os.path.join(ROOT, "data", "tiny.jsonl")).values())[:4]
    run = synthetic_run(tmp_path / "adaptive", tasks, tasks[:1], rounds=1, mode="seal-adaptive", hostile=False)
    folder = run / "round_000"
    diags = [json.loads(x) for x in open(folder / "diagnoses.jsonl")]
    for d in diags:  # task 0 fails throughout, and one failure beside task 1's success, as state_mismatch
        if d["task_id"] == tasks[0]["id"] or (d["task_id"] == tasks[1]["id"] and d["sample_index"] == 1):
            n = len(d["turn_labels"])
            d |= {"reward": 0, "turn_labels": ["state_mismatch"] * n, "profile": {z: float(z == "state_mismatch")
                                                                                 for z in LABELS}}
    _write(str(folder / "diagnoses.jsonl"), diags)
    adapted = adaptive_rho(RHO, diags)
    assert adapted.kept is None and adapted.learnable["state_mismatch"] == 0.2
    _write(str(folder / "train_metrics.jsonl"), [{"step": 0, "global_step": 0, "w_mean": 1.0, "w_std": 0.0,
                                                  "rho": adapted.rho, "rho_adapted": True}])
    view_mod.build(str(run))
    page = run / "viewer" / "index.html"
    profiles = {(d["task_id"], d["sample_index"]): d["profile"] for d in diags}
    w = {(r["task_id"], r["sample_index"]): r["w"] for r in data(page, "round_000")["rows"]}
    assert w == {k: diagnosis_weight(p, adapted.rho) for k, p in profiles.items()} and len(set(w.values())) > 2
    assert data(page, "run")["rounds"][0]["rho"] == adapted.rho
    figs = tracking.round_figures(str(folder), 0, {}, None)
    assert figs["seal/rho/state_mismatch"] == adapted.rho["state_mismatch"] < RHO["state_mismatch"]
    assert figs["seal/rho/adapted"] == 1.0
    table = tracking.trajectory_table(tracking.Run(str(run)), str(folder))
    assert all(r[7] == w[r[0], r[1]] for r in table)
    report.main(str(run))
    text = (run / "report.md").read_text()
    assert "## ρ per label" in text and f"| {adapted.rho['state_mismatch']:.3f} |" in text


def test_a_task_across_rounds_and_an_evaluation_beside_another_run(runs):
    page = runs / "seal" / "viewer" / "index.html"
    task = data(page, "round_000")["rows"][0]["task_id"]
    assert len(list(next(browse(page, f"task/{task}").all("table", id="task-rounds")).all("tr"))) == 1 + 2
    ev = data(page, "eval_round_001")["rows"]
    dom = browse(page, "eval/round_001?valid=false")
    assert len(rows(dom)) == 2 and len(ev) == 4
    dom = browse(page, f"evaltraj/round_001/{ev[0]['task_id']}?with=vanilla")
    heads = [x.text() for x in dom.all("h2")]
    assert "seal · round_001" in heads and "vanilla · round_001" in heads


def test_a_rebuild_rewrites_only_what_changed(runs):
    data_dir = runs / "vanilla" / "viewer" / "data"
    before = {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()}
    os.utime(runs / "vanilla" / "round_001" / "diagnoses.jsonl")
    assert view(runs / "vanilla").returncode == 0
    after = {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()}
    assert after["round_000.js"] == before["round_000.js"] and after["eval_round_001.js"] == before["eval_round_001.js"]
    assert after["round_001.js"] != before["round_001.js"]


def test_a_folder_that_is_not_a_run_is_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    for path, why in ((tmp_path / "notes.txt", "a file, not a run folder"), (tmp_path, "not a run folder"),
                      (tmp_path / "nope", "no such run folder")):
        out = view(path)
        assert out.returncode != 0 and f"{path}: {why}" in out.stderr, out.stderr
        assert not (tmp_path / "viewer").exists()


def test_trackers_get_each_rounds_trajectories_with_label_and_w(runs):
    """REPORT_TO: a round's table (TRL's completions table plus label and w; A and w the
    trainer's) and TensorBoard's text summary of it, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from common.run import tracking
    run = runs / "vanilla"
    rows = tracking.trajectory_table(tracking.Run(str(run)), str(run / "round_000"))
    page = data(run / "viewer" / "index.html", "round_000")["rows"]
    trained = {(r["task_id"], r["sample_index"]): (r["A"], r["w"]) for r in page}
    assert len(rows) == 16 and [abs(r[8]) for r in rows] == sorted((abs(r[8]) for r in rows), reverse=True)
    assert all(trained[r[0], r[1]] == (r[6], r[7]) for r in rows)
    task = load_tasks(str(run / "tasks.jsonl"))[rows[0][0]]
    assert rows[0][3] == task["questions"][0][0]["content"] and "<tool_call>" in rows[0][4]  # prompt, completion
    assert tracking.log(str(run), "tensorboard")["tensorboard"][:2] == ["round 0", "round 1"]
    acc = EventAccumulator(str(run / "tracking" / "seal"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("seal/trajectories/text_summary")
    assert [e.step for e in texts] == [0, 1]
    text = texts[0].tensor_proto.string_val[0].decode()
    assert text.count("\n") == 1 + len(rows) and rows[0][0] in text


def test_a_turn_credit_run_shows_each_turns_weight_beside_its_label(tmp_path):
    """seal-turn: each turn's weight is the trainer's (common/train/grpo.py join_round with turn credit) and the
    trajectory page shows it beside the turn's label: a failed trajectory's first turn, verified right, at 0
    (not penalised), its failing turns at clip(ρ(label)), a rewarded one's turns at its w. The run page, the
    report and the trackers carry the round's turn figures from the train metrics."""
    from common.jsonl import read_jsonl
    from common.run import report
    from common.train.grpo import join_round, load_rho

    tasks = [t for t in load_tasks(os.path.join(ROOT, "data", "heldin.jsonl")).values() if len(t["questions"]) > 2][:2]
    run = synthetic_run(tmp_path / "turn", tasks, tasks[:1], rounds=1, n=2, hostile=False, mode="seal-turn")
    view_mod.build(str(run))
    page, folder = run / "viewer" / "index.html", run / "round_000"
    joined, _ = join_round(read_jsonl(str(folder / "rollouts.jsonl")), read_jsonl(str(folder / "diagnoses.jsonl")),
                           load_rho(str(folder / "interface.json")), turn_credit=True)
    got = {(r["task_id"], r["sample_index"]): r["turn_w"] for r in data(page, "round_000")["rows"]}
    assert got == {(t.task_id, t.sample_index): t.turn_weights for t in joined}
    task = tasks[1]["id"]  # sample 0 right, sample 1 wrong: pass, then argument_mismatch on every other turn
    failed = next(t for t in joined if (t.task_id, t.sample_index) == (task, 1))
    n = len(task_questions := tasks[1]["questions"])
    assert n == len(failed.turn_weights) and failed.advantage < 0
    assert failed.turn_weights == [0.0] + [RHO["argument_mismatch"]] * (n - 1)
    heads = [x.text() for x in browse(page, f"traj/0/{task}/1").all("h2") if x.text().startswith("Turn")]
    assert heads == ["Turn 0 pass weight 0.000 (verified right: not penalised)"] + [
        f"Turn {k} argument_mismatch weight 1.200" for k in range(1, len(task_questions))]
    heads = [x.text() for x in browse(page, f"traj/0/{task}/0").all("h2") if x.text().startswith("Turn")]
    assert heads == [f"Turn {k} pass weight 1.000" for k in range(n)]  # A > 0: every turn at w
    dom = browse(page, "run")
    table = next(dom.all("table", id="rounds"))
    assert "turn w" in table.text() and "0.900" in table.text() and "0.250" in table.text()
    figs = tracking.round_figures(str(folder), 0, {}, None)
    assert figs["seal/turn/w_mean"] == 0.9 and figs["seal/turn/zeroed_share"] == 0.25
    rows = tracking.trajectory_table(tracking.Run(str(run)), str(folder))
    assert next(r for r in rows if (r[0], r[1]) == (task, 1))[9].startswith("pass×0.00 argument_mismatch×1.20")
    report.main(str(run))
    text = (run / "report.md").read_text()
    assert "| turn w mean | A<0 tokens zeroed |" in text and "| 0.900 | 0.250 |" in text


class ToyEnv:
    """An environment kind of the test's own, with only what the views ask of one (common/envs/__init__.py)."""

    TASKS = {}  # its tasks by id, which the viewer and the trackers show through task_view

    @staticmethod
    def columns(env):
        return ["small", "large"]

    @staticmethod
    def view_categories(env):
        return ["small", "large"]

    @staticmethod
    def eval_title(env, scores):
        return f"Toy {env.split(':', 1)[1]}: boxes packed (%)"

    @staticmethod
    def plot_title(env):
        return "toy boxes packed (%)"

    @staticmethod
    def eval_tasks(env):
        return f"{env}:test"

    @classmethod
    def view_tasks(cls, source):
        return cls.TASKS

    @staticmethod
    def task_view(task):
        return {"category": task["category"], "questions": [[{"role": "user", "content": f"Pack {task['id']}."}]]}

    @staticmethod
    def compare_columns(scores):
        return [c for c in ("small", "large") if any(c in sc for sc in scores)]

    @staticmethod
    def score_notes(sc):
        return ["toy boxes"] if "small" in sc else []

    @staticmethod
    def references(scores):
        return []


def test_an_environment_kind_brings_its_own_report_viewer_and_tracker_views(tmp_path, monkeypatch, capsys):
    """A kind registered in envs.KINDS, and nothing else: the report's evaluation table and the
    compare table take its title and score columns, the viewer its categories and task views, the
    trackers' prompts its tasks' user turns (common/run/report.py, view.py, tracking.py ask the kind)."""
    from common import envs
    from common.run import report

    monkeypatch.setitem(envs.KINDS, "toy", ToyEnv)
    tasks = [dict(t, category=("small", "large")[i % 2])
             for i, t in enumerate(list(load_tasks(os.path.join(ROOT, "data", "tiny.jsonl")).values())[:4])]
    monkeypatch.setattr(ToyEnv, "TASKS", {t["id"]: t for t in tasks})
    run = tmp_path / "toy-run"
    synthetic_run(run, tasks, tasks[:2], rounds=1, n=2, hostile=False)
    config = json.loads((run / "config.json").read_text())
    config["settings"].update(env="toy:box", tasks="toy:box:train")
    (run / "config.json").write_text(json.dumps(config))
    (run / "eval" / "round_000" / "scores.json").write_text(json.dumps({"small": 40.0, "large": 60.0, "average": 50.0}))

    rounds, _, _, _ = report.collect(str(run))
    assert set(rounds[0]["reward_by_category"]) == {"small", "large"}
    report.main(str(run))
    text = (run / "report.md").read_text()
    assert "## Toy box: boxes packed (%)\n\n| policy | small | large | average |\n" in text
    assert "| round_000 | 40.00 | 60.00 | 50.00 |" in text and "Held-in" not in text and "τ²" not in text
    capsys.readouterr()
    report.compare([str(run)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["mode", "small", "large", "average"] and out[1].endswith("toy boxes")

    page = view_mod.build(str(run))
    assert data(page, "run")["categories"] == ["small", "large"]
    shown = data(page, "round_000")["tasks"]
    assert shown == {t["id"]: ToyEnv.task_view(t) for t in tasks}
    assert data(page, "eval_round_000")["tasks"] == {t["id"]: ToyEnv.task_view(t) for t in tasks[:2]}
    cats = next(s for s in browse(page, "round/0").all("select") if s.attrs.get("name") == "cat")
    assert [o.text() for o in cats.all("option")] == ["any category", "small", "large"]  # the page's filter

    table = tracking.trajectory_table(tracking.Run(str(run)), str(run / "round_000"))
    assert {r[3] for r in table} == {f"Pack {t['id']}." for t in tasks}
