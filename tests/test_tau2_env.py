"""τ²-bench as a training environment (common/envs/tau2/tau2.py): episodes into rollout records, and
τ²'s own verdict into Ψ's labels (common/seal/taxonomy.py's τ² rules), one constructed episode per
label on τ²'s mock domain, played through τ²'s orchestrator, environment and evaluator."""

import json
import os
import re
import subprocess
import sys
import threading

import pytest

from common.engine import calls as calls_api
from common.envs.tau2 import diagnose as D
from common.envs.tau2 import tau2 as T
from common.jsonl import RecordError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DONE = "Your request is complete."
NO_TOKENS = {"prompt_ids": [], "ids": [], "mask": [], "logprobs": []}  # a scripted agent generates none


@pytest.fixture(scope="module")
def tau2():
    return T.import_tau2()


def call(name, **arguments):
    return calls_api.format_calls([{"name": name, "arguments": arguments}], "json")


def scripted(tau2, domain, task_id, outputs):
    """(rollout record, diagnosis record) of an episode whose agent writes `outputs` in turn,
    against the scripted ScenarioUser."""
    task = next(t for t in tau2.tasks(domain) if t.id == task_id)
    texts = iter(outputs)

    def players(task, tools, user_tools, system, fmt):
        return (lambda history, new: next(texts)), tau2.classes[4](task)

    row = tau2.play(domain, task, players, 50, "json")
    record = T.episode_record(row, NO_TOKENS, 0, 0, "scripted", "scripted", 0.0)
    return record, D.diagnose(tau2, domain, task, record)


GOLD = call("create_task", user_id="user_1", title="Important Meeting")

CASES = {  # label: (task, the agent's outputs, evidence it names)
    "pass": ("create_task_1", [GOLD, DONE], "reward 1"),
    "invalid_tool_call": ("create_task_1", [call("delete_everything"), DONE], "unknown tool delete_everything"),
    "argument_mismatch": ("create_task_1", [call("create_task", user_id="user_1", title="Other"), DONE],
                          "title='Other', ground truth 'Important Meeting'"),
    "state_mismatch": ("create_task_1", [GOLD, call("create_task", user_id="user_1", title="Extra"), DONE],
                       "database differs from the gold actions' replay: tasks[task_3] added, users[user_1] changed"),
    "recovery_failure": ("impossible_task_1", [call("update_task_status", task_id="task_999", status="completed"),
                                               DONE], "last call failed"),
    "missing_tool_call": ("impossible_task_1", [DONE], "never made gold action transfer_to_human_agents"),
    "response_mismatch": ("update_task_with_initialization_data",
                          [call("update_task_status", task_id="task_2", status="completed"), DONE],
                          "not communicated"),
}


@pytest.mark.parametrize("label", list(CASES))
def test_each_label_from_a_constructed_episode(tau2, label):
    task_id, outputs, evidence = CASES[label]
    record, diagnosis = scripted(tau2, "mock", task_id, outputs)
    assert diagnosis["turn_labels"] == [label] and evidence in diagnosis["evidence"][0]
    assert diagnosis["reward"] == (1.0 if label == "pass" else 0.0)
    assert diagnosis["official"]["valid"] is (label == "pass")
    assert diagnosis["profile"][label] == 1.0 and sum(diagnosis["profile"].values()) == 1.0
    # the record: one turn (the user's opening), one step per output, τ²'s results beside the calls
    (turn,) = record["turns"]
    assert [s["text"] for s in turn["steps"]] == outputs and turn["end"] == "answer"
    assert all(len(s["results"]) == len(s["calls"]) == len(s["call_errors"]) for s in turn["steps"])
    assert record["stop"] == "user_stop" and record["env"] == "tau2:mock"


def test_an_early_end_is_a_missing_tool_call(tau2):
    """An empty agent output ends the episode as AGENT_ERROR, which τ² scores 0 without checks."""
    record, diagnosis = scripted(tau2, "mock", "create_task_1", ["  "])
    assert record["stop"] == "agent_error" and diagnosis["reward"] == 0.0
    assert diagnosis["turn_labels"] == ["missing_tool_call"] and "agent_error" in diagnosis["evidence"][0]


