"""Test-wide settings: nothing is fetched from a hub; the shared data folder is found relative to the repo."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Without a GPU, Triton kernels run in its interpreter. The variable must be set before triton is
# first imported (some peer packages import it while tests are collected), so it is set here.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO / ".." / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        raise FileNotFoundError(f"{SHARED_DATA} is missing: tests read ../shared/data beside the checkout")
    return SHARED_DATA
