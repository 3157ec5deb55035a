"""The three score tables (held-in, BFCL V4 memory / web search, τ²-bench) on hand-made results:
percent per group to two decimals, means over the rounded group scores, and each table's own
reading of a group without results."""

from common.envs.bfcl import evaluate, memory
from common.envs.tau2 import tau2 as tau
from common.run.scores import mean, percent_by_group


def rows(key, value, **groups):
    return [{key: g, value: v} for g, vs in groups.items() for v in vs]


def test_core():
    res = rows("g", "v", a=[True, False, False], b=[1.0, 0.5])
    assert percent_by_group(res, ["b", "a", "c"], "g", "v") == {"b": 75.0, "a": 33.33, "c": None}
    assert mean([33.33, 75.0]) == 54.16 and mean([]) is None  # over the rounded scores: 54.165 -> 54.16


def test_held_in_leaves_out_categories_without_tasks():
    res = rows("category", "valid", base=[True, False, False], long_context=[True])
    assert evaluate.category_scores(res) == {"base": 33.33, "long_context": 100.0, "average": 66.66}
    assert list(evaluate.category_scores(res)) == ["base", "long_context", "average"]
    assert evaluate.category_scores([]) == {"average": 0.0}


def test_memory_keeps_categories_not_run_as_none():
    cats = [f"memory_{b}" for b in memory.BACKENDS]
    res = rows("category", "valid", memory_kv=[True, False, False], memory_rec_sum=[True, True])
    assert memory.category_scores(res, cats) == {
        "memory_kv": 33.33, "memory_vector": None, "memory_rec_sum": 100.0, "memory": 66.66,
        "web_search": None, "note": memory.NO_WEB_NOTE}
    assert memory.category_scores([], memory.WEB_CATEGORIES) == {
        "web_search_base": None, "web_search_no_snippet": None, "web_search": None}


def test_tau_scores_a_domain_without_results_zero_in_the_average():
    res = rows("domain", "reward", retail=[1.0, 0.0, 0.0], airline=[0.5])
    assert tau.domain_scores(res, list(tau.DOMAINS)) == {"retail": 33.33, "airline": 50.0, "telecom": 0.0,
                                                         "average": 27.78}
    assert tau.domain_scores(res, ["airline"]) == {"airline": 50.0, "average": 50.0}
