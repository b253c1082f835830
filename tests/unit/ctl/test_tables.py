import dataclasses

from services.ctl.records import (ClusterStatus, DrainResult, InstanceListing, InstanceRow, MigrationRow, RequestList,
                                 RequestRow, to_json)
from services.ctl.tables import (drain_line, host_names, instances_table, listing_table, load_table, migrations_table,
                                policy_table, render_table, requests_table, status_table)


def instance(instance_id="instance-0", free=192, total=256, served=7, free_slots=5, max_num_seqs=8,
             report_age_s=0.05, preemptions=3) -> InstanceRow:
    return InstanceRow(instance_id=instance_id, address="10.0.0.1:50061", role="both", state="serving", model="m",
                       host="h", pid=1, num_running=2, num_waiting=1, num_free_blocks=free, num_total_blocks=total,
                       freeness=42.5, num_requests_served=served, num_dispatched=9, report_age_s=report_age_s,
                       prefix_cache_queried_tokens=400, prefix_cache_hit_tokens=100,
                       num_free_slots=free_slots, max_num_seqs=max_num_seqs, num_preemptions=preemptions)


def test_render_table_aligns_text_left_and_numbers_right():
    text = render_table(("NAME", "N"), [("a", 1), ("long-name", 100)])
    assert text.splitlines() == ["NAME         N", "a            1", "long-name  100"]


def test_a_number_column_with_an_unmeasured_cell_stays_right_aligned():
    """`top`'s REQ/S was left-aligned whenever one row showed `-` (no rate yet)."""
    text = render_table(("NAME", "REQ/S"), [("a", 12.5), ("b", "-")])
    assert text.splitlines() == ["NAME  REQ/S", "a     12.50", "b         -"]


def test_shares_and_counts_of_a_total_are_right_aligned_as_numbers():
    """CACHE HIT (`0.0%`), SLOTS (`64/64`) and KV FREE (`364/364`) were text: left-aligned under their headers, the
    digits of two rows out of line. An IPv4 host name stays text."""
    text = render_table(("HIT", "KV FREE", "HOST"), [("0.0%", "64/364", "10.0.0.1"), ("12.5%", "?/364", "10.0.0.22")])
    assert text.splitlines() == ["  HIT  KV FREE  HOST", " 0.0%   64/364  10.0.0.1", "12.5%    ?/364  10.0.0.22"]


def test_instances_table():
    header, row = instances_table([instance()]).splitlines()
    assert header.split() == ["INSTANCE", "ROLE", "STATE", "RUN", "WAIT", "SLOTS", "KV", "FREE", "FREENESS",
                              "SERVED", "PREEMPT", "CACHE", "HIT", "ADDRESS"]
    assert row.split() == ["instance-0", "both", "serving", "2", "1", "5/8", "192/256", "42.50", "7", "3",
                           "25.0%", "10.0.0.1:50061"]
    assert instances_table([]) == "no instances registered"


def _on_hosts(hosts: list[str]) -> list[InstanceRow]:
    return [dataclasses.replace(instance(f"instance-{i}", free=900, total=1000, served=1234, max_num_seqs=64,
                                         free_slots=60), host=host, address=f"10.0.0.{i // 2 + 1}:50061",
                                num_running=4, num_waiting=12, freeness=123.4) for i, host in enumerate(hosts)]


def test_instances_on_several_hosts_show_each_ones_host():
    """HOST was in --json alone: an operator could not see from the table which machine to look at."""
    rows = _on_hosts([f"gpu-node-{i // 2 + 1}.example.internal" for i in range(12)])
    header, *lines = instances_table(rows).splitlines()
    assert header.split()[-2:] == ["HOST", "ADDRESS"]
    assert [line.split()[-2] for line in lines[::2]] == [f"gpu-node-{n}" for n in range(1, 7)]
    assert max(len(line) for line in [header, *lines]) <= 120


def test_instances_on_one_host_have_no_host_column():
    header, *_ = instances_table(_on_hosts(["gpu-node-1"] * 3)).splitlines()
    assert "HOST" not in header.split()


def test_host_names_stay_whole_where_cutting_them_makes_two_alike():
    assert host_names(_on_hosts(["a.rack1", "a.rack2"])) == ["a.rack1", "a.rack2"]
    assert host_names(_on_hosts(["10.0.0.1", "10.0.0.2"])) == ["10.0.0.1", "10.0.0.2"]
    assert host_names(_on_hosts(["a.rack1", "", "b.rack1"])) == ["a", "?", "b"]  # an older instance does not say
    assert host_names(_on_hosts(["", "a.rack1"])) == []


