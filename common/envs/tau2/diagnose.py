"""Ψ's rules on τ²-bench episodes (docs/environments.md §3; common/seal/taxonomy.py holds the labels and
their priority order): τ²'s verdict on the episode gathered into an `Episode`, each user turn's evidence
into a `Turn`.
"""

import dataclasses

from common.engine import calls as calls_api
from common.jsonl import RecordError
from common.seal import taxonomy
from common.seal.taxonomy import arg_diff, invalid_tool_call, line, profile, show

EVAL_RAISED = "τ²'s evaluation raised"


def argument_mismatch(turn, episode):
    """A call names a missing gold action's tool and matches no gold action (τ²'s compare_args, else all)."""
    for call in turn.calls:
        for action in episode.unmatched_actions:
            if action.name == call["name"] and not episode.matches_gold(call):
                return f"{call['name']}: {arg_diff(call['arguments'], action.arguments)}"
    return None


def state_mismatch(turn, episode):
    """τ²'s database check fails (naming the differing rows), or an environment assertion does not hold."""
    if episode.db_match is False:
        return f"database differs from the gold actions' replay: {episode.db_diff or 'τ² hash check'}"
    if episode.failed_assertions:
        return f"environment assertion not met: {episode.failed_assertions[0]}"
    return None


def recovery_failure(turn, episode):
    """The turn's last call failed (τ²'s error=True) and nothing corrected it in the turn."""
    if turn.results and turn.errors[-1]:
        return f"last call failed: {show(turn.calls[-1])} -> {turn.results[-1]}"
    return None


def missing_tool_call(turn, episode):
    """The episode ended early (an agent error, a step or error limit), or a gold action never made is not
    named by any call of the turn."""
    if episode.early_end:
        return f"episode ended early: {episode.early_end}"
    for action in episode.unmatched_actions:
        if all(c["name"] != action.name for c in turn.calls):
            return f"never made gold action {action.name}"
    return None


def response_mismatch(turn, episode):
    """Information the task requires the agent to communicate was not (τ²'s communicate check)."""
    if episode.unmet_info:
        return f"{len(episode.unmet_info)} required piece(s) of information not communicated, e.g. " \
               f"{episode.unmet_info[0]!r}"
    return None


RULES = {  # by label; taxonomy.label tries them in its priority order
    "invalid_tool_call": lambda turn, episode: invalid_tool_call(turn),  # τ²'s executor answers such calls with error=True
    "argument_mismatch": argument_mismatch,
    "state_mismatch": state_mismatch,
    "recovery_failure": recovery_failure,
    "missing_tool_call": missing_tool_call,
    "response_mismatch": response_mismatch,
}


def label_turn(turn, episode):
    """(label, evidence) of one turn of a τ² episode: a pass, or the first rule above that applies."""
    if episode.reward == 1:
        return "pass", line(f"τ² reward 1 ({len(turn.calls)} call(s) in the turn)")
    return taxonomy.label(turn, RULES, episode)


@dataclasses.dataclass
class Turn:
    """One user turn's evidence, as the rules above read it."""

    index: int
    parse_errors: list
    schema_errors: list  # (call, reason) per call that broke the tool schemas
    calls: list
    results: list
    errors: list  # per call: τ²'s error flag on its tool message


@dataclasses.dataclass
class Episode:
    """τ²'s verdict on one episode, as the rules above read it."""

    reward: float
    early_end: str | None  # the termination, when it is not a stop by the user or the agent
    db_match: bool | None
    db_diff: str  # where the database differs from the gold replay (tables and rows)
    failed_assertions: list
    unmatched_actions: list  # gold actions τ²'s action check did not find
    unmet_info: list
    gold: list  # every gold action of the agent

    def matches_gold(self, call):
        from tau2.data_model.message import ToolCall
        tc = ToolCall(id="", name=call["name"], arguments=call["arguments"])
        return any(a.compare_with_tool_call(tc) for a in self.gold)


def turn_evidence(index, turn, schemas):
    """A rollout record's turn as a Turn, its schema verdicts re-derived; RecordError on a structure
    that is not a rollout's (records are not trusted: docs/design.md §3)."""
    try:
        steps = turn["steps"]
        calls = [c for s in steps for c in s["calls"]]
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)
                   for c in calls):
            raise TypeError("a call is not {name, arguments}")
        return Turn(index, [s["parse_error"] for s in steps if s["parse_error"]],
                    [(c, why) for c in calls if (why := calls_api.validate(c, schemas))], calls,
                    [str(r) for s in steps for r in s["results"]],
                    [e is not None for s in steps for e in s["call_errors"]])
    except (KeyError, TypeError, AttributeError) as e:
        raise RecordError(f"turn {index} is not a τ² rollout's turn ({type(e).__name__}: {e})") from None


