"""What the benchmarks and the tests both run: the vLLM scenario runner
(``vllm_scenario``, a script for the vLLM environment's interpreter), the
tiny checkpoints of the architectures users serve (``vllm_models``), the
openai clients of an API server (``vllm_clients``), and how a scenario run is
started in a fresh process (``vllm_launch``).

A plain package at the repository's root, imported as ``workloads.<module>``:
the tests find it through pytest's ``pythonpath`` (pyproject.toml), the
benchmarks through benchmarks/harness.py, which puts the repository's root on
``sys.path``. It imports vattn and the standard library (and, in the vLLM
environment, vLLM), never tests/ or benchmarks/ (tests/tools/test_layers.py).
"""