def test_the_reward_is_taus_evaluator_on_the_transcript(tau2):
    """Diagnosis scores the record's transcript with τ²'s evaluator, which replays its calls in a
    fresh environment: a transcript whose results the calls do not give is refused, not scored."""
    record, diagnosis = scripted(tau2, "mock", "create_task_1", [GOLD, DONE])
    assert diagnosis["reward"] == 1.0
    task = next(t for t in tau2.tasks("mock") if t.id == "create_task_1")
    edited = json.loads(json.dumps(record))
    for m in edited["transcript"]:
        for c in m.get("tool_calls") or []:
            c["arguments"]["title"] = "Edited"
    with pytest.raises(RecordError, match="does not replay"):
        D.diagnose(tau2, "mock", task, edited)
    broken = json.loads(json.dumps(record))
    broken["turns"][0]["steps"][0]["calls"] = [["create_task"]]
    with pytest.raises(RecordError, match="turn 0 is not a τ² rollout's turn"):
        D.diagnose(tau2, "mock", task, broken)
    edited["transcript"][1]["role"] = "wizard"
    with pytest.raises(RecordError, match="not a τ² transcript"):
        D.diagnose(tau2, "mock", task, edited)


def test_splits_and_playable_tasks(tau2):
    """τ²'s own splits; tasks that start mid-conversation are not played."""
    assert (len(tau2.tasks("airline", split="train")), len(tau2.tasks("airline", split="test"))) == (30, 20)
    assert sum(map(T.playable, tau2.tasks("mock"))) == 7
    with pytest.raises(RecordError, match="task split 'nope'"):
        tau2.tasks("airline", split="nope")


def _stage(*argv):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_tiny_model_rollouts_diagnosed_by_tau2(tmp_path, tiny_model, tau2):
    """rollout.py and diagnose.py on a τ² split, the tiny model (HF engine) against the scripted
    user, Ω_0 on: every record's tokens are what the model was shown and wrote, and each episode
    is scored by τ²'s evaluator and labelled."""
    from transformers import AutoTokenizer

    from common.jsonl import write_json
    from common.seal import interface as omega_api
    from common.seal import taxonomy
    write_json(tmp_path / "omega.json", omega_api.initial())
    res = _stage("rollout.py", "--model", tiny_model, "--tasks", "tau2:mock:base", "--limit", "2", "--n", "2",
                 "--engine", "hf", "--scripted-user", "--max-new-tokens", "24", "--interface",
                 str(tmp_path / "omega.json"), "--out", str(tmp_path / "r.jsonl"))
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["sample_index"]) for r in records] == [
        (t, k) for t in ("create_task_1", "create_task_1_with_env_assertions") for k in range(2)]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    policy = tau2.registry.get_env_constructor("mock")().get_policy()
    for r in records:
        assert r["env"] == "tau2:mock" and "scripted" in r["user_simulator"] and r["category"] == "mock"
        t = r["tokens"]
        assert len(t["ids"]) == len(t["mask"]) == len(t["logprobs"]) and sum(t["mask"]) == r["stats"]["gen_tokens"] > 0
        assert all((lp is not None) == bool(m) for m, lp in zip(t["mask"], t["logprobs"], strict=True))
        shown = tok.decode(t["prompt_ids"])
        assert policy.strip()[:200] in shown and r["turns"][0]["user"] in shown
        assert r["stats"]["cue_tokens"] > 0  # Ω_0's schema cue annotates τ²'s tool schemas
        context, at = tok.decode(t["prompt_ids"] + t["ids"]), 0
        for step in (s for turn in r["turns"] for s in turn["steps"]):
            at = context.index(step["text"], at)  # each output in the context, in order
    for workers in ("1", "2"):  # forked workers give the same file
        res = _stage("diagnose.py", "--tasks", "tau2:mock:base", "--rollouts", str(tmp_path / "r.jsonl"),
                     "--workers", workers, "--out", str(tmp_path / f"d{workers}.jsonl"))
        assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "d1.jsonl").read_bytes() == (tmp_path / "d2.jsonl").read_bytes()
    diagnoses = [json.loads(line) for line in (tmp_path / "d1.jsonl").read_text().splitlines()]
    assert len(diagnoses) == len(records)
    for d, r in zip(diagnoses, records, strict=True):
        assert (d["task_id"], d["sample_index"]) == (r["task_id"], r["sample_index"])
        assert d["reward"] in (0.0, 1.0) and len(d["turn_labels"]) == max(1, len(r["turns"]))
        assert set(d["turn_labels"]) <= set(taxonomy.LABELS) and abs(sum(d["profile"].values()) - 1) < 1e-9
    # a bad record met by a worker still names its file and line, and nothing is written
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    broken = json.loads(lines[2])
    broken["turns"][0]["steps"] = "none"
    (tmp_path / "bad.jsonl").write_text("\n".join(lines[:2] + [json.dumps(broken)] + lines[3:]) + "\n")
    res = _stage("diagnose.py", "--tasks", "tau2:mock:base", "--rollouts", str(tmp_path / "bad.jsonl"),
                 "--workers", "2", "--out", str(tmp_path / "bad-d.jsonl"))
    assert res.returncode == 1 and f"{tmp_path / 'bad.jsonl'}:3: turn 0 is not a τ² rollout's turn" in res.stderr
    assert not (tmp_path / "bad-d.jsonl").exists()


