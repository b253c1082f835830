from services.common.scaling_target import ScalingTarget


def test_round_trips_and_refuses_what_is_malformed() -> None:
    target = ScalingTarget(3, draining=["b"], stoppable=["c"], reason="why", manager_id="m-0", updated_at=5.0)
    assert ScalingTarget.from_json(target.to_json()) == target and target.is_decided
    assert not ScalingTarget.from_json({"num_instances": 2}).is_decided  # a launcher's startup target
    for value in (None, [], {"draining": []}, {"num_instances": "many"}):
        assert ScalingTarget.from_json(value) is None
