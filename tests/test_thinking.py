"""Thinking models trained on what they saw (docs/design.md §3, segments).

bfcl-eval's QwenFCHandler keeps an assistant message's reasoning only after the last user
query: at a new user turn its prompt drops the reasoning the model wrote, and is no extension
of the generated tokens. A training rollout goes on from the handler's rendering there, in a new
segment. Checked against bfcl-eval's own multi-turn loop (tests/test_prompts.py `theirs`): every
step's prompt is the one it builds, byte for byte; the trainer scores each segment in its own
context; calls are parsed from the answer, never from the reasoning.
"""

import json
import os

import pytest
from helpers import Script, theirs
from transformers import AutoTokenizer

from common.engine import calls as C
from common.engine import episode
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play, prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def multi_turn(heldin, k=3):
    """Tasks of several user turns: the first `k` of each category with at least three."""
    out = []
    for cat in bfcl.CATEGORIES:
        out += [t for t in heldin.values() if t["category"] == cat and len(t["questions"]) >= 3][:k]
    return out


def thinking_script(task, think_turns):
    """Per (turn, step): reasoning on the turns in `think_turns`, then the ground-truth calls
    (as the handler renders them) and a plain answer."""
    def script(task_id, turn, step):
        head = f"<think>\nturn {turn}, step {step}: plan\n</think>\n\n" if turn in think_turns else ""
        gt = bfcl.ground_truth_calls(task, turn)
        if gt and step == 0:
            return head + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in gt)
        return head + "Done."
    return script