def test_the_user_flags_belong_to_tau2_tasks(tmp_path, tiny_model):
    out = str(tmp_path / "r.jsonl")
    res = _stage("rollout.py", "--model", tiny_model, "--tasks", "tau2:mock:base", "--out", out)
    assert res.returncode == 2 and "τ² tasks need one user" in res.stderr
    res = _stage("rollout.py", "--model", tiny_model, "--tasks", "data/tiny.jsonl", "--scripted-user", "--out", out)
    assert res.returncode == 2 and "--scripted-user: for tau2 tasks, not data/tiny.jsonl" in res.stderr
    res = _stage("diagnose.py", "--tasks", "tau2:mock", "--rollouts", out, "--out", out)
    assert res.returncode == 1 and "tau2:DOMAIN:SPLIT" in res.stderr
    assert not os.path.exists(out)


@pytest.mark.parametrize("omega", ["initial", "off"])
def test_error_feedback_hints_after_taus_error_messages(tau2, tokenizer, omega):
    """Ω's error feedback appends a recovery hint to a tool message τ² flags error=True (never
    the answer), recorded as the step's feedback and counted as cue tokens; with Ω off the
    model sees τ²'s message alone. The agent is scripted (real tokenizer, fixed texts)."""
    from helpers import Scripted

    from common.envs.bfcl.play import PlaySpec
    from common.seal import interface as omega_api
    texts = iter([call("update_task_status", task_id="task_999", status="completed"), DONE])
    engine = Scripted(tokenizer, lambda prompt: next(texts))
    spec = PlaySpec(omega=getattr(omega_api, omega)(), fmt="json", temperature=1.0, max_model_len=8192,
                    max_new_tokens=64)
    task = next(t for t in tau2.tasks("mock") if t.id == "impossible_task_1")
    (record,), _ = T.rollouts(tau2, "mock", [task], 1, engine, spec, T.SCENARIO)
    first, second = record["turns"][0]["steps"]
    assert first["call_errors"][0] and "not found" in first["call_errors"][0]
    context = tokenizer.decode(record["tokens"]["prompt_ids"] + record["tokens"]["ids"])
    if omega == "initial":
        assert first["feedback"] and first["feedback"] in context and record["stats"]["cue_tokens"] > 0
        assert "task_999" not in first["feedback"]
    else:
        assert first["feedback"] is None and record["stats"]["cue_tokens"] == 0
    assert second["feedback"] is None and second["text"] == DONE


