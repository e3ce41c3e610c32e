"""Shared pieces of the batch-generation tests (test_batch.py,
test_batch_io.py): the repository root, the environment the CLI runs in (a
private loopback Ray, no token auth), and the tiny target and drafter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from factories import make_models

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    # RAY_AUTH_MODE: a ~/.ray/auth_token left by any earlier `ray start` turns
    # token auth on by default; this private loopback head runs without it.
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false",
               RAY_AUTH_MODE="disabled",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    return env


def batch_models(tmp_path_factory) -> Path:
    """For a module's ``models`` fixture: a tiny random target (with tokenizer
    and chat template) and a tiny drafter."""
    return make_models(tmp_path_factory.mktemp("batch_models"))
