"""Shared fixtures. Tests run offline: nothing may reach a model hub."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import pytest  # noqa: E402

# The vLLM servers the suite shares, by fixture name: their settings. Each start is ~45 s of one
# core on 2 cores (two processes importing torch and vLLM, one after the other).
SERVERS = {
    # the engine every stage plays through; LoRA on so that adapters load into it; the model's own
    # context, as loop.sh serves it (evaluation asks for that much)
    "tiny_server_state": {"max_model_len": None, "seed": 0, "lora_rank": 16},
    # another server on another port of this machine: a second host, as far as a stage can tell
    "second_server": {"max_model_len": 16384, "seed": 0},
}
LONG_FIRST = ("test_third_env", "test_mcp")  # a loop of their own, or a dozen real server processes
_spawned = {}  # fixture name -> (state, process) of a server started early, not yet waited for
_WANTED = pytest.StashKey[set]()  # the shared servers the selected tests need


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Modules that play on a shared server run last (in their usual order), and the servers the
    selected tests need start as soon as the tiny model exists (`tiny_model`): their start then
    overlaps the tests before them instead of adding to the suite's time."""
    needs = {}
    for item in items:
        needs.setdefault(item.module, set()).update(n for n in SERVERS if n in item.fixturenames)
    # stable: a module's tests stay together; the long serverless modules first, so that xdist's workers
    # fill the time around them with short ones instead of ending on them
    items.sort(key=lambda item: (bool(needs[item.module]), item.module.__name__ not in LONG_FIRST))
    # An xdist worker collects every test but runs the modules it is sent, which it cannot know
    # here: its servers start when a test first needs them.
    config.stash[_WANTED] = set() if os.environ.get("PYTEST_XDIST_WORKER") else set().union(*needs.values())


@pytest.fixture(scope="module")
def heldin():
    """The held-in tasks (data/heldin.jsonl), as the stages load them (a module's own copy)."""
    from common.envs.bfcl import harness as bfcl
    return bfcl.load_tasks(os.path.join(REPO, "data", "heldin.jsonl"))


@pytest.fixture(scope="module")
def entries():
    """bfcl-eval's own multi-turn entries by id, every category."""
    from bfcl_eval.utils import load_dataset_entry

    from common.envs.bfcl import harness as bfcl
    return {e["id"]: e for cat in bfcl.CATEGORIES for e in load_dataset_entry(f"multi_turn_{cat}")}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def tiny_model(request, tmp_path_factory):
    """Folder of the tiny offline model (built once into <repo>/.cache/tiny-<hash>/, then reused)."""
    from common.engine import serve
    from common.run.tiny import build_cached
    folder = build_cached()
    for name in sorted(request.config.stash.get(_WANTED, set())):
        _spawned[name] = _spawn(folder, name, tmp_path_factory)
        request.addfinalizer(lambda pid=_spawned[name][0]["pid"]: serve.stop_group(pid))  # if never used
    return folder


def _spawn(model, name, tmp_path_factory):
    from common.engine import serve
    from common.engine.models import model_context
    settings = dict(SERVERS[name])
    settings["max_model_len"] = settings["max_model_len"] or model_context(model)
    return serve.spawn(model, str(tmp_path_factory.mktemp(name) / "server.log"), **settings)


def _server(model, name, tmp_path_factory):
    """The state of the shared server `name`, healthy: the one started early, or a new one."""
    from common.engine import serve
    return serve.ready_or_stop(*(_spawned.pop(name, None) or _spawn(model, name, tmp_path_factory)))


@pytest.fixture(scope="session")
def tiny_server_state(tiny_model, tmp_path_factory):
    """The session's vLLM server (common/engine/serve.py, vLLM's own) on the tiny model, the engine every
    stage plays through: its state file (url, pid, log)."""
    from common.engine import serve
    from common.jsonl import write_json
    state = _server(tiny_model, "tiny_server_state", tmp_path_factory)
    path = os.path.join(os.path.dirname(state["log"]), "server.json")
    write_json(path, state)
    yield path
    serve.stop(path)


@pytest.fixture(scope="session")
def second_server(tiny_model, tmp_path_factory):
    """Another server on the tiny model (SERVERS): its state. A test may kill it."""
    from common.engine import serve
    state = _server(tiny_model, "second_server", tmp_path_factory)
    yield state
    serve.stop_group(state["pid"])


@pytest.fixture
def tiny_server(tiny_server_state, tiny_model):
    """The session's server URL, serving the tiny model (a test before may have loaded another policy)."""
    from common.engine import serve
    from common.jsonl import read_json
    serve.reload([read_json(tiny_server_state)["url"]], tiny_model, tiny_server_state)
    return read_json(tiny_server_state)["url"]
