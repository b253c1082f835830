"""How many migrations, in or out, an instance runs at once (--max-concurrent-migrations).

A slot is taken when a migration starts here (MigrateOut on the source, the first
PrepareMigrateIn on the destination) and given back when it commits or aborts, so a
busy instance refuses at once instead of queueing copies behind each other.
"""

from __future__ import annotations

from services.common.errors import ResourceExhausted


class MigrationSlots:
    def __init__(self, max_concurrent: int) -> None:
        if max_concurrent <= 0:
            raise ValueError(f"--max-concurrent-migrations must be positive, got {max_concurrent}")
        self.max_concurrent = max_concurrent
        self._holders: set[str] = set()  # migration ids holding a slot

    @property
    def num_busy(self) -> int:
        return len(self._holders)

    @property
    def num_free(self) -> int:
        return max(self.max_concurrent - len(self._holders), 0)

    @property
    def has_free(self) -> bool:
        return self.num_free > 0

    def acquire(self, migration_id: str) -> None:
        """Take a slot for `migration_id` (idempotent); ResourceExhausted when all are busy."""
        if migration_id in self._holders:
            return
        if not self.has_free:
            raise ResourceExhausted(
                f"this instance already runs {len(self._holders)} migration(s), the most "
                f"--max-concurrent-migrations {self.max_concurrent} allows; retry later or pick another instance")
        self._holders.add(migration_id)

    def release(self, migration_id: str) -> None:
        self._holders.discard(migration_id)
