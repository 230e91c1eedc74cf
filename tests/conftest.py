import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny  # noqa: E402


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