class Seen(Script):
    """The scripted policy, keeping every prompt (as ids) the trajectory sent it."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.prompts = []

    def generate(self, prompts_, max_new_tokens, temperature):
        self.prompts += [list(p) for p in prompts_]
        return super().generate(prompts_, max_new_tokens, temperature)


def train_play(task, engine):
    spec = play.PlaySpec(temperature=1.0, max_model_len=1 << 30, max_new_tokens=4096)
    traj = play.Trajectory(task, 0, spec, engine.tokenizer, engine.stop_ids)
    engine.traj = traj
    episode.run([traj], engine, spec, progress=False)
    return traj.record(0, "script")


@pytest.mark.parametrize("think_turns", [range(99), (0, 2)], ids=["every_turn", "turns_0_2"])
def test_training_prompts_are_bfcl_evals_with_reasoning_dropped_where_it_drops_it(heldin, entries, tokenizer,
                                                                                 think_turns):
    """Token-in/token-out training rollouts of a model that thinks (on every turn, or on some):
    every step's prompt is the one bfcl-eval's multi-turn loop formats from the same outputs,
    byte for byte, the reasoning of earlier turns dropped; a new segment starts exactly at the
    turns after one with reasoning, its prompt_ids the handler's prompt as the server tokenises
    it; within a segment each prompt extends the last; the model tokens are the outputs, once."""
    for task in multi_turn(heldin):
        engine = Seen(tokenizer, thinking_script(task, think_turns))
        rec = train_play(task, engine)
        texts = [s["text"] for turn in rec["turns"] for s in turn["steps"]]
        seen, error = theirs(entries[task["id"]], texts)
        assert error is None and rec["stop"] == "done"
        mine = [tokenizer.decode(p, skip_special_tokens=False) for p in engine.prompts]
        assert mine == seen, task["id"]
        segs = [rec["tokens"], *rec["tokens"].get("segments", [])]
        starts = [t for t in range(1, len(rec["turns"])) if t - 1 in think_turns]
        assert [s.get("turn", 0) for s in segs] == [0, *starts]
        # each segment's prompt is a step's whole prompt; the steps in it extend it token for token
        step_of_turn = [sum(len(t["steps"]) for t in rec["turns"][:k]) for k in range(len(rec["turns"]))]
        bounds = [step_of_turn[s.get("turn", 0)] for s in segs] + [len(seen)]
        for seg, k, end in zip(segs, bounds, bounds[1:], strict=False):
            assert seg["prompt_ids"] == engine.prompts[k] == tokenizer(seen[k])["input_ids"]
            context = seg["prompt_ids"] + seg["ids"]
            assert all(p == context[:len(p)] for p in engine.prompts[k:end])
        generated = [tokenizer.decode([i for i, m in zip(s["ids"], s["mask"], strict=True) if m]) for s in segs]
        assert "".join(generated) == "".join(f"{t}<|im_end|>" for t in texts)
        assert rec["stats"]["gen_tokens"] == sum(sum(s["mask"]) for s in segs)


def test_a_history_the_handler_cannot_render_fails_at_the_new_turn(heldin, entries, tokenizer):
    """A thinking output with a malformed <tool_call> block: bfcl-eval keeps it and its next
    turn's prompt raises, an inference error for the entry; the training rollout re-renders at
    that turn and stops there the same way."""
    task = multi_turn(heldin, 1)[0]
    good = thinking_script(task, range(99))

    def script(tid, turn, step):
        return '<think>\nx\n</think>\n\n<tool_call>\n{"name": "ls"}\n</tool_call>' if (turn, step) == (0, 0) \
            else good(tid, turn, step)
    engine = Seen(tokenizer, script)
    rec = train_play(task, engine)
    seen, error = theirs(entries[task["id"]], [s["text"] for t in rec["turns"] for s in t["steps"]])
    assert error is not None and rec["stop"] == "inference_error" and rec["inference_error"] == str(error)
    assert len(rec["turns"]) == 2 and "segments" not in rec["tokens"]


def test_non_thinking_rollouts_stay_one_segment(heldin, tokenizer):
    """Without reasoning the context is never re-rendered: one segment, as before segments existed."""
    task = multi_turn(heldin, 1)[0]
    rec = train_play(task, Seen(tokenizer, thinking_script(task, ())))
    assert rec["stop"] == "done" and "segments" not in rec["tokens"]


@pytest.mark.parametrize("text", [
    "<think>\nI could call <tool_call>\n{\"name\": \"rm\", \"arguments\": {\"file_name\": \"a\"}}\n</tool_call>\n</think>\n\nDone.",
    "<think>\nplan\n</think>\n\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>",
    "<think>\n<tool_call>\n{\"name\": \"rm\"}\n</tool_call></think><tool_call>\n{\"name\": \"pwd\", \"arguments\": {}}\n</tool_call>",
    "no reasoning <tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>",
])
def test_calls_are_parsed_from_the_answer_as_bfcl_eval_decodes_it(text):
    """The calls (what runs, what diagnosis, evidence and Ω's cues read) are those of the answer
    bfcl-eval's QwenFCHandler splits off the reasoning (its _parse_query_response_prompting,
    whose `model_responses` its harness decodes): a call written inside <think> never runs."""
    answer = prompts.handler("QwenFCHandler")._parse_query_response_prompting(prompts.response(text))["model_responses"]
    assert C.parse(text, "json") == C.parse(answer, "json")
    assert "rm" not in [c["name"] for c in C.parse(text, "json")[0]]


# ---------------------------------------------------------------- the tiny thinking model


@pytest.fixture(scope="module")
def thinking_model():
    from common.run.tiny import THINKING, build_cached
    return build_cached(**THINKING)


@pytest.fixture(scope="module")
def thought(thinking_model, heldin):
    """Rollouts of the tiny thinking model on multi-turn tasks, token-in/token-out at T = 1."""
    from common.engine.engines import make_engine
    engine = make_engine("hf", thinking_model, max_model_len=32768, seed=0)
    # the two with the fewest tool docs: the suite's time goes into prefilling prompts on CPU
    tasks = sorted(multi_turn(heldin, 99), key=lambda t: len(json.dumps(t["tools"])))[:2]
    try:
        spec = play.PlaySpec(temperature=1.0, max_new_tokens=40, max_model_len=32768, max_steps_per_turn=2)
        records, _ = play.play(tasks, 2, engine, spec, progress=False)
    finally:
        engine.close()
    return tasks, records


def test_the_tiny_thinking_model_is_qwen3_and_opens_with_think(thinking_model, heldin):
    """Qwen3's architecture, <think> and </think> as added tokens decoding keeps (as Qwen3's
    tokenizer has them), and <think> the first token it writes on every first prompt, by far."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(thinking_model)
    model = AutoModelForCausalLM.from_pretrained(thinking_model).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    think = tok.convert_tokens_to_ids("<think>")
    assert tok.decode([think, tok.convert_tokens_to_ids("</think>")], skip_special_tokens=True) == "<think></think>"
    with torch.no_grad():
        for task in multi_turn(heldin, 1):
            ids = tok(prompts.first_prompt(task))["input_ids"]
            assert torch.softmax(model(torch.tensor([ids])).logits[0, -1], -1)[think] > 0.9, task["id"]


