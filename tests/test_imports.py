"""The modules of common/ import each other one way: no circle, lazy imports inside functions included
(read from the source with ast, so nothing is imported)."""

import ast
import graphlib
import os

COMMON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common")


def modules():
    """Every module of common/ by dotted name (a package by its own name), and its source."""
    out = {}
    for root, _, files in os.walk(COMMON):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(COMMON))[:-3].replace(os.sep, ".")
                with open(os.path.join(root, f), encoding="utf-8") as fh:
                    out[rel.removesuffix(".__init__")] = fh.read()
    return out


def common_imports(source, package):
    """The common modules a source imports, anywhere in it (`from common.x import y` is y where
    common.x.y is a module, else common.x)."""
    known, out = set(modules()) if package is not None else set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "common":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known or package is None else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("common.")}
    return out


def test_the_walker_sees_every_form_of_import():
    source = "import common.a\nfrom common import b, c\ndef f():\n    from common.d import x\n"
    assert common_imports(source, None) == {"common.a", "common.b", "common.c", "common.d.x"}


def test_common_has_no_import_circle_and_lower_layers_import_no_environment():
    mods = modules()
    deps = {name: common_imports(src, name) - {name} for name, src in mods.items()}
    for name, d in deps.items():
        assert d <= set(mods), f"{name} imports no such module {d - set(mods)}"
    # a package's __init__ importing its own modules is no circle; modules importing their package are
    acyclic = {n: {m for m in d if not (m.startswith(n + ".") and n != "common")} for n, d in deps.items()}
    try:
        order = list(graphlib.TopologicalSorter(acyclic).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle in common/: {' -> '.join(e.args[1])}") from None
    # what engines.py and serve.py both need lives below both of them
    assert order.index("common.engine.models") < order.index("common.engine.serve") < order.index("common.engine.engines")
    for name, d in deps.items():
        if name.split(".")[1:2] in (["engine"], ["train"], ["seal"]):
            assert not {m for m in d if m.startswith("common.envs")}, f"{name} imports an environment: {d}"


def test_the_plan_check_and_the_trainers_plumbing_import_without_bfcl_eval():
    """bench/gpu_check.sh measures the memory plan before it installs bfcl-eval on the GPU machine: what
    bench/plan_check.py imports (the GRPO loss, the distributed plumbing, ρ's table) needs none of it."""
    import subprocess
    import sys

    code = """import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "bfcl_eval":
            raise ImportError("bfcl_eval refused: " + name)
sys.meta_path.insert(0, Refuse())
import common.train.grpo, common.train.distributed, common.seal.taxonomy, common.train.memplan
assert "bfcl_eval" not in sys.modules
try:
    import common.envs.bfcl.harness
except ImportError as e:
    print(e)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(COMMON), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("bfcl_eval refused"), res.stdout + res.stderr
