"""Test-wide settings: nothing is fetched from a hub; the shared data folder is found relative to the repo."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO / ".." / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        raise FileNotFoundError(f"{SHARED_DATA} is missing: tests read ../shared/data beside the checkout")
    return SHARED_DATA