def test_thinking_rollouts_segment_at_bfcl_evals_prompts_and_score_as_played(thought, entries, thinking_model):
    """The tiny thinking model's own rollouts: every segment starts at the prompt bfcl-eval's
    multi-turn loop sends at that step (from the same outputs), byte for byte, and each
    segment's engine log-probs equal the trainer's fresh recomputation of it in its own context."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.train.grpo import TrainingSequence, collate, sequence_logprobs

    tasks, records = thought
    tok = AutoTokenizer.from_pretrained(thinking_model)
    model = AutoModelForCausalLM.from_pretrained(thinking_model).eval()
    segmented = 0
    for rec in records:
        segs = [rec["tokens"], *rec["tokens"].get("segments", [])]
        segmented += len(segs) > 1
        seen, _ = theirs(entries[rec["task_id"]], [s["text"] for t in rec["turns"] for s in t["steps"]])
        first_step = [sum(len(t["steps"]) for t in rec["turns"][:s.get("turn", 0)]) for s in segs]
        assert [tok.decode(s["prompt_ids"], skip_special_tokens=False) for s in segs] == [seen[k] for k in first_step]
        for s in segs[1:]:  # a new segment where the turn before it wrote reasoning
            assert any("</think>" in st["text"] for st in rec["turns"][s["turn"] - 1]["steps"])
        seqs = [TrainingSequence("t", 0, s["prompt_ids"], s["ids"], s["mask"], s["logprobs"], 0.0, 1.0)
                for s in segs if sum(s["mask"])]
        with torch.no_grad():
            for seq in seqs:
                b = collate([seq], "cpu")
                lp = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["off"], 1.0, b["mask"])[0]
                lp = lp[len(seq.prompt_ids) - b["off"]:][b["mask"][0, len(seq.prompt_ids) - b["off"]:]]
                engine = torch.tensor([x for x, m in zip(seq.engine_logprobs, seq.mask, strict=True) if m])
                assert torch.allclose(lp, engine, atol=2e-3), (rec["task_id"], (lp - engine).abs().max())
    # How often a sampled trajectory gets past a turn with reasoning depends on the build's floats;
    # the scripted test above segments deterministically. Here every segment the model did produce
    # was checked, and so was every first one.
    print(f"{segmented} of {len(records)} trajectories segmented")


def segmented_copy(tokens):
    """A played record's tokens as two segments: the second holds the later half of its tokens after
    a prompt of everything before them (what a re-render hands on, here without dropping anything)."""
    k = len(tokens["ids"]) // 2
    rest = {"turn": 1, "prompt_ids": tokens["prompt_ids"] + tokens["ids"][:k]}
    return tokens | {f: tokens[f][:k] for f in ("ids", "mask", "logprobs")} | {
        "segments": [rest | {f: tokens[f][k:] for f in ("ids", "mask", "logprobs")}]}


def test_a_round_trains_on_segmented_rollouts(thought, thinking_model, heldin, tmp_path):
    """diagnose.py's labels (from the answers) and train_grpo.py, one process, on the segmented
    rollouts: the round writes a policy whose log-probs moved."""
    import subprocess
    import sys

    from helpers import in_process

    tasks, records = thought
    if not any("segments" in r["tokens"] for r in records):  # sampling: see the test above
        records = [records[0] | {"tokens": segmented_copy(records[0]["tokens"])}, *records[1:]]
    rollouts, diagnoses, out = tmp_path / "rollouts.jsonl", tmp_path / "diagnoses.jsonl", tmp_path / "policy"
    rollouts.write_text("".join(json.dumps(r) + "\n" for r in records))
    taskfile = tmp_path / "tasks.jsonl"
    taskfile.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    proc = subprocess.run([sys.executable, "diagnose.py", "--tasks", str(taskfile), "--rollouts", str(rollouts),
                           "--out", str(diagnoses)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    diags = [json.loads(line) for line in diagnoses.read_text().splitlines()]
    if len({d["reward"] for d in diags}) == 1:  # every group equal: give one group a signal to learn
        diags[0]["reward"] = 1 - diags[0]["reward"]
        diagnoses.write_text("".join(json.dumps(d) + "\n" for d in diags))
    proc = in_process(["--model", thinking_model, "--rollouts", str(rollouts), "--diagnoses", str(diagnoses),
                       "--out", str(out), "--cpu", "--lr", "1e-3", "--mini-batch-tasks", "8",
                       "--max-tokens-per-micro-batch", "20000"])
    assert proc.returncode == 0, proc.stderr
    metrics = [json.loads(line) for line in (tmp_path / "train_metrics.jsonl").read_text().splitlines()]
    tokens = sum(sum(s["mask"]) for r in records for s in [r["tokens"], *r["tokens"].get("segments", [])])
    assert metrics[0]["step"] == 1 and 0 < metrics[0]["model_tokens"] <= tokens  # each model token once
    assert os.path.isfile(out / "config.json")


# ----------------------------------------------------------------------------- τ²-bench


def _qwen3_style():
    """The tiny chat template with Qwen3's rule for reasoning: an assistant message before the last
    user message is shown without what precedes its </think> (Qwen3-8B's template drops it too)."""
    from common.run.tiny import CHAT_TEMPLATE
    last = ("{%- set ns = namespace(last=-1) -%}{%- for m in rest -%}{%- if m.role == 'user' -%}"
            "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}\n{%- for message in rest -%}")
    shown = ("{%- set content = message.content.split('</think>')[-1].lstrip('\\n') if message.role == 'assistant' "
             "and loop.index0 < ns.last and '</think>' in message.content else message.content -%}"
             "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}")
    out = CHAT_TEMPLATE.replace("{%- for message in rest -%}", last, 1)
    return out.replace("{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}", shown, 1)


QWEN3_STYLE = _qwen3_style()


def test_a_thinking_model_on_tau2_trains_segment_by_segment(thinking_model, tmp_path):
    """τ² episodes render with the model's chat template, and Qwen3's drops earlier reasoning once a
    new user message follows: the episode goes on from the template's rendering in a new segment
    (as on BFCL), never a traceback. Each segment starts at the template's prompt of the
    conversation so far, the reasoning is never said to the user, τ²'s evaluator scores the answers,
    and a round of train_grpo.py takes an optimiser step on the segmented records."""
    from helpers import Scripted, train_one_round

    from common.envs.bfcl.play import PlaySpec
    from common.envs.tau2 import diagnose as D
    from common.envs.tau2 import tau2 as T
    from common.seal import interface as omega_api
    from common.train.grpo import token_segments

    tau2 = T.import_tau2()
    tok = AutoTokenizer.from_pretrained(thinking_model)
    tok.chat_template = QWEN3_STYLE
    task = next(t for t in tau2.tasks("mock") if t.id == "create_task_1")
    gold = C.format_calls([{"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}}],
                          "json")
    spec = PlaySpec(omega=omega_api.initial(), fmt="json", temperature=1.0, max_model_len=8192, max_new_tokens=96)
    records = []
    for first in (gold, "I cannot do that."):  # reward 1, then 0: a group to learn from
        texts = iter([f"<think>\nplan {k}\n</think>\n\n{text}" for k, text in
                      enumerate([first, "Anything else?", "Your request is complete."])])
        engine = Scripted(tok, lambda prompt, texts=texts: next(texts))
        (record,), _ = T.rollouts(tau2, "mock", [task], 1, engine, spec, T.SCENARIO)
        records.append(record | {"sample_index": len(records)})
    for record in records:
        segs = token_segments(record["tokens"])
        # a new segment at every user message after the first: the template dropped the reasoning
        assert len(segs) >= 2 and [s.get("turn", 0) for s in segs] == list(range(len(record["turns"])))
        assert sum(sum(s["mask"]) for s in segs) == record["stats"]["gen_tokens"] > 0
        texts = [tok.decode(s["prompt_ids"], skip_special_tokens=False) for s in segs]
        assert all("plan" not in t for t in texts[1:])
        assert all("plan" not in (m.get("content") or "") for m in record["transcript"] if m["role"] == "assistant")
        # each prompt is the template's rendering of the whole conversation: the answers stay
        first_text = record["turns"][0]["steps"][0]["text"].split("</think>")[-1].strip()
        assert all(first_text in t and t.endswith("<|im_start|>assistant\n") for t in texts[1:])
        assert "plan 0" in tok.decode(segs[0]["prompt_ids"] + segs[0]["ids"], skip_special_tokens=False)
    diagnoses = [D.diagnose(tau2, "mock", task, r) for r in records]
    assert [d["reward"] for d in diagnoses] == [1.0, 0.0]
    assert [m["step"] for m in train_one_round(thinking_model, records, diagnoses, tmp_path)] == [1]
