"""A scenario's deployment: replicas of the engine on one clock behind a router (and prefill
and decode pools), and :func:`simcap.fleet.run.simulate`, which runs any scenario, one engine
or a fleet."""
