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
