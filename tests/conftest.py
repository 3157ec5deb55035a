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


@pytest.fixture(scope="session")
def tiny_model():
    """Folder of the tiny offline model (built once into <repo>/.cache/tiny-<hash>/, then reused)."""
    from common.tiny import build_cached
    return build_cached()


@pytest.fixture(scope="session")
def tiny_server_state(tiny_model, tmp_path_factory):
    """One vLLM server (common/serve.py, vLLM's own) on the tiny model for the whole session, the
    engine every stage plays through: its state file (url, pid, log). LoRA is on so that adapters
    load into it; its context is the model's, as loop.sh serves it (evaluation asks for that much)."""
    from common import serve
    from common.engines import model_context
    from common.jsonl import write_json
    folder = tmp_path_factory.mktemp("server")
    state = serve.start(tiny_model, str(folder / "server.log"), max_model_len=model_context(tiny_model), seed=0,
                        lora_rank=16)
    path = str(folder / "server.json")
    write_json(path, state)
    yield path
    serve.stop(path)


@pytest.fixture
def tiny_server(tiny_server_state, tiny_model):
    """The session's server URL, serving the tiny model (a test before may have loaded another policy)."""
    from common import serve
    from common.jsonl import read_json
    serve.reload([read_json(tiny_server_state)["url"]], tiny_model, tiny_server_state)
    return read_json(tiny_server_state)["url"]
