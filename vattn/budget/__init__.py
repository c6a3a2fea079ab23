"""Machine-wide memory budgets: one limit that managers in several processes
draw physical pages from (:class:`Budget`), how a manager joins one
(:mod:`.membership`), and the ``python -m vattn budget`` / ``top`` commands
(:mod:`.cli`, :mod:`.top`); docs/elastic.md."""

from .budget import Budget, BudgetMember, BudgetUsage, MemberUsage, ProcessUsage, names, remove, resolve_device

__all__ = ["Budget", "BudgetMember", "BudgetUsage", "MemberUsage", "ProcessUsage", "names", "remove",
           "resolve_device"]
