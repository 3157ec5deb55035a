"""Prompt parity with bfcl-eval's own harness, text for text.

The reference is bfcl-eval's `inference_multi_turn_prompting` itself (its message flow,
its executor, its handler's `_format_prompt`), run on a subclass of the handler whose
`_query_prompting` answers with the texts our trajectory produced instead of asking a
server: every prompt it formats is compared with the prompt our evaluation sent for
that step. Its task entries come from bfcl-eval's own `load_dataset_entry` (tool docs
with its language hint, held-out docs in its order), not from our data files.
"""

import copy
import json
import os

import pytest
from helpers import Script, theirs

from common.engine import calls as C
from common.engine import episode
from common.envs.bfcl import harness as bfcl
from common.envs.bfcl import play, prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def ours(task, engine, handler="QwenFCHandler", fmt="json"):
    """Our evaluation's record of `task` under the scripted policy, with each step's prompt."""
    # Parity is about text: the tiny tokenizer (4k tokens) needs more than a real model's 32k context
    # for the biggest long-context results, so the context here is unbounded.
    spec = play.PlaySpec(fmt=fmt, temperature=0.001, max_model_len=1 << 30, max_new_tokens=4096, handler=handler,
                         rerender=True)
    traj = play.Rerendered(task, 0, spec, engine.tokenizer, engine.stop_ids)
    engine.traj = traj
    episode.run([traj], engine, spec, progress=False)
    return traj.record(0, "script"), traj


def oracle_script(task):
    """Per (turn, step): the ground-truth calls, then a plain answer."""
    def script(task_id, turn, step):
        gt = bfcl.ground_truth_calls(task, turn)
        return C.format_calls(gt, "json") if gt and step == 0 else "Done."
    return script


def check_parity(task, entry, engine, handler="QwenFCHandler", fmt="json"):
    rec, traj = ours(task, engine, handler, fmt)
    texts = [s["text"] for turn in rec["turns"] for s in turn["steps"]]
    seen, error = theirs(entry, texts, handler)
    mine = [s["formatted_prompt"] for turn in rec["turns"] for s in turn["steps"]]
    assert len(seen) == len(mine), (task["id"], len(seen), len(mine))
    for k, (a, b) in enumerate(zip(seen, mine, strict=True)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            raise AssertionError(f"{task['id']} step {k}: bfcl-eval's {a[at - 60:at + 60]!r} vs ours {b[at - 60:at + 60]!r}")
    return rec, error


def test_oracle_prompts_are_bfcl_evals_on_every_heldin_task(heldin, entries, tokenizer):
    """All 400 held-in tasks played by the oracle: every step's prompt is the one bfcl-eval's
    harness builds from the same history, byte for byte (QwenFCHandler)."""
    first = prompts.first_prompt(next(iter(heldin.values())))
    # what the play loop counts as bfcl-eval's input length (its tokenizer.tokenize)
    assert len(tokenizer.tokenize(first)) == len(tokenizer(first)["input_ids"]) - tokenizer.num_special_tokens_to_add()
    steps = 0
    for task in heldin.values():
        engine = Script(tokenizer, oracle_script(task))
        rec, error = check_parity(task, entries[task["id"]], engine)
        assert error is None and rec["stop"] == "done"
        steps += sum(len(t["steps"]) for t in rec["turns"])
    # every turn played: the calls and an answer, or the answer alone where nothing is to be called
    assert steps == sum(2 if gt else 1 for t in heldin.values() for gt in t["ground_truth"])


def test_prompt_ids_equal_whole_encodes(heldin, tokenizer):
    """PromptIds (each step's prompt ids from the last prompt's, as evaluation plays) equals
    encoding every prompt whole: on held-in plays of every category (the longest included), on
    prompts that rewrite earlier history or shrink, with special-token text inside a message,
    with a tokenizer that adds a BOS, and with an added token that strips whitespace."""
    tasks = list(heldin.values())[::25] + [max(heldin.values(), key=lambda t: len(json.dumps(t)))]
    for task in tasks:
        _, traj = ours(task, Script(tokenizer, oracle_script(task)))
        ids = prompts.PromptIds(tokenizer)
        assert len(traj.step_prompts) > 1
        for text in traj.step_prompts:
            assert ids(text) == tokenizer(text)["input_ids"], task["id"]

    def msg(role, text):
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"
    a = msg("system", "tools") + msg("user", "list  files") + "<|im_start|>assistant\n"
    texts = [a, a + "<tool_call>\n{}\n</tool_call><|im_end|>\n" + msg("user", "ok <|im_end|> then") + "<|im_start|>",
             a.replace("tools", "other tools") + msg("user", "again"), a[:20], a, "no marks at all", a + " x"]
    bos = copy.deepcopy(tokenizer)
    from tokenizers.processors import TemplateProcessing
    bos.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
        ("<|endoftext|>", bos.convert_tokens_to_ids("<|endoftext|>"))])
    stripping = copy.deepcopy(tokenizer)
    from tokenizers import AddedToken
    stripping.add_tokens([AddedToken("<|strip|>", lstrip=True, rstrip=True)])
    for tok in (tokenizer, bos, stripping):
        ids = prompts.PromptIds(tok)
        for text in texts + [a + "  <|strip|>  b", a + "  <|strip|>  b" + msg("user", "c")]:
            assert ids(text) == tok(text)["input_ids"], (text, tok(text).tokens())
    assert bos(a)["input_ids"][:2] == [bos.convert_tokens_to_ids("<|endoftext|>"), bos.convert_tokens_to_ids("<|im_start|>")]
    assert "<|strip|>" in stripping.get_added_vocab() and stripping.convert_tokens_to_ids("<|strip|>") not in \
        prompts.PromptIds(stripping).marks


