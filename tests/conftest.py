"""Shared pytest fixtures: paths to the build, the default model and the shared data."""
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / os.environ.get("BUILD", "build")
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def root():
    return ROOT


@pytest.fixture(scope="session")
def build_dir():
    return BUILD


@pytest.fixture(scope="session")
def default_model():
    if not DEFAULT_MODEL.exists():
        pytest.fail(f"default model missing: run `make model` ({DEFAULT_MODEL})")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def squad_dir():
    d = SHARED_DATA / "squad2"
    if not (d / "passages.jsonl").exists():
        pytest.fail(f"shared evaluation data missing at {d}")
    return d
