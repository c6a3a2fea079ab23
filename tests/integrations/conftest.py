"""The vLLM environment's interpreter (tests/integrations/test_vllm.py's ``vllm_python``) has vattn
installed in editable mode from wherever it was built; its subprocesses here must import this
checkout's vattn (a worktree's, say), so this checkout goes first on their ``PYTHONPATH``."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                    if p and p != ROOT)])