def test_a_draining_instance_that_is_empty_shows_drained():
    """STATE said `draining` for good once a drain had emptied the instance; only `ferryctl drain ID` said drained."""
    draining = dataclasses.replace(instance("instance-1"), state="draining")
    drained = dataclasses.replace(instance("instance-2"), state="draining", is_drained=True)
    for table in (instances_table, lambda rows: load_table(rows, {})):
        rows = [line.split() for line in table([instance(), draining, drained]).splitlines()[1:]]
        assert [row[2] for row in rows] == ["serving", "draining", "drained"]


def test_slots_show_what_is_not_known_as_a_question_mark():
    """An instance that reported no free slots yet, or an older one without --max-num-seqs in its record."""
    assert instance(free_slots=0).slots == "0/8"
    assert instance(free_slots=None).slots == "?/8"
    assert instance(free_slots=3, max_num_seqs=0).slots == "3/?"


def test_an_instance_not_reported_yet_shows_its_load_as_unknown_not_idle():
    """A leader elected (or restarted) moments ago, or a standby answering alone, has no load report of an
    instance yet: the view's zeros showed a busy cluster as idle (0 running, every block free)."""
    unreported = instance("instance-1", free=256, served=0, free_slots=None, report_age_s=-1.0)
    lines = instances_table([instance(), unreported]).splitlines()
    assert lines[2].split() == ["instance-1", "both", "serving", "?", "?", "?/8", "?/256", "?", "?", "?", "?",
                                "10.0.0.1:50061"]
    assert lines[1].split()[3:5] == ["2", "1"]  # a reported one as before
    top = load_table([unreported], {}).splitlines()[1].split()
    assert top[3:12] == ["?", "?", "?/8", "?", "?", "?", "?", "?", "?"] and top[12:] == ["no", "report"]


def test_status_says_how_many_instances_its_figures_count_as_idle():
    status = ClusterStatus("manager-1", "10.0.0.1:50051", "manager-1", "load", 3, 3, 0, 0, 0, 0, 0, 256.0)
    assert "load unknown" not in status_table(status)
    assert status_table(status, num_unreported=3).splitlines()[-1].split(None, 2)[2] == (
        "3 instances not reported to manager-1 yet: the figures above count them as idle")


def test_status_without_a_leader_says_whose_view_it_is():
    """etcd down past the lease TTL: the manager answering leads no more and gets no load reports, so its
    view has every instance unhealthy; the operator is told why rather than left to believe it."""
    status = ClusterStatus("", "", "manager-0", "load", 3, 0, 0, 3, 4, 0, 0, 0.0)
    lines = status_table(status).splitlines()
    assert lines[0].split() == ["leader", "none", "elected"]
    assert lines[-1].startswith("no leader") and "manager-0's view" in lines[-1] and "etcd unreachable" in lines[-1]
    assert "no leader" not in status_table(dataclasses.replace(status, leader_id="manager-0"))


def test_instances_without_a_leader_say_whose_view_it_is_as_status_does():
    """`instances` showed every instance unhealthy with no word of why while `status` and `top` said no manager
    leads; an older manager, which does not say who answered, gets no note."""
    rows = (dataclasses.replace(instance(), state="unhealthy"),)
    lines = listing_table(InstanceListing(rows, leader_id="", answered_by="manager-0")).splitlines()
    assert len(lines) == 3 and lines[1].split()[2] == "unhealthy"
    status = ClusterStatus("", "", "manager-0", "load", 1, 0, 0, 1, 0, 0, 0, 0.0)
    assert lines[2] == "no leader: " + status_table(status).splitlines()[-1].split(None, 2)[2]
    assert listing_table(InstanceListing(rows, "manager-0", "manager-0")) == instances_table(rows)
    assert listing_table(InstanceListing(rows, "", "")) == instances_table(rows)


def test_instances_answered_by_a_standby_alone_say_it_is_not_the_leaders_view():
    """A standby whose forward to the leader failed (a leader killed moments ago, its key not yet expired) answers
    from its own view, with no load reports: every instance unhealthy, and no word of it before."""
    rows = (dataclasses.replace(instance(), state="unhealthy", report_age_s=-1.0),)
    *_, note = listing_table(InstanceListing(rows, leader_id="manager-0", answered_by="manager-1")).splitlines()
    assert note == ("not the leader's view: manager-1 answered alone (the leader, manager-0, did not in time) and "
                    "gets no load reports, so it counts instances as unhealthy that may well serve")


