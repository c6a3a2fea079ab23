"""Framework integrations of vattn, one module per framework.

Installed as ``vattn.integrations``; each module imports its framework on
import, so importing ``vattn`` never pulls a framework in.

- ``vattn.integrations.transformers``: :class:`VAttnCache`, a transformers
  ``Cache`` whose K/V live in a vattn cache (``pip install vattn[transformers]``).
"""
