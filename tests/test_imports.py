"""The modules of common/ import each other one way: no circle, lazy imports inside functions included
(read from the source with ast, so nothing is imported)."""

import ast
import graphlib
import os

COMMON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common")


def common_imports(source):
    """The common/ modules a source imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "common":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("common.")}
    return out


def test_the_walker_sees_every_form_of_import():
    source = "import common.a\nfrom common import b, c\ndef f():\n    from common.d import x\n"
    assert common_imports(source) == {"a", "b", "c", "d"}


def test_common_has_no_import_circle():
    names = [f[:-3] for f in os.listdir(COMMON) if f.endswith(".py") and f != "__init__.py"]
    deps = {}
    for name in names:
        with open(os.path.join(COMMON, f"{name}.py"), encoding="utf-8") as f:
            deps[name] = common_imports(f.read()) - {name}
        assert deps[name] <= set(names), f"common/{name}.py imports no such module {deps[name] - set(names)}"
    try:
        order = list(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle in common/: {' -> '.join(e.args[1])}") from None
    # what engines.py and serve.py both need lives below both of them
    assert order.index("models") < order.index("serve") < order.index("engines")


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
import common.grpo, common.distributed, common.taxonomy, common.memplan
assert "bfcl_eval" not in sys.modules
try:
    import common.bfcl
except ImportError as e:
    print(e)
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(COMMON), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("bfcl_eval refused"), res.stdout + res.stderr
