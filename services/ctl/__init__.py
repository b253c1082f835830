"""ferryctl (`python -m services.ctl`): the admin API as readable tables, JSON and a live top view."""
