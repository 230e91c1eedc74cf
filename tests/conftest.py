import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny  # noqa: E402

# One intra-op thread: the tests' models are tiny, so a second thread only adds spin-waits, and
# beside a 2-rank job on 2 cores they stall (test_memorise_then_rollout_reproduces: 118 CPU-s
# with torch's default 2 threads, 20 with one). The subprocesses that load torch set OMP_NUM_THREADS=1.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.make_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    return tiny.make_model(tokenizer)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny model saved as a Hugging Face directory (for CLI tests)."""
    return tiny.save_tiny(tmp_path_factory.mktemp("tiny_model"))