def test_load_table_draws_a_usage_bar_and_rates():
    text = load_table([instance(free=128)], {"instance-0": 1.5}, {"instance-0": 0.25})
    header, row = text.splitlines()
    assert header.split()[:6] == ["INSTANCE", "ROLE", "STATE", "RUN", "WAIT", "SLOTS"]
    assert header.split()[-6:] == ["FREENESS", "REQ/S", "PREEMPT/S", "SERVED", "REPORT", "AGE"]
    assert row.split()[5] == "5/8" and row.split()[9:12] == ["1.50", "0.25", "7"]
    assert "[#####.....]" in text


def test_load_table_shows_a_rate_not_measured_yet_as_a_dash_not_zero():
    """The first frame (all of `top --iterations 1`) has one sample of each counter: no rate, not 0.00."""
    row = load_table([instance(free=128)], {}).splitlines()[1].split()
    assert row[9:12] == ["-", "-", "7"]


def test_requests_table_names_silent_instances():
    listing = RequestList((RequestRow("r-1", "instance-0", "running", 12, 6),), ("instance-1",))
    lines = requests_table(listing).splitlines()
    assert lines[1].split() == ["r-1", "instance-0", "running", "12", "6"]
    assert lines[-1] == "(no answer from: instance-1)"
    assert requests_table(RequestList((), ())) == "no requests"


def test_status_table_and_drain_line():
    status = ClusterStatus("manager-0", "10.0.0.1:50051", "manager-1", "load", 2, 1, 1, 0, 3, 0, 17, 12.0)
    text = status_table(status)
    assert text.splitlines()[0].split() == ["leader", "manager-0", "(10.0.0.1:50051)"]
    assert "2 (1 serving, 1 draining, 0 unhealthy)" in text
    assert drain_line(DrainResult("instance-1", "draining", False, 3)) == (
        "instance instance-1 is draining: no new requests go to it; 3 requests still on it")
    assert drain_line(DrainResult("instance-1", "draining", False, 1)).endswith("; 1 request still on it")
    assert drain_line(DrainResult("instance-1", "draining", True, 0)) == (
        "instance instance-1 is drained: no new requests go to it, and nothing runs there")
    assert drain_line(DrainResult("instance-9", "unspecified", False, 0)) == (
        "instance instance-9 is not registered; its drain mark is removed, so it takes requests when it comes "
        "back under this id")


def test_policy_and_migrations_tables():
    assert policy_table({"dispatch": "load", "migration_enabled": True}).splitlines() == [
        "dispatch           load", "migration_enabled  true"]
    row = MigrationRow(0.0, "r-1", "i-0", "i-1", "admin", "committed", 4, 1024, 2, "grpc", 12.5, 1.25, "", "")
    header, line = migrations_table([row]).splitlines()
    assert header.split()[:6] == ["STARTED", "REQUEST", "FROM", "TO", "TRIGGER", "OUTCOME"]
    assert line.split()[1:] == ["r-1", "i-0", "i-1", "admin", "committed", "4", "2", "grpc", "12.50", "1.25"]
    assert migrations_table([]) == "no migrations"


def test_the_migrations_table_says_why_one_did_not_commit():
    """Its message was in --json only: a failed or unknown migration showed a status code and no reason."""
    committed = MigrationRow(0.0, "r-1", "i-0", "i-1", "admin", "committed", 4, 1024, 2, "grpc", 12.5, 1.25, "",
                             "the source gave no answer, but the destination holds the request")
    failed = MigrationRow(0.0, "r-2", "i-0", "i-1", "load", "failed", 0, 0, 0, "", 30.0, 0.0, "DEADLINE_EXCEEDED",
                          "not committed: the destination holds the request resumed " + "x" * 200)
    header, first, second = migrations_table([committed, failed]).splitlines()
    assert header.split()[-2:] == ["REASON", "MESSAGE"] and first.split()[-1] == "1.25"
    assert second.endswith("DEADLINE_EXCEEDED  not committed: the destination holds the request resumed "
                           + "x" * 40 + "...")


def test_to_json_flattens_records():
    listing = RequestList((RequestRow("r-1", "i", "running", 3, 1),), ())
    assert to_json(listing) == {"requests": [{"request_id": "r-1", "instance_id": "i", "state": "running",
                                              "num_tokens": 3, "num_output_tokens": 1}],
                                "unreachable_instance_ids": []}
    assert to_json([instance()])[0]["freeness"] == 42.5
