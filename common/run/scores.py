"""Benchmark scores as BFCL and τ²-bench report them: percent per group, and unweighted means over the
rounded group scores, both to two decimals; shared by evaluate.py and the OOD benches."""


def percent_by_group(results, groups, key, value):
    """{group: 100 x mean of result[value] over the results of that result[key], or None}, in order."""
    values = {g: [r[value] for r in results if r[key] == g] for g in groups}
    return {g: round(100 * sum(v) / len(v), 2) if v else None for g, v in values.items()}


def mean(scores):
    """The unweighted mean of group scores, two decimals; None for no scores."""
    scores = list(scores)
    return round(sum(scores) / len(scores), 2) if scores else None
