"""Each migration counted (metrics) and logged once, whoever ran it and however it ended; apart, what a migration an
earlier term left unknown turned out to be."""

from __future__ import annotations

import structlog

from services.manager import metrics
from services.manager.migration import MigrationOrder, MigrationOutcome, MigrationRecord, SourceBusy

log = structlog.get_logger(__name__)


def account(record: MigrationRecord) -> None:
    """Counted (metrics) and logged: committed with its figures, failed by reason, refused, or unknown."""
    order, figures = record.order, record.figures
    metrics.MIGRATIONS.labels(record.outcome.value, order.trigger.value).inc()
    fields = dict(request_id=figures.request_id, src_instance_id=order.src_instance_id,
                  dst_instance_id=order.dst_instance_id, trigger=order.trigger.value,
                  duration_ms=round(figures.duration_ms, 2))
    if record.outcome is MigrationOutcome.UNKNOWN:
        log.warning("migration_outcome_unknown", reason=record.reason, error=record.message, **fields)
        return
    if record.outcome is MigrationOutcome.REFUSED:  # no fault: not in the failures, logged below a warning
        log.info("migration_refused", reason=record.reason, error=record.message, **fields)
        return
    if not record.is_committed:
        metrics.MIGRATION_FAILURES.labels(record.reason).inc()
        log.warning("migration_failed", reason=record.reason, error=record.message, **fields)
        return
    metrics.MIGRATED_BYTES.inc(figures.num_bytes)
    metrics.MIGRATED_BLOCKS.inc(figures.num_blocks)
    if figures.downtime_ms > 0:  # not known where the source gave no answer
        metrics.MIGRATION_DOWNTIME.observe(figures.downtime_ms / 1e3)
    metrics.MIGRATION_DURATION.observe(figures.duration_ms / 1e3)
    log.info("request_migrated", num_blocks=figures.num_blocks, num_bytes=figures.num_bytes,
             num_stages=figures.num_stages, backend=figures.backend, downtime_ms=round(figures.downtime_ms, 2),
             **fields)


def note_source_busy(order: MigrationOrder, error: SourceBusy) -> None:
    """Counted apart and logged: no failed migration (nothing was tried), no backoff of the pair."""
    metrics.MIGRATIONS_SOURCE_BUSY.labels(order.trigger.value).inc()
    log.info("migration_source_busy", src_instance_id=order.src_instance_id,
             dst_instance_id=order.dst_instance_id, trigger=order.trigger.value, error=error.message)


def account_adopted(record: MigrationRecord) -> None:
    """What a migration an earlier term left unknown turned out to be: counted apart (the earlier leader counted it
    unknown in ferry_manager_migrations_total) and logged."""
    order = record.order
    metrics.MIGRATIONS_ADOPTED.labels(record.outcome.value).inc()
    log.info("migration_adopted_settled", outcome=record.outcome.value, request_id=record.figures.request_id,
             migration_id=record.figures.migration_id, src_instance_id=order.src_instance_id,
             dst_instance_id=order.dst_instance_id, trigger=order.trigger.value, message=record.message)
