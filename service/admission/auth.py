"""Who is calling: API keys → principal (tenant, role, limits, allowed adapters).

With no key file configured the service runs open: every caller is the `anonymous` tenant with the `admin` role.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: str = "user"  # user | admin
    rate: float | None = None  # tokens/s; None = settings default
    burst: float | None = None
    adapters: frozenset[str] | None = None  # None = any adapter
    key_id: str | None = field(default=None, repr=False)  # short hash prefix for audit, never the key

    def may_use_adapter(self, adapter: str | None) -> bool:
        return adapter is None or self.adapters is None or adapter in self.adapters


ANONYMOUS = Principal(tenant="anonymous", role="admin")