def test_a_round_trains_on_tau2_rollouts(tiny_model, tau2, tmp_path):
    """train_grpo.py on τ² rollout records and their diagnoses (SEAL's weight, Ω_0): a group of
    the tiny model's own samples and two teacher episodes (the gold call, reward 1 by τ²'s
    evaluator; none, reward 0) takes an optimiser step, and the rewarded episodes gain
    log-probability against the others."""
    from helpers import Teacher, seq_logprob, train_one_round
    from transformers import AutoModelForCausalLM

    from common.engine.engines import make_engine
    from common.envs.bfcl.play import PlaySpec
    from common.seal import interface as omega_api
    task = next(t for t in tau2.tasks("mock") if t.id == "create_task_1")
    spec = PlaySpec(omega=omega_api.initial(), fmt="json", temperature=1.0, max_model_len=8192, max_new_tokens=48)
    engine = make_engine("hf", tiny_model, max_model_len=8192, seed=0)
    real, _ = T.rollouts(tau2, "mock", [task], 2, engine, spec, T.SCENARIO, concurrency=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    right = Teacher(model, engine.tokenizer, lambda tail: DONE if "task_2" in tail else GOLD)
    wrong = Teacher(model, engine.tokenizer, lambda tail: DONE)
    records = real + [T.rollouts(tau2, "mock", [task], 1, t, spec, T.SCENARIO, concurrency=1)[0][0] for t in (right, wrong)]
    for k, r in enumerate(records):
        r["sample_index"] = k
    diagnoses = [D.diagnose(tau2, "mock", task, r) for r in records]
    rewards = [d["reward"] for d in diagnoses]
    assert rewards[2:] == [1.0, 0.0]
    assert [m["step"] for m in train_one_round(tiny_model, records, diagnoses, tmp_path)] == [1]
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    mean = sum(rewards) / len(rewards)
    delta = [seq_logprob(after, r) - seq_logprob(model, r) for r in records]
    up = [d for d, x in zip(delta, rewards, strict=True) if x > mean]
    down = [d for d, x in zip(delta, rewards, strict=True) if x < mean]
    assert sum(up) / len(up) > sum(down) / len(down), (rewards, delta)


SHOP = os.path.join(ROOT, "docs", "examples", "shop_domain.py")


def test_a_users_own_domain(tau2, monkeypatch):
    """docs/examples/shop_domain.py, a domain of the user's in τ²'s own format, registered through
    SEAL_TAU2_DOMAINS: its splits load through the stages' seam, and its episodes are scored by
    τ²'s evaluator and labelled like any domain's."""
    from common import envs
    monkeypatch.setenv("SEAL_TAU2_DOMAINS", SHOP)
    env = envs.load("tau2:shop:train", user="scripted")
    assert list(env.tasks) == ["two_mugs", "one_teapot"] and env.categories == ["shop"]
    order = call("place_order", item_id="i2", quantity=1)
    for task_id, outputs, label, evidence in [
            ("two_mugs", [call("place_order", item_id="i1", quantity=2), DONE], "pass", "reward 1"),
            ("two_mugs", [call("place_order", item_id="i1", quantity=3), DONE], "argument_mismatch",
             "quantity=3, ground truth 2"),
            ("one_teapot", [order, DONE], "response_mismatch", "'30'"),
            ("one_teapot", [order, f"That is 30 in total. {DONE}"], "pass", "reward 1")]:
        _, diagnosis = scripted(env.tau2, "shop", task_id, outputs)
        assert diagnosis["turn_labels"] == [label] and evidence in diagnosis["evidence"][0], diagnosis
    monkeypatch.setenv("SEAL_TAU2_DOMAINS", str(ROOT) + "/no/such/domain.py")
    with pytest.raises(RecordError, match="SEAL_TAU2_DOMAINS: importing .*domain.py failed"):
        T.import_tau2()


def test_the_loop_trains_on_a_users_domain(tmp_path, tiny_model):
    """bash loop.sh tiny --set ENV=tau2:shop: one round of rollouts on the domain's train split
    against the scripted user, diagnosis, Ω's next version, training, and evaluation on its test
    split by τ²'s evaluator, with the report and viewer (the same stages as BFCL's loop); BFCL
    held-in is its out-of-distribution score. The model is the BFCL tiny build, named with MODEL:
    the domain's own build (loop.sh's default for tiny on τ²) is tested in tests/test_tiny.py."""
    res = subprocess.run(["bash", "loop.sh", "tiny", "--rounds", "1", "--set", "ENV=tau2:shop", "--set", "N=2",
                          "--set", f"MODEL={tiny_model}",
                          "--set", "MAX_NEW=32", "--set", "OOD=bfcl-heldin", "--set", "EVAL_NEW=32",
                          "--set", "REPORT_TO=tensorboard",
                          "--runs", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "SEAL_TAU2_DOMAINS": SHOP}, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    run = tmp_path / "tiny-seal-shop"
    # the trackers log a τ² run as they log BFCL's: every round, its domain's reward, the trajectory table
    assert "logging to tensorboard failed" not in res.stderr, res.stderr[-4000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tracking" / "seal"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/shop/mean")] == [0] and acc.Scalars("critic/score/mean")
    assert [e.step for e in acc.Tensors("seal/trajectories/text_summary")] == [0]
    state = json.loads((run / "tracking" / "state.json").read_text())
    assert state["logged"]["tensorboard"][:2] == ["eval base", "round 0"]
    config = json.loads((run / "config.json").read_text())["settings"]
    assert config["env"] == "tau2:shop" and config["tasks"] == "tau2:shop:train"
    records = [json.loads(line) for line in open(run / "round_000" / "rollouts.jsonl")]
    assert sorted({r["task_id"] for r in records}) == ["one_teapot", "two_mugs"] and len(records) == 4
    assert all(r["env"] == "tau2:shop" and r["interface_version"] == 0 for r in records)
    assert len(open(run / "round_000" / "diagnoses.jsonl").readlines()) == 4
    assert (run / "round_000" / "policy" / "model.safetensors").is_file()
    for scores in (tmp_path / "base-tiny-tau2-shop" / "eval" / "scores.json", run / "eval" / "round_000" / "scores.json"):
        s = json.loads(scores.read_text())
        assert s["split"] == "test" and s["tasks"] == {"shop": 1} and "shop" in s  # the tiny preset's EVAL_LIMIT
        assert s["user_simulator"]["kind"] == "scripted"
    report = (run / "report.md").read_text()
    assert "τ²-bench shop, test split" in report
    # the viewer's trajectory page shows the user simulator's opening and τ²'s verdict
    from helpers import browse
    dom = browse(run / "viewer" / "index.html", "traj/0/two_mugs/0")
    text = dom.text()
    assert "user: I want to order 2 mugs (item i1)." in text and "official verdict" in text
    assert re.search(r"official verdict(valid|invalid: DB 0 \(\w+\))turn labels", text), text[:2000]
    res = _stage("evaluate.py", "--compare", str(run))
    header, *rows = res.stdout.splitlines()
    assert res.returncode == 0 and header.split() == ["mode", "shop", "average"], res.stdout
    assert len(rows) >= 2 and all(r.endswith("τ² test split") for r in rows[:2])
    assert "BFCL held-in" in res.stdout
    for folder in (tmp_path / "base-tiny-tau2-shop" / "ood", run / "ood" / "round_000"):
        assert json.loads((folder / "bfcl-heldin" / "scores.json").read_text())["average"] >= 0


def test_the_scripted_user_acts_after_the_agents_own_actions(tau2):
    """Telecom's gold actions mix the agent's and the user's (refuel_data by the agent, then
    toggle_roaming on the user's phone): the ScenarioUser performs its action when asked, after
    the agent's; two actions asked for in one message are both performed, one after the other's
    result; τ²'s environment assertions pass."""
    def performed(record):
        return [c["name"] for m in record["transcript"] if m["role"] == "user" for c in m.get("tool_calls") or []]

    task_id = "[mobile_data_issue]data_usage_exceeded|user_abroad_roaming_enabled_off[PERSONA:Easy]"
    task = next(t for t in tau2.tasks("telecom") if t.id == task_id)
    agent, user = task.evaluation_criteria.actions
    assert (agent.requestor, user.requestor) == ("assistant", "user")
    record, diagnosis = scripted(tau2, "telecom", task_id, [
        call(agent.name, **agent.arguments), f"Please do this on your side: {user.get_func_format()}.", DONE])
    assert diagnosis["reward"] == 1.0 and performed(record) == [user.name], diagnosis
    task_id = "[mobile_data_issue]airplane_mode_on|user_abroad_roaming_enabled_off[PERSONA:None]"
    task = next(t for t in tau2.tasks("telecom") if t.id == task_id)
    first, second = task.evaluation_criteria.actions
    assert (first.requestor, second.requestor) == ("user", "user")
    record, diagnosis = scripted(tau2, "telecom", task_id, [
        f"Please do this on your side: {first.get_func_format()}; then {second.get_func_format()}.", DONE])
    assert diagnosis["reward"] == 1.0 and performed(record) == [first.name, second.name], diagnosis


def test_the_loop_refuses_an_unknown_domain_before_any_round(tmp_path):
    """tiny on ENV=tau2:DOMAIN builds the domain's tiny model first: a domain τ²'s registry does not
    hold stops there, named, with nothing written under the runs folder."""
    res = subprocess.run(["bash", "loop.sh", "tiny", "--set", "ENV=tau2:nope", "--runs", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert res.returncode == 2 and "loop: ENV=tau2:nope: τ² domain 'nope'" in res.stderr, res.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_an_episode_the_agent_never_spoke_in_has_its_prompt(tau2, tokenizer):
    """An episode that ends before the agent's first output (its user simulator failed at once)
    still records the prompt the agent would have been shown, so training reads it as any other
    record (an empty prompt is refused there)."""
    from helpers import Scripted

    from common.envs.bfcl.play import PlaySpec
    from common.train.grpo import token_segments
    env = tau2.registry.get_env_constructor("mock")()
    policy = T.ModelPolicy(Scripted(tokenizer, lambda prompt: DONE), env.get_tools(), "Be brief.",
                           PlaySpec(fmt="json", max_model_len=4096, max_new_tokens=16))
    tokens = policy.tokens([{"role": "assistant", "content": "Hi! How can I help you today?"}])
    assert tokens["ids"] == [] and "Hi! How can I help you today?" in tokenizer.decode(tokens["prompt_ids"])
    assert token_segments(tokens) == [tokens]


def test_rollouts_against_a_served_user_simulator(tmp_path, tiny_model, tiny_server):
    """Training rollouts whose user is τ²'s own UserSimulator on a served model (the session's
    vLLM server on the tiny model, reached as an endpoint the user runs): the user's turns are
    the simulator's, the record names it, and the episodes are diagnosed as any other."""
    out = tmp_path / "r.jsonl"
    res = _stage("rollout.py", "--model", tiny_model, "--tasks", "tau2:mock:base", "--task-ids", "create_task_1",
                 "--n", "2", "--engine", "hf", "--user-base-url", f"{tiny_server}/v1/", "--user-model-name", "policy",
                 "--user-max-tokens", "16", "--max-episode-steps", "6", "--max-new-tokens", "16", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["user_simulator"] == f"policy at {tiny_server}/v1"
        assert r["termination"] in ("max_steps", "user_stop", "user_error", "agent_error", "agent_stop")
        users = [m for m in r["transcript"] if m["role"] == "user"]
        assert users and r["turns"] and r["turns"][0]["user"] == users[0]["content"]
        assert len(r["transcript"]) <= 6 + 1  # τ²'s greeting, then at most the steps allowed
    res = _stage("diagnose.py", "--tasks", "tau2:mock:base", "--rollouts", str(out), "--out", str(tmp_path / "d.jsonl"))
    assert res.returncode == 0, res.stderr[-3000:]
    res = _stage("rollout.py", "--model", tiny_model, "--tasks", "data/tiny.jsonl", "--max-episode-steps", "6",
                 "--out", str(out))
    assert res.returncode == 2 and "--max-episode-steps: for tau2 tasks" in res.stderr


def test_async_episodes_send_their_own_generations(tau2, tiny_model, tiny_server):
    """τ² rollouts on the async schedule (the session's vLLM server, the scripted user): each
    episode sends its generations itself, one prompt a request from its own thread, pinned under
    its key until it ends; one episode's first generation is held until another episode has
    ended, which no barrier across episodes would allow. The records come in (task, sample)
    order and are the lock-step schedule's (one batched engine call per step) at temperature 0;
    a request the server refuses fails the rollouts with its answer."""
    import math

    from common.engine.engines import ServerEngine
    from common.envs.bfcl.play import PlaySpec

    class Holding(ServerEngine):
        """vLLM's server, the first request held until an episode other than its own ended."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen, self.held, self.ended, self.mutex = [], None, threading.Event(), threading.Lock()

        def request(self, key, prompt, max_new_tokens, sampling):
            with self.mutex:
                self.seen.append((key, threading.get_ident()))
                hold = self.held is None
                self.held = key if hold else self.held
            if hold and not self.ended.wait(60):
                raise AssertionError("no episode ended while another's generation was held: a barrier")
            return super().request(key, prompt, max_new_tokens, sampling)

        def release(self, key):
            super().release(key)
            if key != self.held:
                self.ended.set()

    tasks = [t for t in tau2.tasks("mock") if T.playable(t)][:2]
    settings = dict(fmt="json", temperature=0.0, max_model_len=8192, max_new_tokens=16)
    engine = Holding([tiny_server], tiny_model, max_model_len=8192)
    try:
        asyn, timing = T.rollouts(tau2, "mock", tasks, 2, engine, PlaySpec(schedule="async", **settings), T.SCENARIO)
        seen, batched = list(engine.seen), engine.calls  # generate() calls: none on the async schedule
        assert not engine.pins and not engine.requesting  # every episode's key released at its end
        lock, _ = T.rollouts(tau2, "mock", tasks, 2, engine, PlaySpec(schedule="lockstep", **settings), T.SCENARIO)
        refused = PlaySpec(schedule="async", **settings | {"temperature": -1.0})  # the server answers 400
        with pytest.raises(RecordError, match="answered 400"):  # the stage fails with the server's answer
            T.rollouts(tau2, "mock", tasks, 2, engine, refused, T.SCENARIO)
    finally:
        engine.close()
    order = [(t.id, k) for t in tasks for k in range(2)]
    assert [(r["task_id"], r["sample_index"]) for r in asyn] == [(r["task_id"], r["sample_index"]) for r in lock] == order
    threads = {}
    for key, thread in seen:
        threads.setdefault(key, set()).add(thread)
    assert sorted(threads) == order and all(len(t) == 1 for t in threads.values())  # each its own thread
    assert len(set.union(*threads.values())) == len(order) and batched == 0
    assert engine.held in order and engine.ended.is_set()
    generations = sum(len(t["steps"]) for r in asyn for t in r["turns"])
    assert len(seen) == generations >= len(order)  # one request per output, one prompt each
    assert timing["prompt_tokens"] > 0 and 0 <= timing["engine_seconds"] <= timing["seconds"]
    for a, b in zip(asyn, lock, strict=True):
        assert a["env"] == "tau2:mock" and a["termination"] and a["transcript"]
        ta, tb = a.pop("tokens"), b.pop("tokens")
        assert len(ta["ids"]) == len(ta["mask"]) == len(ta["logprobs"]) and sum(ta["mask"]) == a["stats"]["gen_tokens"]
        assert (ta["prompt_ids"], ta["ids"], ta["mask"]) == (tb["prompt_ids"], tb["ids"], tb["mask"])
        # log-probs: the batches differ between schedules, and float sums may too
        assert all((x is None) == (y is None) and (x is None or math.isclose(x, y, abs_tol=1e-4))
                   for x, y in zip(ta["logprobs"], tb["logprobs"], strict=True))
        for r in (a, b):  # wall times: the episode's, its messages' timestamps
            r["stats"].pop("seconds")
            r["transcript"] = [{k: v for k, v in m.items() if k != "timestamp"} for m in r["transcript"]]
        assert a == b
