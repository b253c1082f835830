"""This manager's campaign for leadership, and its knowledge of who else leads.

Design: campaign (blocks while another manager leads) → lead until the election says
the lease is lost → step down → campaign again. Taking over starts a new term in the
cluster view: reports from an earlier term are forgotten and every instance gets a
fresh grace to open its load stream to us. An unexpected error anywhere in a term is
logged and ends only the term (step down, resign, campaign again after a backoff).
Alongside, `leader_watch_loop` follows the leader key so a standby can name the leader
in its refusals and forward admin reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from services.common.error_text import typed_error_text
from services.common.backoff import Backoff
from services.common.election import Election, LeaderInfo, LeaderView
from services.manager.cluster_view import ClusterView
from services.manager.leadership import Leader, Leadership

log = structlog.get_logger(__name__)


class Campaign:
    def __init__(self, election: Election, leader_view: LeaderView, leadership: Leadership, view: ClusterView,
                 is_membership_read: Callable[[], bool] = lambda: True) -> None:
        self._election = election
        self._leader_view = leader_view
        self._is_membership_read = is_membership_read  # the etcd membership behind `view` was read at least once
        self._leadership = leadership
        self._view = view

    async def campaign_loop(self) -> None:
        backoff = Backoff(initial_s=0.2, max_s=5.0)
        while True:
            try:
                await self._election.campaign()
                self._take_over()
                await self._election.lost.wait()
                self._step_down()
                backoff.reset()
            except Exception:  # noqa: BLE001 — a failed term must not end the campaign (or the manager)
                log.exception("campaign_failed", manager_id=self._leadership.me.manager_id)
                await self._give_up_term()
                await backoff.sleep()

    async def leader_watch_loop(self) -> None:
        backoff = Backoff(initial_s=0.2, max_s=5.0)
        while True:
            try:
                self._note_leader(self._leader_view.leader)
                await self._leader_view.changed()
                backoff.reset()
            except Exception:  # noqa: BLE001 — e.g. a malformed leader key: keep the last leader, look again
                log.exception("leader_watch_failed")
                await backoff.sleep()

    async def resign(self) -> None:
        """Step down and free the leader key at once, so a standby need not wait for the TTL."""
        self._leadership.set_elected(False)
        with contextlib.suppress(asyncio.CancelledError):
            await self._election.close()

    def _take_over(self) -> None:
        self._view.start_leading(self._is_membership_read())
        self._leadership.set_elected(True)
        log.info("leadership_taken", manager_id=self._leadership.me.manager_id, epoch=self._election.epoch)

    async def _give_up_term(self) -> None:
        """After a failure mid-term: lead no more, and free the key for the next campaign (ours or another's)."""
        self._leadership.set_elected(False)
        try:
            await self._election.resign()
        except Exception as exc:  # noqa: BLE001 — the lease then expires by itself within its TTL
            log.warning("resign_failed", error=typed_error_text(exc))

    def _step_down(self) -> None:
        self._leadership.set_elected(False)
        log.warning("leadership_lost", manager_id=self._leadership.me.manager_id)

    def _note_leader(self, info: LeaderInfo | None) -> None:
        leader = Leader(info.leader_id, info.address) if info else None
        if leader != self._leadership.leader:
            log.info("leader_seen", leader_id=info.leader_id if info else None, address=info.address if info else None)
        self._leadership.set_watched_leader(leader)