def diagnose(tau2, domain, task, record):
    """The diagnosis record (docs/design.md §3) of one τ² rollout record: τ²'s own reward, and a
    label and evidence for every user turn (the rules above)."""
    if missing := [k for k in ("transcript", "termination") if k not in record]:
        raise RecordError(f"not a τ² rollout record (no {missing[0]!r}): was it played on BFCL tasks?")
    transcript = messages(record)
    info = verdict(tau2, domain, task, transcript, record["termination"])
    # the schemas the agent was shown are the domain's, not what a record says they were
    turns = [turn_evidence(i, turn, tau2.schemas(domain)) for i, turn in enumerate(record["turns"])]
    crit = task.evaluation_criteria
    gold = [a for a in (crit.actions or []) if a.requestor == "assistant"] if crit else []
    # checks count where the task's reward basis counts them; gold actions always (docs/environments.md §3)
    basis = {getattr(b, "value", b) for b in (crit.reward_basis if crit else [])}
    differs = info.db_check is not None and not info.db_check.db_match and "DB" in basis
    episode = Episode(
        reward=info.reward, db_diff=db_diff(tau2, domain, task, transcript) if differs else "",
        early_end=None if record["termination"] in ("user_stop", "agent_stop")
        else f"{record['termination']}{': ' + record['error'] if record.get('error') else ''}",
        db_match=info.db_check.db_match if info.db_check and "DB" in basis else None,
        failed_assertions=[f"{c.env_assertion.func_name}({c.env_assertion.arguments})"
                           for c in info.env_assertions or [] if not c.met and "ENV_ASSERTION" in basis]
        + [note for note in [(info.info or {}).get("note") or ""] if note.startswith(EVAL_RAISED)],
        unmatched_actions=[c.action for c in info.action_checks or [] if not c.action_match
                           and c.action.requestor == "assistant"],
        unmet_info=[c.info for c in info.communicate_checks or [] if not c.met and "COMMUNICATE" in basis],
        gold=gold)
    # no user turn (the user simulator failed at once): one turn, the episode's
    labelled = [label_turn(t, episode) for t in turns or [Turn(0, [], [], [], [], [])]]
    labels = [z for z, _ in labelled]
    failed = [k for k, v in (info.reward_breakdown or {}).items() if v < 1]
    official = {"valid": info.reward == 1, "reward": info.reward, "termination": record["termination"],
                "error_type": None if info.reward == 1 else (str(getattr(failed[0], "value", failed[0])) if failed
                                                             else record["termination"]),
                "reward_breakdown": {str(getattr(k, "value", k)): v for k, v in (info.reward_breakdown or {}).items()},
                "note": (info.info or {}).get("note")}
    return {"task_id": record["task_id"], "category": record["category"], "sample_index": record["sample_index"],
            "round": record["round"], "reward": info.reward, "official": official, "turn_labels": labels,
            "evidence": [e for _, e in labelled], "profile": profile(labels)}


def db_diff(tau2, domain, task, transcript, limit=4):
    """Where the database after the episode differs from the gold actions' replay, as one short line ("" when
    it does not), read from the two environments τ²'s environment evaluator builds."""
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    built, make = [], tau2.registry.get_env_constructor(domain)

    def recording(**kwargs):  # τ²'s evaluator builds the predicted environment, then the gold one
        built.append(make(**kwargs))
        return built[-1]
    EnvironmentEvaluator.calculate_reward(environment_constructor=recording, task=task, solo_mode=False,
                                          full_trajectory=transcript)
    if len(built) != 2:
        return ""
    diffs = []
    for side in ("tools", "user_tools"):
        made, gold = (getattr(getattr(env, side, None), "db", None) for env in built)
        if made is None or gold is None:
            continue
        made, gold = made.model_dump(mode="json"), gold.model_dump(mode="json")
        for table in sorted(set(made) | set(gold)):
            a, b = made.get(table), gold.get(table)
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict):
                diffs += [f"{table}[{k}] {'added' if k not in b else 'missing' if k not in a else 'changed'}"
                          for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            elif isinstance(a, list) and isinstance(b, list):
                diffs.append(f"{table}: {len(a)} rows, gold {len(b)}" if len(a) != len(b) else f"{table} changed")
            else:
                diffs.append(f"{table} changed")
    more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more


def messages(record):
    """A rollout record's transcript as τ²'s messages; RecordError when it is not one."""
    from pydantic import TypeAdapter, ValidationError
    from tau2.data_model.message import Message

    try:
        return TypeAdapter(list[Message]).validate_python(record["transcript"])
    except ValidationError as e:
        raise RecordError(f"not a τ² transcript: {str(e).splitlines()[0]}") from None


def verdict(tau2, domain, task, transcript, termination):
    """τ²'s own evaluator's RewardInfo of a `transcript` (τ²'s messages), as τ²'s runner scores it."""
    from pydantic import ValidationError
    from tau2.data_model.simulation import SimulationRun

    try:
        sim = SimulationRun(id="seal", task_id=task.id, start_time="", end_time="", duration=0.0,
                            termination_reason=termination, messages=transcript)
    except ValidationError as e:
        raise RecordError(f"not a τ² termination: {str(e).splitlines()[0]}") from None
    try:
        return tau2.evaluate_simulation(simulation=sim, task=task, evaluation_type=tau2.all, solo_mode=False,
                                        domain=domain)
    except ValueError as e:
        if str(e).startswith("Tool call:"):  # τ²'s replay checks every recorded tool result against a fresh run
            raise RecordError(f"the transcript does not replay in τ²'s environment: "
                              f"{' '.join(str(e).split())[:300]}") from None
        # a domain's assertion that raises where its state has no answer: τ²'s runner fails the episode too
        return tau2.RewardInfo(reward=0.0, info={"note": f"{EVAL_RAISED}: {type(e).__name__}: {e}"})
