"""The command line, ``python -m vattn``: ``info``, ``demo`` and the budget
commands (:mod:`vattn.budget.cli`); the entry point is :func:`vattn.cli.main.main`."""