NON_ASCII = '<tool_call>\n{"name": "mkdir", "arguments": {"dir_name": "Résumé_数据"}}\n</tool_call>'
OUTPUTS = {
    "prose": 'Let me look first.\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\nThen I will answer.',
    "compact": '<tool_call>\n{"arguments":{"a":true},"name":"ls"}\n</tool_call>',
    "reordered": '<tool_call>\n{"arguments": {"folder": "document"}, "name": "cd"}\n</tool_call>',
    "non_ascii": NON_ASCII,
    "one_bad_block": ('<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "cd", '
                      '"arguments": {"folder": \n</tool_call>\n<tool_call>\n{"name": "pwd", "arguments": {}}\n</tool_call>'),
    "think": '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "pwd", "arguments": {}}\n</tool_call>',
    "plain_answer": "I have done it.",
}


@pytest.mark.parametrize("kind", sorted(OUTPUTS))
def test_model_outputs_are_re_rendered_as_bfcl_eval_does(heldin, entries, tokenizer, kind):
    """Outputs with prose around calls, compact or reordered JSON, non-ASCII values, a bad block
    among good ones, reasoning: the next prompts equal bfcl-eval's (it keeps the decoded calls,
    not the text), on a base task and on a miss_func task's held-out turn."""
    for task_id in ("multi_turn_base_100", "multi_turn_miss_func_100"):
        task = heldin.get(task_id) or next(t for t in heldin.values() if t["id"].startswith(task_id[:-3]))
        gt_script = oracle_script(task)

        def script(tid, turn, step, gt_script=gt_script):
            return OUTPUTS[kind] if step == 0 else gt_script(tid, turn, step)
        rec, error = check_parity(task, entries[task["id"]], Script(tokenizer, script))
        assert error is None
        if task["missed_function"]:
            turn = int(next(iter(task["missed_function"])))
            prompt = rec["turns"][turn]["steps"][0]["formatted_prompt"]
            assert repr(task["missed_function"][str(turn)])[:40] in prompt  # a Python repr, as bfcl-eval writes


@pytest.mark.parametrize("block", ['{"name": "ls"}', '[{"name": "ls", "arguments": {}}]', '{"name": 7, "arguments": {}}'])
def test_a_malformed_block_fails_the_entry_as_bfcl_eval_does(heldin, entries, tokenizer, block):
    """A block whose JSON has no arguments, is a list, or has a non-string name: bfcl-eval keeps it
    in the history and its next _format_prompt raises; the entry is an inference error there, and
    here (scored as failed), with the same prompts up to that point."""
    task = heldin["multi_turn_base_100"] if "multi_turn_base_100" in heldin else next(iter(heldin.values()))
    gt_script = oracle_script(task)

    def script(tid, turn, step):
        return f"<tool_call>\n{block}\n</tool_call>" if turn == 0 and step == 0 else gt_script(tid, turn, step)
    rec, error = check_parity(task, entries[task["id"]], Script(tokenizer, script))
    assert error is not None
    assert rec["stop"] == "inference_error" and rec["inference_error"] == str(error)
    assert bfcl.official_verdict(task, [])["valid"] is False


def test_llama_handler_prompts_on_the_tiny_model(heldin, entries, tiny_model):
    """ToolACE-2-8B's handler (LlamaHandler, prompting, Python-list calls): the tiny model's own
    outputs, re-rendered, give bfcl-eval's prompts (no ToolACE weights here: the format is tested)."""
    from common.engine.engines import make_engine
    engine = make_engine("hf", tiny_model, max_model_len=32768, seed=0)
    tasks = [t for t in heldin.values()][:1] + [t for t in heldin.values() if t["missed_function"]][:1]
    try:
        spec = play.PlaySpec(fmt="python", temperature=0.0, max_new_tokens=24, max_model_len=32768,
                             prompts="bfcl", handler="LlamaHandler", rerender=True)
        records, _ = play.play(tasks, 1, engine, spec, progress=False)
    finally:
        engine.close()
    for task, rec in zip(tasks, records, strict=True):
        texts = [s["text"] for turn in rec["turns"] for s in turn["steps"]]
        seen, error = theirs(entries[task["id"]], texts, "LlamaHandler")
        mine = [s["formatted_prompt"] for turn in rec["turns"] for s in turn["steps"]]
        assert seen == mine and error is None
        assert mine[0].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")


def test_unknown_handler_is_a_clear_error():
    with pytest.raises(prompts.HandlerError, match="choices: QwenFCHandler, LlamaHandler"):
        prompts.check_handler("NoSuchHandler")


@pytest.mark.parametrize("args, message", [
    (["--handler", "NoSuchHandler"], "choices: QwenFCHandler, LlamaHandler"),
    (["--max-model-len", "99999999"], "exceeds the model's context"),
])
def test_evaluate_refuses_bad_settings_before_any_output(tmp_path, tiny_model, args, message):
    import subprocess
    import sys
    out = tmp_path / "eval"
    res = subprocess.run([sys.executable, "evaluate.py", "--policy", tiny_model, "--engine", "hf", "--limit", "1",
                          "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode != 0 and message in res.stderr
    assert not out.exists()
