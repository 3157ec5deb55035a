"""Benchmark scores as BFCL and τ²-bench report them: percent per group, and unweighted means,
both to two decimals (means are taken over the rounded group scores, as the leaderboards do).

Held-in (evaluate.py), BFCL V4 memory / web search (ood/memory.py) and τ²-bench
(ood/tau.py) share this core and differ only in what a group without results means; each
caller says so where it builds its table.
"""


def percent_by_group(results, groups, key, value):
    """{group: 100 x mean of result[value] over the results whose result[key] is the group, or
    None where no result falls in the group}, in the order of `groups`."""
    scores = {}
    for g in groups:
        values = [r[value] for r in results if r[key] == g]
        scores[g] = round(100 * sum(values) / len(values), 2) if values else None
    return scores


def mean(scores):
    """The unweighted mean of group scores, two decimals; None for no scores."""
    scores = list(scores)
    return round(sum(scores) / len(scores), 2) if scores else None
