"""What an operator's AdminService.Migrate moves, and where: the checks on the instances it
names (NotFound for unknown ones, FailedPrecondition for a destination that cannot take the
request) and the choices where it names none (the busiest source, the freest destination)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import FailedPrecondition, NotFound
from services.common.ids import check_id
from services.manager.cluster_view import ClusterView
from services.manager.domain import InstanceId, InstanceState, InstanceView, Role
from services.manager.migration import MigrationOrder, MigrationSelection, MigrationTrigger
from services.manager.migration_policies import Peer, destination_order


@dataclass(frozen=True, slots=True)
class AdminOrders:
    view: ClusterView
    peer_of: Callable[[InstanceView], Peer]  # the migration loop's view of an instance as a peer

    def order(self, src_id: str, dst_id: str, request_id: str, selection: MigrationSelection,
              backend: str) -> MigrationOrder:
        """A Migrate order from `src_id` to `dst_id` (empty: the freest other instance with room)."""
        src = self._member(src_id, "source", "src_instance_id")
        dst = self._member(dst_id, "destination", "dst_instance_id") if dst_id else self._freest_other(src)
        if dst.record.instance_id == src.record.instance_id:
            raise FailedPrecondition(f"source and destination are both {src_id}; name another dst_instance_id "
                                     "(ferryctl --dst) or leave it empty for the freest serving instance")
        if dst.state is not InstanceState.SERVING:
            raise FailedPrecondition(f"destination {dst.record.instance_id} is {dst.state.value}; "
                                     "pick a serving instance (see ListInstances)")
        if not src.record.holds_same_model(dst.record):
            raise FailedPrecondition(f"destination {dst.record.instance_id} serves another model than "
                                     f"{src.record.instance_id} (its etcd record names another KV layout, "
                                     "vocabulary or model fingerprint: other weights, such as another fine-tune): "
                                     "requests move only between instances of one model")
        if dst.record.role is Role.PREFILL:
            raise FailedPrecondition(f"destination {dst.record.instance_id} is a prefill instance: it would hand "
                                     "the request straight on to a decode instance; name a decode or mixed "
                                     "instance, or leave dst_instance_id (ferryctl --dst) empty")
        return MigrationOrder(src.record.instance_id, src.record.address, dst.record.instance_id, dst.record.address,
                              MigrationTrigger.ADMIN, selection, request_id=request_id,
                              backend=backend, dst_max_model_len=dst.record.max_model_len)

    def busiest_source(self, dst_id: str = "") -> str:
        """Where an admin Migrate that names no request and no source moves from: the least free
        instance (ties by id) with a request running or waiting, other than `dst_id` (NotFound if that
        names no instance: said before "nothing to migrate", which would send the caller elsewhere)."""
        if dst_id:
            self._member(dst_id, "destination", "dst_instance_id")
        busy = [v for v in self.view.instances() if v.held_load.num_running + v.held_load.num_waiting > 0
                and v.state is not InstanceState.UNHEALTHY and v.record.instance_id != dst_id]
        if not busy:
            raise FailedPrecondition("nothing to migrate: no instance reports a running or waiting request "
                                     "(see ListRequests)")
        return min(busy, key=lambda v: (v.held_load.freeness, v.record.instance_id)).record.instance_id

    def _member(self, instance_id: str, role: str, field: str) -> InstanceView:
        check_id(field, instance_id)
        if not self.view.has_member(instance_id):
            raise NotFound(f"{role} instance {instance_id!r} is not registered; see ListInstances for the ids")
        return self.view.instance(InstanceId(instance_id))

    def _freest_other(self, src: InstanceView) -> InstanceView:
        others = [v for v in self.view.instances() if v.state is InstanceState.SERVING
                  and v.record.instance_id != src.record.instance_id and src.record.holds_same_model(v.record)
                  and Peer.of(v, False).can_receive]
        if not others:
            raise FailedPrecondition(f"no other serving instance has a free KV block, batch slot and migration slot "
                                     f"to take a request from {src.record.instance_id}; start one, undrain one "
                                     "(python -m services.ctl drain ID --undo) or try again when one has room")
        return min(others, key=lambda v: destination_order(self.peer_of(v)))
